r"""Jittable replay buffers: frozen containers of pure functions over pytree states.

Random numbers come from a counter-based hash of the caller's ``key``: the key's data words
are mixed with the position of each draw by two rounds of the murmur3 32-bit finalizer. This
is deterministic in the key (same key, same sample; split keys as usual), costs a few integer
operations per draw, and is several times cheaper than drawing from ``jax.random`` with the
default threefry keys, which dominates the cost of a small replay sample on a CPU. The
resulting indices are uniform up to a relative bias below ``size / 2**32`` (the modulo
reduction of a 32-bit hash).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._dataclass import pytree_dataclass
from coax_utils.replay._host import SequenceSample
from coax_utils.utils._segment_tree_fn import (
    SumTreeState,
    checked_indices,
    sum_tree_init,
    sum_tree_set,
    value_cap,
)

__all__ = [
    "PrioritizedBuffer",
    "PrioritizedBufferState",
    "PrioritizedSample",
    "UniformBuffer",
    "UniformBufferState",
    "make_prioritized_buffer",
    "make_uniform_buffer",
]


# -- randomness ---------------------------------------------------------------------------


def _fmix32(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = jnp.asarray(key).astype(jnp.uint32).reshape(-1)
    k0, k1 = words[0], words[-1]
    for i in range(1, words.shape[0] - 1):  # fold in any further words (e.g. rbg keys)
        k1 = _fmix32(k1 ^ words[i])
    return k0, k1


def _random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 hash bits, one per element of ``shape``, determined by ``key``."""
    k0, k1 = _key_words(key)
    seed = _fmix32(k1 ^ _fmix32(k0 ^ jnp.uint32(0x2545F491)))
    count = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
    x = _fmix32((count * jnp.uint32(0x9E3779B9)) ^ seed)
    return _fmix32(x ^ k0)


def _randint(key: jax.Array, shape: tuple[int, ...], span: jax.Array) -> jax.Array:
    """int32 numbers in ``[0, span)`` (``span >= 1``, traced)."""
    span = jnp.maximum(span, 1).astype(jnp.uint32)
    return (_random_bits(key, shape) % span).astype(jnp.int32)


