"""The frame ring of the jittable frame-stacked buffers: each frame stored once, found again
by content (a direct-mapped table of fingerprints, then the bytes), rebuilt into stacks."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_int
from coax_utils.replay._frames_store import match_window
from coax_utils.replay._functional import check_state
from coax_utils.replay._transition import TransitionBatch

__all__ = ["COUNTER_SPAN", "FrameRing"]

COUNTER_SPAN = 2**30  # frame ids and transition counts wrap below this (int32 counters)


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
class FrameRing:
    """Frame storage of the jittable frame-stacked buffers (configuration; pure methods).

    Frame ``i`` lives at row ``i % capacity`` of ``frames``; a transition refers to its
    frames by id, and lost one when one of its ids is more than ``capacity`` frames older
    than ``frame_count``. Ids and ``frame_count`` count modulo ``modulus`` (a multiple of
    ``capacity`` near ``2**30``), so the int32 counters never overflow; every age is taken
    modulo it, which is exact because no stored transition refers to a frame more than
    ``modulus / 4`` frames old (checked by :meth:`make`).
    New frames equal to one stored at most ``window`` frames before the add (see
    ``match_window``: the copy outlives the transitions that refer to it) are found by
    fingerprint in a direct-mapped table and confirmed byte for byte.
    """

    k: int
    capacity: int
    window: int
    bits: int
    modulus: int

    @classmethod
    def make(cls, capacity: int, stack_size: Any, frame_capacity: Any, window: Any) -> FrameRing:
        """Check the arguments of a factory (``capacity`` checked already)."""
        k = check_int(stack_size, "stack_size", low=1)
        if frame_capacity is None:
            frame_capacity = capacity + capacity // 64 + 2 * k
        F = check_int(frame_capacity, "frame_capacity", low=2 * k, high=COUNTER_SPAN // 4)
        window = min(check_int(window, "window", low=0), match_window(capacity, k, F))
        # a table of 8 entries per frame of the window (as used: at most frame_capacity
        # frames), at least 8192: frames that share an entry evict each other and are
        # stored again while both are in use
        bits = max(13, int(8 * window - 1).bit_length())
        modulus = F * (COUNTER_SPAN // F)
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
