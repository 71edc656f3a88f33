"""The files of a :class:`ShardedReplay` checkpoint folder: the manifest
(``sharded_replay.json``), the shard files it names, and the lock that saves hold.

A save is committed by one atomic rename, that of the manifest: the shard files of a save
carry a name of their own (``shard-<i>-<token>.lz4``), written and fsynced before the
manifest that names them, and the files of earlier saves are removed only after it. A save
killed at any point thus leaves the folder's manifest naming the complete files of either
the earlier save or the new one; the files of the other are leftovers that the next save
removes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from coax_utils._checks import is_int
from coax_utils._files import atomic_write, lock_file, open_regular_file
from coax_utils._numpy_random import bit_generator_from_state
from coax_utils.utils import CheckpointDamagedError, CheckpointNotReadableError

__all__ = [
    "MANIFEST",
    "Manifest",
    "new_shard_files",
    "read_manifest",
    "remove_shard_files",
    "save_lock",
    "write_manifest",
]

MANIFEST = "sharded_replay.json"
_LOCK = ".sharded_replay.lock"
_VERSION = 3
_MAX_BYTES = 64 << 20  # a manifest holds a few hundred bytes per shard
_KEYS = {"format", "num_shards", "next_shard", "rng", "rate_limiter", "hint", "files", "sha256"}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHARD_FILE = re.compile(r"shard-([0-9]+)-[0-9a-f]{32}\.lz4")  # shard-<i>-<save token>.lz4


class Manifest(NamedTuple):
    """A manifest read from disk, every field checked."""

    files: list[str]
    sha256: list[str]
    rng: np.random.Generator
    hint: np.ndarray | None
    next_shard: int
    rate_limiter: dict[str, int] | None


def new_shard_files(num_shards: int) -> list[str]:
    """The names of the shard files of a new save (a token of its own)."""
    token = uuid.uuid4().hex
    return [f"shard-{i}-{token}.lz4" for i in range(num_shards)]


@contextlib.contextmanager
def save_lock(folder: str, *, reading: bool = False) -> Iterator[None]:
    """Hold the lock of the checkpoint folder ``folder``: one save at a time, and no save
    removes the files a restore reads. A reader (``reading=True``) of a folder it cannot
    write, or that does not exist, goes without the lock."""
    try:
        fd: int | None = lock_file(os.path.join(folder, _LOCK))
    except OSError as exc:
        if not reading or exc.errno not in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def write_manifest(
    folder: str,
    *,
    files: Sequence[str],
    sha256: Sequence[str],
    rng_state: dict[str, Any],
    hint: list[float] | None,
    next_shard: int,
    rate_limiter: dict[str, int] | None,
) -> None:
    """Write the manifest of a save atomically (temp file, fsync, rename, folder fsync)."""
    manifest = {
        "format": _VERSION,
        "num_shards": len(files),
        "next_shard": next_shard,
        "rng": rng_state,
        "rate_limiter": rate_limiter,
        "hint": hint,
        "files": list(files),
        "sha256": list(sha256),
    }
    data = json.dumps(manifest).encode()
    atomic_write(os.path.join(folder, MANIFEST), lambda place: place(0, data))


def remove_shard_files(folder: str, keep: Sequence[str]) -> None:
    """Remove the shard files in ``folder`` that neither ``keep`` nor the manifest there
    names (best effort)."""
    named: set[str] = set(keep)
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            listed = json.load(f).get("files")
        if isinstance(listed, list):
            named.update(x for x in listed if isinstance(x, str))
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    for name in os.listdir(folder):
        if _SHARD_FILE.fullmatch(name) and name not in named:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))


def _is_total(x: Any) -> bool:
    """Whether ``x`` (read from a manifest) is a finite number >= 0 (JSON ints may be huge)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x) and x >= 0
    except OverflowError:  # an int beyond any float
        return False


