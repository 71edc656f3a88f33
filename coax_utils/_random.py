"""Random numbers for jitted sampling, drawn through :mod:`jax.random` with the caller's key.

Every function takes the caller's key, typed or raw, of whatever implementation (threefry,
rbg, unsafe_rbg), and draws its words with :func:`jax.random.bits`: same key, same numbers.

Indices are drawn in blocks. On a CPU, XLA runs an integer remainder over more than a few
dozen words on several threads, and handing the work over costs more than the arithmetic:
inside a jitted uniform sample of 256 items from a buffer, drawing the indices in one call
took about 150 us, against 55 us for 16 blocks of 16 words in a compiled loop. Up to
:data:`MAX_BLOCKED` indices are therefore drawn in blocks of :data:`BLOCK` under the keys
``fold_in(key, block)``, the remainder taken block by block: in a loop on a CPU, vectorised
over the blocks elsewhere (the same words either way for threefry keys; jax's rbg words
differ between backends and under ``vmap`` in any case). Larger draws are one call.

Uniform floats are one call: their conversion (a shift, a cast, a product) stays on one
thread, and a loop of blocks cost more than it saved (a jitted sum-tree sample-and-update
step of 32 items took about 60 us with blocks, 28 us with one call).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BLOCK", "MAX_BLOCKED", "random_bits", "random_index", "random_uniform"]

BLOCK = 16
MAX_BLOCKED = 512


def _block(key: jax.Array, i: jax.Array) -> jax.Array:
    return jax.random.bits(jax.random.fold_in(key, i), (BLOCK,), jnp.uint32)


def _blocks_in_loop(key: jax.Array, blocks: int, fn: Callable = lambda w: w) -> jax.Array:
    def body(i: jax.Array, out: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(out, fn(_block(key, i)), (i * BLOCK,))

    dtype = jax.eval_shape(fn, jax.ShapeDtypeStruct((BLOCK,), jnp.uint32)).dtype
    return jax.lax.fori_loop(0, blocks, body, jnp.zeros((blocks * BLOCK,), dtype))


def _blocks_vectorised(key: jax.Array, blocks: int, fn: Callable = lambda w: w) -> jax.Array:
    return fn(jax.vmap(_block, in_axes=(None, 0))(key, jnp.arange(blocks)).reshape(-1))


def _draw(key: jax.Array, n: int, fn: Callable) -> jax.Array:
    """``fn`` (elementwise) of ``n`` random words; ``fn`` runs block by block on a CPU."""
    if n > MAX_BLOCKED:
        return fn(jax.random.bits(key, (n,), jnp.uint32))
    blocks = -(-n // BLOCK)
    out = jax.lax.platform_dependent(
        key,
        cpu=lambda key: _blocks_in_loop(key, blocks, fn),
        default=lambda key: _blocks_vectorised(key, blocks, fn),
    )
    return out[:n]


def random_bits(key: jax.Array, n: int) -> jax.Array:
    """``n`` random ``uint32`` words (``n`` static) from ``key``."""
    return _draw(key, n, lambda words: words)


def random_index(key: jax.Array, shape: tuple[int, ...], span: jax.Array) -> jax.Array:
    """int32 numbers in ``[0, span)`` (``span >= 1``, may be traced) of a static ``shape``.

    32 random bits reduced modulo ``span``: uniform up to a relative bias below
    ``span / 2**32``.
    """
    span = jnp.maximum(span, 1).astype(jnp.uint32)
    n = int(np.prod(shape, dtype=np.int64))
    return _draw(key, n, lambda words: (words % span).astype(jnp.int32)).reshape(shape)


def random_uniform(key: jax.Array, n: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``n`` uniform numbers in ``[0, 1)`` of a floating ``dtype``.

    For float32 the top 24 bits of each word give the number (a multiple of ``2**-24``, exact
    in float32); other types take :func:`jax.random.uniform` (its precision for the type).
    """
    dtype = jnp.dtype(dtype)
    if dtype != jnp.float32:
        return jax.random.uniform(key, (n,), dtype)
    words = jax.random.bits(key, (n,), jnp.uint32)
    return (words >> 8).astype(jnp.float32) * np.float32(2.0**-24)
