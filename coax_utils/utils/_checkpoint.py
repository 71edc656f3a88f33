"""Checkpoints: ``dump``, ``dumps``, ``load`` and ``loads``.

File layout (format version 1, all integers little-endian)::

    header   MAGIC (8 bytes) | version u32 | meta_len u32 | meta (JSON) | crc32 u32
    body     the stored chunks, one after the other
    index    JSON: for every segment its size and, per chunk, [stored_len, crc32, codec]
    footer   index_offset u64 | index_len u64 | index_crc u32 | footer_crc u32 | END_MAGIC

Segment 0 is the pickle stream (cloudpickle, protocol 5); the other segments are the array
buffers that the pickler handed out of band. Every segment is cut into chunks of
``chunk_size`` bytes, each compressed on its own with ``lz4.block`` (or stored as is when lz4
does not make it smaller), so that threads can work on chunks in parallel. Every byte of the
file is covered by a CRC-32 (header, chunks, index, footer).
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import functools
import io
import json
import os
import pickle
import platform
import queue
import secrets
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import cloudpickle
import jax
import lz4.block
import lz4.frame
import numpy as np

from coax_utils._version import __version__

__all__ = ["dump", "dumps", "load", "loads"]

MAGIC = b"\x89COAXCK\n"
END_MAGIC = b"\nKCXAOC\x89"
FORMAT_VERSION = 1
# Bytes of raw data per compressed chunk. Each chunk starts without an lz4 history, which
# costs about 1 KB of output on compressible data: at 16 MiB that is less than what the block
# headers of an lz4 frame cost (coax's format), and still many chunks for the threads.
CHUNK_SIZE = 16 << 20
INBAND_LIMIT = 64 << 10  # array buffers smaller than this stay inside the pickle stream
MAX_THREADS = 4

_LZ4_FRAME_MAGIC = b"\x04\x22\x4d\x18"
_HEADER = struct.Struct("<8sII")
_CRC = struct.Struct("<I")
_FOOTER = struct.Struct("<QQII8s")
_RAW, _LZ4 = 0, 1


# -- array reduction -----------------------------------------------------------------------


def _array_payload(arr: np.ndarray) -> tuple[Any, np.dtype, tuple[int, ...], str]:
    """Describe a numpy array as (flat byte buffer, dtype, shape, order) without copying."""
    if arr.nbytes == 0:
        return None, arr.dtype, arr.shape, "C"
    if arr.flags.c_contiguous:
        data, order = arr, "C"
    elif arr.flags.f_contiguous:
        data, order = arr.T, "F"
    else:
        data, order = np.ascontiguousarray(arr), "C"
    return pickle.PickleBuffer(data.reshape(-1).view(np.uint8)), arr.dtype, arr.shape, order


def _array_from_payload(buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"array buffers cannot hold Python objects (dtype {dtype})")
    if order not in ("C", "F"):
        raise pickle.UnpicklingError(f"unknown array order {order!r}; expected 'C' or 'F'")
    shape = tuple(int(n) for n in shape)
    if buf is None:
        return np.empty(shape, dtype)
    flat = np.frombuffer(buf, dtype=np.uint8).view(dtype)
    if order == "C":
        return flat.reshape(shape)
    return flat.reshape(shape[::-1]).T


def _rebuild_ndarray(buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    """Rebuild a numpy array saved by :func:`dumps` (always writable)."""
    arr = _array_from_payload(buf, dtype, shape, order)
    if not arr.flags.writeable:
        arr = arr.copy(order="K")
    return arr


def _rebuild_jax_array(buf: Any, dtype: Any, shape: Any, weak_type: bool) -> jax.Array:
    """Rebuild a jax array saved by :func:`dumps` (placed on the default device)."""
    x = jax.device_put(_array_from_payload(buf, dtype, shape, "C"))
    if weak_type:
        x.aval = x.aval.update(weak_type=True)
    return x


def _rebuild_jax_key(data: Any, impl: str) -> jax.Array:
    """Rebuild a typed PRNG key array saved by :func:`dumps`."""
    return jax.random.wrap_key_data(data, impl=str(impl))


def _reduce_jax_array(x: jax.Array) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return _rebuild_jax_key, (jax.random.key_data(x), str(jax.random.key_impl(x)))
    buf, dtype, shape, _ = _array_payload(np.asarray(x))
    return _rebuild_jax_array, (buf, dtype, shape, bool(getattr(x, "weak_type", False)))


class _Pickler(cloudpickle.Pickler):
    """cloudpickle with numpy/jax array memory handed out as raw byte buffers."""

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is np.ndarray and not obj.dtype.hasobject:
            return _rebuild_ndarray, _array_payload(obj)
        if isinstance(obj, jax.Array):
            return _reduce_jax_array(obj)
        return super().reducer_override(obj)


def _pickle(obj: Any) -> tuple[memoryview, list[memoryview]]:
    """Pickle ``obj``; return the pickle stream and the out-of-band buffers."""
    buffers: list[memoryview] = []

    def keep_out_of_band(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < INBAND_LIMIT:
            return True  # small: serialize in-band
        buffers.append(raw)
        return False

    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=keep_out_of_band).dump(obj)
    return f.getbuffer(), buffers


# -- threads ---------------------------------------------------------------------------------


def _num_threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, n))


_END = object()


def _map_ordered(fn: Callable[[Any], Any], items: list[Any], nbytes: int) -> Iterator[Any]:
    """``map(fn, items)`` on a few threads (lz4 and crc32 release the GIL), results in order."""
    workers = min(_num_threads(), len(items))
    if workers < 2 or nbytes < min(2 * CHUNK_SIZE, 1 << 20):  # threads would not pay off
        yield from map(fn, items)
        return
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        it = iter(items)
        pending = collections.deque(pool.submit(fn, x) for _, x in zip(range(2 * workers), it))
        while pending:
            result = pending.popleft().result()
            nxt = next(it, _END)
            if nxt is not _END:
                pending.append(pool.submit(fn, nxt))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- lz4 -----------------------------------------------------------------------------------


@functools.cache
def _lz4_native() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """``LZ4_compress_default`` and ``LZ4_decompress_safe`` from the C library in python-lz4.

    python-lz4 returns new ``bytes`` (allocated and copied with the GIL held); calling the C
    functions through ctypes compresses and decompresses straight into our own buffers, with
    the GIL released. Returns None when the symbols are not found or do not behave like the
    python-lz4 API (a self-test), in which case python-lz4's functions are used.
    """
    import ctypes

    try:
        lib = ctypes.CDLL(lz4.block._block.__file__)
        compress, decompress = lib.LZ4_compress_default, lib.LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    for fn in (compress, decompress):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    sample = np.frombuffer(b"coax_utils checkpoint self-test " * 64 + bytes(range(256)), np.uint8)
    packed = np.empty(_lz4_bound(sample.size), np.uint8)
    out = np.empty(sample.size, np.uint8)
    try:
        k = compress(_address(sample), _address(packed), sample.size, packed.size)
        if not 0 < k < sample.size:
            return None
        n = decompress(_address(packed), _address(out), k, out.size)
        theirs = lz4.block.decompress(packed[:k].tobytes(), uncompressed_size=sample.size)
    except Exception:  # any failure means: do not use the C functions
        return None
    if n != sample.size or out.tobytes() != sample.tobytes() or theirs != sample.tobytes():
        return None
    return compress, decompress


def _lz4_bound(n: int) -> int:
    return n + n // 255 + 16


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _compress_chunk(chunk: memoryview, out: np.ndarray | None = None) -> tuple[Any, int, int]:
    """Compress one chunk; return (stored bytes, codec, crc32 of the stored bytes).

    ``out`` (a uint8 array of at least ``_lz4_bound(chunk.nbytes)`` bytes) receives the
    compressed bytes where the C functions are available; the stored bytes are then a view
    of it, or ``chunk`` itself when lz4 does not make it smaller.
    """
    native = _lz4_native()
    if native is None:
        packed: Any = lz4.block.compress(chunk, store_size=False)
        k = len(packed)
    else:
        src = np.frombuffer(chunk, np.uint8)
        if out is None:
            out = np.empty(_lz4_bound(src.size), np.uint8)
        k = native[0](_address(src), _address(out), src.size, out.size)
        packed = out[:k]
    if k <= 0 or k >= chunk.nbytes:  # lz4 does not help: store the chunk as it is
        return chunk, _RAW, zlib.crc32(chunk)
    return packed, _LZ4, zlib.crc32(packed)


def _decompress_into(src: Any, codec: int, dest: np.ndarray) -> None:
    """Decompress one stored chunk into ``dest`` (a uint8 array of the raw chunk size)."""
    if codec == _RAW:
        if len(src) != dest.size:
            raise _Corrupt("stored chunk has the wrong size")
        dest[:] = np.frombuffer(src, np.uint8)
        return
    if codec != _LZ4:
        raise _Corrupt(f"unknown chunk codec {codec}")
    native = _lz4_native()
    if native is not None:
        src = np.frombuffer(src, np.uint8)
        if native[1](_address(src), _address(dest), src.size, dest.size) != dest.size:
            raise _Corrupt("lz4 chunk does not decompress to its recorded size")
        return
    try:
        out = lz4.block.decompress(src, uncompressed_size=dest.size)
    except lz4.block.LZ4BlockError as e:
        raise _Corrupt(f"lz4 chunk does not decompress: {e}") from None
    if len(out) != dest.size:
        raise _Corrupt("lz4 chunk does not decompress to its recorded size")
    dest[:] = np.frombuffer(out, np.uint8)


# -- encoding ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _metadata(chunk_size: int) -> bytes:
    meta = {
        "format": "coax_utils checkpoint",
        "writer": f"coax_utils {__version__}",
        "python": platform.python_version(),
        "pickle_protocol": 5,
        "codec": "lz4.block",
        "checksum": "crc32",
        "chunk_size": chunk_size,
    }
    return json.dumps(meta, sort_keys=True).encode()


def _header(chunk_size: int) -> bytes:
    meta = _metadata(chunk_size)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(meta)) + meta
    return header + _CRC.pack(zlib.crc32(header))


def _encode(
    stream: memoryview, buffers: list[memoryview], write: Callable[[int, Any], None]
) -> int:
    """Encode a checkpoint: call ``write(offset, piece)`` for every piece; return the size.

    The pieces (bytes-like) tile ``[0, size)``. With several threads, ``write`` is called
    from the worker threads, in any order, as soon as a piece's place is known: the copies
    (or file writes) run in parallel with each other and with the compression of later
    chunks. A piece may only be used during its call. Compressed chunks go to scratch
    buffers that are reused as soon as they are written.
    """
    chunk_size = CHUNK_SIZE
    header = _header(chunk_size)
    segments = [stream, *buffers]
    chunks = [seg[i : i + chunk_size] for seg in segments for i in range(0, seg.nbytes, chunk_size)]
    total = sum(seg.nbytes for seg in segments)
    bound = _lz4_bound(min(chunk_size, max((c.nbytes for c in chunks), default=0)))
    free: list[np.ndarray] = []  # scratch buffers (list.pop/append are atomic)

    def compress(chunk: memoryview) -> tuple[Any, int, int, np.ndarray | None]:
        if _lz4_native() is None:  # python-lz4 returns new bytes
            return (*_compress_chunk(chunk), None)
        try:
            scratch = free.pop()
        except IndexError:
            scratch = _scratch_buffer(bound)
        stored, codec, crc = _compress_chunk(chunk, scratch)
        if codec == _RAW:  # the scratch buffer holds nothing
            free.append(scratch)
            scratch = None
        return stored, codec, crc, scratch

    def store(job: tuple[int, Any, np.ndarray | None]) -> None:
        offset, stored, scratch = job
        write(offset, stored)
        if scratch is not None:
            free.append(scratch)

    table: list[list[int]] = []
    offset = len(header)
    workers = min(_num_threads(), len(chunks))
    if workers < 2 or total < min(2 * CHUNK_SIZE, 1 << 20):  # threads would not pay off
        write(0, header)
        for chunk in chunks:
            stored, codec, crc, scratch = compress(chunk)
            n = len(memoryview(stored))
            store((offset, stored, scratch))
            table.append([n, crc, codec])
            offset += n
    else:
        pool = concurrent.futures.ThreadPoolExecutor(workers)
        try:
            stores = [pool.submit(store, (0, header, None))]
            it = iter(chunks)
            pending = collections.deque(
                pool.submit(compress, c) for _, c in zip(range(2 * workers), it)
            )
            while pending:
                stored, codec, crc, scratch = pending.popleft().result()
                nxt = next(it, _END)
                if nxt is not _END:
                    pending.append(pool.submit(compress, nxt))
                n = len(memoryview(stored))
                stores.append(pool.submit(store, (offset, stored, scratch)))
                table.append([n, crc, codec])
                offset += n
            for f in stores:
                f.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    index_segments, k = [], 0
    for seg in segments:
        n_chunks = -(-seg.nbytes // chunk_size)
        index_segments.append([seg.nbytes, table[k : k + n_chunks]])
        k += n_chunks
    index = json.dumps({"segments": index_segments}, separators=(",", ":")).encode()
    fields = struct.pack("<QQI", offset, len(index), zlib.crc32(index))
    footer = _FOOTER.pack(offset, len(index), zlib.crc32(index), zlib.crc32(fields), END_MAGIC)
    write(offset, index + footer)
    return offset + len(index) + len(footer)


def _capacity(stream: memoryview, buffers: list[memoryview]) -> int:
    """An upper bound of the size of the encoded checkpoint."""
    n = len(_header(CHUNK_SIZE)) + 64 + _FOOTER.size
    for seg in (stream, *buffers):
        full, rest = divmod(seg.nbytes, CHUNK_SIZE)
        n += full * _lz4_bound(CHUNK_SIZE) + (_lz4_bound(rest) if rest else 0)
        n += 64 * (full + 2)  # its index entry: at most 64 characters per chunk and segment
    return n


def _scratch_buffer(n: int) -> np.ndarray:
    # From the heap: after the first call, malloc serves buffers of this size from memory
    # the process already has mapped (no page faults), unlike fresh anonymous mappings.
    return np.empty(n, np.uint8)


# -- assembling the result of dumps ---------------------------------------------------------

# Results smaller than this are built with b"".join; the in-place path pays off above it.
_DIRECT_JOIN_MIN = 1 << 20


class _BytesApi:
    """CPython's C functions to build a ``bytes`` object in place, called through ctypes.

    ``PyBytes_FromStringAndSize(NULL, n)`` makes a ``bytes`` object whose contents its
    owner fills before anyone else sees it, and ``_PyBytes_Resize`` changes its size while
    it has no other reference (both documented in the C API, used by C extensions that build
    bytes). With them, :func:`dumps` writes the checkpoint straight into its result, from
    several threads, and trims the unused end; no second copy of the result is made.
    """

    def __init__(self) -> None:
        import ctypes

        api = ctypes.pythonapi
        # item access makes private function objects: the shared ones keep their signatures
        self.new = api["PyBytes_FromStringAndSize"]
        self.new.restype, self.new.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_ssize_t]
        self.data = api["PyBytes_AsString"]
        self.data.restype, self.data.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        self.resize = api["_PyBytes_Resize"]
        self.resize.restype = ctypes.c_int
        self.resize.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        # PyBytes_FromObject returns a new reference to an exact bytes object: here, the
        # way to hand the finished object to Python
        self.adopt = api["PyBytes_FromObject"]
        self.adopt.restype, self.adopt.argtypes = ctypes.py_object, [ctypes.c_void_p]
        self.decref = api["Py_DecRef"]
        self.decref.restype, self.decref.argtypes = None, [ctypes.c_void_p]


class _BytesBuilder:
    """A new ``bytes`` object of ``capacity`` bytes, written at offsets, then trimmed."""

    def __init__(self, api: _BytesApi, capacity: int) -> None:
        import ctypes

        self._api, self._ctypes = api, ctypes
        self._ptr = ctypes.c_void_p(api.new(None, capacity))  # the one (owned) reference
        if not self._ptr.value:
            raise MemoryError(f"cannot allocate {capacity} bytes")
        self._start, self._capacity = api.data(self._ptr), capacity

    def write(self, offset: int, piece: Any) -> None:
        src = np.frombuffer(piece, np.uint8)
        if offset < 0 or offset + src.size > self._capacity:
            raise ValueError("write outside the buffer")  # a bug: never overrun the object
        self._ctypes.memmove(self._start + offset, _address(src), src.size)  # releases the GIL

    def finish(self, size: int) -> bytes:
        """Trim to ``size`` bytes and return the object (the builder is then empty)."""
        if self._api.resize(self._ctypes.byref(self._ptr), size) != 0 or not self._ptr.value:
            self._ptr.value = None  # _PyBytes_Resize freed the object
            raise MemoryError(f"cannot resize a bytes object to {size} bytes")
        out = self._api.adopt(self._ptr)
        self.close()
        return out

    def close(self) -> None:
        if self._ptr.value:
            self._api.decref(self._ptr)
            self._ptr.value = None


@functools.cache
def _bytes_api() -> _BytesApi | None:
    """The C functions of :class:`_BytesApi`, or None (then ``b"".join`` is used).

    None where they are missing (not CPython) or fail a self-test.
    """
    if sys.implementation.name != "cpython":
        return None
    try:
        api = _BytesApi()
        builder = _BytesBuilder(api, 4096)
        try:
            builder.write(0, b"coax_utils")
            builder.write(10, bytes(range(256)))
            out = builder.finish(266)
        finally:
            builder.close()
    except Exception:  # any failure means: use b"".join
        return None
    expected = b"coax_utils" + bytes(range(256))
    if type(out) is not bytes or out != expected or hash(out) != hash(expected):
        return None
    if sys.getrefcount(out) > 2:  # ours and getrefcount's argument: nothing leaked
        return None
    return api


def _dumps_pieces(stream: memoryview, buffers: list[memoryview]) -> bytes:
    pieces: dict[int, bytes] = {}

    def write(offset: int, piece: Any) -> None:
        pieces[offset] = bytes(piece)  # pieces in scratch buffers are reused

    _encode(stream, buffers, write)
    return b"".join(pieces[k] for k in sorted(pieces))


# -- decoding ------------------------------------------------------------------------------


class _Corrupt(Exception):
    """Raised internally when the data fails a structural or checksum test."""


class UnsafeGlobalError(pickle.UnpicklingError):
    """A ``safe=True`` load met a global (function or class) that is not plain data."""


class _MemorySource:
    """Checkpoint bytes in memory; ``read`` returns zero-copy views."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.size = view, len(view)

    def read(self, offset: int, n: int) -> memoryview:
        return self.view[offset : offset + n]


