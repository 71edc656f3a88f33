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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from coax_utils._checks import check_choice, check_float, checked_indices
from coax_utils._dataclass import pytree_dataclass
from coax_utils._random import random_index, random_uniform
from coax_utils.replay._functional_checks import check_restored_state
from coax_utils.replay._functional_common import (
    SEQ_DOC,
    VERSION_MAX,
    check_beta,
    check_capacity,
    check_state,
    check_static_int,
    checked_versions,
    compiled,
    gather_rows,
    host_indices,
    init_storage,
    sample_windows,
    slot_versions,
    write_rows,
)
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

    A state restored from a checkpoint is checked before use (its ``__checkpoint_check__``
    raises ValueError for a state that breaks an invariant, e.g. ``size`` beyond the
    capacity; the invariants are listed in ``coax_utils/replay/_functional_checks.py``).
    """

    items: Any
    pos: jax.Array
    size: jax.Array
    episode: jax.Array
    episode_counter: jax.Array

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state keeps the buffer's invariants."""
        check_restored_state(self, prioritized=False)


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
    capacity = check_capacity(capacity)

    def init(example_item: Any) -> UniformBufferState:
        return UniformBufferState(
            items=init_storage(example_item, capacity),
            pos=jnp.zeros([], jnp.int32),
            size=jnp.zeros([], jnp.int32),
            episode=jnp.zeros((capacity,), jnp.int32),
            episode_counter=jnp.zeros([], jnp.int32),
        )

    def add(state: UniformBufferState, items: Any, episode_end: Any = None) -> UniformBufferState:
        return write_rows(state, items, episode_end, capacity)[0]

    def sample(state: UniformBufferState, key: jax.Array, batch_size: int) -> Any:
        batch_size = check_static_int(batch_size, "batch_size")
        check_state(state, capacity)
        return gather_rows(state.items, random_index(key, (batch_size,), state.size))

    def can_sample(state: Any, batch_size: int) -> jax.Array:
        return state.size >= jnp.maximum(batch_size, 1)

    def sample_sequences(
        state: Any, key: jax.Array, batch_size: int, length: int
    ) -> SequenceSample:
        return sample_windows(state, key, batch_size, length, capacity)

    init.__doc__ = "Allocate the state for items shaped like ``example_item`` (no batch axis)."
    add.__doc__ = "Add ``items`` (leading batch axis) to the ring; return the new state."
    sample.__doc__ = "Sample ``batch_size`` (static) items uniformly with replacement."
    can_sample.__doc__ = "Whether the buffer holds at least ``batch_size`` items."
    sample_sequences.__doc__ = SEQ_DOC
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
    laps : int32 Array
        How many times the write head came back to slot 0 (0 until the buffer is full),
        counted up to ``2**31 - 1`` and then again from 1. As the ring writes its slots in
        order, the laps and ``pos`` give the version of every slot: the number of times it
        was written (0 for a slot never written), counted the same way. A sample returns
        the versions of its slots, and ``update`` ignores the slots whose version changed
        since.

    A state restored from a checkpoint is checked before use, as a
    :class:`UniformBufferState`, plus the sum tree (sums, padding, no negative or NaN
    priority), priorities of 0 in empty slots and at most ``max_priority`` in filled ones,
    and ``laps`` (0 exactly while the buffer is not full).
    """

    items: Any
    pos: jax.Array
    size: jax.Array
    episode: jax.Array
    episode_counter: jax.Array
    tree: SumTreeState
    max_priority: jax.Array
    laps: jax.Array

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state keeps the buffer's invariants."""
        check_restored_state(self, prioritized=True)


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
    versions : int32 Array, shape ``(batch_size,)``
        The versions of the sampled slots, their write counts (see
        :class:`PrioritizedBufferState`): pass them to ``update`` with the indices, so that
        an update for a slot overwritten since is ignored.
    """

    items: Any
    indices: jax.Array
    weights: jax.Array
    versions: jax.Array


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
    - ``update(state, indices, priorities, versions=None) -> state``: set new priorities
      of the slots ``indices`` (the ``indices`` of a sample). Pass the sample's
      ``versions`` too: an update for a slot that was written again since it was sampled
      is then ignored, as the host buffer ignores the id of an overwritten transition (the
      version of a slot is its write count, which ``sample`` returns; it repeats only
      after ``2**31 - 1`` writes of one slot). Without ``versions`` the priority goes
      to whatever item the slot holds now. With duplicate indices the last one wins;
      NaN or infinite priorities, indices of empty slots and out-of-range indices (whatever
      their integer dtype: ``2**32 + 1`` does not wrap to slot 1) are ignored, since nothing
      can be raised inside a jitted function for a value; a non-integer ``indices`` or
      ``versions`` dtype raises a TypeError while tracing. :math:`p_i` is capped at
      ``finfo(float32).max / (2 L)`` (``L`` the sum tree's leaf count), so the total
      priority stays finite and weights never become NaN.

    Everything is jittable, vmappable and donation-friendly
    (``jax.jit(buffer.update, donate_argnums=0)``), and ``add``, ``sample`` and ``update``
    come compiled, as for :func:`make_uniform_buffer`. A concrete ``beta`` and NumPy
    ``indices`` are checked before they are traced (an int64 index beyond int32 is ignored,
    not wrapped onto another slot). ``update``'s priorities must be one value for all
    indices or one per index in their layout (axes of size 1 aside), else ValueError; the
    same rule holds for ``versions``.

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

    Slot 2 is overwritten before the update of its old item arrives: the update is ignored.

    >>> state = buffer.add(state, jnp.ones((5, 3)))  # slots 4..7, then 0 (full: 8 items)
    >>> state = buffer.add(state, jnp.ones((2, 3)))  # slots 1 and 2
    >>> new = buffer.update(state, sample.indices, jnp.zeros(16), sample.versions)
    >>> bool(jnp.array_equal(new.tree.nodes, state.tree.nodes))
    True
    """
    capacity = check_capacity(capacity)
    alpha = check_float(alpha, "alpha", low=0)
    beta = check_float(beta, "beta", low=0)
    epsilon = check_float(epsilon, "epsilon", low=0, low_open=True)
    strategy = check_choice(tree_strategy, "tree_strategy", SUM_TREE_STRATEGIES)

    def init(example_item: Any) -> PrioritizedBufferState:
        return PrioritizedBufferState(
            items=init_storage(example_item, capacity),
            pos=jnp.zeros([], jnp.int32),
            size=jnp.zeros([], jnp.int32),
            episode=jnp.zeros((capacity,), jnp.int32),
            episode_counter=jnp.zeros([], jnp.int32),
            tree=sum_tree_init(capacity, jnp.float32),
            max_priority=jnp.ones([], jnp.float32),
            laps=jnp.zeros([], jnp.int32),
        )

    def add(
        state: PrioritizedBufferState, items: Any, episode_end: Any = None
    ) -> PrioritizedBufferState:
        new, slots = write_rows(state, items, episode_end, capacity)
        values = jnp.broadcast_to(new.max_priority, slots.shape)
        # the write head came back to slot 0: one more lap (from 2**31 - 1 back to 1)
        wrapped = state.pos >= capacity - slots.shape[0]
        return new.replace(
            tree=sum_tree_set(new.tree, slots, values, strategy),
            laps=jnp.where(wrapped, state.laps % VERSION_MAX + 1, state.laps),
        )

    def sample(
        state: PrioritizedBufferState, key: jax.Array, batch_size: int, beta: Any = None
    ) -> PrioritizedSample:
        check_beta(beta)  # a concrete beta, before it is traced
        return compiled_sample(state, key, batch_size, beta)

    def sample_traced(
        state: PrioritizedBufferState, key: jax.Array, batch_size: int, beta: Any
    ) -> PrioritizedSample:
        batch_size = check_static_int(batch_size, "batch_size")
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
        versions = slot_versions(state, indices)
        return PrioritizedSample(gather_rows(state.items, indices), indices, weights, versions)

    def update(
        state: PrioritizedBufferState,
        indices: jax.Array,
        priorities: jax.Array,
        versions: jax.Array | None = None,
    ) -> PrioritizedBufferState:
        if versions is not None:
            versions = checked_versions(versions, indices)
        return compiled_update(state, *host_indices(indices, priorities, capacity), versions)

    def update_traced(
        state: PrioritizedBufferState,
        indices: jax.Array,
        priorities: jax.Array,
        versions: jax.Array | None,
    ) -> PrioritizedBufferState:
        check_state(state, capacity)
        indices, valid = checked_indices(indices, capacity)
        priorities = jnp.broadcast_to(
            jnp.asarray(priorities, jnp.float32).reshape(-1), indices.shape
        )
        p = jnp.power(jnp.abs(priorities) + epsilon, alpha)
        p = jnp.minimum(p, state.tree.max_value)
        valid = valid & jnp.isfinite(priorities) & (indices < state.size)
        if versions is not None:  # the item sampled is still there
            held = slot_versions(state, indices)
            valid = valid & (held == jnp.broadcast_to(versions, indices.shape))
        tree = sum_tree_set(state.tree, jnp.where(valid, indices, -1), p, strategy)
        max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(valid, p, 0.0), initial=0.0))
        return state.replace(tree=tree, max_priority=max_p)

    def can_sample(state: Any, batch_size: int) -> jax.Array:
        return state.size >= jnp.maximum(batch_size, 1)

    def sample_sequences(
        state: Any, key: jax.Array, batch_size: int, length: int
    ) -> SequenceSample:
        return sample_windows(state, key, batch_size, length, capacity)

    default_beta = beta
    compiled_sample = compiled(sample_traced, (2,))
    compiled_update = compiled(update_traced)
    init.__doc__ = "Allocate the state for items shaped like ``example_item`` (no batch axis)."
    add.__doc__ = "Add ``items`` (leading batch axis) with the maximum priority; new state."
    sample.__doc__ = "Sample ``batch_size`` (static) items by priority, with IS weights."
    update.__doc__ = (
        "Set the priorities of the slots ``indices`` (of ``versions``); return the new state."
    )
    can_sample.__doc__ = "Whether the buffer holds at least ``batch_size`` items."
    sample_sequences.__doc__ = SEQ_DOC
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
