"""What :meth:`ShardedReplay.sample_async` and :meth:`ShardedReplay.update` return: the
replies of shards to one call, collected on demand."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

__all__ = ["PendingReply"]


class PendingReply:
    """The replies of shards (and the rate limiter) to one call, collected on demand.

    :meth:`ShardedReplay.sample_async` and :meth:`ShardedReplay.update` (``wait=False``)
    return one: the requests are on their way, and :meth:`result` waits for them with the
    client's time limits and raises a failed shard's error (naming it) there.
    """

    def __init__(
        self,
        get: Callable[..., Any],
        refs: dict[int | None, Any],
        finish: Callable[[dict[int | None, Any]], Any],
        extra: dict[int | None, float | None] | None = None,
    ) -> None:
        # get(ref, key, extra, abort): one reply, with the caller's time limits and errors
        self._get = get
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
                    key: self._get(ref, key, self._extra.get(key, 0.0), abort)
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
