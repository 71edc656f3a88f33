"""Checks of restored states of the jittable uniform and prioritized buffers.

A checkpoint rebuilds a :class:`UniformBufferState` or :class:`PrioritizedBufferState` field
by field, without running any code of the buffer; their ``__checkpoint_check__`` methods call
:func:`check_restored_state`, which refuses (ValueError) a state that no sequence of ``add``
and ``update`` calls can produce and that would make the buffer read or sample the wrong rows.
The checks run on host copies of the small arrays (never of the items, which may be frames),
vectorised, with any leading batch axes of a :func:`jax.vmap` of buffers: a buffer of
:math:`2^{20}` slots is checked in milliseconds.

Invariants (per buffer of the batch; ``C`` is the capacity, the length of ``episode``):

- ``pos``, ``size``, ``episode_counter`` are int32 of the batch shape, ``episode`` int32 of
  the batch shape plus ``(C,)``, every leaf of ``items`` has the batch shape plus ``(C,)``
  in front;
- ``0 <= size <= C`` and ``0 <= pos < C``, and ``pos == size`` while ``size < C`` (the ring
  fills from slot 0);
- episode ids are 0 in the empty slots and, in insertion order, non-decreasing from 0 up to
  ``episode_counter``, which is the newest id or the one after it (0 when empty);

and for a prioritized state:

- the sum tree holds ``C`` float32 values and is consistent
  (:meth:`coax_utils.utils.SumTreeState.__checkpoint_check__`); the values of empty slots
  are 0, those of filled slots at most ``max_priority``;
- ``max_priority`` is float32, finite, at least 1 (its initial value) and at most
  ``max(1, tree.max_value)``;
- ``laps`` is int32 of the batch shape, in ``[0, 2**31 - 1]``, and 0 exactly while the
  buffer is not full (the versions of the slots follow from it and ``pos``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from coax_utils.replay._batch_checks import ARRAY_TYPES, host_array
from coax_utils.utils import SumTreeState

__all__ = ["check_restored_state"]


def _first(bad: np.ndarray) -> str:
    """Where the first True of ``bad`` is (a position, or batch position and slot)."""
    where = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return str(tuple(int(i) for i in where)) if len(where) > 1 else str(int(where[0]))


def _check_ring(state: Any) -> tuple[tuple, int, np.ndarray]:
    """Check the fields shared by the uniform and prioritized states; return the batch
    shape, the capacity and the mask of filled slots."""
    pos = state.pos
    if not isinstance(pos, ARRAY_TYPES):
        raise ValueError(f"pos must be an array, got {type(pos).__name__}")
    batch = tuple(pos.shape)
    pos = host_array(pos, "pos", np.int32, batch)
    size = host_array(state.size, "size", np.int32, batch)
    counter = host_array(state.episode_counter, "episode_counter", np.int32, batch)
    episode = state.episode
    shape = tuple(getattr(episode, "shape", ()))
    if len(shape) != len(batch) + 1 or shape[:-1] != batch or shape[-1] < 1:
        raise ValueError(
            f"episode must have the batch shape {batch} plus (capacity,), got shape {shape}"
        )
    capacity = shape[-1]
    episode = host_array(episode, "episode", np.int32, shape)
    for k, leaf in enumerate(jax.tree_util.tree_leaves(state.items)):
        if not isinstance(leaf, ARRAY_TYPES):
            raise ValueError(f"leaf {k} of items must be an array, got {type(leaf).__name__}")
        if tuple(leaf.shape[: len(shape)]) != shape:
            raise ValueError(
                f"leaf {k} of items must have the rows {shape} of the other arrays in front, "
                f"got shape {tuple(leaf.shape)}"
            )
    if np.any((size < 0) | (size > capacity)):
        raise ValueError(f"size must lie in [0, {capacity}], got {size.tolist()}")
    if np.any((pos < 0) | (pos >= capacity)):
        raise ValueError(f"pos must lie in [0, {capacity}), got {pos.tolist()}")
    if np.any((size < capacity) & (pos != size)):
        raise ValueError(
            f"pos must equal size until the buffer is full (the ring fills from slot 0), got "
            f"pos {pos.tolist()} and size {size.tolist()}"
        )
    # the ring fills from slot 0, so the filled slots are the first `size` ones
    filled = np.arange(capacity, dtype=np.int32) < size[..., None]
    bad = ~filled & (episode != 0)
    if np.any(bad):
        raise ValueError(f"episode ids of empty slots must be 0, slot {_first(bad)}")
    if np.any(episode < 0) or np.any(episode > counter[..., None]):
        raise ValueError("episode ids must lie in [0, episode_counter]")
    # oldest to newest: slots pos, ..., capacity - 1, 0, ..., pos - 1 (full) or 0, ..., size
    # - 1; every step but the one from the newest (pos - 1) to the oldest (pos) must not
    # go down (ids lie in [0, 2**31 - 1], so the int32 differences do not overflow)
    down = episode[..., 1:] < episode[..., :-1]
    steps = np.arange(capacity - 1, dtype=np.int32)
    down &= (steps < size[..., None] - 1) & (steps != pos[..., None] - 1)
    wrap = (size == capacity) & (pos != 0) & (episode[..., 0] < episode[..., -1])
    if np.any(down) or np.any(wrap):
        raise ValueError("episode ids must not decrease from the oldest item to the newest")
    newest = np.take_along_axis(episode, ((pos - 1) % capacity)[..., None], axis=-1)[..., 0]
    gap = counter.astype(np.int64) - np.where(size > 0, newest, counter)
    if np.any((gap < 0) | (gap > 1) | ((size == 0) & (counter != 0))):
        raise ValueError(
            "episode_counter must be the newest item's episode id or the next one (0 when "
            f"empty), got {counter.tolist()}"
        )
    return batch, capacity, filled


def check_restored_state(state: Any, prioritized: bool) -> None:
    """Raise ValueError unless ``state``, a restored uniform (or, with ``prioritized``,
    prioritized) buffer state, keeps every invariant listed in this module's docstring."""
    batch, capacity, filled = _check_ring(state)
    if not prioritized:
        return
    tree = state.tree
    if not isinstance(tree, SumTreeState):
        raise ValueError(f"tree must be a SumTreeState, got {type(tree).__name__}")
    if tree.capacity != capacity:
        raise ValueError(f"the sum tree holds {tree.capacity!r} values, the buffer {capacity}")
    tree.__checkpoint_check__()  # the tree on its own: shapes, sums, padding, signs
    nodes = np.asarray(tree.nodes)
    if nodes.dtype != np.float32 or nodes.shape[:-1] != batch:
        raise ValueError(
            f"the sum tree's nodes must be float32 with the batch shape {batch} in front, got "
            f"{nodes.dtype} of shape {nodes.shape}"
        )
    top = host_array(state.max_priority, "max_priority", np.float32, batch).astype(np.float64)
    bound = max(1.0, float(np.float32(tree.max_value)))
    if not np.all((top >= 1) & (top <= bound)):  # NaN fails too
        raise ValueError(
            f"max_priority must lie in [1, {bound}] (1 initially, never lowered), got "
            f"{top.tolist()}"
        )
    n = tree.num_leaves
    values = nodes[..., n : n + capacity].astype(np.float64)
    bad = ~filled & (values != 0)
    if np.any(bad):
        raise ValueError(f"empty slots must have priority 0, slot {_first(bad)}")
    if np.any(values > top[..., None]):
        raise ValueError(f"a priority exceeds max_priority, slot {_first(values > top[..., None])}")
    laps = host_array(state.laps, "laps", np.int32, batch)
    full = filled[..., -1]
    if np.any((laps < 0) | (full == (laps == 0))):
        raise ValueError(
            "laps must be 0 while the buffer is not full and at least 1 once it is, got "
            f"{laps.tolist()} (full: {full.tolist()})"
        )
