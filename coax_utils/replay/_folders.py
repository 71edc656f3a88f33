"""Replay folders: a host buffer saved as one ``.npy`` file (a *leaf*) per storage array beside
a ``meta.lz4`` file of the rest of its state, and loaded back with every file checked.

Saves go through :func:`coax_utils._files.atomic_folder` (a new folder beside the target,
fsynced, swapped in with two renames under a lock on the target); loads find the folder with
:func:`coax_utils._files.resolve_folder` and start again when a concurrent save replaced it
while it was read.

Every leaf carries checksums, computed while it is written and recorded in ``meta.lz4``: the
XXH64 (:mod:`._xxh64`) of its ``.npy`` header and of each consecutive chunk of its array data
(``chunk_bytes``, recorded too; saves use 8 MiB). The chunks are written, or read, and hashed by
a few threads at once, so the checksums cost little next to the file's bytes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import itertools
import math
import os
import re
from typing import Any

import numpy as np

from coax_utils import utils
from coax_utils._checks import checked_dtype, is_int
from coax_utils._files import atomic_folder, open_regular_file, resolve_folder, write_file
from coax_utils.replay._host_state import generator_from_record, split_state

__all__ = ["CHUNK_BYTES", "load_folder", "save_folder"]

_FOLDER_FORMAT = 3  # 3: leaves with sizes and checksums
_META = "meta.lz4"
CHUNK_BYTES = 8 << 20  # the chunks of the leaves that saves write (loads take any valid size)
_CHUNK_RANGE = (1 << 16, 1 << 30)  # the chunk sizes a load accepts: powers of two in it
_MAX_HEADER = 1 << 16
_MAX_THREADS = 4
_ATTEMPTS = 100  # loads started again because concurrent saves replaced the folder


def _xxh64(data: np.ndarray) -> int:
    from coax_utils.replay._xxh64 import xxh64  # numba: compiled or loaded on first use

    return xxh64(data)


def _threads() -> int:
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def _wait_all(futures: list) -> list:
    """The results of ``futures``, once every one has finished (the first error is raised
    only then: none may still use a file that the caller closes)."""
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


def _chunk_checksums(nbytes: int, chunk: int, pool: Any, checksum: Any) -> list[int]:
    """``checksum(lo)`` of each chunk of ``nbytes`` bytes (``lo``: where it starts), on the
    threads of ``pool``, each taking the next chunk not taken yet."""
    sums = [0] * -(-nbytes // chunk)
    chunks = itertools.count()  # its next() is atomic

    def run() -> None:
        while (k := next(chunks)) < len(sums):
            sums[k] = checksum(k * chunk)

    _wait_all([pool.submit(run) for _ in range(min(_threads(), len(sums)))])
    return sums


def _is_saved_folder(path: str) -> bool:
    names = os.listdir(path)
    return all(n == _META or re.fullmatch(r"leaf_\d+\.npy", n) for n in names)


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 array (no copy)."""
    return arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)


def _npy_header(arr: np.ndarray) -> bytes:
    f = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": False}
    d["shape"] = arr.shape
    try:
        np.lib.format.write_array_header_1_0(f, d)
    except ValueError:  # a header too long for format 1.0
        np.lib.format.write_array_header_2_0(f, d)
    return f.getvalue()


def _write_leaf(path: str, arr: np.ndarray, pool: Any) -> dict:
    """Write ``arr`` as the new ``.npy`` file ``path`` of a folder being saved, and fsync it;
    return the file's size and checksums, computed from the bytes as they are written (the
    folder, not each file, is swapped in atomically)."""
    arr = np.ascontiguousarray(arr)
    header, data = np.frombuffer(_npy_header(arr), np.uint8), _bytes_of(arr)
    chunks: list[int] = []

    def write_all(place: Any) -> None:
        def write(lo: int) -> int:
            piece = data[lo : lo + CHUNK_BYTES]
            place(len(header) + lo, piece)
            return _xxh64(piece)

        place(0, header)
        chunks.extend(_chunk_checksums(len(data), CHUNK_BYTES, pool, write))

    write_file(path, write_all)
    return {
        "size": len(header) + len(data),
        "header_checksum": _xxh64(header),
        "chunk_bytes": CHUNK_BYTES,
        "chunk_checksums": chunks,
    }


def save_folder(buffer: Any, path: str | os.PathLike) -> None:
    """Save ``buffer`` to the folder ``path`` (see ``save`` of the host buffers)."""
    target = os.path.abspath(os.fspath(path))

    def check_target() -> None:
        if os.path.lexists(target) and not (
            os.path.isdir(target) and not os.path.islink(target) and _is_saved_folder(target)
        ):
            raise ValueError(
                f"{target!r} exists and is not a folder written by save(); not replacing it"
            )

    check_target()
    meta, arrays, generators = split_state(buffer.__checkpoint_state__())
    with (
        atomic_folder(target) as staging,
        concurrent.futures.ThreadPoolExecutor(_threads(), "replay-save") as pool,
    ):
        check_target()  # again, under the lock
        files = []
        for i, (key, index, arr) in enumerate(arrays):
            file = f"leaf_{i}.npy"
            entry = {"file": file, "key": key, "index": index}
            entry.update(dtype=arr.dtype.str, shape=list(arr.shape))
            entry.update(_write_leaf(os.path.join(staging, file), arr, pool))
            files.append(entry)
        record = {
            "format": _FOLDER_FORMAT,
            "class": type(buffer).__name__,
            "state": meta,
            "files": files,
            "generators": generators,
        }
        utils.dump(record, os.path.join(staging, _META))


