"""Checks of restored states of the jittable sequence buffers.

A checkpoint rebuilds a :class:`SequenceBufferState` or
:class:`PrioritizedSequenceBufferState` field by field; their ``__checkpoint_check__``
calls :func:`check_restored_sequence_state`, which refuses (ValueError) a state that no
sequence of ``add``, ``reset_chains`` and ``update`` calls can produce and that would make
the buffer read or sample the wrong rows. States of one buffer (no :func:`jax.vmap` batch
axes). With ``C`` the capacity (the length of ``seq_len``), ``E`` the sub-envs (of
``chain_n``) and ``L`` the window length (the second axis of the stored steps):

- ``pos``, ``size``, ``laps`` are int32 scalars; ``0 <= size <= C``, ``0 <= pos < C``,
  ``pos == size`` while ``size < C`` (the ring fills from slot 0); ``laps`` in
  ``[0, 2**31 - 1]``, 0 exactly while the buffer is not full;
- ``seq_len`` int32, ``seq_end`` int8, ``seq_first`` bool, all ``(C,)``: filled slots hold
  1 to ``L`` valid steps (fewer only at an episode end: ``seq_end`` 1 or 2), end kinds in
  ``{0, 1, 2}``; empty slots hold 0, 0, False;
- ``chain_n`` int32, ``chain_first`` bool and ``chain_start`` int32, ``(E,)``:
  ``chain_n < L``, and ``>= 0`` for a chain at its episode's first window; ``chain_start``
  in ``[0, L)``;
- the leaves of ``steps`` are ``(C, L, ...)``, those of ``pending`` have the structure of
  ``steps`` and are ``(E, L, ...)`` with the same dtypes and per-step shapes; ``core``
  ``(C, ...)`` and ``pending_core`` ``(E, L, ...)`` likewise;

and for a prioritized state: the sum tree holds ``C`` float32 values and is consistent,
empty slots have priority 0 and filled ones a positive priority, and ``max_mix`` is a
finite float32 >= 1.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from coax_utils.utils import SumTreeState

__all__ = ["check_restored_sequence_state"]

_ARRAYS = (np.ndarray, np.generic, jax.Array)


def _array(x: Any, name: str, dtype: Any, shape: tuple | None = None) -> np.ndarray:
    if not isinstance(x, _ARRAYS):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if np.dtype(x.dtype) != np.dtype(dtype) or (shape is not None and x.shape != shape):
        raise ValueError(
            f"{name} must be {np.dtype(dtype)} of shape {shape}, got {x.dtype} of shape "
            f"{tuple(x.shape)}"
        )
    return np.asarray(x)


def _leaves(tree: Any, name: str, rows: tuple) -> tuple[list, Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for k, x in enumerate(leaves):
        if not isinstance(x, _ARRAYS) or tuple(x.shape[: len(rows)]) != rows:
            raise ValueError(f"leaf {k} of {name} must be an array with the rows {rows} in front")
    return leaves, treedef


def _pair(a: Any, b: Any, skip_a: int, skip_b: int, names: str, rows: tuple) -> None:
    la, da = _leaves(a, names.split(" and ")[0], rows[0])
    lb, db = _leaves(b, names.split(" and ")[1], rows[1])
    if da != db or any(
        x.dtype != y.dtype or x.shape[skip_a:] != y.shape[skip_b:] for x, y in zip(la, lb)
    ):
        raise ValueError(f"{names} must have one structure, dtypes and per-step shapes")


def check_restored_sequence_state(state: Any, prioritized: bool) -> None:
    """Raise ValueError unless ``state`` keeps every invariant of this module's docstring."""
    seq_len = state.seq_len
    if not isinstance(seq_len, _ARRAYS) or seq_len.ndim != 1 or seq_len.shape[0] < 1:
        raise ValueError("seq_len must be an array of shape (capacity,)")
    C = seq_len.shape[0]
    seq_len = _array(seq_len, "seq_len", np.int32)
    seq_end = _array(state.seq_end, "seq_end", np.int8, (C,))
    seq_first = _array(state.seq_first, "seq_first", np.bool_, (C,))
    pos = int(_array(state.pos, "pos", np.int32, ()))
    size = int(_array(state.size, "size", np.int32, ()))
    laps = int(_array(state.laps, "laps", np.int32, ()))
    if not (0 <= size <= C and 0 <= pos < C and (size == C or pos == size)):
        raise ValueError(
            f"pos and size must lie in [0, {C}) and [0, {C}], pos == size until the buffer is "
            f"full, got pos {pos} and size {size}"
        )
    if laps < 0 or (size == C) == (laps == 0):
        raise ValueError(f"laps must be 0 exactly while the buffer is not full, got {laps}")
    steps, _ = _leaves(state.steps, "steps", (C,))
    if not steps or steps[0].ndim < 2:
        raise ValueError("steps must hold arrays of shape (capacity, length, ...)")
    L = steps[0].shape[1]
    chain_n = state.chain_n
    if not isinstance(chain_n, _ARRAYS) or chain_n.ndim != 1 or chain_n.shape[0] < 1:
        raise ValueError("chain_n must be an array of shape (num_envs,)")
    E = chain_n.shape[0]
    n = _array(chain_n, "chain_n", np.int32)
    first = _array(state.chain_first, "chain_first", np.bool_, (E,))
    start = _array(state.chain_start, "chain_start", np.int32, (E,))
    _pair(state.steps, state.pending, 2, 2, "steps and pending", ((C, L), (E, L)))
    _pair(state.core, state.pending_core, 1, 2, "core and pending_core", ((C,), (E, L)))
    filled = np.arange(C) < size
    if (
        np.any(filled & ((seq_len < 1) | (seq_len > L)))
        or np.any(~filled & ((seq_len != 0) | (seq_end != 0) | seq_first))
        or np.any((seq_end < 0) | (seq_end > 2))
        or np.any(filled & (seq_len < L) & (seq_end == 0))
    ):
        raise ValueError(
            f"stored windows must have 1 to {L} valid steps (fewer only at an episode end), "
            "end kinds 0, 1 or 2, and empty slots all 0"
        )
    if np.any(n >= L) or np.any(first & (n < 0)) or np.any((start < 0) | (start >= L)):
        raise ValueError(
            f"chain_n must be < {L}, and >= 0 at an episode's first window; chain_start in [0, {L})"
        )
    if not prioritized:
        return
    tree = state.tree
    if not isinstance(tree, SumTreeState) or tree.capacity != C:
        raise ValueError(f"tree must be a SumTreeState of capacity {C}")
    tree.__checkpoint_check__()
    nodes = np.asarray(tree.nodes)
    if nodes.dtype != np.float32:
        raise ValueError(f"the sum tree's nodes must be float32, got {nodes.dtype}")
    values = nodes[tree.num_leaves : tree.num_leaves + C]
    if np.any(~filled & (values != 0)) or np.any(filled & ~(values > 0)):
        raise ValueError("empty slots must have priority 0 and filled ones a positive one")
    top = float(_array(state.max_mix, "max_mix", np.float32, ()))
    if not (np.isfinite(top) and top >= 1):
        raise ValueError(f"max_mix must be a finite float32 >= 1, got {top}")
