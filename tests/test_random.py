"""Random draws of the jitted buffers: jax.random words of the caller's key (indices in blocks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import _random
from coax_utils._random import BLOCK, MAX_BLOCKED, random_bits, random_index, random_uniform

KEYS = {
    "threefry": lambda seed: jax.random.key(seed),
    "rbg": lambda seed: jax.random.key(seed, impl="rbg"),
    "raw": lambda seed: jax.random.PRNGKey(seed),
}


def reference_words(key, n):
    """The documented stream, built word by word: block b is bits(fold_in(key, b), 16)."""
    if n > MAX_BLOCKED:
        return np.asarray(jax.random.bits(key, (n,), jnp.uint32))
    blocks = [
        np.asarray(jax.random.bits(jax.random.fold_in(key, b), (BLOCK,), jnp.uint32))
        for b in range(-(-n // BLOCK))
    ]
    return np.concatenate(blocks)[:n]


@pytest.mark.parametrize("impl", sorted(KEYS))
@pytest.mark.parametrize("n", [1, 15, 16, 17, 256, MAX_BLOCKED, MAX_BLOCKED + 1, 1000])
def test_words_are_the_callers_key_stream(impl, n):
    key = KEYS[impl](3)
    got = np.asarray(jax.jit(random_bits, static_argnums=1)(key, n))
    assert got.dtype == np.uint32 and got.shape == (n,)
    np.testing.assert_array_equal(got, reference_words(key, n))
    other = np.asarray(random_bits(KEYS[impl](4), n))
    assert not np.array_equal(got, other)


@pytest.mark.parametrize("impl", ["threefry", "raw"])
def test_loop_and_vectorised_blocks_give_the_same_words(impl):
    # the CPU runs the loop; other backends run the vectorised form: both are checked here
    # (threefry only: jax's rbg words change under vmap and from one backend to another)
    key = KEYS[impl](7)
    for blocks in (1, 3, 32):
        loop = jax.jit(_random._blocks_in_loop, static_argnums=1)(key, blocks)
        vectorised = jax.jit(_random._blocks_vectorised, static_argnums=1)(key, blocks)
        np.testing.assert_array_equal(np.asarray(loop), np.asarray(vectorised))
        np.testing.assert_array_equal(np.asarray(loop), reference_words(key, blocks * BLOCK))


def test_index_is_uniform_and_in_range():
    key = jax.random.key(0)
    draw = jax.jit(random_index, static_argnums=1)
    got = np.asarray(draw(key, (4, 8), jnp.int32(5)))
    assert got.shape == (4, 8) and got.dtype == np.int32
    np.testing.assert_array_equal(got.ravel(), reference_words(key, 32) % 5)
    # a traced span of 0 draws zeros rather than dividing by zero
    assert not np.asarray(draw(key, (3,), jnp.int32(0))).any()
    t = np.concatenate(
        [np.asarray(draw(k, (256,), jnp.int32(7))) for k in jax.random.split(key, 100)]
    )
    counts = np.bincount(t, minlength=7)
    assert np.abs(counts - t.size / 7).max() < 6 * np.sqrt(t.size / 7)


def test_uniform_is_the_top_24_bits_in_float32_and_full_precision_otherwise():
    key = jax.random.key(1)
    u = np.asarray(jax.jit(random_uniform, static_argnums=1)(key, 300))
    assert u.dtype == np.float32
    words = np.asarray(jax.random.bits(key, (300,), jnp.uint32))  # one call, not blocks
    np.testing.assert_array_equal(u, (words >> 8) * np.float32(2.0**-24))
    assert u.min() >= 0 and u.max() < 1
    # the largest word maps below 1
    top = (np.uint32(2**32 - 1) >> 8) * np.float32(2.0**-24)
    assert top < 1
    half = np.asarray(random_uniform(key, 64, jnp.float16))
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, np.asarray(jax.random.uniform(key, (64,), jnp.float16)))
