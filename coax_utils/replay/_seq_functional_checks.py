"""Checks of restored states of the jittable sequence buffers.

A checkpoint rebuilds a :class:`SequenceBufferState` or
:class:`PrioritizedSequenceBufferState` field by field; their ``__checkpoint_check__``
calls :func:`check_restored_sequence_state`, which refuses (ValueError) a state that no
sequence of ``add``, ``reset_chains`` and ``update`` calls can produce and that would make
the buffer read or sample the wrong rows. The checks run on host copies of the small arrays
and of the rows' metadata (never of the steps, whose padding is checked where they are),
vectorised, with any leading batch axes of a :func:`jax.vmap` of buffers (the shape of
``pos``; every other field has them in front); a refusal names the batch position of the
first buffer at fault.

Invariants (per buffer of the batch; ``C`` the capacity, the axis after the batch axes of
``windows``, ``E`` the sub-envs, of ``chain_n``, and ``L`` the window length, the axis after
``E`` of the pending steps):

- the leaves of ``pending`` and ``pending_core`` are ``(E, L, ...)`` after the batch axes;
  ``windows`` is uint32 ``(C, W)`` after them, ``W`` the words of a window's row as they
  lay it out (``coax_utils/replay/_seq_layout.py``), ``C >= 1``;
- ``pos``, ``size``, ``laps`` are int32 of the batch shape; ``0 <= size <= C``,
  ``0 <= pos < C``, ``pos == size`` while ``size < C`` (the ring fills from slot 0);
  ``laps`` in ``[0, 2**31 - 1]``, 0 exactly while the buffer is not full;
- the metadata of the rows (``seq_len``, ``seq_end``, ``seq_first``): filled slots hold 1
  to ``L`` valid steps (fewer only at an episode end: ``seq_end`` 1 or 2), end kinds in
  ``{0, 1, 2}``; empty slots hold 0, 0, False;
- ``chain_n`` int32, ``chain_first`` bool and ``chain_start`` int32, ``(E,)`` after the
  batch axes: ``chain_n < L``, and ``>= 0`` for a chain at its episode's first window;
  ``chain_start`` in ``[0, L)``;
- in every filled slot, the steps past the valid ones hold the last valid step (samples
  return them as the padding; checked on the device, in one pass over the steps, the only
  check that reads them);

and for a prioritized state: the sum tree holds ``C`` float32 values (batch axes in front)
and is consistent, empty slots have priority 0 and filled ones a positive priority, and
``max_mix`` is a finite float32 >= 1 of the batch shape.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils.replay._batch_checks import ARRAY_TYPES, host_array, refuse_if
from coax_utils.replay._seq_layout import window_layout
from coax_utils.utils import SumTreeState

__all__ = ["check_restored_sequence_state"]


def _rows(x: Any, name: str, batch: tuple, what: str) -> int:
    """The length of the one axis ``x`` has after the batch axes (``what`` names it)."""
    if not isinstance(x, ARRAY_TYPES) or x.ndim != len(batch) + 1 or x.shape[:-1] != batch:
        shape = tuple(x.shape) if isinstance(x, ARRAY_TYPES) else type(x).__name__
        raise ValueError(f"{name} must be an array of shape {batch + (what,)}, got {shape}")
    if x.shape[-1] < 1:
        raise ValueError(f"{name} must hold at least one entry, got shape {tuple(x.shape)}")
    return int(x.shape[-1])


def _leaves(tree: Any, name: str, rows: tuple) -> tuple[list, Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for k, x in enumerate(leaves):
        if not isinstance(x, ARRAY_TYPES) or tuple(x.shape[: len(rows)]) != rows:
            raise ValueError(f"leaf {k} of {name} must be an array with the rows {rows} in front")
    return leaves, treedef


def check_restored_sequence_state(state: Any, prioritized: bool) -> None:
    """Raise ValueError unless ``state`` keeps every invariant of this module's docstring."""
    if not isinstance(state.pos, ARRAY_TYPES):
        raise ValueError(f"pos must be an array, got {type(state.pos).__name__}")
    batch = tuple(state.pos.shape)
    nb = len(batch)
    pos = host_array(state.pos, "pos", np.int32, batch).astype(np.int64)
    size = host_array(state.size, "size", np.int32, batch).astype(np.int64)
    laps = host_array(state.laps, "laps", np.int32, batch)
    E = _rows(state.chain_n, "chain_n", batch, "num_envs")
    pending, _ = _leaves(state.pending, "pending", batch + (E,))
    if not pending or pending[0].ndim < nb + 2 or pending[0].shape[nb + 1] < 1:
        raise ValueError(f"pending must hold arrays of shape {batch} + (num_envs, length, ...)")
    L = int(pending[0].shape[nb + 1])
    _leaves(state.pending, "pending", batch + (E, L))
    _leaves(state.pending_core, "pending_core", batch + (E, L))
    width = window_layout(state.pending, state.pending_core, nb).width
    windows = state.windows
    if (
        not isinstance(windows, ARRAY_TYPES)
        or windows.dtype != np.uint32
        or windows.ndim != nb + 2
        or windows.shape[:nb] != batch
        or windows.shape[-1] != width
        or windows.shape[nb] < 1
    ):
        shape = tuple(windows.shape) if isinstance(windows, ARRAY_TYPES) else type(windows)
        raise ValueError(
            f"windows must be uint32 of shape {batch} + (capacity, {width}) (a row of words "
            f"per window, as the pending steps and core states lay it out), got {shape}"
        )
    C = int(windows.shape[nb])
    refuse_if(
        (size < 0) | (size > C) | (pos < 0) | (pos >= C) | ((size < C) & (pos != size)),
        nb,
        f"pos and size must lie in [0, {C}) and [0, {C}], pos == size until the buffer is "
        f"full, got pos {pos.tolist()} and size {size.tolist()}",
    )
    refuse_if(
        (laps < 0) | ((size == C) == (laps == 0)),
        nb,
        f"laps must be 0 exactly while the buffer is not full, got {laps.tolist()}",
    )
    seq_len = np.asarray(state.seq_len)
    seq_end = np.asarray(state.seq_end)
    seq_first = np.asarray(state.seq_first)
    n = host_array(state.chain_n, "chain_n", np.int32, batch + (E,))
    first = host_array(state.chain_first, "chain_first", np.bool_, batch + (E,))
    start = host_array(state.chain_start, "chain_start", np.int32, batch + (E,))
    filled = np.arange(C) < size[..., None]
    refuse_if(
        (filled & ((seq_len < 1) | (seq_len > L)))
        | (~filled & ((seq_len != 0) | (seq_end != 0) | seq_first))
        | (seq_end < 0)
        | (seq_end > 2)
        | (filled & (seq_len < L) & (seq_end == 0)),
        nb,
        f"stored windows must have 1 to {L} valid steps (fewer only at an episode end), "
        "end kinds 0, 1 or 2, and empty slots all 0",
    )
    refuse_if(
        (n >= L) | (first & (n < 0)) | (start < 0) | (start >= L),
        nb,
        f"chain_n must be < {L}, and >= 0 at an episode's first window; chain_start in [0, {L})",
    )
    steps = jax.tree_util.tree_leaves(state.steps)
    unpadded = [np.asarray(_unpadded(x, seq_len, nb)) for x in steps]
    refuse_if(
        np.any(unpadded, axis=0),
        nb,
        "the steps past a window's valid ones must hold its last valid step (the padding)",
    )
    if prioritized:
        _check_priorities(state, batch, C, filled)


