"""The :class:`ShardedReplay` client: N replay shards on Ray that sample like one buffer."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import ray

from coax_utils.distributed._actor import wait_ready
from coax_utils.distributed._server import ReplayServer
from coax_utils.replay import PrioritizedReplayBuffer, TransitionBatch

__all__ = ["PendingReply", "ReplayShardError", "ShardedReplay"]

_MANIFEST = "sharded_replay.json"
_MANIFEST_VERSION = 3
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHARD_FILE = re.compile(r"shard-([0-9]+)-[0-9a-f]{32}\.lz4")  # shard-<i>-<save token>.lz4


class ReplayShardError(RuntimeError):
    """A replay shard (or the rate limiter) died or stopped answering; the message names it."""


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_timeout(name: str, value: Any, positive: bool = False) -> float | None:
    """None, or a finite float >= 0 (> 0 with ``positive``)."""
    if value is None:
        return None
    what = f"None or a finite float {'>' if positive else '>='} 0"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not (np.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def _sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (hex), read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _kind(buffer: Any) -> tuple[Any, ...]:
    """What the shards of one replay share: the buffer type and, if prioritized, the
    exponents and epsilon that global probabilities and weights depend on."""
    if isinstance(buffer, PrioritizedReplayBuffer):
        return (type(buffer), buffer.alpha, buffer.beta, buffer.epsilon)
    return (type(buffer),)


def _describe_kind(kind: tuple[Any, ...]) -> str:
    if len(kind) == 1:
        return kind[0].__name__
    return f"{kind[0].__name__}(alpha={kind[1]}, beta={kind[2]}, epsilon={kind[3]})"


class _Shard(ReplayServer):
    """A :class:`ReplayServer` whose ``add`` first waits for the rate limiter (if any)."""

    _ray_options: ClassVar[dict[str, Any]] = {"max_concurrency": 16}
    # adds waiting for the rate limiter take threads of their own: however many wait, the
    # samples (whose permits let them go on), updates and counters still find a thread
    _concurrency_groups: ClassVar[dict[str, int] | None] = {"adds": 16}

    def __init__(
        self, buffer: Any, limiter: Any = None, insert_timeout: float | None = None
    ) -> None:
        super().__init__(buffer)
        self._limiter = limiter
        self._insert_timeout = insert_timeout
        self._staged: Any = None  # a checkpoint's buffer, loaded and checked, not yet served

    @classmethod
    def _validate_args(cls, buffer: Any, limiter: Any = None, insert_timeout: Any = None) -> None:
        super()._validate_args(buffer)

    @ray.method(concurrency_group="adds")
    def add(self, transition_batch: TransitionBatch, Adv: Any = None) -> int:
        if self._limiter is None or not isinstance(transition_batch, TransitionBatch):
            return super().add(transition_batch, Adv)
        n = transition_batch.batch_size
        # reserved, not counted: samples see these inserts only once they are in the buffer
        self._ask_limiter(self._limiter.reserve_inserts.remote(n, self._insert_timeout))
        try:
            added = super().add(transition_batch, Adv)
        except BaseException:
            self._ask_limiter(self._limiter.release_inserts.remote(n))
            raise
        self._ask_limiter(self._limiter.confirm_inserts.remote(n))
        return added

    @staticmethod
    def _ask_limiter(ref: Any) -> Any:
        """``ray.get`` a reply of the rate limiter; ReplayShardError naming it if it died."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise ReplayShardError(f"the rate limiter died or is unreachable: {exc}") from None

    def _load(self, path: str | os.PathLike, safe: bool) -> Any:
        """A saved buffer of the kind this shard serves (its siblings serve the same)."""
        buffer = super()._load(path, safe)
        new, old = _kind(buffer), _kind(self._buffer)
        if new != old:
            raise ValueError(
                f"{os.fspath(path)!r} holds a {_describe_kind(new)}; this replay shard serves "
                f"a {_describe_kind(old)} (all shards must hold buffers of one kind)"
            )
        return buffer

    def checkpoint(self, path: str) -> str:
        """:meth:`save` to ``path``; returns the SHA-256 of the file written."""
        return _sha256(self.save(path))

    def stage(self, path: str, sha256: str) -> int:
        """Load and check the checkpoint at ``path`` without serving it yet; its size.

        Raises ValueError if the file's SHA-256 is not ``sha256`` (edited, or saved by
        another checkpoint) or it holds another kind of buffer; the served buffer is
        unchanged either way.
        """
        if _sha256(path) != sha256:
            raise ValueError(
                f"{path!r} is not the file its checkpoint's manifest names (its SHA-256 "
                "differs): it was edited, or written by another save"
            )
        buffer = self._load(path, True)
        with self._lock:
            self._staged = buffer
            return len(buffer)

    def commit_staged(self) -> int:
        """Serve the buffer :meth:`stage` loaded; returns its size."""
        with self._lock:
            if self._staged is None:
                raise RuntimeError("no checkpoint is staged on this replay shard")
            self._buffer, self._staged = self._staged, None
            self._num_added = len(self._buffer)
            return len(self._buffer)

    def drop_staged(self) -> None:
        """Forget the buffer :meth:`stage` loaded (a restore that was refused)."""
        with self._lock:
            self._staged = None

    def sample_share(self, count: int, permit: Any = None) -> dict[str, Any]:
        """Draw ``count`` transitions (none from an empty buffer) with the shard's totals.

        ``permit`` is the rate limiter's reply: passed as an object ref, Ray runs this call
        only once the limiter allowed the sample. Returns :meth:`totals`, plus the keys of
        :meth:`sample_with_priorities` when something was drawn, read under one lock.
        """
        with self._lock:
            if count > 0 and len(self._buffer) > 0:
                return self._sample_with_priorities(count)
            return self._totals()


