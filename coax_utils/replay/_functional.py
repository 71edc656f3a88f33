r"""Jittable replay buffers: frozen containers of pure functions over pytree states.

Random numbers come from :mod:`jax.random` with the caller's ``key``, whatever its
implementation (threefry, rbg, unsafe_rbg; typed keys or raw ``uint32`` keys of the default
implementation): same key, same sample; split keys as usual (see
``coax_utils._random`` for how small draws stay cheap on a CPU). Uniform indices are drawn
as 32 random bits reduced modulo the number of stored items, uniform up to a relative bias
below ``size / 2**32``; priority draws use the top 24 bits of a word as a uniform number.
The priorities of the prioritized buffer live in the package's one functional sum tree
(:func:`coax_utils.utils.sum_tree_set` and friends).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import (
    check_choice,
    check_float,
    check_int,
    check_pairs_up,
    checked_indices,
)
from coax_utils._dataclass import pytree_dataclass
from coax_utils._random import random_index, random_uniform
from coax_utils.replay._sequence import SequenceSample
from coax_utils.utils import (
    SUM_TREE_STRATEGIES,
    SumTreeState,
    sum_tree_init,
    sum_tree_inverse_cdf,
    sum_tree_set,
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


# -- shared helpers -------------------------------------------------------------------------


def _check_capacity(capacity: Any) -> int:
    return check_int(capacity, "capacity", low=1, high=2**31 - 1)


def _check_static_int(value: Any, name: str) -> int:
    return check_int(value, name, low=1)


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


def check_beta(beta: Any) -> None:
    """Check a concrete ``beta`` of a prioritized sample (traced ones are clipped to >= 0)."""
    if beta is not None and not isinstance(beta, (jax.Array, jax.core.Tracer)):
        check_float(beta.item() if isinstance(beta, np.ndarray) else beta, "beta", low=0)


def _init_storage(example_item: Any, capacity: int) -> Any:
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
    # a truth value, as the host buffers read it: any nonzero mark ends the episode
    ends = jnp.broadcast_to(jnp.asarray(episode_end) != 0, (batch_size,)).astype(jnp.int32)
    csum = jnp.cumsum(ends, dtype=jnp.int32)
    return counter + csum - ends, counter + csum[-1]


def _write(state: Any, items: Any, episode_end: Any, capacity: int) -> tuple[Any, jax.Array]:
    check_state(state, capacity)
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
    if row_bytes > _ROW_LOOP_MAX_BYTES or slots.shape[0] > _ROW_LOOP_MAX_ROWS:
        return gather(storage, slots)
    return jax.lax.platform_dependent(storage, slots, cpu=loop, default=gather)


def _sample_sequences(
    state: Any, key: jax.Array, batch_size: int, length: int, capacity: int
) -> SequenceSample:
    batch_size = _check_static_int(batch_size, "batch_size")
    length = _check_static_int(length, "length")
    if length > capacity:
        raise ValueError(f"length={length} exceeds the buffer's capacity {capacity}")
    # compiled once per shape: called eagerly, the platform-dependent draws and gathers
    # would be traced and compiled anew on every call
    return _sample_windows(state, key, batch_size, length, capacity)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _sample_windows(
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


_SEQ_DOC = """Sample ``batch_size`` contiguous windows of ``length`` items (jittable).

        Window starts are uniform over the positions (in insertion order) that leave room for
        ``length`` stored items. Windows never cross an episode boundary (rows added with
        ``episode_end=True``): steps after the end of the first episode are *masked* and padded
        by repeating the last valid step. While the buffer holds fewer than ``length`` items,
        windows start at the oldest item and the steps past the newest are masked (every step,
        when it is empty: check ``can_sample`` first). ``batch_size`` and ``length`` are
        static. Returns a
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
      ``episode_end`` (bool, per item; any nonzero number counts as True) marks the last
      item of an episode; only ``sample_sequences`` uses it.
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
    use the donated state afterwards). ``add`` and ``sample`` come compiled with
    :func:`jax.jit` already (once per shapes, ``batch_size`` static), so calls outside
    ``jit`` are fast too; inside a caller's ``jit`` they are inlined.

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
        check_state(state, capacity)
        return gather_rows(state.items, random_index(key, (batch_size,), state.size))

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
    return UniformBuffer(
        init, compiled(add), compiled(sample, (2,)), can_sample, sample_sequences, capacity
    )


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
    tree_strategy: str


