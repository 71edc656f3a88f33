"""The layout of a jittable sequence buffer's stored windows: a row of ``uint32`` words per
window (:class:`~coax_utils._rows.RowLayout`), its metadata first, then its steps and the
core state at its first step, so that a sample reads each window with one gather."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from coax_utils._rows import RowLayout

__all__ = ["META_LAYOUT", "decoded_windows", "window_layout"]

# every window's metadata, in the first words of its row (read alone by ``update``)
_META = {
    "seq_len": jax.ShapeDtypeStruct((), jnp.int32),
    "seq_end": jax.ShapeDtypeStruct((), jnp.int8),
    "seq_first": jax.ShapeDtypeStruct((), jnp.bool_),
}
META_LAYOUT = RowLayout.of(_META)


def window_layout(pending: Any, pending_core: Any, batch_ndim: int = 0) -> RowLayout:
    """The layout of a stored window's row, from a state's ``pending`` and ``pending_core``
    (leaves ``(num_envs, length, ...)`` after ``batch_ndim`` batch axes): a pair, the
    metadata (:data:`META_LAYOUT`, first) and a dict of the ``steps`` and ``core``."""

    def per(skip: int) -> Any:
        return lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[batch_ndim + skip :], x.dtype)

    body = {
        "steps": jax.tree_util.tree_map(per(1), pending),
        "core": jax.tree_util.tree_map(per(2), pending_core),
    }
    return RowLayout.of((_META, body))


def decoded_windows(state: Any) -> dict:
    """Every stored window of ``state`` decoded (batch axes of a vmapped state kept)."""
    nb = jnp.ndim(state.pos)
    meta, body = window_layout(state.pending, state.pending_core, nb).unpack(state.windows)
    return {**meta, **body}
