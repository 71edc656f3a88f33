"""Jittable replay buffers for frame-stacked observations that store each frame once.

The frame ring (:class:`_FrameRing`) is shared: the uniform buffer composes it with
:func:`make_uniform_buffer`, the prioritized one with :func:`make_prioritized_buffer`, whose
state holds the transitions with ``S`` and ``S_next`` replaced by int32 frame ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_int, checked_indices
from coax_utils._dataclass import pytree_dataclass
from coax_utils._random import random_index
from coax_utils.replay._frames import match_window
from coax_utils.replay._functional import (
    PrioritizedBufferState,
    PrioritizedSample,
    UniformBufferState,
    check_beta,
    check_state,
    compiled,
    gather_rows,
    host_indices,
    make_prioritized_buffer,
    make_uniform_buffer,
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

_REJECTION_ROUNDS = 32
_COUNTER_SPAN = 2**30  # frame ids and transition counts wrap below this (int32 counters)
_PRUNE_CHUNK = 64  # transitions checked per round for lost frames (prioritized add)


# -- the frame ring shared by both buffers ----------------------------------------------------


def _multipliers(n: int) -> np.ndarray:
    return np.random.default_rng(0x5EED).integers(1, 2**32, size=(2, n), dtype=np.uint32) | 1


def _fingerprints(frames: jax.Array) -> jax.Array:
    """Two 32-bit linear hashes of the bytes of each frame: ``(n, 2)`` uint32."""
    n = frames.shape[0]
    if frames.dtype == jnp.bool_:  # (bool cannot be bitcast; its bytes are 0 and 1)
        frames = frames.astype(jnp.uint8)
    raw = jax.lax.bitcast_convert_type(frames, jnp.uint8).reshape(n, -1)
    pad = -raw.shape[1] % 4
    raw = jnp.pad(raw, ((0, 0), (0, pad)))
    words = jax.lax.bitcast_convert_type(raw.reshape(n, -1, 4), jnp.uint32)
    mult = jnp.asarray(_multipliers(words.shape[1]))
    return jnp.stack([(words * m).sum(axis=1, dtype=jnp.uint32) for m in mult], axis=1)


@dataclasses.dataclass(frozen=True)
class _FrameRing:
    """Frame storage of the jittable frame-stacked buffers (configuration; pure methods).

    Frame ``i`` lives at row ``i % capacity`` of ``frames``; a transition refers to its
    frames by id, and lost one when one of its ids is more than ``capacity`` frames older
    than ``frame_count``. Ids and ``frame_count`` count modulo ``modulus`` (a multiple of
    ``capacity`` near ``2**30``), so the int32 counters never overflow; every age is taken
    modulo it, which is exact because no stored transition refers to a frame more than
    ``modulus / 4`` frames old (checked by :meth:`make`).
    New frames equal to one of the ``window`` newest (``window <= capacity - 2 * k``, so a
    matched frame outlives the add that references it) are found by fingerprint in a
    direct-mapped table and confirmed byte for byte.
    """

    k: int
    capacity: int
    window: int
    bits: int
    modulus: int

    @classmethod
    def make(cls, capacity: int, stack_size: Any, frame_capacity: Any, window: Any) -> _FrameRing:
        """Check the arguments of a factory (``capacity`` checked already)."""
        k = check_int(stack_size, "stack_size", low=1)
        if frame_capacity is None:
            frame_capacity = capacity + capacity // 64 + 2 * k
        F = check_int(frame_capacity, "frame_capacity", low=2 * k, high=_COUNTER_SPAN // 4)
        window = min(check_int(window, "window", low=0), match_window(capacity, k, F))
        # a table of 8 entries per frame of the window (as used: at most frame_capacity
        # frames), at least 8192: frames that share an entry evict each other and are
        # stored again while both are in use
        bits = max(13, int(8 * window - 1).bit_length())
        modulus = F * (_COUNTER_SPAN // F)
        # a stored transition was added at most ``capacity`` transitions (2 k new frames
        # each) ago and refers to frames up to ``window`` older than that
        if 4 * (2 * k * capacity + window + F) > modulus:
            raise ValueError(
                f"capacity={capacity} with stack_size={k} and frame_capacity={F} is too large "
                "for the buffer's 32-bit frame counters"
            )
        return cls(k=k, capacity=F, window=window, bits=bits, modulus=modulus)

    def age(self, ids: jax.Array, frame_count: jax.Array) -> jax.Array:
        """How many frames were stored after the frames ``ids`` (exact for stored ids)."""
        return (frame_count - ids) % self.modulus

    def check(self, batch: Any, frames: Any, batched: bool) -> None:
        """Trace-time checks of the stacks of ``batch`` (against ``frames`` if given)."""
        k = self.k
        if not isinstance(batch, TransitionBatch):
            raise TypeError(f"transitions must be a TransitionBatch, got {type(batch).__name__}")
        for name in ("S", "S_next"):
            x = getattr(batch, name)
            shape = jnp.shape(x)[1:] if batched else jnp.shape(x)
            if not shape or shape[0] != k:
                raise ValueError(f"{name} must stack stack_size={k} frames, got shape {shape}")
            if frames is not None and (
                shape[1:] != frames.shape[1:] or jnp.result_type(x) != frames.dtype
            ):
                raise ValueError(
                    f"the frames of {name} are {jnp.result_type(x)}{list(shape[1:])}; the "
                    f"buffer holds {frames.dtype}{list(frames.shape[1:])}"
                )

    def check_state(self, state: Any, capacity: int) -> None:
        """Trace-time check that ``state`` has the shapes of this buffer's states (a state of
        a buffer made with another capacity, frame_capacity or window would be read at
        other rows)."""
        table = 1 << self.bits
        more = [
            ("frames", state.frames, self.capacity),
            ("table_hash", state.table_hash, table),
            ("table_id", state.table_id, table),
        ]
        if hasattr(state, "birth"):
            more.append(("birth", state.birth, capacity))
        check_state(state.transitions, capacity, tuple(more))

    def init(self, example: TransitionBatch) -> tuple[TransitionBatch, dict[str, jax.Array]]:
        """The example with frame ids for stacks, and the initial frame fields of a state."""
        self.check(example, None, batched=False)
        S = jnp.asarray(example.S)
        ids = jnp.zeros((self.k,), jnp.int32)
        table = 1 << self.bits
        return example.replace(S=ids, S_next=ids, idx=None), dict(
            frames=jnp.zeros((self.capacity,) + S.shape[1:], S.dtype),
            frame_count=jnp.zeros([], jnp.int32),
            table_hash=jnp.zeros((table, 2), jnp.uint32),
            table_id=jnp.full((table,), -1, jnp.int32),
        )

    def store(self, state: Any, batch: TransitionBatch) -> tuple[TransitionBatch, dict]:
        """Store the new frames of ``batch``: the batch with frame ids and the frame fields."""
        self.check(batch, state.frames, batched=True)
        k, F, window, bits = self.k, self.capacity, self.window, self.bits
        n = jnp.shape(batch.S)[0]
        x = jnp.concatenate([jnp.asarray(batch.S), jnp.asarray(batch.S_next)], axis=1)
        x = x.reshape((2 * n * k,) + state.frames.shape[1:])

        born = state.frame_count

        def one(carry: tuple, item: tuple) -> tuple:
            frames, count, th, tid = carry
            frame, h = item
            # the high bits of a multiplicative mix: the low bits of a linear hash are weak
            mixed = (h[0] ^ (h[1] * jnp.uint32(0x85EBCA6B))) * jnp.uint32(0x9E3779B1)
            slot = (mixed >> (32 - bits)).astype(jnp.int32)
            cand = tid[slot]
            # frames stored from window frames before the add on (as the host buffer)
            reach = window + self.age(born, count)
            hit = (cand >= 0) & (self.age(cand, count) <= reach) & jnp.all(th[slot] == h)
            hit &= jnp.array_equal(frames[cand % F], frame)
            row = count % F
            frames = frames.at[row].set(jnp.where(hit, frames[row], frame))
            fid = jnp.where(hit, cand, count)
            th = th.at[slot].set(jnp.where(hit, th[slot], h))
            tid = tid.at[slot].set(fid)
            count = (count + 1 - hit.astype(jnp.int32)) % self.modulus
            return (frames, count, th, tid), fid

        carry = (state.frames, state.frame_count, state.table_hash, state.table_id)
        (frames, count, th, tid), ids = jax.lax.scan(one, carry, (x, _fingerprints(x)))
        ids = ids.reshape(n, 2, k)
        refs = batch.replace(S=ids[:, 0], S_next=ids[:, 1], idx=None)
        return refs, dict(frames=frames, frame_count=count, table_hash=th, table_id=tid)

    def lost(self, items: TransitionBatch, frame_count: jax.Array, slots: Any = None) -> jax.Array:
        """Whether transitions lost a frame: ``items`` (frame ids, leading batch axis), or
        those stored in ``slots`` of ``items``."""
        S, S_next = items.S, items.S_next
        if slots is not None:
            S, S_next = S[slots], S_next[slots]
        oldest = jnp.maximum(self.age(S, frame_count), self.age(S_next, frame_count)).max(-1)
        return oldest > self.capacity

    def rebuild(self, frames: jax.Array, items: TransitionBatch) -> TransitionBatch:
        """``items`` with the frame ids of ``S`` and ``S_next`` replaced by their frames.

        One gather per field, each written straight into its output (slicing one gather of
        both into two outputs costs a copy of every stack), without bounds handling (rows
        ``id % capacity`` are in bounds).
        """

        def stacks(ids: jax.Array) -> jax.Array:
            rows = frames.at[(ids % self.capacity).reshape(-1)].get(mode="promise_in_bounds")
            return rows.reshape(ids.shape + frames.shape[1:])

        return items.replace(S=stacks(items.S), S_next=stacks(items.S_next))


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
    """

    transitions: UniformBufferState
    frames: jax.Array
    frame_count: jax.Array
    table_hash: jax.Array
    table_id: jax.Array


