"""The :class:`RateLimiter` actor: a samples-per-insert ratio held between writers and learner."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

from coax_utils._checks import check_float, check_int
from coax_utils.distributed._actor import RemoteClass

__all__ = ["RateLimiter"]


def _check_timeout(timeout: Any) -> float | None:
    return None if timeout is None else check_float(timeout, "timeout", low=0.0)


def _check_args(min_size_to_sample: int, samples_per_insert: float, error_buffer: float) -> None:
    check_int(min_size_to_sample, "min_size_to_sample", low=1)
    spi = check_float(samples_per_insert, "samples_per_insert", low=0.0, low_open=True)
    eb = check_float(error_buffer, "error_buffer", low=0.0)
    if eb < max(1.0, spi):
        raise ValueError(
            f"error_buffer must be >= max(1, samples_per_insert) = {max(1.0, spi)} so that one "
            f"insert and one sample always fit in the window, got {error_buffer!r}"
        )


class RateLimiter(RemoteClass):
    r"""A Ray actor that holds the ratio of sampled to inserted transitions, as Reverb's.

    Writers ask for permission before they insert ``n`` transitions (:meth:`insert`), the
    learner before it samples ``n`` (:meth:`sample`); each call waits until it is allowed,
    then counts. With :math:`I` the inserts and :math:`S` the samples counted so far,
    :math:`r` = ``samples_per_insert``, :math:`m` = ``min_size_to_sample`` and
    :math:`e` = ``error_buffer``, and the window

    .. math::

        d_\min = r\,m - e\,,\qquad d_\max = r\,m + e\,,

    - a **sample** of ``n`` waits while :math:`I < m`, or while
      :math:`r\,I - (S + n) < d_\min` (sampling ran ahead of the ratio);
    - an **insert** of ``n`` waits while :math:`I + n > m` and
      :math:`r\,(I + n) - S > d_\max` (inserting ran ahead of the ratio), where :math:`I`
      also counts the inserts reserved (:meth:`reserve_inserts`) and not yet confirmed.

    So, once ``min_size_to_sample`` transitions are in, :math:`r\,I - S` stays within
    :math:`r\,m \pm e`: over a run the measured samples per insert :math:`S / I` tends to
    :math:`r`, whatever the speeds of writers and learner. ``samples_per_insert`` counts
    transitions: a learner that samples batches of 64 with ``samples_per_insert=8`` takes
    one batch per 8 inserted transitions. Choose ``error_buffer`` at least as large as
    ``samples_per_insert`` times the writers' batch plus the learner's batch, or a waiting
    insert and a waiting sample can block each other.

    Use it through :class:`ShardedReplay` (``rate_limiter=RateLimiter.remote(...)``): the
    shards ask it before every add (:meth:`reserve_inserts`, counted by
    :meth:`confirm_inserts` once the batch is in the buffer, so a rejected batch never
    lets a sample through), the client before every sample. The class also works
    in-process (without Ray), e.g. with threads.

    Parameters
    ----------
    min_size_to_sample : int
        The number of inserted transitions before the first sample is allowed (>= 1).
    samples_per_insert : float
        The target ratio :math:`r > 0` of sampled to inserted transitions.
    error_buffer : float
        The allowed deviation :math:`e \ge \max(1, r)` of :math:`r\,I - S` from
        :math:`r\,m`.

    Raises
    ------
    TypeError, ValueError
        For bad arguments (raised by ``RateLimiter.remote`` in the calling process).

    Examples
    --------
    >>> limiter = RateLimiter(min_size_to_sample=2, samples_per_insert=1.0, error_buffer=2.0)
    >>> limiter.insert(2)  # allowed: fills up to min_size_to_sample
    >>> limiter.sample(2)  # r I - S = 2 - 2 = 0 >= r m - e = 0: allowed
    >>> limiter.sample(1, timeout=0.01)  # 2 - 3 < 0: sampling would run ahead
    Traceback (most recent call last):
    ...
    TimeoutError: rate limiter: a sample of 1 transitions waited ...
    >>> limiter.insert(1), limiter.sample(1), limiter.counts()
    (None, None, {'inserts': 3, 'samples': 3})
    """

    # Waiting callers hold a thread each, so the actor runs many calls at once.
    _ray_options: ClassVar[dict[str, Any]] = {"max_concurrency": 64, "num_cpus": 0}

    def __init__(
        self, min_size_to_sample: int, samples_per_insert: float, error_buffer: float
    ) -> None:
        _check_args(min_size_to_sample, samples_per_insert, error_buffer)
        self._min_size = int(min_size_to_sample)
        self._spi = float(samples_per_insert)
        self._error_buffer = float(error_buffer)
        self._min_diff = self._spi * self._min_size - self._error_buffer
        self._max_diff = self._spi * self._min_size + self._error_buffer
        self._inserts = 0
        self._reserved = 0  # allowed inserts not yet carried out: invisible to samples
        self._samples = 0
        self._cond = threading.Condition()

    @classmethod
    def _validate_args(cls, *args: Any, **kwargs: Any) -> None:
        _check_args(*args, **kwargs)

    def _can_insert(self, n: int) -> bool:
        inserts = self._inserts + self._reserved + n
        if inserts <= self._min_size:
            return True
        return self._spi * inserts - self._samples <= self._max_diff

    def _can_sample(self, n: int) -> bool:
        if self._inserts < self._min_size:
            return False
        return self._spi * self._inserts - (self._samples + n) >= self._min_diff

    def _wait(self, kind: str, n: Any, timeout: Any) -> None:
        """Wait until ``n`` may be sampled (``kind="sample"``) or inserted (``"insert"``,
        ``"reserved insert"``), then count them."""
        n = check_int(n, "n", low=0)
        timeout = _check_timeout(timeout)
        if kind == "sample":
            allowed, window, what = self._can_sample, float(n), "a sample"
        else:
            allowed, window = self._can_insert, self._spi * n
            what = "an insert" if kind == "insert" else "a reserved insert"
        if window > self._max_diff - self._min_diff:
            raise ValueError(
                f"{what} of {n} transitions can never fit in the rate limiter's window of "
                f"2 * error_buffer = {self._max_diff - self._min_diff}; raise error_buffer or "
                f"use smaller batches"
            )
        tic = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(lambda: allowed(n), timeout):
                raise TimeoutError(
                    f"rate limiter: {what} of {n} transitions waited {time.monotonic() - tic:.3g}"
                    f" s (timeout {timeout} s); {self._describe()}"
                )
            if kind == "insert":
                self._inserts += n
            elif kind == "reserved insert":
                self._reserved += n
            else:
                self._samples += n
            self._cond.notify_all()

    def _describe(self) -> str:
        return (
            f"inserts={self._inserts}, samples={self._samples}, "
            f"reserved inserts={self._reserved}, "
            f"samples_per_insert={self._spi}, min_size_to_sample={self._min_size}, "
            f"error_buffer={self._error_buffer}"
        )

    def insert(self, n: int, timeout: float | None = None) -> None:
        """Wait until ``n`` transitions may be inserted, then count them.

        Parameters
        ----------
        n : int
            The number of transitions about to be inserted (>= 0).
        timeout : float, optional
            Seconds to wait at most (None: no limit).

        Raises
        ------
        TimeoutError
            If the insert was not allowed within ``timeout``; nothing is counted.
        ValueError
            If ``n`` is negative or can never fit in the window.
        """
        self._wait("insert", n, timeout)

    def reserve_inserts(self, n: int, timeout: float | None = None) -> None:
        """Wait like :meth:`insert`, then reserve ``n`` inserts without counting them yet.

        Reserved inserts hold back further inserts as counted ones do, but no sample is
        allowed on their account until :meth:`confirm_inserts` counts them (once they are
        in the buffer); :meth:`release_inserts` drops them (a batch the buffer rejected).
        So an insert that fails never lets a sample run ahead of the ratio.

        Raises
        ------
        TimeoutError
            If the insert was not allowed within ``timeout``; nothing is reserved.
        ValueError
            If ``n`` is negative or can never fit in the window.
        """
        self._wait("reserved insert", n, timeout)

    def confirm_inserts(self, n: int) -> None:
        """Count ``n`` reserved inserts (see :meth:`reserve_inserts`) as carried out.

        Raises
        ------
        ValueError
            If ``n`` is negative or more than the inserts reserved; nothing is changed.
        """
        self._unreserve(n, confirm=True)

    def sample(self, n: int, timeout: float | None = None) -> None:
        """Wait until ``n`` transitions may be sampled, then count them.

        Parameters
        ----------
        n : int
            The number of transitions about to be sampled (the batch size).
        timeout : float, optional
            Seconds to wait at most (None: no limit).

        Raises
        ------
        TimeoutError
            If the sample was not allowed within ``timeout`` (too few transitions, or
            sampling ran ahead of the ratio); nothing is counted.
        ValueError
            If ``n`` is negative or can never fit in the window.
        """
        self._wait("sample", n, timeout)

    def release_inserts(self, n: int) -> None:
        """Drop ``n`` reserved inserts that were not carried out (a rejected batch).

        Raises
        ------
        ValueError
            If ``n`` is negative or more than the inserts reserved; nothing is changed.
        """
        self._unreserve(n, confirm=False)

    def _unreserve(self, n: Any, confirm: bool) -> None:
        n = check_int(n, "n", low=0)
        with self._cond:
            if n > self._reserved:
                what = "confirm" if confirm else "release"
                raise ValueError(f"cannot {what} {n} inserts: only {self._reserved} reserved")
            self._reserved -= n
            if confirm:
                self._inserts += n
            self._cond.notify_all()

    def max_insert(self) -> int:
        r"""The largest number of transitions one insert may carry: ``n`` with
        :math:`r\,n \le 2 e` (a larger one can never fit in the window and is refused).

        :class:`ReplayWriter` refuses a ``chunk_size`` above it before anything is sent.
        """
        window = self._max_diff - self._min_diff
        n = int(window // self._spi)
        # the check of _wait, in floating point (the quotient may round either way)
        while n > 0 and self._spi * n > window:
            n -= 1
        while self._spi * (n + 1) <= window:
            n += 1
        return n

    def counts(self) -> dict[str, int]:
        """The counters: ``{"inserts": I, "samples": S}``."""
        with self._cond:
            return {"inserts": self._inserts, "samples": self._samples}

    def set_counts(self, inserts: int, samples: int) -> None:
        """Replace the counters (used to restore a checkpoint); waiting calls re-check.

        Raises
        ------
        TypeError, ValueError
            If a count is not an int >= 0; nothing is changed.
        """
        inserts = check_int(inserts, "inserts", low=0)
        samples = check_int(samples, "samples", low=0)
        with self._cond:
            self._inserts, self._samples = inserts, samples
            self._cond.notify_all()
