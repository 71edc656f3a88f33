"""The :class:`PrefetchingSampler`: learner-side batches sampled ahead, updates sent async."""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

from coax_utils._checks import check_float, check_int
from coax_utils.replay import TransitionBatch

__all__ = ["PrefetchingSampler"]


class PrefetchingSampler:
    """Keeps ``num_in_flight`` batches requested ahead so the learner rarely waits.

    A background thread keeps up to ``num_in_flight`` sample requests outstanding: it sends
    them with ``replay.sample_async`` (no waiting), collects the replies in order (its time
    is spent in ``ray.get``, which releases the GIL) and queues the ready batches.
    :meth:`sample` only picks up the oldest ready batch, so as long as a learner step takes
    longer than a sample round trip divided by ``num_in_flight``, the learner does not wait
    for the shards. Requested-but-not-yet-taken batches (in flight or ready) never exceed
    ``num_in_flight``: a batch is drawn before the priority updates of at most the last
    ``num_in_flight`` steps arrived (the usual Ape-X staleness). The default of 4 hides the
    round trip on 2 shared cores, where round trips vary a lot: the learner waited a median
    of 0.002 of a round trip with 4 in flight, 0.004 with 2, 0.79 with 1 (see the
    distributed benchmarks page).

    A sampler that is no longer referenced stops its thread when it is garbage collected,
    as after :meth:`close` (without waiting for its updates); prefer :meth:`close` or a
    ``with`` block, which also raise a failed update's error.

    :meth:`update` sends new priorities without waiting (fire and forget). The background
    thread collects their acknowledgements after each batch, so :meth:`sample` makes no
    round trip of its own; a shard's error is raised by the learner's next call (a dead
    shard raises :class:`ReplayShardError` naming it). At most ``max_pending_updates``
    updates are unacknowledged: beyond that, :meth:`update` waits for the oldest (within
    the replay's ``timeout``).

    Parameters
    ----------
    replay : ShardedReplay
        The replay to sample from (anything with ``sample_async(batch_size, timeout)`` and
        ``update(idx, Adv, wait=False)`` that return :class:`PendingReply`-like objects:
        ``done()`` and ``result(abort=None)``).
    batch_size : int
        Transitions per batch.
    num_in_flight : int, optional
        Batches requested ahead (>= 1; default 4).
    timeout : float, optional
        Passed to ``replay.sample_async`` (the rate limiter's wait); None: no limit.
    max_pending_updates : int
        Unacknowledged :meth:`update` calls allowed (>= 1).

    Examples
    --------
    .. code-block:: python

        with PrefetchingSampler(replay, batch_size=64) as sampler:  # 4 requests in flight
            for step in range(num_steps):
                batch = sampler.sample()
                ...                                # train on it
                sampler.update(batch.idx, td_error)
    """

    def __init__(
        self,
        replay: Any,
        batch_size: int,
        *,
        num_in_flight: int = 4,
        timeout: float | None = None,
        max_pending_updates: int = 8,
    ) -> None:
        for name in ("sample_async", "update"):
            if not callable(getattr(replay, name, None)):
                raise TypeError(
                    f"replay must have sample_async and update methods (a ShardedReplay), got "
                    f"{type(replay).__name__}"
                )
        batch_size = check_int(batch_size, "batch_size", low=1)
        num_in_flight = check_int(num_in_flight, "num_in_flight", low=1)
        self._max_pending = check_int(max_pending_updates, "max_pending_updates", low=1)
        if timeout is not None:
            timeout = check_float(timeout, "timeout", low=0.0)
        self._replay = replay
        # the background thread holds the fetcher, not the sampler: a sampler nobody holds
        # is collected, and its finalizer stops the thread
        self._fetcher = _Fetcher(replay, batch_size, num_in_flight, timeout)
        self._finalizer = weakref.finalize(self, self._fetcher.stop)

    def sample(self) -> TransitionBatch:
        """The next batch (waits only if it has not arrived yet).

        Raises
        ------
        Exception
            The replay's error for this request (e.g. :class:`TimeoutError`,
            :class:`ReplayShardError`) or a failed priority update's; the next call tries
            a new request.
        RuntimeError
            After :meth:`close`.
        """
        f = self._fetcher
        self._check_open()
        f.raise_update_error()
        with f.cond:
            # close() from another thread wakes this wait (the thread then ends unheard)
            f.cond.wait_for(lambda: f.ready or f.closed or not f.thread.is_alive())
            if f.closed:
                raise RuntimeError("the PrefetchingSampler was closed while sample waited")
            if not f.ready:
                raise RuntimeError("the PrefetchingSampler's background thread stopped")
            batch, error = f.ready.popleft()
            f.cond.notify_all()
        if error is not None:
            raise error
        return batch

    def update(self, idx: Any, Adv: Any) -> None:
        """Send new priorities for a sampled batch without waiting for the shards.

        Bad ids or values raise here (checked before anything is sent); a shard's later
        error is raised by a following :meth:`sample`, :meth:`update` or :meth:`close`.
        """
        f = self._fetcher
        self._check_open()
        f.raise_update_error()
        reply = self._replay.update(idx, Adv, wait=False)
        with f.cond:
            f.updates.append(reply)
        f.acknowledge(keep=self._max_pending)
        f.raise_update_error()

    def _check_open(self) -> None:
        if self._fetcher.closed:
            raise RuntimeError("the PrefetchingSampler is closed")

    def close(self) -> None:
        """Wait for the pending priority updates and stop prefetching (idempotent).

        The background thread has ended when this returns, also while its request waits
        without a time limit (``timeout=None``) at the rate limiter. Requests still in
        flight are abandoned: they finish on their own and their batches are dropped (their
        rate-limiter samples stay counted).
        """
        f = self._fetcher
        if f.closed:
            return
        self._finalizer()  # stops the thread
        f.acknowledge(keep=0)
        with f.cond:  # and the one the background thread may be reading
            f.cond.wait_for(lambda: f.acknowledging == 0)
        f.thread.join()
        f.raise_update_error()

    def __enter__(self) -> PrefetchingSampler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _Fetcher:
    """What the background thread of a :class:`PrefetchingSampler` shares with it."""

    def __init__(
        self, replay: Any, batch_size: int, num_in_flight: int, timeout: float | None
    ) -> None:
        self.replay = replay
        self.batch_size = batch_size
        self.num_in_flight = num_in_flight
        self.timeout = timeout
        self.cond = threading.Condition()
        self.ready: collections.deque = collections.deque()  # (batch, error) pairs
        self.updates: collections.deque = collections.deque()  # sent, not acknowledged
        self.errors: collections.deque = collections.deque()  # of acknowledged updates
        self.acknowledging = 0  # updates taken off the queue whose reply is being read
        self.closed = False
        self.thread = threading.Thread(target=self.fetch, name="prefetch", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop prefetching and drop the ready batches (the thread ends after its request)."""
        with self.cond:
            self.closed = True
            self.ready.clear()
            self.cond.notify_all()

    def fetch(self) -> None:
        """The background thread: keep requests in flight, queue their batches in order."""
        pending: collections.deque = collections.deque()
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda: self.closed or pending or len(self.ready) < self.num_in_flight
                )
                if self.closed:
                    return
                room = self.num_in_flight - len(self.ready) - len(pending)
            try:
                for _ in range(room):
                    pending.append(self.replay.sample_async(self.batch_size, self.timeout))
                # abort: stop() ends the wait also while it has no time limit (the limiter)
                item = (pending.popleft().result(abort=lambda: self.closed), None)
            except BaseException as exc:  # handed to the learner by sample()
                item = (None, exc)
            with self.cond:
                if not self.closed:
                    self.ready.append(item)
                self.cond.notify_all()
            self.acknowledge()

    def acknowledge(self, keep: int | None = None) -> None:
        """Collect acknowledgements of sent updates, oldest first, keeping their errors.

        With ``keep=None`` only those that have arrived (the background thread does this
        after each batch, so the learner's calls make no round trips); otherwise wait until
        at most ``keep`` updates are outstanding.
        """
        while True:
            with self.cond:
                if len(self.updates) <= (keep or 0):
                    return
                reply = self.updates[0]
            if keep is None and not reply.done():
                return
            with self.cond:
                if not self.updates or self.updates[0] is not reply:
                    continue  # the other thread took it
                self.updates.popleft()
                self.acknowledging += 1
            error = None
            try:
                reply.result()
            except BaseException as exc:
                error = exc
            with self.cond:
                self.acknowledging -= 1
                if error is not None:
                    self.errors.append(error)
                self.cond.notify_all()

    def raise_update_error(self) -> None:
        """Raise the error of the oldest failed update, if any (once)."""
        with self.cond:
            error = self.errors.popleft() if self.errors else None
        if error is not None:
            raise error
