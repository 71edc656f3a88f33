"""Frame-stacked host buffers against gymnasium's FrameStackObservation on real envs."""

from __future__ import annotations

import pickle

import gymnasium
import numpy as np
import pytest
from gymnasium.wrappers import (
    AddRenderObservation,
    FrameStackObservation,
    GrayscaleObservation,
    ResizeObservation,
)

from coax_utils import utils
from coax_utils.replay import (
    FrameStackReplayBuffer,
    NStep,
    PrioritizedFrameStackReplayBuffer,
    RecordTransitions,
    SimpleReplayBuffer,
    TransitionBatch,
)

K = 4


def image_cartpole(max_steps: int, k: int = K) -> gymnasium.Env:
    """CartPole seen through 84x84 grayscale renders: cheap images, short episodes that end
    by termination (the pole falls) or truncation (``max_steps``)."""
    env = gymnasium.make("CartPole-v1", render_mode="rgb_array", max_episode_steps=max_steps)
    env = AddRenderObservation(env, render_only=True)
    env = GrayscaleObservation(ResizeObservation(env, (84, 84)))
    return FrameStackObservation(env, k)


def pong(k: int = K, max_steps: int = 60) -> gymnasium.Env:
    import ale_py

    gymnasium.register_envs(ale_py)
    env = gymnasium.make("ALE/Pong-v5", frameskip=1, max_episode_steps=max_steps * 4)
    env = gymnasium.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84)
    return FrameStackObservation(env, k)


class Tee:
    """Adds every batch to the buffer under test and to a plain SimpleReplayBuffer, the
    oracle that holds the stacks exactly as FrameStackObservation returned them."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.oracle = SimpleReplayBuffer(capacity=100_000)

    def add(self, batch):
        self.buffer.add(batch)
        self.oracle.add(batch)


def run(env, buffer, tracer, steps, seed=0, after_step=None):
    """Act randomly for ``steps`` steps, recording through ``tracer``; return the oracle and
    the number of episodes that ended."""
    tee = Tee(buffer)
    env = RecordTransitions(env, tee, tracer)
    env.action_space.seed(seed)
    env.reset(seed=seed)
    ends = 0
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if np.any(terminated) or np.any(truncated):
            ends += int(np.sum(np.logical_or(terminated, truncated)))
            if not isinstance(env, gymnasium.vector.VectorWrapper):
                env.reset()
        if after_step is not None:
            after_step(tee.oracle)
    return tee.oracle, ends


def by_id(oracle):
    return {int(tr.idx[0]): tr for tr in oracle}


def assert_same(batch, expected):
    """Every row of ``batch`` equals the oracle's transition of the same id."""
    for i, idx in enumerate(batch.idx):
        tr = expected[int(idx)]
        np.testing.assert_array_equal(batch.S[i], tr.S[0])
        np.testing.assert_array_equal(batch.S_next[i], tr.S_next[0])
        for field in ("A", "Rn", "In"):
            np.testing.assert_array_equal(getattr(batch, field)[i], getattr(tr, field)[0])


def assert_all_samplable(buffer, oracle):
    expected = by_id(oracle)
    stored = list(buffer)
    assert [int(tr.idx[0]) for tr in stored] == sorted(expected)[-len(buffer) :]
    for tr in stored:
        assert_same(tr, expected)
    return expected


# -- differential tests against FrameStackObservation ------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("cls", [FrameStackReplayBuffer, PrioritizedFrameStackReplayBuffer])
def test_image_cartpole_every_stack_as_acting_saw_it(cls, n):
    buffer = cls(capacity=1000, stack_size=K, random_seed=1)
    oracle, ends = run(image_cartpole(max_steps=14), buffer, NStep(n=n, gamma=0.9), 150)
    assert ends >= 5
    dones = [bool(tr.In[0] == 0) for tr in oracle]
    assert any(dones) and not all(dones)  # terminations and truncations/bootstraps both
    expected = assert_all_samplable(buffer, oracle)  # every step, in order
    assert len(buffer) == len(oracle)
    # each frame once, plus one per episode start: at most steps + episodes frames
    assert buffer.frame_count <= 150 + ends + 1
    # the padding at episode start repeats the reset frame, as FrameStackObservation does
    first = next(iter(buffer))
    assert all(np.array_equal(first.S[0, j], first.S[0, 0]) for j in range(K))
    for _ in range(5):
        batch = buffer.sample(64)
        assert_same(batch, expected)
        if cls is PrioritizedFrameStackReplayBuffer:
            buffer.update(batch.idx, np.random.default_rng(0).normal(size=64))