# -- loading ------------------------------------------------------------------------------------


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _check_on_disk(fd: int, size: int) -> None:
    """Refuse a file with holes: its bytes must really be on disk (a sparse file of a few
    KiB could otherwise declare gigabytes that a load would allocate)."""
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is None or size == 0:
        return
    try:
        hole = os.lseek(fd, 0, seek_hole)
    except OSError:  # the file system cannot tell
        return
    if hole < size:
        raise ValueError(
            f"it is a sparse file: its bytes from {hole} on are a hole, not data on disk"
        )


def _read_exactly(fd: int, buf: Any, offset: int) -> None:
    view, done = memoryview(buf), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError("it became shorter while it was read")
        done += n


def _is_checksum(x: Any) -> bool:
    return is_int(x) and 0 <= x < 2**64


class _Leaf:
    """An opened leaf file, checked against its metadata entry before anything is read."""

    def __init__(self, fd: int, size: int, entry: dict) -> None:
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if not (isinstance(dtype, str) and isinstance(shape, list) and len(shape) <= 32):
            raise ValueError("dtype and shape must be recorded")
        if not all(is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"invalid shape {shape!r}")
        self.dtype, self.shape = checked_dtype(dtype, "dtype"), [int(d) for d in shape]
        self.nbytes = self.dtype.itemsize * math.prod(self.shape)
        recorded, chunk = entry.get("size"), entry.get("chunk_bytes")
        header_checksum, chunks = entry.get("header_checksum"), entry.get("chunk_checksums")
        if not (is_int(recorded) and _is_checksum(header_checksum) and isinstance(chunks, list)):
            raise ValueError("its size and checksums must be recorded")
        low, high = _CHUNK_RANGE
        if not (is_int(chunk) and low <= chunk <= high and chunk & (chunk - 1) == 0):
            raise ValueError(f"its chunk size must be a power of two in [{low}, {high}]")
        if size != recorded:
            raise ValueError(f"it holds {size} bytes, the metadata says {recorded}")
        _check_on_disk(fd, size)
        head = os.pread(fd, min(size, _MAX_HEADER), 0)
        f = io.BytesIO(head)
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"unsupported .npy format version {version}")
        read = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }[version]
        got_shape, fortran, got_dtype = read(f)
        if got_dtype != self.dtype or list(got_shape) != self.shape or fortran:
            raise ValueError(
                f"it holds {got_dtype}{list(got_shape)}, the metadata says {self.dtype}{shape}"
            )
        self.start = f.tell()
        if size != self.start + self.nbytes:
            raise ValueError(f"its size {size} is not that of its header and array")
        if len(chunks) != -(-self.nbytes // chunk) or not all(map(_is_checksum, chunks)):
            raise ValueError(f"it needs one checksum per {chunk} bytes of its array")
        if _xxh64(np.frombuffer(head[: self.start], np.uint8)) != header_checksum:
            raise ValueError("its header does not match its checksum")
        self.fd, self.chunk, self.checksums = fd, int(chunk), [int(c) for c in chunks]

    def read(self, mmap_mode: str | None, pool: Any) -> np.ndarray:
        """The array, mapped (``mmap_mode`` "c" or "r") or read into memory (None), every
        chunk checked against its checksum (ValueError if one fails).

        A read into memory reads each chunk straight into the new array and hashes it there,
        a few chunks at once on the threads of ``pool``; a leaf that another program
        shortens meanwhile is a ValueError, like any other change."""
        if self.nbytes == 0:
            return np.empty(self.shape, self.dtype)
        if mmap_mode is None:
            arr = np.empty(self.shape, self.dtype)
        else:
            with open(self.fd, "rb", closefd=False) as f:
                arr = np.memmap(f, self.dtype, mmap_mode, self.start, tuple(self.shape))
        data = _bytes_of(arr)

        def checksum(lo: int) -> int:
            hi = min(lo + self.chunk, self.nbytes)
            if mmap_mode is None:
                _read_exactly(self.fd, data[lo:hi], self.start + lo)
            return _xxh64(data[lo:hi])

        sums = _chunk_checksums(self.nbytes, self.chunk, pool, checksum)
        for k, (got, want) in enumerate(zip(sums, self.checksums)):
            if got != want:
                lo = self.start + k * self.chunk
                hi = min(lo + self.chunk, self.start + self.nbytes)
                raise ValueError(
                    f"its bytes {lo} to {hi} do not match their checksum "
                    "(damaged, or from another save)"
                )
        return arr


def _read_meta(folder: str, bad: Any) -> dict:
    meta_path = os.path.join(folder, _META)
    if not os.path.lexists(meta_path):
        raise bad(f"{_META} is missing (an incomplete save)")
    try:
        with open_regular_file(meta_path, follow_links=False) as (fd, size):
            _check_on_disk(fd, size)
            data = bytearray(size)
            _read_exactly(fd, data, 0)
        record = utils.loads(data, safe=True)
    except (ValueError, TypeError, OSError, EOFError) as e:
        raise bad(f"{_META} cannot be read ({e})") from None
    keys = ("format", "class", "state", "files", "generators")
    if not isinstance(record, dict) or set(record) != set(keys):
        raise bad(f"{_META} must hold a dict with the keys {list(keys)}")
    return record


def _load_once(cls: type, folder: str, mmap_mode: str | None, pool: Any) -> Any:
    def bad(what: str) -> ValueError:
        return ValueError(f"{folder!r} does not hold a complete saved {cls.__name__}: {what}")

    record = _read_meta(folder, bad)
    if record["class"] != cls.__name__:
        raise bad(f"it holds a {record['class']!r}")
    if record["format"] != _FOLDER_FORMAT:
        raise bad(f"unsupported format {record['format']!r} (format 3 has leaf checksums)")
    state, files, generators = record["state"], record["files"], record["generators"]
    if not (isinstance(state, dict) and isinstance(files, list)):
        raise bad("state must be a dict and files a list")
    if not isinstance(generators, dict):
        raise bad("generators must be a dict")
    expected = {f"leaf_{i}.npy" for i in range(len(files))} | {_META}
    found = os.listdir(folder)
    if set(found) != expected:
        raise bad(f"it must hold exactly {sorted(expected)}, found {sorted(found)}")
    with contextlib.ExitStack() as stack:
        leaves = []  # every leaf opened and checked before any is read
        for i, entry in enumerate(files):
            if not (isinstance(entry, dict) and entry.get("file") == f"leaf_{i}.npy"):
                raise bad(f"files[{i}] must describe leaf_{i}.npy")
            path = os.path.join(folder, entry["file"])
            try:
                fd, size = stack.enter_context(open_regular_file(path, follow_links=False))
                leaves.append(_Leaf(fd, size, entry))
            except (TypeError, ValueError, OSError, EOFError) as e:
                raise bad(f"{entry['file']} cannot be read ({e})") from None
        state = dict(state)
        for entry, leaf in zip(files, leaves):
            try:
                arr = leaf.read(mmap_mode, pool)
            except (ValueError, OSError) as e:
                raise bad(f"{entry['file']} cannot be read ({e})") from None
            key, index = entry.get("key"), entry.get("index")
            place = state.get(key) if isinstance(key, str) else "missing"
            if index is None and place is None and key in state:
                state[key] = arr
            elif is_int(index) and isinstance(place, list) and 0 <= index < len(place):
                if place[index] is not None:
                    raise bad(f"{entry['file']} points at {key}[{index}], which is not empty")
                state[key] = place = list(place)
                place[index] = arr
            else:
                raise bad(f"{entry['file']} points at {key!r}[{index!r}], not an empty place")
    for key, generator in generators.items():
        if key not in state or state[key] is not None:
            raise bad(f"generator {key!r} has no empty place in the state")
        try:
            state[key] = generator_from_record(generator, key)
        except ValueError as e:
            raise bad(str(e)) from None
    try:
        return cls.__checkpoint_restore__(state)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None


def load_folder(cls: type, path: str | os.PathLike, mmap_mode: str | None) -> Any:
    """A buffer of class ``cls`` read from the folder ``path`` (see ``load``)."""
    if mmap_mode not in ("c", "r", None):
        hint = " (writing through to a saved folder would break it; use save)"
        raise ValueError(
            f"mmap_mode must be 'c', 'r' or None, got {mmap_mode!r}"
            + (hint if mmap_mode in ("r+", "w+") else "")
        )
    target = os.path.abspath(os.fspath(path))
    with concurrent.futures.ThreadPoolExecutor(_threads(), "replay-load") as pool:
        for attempt in range(_ATTEMPTS):
            folder = resolve_folder(target)
            before = _identity(folder)
            if before is None or not os.path.isdir(folder):
                if attempt + 1 < _ATTEMPTS and _identity(resolve_folder(target)) is not None:
                    continue  # a concurrent save moved it in the meantime
                raise FileNotFoundError(f"no saved buffer at {target!r}")
            try:
                return _load_once(cls, folder, mmap_mode, pool)
            except (ValueError, OSError):
                # a save that replaced the folder while it was read: start again
                if attempt + 1 < _ATTEMPTS and _identity(resolve_folder(target)) != before:
                    continue
                raise
    raise AssertionError("unreachable")  # pragma: no cover
