"""Sequence sampling: contiguous windows that never cross an episode boundary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.replay import (
    PrioritizedReplayBuffer,
    SimpleReplayBuffer,
    TransitionBatch,
    make_prioritized_buffer,
    make_uniform_buffer,
)
from tests._compiles import compiles

EPISODES = [4, 2, 5, 1, 3]  # episode lengths


def episode_rows():
    """Step codes 100 * episode + t, and the episode-end marks."""
    codes, ends = [], []
    for e, length in enumerate(EPISODES):
        codes += [100 * e + t for t in range(length)]
        ends += [False] * (length - 1) + [True]
    return np.array(codes), np.array(ends)


def check_windows(codes, mask, length):
    codes, mask = np.asarray(codes), np.asarray(mask)
    assert codes.shape == mask.shape and codes.shape[1] == length
    assert mask[:, 0].all()
    # the mask is a prefix of each row
    assert np.all(np.diff(mask.astype(int), axis=1) <= 0)
    for row, m in zip(codes, mask):
        n_valid = int(m.sum())
        # every step, padded ones included, comes from the episode of the first step
        assert np.all(row // 100 == row[0] // 100)
        # valid steps are consecutive steps; padding repeats the last valid one
        np.testing.assert_array_equal(row[:n_valid], row[0] + np.arange(n_valid))
        np.testing.assert_array_equal(row[n_valid:], row[n_valid - 1])
        # a window is masked only where its episode really ended
        episode, t_last = row[0] // 100, row[n_valid - 1] % 100
        assert (n_valid == length) or t_last == EPISODES[episode] - 1


def test_host_sequences_respect_episode_ends():
    codes, ends = episode_rows()
    for cls in (SimpleReplayBuffer, PrioritizedReplayBuffer):
        buffer = cls(64, random_seed=0)
        batch = TransitionBatch(
            S=codes.astype(np.float32),
            A=codes,
            logP=np.zeros(len(codes), np.float32),
            Rn=np.zeros(len(codes), np.float32),
            In=np.ones(len(codes), np.float32),
            S_next=codes.astype(np.float32),
        )
        buffer.add(batch[:7], episode_end=ends[:7])  # split across two adds
        buffer.add(batch[7:], episode_end=ends[7:])
        out = buffer.sample_sequences(300, 3)
        check_windows(out.items.A, out.mask, 3)
        np.testing.assert_array_equal(out.indices, out.items.idx)
        assert out.items.S.shape == (300, 3)
        assert not out.mask.all()  # windows at episode ends were sampled and masked
        with pytest.raises(ValueError):
            buffer.sample_sequences(4, len(codes) + 1)
        with pytest.raises(ValueError):
            buffer.sample_sequences(4, 0)
        with pytest.raises(ValueError):
            buffer.add(batch[:2], episode_end=np.array([True, False, True]))


def test_host_sequences_after_ring_overwrite():
    buffer = SimpleReplayBuffer(8, random_seed=1)
    for t in range(19):  # one long episode, wrapped around the ring twice
        buffer.add(TransitionBatch.from_single(s=t, a=t, logp=0.0, r=0.0, done=False, gamma=1.0))
    out = buffer.sample_sequences(200, 4)
    assert out.mask.all()
    a = out.items.A
    np.testing.assert_array_equal(np.diff(a, axis=1), 1)  # windows never jump the write head
    assert a.min() >= 11 and a.max() <= 18


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_jittable_sequences_respect_episode_ends(make):
    codes, ends = episode_rows()
    buffer = make(10)  # smaller than the data: the ring wraps
    add = jax.jit(buffer.add)
    seq = jax.jit(buffer.sample_sequences, static_argnums=(2, 3))
    state = buffer.init(jnp.int32(0))
    for lo in range(0, len(codes), 5):
        chunk = slice(lo, lo + 5)
        state = add(state, jnp.asarray(codes[chunk], jnp.int32), jnp.asarray(ends[chunk]))
    out = seq(state, jax.random.key(0), 300, 3)
    check_windows(out.items, out.mask, 3)
    kept = set(codes[-10:].tolist())
    assert set(np.asarray(out.items).ravel().tolist()) <= kept
    np.testing.assert_array_equal(np.asarray(state.items)[np.asarray(out.indices)], out.items)
    # vmapped over two buffers
    states = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    keys = jax.random.split(jax.random.key(1), 2)
    out2 = jax.vmap(seq, in_axes=(0, 0, None, None))(states, keys, 50, 2)
    assert out2.items.shape == (2, 50, 2)
    check_windows(out2.items[1], out2.mask[1], 2)


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
@pytest.mark.parametrize("mark", [1, -1, 2, 0.5, 1.0])
def test_jittable_episode_end_marks_are_truth_values(make, mark):
    # episode_end is read as a truth value, as the host buffers read it: any nonzero mark
    # ends the episode (an int -1 once made episode numbers go down, a float 0.5 was
    # rounded to "not an end", and windows then ran across the boundary)
    codes, ends = episode_rows()
    buffer = make(32)
    state = buffer.init(jnp.int32(0))
    marks = ends.astype(type(mark))
    marks[np.flatnonzero(ends)[::2]] = mark  # mixed with plain ones
    for lo in range(0, len(codes), 5):
        chunk = slice(lo, lo + 5)
        state = buffer.add(state, jnp.asarray(codes[chunk], jnp.int32), jnp.asarray(marks[chunk]))
    out = jax.jit(buffer.sample_sequences, static_argnums=(2, 3))(state, jax.random.key(0), 400, 5)
    check_windows(out.items, out.mask, 5)
    assert not np.asarray(out.mask).all()


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_jittable_eager_sample_sequences_compiles_once(make):
    # called eagerly, each call traced and compiled its platform-dependent draws anew
    buffer = make(16)
    state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(9, dtype=jnp.int32))
    buffer.sample_sequences(state, jax.random.key(0), 4, 3)
    before = compiles()
    for i in range(6):
        out = buffer.sample_sequences(state, jax.random.key(i), 4, 3)
        np.testing.assert_array_equal(np.diff(np.asarray(out.items), axis=1), 1)
    assert compiles() == before


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_jittable_sequences_from_a_short_or_empty_buffer_are_masked(make):
    buffer = make(8)
    state = buffer.init(jnp.int32(0))
    out = buffer.sample_sequences(state, jax.random.key(0), 5, 3)
    assert not np.asarray(out.mask).any()  # empty: nothing is valid, the first column too
    state = buffer.add(state, jnp.array([7, 8], jnp.int32))
    out = buffer.sample_sequences(state, jax.random.key(0), 5, 3)
    np.testing.assert_array_equal(out.mask, [[True, True, False]] * 5)
    np.testing.assert_array_equal(out.items, [[7, 8, 8]] * 5)


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_jittable_mask_is_a_prefix_even_for_a_damaged_state(make):
    # episode numbers that go down and up again (a damaged or hand-edited state) made a
    # mask like [T, F, T], whose third step held a copy of the second: another episode
    buffer = make(4)
    state = buffer.add(buffer.init(jnp.int32(0)), jnp.array([10, 11, 12, 13], jnp.int32))
    state = state.replace(episode=jnp.array([0, 1, 0, 1], jnp.int32))
    out = buffer.sample_sequences(state, jax.random.key(0), 20, 3)
    for row, mask in zip(np.asarray(out.items), np.asarray(out.mask)):
        assert mask.tolist() == [True, False, False]
        assert row.tolist() == [row[0]] * 3  # padding repeats the one valid step
