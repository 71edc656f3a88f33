"""The XXH64 kernel of the replay-folder checksums: the published values of the reference
implementation, and a plain-Python transcription of the algorithm on every tail length."""

import numpy as np
import pytest

from coax_utils.replay._xxh64 import xxh64

M = 2**64 - 1
P1, P2, P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P4, P5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5


def rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M


def rnd(acc, word):
    return rotl((acc + word * P2) & M, 31) * P1 & M


def word(b, i, n):
    return int.from_bytes(b[i : i + n], "little")


def reference(b: bytes) -> int:
    """XXH64 with seed 0, as written in the xxHash specification."""
    n, i = len(b), 0
    if n >= 32:
        v = [(P1 + P2) & M, P2, 0, -P1 & M]
        while i + 32 <= n:
            v = [rnd(v[j], word(b, i + 8 * j, 8)) for j in range(4)]
            i += 32
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M
        for x in v:
            h = ((h ^ rnd(0, x)) * P1 + P4) & M
    else:
        h = P5
    h = (h + n) & M
    while i + 8 <= n:
        h = (rotl(h ^ rnd(0, word(b, i, 8)), 27) * P1 + P4) & M
        i += 8
    if i + 4 <= n:
        h = (rotl(h ^ (word(b, i, 4) * P1 & M), 23) * P2 + P3) & M
        i += 4
    for byte in b[i:]:
        h = rotl(h ^ (byte * P5 & M), 11) * P1 & M
    h = (h ^ (h >> 33)) * P2 & M
    h = (h ^ (h >> 29)) * P3 & M
    return h ^ (h >> 32)


def of(b: bytes) -> int:
    return xxh64(np.frombuffer(b, np.uint8))


def test_published_values():
    assert of(b"") == 0xEF46DB3751D8E999
    assert of(b"a") == 0xD24EC4F1A98C6E5B
    assert of(b"abc") == 0x44BC2CF5AD770999
    assert of(b"Nobody inspects the spammish repetition") == 0xFBCEA83C8A378BF1


def test_every_length_and_offset_matches_the_reference():
    data = np.random.default_rng(0).integers(0, 256, 4096 + 64, np.uint8)
    for n in [*range(0, 130), 1000, 4096 + 7]:
        for offset in (0, 1, 3):  # unaligned starts, as slices of a larger array
            piece = data[offset : offset + n]
            assert xxh64(piece) == reference(piece.tobytes()), (n, offset)


def test_one_changed_bit_changes_the_hash():
    data = np.random.default_rng(1).integers(0, 256, 1 << 16, np.uint8)
    h = xxh64(data)
    for i in (0, 1, 7, 8, 31, 32, 4095, len(data) - 5, len(data) - 1):
        changed = data.copy()
        changed[i] ^= 0x80
        assert xxh64(changed) != h


def test_it_takes_contiguous_bytes_only():
    for bad in (np.zeros(8, np.int16), np.zeros((2, 4), np.uint8), np.zeros(8, np.uint8)[::2]):
        with pytest.raises(TypeError, match="contiguous one-dimensional uint8 array"):
            xxh64(bad)
