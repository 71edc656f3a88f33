"""The :class:`ShardedReplay` client: N replay shards on Ray that sample like one buffer."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from coax_utils._checks import check_float, check_int, check_seed
from coax_utils.distributed._actor import wait_ready
from coax_utils.distributed._manifest import (
    new_shard_files,
    read_manifest,
    remove_shard_files,
    save_lock,
    write_manifest,
)
from coax_utils.distributed._pending import PendingReply
from coax_utils.distributed._shard import ReplayShard, ReplayShardError, check_buffers
from coax_utils.distributed._writer import ReplayWriter
from coax_utils.replay import TransitionBatch

__all__ = ["PendingReply", "ReplayShardError", "ShardedReplay"]


def _check_timeout(value: Any, name: str, positive: bool = False) -> float | None:
    """None, or a finite float >= 0 (> 0 with ``positive``)."""
    return None if value is None else check_float(value, name, low=0.0, low_open=positive)


class ShardedReplay:
    r"""N replay shards on a Ray cluster behind one client, sampling like one buffer.

    Each shard is a :class:`ReplayServer` actor serving one of ``buffers``, so adds, samples
    and priority updates spread over N processes (and nodes). The client object is cheap to
    pickle: hand it (or one of :attr:`shards`) to every writer and keep one in the learner.

    - **Adds** go to one shard per call: round robin over the shards by default, or the
      shard a writer names (``shard=writer_id % num_shards``, "by writer"; a
      :class:`RolloutWorker` given ``replay.shards[i]`` does the same). A writer that
      buffers its transitions into chunks, one call per chunk, is :meth:`writer`.
    - **Sampling is exact, in one round trip.** Each shard draws a little more than its
      expected share of the batch with its own buffer and replies with its total priority
      :math:`T_s`; the client then draws the number of transitions taken from each shard
      from a multinomial with probabilities :math:`T_s / \sum_r T_r` (its own seeded RNG)
      and keeps that many of each shard's draws (see :meth:`sample_async`). A transition of
      priority :math:`p_i` is thus drawn with probability :math:`p_i / \sum_r T_r`, as from
      one buffer holding everything, and the importance weights use the global size
      :math:`N = \sum_s n_s` and these global probabilities:
      :math:`w_i = (N P(i))^{-\beta} / \max_j (N P(j))^{-\beta}`. A uniform
      :class:`~coax_utils.replay.SimpleReplayBuffer` counts as priority 1 per transition.
      The rows of a batch are grouped by shard.
    - **Ids** encode the shard: ``idx = local_id * num_shards + shard``, so :meth:`update`
      routes each new priority to the shard that owns the transition (and a shard ignores
      ids it overwrote since, as :class:`~coax_utils.replay.PrioritizedReplayBuffer` does).
    - **Rate limiting** (optional): with ``rate_limiter`` (a :class:`RateLimiter` handle),
      every shard's ``add`` waits for the limiter's permission and :meth:`sample` does too,
      so the ratio holds over all shards together.
    - **Failures are named.** Every wait on the cluster has a time limit; a shard (or the
      limiter) that died raises :class:`ReplayShardError` naming it on the next call, one
      that does not answer within ``timeout`` seconds raises :class:`TimeoutError`.

    Parameters
    ----------
    buffers : sequence of host replay buffers
        One empty buffer per shard, e.g.
        ``[PrioritizedReplayBuffer(100_000, random_seed=i) for i in range(4)]`` (give each a
        different seed: their RNGs draw the samples within the shards). They must be of one
        type and, if prioritized, share ``alpha``, ``beta`` and ``epsilon``.
    rate_limiter : ray.actor.ActorHandle, optional
        A :class:`RateLimiter` actor.
    seed : int, optional
        Seed of the client's RNG (the per-shard counts of a sample).
    timeout : float, optional
        Seconds (> 0) a call waits for a shard's reply (beyond any rate-limiter wait)
        before it raises; None waits forever (not advised: a lost node then hangs the
        learner).
    insert_timeout : float, optional
        Seconds a shard's ``add`` waits for the rate limiter before it raises
        :class:`TimeoutError` to the writer (None: no limit).
    shard_options : dict, optional
        Ray actor options for the shards (``num_cpus``, ``resources``,
        ``scheduling_strategy``, ...); by default ``max_concurrency=16``. Adds run on
        16 threads of their own (a Ray concurrency group), so however many adds wait for
        the rate limiter, samples, updates and counters are still served.

    Raises
    ------
    TypeError, ValueError
        For bad arguments, before any actor starts.

    Examples
    --------
    .. code-block:: python

        limiter = RateLimiter.remote(min_size_to_sample=1000, samples_per_insert=4.0,
                                     error_buffer=400.0)
        replay = ShardedReplay(
            [PrioritizedReplayBuffer(50_000, alpha=0.6, beta=0.4, random_seed=i)
             for i in range(2)],
            rate_limiter=limiter, seed=0)
        replay.add(transition_batch, Adv)          # any process; round robin
        batch = replay.sample(64, timeout=30.0)    # the learner
        replay.update(batch.idx, td_error)
    """

    def __init__(
        self,
        buffers: Sequence[Any],
        *,
        rate_limiter: Any = None,
        seed: int | None = None,
        timeout: float | None = 60.0,
        insert_timeout: float | None = None,
        shard_options: dict[str, Any] | None = None,
    ) -> None:
        buffers = check_buffers(buffers)
        if rate_limiter is not None and not isinstance(rate_limiter, ray.actor.ActorHandle):
            raise TypeError(
                f"rate_limiter must be None or a RateLimiter actor handle, got "
                f"{type(rate_limiter).__name__}"
            )
        seed = check_seed(seed, "seed")
        # 0 would fail every call before its reply could arrive (and cancel it)
        self.timeout = _check_timeout(timeout, "timeout", positive=True)
        insert_timeout = _check_timeout(insert_timeout, "insert_timeout")
        if shard_options is not None and not isinstance(shard_options, dict):
            raise TypeError(f"shard_options must be a dict, got {type(shard_options).__name__}")
        options = ReplayShard.options(**(shard_options or {}))
        self.shards: list[Any] = [options.remote(b, rate_limiter, insert_timeout) for b in buffers]
        self.rate_limiter = rate_limiter
        self._insert_timeout = insert_timeout
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._hint: np.ndarray | None = None  # the shards' totals at the last sample
        self._next_shard = 0

    # -- pickling (the lock stays behind) ----------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_rng_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rng_lock = threading.Lock()

    # -- waiting on the cluster --------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        """The number of shards."""
        return len(self.shards)

    def _name(self, shard: int | None) -> str:
        if shard is None:
            return "the rate limiter"
        return f"replay shard {shard} of {self.num_shards}"

    def _get(
        self,
        ref: Any,
        shard: int | None,
        extra: float | None = 0.0,
        abort: Callable[[], bool] | None = None,
    ) -> Any:
        """``ray.get`` one reply with the client's time limit (plus ``extra``; None: none);
        with ``abort``, wait in slices of 0.1 s and raise RuntimeError once it returns True."""
        timeout = None if self.timeout is None or extra is None else self.timeout + extra
        if abort is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            if not wait_ready(ref, deadline, abort) and abort():
                raise RuntimeError(f"the wait for {self._name(shard)} was abandoned")
            # past the deadline: ray.get below raises the TimeoutError
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            raise TimeoutError(f"{self._name(shard)} did not answer within {timeout} s") from None
        except ray.exceptions.RayActorError as exc:
            raise ReplayShardError(f"{self._name(shard)} died or is unreachable: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ReplayShardError):  # a shard found the limiter dead
                raise ReplayShardError(str(exc.cause)) from None
            raise

    def _gather(self, refs: dict[int, Any]) -> dict[int, Any]:
        return {i: self._get(ref, i) for i, ref in refs.items()}

    # -- writers -----------------------------------------------------------------------------

    def add(
        self,
        transition_batch: TransitionBatch,
        Adv: Any = None,
        *,
        shard: int | None = None,
        wait: bool = True,
    ) -> Any:
        """Add a batch of transitions to one shard.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions.
        Adv : array, optional
            Advantages or TD errors that set the initial priorities (see
            :meth:`ReplayServer.add`).
        shard : int, optional
            The shard to add to; None takes the next one, round robin.
        wait : bool
            Wait for the shard's acknowledgement (and the rate limiter's permission) and
            return the number of transitions added; False returns the Ray object ref at once.

        Returns
        -------
        int or ray.ObjectRef
            The number of transitions added, or a ref to it.

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a TransitionBatch (nothing is sent).
        ValueError
            If ``shard`` is out of range, or the shard's buffer rejects the batch.
        ReplayShardError, TimeoutError
            If the shard died or did not answer.
        """
        if not isinstance(transition_batch, TransitionBatch):
            raise TypeError(
                "ShardedReplay.add expects a coax_utils.replay.TransitionBatch, got "
                f"{type(transition_batch).__name__}"
            )
        if shard is None:
            shard = self._next_shard
            self._next_shard = (self._next_shard + 1) % self.num_shards
        else:
            shard = check_int(shard, "shard", low=0, high=self.num_shards - 1)
        ref = self.shards[shard].add.remote(transition_batch, Adv)
        if not wait:
            return ref
        # an add may wait for the rate limiter first
        extra = 0.0 if self.rate_limiter is None else self._insert_timeout
        return self._get(ref, int(shard), extra)

    def writer(
        self,
        shard: int | None = None,
        *,
        chunk_size: int = 256,
        max_delay: float | None = 1.0,
        interrupt: Callable[[], bool] | None = None,
    ) -> ReplayWriter:
        """A :class:`ReplayWriter` into one shard (None: the next one, round robin): adds are
        buffered into chunks of ``chunk_size`` transitions, one call per chunk.

        Its ``timeout`` is this client's (plus ``insert_timeout`` with a rate limiter; None
        if either is None). Raises TypeError/ValueError for bad arguments (a ``chunk_size``
        above the rate limiter's :meth:`~RateLimiter.max_insert` included) before anything
        is sent.
        """
        if shard is None:
            shard = self._next_shard
            self._next_shard = (self._next_shard + 1) % self.num_shards
        else:
            shard = check_int(shard, "shard", low=0, high=self.num_shards - 1)
        extra = 0.0 if self.rate_limiter is None else self._insert_timeout
        timeout = None if self.timeout is None or extra is None else self.timeout + extra
        return ReplayWriter(
            self.shards[shard],
            chunk_size=chunk_size,
            max_delay=max_delay,
            timeout=timeout,
            interrupt=interrupt,
        )

    # -- the learner -------------------------------------------------------------------------

    def sample(self, batch_size: int = 32, timeout: float | None = None) -> TransitionBatch:
        """Sample a batch as one buffer holding all shards' transitions would.

        ``sample(n, timeout)`` is ``sample_async(n, timeout).result()``: one round trip to
        the shards (see :meth:`sample_async`).

        Parameters
        ----------
        batch_size : int
            The number of transitions (drawn with replacement).
        timeout : float, optional
            Seconds to wait at most for the rate limiter's permission (None: no limit).

        Returns
        -------
        TransitionBatch
            With global ``idx`` (pass them to :meth:`update`) and ``W`` (stored weights
            times the global importance weights, largest 1).

        Raises
        ------
        TypeError, ValueError
            For a bad ``batch_size`` or ``timeout``, or if every shard is empty.
        TimeoutError
            If the rate limiter did not allow the sample within ``timeout``.
        ReplayShardError
            If a shard or the limiter died.
        """
        return self.sample_async(batch_size, timeout).result()

    def sample_async(self, batch_size: int = 32, timeout: float | None = None) -> PendingReply:
        r"""Send the requests of a :meth:`sample` and return at once.

        One round trip: every shard :math:`s` draws :math:`m_s` transitions at once, with
        :math:`m_s` the shard's expected share of the batch under the totals it reported
        last, :math:`B q_s`, plus a margin of :math:`3 \sqrt{B q_s (1 - q_s)} + 1` (all
        :math:`B` before the first reply), and sends them back with its current total
        priority and size. The client then draws the per-shard counts :math:`c_s` from a
        multinomial over the *current* totals and keeps the first :math:`c_s` draws of each
        shard. A shard's draws are independent and identically distributed and the counts
        are drawn independently of them, so the batch is distributed exactly as a draw from
        one buffer holding everything. In the rare case that :math:`c_s > m_s` the client
        asks that shard for the missing draws (a second round trip; transitions added to
        that shard in between may be among them, as with any sample taken while writers
        add, and the weights use the totals of the first trip). With a rate limiter,
        its permission is requested in the same round: the shards' calls depend on it and
        run once it is granted.

        Returns
        -------
        PendingReply
            Its :meth:`~PendingReply.result` is the batch :meth:`sample` returns.

        Raises
        ------
        TypeError, ValueError
            For a bad ``batch_size`` or ``timeout`` (nothing is sent).
        """
        batch_size = check_int(batch_size, "batch_size", low=1)
        timeout = _check_timeout(timeout, "timeout")
        refs: dict[int | None, Any] = {}
        permit = None
        if self.rate_limiter is not None:
            permit = refs[None] = self.rate_limiter.sample.remote(batch_size, timeout)
        with self._rng_lock:
            asked = self._shares(batch_size)
        for i, shard in enumerate(self.shards):
            refs[i] = shard.sample_share.remote(int(asked[i]), permit)
        return PendingReply(
            self._get, refs, lambda replies: self._combine(batch_size, replies), {None: timeout}
        )

    def _shares(self, batch_size: int) -> np.ndarray:
        """How many transitions to ask of each shard: its expected share plus a margin."""
        if self._hint is None or not self._hint.sum() > 0:
            return np.full(self.num_shards, batch_size)
        q = self._hint / self._hint.sum()
        spare = 3.0 * np.sqrt(batch_size * q * (1.0 - q)) + 1.0
        return np.minimum(np.ceil(batch_size * q + spare), batch_size).astype(np.int64)

    def _combine(self, batch_size: int, replies: dict[int | None, Any]) -> TransitionBatch:
        """The batch an exact global draw keeps from the shards' replies."""
        infos = [replies[i] for i in range(self.num_shards)]
        T = np.array([info["total"] for info in infos], np.float64)
        if not T.sum() > 0:
            raise ValueError("cannot sample from an empty replay: no shard holds transitions")
        with self._rng_lock:
            self._hint = T
            counts = self._rng.multinomial(batch_size, T / T.sum())
        N = sum(info["size"] for info in infos)
        T_all = float(T.sum())
        pieces = []  # (shard, reply, rows kept)
        for i, (info, k) in enumerate(zip(infos, counts)):
            drawn = info["batch"].batch_size if "batch" in info else 0
            if k > 0 and drawn > 0:
                pieces.append((i, info, min(int(k), drawn)))
            if k > drawn:  # beyond the margin: the missing draws in a second round trip
                more = self._get(self.shards[i].sample_share.remote(int(k - drawn)), i)
                if "batch" not in more:
                    raise ValueError(f"{self._name(i)} emptied while it was sampled")
                pieces.append((i, more, int(k - drawn)))
        batches, weights, stored = [], [], []
        for i, reply, k in pieces:
            batch, p, beta = reply["batch"], reply["priorities"], reply["beta"]
            # undo the shard's own normalisation (over all it drew), keep the first k rows
            local = np.power(reply["size"] * p / reply["total"], -beta)
            stored.append((np.asarray(batch.W, np.float64) * local.max() / local)[:k])
            weights.append(np.power(N * p[:k] / T_all, -beta))
            idx = np.asarray(batch.idx[:k], np.int64) * self.num_shards + i
            batches.append(batch[:k].replace(idx=idx))
        out = TransitionBatch.concatenate(*batches)
        w = np.concatenate(weights)
        W = np.concatenate(stored) * (w / w.max())
        return out.replace(W=W.astype(np.asarray(out.W).dtype))

    def _route(self, idx: Any, Adv: Any) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        idx = np.asarray(idx)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ValueError(f"idx must be a 1-d array of ints, got {idx.dtype}{list(idx.shape)}")
        if idx.size and idx.min() < 0:
            raise ValueError(f"idx must be non-negative transition ids, got {idx.min()}")
        if idx.size and idx.dtype.kind == "u" and idx.max() > np.iinfo(np.int64).max:
            # the cast below would wrap it to a negative id of some other shard
            raise ValueError(f"idx must be transition ids below 2**63, got {idx.max()}")
        adv = np.asarray(Adv)
        if adv.dtype.kind not in "biuf":
            raise TypeError(f"Adv must be a numeric array, got dtype {adv.dtype}")
        if adv.shape != idx.shape:
            raise ValueError(f"Adv must have shape {idx.shape} (one per idx), got {adv.shape}")
        if not np.all(np.isfinite(adv)):
            raise ValueError(f"Adv must be finite (no NaN or inf), got {Adv!r}")
        idx = idx.astype(np.int64)
        owner = idx % self.num_shards
        return {
            int(s): (idx[owner == s] // self.num_shards, adv[owner == s]) for s in np.unique(owner)
        }

    def update(self, idx: Any, Adv: Any, *, wait: bool = True) -> PendingReply | None:
        """Send new priorities of sampled transitions to the shards that own them.

        Parameters
        ----------
        idx : array of int
            The ``idx`` of a batch from :meth:`sample`.
        Adv : array
            The new advantages or TD errors, one per id.
        wait : bool
            Wait until every shard applied its part; False returns a :class:`PendingReply`
            at once (its ``result()`` raises a shard's error).

        Returns
        -------
        None or PendingReply

        Raises
        ------
        TypeError, ValueError
            For ids or values the shards would refuse (checked before anything is sent), or
            a shard's own error.
        ReplayShardError, TimeoutError
            If a shard died or did not answer.
        """
        parts = self._route(idx, Adv)
        refs = {s: self.shards[s].update.remote(i, a) for s, (i, a) in parts.items()}
        reply = PendingReply(self._get, dict(refs), lambda replies: None)
        return reply if not wait else reply.result()

    # -- counters ----------------------------------------------------------------------------

    def totals(self) -> list[dict[str, Any]]:
        """Every shard's :meth:`ReplayServer.totals` (total priority, size, num_added)."""
        replies = self._gather({i: s.totals.remote() for i, s in enumerate(self.shards)})
        return [replies[i] for i in range(self.num_shards)]

    def size(self) -> int:
        """The number of transitions held by all shards together."""
        return sum(t["size"] for t in self.totals())

    def num_added(self) -> int:
        """The number of transitions the shards accepted since they started."""
        return sum(t["num_added"] for t in self.totals())

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike) -> str:
        """Checkpoint every shard and the client's state into ``folder``.

        Each shard writes ``shard-<i>-<token>.lz4`` there with :meth:`ReplayServer.save`
        (on the shard's node: on a multi-node cluster ``folder`` must be shared storage),
        under a name new to this save; the client then writes ``sharded_replay.json`` (the
        files' names and SHA-256, its RNG state, the shards' totals it last saw, the
        round-robin position and the rate limiter's counters), and removes the shard files
        of earlier saves. Every file is written atomically (temp file, fsync, rename, fsync
        of the folder), and the rename of the manifest commits the save: a save killed at
        any point leaves the folder's manifest naming the complete files of either the
        earlier save or this one, never a mix; the other's files are removed by the next
        save. (The files are renamed in place rather than swapped in as a new folder, so
        the folder may hold other files and :meth:`restore` needs no repair step.) A save
        that fails (e.g. a dead shard) removes what it wrote. Saves into one folder hold a
        lock on it (a ``.sharded_replay.lock`` file): a second save waits for the first.

        Parameters
        ----------
        folder : str or path-like
            The folder (created if missing).

        Returns
        -------
        str
            The absolute path of the folder.
        """
        folder = os.path.abspath(os.fspath(folder))
        os.makedirs(folder, exist_ok=True)
        with save_lock(folder):
            files = new_shard_files(self.num_shards)
            refs = {
                i: s.checkpoint.remote(os.path.join(folder, files[i]))
                for i, s in enumerate(self.shards)
            }
            try:
                digests = self._gather(refs)
                limiter = None
                if self.rate_limiter is not None:
                    limiter = self._get(self.rate_limiter.counts.remote(), None)
                with self._rng_lock:
                    rng_state = self._rng.bit_generator.state
                    hint = None if self._hint is None else self._hint.tolist()
                write_manifest(
                    folder,
                    files=files,
                    sha256=[digests[i] for i in range(self.num_shards)],
                    rng_state=rng_state,
                    hint=hint,
                    next_shard=self._next_shard,
                    rate_limiter=limiter,
                )
            except BaseException:
                ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout)
                remove_shard_files(folder, keep=())  # keeps what the manifest there names
                raise
            remove_shard_files(folder, keep=files)
        return folder

    def restore(self, folder: str | os.PathLike) -> int:
        """Restore every shard and the client's state from a folder written by :meth:`save`.

        The shards' buffers (with their RNG states), the client's RNG and the shards'
        totals it last saw (how much it asks of each shard), the round-robin position and
        the rate limiter's counters continue where they were saved, so the samples that
        follow equal those the saved replay would have drawn.

        Each shard reads its file once into memory, checks the SHA-256 of those bytes
        against the manifest and loads the same bytes (with ``safe=True``: plain data
        only), so a file replaced while the restore runs is refused or never read. The
        RNG state goes through the checked constructor of every generator read from disk.
        The restore holds the folder's lock (where it can write the lock file), so no save
        into the folder removes the files it reads.

        Parameters
        ----------
        folder : str or path-like
            A folder written by :meth:`save` for the same number of shards.

        Returns
        -------
        int
            The number of transitions held after the restore.

        Raises
        ------
        ValueError
            If the manifest is missing, corrupted or made for another number of shards or
            for a replay with(out) a rate limiter, or a shard file is missing, edited,
            written by another save (its SHA-256 differs from the manifest's), corrupted or
            holds another kind of buffer than the shards serve. A manifest or shard file
            that lies raises :class:`~coax_utils.utils.CheckpointDamagedError`. Nothing is
            changed: every shard loads and checks its file before any of them serves it.
        ReplayShardError, TimeoutError
            If a shard died or did not answer (before the switch: nothing is changed).
        """
        folder = os.path.abspath(os.fspath(folder))
        with save_lock(folder, reading=True):
            manifest = read_manifest(folder, self.num_shards, self.rate_limiter is not None)
            staged = {
                i: s.stage.remote(os.path.join(folder, manifest.files[i]), manifest.sha256[i])
                for i, s in enumerate(self.shards)
            }
            try:
                self._gather(staged)
            except BaseException:
                for shard in self.shards:  # best effort: a dead shard holds nothing anyway
                    shard.drop_staged.remote()
                raise
        # every file is loaded and checked: switch all shards
        sizes = self._gather({i: s.commit_staged.remote() for i, s in enumerate(self.shards)})
        if manifest.rate_limiter is not None:
            counts = manifest.rate_limiter
            ref = self.rate_limiter.set_counts.remote(counts["inserts"], counts["samples"])
            self._get(ref, None)
        with self._rng_lock:
            self._rng = manifest.rng
            self._hint = manifest.hint
        self._next_shard = manifest.next_shard
        return int(sum(sizes.values()))