def make_prioritized_buffer(
    capacity: int,
    alpha: float = 1.0,
    beta: float = 1.0,
    epsilon: float = 1e-4,
    tree_strategy: str = "auto",
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
    slots have priority 0 and are never sampled. The priorities live in the functional sum
    tree of :mod:`coax_utils.utils` (:func:`~coax_utils.utils.sum_tree_set`,
    :func:`~coax_utils.utils.sum_tree_inverse_cdf`). The defaults (``alpha=1``, ``beta=1``,
    ``epsilon=1e-4``) are coax's and those of the host
    :class:`~coax_utils.replay.PrioritizedReplayBuffer`; flashbax and the PER paper's
    Atari runs use ``alpha=0.6`` with ``beta`` annealed from 0.4.

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
    (``jax.jit(buffer.update, donate_argnums=0)``), and ``add``, ``sample`` and ``update``
    come compiled, as for :func:`make_uniform_buffer`. A concrete ``beta`` and NumPy
    ``indices`` are checked before they are traced (an int64 index beyond int32 is ignored,
    not wrapped onto another slot). ``update``'s priorities must be one value for all
    indices or one per index in their layout (axes of size 1 aside), else ValueError.

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
    tree_strategy : {"auto", "sequential", "vectorized"}, optional
        How ``add`` and ``update`` write priorities into the sum tree (the ``strategy`` of
        :func:`coax_utils.utils.sum_tree_set`): ``"sequential"`` (one index at a time,
        fastest on a CPU), ``"vectorized"`` (one scatter per tree level, for GPUs and TPUs),
        or ``"auto"`` (default: sequential when the computation is compiled for a CPU,
        vectorized otherwise).

    Returns
    -------
    buffer : PrioritizedBuffer

    Raises
    ------
    TypeError
        If an argument has a wrong type (e.g. a float ``capacity``, a str ``alpha``).
    ValueError
        If an argument is out of range or ``tree_strategy`` is unknown.

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
    alpha = check_float(alpha, "alpha", low=0)
    beta = check_float(beta, "beta", low=0)
    epsilon = check_float(epsilon, "epsilon", low=0, low_open=True)
    strategy = check_choice(tree_strategy, "tree_strategy", SUM_TREE_STRATEGIES)

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
        return state.replace(tree=sum_tree_set(state.tree, slots, values, strategy))

    def sample(
        state: PrioritizedBufferState, key: jax.Array, batch_size: int, beta: Any = None
    ) -> PrioritizedSample:
        check_beta(beta)  # a concrete beta, before it is traced
        return compiled_sample(state, key, batch_size, beta)

    def sample_traced(
        state: PrioritizedBufferState, key: jax.Array, batch_size: int, beta: Any
    ) -> PrioritizedSample:
        batch_size = _check_static_int(batch_size, "batch_size")
        check_state(state, capacity)
        if beta is None:
            beta_ = jnp.float32(default_beta)
        else:
            beta_ = jnp.nan_to_num(jnp.maximum(jnp.asarray(beta, jnp.float32), 0), nan=0.0)
        u = random_uniform(key, batch_size)
        indices, value = sum_tree_inverse_cdf(state.tree, u, return_values=True)
        # (N P)^-beta / max (N P)^-beta  ==  (p / min p)^-beta: the total cancels
        low = jnp.min(value)
        ratio = jnp.where(low > 0, value / jnp.where(low > 0, low, 1), 1)
        weights = jnp.where(ratio > 1, jnp.power(ratio, -beta_), 1.0)
        return PrioritizedSample(gather_rows(state.items, indices), indices, weights)

    def update(
        state: PrioritizedBufferState, indices: jax.Array, priorities: jax.Array
    ) -> PrioritizedBufferState:
        return compiled_update(state, *host_indices(indices, priorities, capacity))

    def update_traced(
        state: PrioritizedBufferState, indices: jax.Array, priorities: jax.Array
    ) -> PrioritizedBufferState:
        check_state(state, capacity)
        indices, valid = checked_indices(indices, capacity)
        priorities = jnp.broadcast_to(
            jnp.asarray(priorities, jnp.float32).reshape(-1), indices.shape
        )
        p = jnp.power(jnp.abs(priorities) + epsilon, alpha)
        p = jnp.minimum(p, state.tree.max_value)
        valid = valid & jnp.isfinite(priorities) & (indices < state.size)
        tree = sum_tree_set(state.tree, jnp.where(valid, indices, -1), p, strategy)
        max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(valid, p, 0.0), initial=0.0))
        return state.replace(tree=tree, max_priority=max_p)

    def can_sample(state: Any, batch_size: int) -> jax.Array:
        return state.size >= jnp.maximum(batch_size, 1)

    def sample_sequences(
        state: Any, key: jax.Array, batch_size: int, length: int
    ) -> SequenceSample:
        return _sample_sequences(state, key, batch_size, length, capacity)

    default_beta = beta
    compiled_sample = compiled(sample_traced, (2,))
    compiled_update = compiled(update_traced)
    init.__doc__ = "Allocate the state for items shaped like ``example_item`` (no batch axis)."
    add.__doc__ = "Add ``items`` (leading batch axis) with the maximum priority; new state."
    sample.__doc__ = "Sample ``batch_size`` (static) items by priority, with IS weights."
    update.__doc__ = "Set the priorities of the slots ``indices``; return the new state."
    can_sample.__doc__ = "Whether the buffer holds at least ``batch_size`` items."
    sample_sequences.__doc__ = _SEQ_DOC
    return PrioritizedBuffer(
        init,
        compiled(add),
        sample,
        can_sample,
        update,
        sample_sequences,
        capacity,
        alpha,
        beta,
        epsilon,
        strategy,
    )