class _FileSource:
    """An open checkpoint file; ``read`` uses ``os.preadv`` into a per-thread buffer.

    Chunks are read where they are needed, by the thread that decompresses them, into a
    buffer that thread reuses: the compressed file is never held in memory as a whole. The
    returned view is valid until the same thread reads again.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._local = threading.local()

    def read(self, offset: int, n: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = bytearray(max(n, min(self.size, _lz4_bound(CHUNK_SIZE))))
        view = memoryview(buf)[:n]
        got = 0
        while got < n:
            k = os.preadv(self.fd, [view[got:]], offset + got)
            if k <= 0:
                raise _Corrupt("file is shorter than its index says (truncated?)")
            got += k
        return view


def _parse(source: Any) -> tuple[int, list[tuple[int, list[tuple[int, int, int]]]], int]:
    """Check header, footer and index; return (chunk_size, segments, body_start)."""
    size = source.size
    if size < _HEADER.size + _CRC.size + _FOOTER.size:
        raise _Corrupt(f"only {size} bytes, too short for a checkpoint (truncated?)")
    magic, version, meta_len = _HEADER.unpack(bytes(source.read(0, _HEADER.size)))
    if magic != MAGIC:
        raise _Corrupt("unrecognised header (neither coax_utils nor legacy coax lz4 data)")
    if version > FORMAT_VERSION or version < 1:
        raise _Corrupt(
            f"format version {version} is not supported (this coax_utils {__version__} reads "
            f"versions 1 to {FORMAT_VERSION}; upgrade coax_utils)"
        )
    body_start = _HEADER.size + meta_len + _CRC.size
    if body_start + _FOOTER.size > size:
        raise _Corrupt("header larger than the data (truncated?)")
    header = bytes(source.read(0, body_start))
    if zlib.crc32(header[: -_CRC.size]) != _CRC.unpack(header[-_CRC.size :])[0]:
        raise _Corrupt("header checksum mismatch")
    meta = json.loads(header[_HEADER.size : _HEADER.size + meta_len])
    if meta.get("codec") != "lz4.block" or meta.get("checksum") != "crc32":
        raise _Corrupt(f"unsupported codec/checksum {meta.get('codec')}/{meta.get('checksum')}")
    chunk_size = int(meta["chunk_size"])
    footer_at = size - _FOOTER.size
    footer = bytes(source.read(footer_at, _FOOTER.size))
    index_offset, index_len, index_crc, footer_crc, end = _FOOTER.unpack(footer)
    fields = struct.pack("<QQI", index_offset, index_len, index_crc)
    if end != END_MAGIC or zlib.crc32(fields) != footer_crc:
        raise _Corrupt("footer missing or damaged (truncated or corrupted data)")
    if index_offset < body_start or index_offset + index_len != footer_at:
        raise _Corrupt("index position inconsistent with the data length (truncated?)")
    index = bytes(source.read(index_offset, index_len))
    if zlib.crc32(index) != index_crc:
        raise _Corrupt("index checksum mismatch")
    segments = [
        (int(n), [(int(k), int(crc), int(codec)) for k, crc, codec in chunks])
        for n, chunks in json.loads(index)["segments"]
    ]
    stored = 0
    for n, chunks in segments:
        if chunk_size <= 0 or len(chunks) != -(-n // chunk_size):
            raise _Corrupt("index chunk count inconsistent with segment size")
        for i, (k, _, _) in enumerate(chunks):
            # lz4 expands at most ~255x: refuse to allocate what no stored chunk can fill
            if min(chunk_size, n - i * chunk_size) > 256 * k + 64:
                raise _Corrupt("index claims more data than the stored chunks can hold")
        stored += sum(k for k, _, _ in chunks)
    if not segments or body_start + stored != index_offset:
        raise _Corrupt("index inconsistent with the body length")
    return chunk_size, segments, body_start


def _decode(source: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """Return the pickle stream and the (writable) out-of-band buffers."""
    chunk_size, segments, pos = _parse(source)
    jobs, outputs, total = [], [], 0
    for n, chunks in segments:
        dest = np.empty(n, np.uint8)
        outputs.append(dest)
        total += n
        for i, (k, crc, codec) in enumerate(chunks):
            jobs.append((pos, k, crc, codec, dest[i * chunk_size : (i + 1) * chunk_size]))
            pos += k

    def run(job: tuple[int, int, int, int, np.ndarray]) -> None:
        offset, k, crc, codec, dest = job
        src = source.read(offset, k)
        if zlib.crc32(src) != crc:
            raise _Corrupt("chunk checksum mismatch (bit flip or damaged data)")
        _decompress_into(src, codec, dest)

    for _ in _map_ordered(run, jobs, total):
        pass
    return outputs[0], outputs[1:]


def _legacy_stream(source: Any) -> bytes:
    """Decompress a coax checkpoint: ``lz4.frame.compress(cloudpickle.dumps(obj))``."""
    try:
        return lz4.frame.decompress(source.read(0, source.size))
    except RuntimeError as e:
        raise _Corrupt(f"legacy coax lz4 frame does not decompress: {e}") from None


# -- safe unpickling -----------------------------------------------------------------------

_SAFE_BUILTINS = frozenset(
    "bool bytearray bytes complex dict float frozenset int list object range set slice str "
    "tuple".split()
)
_SAFE_GLOBALS = frozenset(
    [
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        ("collections", "Counter"),
        ("copyreg", "_reconstructor"),
        ("copyreg", "__newobj__"),
        ("copyreg", "__newobj_ex__"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core._internal", "_convert_to_stringdtype_kwargs"),  # StringDType
        ("numpy.random._pickle", "__randomstate_ctor"),
        ("numpy.random._pickle", "__generator_ctor"),
        ("numpy.random._pickle", "__bit_generator_ctor"),
        ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"),
        ("jax._src.array", "_reconstruct_array"),
        (__name__, "_rebuild_ndarray"),
        (__name__, "_rebuild_jax_array"),
        (__name__, "_rebuild_jax_key"),
    ]
)
# Packages whose classes (not functions) are accepted: their states are plain data.
_SAFE_CLASS_PACKAGES = ("coax_utils", "haiku", "optax")
_NUMPY_PACKAGES = ("numpy", "ml_dtypes")


class _NdarrayToken:
    """Stands for ``numpy.ndarray`` in safe mode.

    The class itself is not safe to hand out: ``numpy.ndarray(shape, object, buffer)`` makes
    an object array whose pointers are bytes from the file. Pickles of object arrays only
    need it as the first argument of ``numpy._core.multiarray._reconstruct``.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsafeGlobalError(
            "refusing to call global 'numpy.ndarray': in safe mode it only rebuilds pickled "
            "arrays (it could turn bytes of the file into object pointers)"
        )