def test_pong_every_stack_as_acting_saw_it():
    buffer = PrioritizedFrameStackReplayBuffer(capacity=500, stack_size=K, random_seed=0)
    oracle, ends = run(pong(max_steps=40), buffer, NStep(n=3, gamma=0.99), 130)
    assert ends >= 3  # truncations
    expected = assert_all_samplable(buffer, oracle)
    assert buffer.frame_count <= 130 + ends + 1
    batch = buffer.sample(128)
    assert_same(batch, expected)
    assert batch.S.shape == (128, K, 84, 84) and batch.S.dtype == np.uint8
    assert batch.W.max() == 1.0


def test_vector_env_with_different_episode_lengths():
    lengths = [5, 9, 13]
    env = gymnasium.vector.SyncVectorEnv(
        [lambda m=m: image_cartpole(max_steps=m, k=3) for m in lengths]
    )
    # frames are matched against the newest frame_capacity - (capacity + capacity // 64 + 1):
    # with 3 streams interleaved, a stack's oldest frame came about 3 * (stack_size + n) ago
    F = 2000 + 2000 // 64 + 1 + 3 * (3 + 2)
    buffer = FrameStackReplayBuffer(capacity=2000, stack_size=3, frame_capacity=F, random_seed=0)
    oracle, ends = run(env, buffer, NStep(n=2, gamma=0.9), 60)
    assert ends >= 10
    expected = assert_all_samplable(buffer, oracle)
    for _ in range(3):
        assert_same(buffer.sample(100), expected)
    # interleaved streams still store each frame about once
    assert buffer.frame_count <= 3 * 60 + ends + 3


def test_ring_overwrite_near_the_boundary():
    # frames per transition exceed frame_capacity / capacity with episodes this short, so
    # the oldest transitions lose frames while they are still in the buffer
    buffer = FrameStackReplayBuffer(capacity=30, stack_size=K, frame_capacity=32, random_seed=0)
    lost = []

    def check(oracle):
        if not buffer:
            return
        expected = by_id(oracle)
        assert_same(buffer.sample(40), expected)
        live = list(buffer)
        for tr in live:
            assert_same(tr, expected)
        lost.append(len(buffer) - len(live))

    run(image_cartpole(max_steps=6), buffer, NStep(n=2, gamma=0.9), 120, after_step=check)
    assert len(buffer) == 30
    assert max(lost) > 0  # some transitions lost frames and were never returned


def test_prioritized_never_samples_lost_transitions():
    buffer = PrioritizedFrameStackReplayBuffer(
        capacity=30, stack_size=K, frame_capacity=20, alpha=0.7, random_seed=3
    )
    lost = []

    def check(oracle):
        if not buffer:
            return
        expected = by_id(oracle)
        live = {int(tr.idx[0]) for tr in buffer}
        lost.append(len(buffer) - len(live))
        batch = buffer.sample(50)
        assert set(batch.idx.tolist()) <= live
        assert_same(batch, expected)
        assert 0 < batch.W.min() and batch.W.max() == 1.0
        # importance weights of the transitions returned (after the redraws)
        prob = buffer.priorities(batch.idx) / buffer.total_priority
        weights = (len(buffer) * prob) ** -1.0  # beta = 1
        np.testing.assert_allclose(batch.W, weights / weights.max(), rtol=1e-6)
        buffer.update(batch.idx, np.linspace(0, 3, 50))

    run(image_cartpole(max_steps=4), buffer, NStep(n=1, gamma=0.9), 80, after_step=check)
    assert max(lost) > 0


# -- checkpoints -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def filled():
    buffer = PrioritizedFrameStackReplayBuffer(capacity=60, stack_size=K, random_seed=0)
    oracle, _ = run(image_cartpole(max_steps=10), buffer, NStep(n=2, gamma=0.9), 80)
    return buffer, oracle


def same_future(a, b, expected):
    for _ in range(3):
        x, y = a.sample(16), b.sample(16)
        np.testing.assert_array_equal(x.idx, y.idx)
        np.testing.assert_array_equal(x.W, y.W)
        assert_same(x, expected)
        assert_same(y, expected)


def test_save_load_round_trip(filled, tmp_path):
    buffer, oracle = filled
    buffer.save(tmp_path / "buf")
    for mode in ("c", None):
        loaded = PrioritizedFrameStackReplayBuffer.load(tmp_path / "buf", mmap_mode=mode)
        assert loaded.frame_count == buffer.frame_count and len(loaded) == len(buffer)
        copy = pickle.loads(pickle.dumps(buffer))
        same_future(loaded, copy, by_id(oracle))


