"""The :class:`PrefetchingSampler`: learner-side batches sampled ahead, updates sent async."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import ray

from coax_utils.replay import TransitionBatch

__all__ = ["PrefetchingSampler"]


def _check_count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


class PrefetchingSampler:
    """Keeps ``num_in_flight`` sample requests in flight so the learner rarely waits.

    Each request runs ``replay.sample(batch_size, timeout)`` on a daemon thread of its own
    (the threads spend their time in ``ray.get``, which releases the GIL). :meth:`sample` hands
    out the oldest request's batch and starts a new request, so as long as a learner step
    takes longer than a sample round trip divided by ``num_in_flight``, the batch is ready
    when the learner asks. A prefetched batch was drawn before the priority updates of the
    last ``num_in_flight`` steps arrived (the usual Ape-X staleness).

    :meth:`update` sends new priorities without waiting; their acknowledgements are
    collected on later calls, which raise a shard's error (e.g. a dead shard) there. At most
    ``max_pending_updates`` updates are unacknowledged: beyond that, the oldest is waited for.

    Parameters
    ----------
    replay : ShardedReplay
        The replay to sample from (anything with ``sample(batch_size, timeout)`` and
        ``update(idx, Adv, wait=False)`` that returns Ray object refs).
    batch_size : int
        Transitions per batch.
    num_in_flight : int
        Sample requests kept in flight (>= 1).
    timeout : float, optional
        Passed to ``replay.sample`` (the rate limiter's wait); None: no limit.
    max_pending_updates : int
        Unacknowledged :meth:`update` calls allowed (>= 1).

    Examples
    --------
    .. code-block:: python

        with PrefetchingSampler(replay, batch_size=64, num_in_flight=2) as sampler:
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
        num_in_flight: int = 2,
        timeout: float | None = None,
        max_pending_updates: int = 8,
    ) -> None:
        for name in ("sample", "update"):
            if not callable(getattr(replay, name, None)):
                raise TypeError(
                    f"replay must have sample and update methods (a ShardedReplay), got "
                    f"{type(replay).__name__}"
                )
        self._batch_size = _check_count("batch_size", batch_size, 1)
        self._num_in_flight = _check_count("num_in_flight", num_in_flight, 1)
        self._max_pending = _check_count("max_pending_updates", max_pending_updates, 1)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.number))
        ):
            raise TypeError(f"timeout must be None or a float >= 0, got {timeout!r}")
        if timeout is not None and not (np.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"timeout must be None or a float >= 0, got {timeout!r}")
        self._replay = replay
        self._timeout = timeout
        self._requests: collections.deque = collections.deque()
        self._updates: collections.deque = collections.deque()
        self._closed = False
        for _ in range(self._num_in_flight):
            self._submit()

    def _submit(self) -> None:
        future: Future = Future()

        def request() -> None:
            try:
                future.set_result(self._replay.sample(self._batch_size, self._timeout))
            except BaseException as exc:  # handed to the learner by sample()
                future.set_exception(exc)

        # a daemon thread per request: one stuck on the rate limiter never blocks exit
        threading.Thread(target=request, name="prefetch", daemon=True).start()
        self._requests.append(future)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the PrefetchingSampler is closed")

    def sample(self) -> TransitionBatch:
        """The next batch (waits only if it has not arrived yet).

        Raises
        ------
        Exception
            The replay's error for this request (e.g. :class:`TimeoutError`,
            :class:`ReplayShardError`); the next call tries a new request.
        RuntimeError
            After :meth:`close`.
        """
        self._check_open()
        self._collect_updates(block=False)
        future = self._requests.popleft()
        self._submit()
        return future.result()

    def update(self, idx: Any, Adv: Any) -> None:
        """Send new priorities for a sampled batch without waiting for the shards.

        Bad ids or values raise here (checked before anything is sent); a shard's later
        error is raised by a following :meth:`sample`, :meth:`update` or :meth:`close`.
        """
        self._check_open()
        self._collect_updates(block=False)
        self._updates.extend(self._replay.update(idx, Adv, wait=False))
        while len(self._updates) > self._max_pending:
            ray.get(self._updates.popleft(), timeout=self._replay_timeout())

    def _replay_timeout(self) -> float | None:
        return getattr(self._replay, "timeout", None)

    def _collect_updates(self, block: bool) -> None:
        if not self._updates:
            return
        refs = list(self._updates)
        if block:
            ray.get(refs, timeout=self._replay_timeout())
            self._updates.clear()
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if done:
            ray.get(done)  # raises a shard's error
            finished = set(done)
            self._updates = collections.deque(r for r in self._updates if r not in finished)

    def close(self) -> None:
        """Wait for the pending priority updates and stop prefetching (idempotent).

        Requests still in flight finish in the background and their batches are dropped
        (their rate-limiter samples stay counted).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._collect_updates(block=True)
        finally:
            self._requests.clear()

    def __enter__(self) -> PrefetchingSampler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