_NDARRAY_TOKEN = _NdarrayToken()


def _safe_reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """``numpy._core.multiarray._reconstruct`` restricted to plain ndarrays."""
    if subtype is not _NDARRAY_TOKEN:
        raise UnsafeGlobalError(f"refusing to reconstruct an array of type {subtype!r}")
    return np.ndarray.__new__(np.ndarray, shape, dtype)  # new memory, never a buffer


def _in_packages(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _is_numpy_data_class(obj: Any) -> bool:
    if isinstance(obj, np.ufunc):  # np.add & co. (the reducers of segment trees)
        return True
    if not isinstance(obj, type) or not _in_packages(obj.__module__, _NUMPY_PACKAGES):
        return False
    data_types = (np.generic, np.dtype, np.random.BitGenerator, np.random.SeedSequence)
    rng_types = (np.random.RandomState, np.random.Generator)
    return issubclass(obj, data_types) or obj in rng_types


class _SafeUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only globals naming data types (see :func:`loads`)."""

    def __init__(self, file: Any, *, buffers: Any, source: str) -> None:
        super().__init__(file, buffers=buffers)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("numpy", "ndarray"):
            return _NDARRAY_TOKEN
        if name == "_reconstruct" and module in ("numpy._core.multiarray", "numpy.core.multiarray"):
            return _safe_reconstruct
        # Import only inside the allowed packages, then check what the name really is (a
        # module may re-export a function or a foreign class under an innocent name).
        if _in_packages(module, _NUMPY_PACKAGES):
            obj = super().find_class(module, name)
            if _is_numpy_data_class(obj):
                return obj
        elif module == "jax.numpy":  # scalar types such as jnp.float32, used as dtypes
            obj = super().find_class(module, name)
            if isinstance(obj, type) and isinstance(getattr(obj, "dtype", None), np.dtype):
                return obj
        elif _in_packages(module, _SAFE_CLASS_PACKAGES):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and _in_packages(obj.__module__, _SAFE_CLASS_PACKAGES):
                return obj
        raise UnsafeGlobalError(
            f"refusing to load global '{module}.{name}' from {self._source}: safe=True allows "
            "only data (numpy/jax arrays and dtypes, numbers, strings, bytes, containers and "
            "classes of haiku, optax and coax_utils); load with safe=False only if you trust "
            "the source"
        )


def _unpickle(stream: Any, buffers: list[Any], safe: bool, source: str) -> Any:
    file = io.BytesIO(stream)
    if safe:
        return _SafeUnpickler(file, buffers=buffers, source=source).load()
    return pickle.Unpickler(file, buffers=buffers).load()


def _loads_from(data: Any, safe: bool, source: str) -> Any:
    legacy = bytes(data.read(0, min(4, data.size))) == _LZ4_FRAME_MAGIC
    try:
        if legacy:
            stream, buffers = _legacy_stream(data), []
        else:
            stream, buffers = _decode(data)
    except _Corrupt as e:
        raise ValueError(f"{source} is not a valid coax_utils checkpoint: {e}") from None
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        # malformed metadata or index (only reachable for data that merely looks like ours)
        raise ValueError(f"{source} is not a valid coax_utils checkpoint: {e!r}") from None
    if not legacy:
        return _unpickle(stream, buffers, safe, source)
    try:
        return _unpickle(stream, buffers, safe, source)
    except UnsafeGlobalError:
        raise
    except (pickle.UnpicklingError, EOFError) as e:  # legacy files carry no checksum
        raise ValueError(
            f"{source} is not a valid coax_utils checkpoint: the legacy coax pickle is "
            f"damaged ({e})"
        ) from None


# -- public API ----------------------------------------------------------------------------

_REFERENCES_WARNING = """
    .. warning::

        References between objects are only preserved if they are stored as part of a single
        object, for example:

        .. code-block:: python

            # b has a reference to a
            a = [13]
            b = {{'a': a}}

            # references preserved
            {dump_both}
            a_new, b_new = {load_both}
            b_new['a'].append(7)
            print(b_new)  # {{'a': [13, 7]}}
            print(a_new)  # [13, 7]         <-- updated

            # references not preserved
            {dump_a}
            {dump_b}
            a_new = {load_a}
            b_new = {load_b}
            b_new['a'].append(7)
            print(b_new)  # {{'a': [13, 7]}}
            print(a_new)  # [13]            <-- not updated!!

        Therefore, the safest way to create checkpoints is to store the entire state as a
        single object like a dict or a tuple.
"""


def _with_warning(**names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if fn.__doc__:  # None under python -OO
            text = _REFERENCES_WARNING.format(**names).lstrip("\n")
            fn.__doc__ = fn.__doc__.replace("    {references}\n", text)
        return fn

    return decorate


def _as_path(filepath: Any) -> str | bytes:
    if not isinstance(filepath, (str, bytes, os.PathLike)):
        raise TypeError(f"filepath must be a str or os.PathLike, got {type(filepath).__name__}")
    return os.fspath(filepath)


@_with_warning(
    dump_both="s = dumps((a, b))",
    load_both="loads(s)",
    dump_a="s_a = dumps(a)",
    dump_b="s_b = dumps(b)",
    load_a="loads(s_a)",
    load_b="loads(s_b)",
)
def dumps(obj: Any) -> bytes:
    """Serialize an object to an lz4-compressed pickle byte-string.

    The object is pickled with cloudpickle (protocol 5). The memory of numpy and jax arrays is
    passed out of band (no copy into the pickle stream) and compressed in chunks with lz4 on a
    few threads. The result starts with a versioned header and carries CRC-32 checksums of
    all its parts. jax arrays are copied to host memory and come back as jax arrays on the
    default device; numpy arrays come back as writable numpy arrays; dtypes (``bfloat16``,
    ``bool``, object arrays, ...) and shapes survive. See :doc:`/checkpoints` for the format.

    {references}

    Parameters
    ----------
    obj : object
        Any picklable Python object (with cloudpickle: lambdas and jitted functions too).

    Returns
    -------
    s : bytes
        The checkpoint, to be read back with :func:`loads`.

    Raises
    ------
    pickle.PicklingError, TypeError, AttributeError
        When ``obj`` (or something it refers to) cannot be pickled.

    Examples
    --------
    >>> import numpy as np
    >>> from coax_utils.utils import dumps, loads
    >>> state = {'step': 3, 'w': np.arange(6, dtype=np.float32).reshape(2, 3)}
    >>> restored = loads(dumps(state))
    >>> restored['step'], restored['w'].dtype, restored['w'].shape
    (3, dtype('float32'), (2, 3))
    """
    stream, buffers = _pickle(obj)
    capacity = _capacity(stream, buffers)
    api = _bytes_api() if capacity >= _DIRECT_JOIN_MIN else None
    if api is None:
        return _dumps_pieces(stream, buffers)
    builder = _BytesBuilder(api, capacity)
    try:
        size = _encode(stream, buffers, builder.write)
        return builder.finish(size)
    finally:
        builder.close()


@_with_warning(
    dump_both="s = dumps((a, b))",
    load_both="loads(s)",
    dump_a="s_a = dumps(a)",
    dump_b="s_b = dumps(b)",
    load_a="loads(s_a)",
    load_b="loads(s_b)",
)
def loads(s: bytes | bytearray | memoryview, safe: bool = False) -> Any:
    """Load an object from a byte-string that was created by :func:`dumps`.

    Byte-strings made by coax (``lz4.frame.compress(cloudpickle.dumps(obj))``) are read too.

    .. danger::

        With the default ``safe=False`` the data is unpickled, which can run arbitrary code:
        only load data from a source you trust. For anything else use ``safe=True``.

    {references}

    Parameters
    ----------
    s : bytes, bytearray or memoryview
        An lz4-compressed pickle byte-string.
    safe : bool, optional
        Refuse every global that is not plain data, so that no code from ``s`` ever runs.
        Allowed are numpy and jax arrays, numpy dtypes, scalars (``ml_dtypes`` ones too) and
        ufuncs (``np.add``, ...), numpy random generators, ``jax.numpy`` scalar types
        (``jnp.float32``, ...), numbers, strings, bytes, lists,
        tuples, dicts, sets, ``collections`` containers (``OrderedDict``, ``defaultdict``,
        ``deque``, ``Counter``) and classes defined in haiku, optax and coax_utils (their
        namedtuple and dataclass states, replay buffers, segment trees, ...). Functions,
        lambdas, jitted functions and classes from anywhere else are refused.

    Returns
    -------
    obj : object
        The restored object.

    Raises
    ------
    ValueError
        If ``s`` is not a valid coax_utils checkpoint: foreign data, truncated, or corrupted
        (checksum mismatch). The message says so; nothing is unpickled in that case.
    pickle.UnpicklingError
        With ``safe=True``, if ``s`` refers to a global that is not allowed; the message names
        the refused global (for instance ``'posix.system'``).

    Examples
    --------
    >>> from coax_utils.utils import dumps, loads
    >>> loads(dumps({'a': [1, 2.5, 'x']}), safe=True)
    {'a': [1, 2.5, 'x']}
    """
    if isinstance(s, str) or not isinstance(s, (bytes, bytearray, memoryview)):
        raise TypeError(f"s must be bytes, bytearray or memoryview, got {type(s).__name__}")
    return _loads_from(_MemorySource(memoryview(s).cast("B")), bool(safe), "the given data")


_OPEN_FLAGS = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _temp_basename() -> str:
    return f".coax_utils-{os.getpid()}-{secrets.token_hex(6)}.tmp"


# Direct I/O (Linux O_DIRECT): file writes that bypass the page cache, in blocks of
# DIRECT_BLOCK bytes from memory aligned to _ALIGN bytes. USE_O_DIRECT switches it off.
USE_O_DIRECT = True
DIRECT_BLOCK = 8 << 20
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on or off for ``fd``; return whether it is on afterwards."""
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)
    except OSError:  # EINVAL: the file system offers no direct I/O (tmpfs, some FUSE)
        return False