def test_dump_load_safe_round_trip(filled, tmp_path):
    buffer, oracle = filled
    utils.dump(buffer, tmp_path / "buf.lz4")
    loaded = utils.load(tmp_path / "buf.lz4", safe=True)
    assert isinstance(loaded, PrioritizedFrameStackReplayBuffer)
    same_future(loaded, pickle.loads(pickle.dumps(buffer)), by_id(oracle))
    # the loaded buffer keeps deduplicating: the newest stacks share frames with stored ones
    tr = list(loaded)[-1]
    count = loaded.frame_count
    loaded.add(tr.replace(idx=None))
    assert loaded.frame_count == count


def test_restore_checks_the_frames(filled):
    buffer, _ = filled
    state = buffer.__checkpoint_state__()
    cls = PrioritizedFrameStackReplayBuffer

    def broken(**changes):
        bad = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        bad["rng"] = np.random.default_rng(0)
        bad.update(changes)
        return bad

    with pytest.raises(ValueError, match="frame ids"):
        cls.__checkpoint_restore__(broken(frame_count=3))
    with pytest.raises(ValueError, match="frames must be"):
        cls.__checkpoint_restore__(broken(frames=state["frames"][:-1].copy()))
    with pytest.raises(ValueError, match="frame_capacity"):
        cls.__checkpoint_restore__(broken(frame_capacity=1))
    with pytest.raises(TypeError, match="stack_size"):
        cls.__checkpoint_restore__(broken(stack_size="4"))
    with pytest.raises(ValueError, match=r"int64 frame ids of shape \(capacity, 5\)"):
        cls.__checkpoint_restore__(broken(stack_size=5))
    restored = cls.__checkpoint_restore__(broken())
    assert restored.frame_count == buffer.frame_count


# -- bad input -------------------------------------------------------------------------------


def stack_batch(frames, k=K):
    return TransitionBatch.from_single(
        s=frames[:k], a=0, logp=0.0, r=1.0, done=False, gamma=0.9, s_next=frames[1 : k + 1]
    )


def test_bad_input_changes_nothing():
    with pytest.raises(ValueError, match="stack_size"):
        FrameStackReplayBuffer(10, stack_size=0)
    with pytest.raises(TypeError, match="stack_size"):
        FrameStackReplayBuffer(10, stack_size=2.0)
    with pytest.raises(ValueError, match="frame_capacity"):
        FrameStackReplayBuffer(10, stack_size=4, frame_capacity=7)
    buffer = FrameStackReplayBuffer(10, stack_size=K, random_seed=0)
    frames = np.arange(5 * 6 * 6, dtype=np.uint8).reshape(5, 6, 6)
    buffer.add(stack_batch(frames))
    before = utils.dumps(buffer)
    bad = [
        (ValueError, stack_batch(frames[:, :5])),  # another frame shape
        (ValueError, stack_batch(frames.astype(np.float32))),  # another dtype
        (ValueError, stack_batch(np.concatenate([frames, frames]), k=3)),  # another k
        (ValueError, stack_batch(frames).replace(S_next=frames[None, :3])),
        (TypeError, stack_batch(frames).replace(S={"x": frames[None, :4]})),
        (ValueError, stack_batch(frames).replace(A=np.zeros((1, 2)))),  # rest of the batch
    ]
    for error, batch in bad:
        with pytest.raises(error):
            buffer.add(batch)
        assert utils.dumps(buffer) == before


def assert_windows(seq, expected):
    assert seq.mask[:, 0].all()
    rows = seq.items.idx
    for b, t in zip(*np.nonzero(seq.mask)):
        tr = expected[int(rows[b, t])]
        np.testing.assert_array_equal(seq.items.S[b, t], tr.S[0])
        np.testing.assert_array_equal(seq.items.S_next[b, t], tr.S_next[0])


def test_sequences_match_the_plain_buffer_when_no_frame_is_lost():
    buffer = FrameStackReplayBuffer(capacity=30, stack_size=K, random_seed=3)
    plain = SimpleReplayBuffer(capacity=30, random_seed=3)

    class Both:
        def add(self, batch):
            buffer.add(batch)
            plain.add(batch)

    oracle, _ = run(image_cartpole(max_steps=6), Both(), NStep(n=1, gamma=0.9), 80)
    seq, ref = buffer.sample_sequences(16, 5), plain.sample_sequences(16, 5)
    assert_windows(seq, by_id(oracle))
    np.testing.assert_array_equal(seq.mask, ref.mask)
    np.testing.assert_array_equal(seq.indices, ref.indices)
    np.testing.assert_array_equal(seq.items.S, ref.items.S)