def _uniform(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Floats in ``[0, 1)`` with 24 random bits."""
    bits = _random_bits(key, shape) >> 8
    return bits.astype(dtype) * jnp.asarray(2.0**-24, dtype)


# -- sum-tree traversals for the hot path ----------------------------------------------------
#
# Sampling and updating priorities run on the layout of ``SumTreeState`` (a 1-indexed heap,
# leaves at ``num_leaves + i``) with XLA loops instead of unrolled levels. Same results as
# ``sum_tree_inverse_cdf`` / ``sum_tree_set`` (tested), but on a CPU: (1) a looped descent
# orders every read of the tree before a following in-place update, so a jitted
# sample-then-update step does not copy the whole tree; (2) a sequential per-index update
# (parents recomputed from their children, never by adding deltas, so no drift; duplicates:
# the last write wins by construction) costs a few scalar operations per level instead of a
# batched gather/scatter per level.


def _tree_inverse_cdf(tree: SumTreeState, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Indices for ``u`` in [0, 1] and their values (never a zero value if the total is not).

    Every read of the tree happens inside the loop (the root's children give the total in the
    first iteration), so nothing outside it keeps the old tree alive.
    """
    nodes = tree.nodes
    u = jnp.clip(u, 0, 1).astype(nodes.dtype)
    if tree.height == 0:  # capacity 1: a single slot
        return jnp.zeros(u.shape, jnp.int32), jnp.broadcast_to(nodes[1], u.shape)

    def level(i: Any, carry: tuple) -> tuple:
        node, target, total, value = carry
        left, right = nodes[2 * node], nodes[2 * node + 1]
        total = jnp.where(i == 0, left + right, total)
        target = jnp.where(i == 0, target * total, target)
        go_left = (left > 0) & ((target < left) | (right <= 0))
        return (
            jnp.where(go_left, 2 * node, 2 * node + 1),
            jnp.where(go_left, target, target - left),
            total,
            jnp.where(go_left, left, right),
        )

    zeros = jnp.zeros(u.shape, nodes.dtype)
    start = (jnp.ones(u.shape, jnp.int32), u, zeros, zeros)
    node, _, _, value = jax.lax.fori_loop(0, tree.height, level, start)
    indices = jnp.minimum(node - tree.num_leaves, tree.capacity - 1).astype(jnp.int32)
    return indices, value


def _tree_set(tree: SumTreeState, indices: jax.Array, values: jax.Array, valid: jax.Array) -> Any:
    """Set ``values`` at ``indices`` where ``valid`` (others are no-ops), one index at a time."""
    n = tree.num_leaves

    def one(nodes: jax.Array, item: tuple) -> tuple:
        i, v, ok = item
        node = jnp.where(ok, i, 0) + n
        old = jax.lax.dynamic_index_in_dim(nodes, node, keepdims=False)
        nodes = jax.lax.dynamic_update_index_in_dim(nodes, jnp.where(ok, v, old), node, 0)

        def level(_: Any, carry: tuple) -> tuple:
            nodes, node = carry
            node = node // 2
            total = jax.lax.dynamic_index_in_dim(nodes, 2 * node, keepdims=False)
            total = total + jax.lax.dynamic_index_in_dim(nodes, 2 * node + 1, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(nodes, total, node, 0), node

        nodes, _ = jax.lax.fori_loop(0, tree.height, level, (nodes, node))
        return nodes, None

    values = values.astype(tree.nodes.dtype)
    nodes, _ = jax.lax.scan(one, tree.nodes, (indices.astype(jnp.int32), values, valid))
    return tree.replace(nodes=nodes)


# -- shared helpers -------------------------------------------------------------------------


def _check_capacity(capacity: Any) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise TypeError(f"capacity must be a positive int, got {capacity!r}")
    if not 1 <= capacity < 2**31:
        raise ValueError(f"capacity must be an int in [1, 2**31), got {capacity!r}")
    return int(capacity)


def _check_static_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive (static) int, got {value!r}")
    return int(value)


def _init_storage(example_item: Any, capacity: int) -> Any:
    def allocate(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        return jnp.zeros((capacity,) + x.shape, x.dtype)

    return jax.tree_util.tree_map(allocate, example_item)


def _check_items(storage: Any, items: Any, capacity: int) -> int:
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
    ends = jnp.broadcast_to(jnp.asarray(episode_end), (batch_size,)).astype(jnp.int32)
    csum = jnp.cumsum(ends, dtype=jnp.int32)
    return counter + csum - ends, counter + csum[-1]


def _write(state: Any, items: Any, episode_end: Any, capacity: int) -> tuple[Any, jax.Array]:
    batch_size = _check_items(state.items, items, capacity)
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


_ROW_LOOP_MAX_BYTES = 1024  # per-item size up to which CPU samples copy rows in a loop
_ROW_LOOP_MAX_ROWS = 8192


def _gather(storage: Any, slots: jax.Array) -> Any:
    """``storage[slots]`` for every leaf.

    On a CPU, XLA splits a gather from a large operand over several threads even when only a
    few hundred small rows are read, and the thread hand-off then costs more than the copy.
    For small items a loop over the rows (one dynamic slice per leaf per row, in one compiled
    loop) avoids that and is several times faster; large items (e.g. frames) and other
    backends use one gather per leaf.
    """
    leaves = jax.tree_util.tree_leaves(storage)
    row_bytes = sum(x.dtype.itemsize * int(np.prod(x.shape[1:])) for x in leaves)
    n = slots.shape[0]
    use_loop = (
        jax.default_backend() == "cpu"
        and row_bytes <= _ROW_LOOP_MAX_BYTES
        and n <= _ROW_LOOP_MAX_ROWS
    )
    if not use_loop:
        return jax.tree_util.tree_map(lambda s: s.at[slots].get(mode="promise_in_bounds"), storage)

    def row(_: Any, i: jax.Array) -> tuple:
        return None, jax.tree_util.tree_map(
            lambda s: jax.lax.dynamic_index_in_dim(s, i, keepdims=False), storage
        )

    return jax.lax.scan(row, None, slots)[1]


def _sample_sequences(
    state: Any, key: jax.Array, batch_size: int, length: int, capacity: int
) -> SequenceSample:
    batch_size = _check_static_int(batch_size, "batch_size")
    length = _check_static_int(length, "length")
    if length > capacity:
        raise ValueError(f"length={length} exceeds the buffer's capacity {capacity}")
    starts = _randint(key, (batch_size,), state.size - length + 1)
    oldest = jnp.where(state.size < capacity, 0, state.pos)
    slots = (oldest + starts[:, None] + jnp.arange(length, dtype=jnp.int32)) % capacity
    episode = state.episode[slots]
    mask = (episode == episode[:, :1]) & (starts[:, None] + jnp.arange(length) < state.size)
    last = jnp.sum(mask, axis=1, keepdims=True) - 1
    slots = jnp.take_along_axis(slots, jnp.minimum(jnp.arange(length), last), axis=1)
    items = _gather(state.items, slots.reshape(-1))
    items = jax.tree_util.tree_map(lambda x: x.reshape((batch_size, length) + x.shape[1:]), items)
    return SequenceSample(items=items, mask=mask, indices=slots)


_SEQ_DOC = """Sample ``batch_size`` contiguous windows of ``length`` items (jittable).

        Window starts are uniform over the positions (in insertion order) that leave room for
        ``length`` stored items. Windows never cross an episode boundary (rows added with
        ``episode_end=True``): steps after the end of the first episode are *masked* and padded
        by repeating the last valid step. ``batch_size`` and ``length`` are static. Returns a
        :class:`SequenceSample` with ``items`` of shape ``(batch_size, length, ...)``, the mask
        and the storage slots."""


# -- uniform buffer ---------------------------------------------------------------------------


@pytree_dataclass
class UniformBufferState:
    """State of a :func:`make_uniform_buffer` buffer (a pytree).

    Attributes
    ----------
    items : pytree
        The storage: every leaf has shape ``(capacity, ...)``.
    pos : int32 Array
        The next slot to write.
    size : int32 Array
        The number of filled slots (at most ``capacity``).
    episode : int32 Array, shape ``(capacity,)``
        Episode id of each slot (for sequence sampling).
    episode_counter : int32 Array
        Episode id given to the next item.
    """

    items: Any
    pos: jax.Array
    size: jax.Array
    episode: jax.Array
    episode_counter: jax.Array


@dataclasses.dataclass(frozen=True)
class UniformBuffer:
    """A jittable uniform replay buffer: pure functions over a :class:`UniformBufferState`.

    Made by :func:`make_uniform_buffer`; see there for the functions.
    """

    init: Callable[[Any], UniformBufferState]
    add: Callable[..., UniformBufferState]
    sample: Callable[[UniformBufferState, jax.Array, int], Any]
    can_sample: Callable[[UniformBufferState, int], jax.Array]
    sample_sequences: Callable[..., SequenceSample]
    capacity: int


def make_uniform_buffer(capacity: int) -> UniformBuffer:
    r"""Make a jittable ring buffer with uniform sampling.

    The returned :class:`UniformBuffer` holds pure functions:

    - ``init(example_item) -> state``: preallocate storage for ``capacity`` items shaped like
      ``example_item`` (any pytree of arrays, *without* a batch axis).
    - ``add(state, items, episode_end=None) -> state``: write ``items`` (leading batch axis of
      size ``<= capacity``) at the write head, overwriting the oldest items when full.
      ``episode_end`` (bool, per item) marks the last item of an episode; only
      ``sample_sequences`` uses it.
    - ``sample(state, key, batch_size) -> items``: ``batch_size`` (static) items drawn
      uniformly with replacement from the filled slots (empty slots are never returned, as
      long as the buffer is not empty).
    - ``can_sample(state, batch_size) -> bool Array``: whether the buffer holds at least
      ``batch_size`` items.
    - ``sample_sequences(state, key, batch_size, length) -> SequenceSample``: contiguous
      windows that never cross an episode boundary (masked; see :class:`SequenceSample`).

    All of them are jittable and vmappable over a batch of states (e.g. one buffer per
    environment); structure, shape and dtype mismatches raise ``ValueError`` while tracing.
    The state is a pytree of arrays with fixed shapes and dtypes, so a jitted function never
    retraces, the state can be checkpointed with :func:`coax_utils.utils.dump`, and ``add``
    can update it in place when donated: ``jax.jit(buffer.add, donate_argnums=0)`` (do not
    use the donated state afterwards).

    Parameters
    ----------
    capacity : int
        The maximum number of items.

    Returns
    -------
    buffer : UniformBuffer

    Raises
    ------
    ValueError
        If ``capacity`` is not a positive int.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> buffer = make_uniform_buffer(capacity=4)
    >>> state = buffer.init({"obs": jnp.zeros(2), "t": jnp.int32(0)})
    >>> add = jax.jit(buffer.add, donate_argnums=0)
    >>> for start in (0, 3):  # 6 items in two batches of 3; the first two get overwritten
    ...     t = jnp.arange(start, start + 3, dtype=jnp.int32)
    ...     state = add(state, {"obs": jnp.ones((3, 2)), "t": t})
    >>> int(state.size), sorted(state.items["t"].tolist())
    (4, [2, 3, 4, 5])
    >>> batch = jax.jit(buffer.sample, static_argnums=2)(state, jax.random.key(0), 8)
    >>> batch["obs"].shape, bool(jnp.all(batch["t"] >= 2))
    ((8, 2), True)
    """
    capacity = _check_capacity(capacity)

    def init(example_item: Any) -> UniformBufferState:
        return UniformBufferState(
            items=_init_storage(example_item, capacity),
            pos=jnp.zeros([], jnp.int32),
            size=jnp.zeros([], jnp.int32),
            episode=jnp.zeros((capacity,), jnp.int32),
            episode_counter=jnp.zeros([], jnp.int32),
        )

    def add(state: UniformBufferState, items: Any, episode_end: Any = None) -> UniformBufferState:
        return _write(state, items, episode_end, capacity)[0]

    def sample(state: UniformBufferState, key: jax.Array, batch_size: int) -> Any:
        batch_size = _check_static_int(batch_size, "batch_size")
        return _gather(state.items, _randint(key, (batch_size,), state.size))

    def can_sample(state: Any, batch_size: int) -> jax.Array:
        return state.size >= jnp.maximum(batch_size, 1)

    def sample_sequences(
        state: Any, key: jax.Array, batch_size: int, length: int
    ) -> SequenceSample:
        return _sample_sequences(state, key, batch_size, length, capacity)

    init.__doc__ = "Allocate the state for items shaped like ``example_item`` (no batch axis)."
    add.__doc__ = "Add ``items`` (leading batch axis) to the ring; return the new state."
    sample.__doc__ = "Sample ``batch_size`` (static) items uniformly with replacement."
    can_sample.__doc__ = "Whether the buffer holds at least ``batch_size`` items."
    sample_sequences.__doc__ = _SEQ_DOC
    return UniformBuffer(init, add, sample, can_sample, sample_sequences, capacity)


# -- prioritized buffer -----------------------------------------------------------------------


@pytree_dataclass
class PrioritizedBufferState:
    """State of a :func:`make_prioritized_buffer` buffer (a pytree).

    Attributes
    ----------
    items, pos, size, episode, episode_counter
        As in :class:`UniformBufferState`.
    tree : SumTreeState
        The priorities :math:`p_i = (|\\delta_i| + \\epsilon)^\\alpha` (zero in empty slots).
    max_priority : float32 Array
        The largest priority :math:`p_i` set so far (1 initially), given to new items.
    """

    items: Any
    pos: jax.Array
    size: jax.Array
    episode: jax.Array
    episode_counter: jax.Array
    tree: SumTreeState
    max_priority: jax.Array


@pytree_dataclass
class PrioritizedSample:
    """A prioritized sample: the items, where they came from and their importance weights.

    Attributes
    ----------
    items : pytree
        The sampled items, leaves of shape ``(batch_size, ...)``.
    indices : int32 Array, shape ``(batch_size,)``
        Storage slots of the items: pass them to ``update``.
    weights : float32 Array, shape ``(batch_size,)``
        Importance weights :math:`(N P(i))^{-\\beta}`, normalised to a batch maximum of 1.
    """

    items: Any
    indices: jax.Array
    weights: jax.Array


@dataclasses.dataclass(frozen=True)
class PrioritizedBuffer:
    """A jittable prioritized replay buffer: pure functions over a
    :class:`PrioritizedBufferState`.

    Made by :func:`make_prioritized_buffer`; see there for the functions.
    """

    init: Callable[[Any], PrioritizedBufferState]
    add: Callable[..., PrioritizedBufferState]
    sample: Callable[..., PrioritizedSample]
    can_sample: Callable[[PrioritizedBufferState, int], jax.Array]
    update: Callable[[PrioritizedBufferState, jax.Array, jax.Array], PrioritizedBufferState]
    sample_sequences: Callable[..., SequenceSample]
    capacity: int
    alpha: float
    beta: float
    epsilon: float


def make_prioritized_buffer(
    capacity: int, alpha: float = 0.6, beta: float = 0.4, epsilon: float = 1e-6
) -> PrioritizedBuffer:
    r"""Make a jittable ring buffer with proportional prioritized sampling.

    Items are sampled with probability :math:`P(i) = p_i / \sum_j p_j`, where
    :math:`p_i = (|\delta_i| + \epsilon)^\alpha` for the priorities :math:`\delta_i` given to
    ``update`` (e.g. TD errors; the sign is ignored). New items get the largest :math:`p`
    set so far (1 initially), so each is likely to be sampled soon. Samples carry importance
    weights

    .. math::

        w_i\ =\ \frac{\left(N\,P(i)\right)^{-\beta}}{\max_j \left(N\,P(j)\right)^{-\beta}}

    with :math:`N` the number of stored items (flashbax returns only :math:`P(i)`). Empty
    slots have priority 0 and are never sampled. The priorities live in a functional sum tree
    (:func:`coax_utils.utils.sum_tree_init`).

    The returned :class:`PrioritizedBuffer` holds ``init``, ``add``, ``can_sample`` and
    ``sample_sequences`` as in :func:`make_uniform_buffer`, plus:

    - ``sample(state, key, batch_size, beta=None) -> PrioritizedSample``: ``batch_size``
      (static) items drawn with replacement; ``beta`` overrides the factory's value and may be
      a traced scalar (for an annealing schedule). A concrete ``beta`` that is negative or
      not finite raises ValueError; a traced one is clipped to ``[0, inf]`` with NaN read as
      0. Weights are computed from the priorities of the sampled slots (never zero), so
      they are never NaN; on an empty buffer they are 1.
    - ``update(state, indices, priorities) -> state``: set new priorities of the slots
      ``indices`` (the ``indices`` of a sample). With duplicate indices the last one wins;
      NaN or infinite priorities, indices of empty slots and out-of-range indices (whatever
      their integer dtype: ``2**32 + 1`` does not wrap to slot 1) are ignored, since nothing
      can be raised inside a jitted function for a value; a non-integer ``indices`` dtype
      raises a TypeError while tracing. :math:`p_i` is capped at ``finfo(float32).max /
      (2 L)`` (``L`` the sum tree's leaf count), so the total priority stays finite and
      weights never become NaN. If a slot was overwritten since it was sampled, the new item
      gets the priority.

    Everything is jittable, vmappable and donation-friendly
    (``jax.jit(buffer.update, donate_argnums=0)``), as for :func:`make_uniform_buffer`.

    Parameters
    ----------
    capacity : int
        The maximum number of items.
    alpha : float, optional
        The priority exponent :math:`\alpha\ge0` (0: uniform sampling).
    beta : float, optional
        The importance-weight exponent :math:`\beta\ge0`.
    epsilon : float, optional
        The regulator :math:`\epsilon>0`.

    Returns
    -------
    buffer : PrioritizedBuffer

    Raises
    ------
    ValueError
        If an argument is out of range.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> buffer = make_prioritized_buffer(capacity=8, alpha=1.0, beta=1.0)
    >>> state = buffer.init(jnp.zeros(3))
    >>> state = buffer.add(state, jnp.ones((4, 3)))
    >>> state = buffer.update(state, jnp.array([0, 1, 2, 3]), jnp.array([0.0, 0.0, 5.0, 0.0]))
    >>> sample = buffer.sample(state, jax.random.key(1), 16)
    >>> sample.indices.tolist() == [2] * 16, sample.weights.shape
    (True, (16,))
    """
    capacity = _check_capacity(capacity)
    for name, value, low_ok in (
        ("alpha", alpha, True),
        ("beta", beta, True),
        ("epsilon", epsilon, False),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise ValueError(f"{name} must be a float, got {value!r}")
        if not np.isfinite(value) or value < 0 or (value == 0 and not low_ok):
            relation = ">= 0" if low_ok else "> 0"
            raise ValueError(f"{name} must be a finite float {relation}, got {value!r}")
    alpha, beta, epsilon = float(alpha), float(beta), float(epsilon)

    def init(example_item: Any) -> PrioritizedBufferState:
        return PrioritizedBufferState(
            items=_init_storage(example_item, capacity),
            pos=jnp.zeros([], jnp.int32),
            size=jnp.zeros([], jnp.int32),
            episode=jnp.zeros((capacity,), jnp.int32),
            episode_counter=jnp.zeros([], jnp.int32),
            tree=sum_tree_init(capacity, jnp.float32),
            max_priority=jnp.ones([], jnp.float32),
        )

    def add(
        state: PrioritizedBufferState, items: Any, episode_end: Any = None
    ) -> PrioritizedBufferState:
        state, slots = _write(state, items, episode_end, capacity)
        values = jnp.broadcast_to(state.max_priority, slots.shape)
        return state.replace(tree=sum_tree_set(state.tree, slots, values))

    def sample(
        state: PrioritizedBufferState, key: jax.Array, batch_size: int, beta: Any = None
    ) -> PrioritizedSample:
        batch_size = _check_static_int(batch_size, "batch_size")
        if beta is None:
            beta_ = jnp.float32(default_beta)
        else:
            if not isinstance(beta, (jax.Array, jax.core.Tracer)):
                b = np.asarray(beta, np.float64)
                if b.shape != () or not np.isfinite(b) or b < 0:
                    raise ValueError(f"beta must be a finite float >= 0, got {beta!r}")
            beta_ = jnp.nan_to_num(jnp.maximum(jnp.asarray(beta, jnp.float32), 0), nan=0.0)
        u = _uniform(key, (batch_size,), jnp.float32)
        indices, value = _tree_inverse_cdf(state.tree, u)
        # (N P)^-beta / max (N P)^-beta  ==  (p / min p)^-beta: the total cancels
        low = jnp.min(value)
        ratio = jnp.where(low > 0, value / jnp.where(low > 0, low, 1), 1)
        weights = jnp.where(ratio > 1, jnp.power(ratio, -beta_), 1.0)
        return PrioritizedSample(_gather(state.items, indices), indices, weights)

    def update(
        state: PrioritizedBufferState, indices: jax.Array, priorities: jax.Array
    ) -> PrioritizedBufferState:
        indices, valid = checked_indices(indices, capacity)
        priorities = jnp.broadcast_to(
            jnp.asarray(priorities, jnp.float32).reshape(-1), indices.shape
        )
        p = jnp.power(jnp.abs(priorities) + epsilon, alpha)
        p = jnp.minimum(p, value_cap(jnp.float32, state.tree.num_leaves))
        valid = valid & jnp.isfinite(priorities) & (indices < state.size)
        tree = _tree_set(state.tree, indices, p, valid)
        max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(valid, p, 0.0), initial=0.0))
        return state.replace(tree=tree, max_priority=max_p)

    def can_sample(state: Any, batch_size: int) -> jax.Array:
        return state.size >= jnp.maximum(batch_size, 1)

    def sample_sequences(
        state: Any, key: jax.Array, batch_size: int, length: int
    ) -> SequenceSample:
        return _sample_sequences(state, key, batch_size, length, capacity)

    default_beta = beta
    init.__doc__ = "Allocate the state for items shaped like ``example_item`` (no batch axis)."
    add.__doc__ = "Add ``items`` (leading batch axis) with the maximum priority; new state."
    sample.__doc__ = "Sample ``batch_size`` (static) items by priority, with IS weights."
    update.__doc__ = "Set the priorities of the slots ``indices``; return the new state."
    can_sample.__doc__ = "Whether the buffer holds at least ``batch_size`` items."
    sample_sequences.__doc__ = _SEQ_DOC
    return PrioritizedBuffer(
        init, add, sample, can_sample, update, sample_sequences, capacity, alpha, beta, epsilon
    )