def _aligned_buffer(n: int) -> np.ndarray:
    raw = np.empty(n + _ALIGN, np.uint8)
    skip = -_address(raw) % _ALIGN
    return raw[skip : skip + n]


class _DirectWriter:
    """The ``write(offset, piece)`` of :func:`_encode` for a file opened with O_DIRECT.

    Pieces are copied into aligned staging blocks of ``DIRECT_BLOCK`` bytes; a block that is
    complete (the pieces tile the file, so: once as many bytes as it holds have arrived) goes
    to a writer thread that writes it with ``os.pwrite``, while the worker threads go on
    compressing. :meth:`finish` writes the last block padded to the alignment and truncates
    the file to its size. Should a direct write fail with EINVAL (an alignment the file
    system does not accept), O_DIRECT is switched off and the write repeated through the
    page cache.
    """

    def __init__(self, fd: int, capacity: int) -> None:
        import ctypes

        self._fd, self._memmove = fd, ctypes.memmove
        self.block = min(DIRECT_BLOCK, -(-capacity // _ALIGN) * _ALIGN)
        self._lock = threading.Lock()
        self._open: dict[int, list[Any]] = {}  # block index -> [buffer, bytes filled]
        self._free: list[np.ndarray] = []
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=4)  # bounds the memory in flight
        self._error: BaseException | None = None
        self._direct = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            index, buf, n = job
            if self._error is None:
                try:
                    self._pwrite(buf[:n], index * self.block)
                except BaseException as e:  # reported by finish(); keep draining the queue
                    self._error = e
            self._free.append(buf)

    def _pwrite(self, data: np.ndarray, offset: int) -> None:
        done = 0
        while done < data.size:
            try:
                done += os.pwrite(self._fd, data[done:], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not self._direct:
                    raise
                self._direct = _set_direct(self._fd, False)
                if self._direct:
                    raise

    def write(self, offset: int, piece: Any) -> None:
        src = np.frombuffer(piece, np.uint8)
        pos = 0
        while pos < src.size:
            index, within = divmod(offset + pos, self.block)
            n = min(self.block - within, src.size - pos)
            with self._lock:
                entry = self._open.get(index)
                if entry is None:
                    buf = self._free.pop() if self._free else _aligned_buffer(self.block)
                    entry = self._open[index] = [buf, 0]
            self._memmove(_address(entry[0]) + within, _address(src) + pos, n)
            with self._lock:
                entry[1] += n
                full = entry[1] == self.block
                if full:
                    del self._open[index]
            if full:
                self._queue.put((index, entry[0], self.block))
            pos += n

    def finish(self, size: int) -> None:
        """Write the last block, wait for the writes and truncate the file to ``size``."""
        last, n = divmod(size, self.block)
        if set(self._open) != ({last} if n else set()) or (n and self._open[last][1] != n):
            raise RuntimeError("checkpoint pieces do not tile the file")  # a bug
        if n:
            buf = self._open.pop(last)[0]
            padded = -(-n // _ALIGN) * _ALIGN
            buf[n:padded] = 0
            self._queue.put((last, buf, padded))
        self.close()
        if self._error is not None:
            raise self._error
        os.ftruncate(self._fd, size)

    def close(self) -> None:
        """Stop the writer thread (after the blocks already handed to it)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _write_fd(fd: int, stream: memoryview, buffers: list[memoryview]) -> None:
    if USE_O_DIRECT and _O_DIRECT and _set_direct(fd, True):
        writer = _DirectWriter(fd, _capacity(stream, buffers))
        try:
            writer.finish(_encode(stream, buffers, writer.write))
        finally:
            writer.close()
        os.fsync(fd)
        return
    _write_buffered(fd, stream, buffers)


def _write_buffered(fd: int, stream: memoryview, buffers: list[memoryview]) -> None:
    # Pieces are written at their offsets (os.pwrite, from the worker threads) as soon as
    # they are ready. Where the OS allows, each written piece is handed to write-back at once
    # (POSIX_FADV_DONTNEED starts it for dirty pages, without waiting), so the disk writes
    # overlap the compression of the next chunks and the final fsync has little left to do.
    advise = getattr(os, "posix_fadvise", None)
    pwrite = getattr(os, "pwrite", None)
    lock = threading.Lock()

    def write(offset: int, piece: Any) -> None:
        nonlocal advise
        view = memoryview(piece).cast("B")
        done = 0
        while done < view.nbytes:
            if pwrite is not None:
                done += pwrite(fd, view[done:], offset + done)
            else:
                with lock:  # one file position for all threads
                    os.lseek(fd, offset + done, os.SEEK_SET)
                    done += os.write(fd, view[done:])
        if advise is not None and view.nbytes >= 1 << 20:
            try:
                advise(fd, offset, view.nbytes, os.POSIX_FADV_DONTNEED)
            except OSError:  # a hint only
                advise = None

    _encode(stream, buffers, write)
    os.fsync(fd)


def _write_unnamed(dirname: str, stream: memoryview, buffers: list[memoryview]) -> str | None:
    """Write into an unnamed file (O_TMPFILE), then link it under a temporary name.

    Until it is linked, the file has no name at all: it disappears with the process, even a
    process killed with SIGKILL. Returns the temporary name, or None where the operating or
    file system offers no O_TMPFILE (the caller then uses a named temporary file).
    """
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        fd = os.open(dirname, _OPEN_FLAGS | os.O_TMPFILE, 0o666)
    except OSError:
        return None
    try:
        _write_fd(fd, stream, buffers)
        name = _temp_basename()
        dir_fd = os.open(dirname, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            # dst_dir_fd makes Python call linkat(), which follows the /proc magic link
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
        except OSError:
            return None
        finally:
            os.close(dir_fd)
        return os.path.join(dirname, name)
    finally:
        os.close(fd)


def _fsync_dir(dirname: str) -> None:
    if os.name == "nt":
        return
    fd = os.open(dirname, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(name: str | None) -> None:
    if name is not None:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


@_with_warning(
    dump_both="dump((a, b), 'ab.pkl.lz4')",
    load_both="load('ab.pkl.lz4')",
    dump_a="dump(a, 'a.pkl.lz4')",
    dump_b="dump(b, 'b.pkl.lz4')",
    load_a="load('a.pkl.lz4')",
    load_b="load('b.pkl.lz4')",
)
def dump(obj: Any, filepath: str | os.PathLike) -> None:
    """Save an object to disk.

    The file holds the same bytes :func:`dumps` returns. It is written atomically: the data
    goes to a temporary file in the same folder (unnamed where the OS supports ``O_TMPFILE``,
    so that not even a killed process leaves it behind), which is flushed, fsynced and
    renamed over ``filepath``; the folder is fsynced too. A dump that fails or is killed
    leaves the previous file at ``filepath`` intact. Missing parent folders are created.
    Where the file system supports it (Linux ``O_DIRECT``), the file is written with direct
    I/O, around the page cache, on a writer thread while the next chunks are compressed;
    elsewhere through the page cache. See :doc:`/checkpoints`.

    {references}

    Parameters
    ----------
    obj : object
        Any picklable Python object.
    filepath : str or os.PathLike
        Where to store the object.

    Raises
    ------
    TypeError
        If ``filepath`` is not a path.
    pickle.PicklingError, TypeError, AttributeError
        When ``obj`` cannot be pickled (nothing is written).
    OSError
        When the file cannot be written (the previous file is kept).

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> from coax_utils.utils import dump, load
    >>> path = os.path.join(tempfile.mkdtemp(), 'run', 'ckpt.pkl.lz4')
    >>> dump({'w': np.ones(3)}, path)
    >>> load(path)['w']
    array([1., 1., 1.])
    """
    path = _as_path(filepath)
    stream, buffers = _pickle(obj)  # pickling errors surface before any file is touched
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    tmp = None
    try:
        tmp = _write_unnamed(dirname, stream, buffers)
        if tmp is None:
            name = os.path.join(dirname, _temp_basename())
            fd = os.open(name, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o666)
            tmp = name
            try:
                _write_fd(fd, stream, buffers)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        tmp = None
    finally:
        _remove(tmp)
    _fsync_dir(dirname)


@_with_warning(
    dump_both="dump((a, b), 'ab.pkl.lz4')",
    load_both="load('ab.pkl.lz4')",
    dump_a="dump(a, 'a.pkl.lz4')",
    dump_b="dump(b, 'b.pkl.lz4')",
    load_a="load('a.pkl.lz4')",
    load_b="load('b.pkl.lz4')",
)
def load(filepath: str | os.PathLike, safe: bool = False) -> Any:
    """Load an object from a file that was created by :func:`dump`.

    Files written by coax (an lz4 frame of a cloudpickle) are read too.

    .. danger::

        With the default ``safe=False`` the file is unpickled, which can run arbitrary code:
        only load files you trust. For files from anywhere else use ``safe=True``.

    {references}

    Parameters
    ----------
    filepath : str or os.PathLike
        File to load.
    safe : bool, optional
        Refuse every global that is not plain data, so that no code from the file ever runs
        (see :func:`loads` for what is allowed).

    Returns
    -------
    obj : object
        The restored object.

    Raises
    ------
    ValueError
        If the file is not a valid coax_utils checkpoint: foreign, truncated or corrupted
        (checksum mismatch). The message names the file; nothing is unpickled in that case.
    pickle.UnpicklingError
        With ``safe=True``, if the file refers to a global that is not allowed; the message
        names the refused global and the file.
    OSError
        If the file cannot be read.

    Examples
    --------
    >>> import os, tempfile
    >>> from coax_utils.utils import dump, load
    >>> path = os.path.join(tempfile.mkdtemp(), 'ckpt.pkl.lz4')
    >>> dump({'episode': 7, 'name': 'cartpole'}, path)
    >>> load(path, safe=True)
    {'episode': 7, 'name': 'cartpole'}
    """
    path = _as_path(filepath)
    source = f"file {os.fsdecode(path)!r}"
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "preadv"):
            data: Any = _FileSource(f.fileno(), os.fstat(f.fileno()).st_size)
        else:
            data = _MemorySource(memoryview(f.read()))
        return _loads_from(data, bool(safe), source)