def test_sequences_never_hold_a_step_that_lost_frames():
    # as in the ring test: the oldest transitions lose frames while still in the buffer
    buffer = FrameStackReplayBuffer(capacity=30, stack_size=K, frame_capacity=32, random_seed=0)
    lost = []

    def check(oracle):
        if len(buffer) < 5:
            return
        live = {int(tr.idx[0]) for tr in buffer}
        seq = buffer.sample_sequences(16, 5)
        assert_windows(seq, by_id(oracle))
        assert {int(i) for i in seq.indices[seq.mask]} <= live
        lost.append(len(buffer) - len(live))

    run(image_cartpole(max_steps=6), buffer, NStep(n=2, gamma=0.9), 120, after_step=check)
    assert max(lost) > 0


def test_first_add_that_cannot_allocate_the_ring_changes_nothing():
    # a frame_capacity too large for memory (from the constructor or a checkpoint of an
    # empty buffer): the add fails before any transition is written
    frames = np.arange(5 * 6 * 6, dtype=np.uint8).reshape(5, 6, 6)
    for cls in (FrameStackReplayBuffer, PrioritizedFrameStackReplayBuffer):
        buffer = cls(10, stack_size=K, frame_capacity=10**14, random_seed=0)
        before = utils.dumps(buffer)
        with pytest.raises((MemoryError, ValueError)):
            buffer.add(stack_batch(frames))
        assert len(buffer) == 0 and utils.dumps(buffer) == before
        state = buffer.__checkpoint_state__()
        restored = cls.__checkpoint_restore__(state)
        with pytest.raises((MemoryError, ValueError)):
            restored.add(stack_batch(frames))
        assert len(restored) == 0 and not restored


def test_frame_ids_that_would_overflow_are_refused_before_any_write():
    buffer = FrameStackReplayBuffer(10, stack_size=K, random_seed=0)
    frames = np.arange(5 * 6 * 6, dtype=np.uint8).reshape(5, 6, 6)
    buffer.add(stack_batch(frames))
    state = buffer.__checkpoint_state__()
    state.update(frame_count=2**63 - 3)  # a checkpoint whose frame ids are near the limit
    restored = FrameStackReplayBuffer.__checkpoint_restore__(state)
    before = utils.dumps(restored)
    with pytest.raises(ValueError, match="overflow"):
        restored.add(stack_batch(frames[::-1].copy()))
    assert utils.dumps(restored) == before


def test_prioritized_refuses_to_sample_when_every_priority_is_zero():
    # (|Adv| + epsilon) ** alpha underflows to 0 for every transition: nothing can be drawn
    buffer = PrioritizedFrameStackReplayBuffer(10, stack_size=K, random_seed=0)
    frames = np.arange(5 * 6 * 6, dtype=np.uint8).reshape(5, 6, 6)
    buffer.add(stack_batch(frames), Adv=np.zeros(1))
    buffer.add(stack_batch(frames[::-1].copy()), Adv=np.zeros(1))
    buffer.alpha = 200.0
    assert buffer.total_priority == 0.0
    with pytest.raises(ValueError, match="priority 0"):
        buffer.sample(4)


def test_prioritized_update_ignores_transitions_that_lost_frames():
    # as the jittable buffer does: an update neither gives such a transition a priority
    # again nor raises the priority that new transitions get
    buffer = PrioritizedFrameStackReplayBuffer(
        capacity=10, stack_size=2, frame_capacity=4, random_seed=0
    )
    frames = np.arange(12 * 9, dtype=np.uint8).reshape(12, 3, 3)
    for t in range(3):  # 3 new frames each (S, S_next share one): the oldest lose frames
        buffer.add(stack_batch(frames[3 * t : 3 * t + 3], k=2), Adv=np.ones(1))
    live = {int(tr.idx[0]) for tr in buffer}
    assert live == {2}
    buffer.update(np.array([0, 1, 2]), np.array([50.0, 60.0, 3.0]))
    assert list(buffer.priorities(np.array([2]))) == pytest.approx([3.0001])
    assert buffer.sample(8).idx.tolist() == [2] * 8  # 0 and 1 are found and dropped
    np.testing.assert_array_equal(buffer.priorities(np.array([0, 1])), [0.0, 0.0])
    buffer.update(np.array([0, 1]), np.array([50.0, 60.0]))
    np.testing.assert_array_equal(buffer.priorities(np.array([0, 1])), [0.0, 0.0])
    buffer.add(stack_batch(frames[9:12], k=2))  # the default: the largest |Adv| of live ones
    assert buffer.priorities(np.array([3])) == pytest.approx([3.0001])


def test_empty_frames_are_refused_by_the_first_add():
    # frames of no bytes were accepted, then sample failed and a saved buffer did not load
    buffer = FrameStackReplayBuffer(10, stack_size=K, random_seed=0)
    before = utils.dumps(buffer)
    with pytest.raises(ValueError, match="empty"):
        buffer.add(stack_batch(np.zeros((5, 3, 0), np.uint8)))
    assert utils.dumps(buffer) == before
