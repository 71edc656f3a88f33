"""Checks of restored states of the jittable frame-stacked buffers.

A checkpoint rebuilds a :class:`FrameStackBufferState` or
:class:`PrioritizedFrameStackBufferState` field by field (its ``transitions`` first, checked
by their own ``__checkpoint_check__``); the states' ``__checkpoint_check__`` methods call
:func:`check_frame_state`, which refuses (ValueError) a state that no sequence of ``add`` and
``update`` calls can produce: one whose stacks would be rebuilt from frames they do not own,
or whose transitions that lost frames would still be sampled. The checks run on host copies
of the ids and counters (never of the frames), with any leading batch axes of a
:func:`jax.vmap` of buffers; a refusal of a value names the batch position of the first
buffer at fault.

Invariants (per buffer of the batch; ``C`` the capacity, ``F`` the number of rows of
``frames``, ``M = F * (2**30 // F)`` the modulus of frame ids and ``age(i) = (frame_count -
i) % M``):

- ``transitions`` is a uniform (prioritized) buffer state whose items hold ``S`` and
  ``S_next`` as int32 frame ids of shape ``(C, k)``, ``k >= 1``; ``frames`` has ``F >= 2 k``
  rows (``F <= 2**28``) and ``4 (2 k C + F) <= M`` (the factories' limit);
- ``frame_count`` is int32 in ``[0, M)``; ``table_id`` int32 of ``T`` entries (a power of two,
  at least 8192), each -1 or in ``[0, M)``, and ``table_hash`` uint32 of shape ``(T, 2)``;
- the frame ids of stored transitions lie in ``[0, M)`` and no id is from the future: ages are
  at most ``M / 4`` (a stored transition's frames are never older than that);

and for a prioritized state (``A = C * (2**30 // C)`` the modulus of transition numbers):

- ``window`` is int32 in ``[0, F - 2 k]``; ``added`` and ``frontier`` int32 in ``[0, A)``, with
  ``added % C == pos`` and ``added == size`` until the buffer is full;
- ``birth`` is int32 in ``[0, M)``, of age at most ``M / 4`` in filled slots, not decreasing
  from the oldest transition to the newest; each transition's frame ids lie in ``[birth -
  window, birth + 2 k)``;
- every stored transition that lost a frame (an age beyond ``F``), and every one older than
  ``frontier``, has priority 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coax_utils.replay._batch_checks import ARRAY_TYPES, host_array, refuse_if
from coax_utils.replay._frames_ring import COUNTER_SPAN as _SPAN

__all__ = ["check_frame_state"]


def check_frame_state(state: Any, transitions_type: type) -> None:
    """Raise ValueError unless ``state`` (a restored frame-stacked buffer state whose
    ``transitions`` must be a ``transitions_type``) keeps the invariants listed in this
    module's docstring."""
    stored = state.transitions
    if not isinstance(stored, transitions_type):
        raise ValueError(
            f"transitions must be a {transitions_type.__name__}, got {type(stored).__name__}"
        )
    batch = tuple(np.shape(stored.pos))
    C = int(np.shape(stored.episode)[-1])
    ids = []
    for name in ("S", "S_next"):
        x = getattr(stored.items, name, None)
        if not isinstance(x, ARRAY_TYPES) or x.ndim != len(batch) + 2:
            raise ValueError(f"transitions.items.{name} must be an array of frame ids (C, k)")
        ids.append(host_array(x, f"transitions.items.{name}", np.int32))
    k = ids[0].shape[-1]
    if k < 1 or ids[1].shape != ids[0].shape:
        raise ValueError(
            f"S and S_next must hold the same number (>= 1) of frame ids, got shapes "
            f"{ids[0].shape} and {ids[1].shape}"
        )
    frames = state.frames
    if not isinstance(frames, ARRAY_TYPES) or frames.ndim < len(batch) + 1:
        raise ValueError("frames must be an array with a row per frame")
    F = int(frames.shape[len(batch)])
    if tuple(frames.shape[: len(batch)]) != batch or not 2 * k <= F <= _SPAN // 4:
        raise ValueError(
            f"frames must have the batch shape {batch} and 2 * stack_size = {2 * k} to 2**28 "
            f"rows, got shape {tuple(frames.shape)}"
        )
    M = F * (_SPAN // F)
    if 4 * (2 * k * C + F) > M:
        raise ValueError(f"capacity {C} with frame_capacity {F} overflows the 32-bit counters")
    count = host_array(state.frame_count, "frame_count", np.int32, batch).astype(np.int64)
    table_id = state.table_id
    T = int(np.shape(table_id)[-1]) if np.ndim(table_id) == len(batch) + 1 else 0
    if T < 8192 or T & (T - 1):
        raise ValueError(f"the table must have a power of two (>= 8192) entries, got {T}")
    table_id = host_array(table_id, "table_id", np.int32, batch + (T,))
    host_array(state.table_hash, "table_hash", np.uint32, batch + (T, 2))
    nb = len(batch)
    refuse_if(
        (count < 0) | (count >= M) | np.any((table_id < -1) | (table_id >= M), axis=-1),
        nb,
        f"frame_count and the table's frame ids must lie in [0, {M})",
    )
    size = np.asarray(stored.size).astype(np.int64)
    filled = np.arange(C) < size[..., None]
    both = np.concatenate(ids, axis=-1).astype(np.int64)
    refuse_if(
        filled[..., None] & ((both < 0) | (both >= M)),
        nb,
        f"the frame ids of stored transitions must lie in [0, {M})",
    )
    age = (count[..., None, None] - both) % M
    refuse_if(
        filled[..., None] & (age > M // 4),
        nb,
        "a stored transition refers to a frame not stored yet",
    )
    if not hasattr(state, "birth"):
        return
    _check_prioritized(state, batch, C, k, F, M, count, filled, age)


def _check_prioritized(
    state: Any, batch: tuple, C: int, k: int, F: int, M: int, count: Any, filled: Any, age: Any
) -> None:
    stored = state.transitions
    A = C * (_SPAN // C)
    window = host_array(state.window, "window", np.int32, batch).astype(np.int64)
    added = host_array(state.added, "added", np.int32, batch).astype(np.int64)
    frontier = host_array(state.frontier, "frontier", np.int32, batch).astype(np.int64)
    birth = host_array(state.birth, "birth", np.int32, batch + (C,)).astype(np.int64)
    nb = len(batch)
    refuse_if(
        (window < 0) | (window > F - 2 * k),
        nb,
        f"window must lie in [0, frame_capacity - 2 * stack_size = {F - 2 * k}]",
    )
    refuse_if(
        (added < 0) | (added >= A) | (frontier < 0) | (frontier >= A),
        nb,
        f"added and frontier must lie in [0, {A})",
    )
    pos, size = np.asarray(stored.pos).astype(np.int64), np.asarray(stored.size).astype(np.int64)
    refuse_if(
        (added % C != pos) | ((size < C) & (added != size)),
        nb,
        "added must be the number of transitions added (modulo the capacity)",
    )
    refuse_if((birth < 0) | (birth >= M), nb, f"birth must lie in [0, {M})")
    born = (count[..., None] - birth) % M  # frames stored since each transition was added
    refuse_if(filled & (born > M // 4), nb, "a stored transition was added after the newest frame")
    # the stored transitions oldest first: slots pos - size, ..., pos - 1 (modulo C)
    in_order = np.take_along_axis(born, ((pos - size)[..., None] + np.arange(C)) % C, axis=-1)
    refuse_if(
        filled[..., 1:] & (in_order[..., 1:] > in_order[..., :-1]),
        nb,
        "birth must not decrease from the oldest transition to the newest",
    )
    lo, hi = born[..., None] - 2 * k, born[..., None] + window[..., None, None]
    refuse_if(
        filled[..., None] & ((age <= lo) | (age > hi)),
        nb,
        "a transition refers to frames outside [birth - window, birth + 2 k)",
    )
    tree = stored.tree
    values = np.asarray(tree.nodes)[..., tree.num_leaves : tree.num_leaves + C]
    lost = (age > F).any(axis=-1)
    newer = 1 + (pos[..., None] - 1 - np.arange(C)) % C  # 1: the newest, size: the oldest
    behind = newer > ((added - frontier) % A)[..., None]
    refuse_if(
        filled & (lost | behind) & (values != 0),
        nb,
        "a transition that lost frames (or is older than the frontier) has a priority",
    )