@functools.partial(jax.jit, static_argnums=2)
def _unpadded(x: jax.Array, seq_len: jax.Array, nb: int) -> jax.Array:
    """Per buffer of the batch (``nb`` axes): whether a filled slot of the steps leaf ``x``
    holds, past its valid steps, anything but its last valid step (NaN equal to NaN)."""
    lengths = seq_len.reshape(seq_len.shape + (1,) * (x.ndim - nb - 1))
    last = jnp.take_along_axis(x, jnp.maximum(lengths, 1) - 1, axis=nb + 1)
    t = jnp.arange(x.shape[nb + 1]).reshape((-1,) + (1,) * (x.ndim - nb - 2))
    same = x == last
    if jnp.issubdtype(x.dtype, jnp.inexact):  # a NaN step pads with NaN
        same = same | (jnp.isnan(x) & jnp.isnan(last))
    bad = (t >= lengths) & (lengths >= 1) & ~same
    return jnp.any(bad, axis=tuple(range(nb, x.ndim)))


def _check_priorities(state: Any, batch: tuple, C: int, filled: np.ndarray) -> None:
    nb = len(batch)
    tree = state.tree
    if not isinstance(tree, SumTreeState) or tree.capacity != C:
        raise ValueError(f"tree must be a SumTreeState of capacity {C}")
    tree.__checkpoint_check__()  # the trees on their own: shapes, sums, padding, signs
    nodes = np.asarray(tree.nodes)
    if nodes.dtype != np.float32 or nodes.shape[:-1] != batch:
        raise ValueError(
            f"the sum tree's nodes must be float32 with the batch shape {batch} in front, got "
            f"{nodes.dtype} of shape {nodes.shape}"
        )
    values = nodes[..., tree.num_leaves : tree.num_leaves + C]
    refuse_if(
        (~filled & (values != 0)) | (filled & ~(values > 0)),
        nb,
        "empty slots must have priority 0 and filled ones a positive one",
    )
    top = host_array(state.max_mix, "max_mix", np.float32, batch)
    refuse_if(
        ~(np.isfinite(top) & (top >= 1)),
        nb,
        f"max_mix must be a finite float32 >= 1, got {top.tolist()}",
    )
