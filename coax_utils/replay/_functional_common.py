"""Pieces shared by the jittable buffers (uniform, prioritized, frame-stacked).

Checks of arguments before they are traced (indices, versions, ``beta``), the trace-time
check that a state fits a buffer, the ring write, row gathers and sequence windows. The
checks of *restored* states (checkpoints) are in :mod:`coax_utils.replay._functional_checks`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_float, check_int, check_pairs_up, checked_indices
from coax_utils._random import random_index
from coax_utils.replay._sequence import SequenceSample

__all__ = [
    "ROW_LOOP_MAX_BYTES",
    "SEQ_DOC",
    "VERSION_MAX",
    "check_beta",
    "check_capacity",
    "check_items",
    "check_state",
    "check_static_int",
    "checked_versions",
    "compiled",
    "gather_rows",
    "host_indices",
    "init_storage",
    "sample_windows",
    "slot_versions",
    "write_rows",
]

#: The largest version of a slot of a prioritized buffer; the next write gives version 1.
VERSION_MAX = 2**31 - 1


def check_capacity(capacity: Any) -> int:
    return check_int(capacity, "capacity", low=1, high=2**31 - 1)


def check_static_int(value: Any, name: str) -> int:
    """A static size (a batch size, a length): an int in ``[1, 2**31 - 1]`` (int32 indices)."""
    return check_int(value, name, low=1, high=2**31 - 1)


def compiled(fn: Callable, static_argnums: tuple[int, ...] = ()) -> Callable:
    """``fn`` under :func:`jax.jit`: compiled once per input shapes (and static arguments).

    The buffers' functions hold control flow (loops, platform-dependent branches) that a
    call outside ``jit`` would trace and compile anew every time (about 0.1-0.2 s a call on
    a CPU); inside a caller's ``jit`` the compiled function is inlined, so nothing changes
    there (donation included).
    """
    return jax.jit(fn, static_argnums=static_argnums)


def host_indices(indices: Any, priorities: Any, capacity: int) -> tuple[Any, Any]:
    """The ``indices`` and ``priorities`` of an ``update``, checked before they are traced.

    The priorities must pair up with the indices (:func:`check_pairs_up`); both are then
    flattened. NumPy indices are checked in their own dtype (``jit`` would narrow a 64-bit
    index such as ``2**32 + 1`` to int32, which wraps it onto a valid slot): int32, -1 for
    those outside ``[0, capacity)``.
    """
    check_pairs_up(priorities, indices, "priorities")
    priorities = jnp.reshape(jnp.asarray(priorities), (-1,))
    if isinstance(indices, (jax.Array, jax.core.Tracer)):
        return jnp.reshape(indices, (-1,)), priorities
    return checked_indices(indices, capacity)[0], priorities


def checked_versions(versions: Any, indices: Any) -> Any:
    """The ``versions`` of an ``update`` as flat int32, -1 where out of ``[0, VERSION_MAX]``.

    They must pair up with ``indices`` like priorities (ValueError) and be integers
    (TypeError, while tracing too). The range is checked in their own dtype, so a 64-bit
    ``2**32 + 5`` never wraps onto version 5; -1 matches no slot.
    """
    host = not isinstance(versions, (jax.Array, jax.core.Tracer))
    x = np.asarray(versions) if host else versions
    if not (jnp.issubdtype(x.dtype, jnp.integer) and x.dtype != jnp.bool_):
        raise TypeError(f"versions must be integers, got dtype {x.dtype}: {versions!r}")
    check_pairs_up(x, indices, "versions")
    xp = np if host else jnp
    x = x.reshape(-1)
    info = np.iinfo(x.dtype)
    valid = xp.ones(x.shape, bool)
    if info.min < 0:
        valid = valid & (x >= 0)
    if info.max > VERSION_MAX:
        valid = valid & (x <= xp.asarray(VERSION_MAX, x.dtype))
    x = xp.where(valid, x, 0).astype(xp.int32)
    return jnp.asarray(xp.where(valid, x, -1))


def slot_versions(state: Any, indices: jax.Array) -> jax.Array:
    """The versions (write counts) of the slots ``indices`` of a prioritized ``state``.

    The ring writes its slots in order, so after ``laps`` returns of the write head to slot
    0, the slots before ``pos`` were written once more than the others: ``laps + 1`` times
    and ``laps`` times (0 for a slot never written), counted up to ``VERSION_MAX`` and then
    again from 1.
    """
    return jnp.where(indices < state.pos, state.laps % VERSION_MAX + 1, state.laps)


def check_beta(beta: Any) -> None:
    """Check a concrete ``beta`` of a prioritized sample (traced ones are clipped to >= 0)."""
    if beta is not None and not isinstance(beta, (jax.Array, jax.core.Tracer)):
        check_float(beta.item() if isinstance(beta, np.ndarray) else beta, "beta", low=0)


def init_storage(example_item: Any, capacity: int) -> Any:
    def allocate(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        return jnp.zeros((capacity,) + x.shape, x.dtype)

    return jax.tree_util.tree_map(allocate, example_item)


def check_state(state: Any, capacity: int, more: tuple = ()) -> None:
    """Trace-time check that the arrays of a uniform or prioritized buffer's ``state`` (and
    the ``more`` named arrays, ``(name, array, rows)``) have the rows a buffer of
    ``capacity`` needs: a state of a buffer made with another capacity would be read and
    written at other rows, silently."""
    rows = [("episode", state.episode, capacity), *more]
    rows += [("items", x, capacity) for x in jax.tree_util.tree_leaves(state.items)]
    tree = getattr(state, "tree", None)
    if tree is not None:
        rows.append(("the sum tree's nodes", tree.nodes, 2 * tree.num_leaves))
    for name, x, n in rows:
        if jnp.shape(x)[:1] != (n,):
            raise ValueError(
                f"the state does not fit this buffer: {name} has shape {jnp.shape(x)}, the "
                f"buffer needs {n} rows (a state of a buffer made with other arguments?)"
            )
    if tree is not None and tree.capacity != capacity:
        raise ValueError(
            f"the state does not fit this buffer: its sum tree holds {tree.capacity} values, "
            f"the buffer needs {capacity}"
        )


def check_items(storage: Any, items: Any, capacity: int) -> int:
    """Trace-time validation of ``items`` against the storage; return the batch size."""
    if jax.tree_util.tree_structure(items) != jax.tree_util.tree_structure(storage):
        raise ValueError(
            "items differ in structure from the buffer's items: expected "
            f"{jax.tree_util.tree_structure(storage)}, got {jax.tree_util.tree_structure(items)}"
        )
    sizes = set()
    for x, s in zip(jax.tree_util.tree_leaves(items), jax.tree_util.tree_leaves(storage)):
        shape, dtype = jnp.shape(x), jnp.result_type(x)
        if len(shape) != s.ndim or shape[1:] != s.shape[1:] or dtype != s.dtype:
            raise ValueError(
                f"items need a leading batch axis and per-item shape {s.shape[1:]} with dtype "
                f"{s.dtype}, got shape {shape} with dtype {dtype}"
            )
        sizes.add(shape[0])
    if len(sizes) != 1:
        raise ValueError(f"all leaves of items need the same batch size, got {sorted(sizes)}")
    (batch_size,) = sizes
    if batch_size > capacity:
        raise ValueError(
            f"cannot add {batch_size} items at once to a buffer of capacity {capacity}"
        )
    return batch_size


def _episode_ids(counter: jax.Array, episode_end: Any, batch_size: int) -> tuple[Any, Any]:
    if episode_end is None:
        return jnp.full((batch_size,), counter, jnp.int32), counter
    # a truth value, as the host buffers read it: any nonzero mark ends the episode
    ends = jnp.broadcast_to(jnp.asarray(episode_end) != 0, (batch_size,)).astype(jnp.int32)
    csum = jnp.cumsum(ends, dtype=jnp.int32)
    return counter + csum - ends, counter + csum[-1]


def write_rows(state: Any, items: Any, episode_end: Any, capacity: int) -> tuple[Any, jax.Array]:
    """Write ``items`` at the write head of a uniform or prioritized ``state``; return the
    new state and the slots written."""
    check_state(state, capacity)
    batch_size = check_items(state.items, items, capacity)
    slots = (state.pos + jnp.arange(batch_size, dtype=jnp.int32)) % capacity
    storage = jax.tree_util.tree_map(
        lambda s, x: s.at[slots].set(x, unique_indices=True, mode="promise_in_bounds"),
        state.items,
        items,
    )
    episode, counter = _episode_ids(state.episode_counter, episode_end, batch_size)
    new = state.replace(
        items=storage,
        pos=((state.pos + batch_size) % capacity).astype(jnp.int32),
        size=jnp.minimum(state.size + batch_size, capacity).astype(jnp.int32),
        episode=state.episode.at[slots].set(episode, unique_indices=True),
        episode_counter=counter.astype(jnp.int32),
    )
    return new, slots


ROW_LOOP_MAX_BYTES = 1024  # per-item size up to which CPU samples copy rows in a loop
_ROW_LOOP_MAX_ROWS = 8192


def gather_rows(storage: Any, slots: jax.Array) -> Any:
    """``storage[slots]`` for every leaf.

    On a CPU, XLA splits a gather from a large operand over several threads even when only a
    few hundred small rows are read, and the thread hand-off then costs more than the copy.
    For small items a loop over the rows (one dynamic slice per leaf per row, in one compiled
    loop) avoids that and is several times faster; large items (e.g. frames) and other
    backends use one gather per leaf. The backend is the one the computation is compiled for
    (:func:`jax.lax.platform_dependent`), not the default backend at trace time.
    """

    def gather(storage: Any, slots: jax.Array) -> Any:
        return jax.tree_util.tree_map(lambda s: s.at[slots].get(mode="promise_in_bounds"), storage)

    def loop(storage: Any, slots: jax.Array) -> Any:
        def row(_: Any, i: jax.Array) -> tuple:
            return None, jax.tree_util.tree_map(
                lambda s: jax.lax.dynamic_index_in_dim(s, i, keepdims=False), storage
            )

        return jax.lax.scan(row, None, slots)[1]

    leaves = jax.tree_util.tree_leaves(storage)
    row_bytes = sum(x.dtype.itemsize * int(np.prod(x.shape[1:])) for x in leaves)
    if row_bytes > ROW_LOOP_MAX_BYTES or slots.shape[0] > _ROW_LOOP_MAX_ROWS:
        return gather(storage, slots)
    return jax.lax.platform_dependent(storage, slots, cpu=loop, default=gather)


def sample_windows(
    state: Any, key: jax.Array, batch_size: int, length: int, capacity: int
) -> SequenceSample:
    """The ``sample_sequences`` of the uniform and prioritized buffers (see :data:`SEQ_DOC`)."""
    batch_size = check_static_int(batch_size, "batch_size")
    length = check_static_int(length, "length")
    if length > capacity:
        raise ValueError(f"length={length} exceeds the buffer's capacity {capacity}")
    # compiled once per shape: called eagerly, the platform-dependent draws and gathers
    # would be traced and compiled anew on every call
    return _compiled_windows(state, key, batch_size, length, capacity)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _compiled_windows(
    state: Any, key: jax.Array, batch_size: int, length: int, capacity: int
) -> SequenceSample:
    check_state(state, capacity)
    starts = random_index(key, (batch_size,), state.size - length + 1)
    oldest = jnp.where(state.size < capacity, 0, state.pos)
    slots = (oldest + starts[:, None] + jnp.arange(length, dtype=jnp.int32)) % capacity
    episode = state.episode[slots]
    mask = (episode == episode[:, :1]) & (starts[:, None] + jnp.arange(length) < state.size)
    # valid up to the first step of another episode, even if a damaged state's episode
    # numbers come back to the first one later
    mask = jnp.cumprod(mask, axis=1).astype(jnp.bool_)
    last = jnp.sum(mask, axis=1, keepdims=True) - 1
    slots = jnp.take_along_axis(slots, jnp.minimum(jnp.arange(length), last), axis=1)
    items = gather_rows(state.items, slots.reshape(-1))
    items = jax.tree_util.tree_map(lambda x: x.reshape((batch_size, length) + x.shape[1:]), items)
    return SequenceSample(items=items, mask=mask, indices=slots)


SEQ_DOC = """Sample ``batch_size`` contiguous windows of ``length`` items (jittable).

        Window starts are uniform over the positions (in insertion order) that leave room for
        ``length`` stored items. Windows never cross an episode boundary (rows added with
        ``episode_end=True``): steps after the end of the first episode are *masked* and padded
        by repeating the last valid step. While the buffer holds fewer than ``length`` items,
        windows start at the oldest item and the steps past the newest are masked (every step,
        when it is empty: check ``can_sample`` first). ``batch_size`` and ``length`` are
        static. Returns a
        :class:`SequenceSample` with ``items`` of shape ``(batch_size, length, ...)``, the mask
        and the storage slots."""
