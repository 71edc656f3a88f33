"""``gather`` of the jittable frame-stacked buffers: the transitions stored in given slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils.replay import (
    TransitionBatch,
    make_frame_stack_buffer,
    make_prioritized_frame_stack_buffer,
)

K = 2


def frame(t):
    return np.full((3,), t, np.uint8)  # frame t of the episode, unique


def transitions(steps):
    """One episode: S = frames (t, t + 1), S_next = (t + 1, t + 2), A = t."""
    S = np.stack([np.stack([frame(t), frame(t + 1)]) for t in steps])
    S_next = np.stack([np.stack([frame(t + 1), frame(t + 2)]) for t in steps])
    zeros = np.zeros(len(steps), np.float32)
    return TransitionBatch(
        S=S, A=np.asarray(steps, np.int32), logP=zeros, Rn=zeros, In=zeros, S_next=S_next
    )


def test_gather_rebuilds_the_stacks_of_given_slots():
    buffer = make_frame_stack_buffer(capacity=8, stack_size=K)
    assert buffer.window >= 2 * K - 1
    state = buffer.init(jax.tree_util.tree_map(lambda x: x[0], transitions([0])))
    state = buffer.add(state, transitions(range(6)))
    slots = jnp.asarray([5, 0, 3, 3], jnp.int32)
    got = jax.jit(buffer.gather)(state, slots)
    want = transitions([5, 0, 3, 3])
    for name in ("S", "S_next", "A"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    # what sample returns: rows of the stored transitions
    drawn = buffer.sample(state, jax.random.key(0), 16)
    np.testing.assert_array_equal(drawn.S, transitions(np.asarray(drawn.A)).S)


def test_prioritized_gather_gives_a_sample_back():
    buffer = make_prioritized_frame_stack_buffer(capacity=8, stack_size=K, beta=0.5)
    state = buffer.init(jax.tree_util.tree_map(lambda x: x[0], transitions([0])))
    state = buffer.add(state, transitions(range(6)))
    state = buffer.update(state, jnp.arange(6), jnp.arange(1.0, 7.0))
    sample = buffer.sample(state, jax.random.key(1), 8)
    again = buffer.gather(state, sample.indices, sample.weights, sample.versions)
    for x, y in zip(jax.tree_util.tree_leaves(sample), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(x, y)
    plain = buffer.gather(state, sample.indices)  # weights 1, the slots' current versions
    np.testing.assert_array_equal(plain.weights, np.ones(8, np.float32))
    np.testing.assert_array_equal(plain.versions, sample.versions)
    np.testing.assert_array_equal(plain.items.S, transitions(np.asarray(sample.items.A)).S)
