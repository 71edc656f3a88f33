"""A jittable replay buffer for frame-stacked observations that stores each frame once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._dataclass import pytree_dataclass
from coax_utils.replay._functional import UniformBufferState, make_uniform_buffer
from coax_utils.replay._transition import TransitionBatch

__all__ = ["FrameStackBuffer", "FrameStackBufferState", "make_frame_stack_buffer"]

_REJECTION_ROUNDS = 32


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
        The number of frames stored (the id of the next one).
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


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _multipliers(n: int) -> np.ndarray:
    return np.random.default_rng(0x5EED).integers(1, 2**32, size=(2, n), dtype=np.uint32) | 1


def _fingerprints(frames: jax.Array) -> jax.Array:
    """Two 32-bit linear hashes of the bytes of each frame: ``(n, 2)`` uint32."""
    n = frames.shape[0]
    raw = jax.lax.bitcast_convert_type(frames, jnp.uint8).reshape(n, -1)
    pad = -raw.shape[1] % 4
    raw = jnp.pad(raw, ((0, 0), (0, pad)))
    words = jax.lax.bitcast_convert_type(raw.reshape(n, -1, 4), jnp.uint32)
    mult = jnp.asarray(_multipliers(words.shape[1]))
    return jnp.stack([(words * m).sum(axis=1, dtype=jnp.uint32) for m in mult], axis=1)


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
        at least ``2 * stack_size``.
    window : int, optional
        How many of the newest frames new frames are matched against.

    Returns
    -------
    buffer : FrameStackBuffer
        ``init(example_transition)`` (a :class:`TransitionBatch` without batch axis),
        ``add(state, transition_batch)``, ``sample(state, key, batch_size)`` (a
        :class:`TransitionBatch`) and ``can_sample(state, batch_size)``, all jittable
        (``batch_size`` static).

    Raises
    ------
    TypeError, ValueError
        For a bad argument here, and at trace time for transitions whose frames differ in
        shape or dtype from the buffer's.
    """
    capacity = _check_int(capacity, "capacity", 1)
    k = _check_int(stack_size, "stack_size", 1)
    if frame_capacity is None:
        frame_capacity = capacity + capacity // 64 + 2 * k
    F = _check_int(frame_capacity, "frame_capacity", 2 * k)
    window = _check_int(window, "window", 0)
    bits = max(1, int(8 * max(window, 1) - 1).bit_length())  # few collisions
    table = 1 << bits
    inner = make_uniform_buffer(capacity)

    def check(batch: Any, frames: Any, batched: bool) -> None:
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

    def init(example: TransitionBatch) -> FrameStackBufferState:
        check(example, None, batched=False)
        S = jnp.asarray(example.S)
        ids = jnp.zeros((k,), jnp.int32)
        return FrameStackBufferState(
            transitions=inner.init(example.replace(S=ids, S_next=ids, idx=None)),
            frames=jnp.zeros((F,) + S.shape[1:], S.dtype),
            frame_count=jnp.zeros([], jnp.int32),
            table_hash=jnp.zeros((table, 2), jnp.uint32),
            table_id=jnp.full((table,), -1, jnp.int32),
        )

    def add(state: FrameStackBufferState, batch: TransitionBatch) -> FrameStackBufferState:
        check(batch, state.frames, batched=True)
        n = jnp.shape(batch.S)[0]
        x = jnp.concatenate([jnp.asarray(batch.S), jnp.asarray(batch.S_next)], axis=1)
        x = x.reshape((2 * n * k,) + state.frames.shape[1:])

        def one(carry: tuple, item: tuple) -> tuple:
            frames, count, th, tid = carry
            frame, h = item
            # the high bits of a multiplicative mix: the low bits of a linear hash are weak
            mixed = (h[0] ^ (h[1] * jnp.uint32(0x85EBCA6B))) * jnp.uint32(0x9E3779B1)
            slot = (mixed >> (32 - bits)).astype(jnp.int32)
            cand = tid[slot]
            hit = (cand >= 0) & (cand >= count - window) & jnp.all(th[slot] == h)
            hit &= jnp.array_equal(frames[cand % F], frame)
            row = count % F
            frames = frames.at[row].set(jnp.where(hit, frames[row], frame))
            fid = jnp.where(hit, cand, count)
            th = th.at[slot].set(jnp.where(hit, th[slot], h))
            tid = tid.at[slot].set(fid)
            return (frames, count + 1 - hit.astype(jnp.int32), th, tid), fid

        carry = (state.frames, state.frame_count, state.table_hash, state.table_id)
        (frames, count, th, tid), ids = jax.lax.scan(one, carry, (x, _fingerprints(x)))
        ids = ids.reshape(n, 2, k)
        refs = batch.replace(S=ids[:, 0], S_next=ids[:, 1], idx=None)
        return FrameStackBufferState(
            transitions=inner.add(state.transitions, refs),
            frames=frames,
            frame_count=count,
            table_hash=th,
            table_id=tid,
        )

    def sample(state: FrameStackBufferState, key: jax.Array, batch_size: int) -> TransitionBatch:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(f"batch_size must be a static positive int, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        stored = state.transitions
        s_ids, next_ids = stored.items.S, stored.items.S_next
        floor = state.frame_count - F

        def dead(slots: jax.Array) -> jax.Array:
            oldest = jnp.minimum(s_ids[slots].min(axis=1), next_ids[slots].min(axis=1))
            return oldest < floor

        def redraw(carry: tuple) -> tuple:
            i, key, slots = carry
            key, sub = jax.random.split(key)
            new = jax.random.randint(sub, (batch_size,), 0, stored.size)
            return i + 1, key, jnp.where(dead(slots), new, slots)

        def again(carry: tuple) -> jax.Array:
            i, _, slots = carry
            return (i < _REJECTION_ROUNDS) & jnp.any(dead(slots))

        key, sub = jax.random.split(key)
        slots = jax.random.randint(sub, (batch_size,), 0, stored.size)
        _, _, slots = jax.lax.while_loop(again, redraw, (0, key, slots))
        newest = (stored.pos - 1) % capacity
        slots = jnp.where(dead(slots), newest, slots)
        items = jax.tree_util.tree_map(lambda s: s[slots], stored.items)
        ids = jnp.stack([items.S, items.S_next]) % F
        stacks = jnp.take(state.frames, ids.reshape(-1), axis=0)
        stacks = stacks.reshape((2, batch_size, k) + state.frames.shape[1:])
        return items.replace(S=stacks[0], S_next=stacks[1])

    def can_sample(state: FrameStackBufferState, batch_size: int) -> jax.Array:
        return inner.can_sample(state.transitions, batch_size)

    return FrameStackBuffer(
        init=init,
        add=add,
        sample=sample,
        can_sample=can_sample,
        capacity=capacity,
        stack_size=k,
        frame_capacity=F,
    )
