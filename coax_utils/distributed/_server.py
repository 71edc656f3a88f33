"""The :class:`ReplayServer` actor: one host replay buffer shared by many writers."""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

from coax_utils.distributed._actor import RemoteClass
from coax_utils.replay import TransitionBatch

__all__ = ["ReplayServer"]

_BUFFER_METHODS = ("add", "sample", "__len__")


def _check_buffer(buffer: Any) -> None:
    if isinstance(buffer, type):  # its methods are callable too, but it holds nothing
        raise TypeError(
            f"ReplayServer needs a host replay buffer instance, got the class "
            f"{buffer.__name__}; pass e.g. {buffer.__name__}(capacity=...)"
        )
    missing = [name for name in _BUFFER_METHODS if not callable(getattr(buffer, name, None))]
    if missing:
        raise TypeError(
            "ReplayServer needs a host replay buffer (e.g. coax_utils.replay."
            "PrioritizedReplayBuffer) with methods add, sample and __len__; got "
            f"{type(buffer).__name__} without {', '.join(missing)}"
        )


class ReplayServer(RemoteClass):
    r"""A Ray actor that serves one host replay buffer to many writers and a learner.

    Start it with ``ReplayServer.remote(buffer)``: the buffer (e.g. a
    :class:`coax_utils.replay.PrioritizedReplayBuffer` or
    :class:`coax_utils.replay.SimpleReplayBuffer`) is copied into the actor's process and
    every method call runs there, one at a time. Rollout workers (any number of Ray tasks or
    actors, e.g. :class:`RolloutWorker`) call ``add``; the learner calls ``sample`` and
    ``update``. This is the replay side of Ape-X (Horgan et al., 2018).

    Guarantees:

    - **Nothing is lost.** Calls are serialized (a lock guards the buffer, also when the
      actor is started with ``max_concurrency > 1``). Every accepted ``add`` is counted in
      :meth:`num_added` and its transitions are either in the buffer or were evicted by the
      buffer's ring (oldest first), never dropped.
    - **Writers are independent.** A Ray call arrives whole or not at all, so a writer that
      dies (or is killed with ``ray.kill``) leaves the server and the other writers as they
      were.
    - **Bad input is rejected, nothing is written.** A batch whose structure, shapes or
      dtypes differ from what the buffer holds raises the buffer's own ValueError/TypeError;
      through Ray it arrives as a ``ray.exceptions.RayTaskError`` that is also an instance of
      the original error type, so ``except ValueError`` works on ``ray.get``.

    Writers keep adding between the learner's ``sample`` and the matching ``update``, so a
    sampled transition may have been evicted when its new priority arrives. The ``idx`` of a
    :class:`~coax_utils.replay.PrioritizedReplayBuffer` are transition ids, not slots, and
    its ``update`` ignores ids that were overwritten, so late priorities never land on
    newer transitions.

    By default the actor runs one call at a time, in the order each caller submitted them,
    so a writer's batches enter the ring in order. Under heavy writing,
    ``ReplayServer.options(max_concurrency=4).remote(buffer)`` lets Ray receive calls on
    several threads (the lock still applies them one at a time), which shortens the
    learner's wait for ``sample`` (see the benchmarks page); the batches of one writer may
    then be applied out of order.

    Parameters
    ----------
    buffer : host replay buffer
        The buffer to serve; it needs ``add(transition_batch[, Adv])``, ``sample(batch_size)``
        and ``len(buffer)``, plus ``update(idx, Adv)`` for :meth:`update`.

    Raises
    ------
    TypeError
        If ``buffer`` is a class rather than a buffer, or lacks ``add``, ``sample`` or
        ``__len__`` (raised by ``ReplayServer.remote`` in the calling process).

    Examples
    --------
    .. code-block:: python

        import ray
        from coax_utils.distributed import ReplayServer
        from coax_utils.replay import PrioritizedReplayBuffer

        ray.init()
        server = ReplayServer.remote(PrioritizedReplayBuffer(capacity=100_000))
        server.add.remote(transition_batch)          # from any number of writers
        batch = ray.get(server.sample.remote(32))    # in the learner
        server.update.remote(batch.idx, td_error)

    The class also works in-process, without Ray (e.g. in unit tests):

    >>> from coax_utils.replay import SimpleReplayBuffer, TransitionBatch
    >>> server = ReplayServer(SimpleReplayBuffer(capacity=2))
    >>> one = TransitionBatch.from_single(s=0, a=0, logp=0.0, r=1.0, done=False, gamma=0.9)
    >>> [server.add(one) for _ in range(3)]
    [1, 1, 1]
    >>> server.num_added(), server.size()  # the ring evicted the oldest transition
    (3, 2)
    """

    def __init__(self, buffer: Any) -> None:
        _check_buffer(buffer)
        # Ray hands over NumPy arrays as read-only views of its object store: own a copy.
        self._buffer = copy.deepcopy(buffer)
        self._lock = threading.Lock()
        # the transitions the buffer already holds count as added: size() equals
        # min(num_added(), capacity) from the start
        self._num_added = len(self._buffer)

    @classmethod
    def _validate_args(cls, buffer: Any) -> None:
        _check_buffer(buffer)

    def add(self, transition_batch: TransitionBatch, Adv: Any = None) -> int:
        """Add a batch of transitions to the buffer.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions (leading batch axis on every field).
        Adv : array, optional
            Per-transition advantages or TD errors that set the initial priorities of a
            prioritized buffer; None gives the buffer's default (its current maximum
            priority).

        Returns
        -------
        int
            The number of transitions added (``transition_batch.batch_size``).

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a :class:`~coax_utils.replay.TransitionBatch`, or
            the buffer's TypeError.
        ValueError
            The buffer's ValueError (e.g. shapes or dtypes that differ from those it holds).
            Nothing is written and nothing is counted.
        """
        if not isinstance(transition_batch, TransitionBatch):
            raise TypeError(
                "ReplayServer.add expects a coax_utils.replay.TransitionBatch, got "
                f"{type(transition_batch).__name__}"
            )
        n = transition_batch.batch_size
        with self._lock:
            if Adv is None:
                self._buffer.add(transition_batch)
            else:
                self._buffer.add(transition_batch, Adv)
            self._num_added += n
        return n

    def sample(self, batch_size: int = 32) -> TransitionBatch:
        """Sample a batch from the buffer (with ``idx`` and, if prioritized, ``W``).

        Parameters
        ----------
        batch_size : int
            The number of transitions to sample.

        Returns
        -------
        TransitionBatch
            The sampled transitions; ``idx`` is what :meth:`update` takes.

        Raises
        ------
        ValueError
            The buffer's error, e.g. for a non-positive ``batch_size`` or an empty buffer.
        """
        with self._lock:
            return self._buffer.sample(batch_size)

    def update(self, idx: Any, Adv: Any) -> None:
        """Update the priorities of sampled transitions (prioritized buffers).

        Parameters
        ----------
        idx : array of int
            The ``idx`` field of a batch returned by :meth:`sample`.
        Adv : array
            New advantages or TD errors, one per index.

        Raises
        ------
        TypeError
            If the buffer has no priorities (no ``update`` method).
        ValueError
            The buffer's error for bad indices or values; nothing is changed.
        """
        update = getattr(self._buffer, "update", None)
        if not callable(update):
            raise TypeError(
                f"the served buffer ({type(self._buffer).__name__}) has no priorities to "
                "update; serve a PrioritizedReplayBuffer to call update"
            )
        with self._lock:
            update(idx, Adv)

    def size(self) -> int:
        """The number of transitions now held by the buffer (``len(buffer)``)."""
        with self._lock:
            return len(self._buffer)

    def totals(self) -> dict[str, Any]:
        """What a sharded client needs to split a sample across shards, in one call.

        Returns
        -------
        dict
            ``total`` (the sum of the priorities of the held transitions; their number for a
            buffer without priorities), ``size`` (``len(buffer)``) and ``num_added`` (see
            :meth:`num_added`).
        """
        with self._lock:
            return self._totals()

    def sample_with_priorities(self, batch_size: int) -> dict[str, Any]:
        """Sample like :meth:`sample`, and return what global importance weights need.

        Returns
        -------
        dict
            ``batch`` (as :meth:`sample` returns it), ``priorities`` (float64, the priority
            of each sampled transition at sampling time; 1 for a buffer without
            priorities), ``beta`` (the buffer's importance-weight exponent; 0 without
            priorities) and the ``total``, ``size`` and ``num_added`` of :meth:`totals`, all
            read under one lock so they describe the distribution the batch came from.
        """
        with self._lock:
            return self._sample_with_priorities(batch_size)

    def _sample_with_priorities(self, batch_size: int) -> dict[str, Any]:
        """:meth:`sample_with_priorities` for a caller that holds the lock."""
        import numpy as np

        batch = self._buffer.sample(batch_size)
        info = self._totals()
        if self._prioritized():
            info["priorities"] = self._buffer.priorities(batch.idx)
            info["beta"] = float(self._buffer.beta)
        else:
            info["priorities"] = np.ones(batch.batch_size)
            info["beta"] = 0.0
        info["batch"] = batch
        return info

    def _prioritized(self) -> bool:
        from coax_utils.replay import PrioritizedReplayBuffer

        return isinstance(self._buffer, PrioritizedReplayBuffer)

    def _totals(self) -> dict[str, Any]:
        size = len(self._buffer)
        total = self._buffer.total_priority if self._prioritized() else float(size)
        return {"total": total, "size": size, "num_added": self._num_added}

    def insert_limit(self) -> int | None:
        """The largest batch one :meth:`add` may carry (None: no limit).

        A plain server has none; a shard of a :class:`ShardedReplay` with a rate limiter
        answers the limiter's :meth:`RateLimiter.max_insert`. :class:`ReplayWriter` asks it
        once, so a chunk that could never be added is refused before anything is sent.
        """
        return None

    def num_added(self) -> int:
        """The number of transitions the buffer held when the server started (or was last
        restored) plus those accepted by :meth:`add` since.

        Transitions stored beyond the buffer's capacity evicted the oldest ones, so
        ``size() == min(num_added(), capacity)`` always: a rejected :meth:`add` writes and
        counts nothing (the host buffers validate everything before the first write).
        """
        with self._lock:
            return self._num_added

    def snapshot(self) -> Any:
        """Return a copy of the served buffer (sent to the caller by Ray).

        Useful to inspect the contents, or to checkpoint the buffer on the caller's machine
        rather than on the server's (:meth:`save` writes on the server's node).
        """
        # A private copy: Ray serializes the return value after the lock is released.
        with self._lock:
            return copy.deepcopy(self._buffer)

    def save(self, path: str | os.PathLike) -> str:
        """Checkpoint the buffer to ``path`` on the server's node with :func:`utils.dump`.

        The write is atomic: a failed or interrupted save leaves an earlier file at ``path``
        intact. The file holds the buffer itself, so ``utils.load(path)`` gives the buffer
        (with its RNG state) in any process.

        Parameters
        ----------
        path : str or path-like
            The file to write (its folder must exist).

        Returns
        -------
        str
            The absolute path written.
        """
        from coax_utils import utils

        path = os.path.abspath(os.fspath(path))
        with self._lock:
            utils.dump(self._buffer, path)
        return path

    def restore(self, path: str | os.PathLike, *, safe: bool = True) -> int:
        """Replace the served buffer by the one saved at ``path`` (see :meth:`save`).

        Parameters
        ----------
        path : str or path-like
            A file written by :meth:`save` (or ``utils.dump(buffer, path)``), read on the
            server's node with :func:`utils.load`.
        safe : bool
            Read the file with ``utils.load(path, safe=True)``: plain data only, so an
            edited file cannot run code in the server. The buffers of
            :mod:`coax_utils.replay` load this way; pass False only for a buffer type of
            your own that needs unpickling, from a file you trust.

        Returns
        -------
        int
            The size of the restored buffer.

        Raises
        ------
        ValueError
            If the file is truncated, corrupted or (with ``safe``) needs unpickling (from
            :func:`utils.load`); the served buffer is unchanged.
        TypeError
            If the file does not hold a replay buffer; the served buffer is unchanged.
        """
        buffer = self._load(path, safe)
        with self._lock:
            self._buffer = buffer
            self._num_added = len(buffer)
            return len(buffer)

    def _load(self, path: str | os.PathLike, safe: bool) -> Any:
        """The replay buffer saved at ``path``, checked (nothing is changed)."""
        from coax_utils import utils

        buffer = utils.load(os.fspath(path), safe=bool(safe))
        try:
            _check_buffer(buffer)
        except TypeError as exc:
            raise TypeError(f"{os.fspath(path)!r} does not hold a replay buffer: {exc}") from None
        return buffer
