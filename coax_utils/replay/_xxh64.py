"""XXH64, the 64-bit xxHash of Yann Collet (seed 0), compiled with numba (imported lazily).

The checksum of replay-folder leaves: a non-cryptographic hash that runs at several GB/s on
one core (three to four times zlib's CRC-32), so verifying a leaf costs little next to copying
its bytes. It follows the reference algorithm (https://github.com/Cyan4973/xxHash,
``doc/xxhash_spec.md``): the 8-byte words of the input are read little-endian, which is
the byte order of the machines that run numba's little-endian targets (x86-64, AArch64).
"""

from __future__ import annotations

import sys

import numba
import numpy as np

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("the XXH64 kernel reads words in the machine's order: little-endian only")

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@numba.njit(cache=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@numba.njit(cache=True, inline="always")
def _round(acc, word):
    return _rotl(acc + word * _P2, 31) * _P1


@numba.njit(cache=True, inline="always")
def _merge(h, v):
    return (h ^ _round(np.uint64(0), v)) * _P1 + _P4


@numba.njit(cache=True, nogil=True)
def _xxh64(data, words):
    # data: the input bytes (uint8); words: its first len(data) // 8 bytes as uint64
    n, stripes = data.size, data.size // 32
    if n >= 32:
        v1, v2 = _P1 + _P2, _P2
        v3, v4 = np.uint64(0), np.uint64(0) - _P1
        for s in range(stripes):
            v1 = _round(v1, words[4 * s])
            v2 = _round(v2, words[4 * s + 1])
            v3 = _round(v3, words[4 * s + 2])
            v4 = _round(v4, words[4 * s + 3])
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(_merge(_merge(_merge(h, v1), v2), v3), v4)
    else:
        h = _P5
    h += np.uint64(n)
    i = 4 * stripes  # words consumed
    while i < n // 8:
        h = _rotl(h ^ _round(np.uint64(0), words[i]), 27) * _P1 + _P4
        i += 1
    b = 8 * i
    if n - b >= 4:
        k = np.uint64(0)
        for j in range(4):
            k |= np.uint64(data[b + j]) << np.uint64(8 * j)
        h = _rotl(h ^ (k * _P1), 23) * _P2 + _P3
        b += 4
    while b < n:
        h = _rotl(h ^ (np.uint64(data[b]) * _P5), 11) * _P1
        b += 1
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h


def xxh64(data: np.ndarray) -> int:
    """The XXH64 (seed 0) of the bytes of ``data``, a contiguous one-dimensional uint8 array
    (the GIL is released while it runs)."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
        raise TypeError("data must be a contiguous one-dimensional uint8 array")
    return int(_xxh64(data, data[: data.size // 8 * 8].view(np.uint64)))