@dataclasses.dataclass(frozen=True)
class FrameStackBuffer:
    """A jittable frame-stacked replay buffer: pure functions over a
    :class:`FrameStackBufferState`. Made by :func:`make_frame_stack_buffer`."""

    init: Callable[[TransitionBatch], FrameStackBufferState]
    add: Callable[[FrameStackBufferState, TransitionBatch], FrameStackBufferState]
    sample: Callable[[FrameStackBufferState, jax.Array, int], TransitionBatch]
    can_sample: Callable[[FrameStackBufferState, int], jax.Array]
    capacity: int
    stack_size: int
    frame_capacity: int


def make_frame_stack_buffer(
    capacity: int, stack_size: int, frame_capacity: int | None = None, window: int = 1024
) -> FrameStackBuffer:
    """Make a jittable uniform replay buffer for frame-stacked observations.

    The jittable counterpart of :class:`FrameStackReplayBuffer`: ``S`` and ``S_next`` of the
    added :class:`TransitionBatch` are stacks of ``stack_size`` frames (e.g. from
    :class:`gymnasium.wrappers.FrameStackObservation`); each frame is stored once (frames
    equal to one of the ``window`` newest are found by fingerprint and confirmed byte for
    byte) and ``sample`` rebuilds the stacks exactly as they were added. A transition that
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
        How many of the newest frames new frames are matched against (at most
        ``frame_capacity - 2 * stack_size`` are, so that a matched frame outlives the add).

    Returns
    -------
    buffer : FrameStackBuffer
        ``init(example_transition)`` (a :class:`TransitionBatch` without batch axis),
        ``add(state, transition_batch)``, ``sample(state, key, batch_size)`` (a
        :class:`TransitionBatch`) and ``can_sample(state, batch_size)``, all jittable
        (``batch_size`` static); ``add`` and ``sample`` come compiled, as those of
        :func:`make_uniform_buffer`.

    Raises
    ------
    TypeError, ValueError
        For a bad argument here, and at trace time for transitions whose frames differ in
        shape or dtype from the buffer's, or a state whose arrays have other sizes than this
        buffer's (a state of a buffer made with other arguments).
    """
    inner = make_uniform_buffer(capacity)
    capacity = inner.capacity
    ring = _FrameRing.make(capacity, stack_size, frame_capacity, window)

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
            return (i < _REJECTION_ROUNDS) & jnp.any(dead)

        key, sub = jax.random.split(key)
        slots = draw(sub)  # checked from the frame ids of the drawn slots alone
        _, _, slots, dead = jax.lax.while_loop(again, redraw, (0, key, slots, lost(slots)))
        slots = jnp.where(dead, (stored.pos - 1) % capacity, slots)
        return ring.rebuild(state.frames, gather_rows(stored.items, slots))

    def can_sample(state: FrameStackBufferState, batch_size: int) -> jax.Array:
        return inner.can_sample(state.transitions, batch_size)

    return FrameStackBuffer(
        init=init,
        add=compiled(add),
        sample=compiled(sample, (2,)),
        can_sample=can_sample,
        capacity=capacity,
        stack_size=ring.k,
        frame_capacity=ring.capacity,
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
    capacity: int
    stack_size: int
    frame_capacity: int
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
    index from then on. Finding those transitions costs no scan of the buffer: frames are
    matched only against the ``window`` newest, so a transition added when ``frame_count``
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
        priorities)`` and ``can_sample(state, batch_size)`` (false while no transition with
        all its frames is stored), all jittable (``batch_size`` static) and donation-friendly;
        ``add``, ``sample`` and ``update`` come compiled, as those of
        :func:`make_prioritized_buffer`.

    Raises
    ------
    TypeError, ValueError
        For a bad argument here, and at trace time for transitions whose frames differ in
        shape or dtype from the buffer's, or a state whose arrays have other sizes than this
        buffer's (a state of a buffer made with other arguments).
    """
    inner = make_prioritized_buffer(capacity, alpha, beta, epsilon, tree_strategy)
    capacity, strategy = inner.capacity, inner.tree_strategy
    ring = _FrameRing.make(capacity, stack_size, frame_capacity, window)
    chunk = min(_PRUNE_CHUNK, capacity)
    added_modulus = capacity * (_COUNTER_SPAN // capacity)

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
        state: PrioritizedFrameStackBufferState, indices: jax.Array, priorities: jax.Array
    ) -> PrioritizedFrameStackBufferState:
        return compiled_update(state, *host_indices(indices, priorities, capacity))

    def update_traced(
        state: PrioritizedFrameStackBufferState, indices: jax.Array, priorities: jax.Array
    ) -> PrioritizedFrameStackBufferState:
        ring.check_state(state, capacity)
        indices, valid = checked_indices(indices, capacity)
        slots = jnp.maximum(indices, 0)
        lost = ring.lost(state.transitions.items, state.frame_count, slots)
        indices = jnp.where(valid & ~lost, indices, -1)
        return state.replace(transitions=inner.update(state.transitions, indices, priorities))

    compiled_update = compiled(update_traced)

    def can_sample(state: PrioritizedFrameStackBufferState, batch_size: int) -> jax.Array:
        has_frames = sum_tree_total(state.transitions.tree) > 0
        return inner.can_sample(state.transitions, batch_size) & has_frames

    init.__doc__ = "Allocate the state for transitions shaped like ``example`` (no batch axis)."
    add.__doc__ = "Add a batch of transitions with the maximum priority; return the new state."
    sample.__doc__ = "Sample ``batch_size`` (static) transitions by priority, with IS weights."
    update.__doc__ = "Set the priorities of the slots ``indices``; return the new state."
    can_sample.__doc__ = "Whether ``batch_size`` transitions with all their frames are stored."
    return PrioritizedFrameStackBuffer(
        init=init,
        add=compiled(add),
        sample=sample,
        can_sample=can_sample,
        update=update,
        capacity=capacity,
        stack_size=ring.k,
        frame_capacity=ring.capacity,
        alpha=inner.alpha,
        beta=inner.beta,
        epsilon=inner.epsilon,
        tree_strategy=strategy,
    )
