"""Frames found by content are referenced only where the stored copy outlives the transitions
that refer to it: a frame that repeats an older one never makes a held transition unreachable
(host and jittable, uniform and prioritized, one env or several interleaved)."""

from __future__ import annotations

import gymnasium
import jax
import numpy as np
import pytest

from coax_utils.replay import (
    FrameStackReplayBuffer,
    NStep,
    PrioritizedFrameStackReplayBuffer,
    TransitionBatch,
    make_frame_stack_buffer,
    make_prioritized_frame_stack_buffer,
)
from tests.replay.test_frames import K, assert_all_samplable, assert_same, pong, run

HOST = [FrameStackReplayBuffer, PrioritizedFrameStackReplayBuffer]
JITTABLE = [make_frame_stack_buffer, make_prioritized_frame_stack_buffer]


def frame_ages(state):
    """Per stored slot, how many frames were stored after its oldest frame (ids count
    modulo the documented number)."""
    F = state.frames.shape[0]
    items, size = state.transitions.items, int(state.transitions.size)
    ids = np.concatenate([np.asarray(items.S), np.asarray(items.S_next)], axis=1)
    age = (int(state.frame_count) - ids.astype(np.int64)) % (F * (2**30 // F))
    return age[:size].max(axis=1)


def drawn_items(buf, state, batch_size):
    drawn = buf.sample(state, jax.random.PRNGKey(0), batch_size)
    return getattr(drawn, "items", drawn)


# -- the minimal case: stacks of 1, one episode whose frame 150 repeats frame 60 ---------------


def one_frame_stream(repeat_of, steps=200):
    frames = np.random.default_rng(0).integers(0, 256, (steps + 1, 3, 3), dtype=np.uint8)
    frames[150] = frames[repeat_of]
    return [
        TransitionBatch.from_single(
            s=frames[t : t + 1],
            a=0,
            logp=0.0,
            r=float(t),  # Rn names the transition
            done=False,
            gamma=0.9,
            s_next=frames[t + 1 : t + 2],
        )
        for t in range(steps)
    ]


# frame 60 is 90 frames older (gone before transition 149 is); frame 149 is the one before
CASES = [(60, 201), (149, 200)]  # (frame 150 repeats, frames stored)


@pytest.mark.parametrize("repeat_of, stored", CASES)
@pytest.mark.parametrize("cls", HOST)
def test_a_repeat_of_an_older_frame_loses_no_transition_host(cls, repeat_of, stored):
    stream = one_frame_stream(repeat_of)
    buffer = cls(capacity=100, stack_size=1, random_seed=0)
    for batch in stream:
        buffer.add(batch)
    # the old copy is stored again (a repeat within the window is still referenced)
    assert buffer.frame_count == stored
    held = [int(tr.Rn[0]) for tr in buffer]
    assert held == list(range(100, 200))  # transitions 149 and 150 included
    for tr in buffer:
        assert_same(tr.replace(idx=np.array([int(tr.Rn[0])])), by_rn(stream))
    batch = buffer.sample(2000)
    assert set(batch.Rn.astype(int).tolist()) == set(range(100, 200))
    if cls is PrioritizedFrameStackReplayBuffer:
        assert buffer.total_priority == pytest.approx(100 * (1 + 1e-4))


def by_rn(stream):
    return {int(tr.Rn[0]): tr for tr in stream}


@pytest.mark.parametrize("repeat_of, stored", CASES)
@pytest.mark.parametrize("factory", JITTABLE)
def test_a_repeat_of_an_older_frame_loses_no_transition_jittable(factory, repeat_of, stored):
    stream = one_frame_stream(repeat_of)
    buf = factory(100, stack_size=1)
    state = buf.init(jax.tree_util.tree_map(lambda x: x[0], stream[0]))
    for batch in stream:
        state = buf.add(state, batch)
    assert int(state.frame_count) == stored
    assert frame_ages(state).max() <= buf.frame_capacity  # every held one has its frames
    items = drawn_items(buf, state, 4096)
    rows = items.Rn.astype(int)
    assert set(rows.tolist()) == set(range(100, 200))
    expected = by_rn(stream)
    for i in np.unique(rows, return_index=True)[1]:
        np.testing.assert_array_equal(items.S[i], expected[int(rows[i])].S[0])
        np.testing.assert_array_equal(items.S_next[i], expected[int(rows[i])].S_next[0])


# -- real Pong ---------------------------------------------------------------------------------


def repeats_beyond(oracle, window, frame_capacity):
    """Frames of the stream that repeat one more than ``window`` and less than
    ``frame_capacity`` frames older (the newest frame of each transition, in order)."""
    frames = [tr.S_next[0, -1] for tr in oracle]
    seen, found = {}, []
    for t, f in enumerate(frames):
        key = f.tobytes()
        if key in seen and window < t - seen[key] < frame_capacity:
            found.append((seen[key], t))
        seen[key] = t
    return found


def test_pong_frames_that_repeat_older_ones_lose_no_transition():
    # Pong's screens repeat (the serve, frames where nothing moves): some frame equals one
    # tens of frames older, inside the frame ring, far beyond what consecutive stacks share
    host = PrioritizedFrameStackReplayBuffer(capacity=100, stack_size=K, random_seed=0)
    buf = make_prioritized_frame_stack_buffer(100, stack_size=K)
    add = jax.jit(buf.add)
    state, seen = None, []

    class Both:
        def add(self, batch):
            nonlocal state
            n = batch.batch_size  # Rn names each transition: its place in the stream
            batch = batch.replace(Rn=np.arange(len(seen), len(seen) + n, dtype=np.float32))
            seen.extend(batch.to_singles())
            host.add(batch)
            if state is None:
                state = buf.init(jax.tree_util.tree_map(lambda x: x[0], batch))
            state = add(state, batch)

    oracle, ends = run(pong(max_steps=80), Both(), NStep(n=1, gamma=0.99), 200)
    assert ends >= 2
    assert repeats_beyond(oracle, 2 * K - 1, host.frame_capacity)
    assert host.frame_count <= 200 + ends + 1  # still each frame of the stream at most once
    held = list(range(len(seen) - len(host), len(seen)))
    assert [int(tr.Rn[0]) for tr in host] == held  # every held transition, stacks as acted
    for tr in host:
        assert_stacks(tr, seen, 0)
    batch = host.sample(256)
    assert set(batch.Rn.astype(int).tolist()) <= set(held)
    for row in range(256):
        assert_stacks(batch, seen, row)
    # the jittable twin holds the same transitions, all with their frames
    assert int(state.frame_count) == host.frame_count
    assert frame_ages(state).max() <= buf.frame_capacity
    items = drawn_items(buf, state, 512)
    assert set(items.Rn.astype(int).tolist()) <= set(held)
    for row in range(512):
        assert_stacks(items, seen, row)


def assert_stacks(batch, seen, row):
    tr = seen[int(batch.Rn[row])]
    np.testing.assert_array_equal(batch.S[row], tr.S[0])
    np.testing.assert_array_equal(batch.S_next[row], tr.S_next[0])


# -- vector envs -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", HOST)
def test_vector_env_streams_keep_every_held_transition(cls):
    # two Pong envs interleaved through RecordTransitions: a stack's oldest frame came about
    # 2 * (stack_size + n) frames before, which the documented frame_capacity leaves room for
    n, C, N = 2, 120, 2
    env = gymnasium.vector.SyncVectorEnv([lambda: pong(max_steps=70) for _ in range(N)])
    F = C + C // 64 + 1 + N * (K + n)
    buffer = cls(capacity=C, stack_size=K, frame_capacity=F, random_seed=0)
    oracle, ends = run(env, buffer, NStep(n=n, gamma=0.99), 150)
    assert len(oracle) > C  # the transition ring wrapped around
    expected = assert_all_samplable(buffer, oracle)
    assert_same(buffer.sample(200), expected)
    assert buffer.frame_count <= N * 150 + ends + N  # each frame of each stream once
