"""The :class:`ReplayWriter`: transitions buffered client-side into chunks, one Ray call each."""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import ray

from coax_utils._checks import check_float, check_int
from coax_utils.distributed._shard import ReplayShardError
from coax_utils.replay import TransitionBatch

__all__ = ["ReplayWriter"]

_WAIT_SLICE = 0.1  # seconds between the checks of an interruptible wait
_MAX_SEALED = 1  # full chunks held back (besides the one in flight) before add() waits


def _check_timeout(value: Any, name: str) -> float | None:
    return None if value is None else check_float(value, name, low=0.0)


class ReplayWriter:
    r"""Buffers the transitions of one writer into chunks: one Ray call adds a whole chunk.

    :meth:`add` copies the rows of each batch into the open chunk (one preallocated,
    contiguous NumPy array per field, ``chunk_size`` rows) and returns; no Ray call is made
    per batch. A chunk is sent, in one ``add`` call of the server, and added to its buffer in
    one buffer ``add``:

    - as soon as it holds ``chunk_size`` transitions (a batch that does not fit is split
      over two chunks, so no chunk is larger);
    - ``max_delay`` seconds after its first transition was added (a background thread sees
      to it, also while :meth:`add` is not called);
    - on :meth:`flush` (call ``flush(wait=False)`` at the end of an episode, so a finished
      episode is never held back) and :meth:`close`.

    At most one chunk is in flight: the next one is sent once the server acknowledged the
    previous one, so the chunks of a writer are added in order, also by a
    :class:`ShardedReplay` shard (which runs its adds on several threads). Meanwhile
    :meth:`add` keeps filling the next chunk; it waits only when a second full chunk is
    ready before the first was acknowledged (e.g. while a rate limiter holds the adds).

    With a :class:`RateLimiter` behind the server, a chunk counts as ``n`` inserted
    transitions, not one call. ``chunk_size`` must fit in the limiter's window (at most
    :meth:`RateLimiter.max_insert` transitions, checked when the writer is created); for
    writers and learner never to block each other, keep ``error_buffer`` at least
    ``samples_per_insert * chunk_size`` plus the learner's batch size.

    Large arrays travel as Ray allows: a chunk's fields are contiguous arrays, so a chunk
    above Ray's inline limit (100 KiB) is put into the object store once, with the arrays
    as out-of-band buffers, and the server reads them there without a copy before its
    buffer copies them into its storage.

    **What a killed writer loses.** Transitions are *acknowledged* once the server has added
    the chunk that holds them (:attr:`num_acknowledged`; :meth:`flush` and :meth:`close`
    return after every transition added so far is acknowledged). A chunk is added whole
    or not at all (one call, one buffer add). So a writer process that dies at any moment
    loses at most what it added since its last acknowledgement, i.e. its open chunk and the
    chunk in flight: never an acknowledged transition, never part of a chunk, and what
    arrives is, per writer, a prefix of what it added, in order.

    Errors of the server (e.g. the buffer's ValueError for a chunk it rejects, or
    :class:`ReplayShardError` for a server that died) are raised by the next call of
    :meth:`add`, :meth:`flush` or :meth:`close`; the rejected chunk's transitions are dropped
    (they were never acknowledged). :meth:`add` checks every batch against the first one
    the writer took (structure, per-row shapes, dtypes) and ``Adv`` before it copies
    anything, so one bad batch is refused alone and never spoils a chunk.

    A writer is used from the process that created it (it cannot be pickled); its methods
    may be called from several threads.

    Parameters
    ----------
    target : ray.actor.ActorHandle
        A :class:`ReplayServer` actor, or one of :attr:`ShardedReplay.shards` (or use
        :meth:`ShardedReplay.writer`).
    chunk_size : int
        Transitions per chunk (>= 1; at most the rate limiter's
        :meth:`~RateLimiter.max_insert`).
    max_delay : float or None
        Seconds (> 0) a transition waits at most in the open chunk before the chunk is sent;
        None: only full chunks, :meth:`flush` and :meth:`close` send.
    timeout : float or None
        Seconds (>= 0) :meth:`add` waits at most for room (the previous chunk's
        acknowledgement) and the default limit of :meth:`flush` and :meth:`close`; None: no
        limit. Also the limit of the one call the constructor makes (asking the server for
        its largest insert; 60 s when None).
    interrupt : callable, optional
        Asked at least every 0.1 s while :meth:`add`, :meth:`flush` or :meth:`close` wait;
        once it returns True, :meth:`add` returns with its rows taken (they are sent later)
        and :meth:`flush` raises :class:`TimeoutError`. A rollout loop passes its stop flag.

    Raises
    ------
    TypeError, ValueError
        For bad arguments, before anything is sent: a ``target`` that is not a replay
        server's actor handle, or a ``chunk_size`` above the server's rate limiter's
        :meth:`~RateLimiter.max_insert`.
    ReplayShardError
        If the server died (it is asked once, see ``timeout``).

    Examples
    --------
    .. code-block:: python

        with ReplayWriter(server, chunk_size=256, max_delay=1.0) as writer:
            for step in range(num_steps):
                ...
                writer.add(transition_batch)        # no Ray call, unless a chunk is full
                if done:
                    writer.flush(wait=False)        # send the episode's last rows now
        # leaving the block flushes and waits for the server's acknowledgements
    """

    def __init__(
        self,
        target: Any,
        *,
        chunk_size: int = 256,
        max_delay: float | None = 1.0,
        timeout: float | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> None:
        chunk_size = check_int(chunk_size, "chunk_size", low=1)
        if max_delay is not None:
            max_delay = check_float(max_delay, "max_delay", low=0.0, low_open=True)
        timeout = _check_timeout(timeout, "timeout")
        if interrupt is not None and not callable(interrupt):
            raise TypeError(f"interrupt must be None or callable, got {type(interrupt).__name__}")
        if not isinstance(target, ray.actor.ActorHandle) or (
            getattr(target, "insert_limit", None) is None
        ):
            raise TypeError(
                "target must be the actor handle of a ReplayServer (ReplayServer.remote(...)) "
                f"or of a shard of a ShardedReplay (replay.shards[i]), got {target!r:.100}"
            )
        try:
            limit = ray.get(
                target.insert_limit.remote(), timeout=60.0 if timeout is None else timeout
            )
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError("the replay server did not answer the writer in time") from None
        except ray.exceptions.RayActorError as exc:
            raise ReplayShardError(f"the replay server died or is unreachable: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ReplayShardError):  # the shard found its limiter dead
                raise ReplayShardError(str(exc.cause)) from None
            raise
        if limit is not None and chunk_size > limit:
            raise ValueError(
                f"chunk_size must be <= {limit}, the most transitions the server's rate limiter "
                f"lets one insert carry (samples_per_insert * n <= 2 * error_buffer), got "
                f"{chunk_size}; use smaller chunks or raise error_buffer"
            )
        self.chunk_size = chunk_size
        self.max_delay = max_delay
        self.timeout = timeout
        self._interrupt = interrupt
        # the background thread holds the state, not the writer: a writer nobody holds is
        # collected, and its finalizer stops the thread (what was added and not sent is lost)
        self._state = _State(target, chunk_size, max_delay)
        self._finalizer = weakref.finalize(self, self._state.stop)

    def __getstate__(self) -> Any:
        raise TypeError(
            "a ReplayWriter cannot be pickled (it holds a thread and unsent rows); create one "
            "in the process that writes"
        )

    # -- counters ----------------------------------------------------------------------------

    @property
    def num_added(self) -> int:
        """Transitions taken by :meth:`add` so far."""
        return self._state.added

    @property
    def num_acknowledged(self) -> int:
        """Transitions the server has added (whole chunks, acknowledged)."""
        return self._state.acknowledged

    @property
    def num_unacknowledged(self) -> int:
        """Transitions taken and not yet acknowledged (open, full, in flight): at most what
        this process loses if it dies now."""
        s = self._state
        with s.cond:
            return s.added - s.acknowledged - s.dropped

    # -- writing -----------------------------------------------------------------------------

    def add(self, transition_batch: TransitionBatch, Adv: Any = None) -> None:
        """Take the rows of a batch into the open chunk (a copy); send full chunks.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions (leading batch axis on every field). The first batch fixes the
            structure, per-row shapes and dtypes of all that follow.
        Adv : array, optional
            Advantages or TD errors, one per transition, that set the initial priorities (see
            :meth:`ReplayServer.add`). Batches with and without ``Adv`` never share a chunk.

        Raises
        ------
        TypeError, ValueError
            For a batch that is not a TransitionBatch or differs from the first one, or a bad
            ``Adv``: nothing is taken.
        RuntimeError
            After :meth:`close`.
        TimeoutError
            If a full chunk waited longer than ``timeout`` for the previous chunk's
            acknowledgement; the rows are taken (a later call sends them).
        Exception
            An earlier chunk's error (see the class docstring).
        """
        s = self._state
        self._check_open()
        self._raise_error()
        if not isinstance(transition_batch, TransitionBatch):
            raise TypeError(
                "ReplayWriter.add expects a coax_utils.replay.TransitionBatch, got "
                f"{type(transition_batch).__name__}"
            )
        n = transition_batch.batch_size  # checks that every field has the batch's rows
        leaves, treedef = jax.tree_util.tree_flatten(transition_batch)
        leaves = [np.asarray(x) for x in leaves]
        spec = (treedef, tuple((x.shape[1:], x.dtype) for x in leaves))
        adv = None if Adv is None else _check_adv(Adv, n)
        with s.cond:
            if s.spec is None:
                s.spec = spec
            elif spec != s.spec:
                raise _mismatch(s.spec, spec, transition_batch)
            if n == 0:
                return
            s.take(leaves, adv, n)
            s.cond.notify_all()
        self._wait(lambda: len(s.sealed) <= _MAX_SEALED, self.timeout, "room for a full chunk")
        self._raise_error()

    def flush(self, *, wait: bool = True, timeout: float | None = None) -> int:
        """Send the open chunk now; with ``wait``, until every transition is acknowledged.

        Parameters
        ----------
        wait : bool
            Wait for the server's acknowledgement of everything taken so far; False returns
            at once (the background thread sends the chunk once the one in flight is
            acknowledged).
        timeout : float, optional
            Seconds to wait at most; None: the writer's ``timeout``.

        Returns
        -------
        int
            :attr:`num_acknowledged`.

        Raises
        ------
        TimeoutError
            If not everything was acknowledged within the time limit (or ``interrupt``
            said stop); what is left stays on its way, a later call waits on.
        Exception
            A chunk's error (see the class docstring).
        """
        s = self._state
        timeout = self.timeout if timeout is None else _check_timeout(timeout, "timeout")
        self._raise_error()
        with s.cond:
            s.seal()
            s.cond.notify_all()
        if wait:
            done = self._wait(lambda: s.idle(), timeout, "the acknowledgement of every chunk")
            if not done:
                raise TimeoutError(
                    f"{self.num_unacknowledged} transitions were not acknowledged by the "
                    "replay server (interrupted); they stay on their way"
                )
        self._raise_error()
        return s.acknowledged

    def close(self, *, timeout: float | None = None) -> None:
        """Flush, wait for every acknowledgement, and stop the background thread (idempotent).

        The writer is closed also when this raises (e.g. :class:`TimeoutError`, or an
        earlier chunk's error): what was not acknowledged by then may still arrive, or be
        lost.
        """
        if self._state.closed:
            return
        try:
            self.flush(timeout=timeout)
        finally:
            self._finalizer()
            self._state.thread.join()

    def __enter__(self) -> ReplayWriter:
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's error goes on: still send what was taken
            self.close()
        except Exception:
            pass

    # -- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state.closed:
            raise RuntimeError("the ReplayWriter is closed")

    def _raise_error(self) -> None:
        s = self._state
        with s.cond:
            error = s.errors.popleft() if s.errors else None
        if error is not None:
            raise error

    def _wait(self, ready: Callable[[], bool], timeout: float | None, what: str) -> bool:
        """Wait (under the lock, in slices) until ``ready()``; False if ``interrupt`` said
        stop; TimeoutError after ``timeout`` seconds; RuntimeError if the thread ended."""
        s = self._state
        deadline = None if timeout is None else time.monotonic() + timeout
        with s.cond:
            while not (ready() or s.errors):
                if not s.thread.is_alive():
                    raise RuntimeError("the ReplayWriter's background thread stopped")
                if self._interrupt is not None and self._interrupt():
                    return False
                left = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"ReplayWriter: {what} did not come within {timeout} s "
                        f"({s.added - s.acknowledged - s.dropped} transitions unacknowledged)"
                    )
                s.cond.wait(min(left, _WAIT_SLICE))
        return True


def _check_adv(Adv: Any, n: int) -> np.ndarray:
    adv = np.asarray(Adv)
    if adv.dtype.kind not in "biuf":
        raise TypeError(f"Adv must be a numeric array, got dtype {adv.dtype}")
    if adv.shape != (n,):
        raise ValueError(f"Adv must have shape ({n},) (one per transition), got {adv.shape}")
    adv = adv.astype(np.float64)
    if not np.all(np.isfinite(adv)):
        raise ValueError("Adv must be finite (no NaN or inf)")
    return adv


def _mismatch(expected: Any, got: Any, batch: TransitionBatch) -> Exception:
    """The error for a batch whose structure, per-row shapes or dtypes differ from the
    writer's first batch."""
    if expected[0] != got[0]:
        return ValueError(
            "the batch's structure differs from the writer's first batch (fields set, "
            f"containers): {got[0]} != {expected[0]}"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(batch)]
    for path, (shape, dtype), (shape0, dtype0) in zip(paths, got[1], expected[1]):
        if shape != shape0:
            return ValueError(
                f"{path} has per-row shape {shape}; the writer's first batch had {shape0}"
            )
        if dtype != dtype0:
            return TypeError(f"{path} has dtype {dtype}; the writer's first batch had {dtype0}")
    return ValueError("the batch differs from the writer's first batch")


class _State:
    """What a :class:`ReplayWriter` shares with its background thread (all under ``cond``).

    Chunks move open -> sealed (full, or flushed) -> in flight (sent) -> acknowledged; only
    the thread makes Ray calls (sends, and collects acknowledgements).
    """

    def __init__(self, target: Any, chunk_size: int, max_delay: float | None) -> None:
        self.target = target
        self.chunk_size = chunk_size
        self.max_delay = max_delay
        self.cond = threading.Condition()
        self.spec: Any = None  # (treedef, ((row shape, dtype), ...)) of the first batch
        self.arrays: list[np.ndarray] | None = None  # the open chunk, one array per leaf
        self.adv: np.ndarray | None = None
        self.with_adv = False
        self.rows = 0
        self.opened = 0.0  # time.monotonic() of the open chunk's first row
        self.sealed: collections.deque = collections.deque()  # (batch, Adv, n), not sent
        self.in_flight: tuple[Any, int] | None = None  # (ref or None while sending, n)
        self.added = self.acknowledged = self.dropped = 0
        self.errors: collections.deque = collections.deque()
        self.closed = False
        self.thread = threading.Thread(target=self.run, name="replay-writer", daemon=True)
        self.thread.start()

    def take(self, leaves: list[np.ndarray], adv: np.ndarray | None, n: int) -> None:
        """Copy ``n`` checked rows into open chunks, sealing each one that fills up."""
        pos = 0
        while pos < n:
            if self.arrays is not None and self.with_adv != (adv is not None):
                self.seal()  # rows with and without Adv never share a chunk
            if self.arrays is None:
                size = self.chunk_size
                self.arrays = [np.empty((size, *x.shape[1:]), x.dtype) for x in leaves]
                self.with_adv = adv is not None
                self.adv = np.empty(size, np.float64) if self.with_adv else None
                self.rows, self.opened = 0, time.monotonic()
            k = min(n - pos, self.chunk_size - self.rows)
            for a, x in zip(self.arrays, leaves):
                a[self.rows : self.rows + k] = x[pos : pos + k]
            if self.adv is not None:
                self.adv[self.rows : self.rows + k] = adv[pos : pos + k]
            self.rows += k
            pos += k
            self.added += k
            if self.rows == self.chunk_size:
                self.seal()

    def seal(self) -> None:
        """Close the open chunk (if any rows) and queue it to be sent."""
        if self.arrays is None or self.rows == 0:
            return
        k = self.rows
        arrays = [a[:k] for a in self.arrays]  # contiguous: leading rows of C arrays
        batch = self.spec[0].unflatten(arrays)
        self.sealed.append((batch, None if self.adv is None else self.adv[:k], k))
        self.arrays, self.adv, self.rows = None, None, 0

    def idle(self) -> bool:
        """Everything taken is acknowledged (or dropped with an error)."""
        return self.rows == 0 and not self.sealed and self.in_flight is None

    def stop(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def run(self) -> None:
        """The background thread: send sealed chunks one at a time, collect the
        acknowledgements, seal the open chunk ``max_delay`` after its first row."""
        while True:
            with self.cond:
                while True:
                    if self.closed:
                        return
                    if self.in_flight is not None:
                        ref, n = self.in_flight
                        break
                    if self.sealed:
                        batch, adv, n = self.sealed.popleft()
                        self.in_flight, ref = (None, n), None
                        break
                    wait = None
                    if self.rows and self.max_delay is not None:
                        wait = self.opened + self.max_delay - time.monotonic()
                        if wait <= 0:
                            self.seal()
                            continue
                    self.cond.wait(wait)
            if ref is None:  # send outside the lock: serializing a large chunk takes time
                try:
                    ref = self.target.add.remote(batch, adv)
                except BaseException as exc:  # e.g. a batch Ray cannot serialize
                    self.finish(n, exc)
                    continue
                del batch, adv
                with self.cond:
                    self.in_flight = (ref, n)
            if ray.wait([ref], timeout=_WAIT_SLICE)[0]:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    error: BaseException | None = ReplayShardError(
                        f"the replay server the writer adds to died or is unreachable: {exc}"
                    )
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause
                    error = (
                        ReplayShardError(str(cause)) if isinstance(cause, ReplayShardError) else exc
                    )
                except BaseException as exc:
                    error = exc
                else:
                    error = None
                self.finish(n, error)

    def finish(self, n: int, error: BaseException | None) -> None:
        """The chunk in flight of ``n`` rows was acknowledged (or failed with ``error``)."""
        with self.cond:
            self.in_flight = None
            if error is None:
                self.acknowledged += n
            else:
                self.dropped += n
                self.errors.append(error)
            self.cond.notify_all()
