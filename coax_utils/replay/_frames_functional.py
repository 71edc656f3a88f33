"""Jittable replay buffers for frame-stacked observations that store each frame once.

The frame ring (``FrameRing`` in ``_frames_ring.py``) is shared: the uniform buffer composes it with
:func:`make_uniform_buffer`, the prioritized one with :func:`make_prioritized_buffer`, whose
state holds the transitions with ``S`` and ``S_next`` replaced by int32 frame ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from coax_utils._checks import check_int, checked_indices
from coax_utils._dataclass import pytree_dataclass
from coax_utils._random import random_index
from coax_utils.replay._frames_checks import check_frame_state
from coax_utils.replay._frames_ring import COUNTER_SPAN, FrameRing
from coax_utils.replay._functional import (
    PrioritizedBufferState,
    PrioritizedSample,
    UniformBufferState,
    check_beta,
    compiled,
    gather_rows,
    host_indices,
    make_prioritized_buffer,
    make_uniform_buffer,
    slot_versions,
)
from coax_utils.replay._transition import TransitionBatch
from coax_utils.utils import sum_tree_set, sum_tree_total

__all__ = [
    "FrameStackBuffer",
    "FrameStackBufferState",
    "PrioritizedFrameStackBuffer",
    "PrioritizedFrameStackBufferState",
    "make_frame_stack_buffer",
    "make_prioritized_frame_stack_buffer",
]

REJECTION_ROUNDS = 32  # redraws of transitions that lost frames (uniform sample)
_PRUNE_CHUNK = 64  # transitions checked per round for lost frames (prioritized add)


def _check_batch_size(batch_size: Any) -> int:
    return check_int(batch_size, "batch_size", low=1)


# -- uniform --------------------------------------------------------------------------------


@pytree_dataclass
class FrameStackBufferState:
    """State of a :func:`make_frame_stack_buffer` buffer (a pytree).

    Attributes
    ----------
    transitions : UniformBufferState
        The transitions, with ``S`` and ``S_next`` replaced by the int32 ids of their frames.
    frames : Array, shape ``(frame_capacity, *frame_shape)``
        The frames, frame ``i`` at row ``i % frame_capacity``.
    frame_count : int32 Array
        The number of frames stored (the id of the next one), modulo ``frame_capacity *
        (2**30 // frame_capacity)``: frame ids count modulo the same number, so the counters
        never overflow however long the buffer runs.
    table_hash : uint32 Array, shape ``(table_size, 2)``
        Fingerprints of recently stored frames (a direct-mapped table).
    table_id : int32 Array, shape ``(table_size,)``
        The frame id of each table entry (-1: empty).

    A state restored from a checkpoint is checked before use (``__checkpoint_check__``): a
    state that breaks an invariant (frame ids from the future or out of range, counters out
    of range, shapes that disagree; for the prioritized state also births, window, frontier
    and a priority above 0 for a transition that lost frames) raises ValueError.
    """

    transitions: UniformBufferState
    frames: jax.Array
    frame_count: jax.Array
    table_hash: jax.Array
    table_id: jax.Array

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state keeps the buffer's invariants
        (listed in ``coax_utils/replay/_frames_checks.py``)."""
        check_frame_state(self, UniformBufferState)


@dataclasses.dataclass(frozen=True)
class FrameStackBuffer:
    """A jittable frame-stacked replay buffer: pure functions over a
    :class:`FrameStackBufferState`. Made by :func:`make_frame_stack_buffer`."""

    init: Callable[[TransitionBatch], FrameStackBufferState]
    add: Callable[[FrameStackBufferState, TransitionBatch], FrameStackBufferState]
    sample: Callable[[FrameStackBufferState, jax.Array, int], TransitionBatch]
    can_sample: Callable[[FrameStackBufferState, int], jax.Array]
    gather: Callable[[FrameStackBufferState, jax.Array], TransitionBatch]
    capacity: int
    stack_size: int
    frame_capacity: int
    window: int


def make_frame_stack_buffer(
    capacity: int, stack_size: int, frame_capacity: int | None = None, window: int = 1024
) -> FrameStackBuffer:
    """Make a jittable uniform replay buffer for frame-stacked observations.

    The jittable counterpart of :class:`FrameStackReplayBuffer`: ``S`` and ``S_next`` of the
    added :class:`TransitionBatch` are stacks of ``stack_size`` frames (e.g. from
    :class:`gymnasium.wrappers.FrameStackObservation`); each frame is stored once (frames
    equal to one stored at most ``window`` frames before the add are found by fingerprint
    and confirmed byte for byte; the window is that of :class:`FrameStackReplayBuffer`, so a
    referenced frame outlives the transitions that refer to it, and transitions lose frames
    in the order they were added) and ``sample`` rebuilds the stacks exactly as they were
    added. A transition that
    lost a frame to the frame ring is redrawn (up to 32 rounds; a row still drawing such
    transitions after that, which takes a ``frame_capacity`` far too small, gets the newest
    transition).

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    stack_size : int
        The number of frames per observation.
    frame_capacity : int, optional
        The number of frames stored (default ``capacity + capacity // 64 + 2 * stack_size``),
        at least ``2 * stack_size``. Frame ids are int32 counters that wrap around (see
        :class:`FrameStackBufferState`), which limits ``4 * (2 * stack_size * capacity +
        window + frame_capacity)`` to ``2**30`` (about 30M transitions for stacks of 4).
    window : int, optional
        At most how many of the newest frames new frames are matched against: the window
        is the smaller of this and the room ``frame_capacity`` leaves beyond ``capacity +
        capacity // 64 + 1`` frames (at least ``2 * stack_size - 1``, at most
        ``frame_capacity - 2 * stack_size``), as in :class:`FrameStackReplayBuffer`.

    Returns
    -------
    buffer : FrameStackBuffer
        ``init(example_transition)`` (a :class:`TransitionBatch` without batch axis),
        ``add(state, transition_batch)``, ``sample(state, key, batch_size)`` (a
        :class:`TransitionBatch`), ``can_sample(state, batch_size)`` and
        ``gather(state, slots)``, all jittable (``batch_size`` static); ``add`` and
        ``sample`` come compiled, as those of :func:`make_uniform_buffer`. ``gather``
        (not compiled) returns the transitions stored in ``slots`` (int32, in
        ``[0, size)``), stacks rebuilt, for samplers of one's own (e.g. over a mesh): what
        ``sample`` returns for the slots it drew, except that ``gather`` does not redraw
        transitions that lost frames (their stacks come back with the frames now in those
        rows). ``window`` is the window in use (the argument, at most what
        ``frame_capacity`` leaves room for).

    Raises
    ------
    TypeError, ValueError
        For a bad argument here, and at trace time for transitions whose frames differ in
        shape or dtype from the buffer's, or a state whose arrays have other sizes than this
        buffer's (a state of a buffer made with other arguments).
    """
    inner = make_uniform_buffer(capacity)
    capacity = inner.capacity
    ring = FrameRing.make(capacity, stack_size, frame_capacity, window)

    def init(example: TransitionBatch) -> FrameStackBufferState:
        refs, fields = ring.init(example)
        return FrameStackBufferState(transitions=inner.init(refs), **fields)

    def add(state: FrameStackBufferState, batch: TransitionBatch) -> FrameStackBufferState:
        ring.check_state(state, capacity)
        refs, fields = ring.store(state, batch)
        return FrameStackBufferState(transitions=inner.add(state.transitions, refs), **fields)

    def sample(state: FrameStackBufferState, key: jax.Array, batch_size: int) -> TransitionBatch:
        batch_size = _check_batch_size(batch_size)
        ring.check_state(state, capacity)
        stored = state.transitions

        def draw(key: jax.Array) -> jax.Array:
            return random_index(key, (batch_size,), stored.size)

        def lost(slots: jax.Array) -> jax.Array:
            return ring.lost(stored.items, state.frame_count, slots)

        def redraw(carry: tuple) -> tuple:
            i, key, slots, dead = carry
            key, sub = jax.random.split(key)
            slots = jnp.where(dead, draw(sub), slots)
            return i + 1, key, slots, lost(slots)

        def again(carry: tuple) -> jax.Array:
            i, _, _, dead = carry
            return (i < REJECTION_ROUNDS) & jnp.any(dead)

        key, sub = jax.random.split(key)
        slots = draw(sub)  # checked from the frame ids of the drawn slots alone
        _, _, slots, dead = jax.lax.while_loop(again, redraw, (0, key, slots, lost(slots)))
        slots = jnp.where(dead, (stored.pos - 1) % capacity, slots)
        return ring.rebuild(state.frames, gather_rows(stored.items, slots))

    def can_sample(state: FrameStackBufferState, batch_size: int) -> jax.Array:
        return inner.can_sample(state.transitions, batch_size)

    def gather(state: FrameStackBufferState, slots: jax.Array) -> TransitionBatch:
        ring.check_state(state, capacity)
        return ring.rebuild(state.frames, gather_rows(state.transitions.items, slots))

    gather.__doc__ = "The transitions stored in ``slots`` (int32, in range), stacks rebuilt."
    return FrameStackBuffer(
        init=init,
        add=compiled(add),
        sample=compiled(sample, (2,)),
        can_sample=can_sample,
        gather=gather,
        capacity=capacity,
        stack_size=ring.k,
        frame_capacity=ring.capacity,
        window=ring.window,
    )


# -- prioritized ----------------------------------------------------------------------------


@pytree_dataclass
class PrioritizedFrameStackBufferState(FrameStackBufferState):
    """State of a :func:`make_prioritized_frame_stack_buffer` buffer (a pytree).

    Attributes
    ----------
    transitions : PrioritizedBufferState
        The transitions and their priorities, with ``S`` and ``S_next`` replaced by the int32
        ids of their frames.
    frames, frame_count, table_hash, table_id
        As in :class:`FrameStackBufferState`.
    birth : int32 Array, shape ``(capacity,)``
        ``frame_count`` when the transition in each slot was added (its frame ids are at
        most ``window`` frames older).
    window : int32 Array
        The largest ``window`` of the buffers that added to this state: a state used by
        buffers made with different windows still finds every transition that lost frames.
    added : int32 Array
        The number of transitions added so far, modulo ``capacity * (2**30 // capacity)``.
    frontier : int32 Array
        The number (in order of addition, modulo the same) of the oldest transition that may
        still hold all its frames: every older one has priority 0 or was overwritten.
    """

    transitions: PrioritizedBufferState  # (a field of the base class: keeps its position)
    birth: jax.Array
    window: jax.Array
    added: jax.Array
    frontier: jax.Array

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state keeps the buffer's invariants."""
        check_frame_state(self, PrioritizedBufferState)


@dataclasses.dataclass(frozen=True)
class PrioritizedFrameStackBuffer:
    """A jittable prioritized frame-stacked replay buffer: pure functions over a
    :class:`PrioritizedFrameStackBufferState`. Made by
    :func:`make_prioritized_frame_stack_buffer`."""

    init: Callable[[TransitionBatch], PrioritizedFrameStackBufferState]
    add: Callable[
        [PrioritizedFrameStackBufferState, TransitionBatch], PrioritizedFrameStackBufferState
    ]
    sample: Callable[..., PrioritizedSample]
    can_sample: Callable[[PrioritizedFrameStackBufferState, int], jax.Array]
    update: Callable[
        [PrioritizedFrameStackBufferState, jax.Array, jax.Array], PrioritizedFrameStackBufferState
    ]
    gather: Callable[..., PrioritizedSample]
    capacity: int
    stack_size: int
    frame_capacity: int
    window: int
    alpha: float
    beta: float
    epsilon: float
    tree_strategy: str


def make_prioritized_frame_stack_buffer(
    capacity: int,
    stack_size: int,
    alpha: float = 1.0,
    beta: float = 1.0,
    epsilon: float = 1e-4,
    frame_capacity: int | None = None,
    window: int = 1024,
    tree_strategy: str = "auto",
) -> PrioritizedFrameStackBuffer:
    r"""Make a jittable prioritized replay buffer for frame-stacked observations.

    The jittable counterpart of :class:`PrioritizedFrameStackReplayBuffer`: frames are
    stored once and stacks rebuilt as in :func:`make_frame_stack_buffer`; priorities,
    importance weights, ``sample``'s ``beta`` and ``update`` are those of
    :func:`make_prioritized_buffer` (the transitions, with frame ids for stacks, live in
    such a buffer). ``sample`` returns a :class:`PrioritizedSample` whose ``items`` is a
    :class:`TransitionBatch` of stacks.

    A transition whose frames were overwritten in the frame ring is never sampled: ``add``
    sets its priority to 0 when its oldest frame is overwritten, and ``update`` ignores its
    index from then on, so the tree's total is that of the transitions that can be
    sampled, in the state itself (checkpoints keep it). Finding those transitions costs no
    scan of the buffer: frames are matched only against the ``window`` newest, so a
    transition added when ``frame_count``
    was :math:`c` refers to frames :math:`\ge c - \text{window}` and can lose one only once
    ``frame_count`` exceeds :math:`c - \text{window} + \text{frame_capacity}`. ``add``
    checks the transitions, oldest first, from the oldest one that may still hold its
    frames up to the last one added early enough to lose any: with the default
    ``frame_capacity`` and episodes of 64 steps or more, none, and otherwise about
    ``window`` plus the added transitions. The importance weights are computed over the
    transitions that can be sampled, as by :func:`make_prioritized_buffer`.

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    stack_size : int
        The number of frames per observation.
    alpha, beta, epsilon : float, optional
        See :func:`make_prioritized_buffer`.
    frame_capacity : int, optional
        The number of frames stored, as in :func:`make_frame_stack_buffer`.
    window : int, optional
        How many of the newest frames new frames are matched against, as in
        :func:`make_frame_stack_buffer`.
    tree_strategy : {"auto", "sequential", "vectorized"}, optional
        See :func:`make_prioritized_buffer`.

    Returns
    -------
    buffer : PrioritizedFrameStackBuffer
        ``init(example_transition)``, ``add(state, transition_batch)``,
        ``sample(state, key, batch_size, beta=None)``, ``update(state, indices,
        priorities, versions=None)`` (pass the sample's ``versions``: an update of a slot
        written since it was sampled is ignored, as by the host buffer) and
        ``can_sample(state, batch_size)`` (false while no transition with all its frames is
        stored) and ``gather(state, slots, weights=None, versions=None)``, all jittable
        (``batch_size`` static) and donation-friendly; ``add``, ``sample`` and ``update``
        come compiled, as those of :func:`make_prioritized_buffer`. ``gather`` (not
        compiled) returns the :class:`PrioritizedSample` of the transitions stored in
        ``slots`` (int32, in ``[0, size)``), for samplers of one's own (e.g. over a mesh):
        ``indices`` the slots, ``weights`` those given (default 1) and ``versions`` those
        given (default the slots' current versions), so that a sample's slots, weights and
        versions give the sample back. ``window`` is the window in use, as in
        :func:`make_frame_stack_buffer`.

    Raises
    ------
    TypeError, ValueError
        For a bad argument here, and at trace time for transitions whose frames differ in
        shape or dtype from the buffer's, or a state whose arrays have other sizes than this
        buffer's (a state of a buffer made with other arguments).
    """
    inner = make_prioritized_buffer(capacity, alpha, beta, epsilon, tree_strategy)
    capacity, strategy = inner.capacity, inner.tree_strategy
    ring = FrameRing.make(capacity, stack_size, frame_capacity, window)
    chunk = min(_PRUNE_CHUNK, capacity)
    added_modulus = capacity * (COUNTER_SPAN // capacity)

    def init(example: TransitionBatch) -> PrioritizedFrameStackBufferState:
        refs, fields = ring.init(example)
        return PrioritizedFrameStackBufferState(
            transitions=inner.init(refs),
            **fields,
            birth=jnp.zeros((capacity,), jnp.int32),
            window=jnp.asarray(ring.window, jnp.int32),
            added=jnp.zeros([], jnp.int32),  # distinct arrays: the state may be donated
            frontier=jnp.zeros([], jnp.int32),
        )

    def prune(state: PrioritizedFrameStackBufferState) -> PrioritizedFrameStackBufferState:
        """Priority 0 for the transitions that lost frames; advance the frontier."""
        stored, count = state.transitions, state.frame_count
        # the transitions from the frontier (or the oldest stored) to the newest, oldest
        # first: transition start + o, for o < todo
        todo = jnp.minimum((state.added - state.frontier) % added_modulus, stored.size)
        start = (state.added - todo) % added_modulus
        # a transition born less than frame_capacity - window frames ago holds its frames
        # (the state's window: the largest of those its transitions were added with)
        old_enough = ring.capacity - jnp.clip(state.window, 0, ring.capacity)

        def more(carry: tuple) -> jax.Array:
            o, _, _, _ = carry
            born = state.birth[(start + o) % capacity]
            return (o < todo) & (ring.age(born, count) >= old_enough)

        def check(carry: tuple) -> tuple:
            o, frontier, blocked, tree = carry
            slots = (start + o + jnp.arange(chunk, dtype=jnp.int32)) % capacity
            lost = (o + jnp.arange(chunk) < todo) & ring.lost(stored.items, count, slots)
            tree = sum_tree_set(tree, jnp.where(lost, slots, -1), jnp.zeros(chunk), strategy)
            leading = jnp.sum(jnp.cumprod(lost), dtype=jnp.int32)
            frontier = jnp.where(blocked, frontier, (start + o + leading) % added_modulus)
            return o + chunk, frontier, blocked | (leading < chunk), tree

        carry = (jnp.zeros([], jnp.int32), start, jnp.asarray(False), stored.tree)
        _, frontier, _, tree = jax.lax.while_loop(more, check, carry)
        return state.replace(transitions=stored.replace(tree=tree), frontier=frontier)

    def add(
        state: PrioritizedFrameStackBufferState, batch: TransitionBatch
    ) -> PrioritizedFrameStackBufferState:
        ring.check_state(state, capacity)
        born = state.frame_count
        refs, fields = ring.store(state, batch)
        n = jnp.shape(refs.S)[0]
        slots = (state.transitions.pos + jnp.arange(n, dtype=jnp.int32)) % capacity
        state = state.replace(
            transitions=inner.add(state.transitions, refs),
            birth=state.birth.at[slots].set(born, unique_indices=True),
            window=jnp.maximum(state.window, ring.window),
            added=(state.added + n) % added_modulus,
            **fields,
        )
        return prune(state)

    def sample(
        state: PrioritizedFrameStackBufferState,
        key: jax.Array,
        batch_size: int,
        beta: Any = None,
    ) -> PrioritizedSample:
        check_beta(beta)  # a concrete beta, before it is traced
        return compiled_sample(state, key, batch_size, beta)

    def sample_traced(
        state: PrioritizedFrameStackBufferState, key: jax.Array, batch_size: int, beta: Any
    ) -> PrioritizedSample:
        ring.check_state(state, capacity)
        drawn = inner.sample(state.transitions, key, batch_size, beta)
        return drawn.replace(items=ring.rebuild(state.frames, drawn.items))

    compiled_sample = compiled(sample_traced, (2,))

    def update(
        state: PrioritizedFrameStackBufferState,
        indices: jax.Array,
        priorities: jax.Array,
        versions: jax.Array | None = None,
    ) -> PrioritizedFrameStackBufferState:
        return compiled_update(state, *host_indices(indices, priorities, capacity), versions)

    def update_traced(
        state: PrioritizedFrameStackBufferState,
        indices: jax.Array,
        priorities: jax.Array,
        versions: jax.Array | None,
    ) -> PrioritizedFrameStackBufferState:
        ring.check_state(state, capacity)
        indices, valid = checked_indices(indices, capacity)
        slots = jnp.maximum(indices, 0)
        lost = ring.lost(state.transitions.items, state.frame_count, slots)
        indices = jnp.where(valid & ~lost, indices, -1)
        # (the versions of a sample: the inner buffer ignores slots written since)
        transitions = inner.update(state.transitions, indices, priorities, versions)
        return state.replace(transitions=transitions)

    compiled_update = compiled(update_traced)

    def can_sample(state: PrioritizedFrameStackBufferState, batch_size: int) -> jax.Array:
        has_frames = sum_tree_total(state.transitions.tree) > 0
        return inner.can_sample(state.transitions, batch_size) & has_frames

    def gather(
        state: PrioritizedFrameStackBufferState,
        slots: jax.Array,
        weights: Any = None,
        versions: Any = None,
    ) -> PrioritizedSample:
        ring.check_state(state, capacity)
        stored = state.transitions
        items = ring.rebuild(state.frames, gather_rows(stored.items, slots))
        if weights is None:
            weights = jnp.ones(jnp.shape(slots), jnp.float32)
        if versions is None:
            versions = slot_versions(stored, slots)
        return PrioritizedSample(items, slots, weights, versions)

    init.__doc__ = "Allocate the state for transitions shaped like ``example`` (no batch axis)."
    add.__doc__ = "Add a batch of transitions with the maximum priority; return the new state."
    sample.__doc__ = "Sample ``batch_size`` (static) transitions by priority, with IS weights."
    update.__doc__ = (
        "Set the priorities of the slots ``indices`` (with a sample's ``versions``, only of "
        "those not written since); return the new state."
    )
    can_sample.__doc__ = "Whether ``batch_size`` transitions with all their frames are stored."
    gather.__doc__ = "The :class:`PrioritizedSample` of the transitions stored in ``slots``."
    return PrioritizedFrameStackBuffer(
        init=init,
        add=compiled(add),
        sample=sample,
        can_sample=can_sample,
        update=update,
        gather=gather,
        capacity=capacity,
        stack_size=ring.k,
        frame_capacity=ring.capacity,
        window=ring.window,
        alpha=inner.alpha,
        beta=inner.beta,
        epsilon=inner.epsilon,
        tree_strategy=strategy,
    )
