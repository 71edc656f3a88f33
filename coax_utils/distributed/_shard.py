"""One replay shard of a :class:`ShardedReplay`: a :class:`ReplayServer` actor that waits for
the rate limiter before it adds, and loads checkpoints in two steps (stage, then commit)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import ray

from coax_utils import utils
from coax_utils._files import open_regular_file
from coax_utils.distributed._server import ReplayServer
from coax_utils.replay import PrioritizedReplayBuffer, TransitionBatch

__all__ = ["ReplayShard", "ReplayShardError", "buffer_kind", "check_buffers", "describe_kind"]


class ReplayShardError(RuntimeError):
    """A replay shard (or the rate limiter) died or stopped answering; the message names it."""


def buffer_kind(buffer: Any) -> tuple[Any, ...]:
    """What the shards of one replay share: the buffer type and, if prioritized, the
    exponents and epsilon that global probabilities and weights depend on."""
    if isinstance(buffer, PrioritizedReplayBuffer):
        return (type(buffer), buffer.alpha, buffer.beta, buffer.epsilon)
    return (type(buffer),)


def describe_kind(kind: tuple[Any, ...]) -> str:
    """A :func:`buffer_kind` in words, for error messages."""
    if len(kind) == 1:
        return kind[0].__name__
    return f"{kind[0].__name__}(alpha={kind[1]}, beta={kind[2]}, epsilon={kind[3]})"


def check_buffers(buffers: Any) -> list[Any]:
    """``buffers`` as a list of empty host buffers of one kind, one per shard (TypeError or
    ValueError otherwise)."""
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


def _read_bytes(path: str) -> bytearray:
    """The bytes of the regular file at ``path``, read once into memory."""
    with open_regular_file(path) as (fd, size):
        data = bytearray(size)
        view = memoryview(data)
        done = 0
        while done < size:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                raise ValueError(f"{path!r} shrank while it was read")
            done += n
    return data


class ReplayShard(ReplayServer):
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

    def insert_limit(self) -> int | None:
        if self._limiter is None:
            return None
        return self._ask_limiter(self._limiter.max_insert.remote())

    @staticmethod
    def _ask_limiter(ref: Any) -> Any:
        """``ray.get`` a reply of the rate limiter; ReplayShardError naming it if it died."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise ReplayShardError(f"the rate limiter died or is unreachable: {exc}") from None

    def _load(self, path: str | os.PathLike, safe: bool, sha256: str | None = None) -> Any:
        """The buffer saved at ``path``, of the kind this shard serves (its siblings serve
        the same); nothing is changed.

        The file is read once into memory: with ``sha256`` those bytes are hashed and
        checked, and the same bytes are loaded, so a file swapped after the check is never
        served.
        """
        path = os.fspath(path)
        data = _read_bytes(path)
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise utils.CheckpointDamagedError(
                f"{path!r} is not the file its checkpoint's manifest names (its SHA-256 "
                "differs): it was edited, or written by another save"
            )
        try:
            buffer = utils.loads(data, safe=bool(safe))
        except ValueError as exc:
            exc.add_note(f"(while loading {path!r})")
            raise
        del data
        try:
            super()._validate_args(buffer)  # TypeError for what is not a replay buffer
        except TypeError as exc:
            raise TypeError(f"{path!r} does not hold a replay buffer: {exc}") from None
        new, old = buffer_kind(buffer), buffer_kind(self._buffer)
        if new != old:
            raise ValueError(
                f"{path!r} holds a {describe_kind(new)}; this replay shard serves "
                f"a {describe_kind(old)} (all shards must hold buffers of one kind)"
            )
        return buffer

    def checkpoint(self, path: str) -> str:
        """:meth:`save` to ``path``; returns the SHA-256 of the file written."""
        digest = hashlib.sha256()
        with open_regular_file(self.save(path)) as (fd, _):
            for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()

    def stage(self, path: str, sha256: str) -> int:
        """Load and check the checkpoint at ``path`` without serving it yet; its size.

        Raises ValueError if the bytes read do not have the SHA-256 ``sha256`` (edited, or
        saved by another checkpoint) or hold another kind of buffer; the served buffer is
        unchanged either way. The bytes checked are the bytes loaded.
        """
        buffer = self._load(path, True, sha256)
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