def _load_json(folder: str) -> Any:
    path = os.path.join(folder, MANIFEST)
    try:
        with open_regular_file(path) as (fd, size):
            if size > _MAX_BYTES:
                raise CheckpointDamagedError(f"{path!r} is too large for a manifest ({size} B)")
            with os.fdopen(os.dup(fd), "rb") as f:
                text = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{folder!r} holds no ShardedReplay checkpoint ({MANIFEST})") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # also ints of more digits than Python reads
        raise CheckpointDamagedError(f"{path!r} is corrupted: {exc}") from None


def read_manifest(folder: str, num_shards: int, with_limiter: bool) -> Manifest:
    """The manifest in ``folder`` of a replay of ``num_shards`` shards, with or without a
    rate limiter, every field checked (ValueError otherwise; CheckpointDamagedError for a
    manifest that lies, CheckpointNotReadableError for one of another format)."""
    path = os.path.join(folder, MANIFEST)
    manifest = _load_json(folder)

    def damaged(what: str) -> CheckpointDamagedError:
        return CheckpointDamagedError(f"{path!r}: {what}")

    if isinstance(manifest, dict) and manifest.get("format", _VERSION) != _VERSION:
        raise CheckpointNotReadableError(
            f"{path!r} has format {manifest['format']!r:.40}, expected {_VERSION} "
            "(a checkpoint of another version of this package)"
        )
    if not isinstance(manifest, dict) or set(manifest) != _KEYS:
        raise damaged(f"not a ShardedReplay manifest (keys {sorted(_KEYS)})")
    if manifest["num_shards"] != num_shards:
        raise ValueError(
            f"{folder!r} holds {manifest['num_shards']!r:.40} shards, this replay has {num_shards}"
        )
    next_shard = manifest["next_shard"]
    if not is_int(next_shard) or not 0 <= next_shard < num_shards:
        raise damaged(f"next_shard {next_shard!r:.40} is out of range")
    hint = manifest["hint"]
    if hint is not None and not (
        isinstance(hint, list) and len(hint) == num_shards and all(_is_total(t) for t in hint)
    ):
        raise damaged("hint must be null or one finite total >= 0 per shard")
    counts = manifest["rate_limiter"]
    if counts is not None and (
        not isinstance(counts, dict)
        or set(counts) != {"inserts", "samples"}
        or not all(is_int(c) and c >= 0 for c in counts.values())
    ):
        raise damaged("rate_limiter must be null or inserts/samples counts (ints >= 0)")
    digests = manifest["sha256"]
    if not (
        isinstance(digests, list)
        and len(digests) == num_shards
        and all(isinstance(d, str) and _SHA256.fullmatch(d) for d in digests)
    ):
        raise damaged("sha256 must hold one hex SHA-256 per shard file")
    if (counts is None) == with_limiter:
        raise ValueError(
            f"{folder!r} was saved {'without' if counts is None else 'with'} a rate "
            f"limiter, this replay has {'one' if with_limiter else 'none'}"
        )
    files = manifest["files"]
    if not (
        isinstance(files, list)
        and len(files) == num_shards
        and all(
            isinstance(name, str)
            and (m := _SHARD_FILE.fullmatch(name)) is not None
            and m.group(1) == str(i)
            for i, name in enumerate(files)
        )
    ):
        raise damaged("files must name one shard-<i>-<token>.lz4 per shard")
    for name in files:
        if not os.path.isfile(os.path.join(folder, name)):
            raise ValueError(f"{folder!r} lacks {name}")
    try:  # the checked constructor: a state no seeding gives (e.g. all zeros) is refused
        rng = np.random.Generator(bit_generator_from_state("PCG64", manifest["rng"]))
    except ValueError as exc:
        raise damaged(f"bad RNG state in the manifest: {exc}") from None
    return Manifest(
        files=files,
        sha256=digests,
        rng=rng,
        hint=None if hint is None else np.array(hint, np.float64),
        next_shard=int(next_shard),
        rate_limiter=counts,
    )
