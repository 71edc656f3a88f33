"""Pytrees of arrays packed side by side into rows of ``uint32`` words.

A table whose row holds every field of a record is read with one gather (and written with
one scatter) instead of one per field. On a CPU, XLA runs each gather of a jitted step as a
task of its own, split over threads, and the hand-over costs more than copying a few
kilobytes: in a jitted sequence-replay step, reading 32 windows with their core states and
metadata from one table of words took about a quarter of the time of eight gathers, one per
field.

Each leaf takes whole words (its bytes padded with zeros to a multiple of four), so leaves of
four-byte dtypes are read back with a bitcast alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RowLayout"]


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where each leaf of a pytree lies in a row of ``width`` uint32 words (static).

    ``fields`` holds, per leaf: its first and past-the-last word, its dtype and its shape.
    """

    treedef: Any
    fields: tuple[tuple[int, int, np.dtype, tuple[int, ...]], ...]
    width: int

    @classmethod
    def of(cls, example: Any) -> RowLayout:
        """The layout of a row shaped like ``example`` (arrays or ``jax.ShapeDtypeStruct``)."""
        leaves, treedef = jax.tree_util.tree_flatten(example)
        fields, start = [], 0
        for x in leaves:
            dtype, shape = np.dtype(x.dtype), tuple(int(d) for d in np.shape(x))
            words = -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // 4)
            fields.append((start, start + words, dtype, shape))
            start += words
        return cls(treedef, tuple(fields), start)

    def pack(self, tree: Any) -> jax.Array:
        """The rows of ``tree``: leaves shaped ``lead + shape`` give ``lead + (width,)``."""
        leaves = self.treedef.flatten_up_to(tree)
        cols = []
        for x, (start, stop, dtype, shape) in zip(leaves, self.fields):
            x = jnp.asarray(x)
            lead = x.shape[: x.ndim - len(shape)]
            cols.append(_to_words(x.astype(dtype), lead, stop - start))
        return jnp.concatenate(cols, axis=-1)

    def unpack(self, rows: jax.Array) -> Any:
        """The pytree held in ``rows`` (``lead + (width,)`` uint32; leading axes kept)."""
        lead = rows.shape[:-1]
        leaves = [
            _from_words(rows[..., start:stop], lead, dtype, shape)
            for start, stop, dtype, shape in self.fields
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _to_words(x: jax.Array, lead: tuple, words: int) -> jax.Array:
    if x.dtype.itemsize % 4 == 0:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(lead + (words,))
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    b = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(lead + (-1,))
    b = jnp.pad(b, [(0, 0)] * len(lead) + [(0, 4 * words - b.shape[-1])])
    return jax.lax.bitcast_convert_type(b.reshape(lead + (words, 4)), jnp.uint32)


def _from_words(w: jax.Array, lead: tuple, dtype: np.dtype, shape: tuple) -> jax.Array:
    if dtype.itemsize % 4 == 0:
        w = w.reshape(lead + (-1, dtype.itemsize // 4)) if dtype.itemsize > 4 else w
        return jax.lax.bitcast_convert_type(w, dtype).reshape(lead + shape)
    b = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(lead + (-1,))
    b = b[..., : int(np.prod(shape, dtype=np.int64)) * dtype.itemsize]
    if dtype == np.bool_:
        return (b != 0).reshape(lead + shape)
    if dtype.itemsize > 1:
        b = b.reshape(lead + (-1, dtype.itemsize))
    return jax.lax.bitcast_convert_type(b, dtype).reshape(lead + shape)