class PendingReply:
    """The replies of shards (and the rate limiter) to one call, collected on demand.

    :meth:`ShardedReplay.sample_async` and :meth:`ShardedReplay.update` (``wait=False``)
    return one: the requests are on their way, and :meth:`result` waits for them with the
    client's time limits and raises a failed shard's error (naming it) there.
    """

    def __init__(
        self,
        replay: ShardedReplay,
        refs: dict[int | None, Any],
        finish: Callable[[dict[int | None, Any]], Any],
        extra: dict[int | None, float | None] | None = None,
    ) -> None:
        self._replay = replay
        self._refs = refs
        self._finish = finish
        self._extra = extra or {}
        self._outcome: tuple[bool, Any] | None = None  # (ok, result or error) once known

    def done(self) -> bool:
        """Whether every reply has arrived (or failed): :meth:`result` then returns at once."""
        refs = list(self._refs.values())
        if not refs:
            return True
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def result(self, *, abort: Callable[[], bool] | None = None) -> Any:
        """Wait for the replies and return the call's result.

        A later call returns the same result (or raises the same error) again: the replies
        are combined once (a sample's per-shard counts are drawn once).

        Parameters
        ----------
        abort : callable, optional
            Asked at least every 0.1 s while a reply is awaited (the time limits still
            apply); once it returns True the replies are abandoned and RuntimeError is
            raised. A thread waiting without a time limit (e.g. for the rate limiter) can
            thus be told to stop.

        Raises
        ------
        ReplayShardError, TimeoutError
            If a shard (or the limiter) died or did not answer in time.
        RuntimeError
            If ``abort()`` returned True before every reply arrived.
        Exception
            A shard's or the limiter's own error (e.g. the limiter's TimeoutError).
        """
        if self._outcome is None:
            try:
                replies = {
                    key: self._replay._get(ref, key, self._extra.get(key, 0.0), abort)
                    for key, ref in self._refs.items()
                }
                self._outcome = (True, self._finish(replies))
            except Exception as exc:
                self._outcome = (False, exc)
            self._refs = {}  # the replies are no longer needed: Ray may free them
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def _is_total(x: Any) -> bool:
    """Whether ``x`` (read from a manifest) is a finite number >= 0 (JSON ints may be huge)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x) and x >= 0
    except OverflowError:  # an int beyond any float
        return False


def _check_buffers(buffers: Any) -> list[Any]:
    if isinstance(buffers, (str, bytes)) or not isinstance(buffers, Sequence):
        raise TypeError(
            "buffers must be a sequence of host replay buffers, one per shard, got "
            f"{type(buffers).__name__}"
        )
    buffers = list(buffers)
    if not buffers:
        raise ValueError("buffers must hold at least one replay buffer (one per shard)")
    kinds = {type(b) for b in buffers}
    if len(kinds) != 1:
        raise TypeError(
            "all shards must hold buffers of one type, got "
            + ", ".join(sorted(k.__name__ for k in kinds))
        )
    if isinstance(buffers[0], PrioritizedReplayBuffer):
        for name in ("alpha", "beta", "epsilon"):
            values = {getattr(b, name) for b in buffers}
            if len(values) != 1:
                raise ValueError(
                    f"the shards' buffers must share {name} (priorities and weights are "
                    f"compared across shards), got {sorted(values)}"
                )
    for i, b in enumerate(buffers):
        if len(b):
            raise ValueError(f"buffers[{i}] is not empty ({len(b)} transitions); pass empty ones")
    return buffers


class ShardedReplay:
    r"""N replay shards on a Ray cluster behind one client, sampling like one buffer.

    Each shard is a :class:`ReplayServer` actor serving one of ``buffers``, so adds, samples
    and priority updates spread over N processes (and nodes). The client object is cheap to
    pickle: hand it (or one of :attr:`shards`) to every writer and keep one in the learner.

    - **Adds** go to one shard per call: round robin over the shards by default, or the
      shard a writer names (``shard=writer_id % num_shards``, "by writer"; a
      :class:`RolloutWorker` given ``replay.shards[i]`` does the same).
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
        buffers = _check_buffers(buffers)
        if rate_limiter is not None and not isinstance(rate_limiter, ray.actor.ActorHandle):
            raise TypeError(
                f"rate_limiter must be None or a RateLimiter actor handle, got "
                f"{type(rate_limiter).__name__}"
            )
        if seed is not None and not _is_int(seed):
            raise TypeError(f"seed must be None or an int, got {seed!r}")
        # 0 would fail every call before its reply could arrive (and cancel it)
        self.timeout = _check_timeout("timeout", timeout, positive=True)
        insert_timeout = _check_timeout("insert_timeout", insert_timeout)
        if shard_options is not None and not isinstance(shard_options, dict):
            raise TypeError(f"shard_options must be a dict, got {type(shard_options).__name__}")
        options = _Shard.options(**(shard_options or {}))
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
        elif not _is_int(shard) or not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must be an int in [0, {self.num_shards}), got {shard!r}")
        ref = self.shards[shard].add.remote(transition_batch, Adv)
        if not wait:
            return ref
        # an add may wait for the rate limiter first
        extra = 0.0 if self.rate_limiter is None else self._insert_timeout
        return self._get(ref, int(shard), extra)

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
        if not _is_int(batch_size):
            raise TypeError(f"batch_size must be a positive int, got {batch_size!r}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        timeout = _check_timeout("timeout", timeout)
        batch_size = int(batch_size)
        refs: dict[int | None, Any] = {}
        permit = None
        if self.rate_limiter is not None:
            permit = refs[None] = self.rate_limiter.sample.remote(batch_size, timeout)
        with self._rng_lock:
            asked = self._shares(batch_size)
        for i, shard in enumerate(self.shards):
            refs[i] = shard.sample_share.remote(int(asked[i]), permit)
        return PendingReply(
            self, refs, lambda replies: self._combine(batch_size, replies), {None: timeout}
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
        reply = PendingReply(self, dict(refs), lambda replies: None)
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
        round-robin position and the rate limiter's counters) atomically, and removes the
        shard files of earlier saves. A save that fails (e.g. a dead shard) removes what it
        wrote and leaves the earlier checkpoint in the folder as it was.

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
        token = uuid.uuid4().hex
        files = [f"shard-{i}-{token}.lz4" for i in range(self.num_shards)]
        refs = {
            i: s.checkpoint.remote(os.path.join(folder, files[i]))
            for i, s in enumerate(self.shards)
        }
        try:
            digests = self._gather(refs)
            limiter = None
            if self.rate_limiter is not None:
                limiter = self._get(self.rate_limiter.counts.remote(), None)
        except BaseException:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout)
            self._remove_shard_files(folder, keep=())
            raise
        with self._rng_lock:
            rng_state = self._rng.bit_generator.state
            hint = None if self._hint is None else self._hint.tolist()
        manifest = {
            "format": _MANIFEST_VERSION,
            "num_shards": self.num_shards,
            "next_shard": self._next_shard,
            "rng": rng_state,
            "rate_limiter": limiter,
            "hint": hint,
            "files": files,
            "sha256": [digests[i] for i in range(self.num_shards)],
        }
        tmp = os.path.join(folder, _MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, _MANIFEST))
        self._remove_shard_files(folder, keep=files)
        return folder

    @staticmethod
    def _remove_shard_files(folder: str, keep: Sequence[str]) -> None:
        """Remove the shard files in ``folder`` that neither ``keep`` nor the manifest there
        names (best effort)."""
        named: set[str] = set(keep)
        try:
            with open(os.path.join(folder, _MANIFEST)) as f:
                listed = json.load(f).get("files")
            if isinstance(listed, list):
                named.update(x for x in listed if isinstance(x, str))
        except (OSError, ValueError, AttributeError):
            pass
        for name in os.listdir(folder):
            if _SHARD_FILE.fullmatch(name) and name not in named:
                try:
                    os.remove(os.path.join(folder, name))
                except OSError:
                    pass

    def _read_manifest(self, folder: str) -> dict[str, Any]:
        path = os.path.join(folder, _MANIFEST)
        try:
            with open(path) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise ValueError(
                f"{folder!r} holds no ShardedReplay checkpoint ({_MANIFEST})"
            ) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path!r} is corrupted: {exc}") from None
        keys = {
            "format",
            "num_shards",
            "next_shard",
            "rng",
            "rate_limiter",
            "hint",
            "files",
            "sha256",
        }
        if isinstance(manifest, dict) and manifest.get("format", _MANIFEST_VERSION) != (
            _MANIFEST_VERSION
        ):
            raise ValueError(
                f"{path!r} has format {manifest['format']!r}, expected {_MANIFEST_VERSION} "
                "(a checkpoint of another version of this package)"
            )
        if not isinstance(manifest, dict) or set(manifest) != keys:
            raise ValueError(f"{path!r} is not a ShardedReplay manifest (keys {sorted(keys)})")
        if manifest["num_shards"] != self.num_shards:
            raise ValueError(
                f"{folder!r} holds {manifest['num_shards']!r} shards, this replay has "
                f"{self.num_shards}"
            )
        if not _is_int(manifest["next_shard"]) or not 0 <= manifest["next_shard"] < self.num_shards:
            raise ValueError(f"{path!r}: next_shard {manifest['next_shard']!r} is out of range")
        hint = manifest["hint"]
        if hint is not None and not (
            isinstance(hint, list)
            and len(hint) == self.num_shards
            and all(_is_total(t) for t in hint)
        ):
            raise ValueError(f"{path!r}: hint must be null or one finite total >= 0 per shard")
        counts = manifest["rate_limiter"]
        if counts is not None and (
            not isinstance(counts, dict)
            or set(counts) != {"inserts", "samples"}
            or not all(_is_int(c) and c >= 0 for c in counts.values())
        ):
            raise ValueError(
                f"{path!r}: rate_limiter must be null or inserts/samples counts (ints >= 0)"
            )
        digests = manifest["sha256"]
        if not (
            isinstance(digests, list)
            and len(digests) == self.num_shards
            and all(isinstance(d, str) and _SHA256.fullmatch(d) for d in digests)
        ):
            raise ValueError(f"{path!r}: sha256 must hold one hex SHA-256 per shard file")
        if (counts is None) != (self.rate_limiter is None):
            raise ValueError(
                f"{folder!r} was saved {'without' if counts is None else 'with'} a rate "
                f"limiter, this replay has {'one' if self.rate_limiter is not None else 'none'}"
            )
        files = manifest["files"]
        if not (
            isinstance(files, list)
            and len(files) == self.num_shards
            and all(
                isinstance(name, str)
                and (m := _SHARD_FILE.fullmatch(name)) is not None
                and m.group(1) == str(i)
                for i, name in enumerate(files)
            )
        ):
            raise ValueError(f"{path!r}: files must name one shard-<i>-<token>.lz4 per shard")
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise ValueError(f"{folder!r} lacks {name}")
        return manifest

    def restore(self, folder: str | os.PathLike) -> int:
        """Restore every shard and the client's state from a folder written by :meth:`save`.

        The shards' buffers (with their RNG states), the client's RNG and the shards'
        totals it last saw (how much it asks of each shard), the round-robin position and
        the rate limiter's counters continue where they were saved, so the samples that
        follow equal those the saved replay would have drawn.

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
            holds another kind of buffer than the shards serve. Nothing is changed: every
            shard loads and checks its file before any of them serves it.
        ReplayShardError, TimeoutError
            If a shard died or did not answer (before the switch: nothing is changed).
        """
        folder = os.path.abspath(os.fspath(folder))
        manifest = self._read_manifest(folder)
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = manifest["rng"]
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            raise ValueError(f"{folder!r}: bad RNG state in the manifest: {exc}") from None
        staged = {
            i: s.stage.remote(os.path.join(folder, manifest["files"][i]), manifest["sha256"][i])
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
        if manifest["rate_limiter"] is not None:
            counts = manifest["rate_limiter"]
            ref = self.rate_limiter.set_counts.remote(counts["inserts"], counts["samples"])
            self._get(ref, None)
        with self._rng_lock:
            self._rng = rng
            hint = manifest["hint"]
            self._hint = None if hint is None else np.array(hint, np.float64)
        self._next_shard = manifest["next_shard"]
        return int(sum(sizes.values()))
