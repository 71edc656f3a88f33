"""Host buffers: ring storage, sampling, priorities, validation and persistence."""

import pickle

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer, TransitionBatch

BUFFERS = [SimpleReplayBuffer, PrioritizedReplayBuffer]


def batch(ts, obs_dtype=np.float32, obs_dim=3):
    rows = [
        TransitionBatch.from_single(
            s=np.full(obs_dim, t, obs_dtype), a=t, logp=0.0, r=float(t), done=False, gamma=0.9
        )
        for t in np.atleast_1d(ts)
    ]
    return TransitionBatch.concatenate(*rows)


def snapshot(buffer):
    """Everything observable about a buffer: contents, counters and its RNG state."""
    return pickle.dumps(buffer)


@pytest.mark.parametrize("cls", BUFFERS)
def test_ring_overwrite_and_ids(cls):
    buffer = cls(capacity=5, random_seed=0)
    assert not buffer and len(buffer) == 0
    for t in range(7):
        buffer.add(batch(t))
    assert buffer and len(buffer) == 5
    rows = list(buffer)  # oldest first
    assert [int(r.A[0]) for r in rows] == [2, 3, 4, 5, 6]
    assert [int(r.idx[0]) for r in rows] == [2, 3, 4, 5, 6]
    sample = buffer.sample(64)
    np.testing.assert_array_equal(sample.A, sample.idx)  # ids are insertion counters
    np.testing.assert_array_equal(sample.S[:, 0], sample.A)
    assert set(sample.A.tolist()) <= {2, 3, 4, 5, 6}
    # a batch larger than the buffer keeps its newest rows
    buffer.add(batch(np.arange(100, 112)))
    assert sorted(int(r.A[0]) for r in buffer) == list(range(107, 112))
    buffer.clear()
    assert len(buffer) == 0 and not buffer


@pytest.mark.parametrize("cls", BUFFERS)
def test_seeded_reproducibility_and_fresh_arrays(cls):
    a, b, c = cls(20, random_seed=3), cls(20, random_seed=3), cls(20, random_seed=4)
    for buf in (a, b, c):
        buf.add(batch(np.arange(15)))
    sa, sb, sc = a.sample(32), b.sample(32), c.sample(32)
    np.testing.assert_array_equal(sa.idx, sb.idx)
    assert not np.array_equal(sa.idx, sc.idx)
    sa.S[:] = -1  # samples are copies, not views of the storage
    assert all(r.S.min() >= 0 for r in a)


@pytest.mark.parametrize("cls", BUFFERS)
def test_rejected_calls_leave_the_buffer_unchanged(cls):
    buffer = cls(10, random_seed=1)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(4)
    buffer.add(batch([0, 1, 2]))
    before = snapshot(buffer)
    bad_batches = [
        batch([5], obs_dim=4),  # per-item shape
        batch([5], obs_dtype=np.float64),  # dtype
        batch([5]).replace(A_next=np.array([1])),  # structure
        batch([5, 6]).replace(Rn=np.zeros(3, np.float32)),  # batch sizes disagree
    ]
    for bad in bad_batches:
        with pytest.raises(ValueError):
            buffer.add(bad)
    with pytest.raises(TypeError):
        buffer.add({"S": 1})
    for size in (0, -3):
        with pytest.raises(ValueError):
            buffer.sample(size)
    with pytest.raises(TypeError):
        buffer.sample(2.5)
    if cls is PrioritizedReplayBuffer:
        with pytest.raises(ValueError, match="finite"):
            buffer.add(batch([5, 6]), Adv=np.array([1.0, np.nan]))
        with pytest.raises(ValueError, match="shape"):
            buffer.add(batch([5, 6]), Adv=np.array([1.0]))
        with pytest.raises(ValueError):
            buffer.update(np.array([0, 1]), np.array([np.inf, 1.0]))
        with pytest.raises(ValueError):
            buffer.update(np.array([-1]), np.array([1.0]))
        with pytest.raises(TypeError):
            buffer.update(np.array([0.5]), np.array([1.0]))
    assert snapshot(buffer) == before
    with pytest.raises(ValueError):
        cls(0)
    with pytest.raises(TypeError):
        cls(2.0)


def test_prioritized_frequencies_and_weights():
    buffer = PrioritizedReplayBuffer(8, alpha=0.7, beta=0.6, epsilon=1e-3, random_seed=5)
    adv = np.array([0.5, 1.0, 2.0, 4.0, 0.0, 1.0])
    buffer.add(batch(np.arange(6)), Adv=adv)
    p = (adv + 1e-3) ** 0.7
    P = p / p.sum()
    n = 20000
    counts = np.zeros(6)
    for _ in range(n // 500):
        s = buffer.sample(500)
        np.add.at(counts, s.idx, 1)
        w = (6 * P[s.idx]) ** -0.6
        np.testing.assert_allclose(s.W, w / w.max(), rtol=1e-5)
    # every count within 5 standard deviations of its expectation
    np.testing.assert_array_less(np.abs(counts - n * P), 5 * np.sqrt(n * P * (1 - P)) + 1)
    buffer.beta = 0.0
    np.testing.assert_array_equal(buffer.sample(50).W, 1.0)


def test_alpha_zero_is_uniform_and_alpha_is_settable():
    buffer = PrioritizedReplayBuffer(4, alpha=0.0, random_seed=0)
    buffer.add(batch(np.arange(4)), Adv=np.array([0.0, 1.0, 10.0, 100.0]))
    counts = np.bincount(buffer.sample(8000).idx, minlength=4)
    np.testing.assert_array_less(np.abs(counts - 2000), 200)
    buffer.alpha = 1.0  # re-weights the stored transitions
    counts = np.bincount(buffer.sample(8000).idx, minlength=4)
    assert counts[3] > 6500 and counts[0] < 50
    with pytest.raises(ValueError):
        buffer.alpha = -1.0
    with pytest.raises(ValueError):
        buffer.epsilon = 0.0
    assert buffer.alpha == 1.0


def test_update_semantics():
    buffer = PrioritizedReplayBuffer(4, alpha=1.0, epsilon=1e-6, random_seed=2)
    buffer.add(batch(np.arange(4)), Adv=np.ones(4))
    buffer.update(np.array([0, 1, 2]), np.zeros(3))
    assert set(buffer.sample(200).idx.tolist()) == {3}
    # duplicate ids: the last value wins
    buffer.update(np.array([1, 1]), np.array([5.0, 0.0]))
    assert set(buffer.sample(200).idx.tolist()) == {3}
    # ids of overwritten transitions are ignored
    buffer.add(batch([4]), Adv=np.zeros(1))  # id 4 overwrites id 0 in slot 0
    buffer.update(np.array([0]), np.array([100.0]))
    assert 4 not in set(buffer.sample(200).idx.tolist())
    buffer.update(np.array([4]), np.array([100.0]))
    assert np.mean(buffer.sample(500).idx == 4) > 0.9


def test_add_without_adv_uses_the_max_priority():
    buffer = PrioritizedReplayBuffer(10, alpha=1.0, epsilon=1e-6, random_seed=0)
    buffer.add(batch([0, 1]), Adv=np.array([0.0, 3.0]))
    buffer.add(batch([2]))  # gets |Adv| = 3, like id 1
    counts = np.bincount(buffer.sample(6000).idx, minlength=3)
    assert counts[0] == 0
    assert abs(counts[1] - counts[2]) < 400


@pytest.mark.parametrize("cls", BUFFERS)
def test_pickle_round_trip_continues_the_rng_stream(cls):
    buffer = cls(50, random_seed=7)
    buffer.add(batch(np.arange(30)))
    buffer.sample(5)
    clone = pickle.loads(pickle.dumps(buffer))
    for _ in range(3):
        x, y = buffer.sample(16), clone.sample(16)
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
            np.testing.assert_array_equal(a, b)
    clone.add(batch([99]))  # the clone has its own full-capacity storage
    assert len(clone) == 31 and len(buffer) == 30


@pytest.mark.parametrize("cls", BUFFERS)
def test_utils_dump_round_trip_continues_the_rng_stream(cls, tmp_path):
    from coax_utils import utils

    buffer = cls(40, random_seed=11)
    buffer.add(batch(np.arange(25)))
    if cls is PrioritizedReplayBuffer:
        buffer.update(np.arange(25), np.linspace(0, 3, 25))
    buffer.sample(3)
    utils.dump(buffer, tmp_path / "buffer.lz4")
    clone = utils.load(tmp_path / "buffer.lz4", safe=True)  # a data tree: no pickle
    assert type(clone) is cls and len(clone) == 25
    for _ in range(3):
        x, y = buffer.sample(16), clone.sample(16)
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls", BUFFERS)
@pytest.mark.parametrize("mmap_mode", ["c", "r", None])
def test_save_load_directory_of_memory_mapped_arrays(cls, mmap_mode, tmp_path):
    buffer = cls(16, random_seed=4)
    for t in range(20):  # wrapped
        buffer.add(batch(t, obs_dtype=np.uint8))
    if cls is PrioritizedReplayBuffer:
        buffer.update(np.arange(4, 20), np.arange(16.0))
    path = tmp_path / "saved"
    buffer.save(path)
    assert sorted(p.name for p in path.iterdir())[-1] == "meta.lz4"
    clone = cls.load(path, mmap_mode=mmap_mode)
    if mmap_mode is not None:
        assert isinstance(clone._storage[0], np.memmap)
    x, y = buffer.sample(32), clone.sample(32)
    for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
        np.testing.assert_array_equal(a, b)
    assert [int(r.A[0]) for r in clone] == list(range(4, 20))
    if mmap_mode == "r":
        before = pickle.dumps(clone)
        with pytest.raises(ValueError, match="read-only"):
            clone.add(batch(99, obs_dtype=np.uint8), episode_end=True)
        assert pickle.dumps(clone) == before
    else:
        clone.add(batch(99, obs_dtype=np.uint8))
        assert int(list(clone)[-1].A[0]) == 99
        again = cls.load(path)
        assert not any(int(r.A[0]) == 99 for r in again)  # the saved folder is unchanged
    with pytest.raises(ValueError, match="writing through to a saved folder"):
        cls.load(path, mmap_mode="r+")
    with pytest.raises(ValueError):
        (SimpleReplayBuffer if cls is PrioritizedReplayBuffer else PrioritizedReplayBuffer).load(
            path
        )


def test_large_samples_never_overwrite_a_batch_still_in_use():
    buffer = SimpleReplayBuffer(64, random_seed=0)
    frames = np.arange(64, dtype=np.uint8)[:, None, None] * np.ones((1, 128, 128), np.uint8)
    buffer.add(
        TransitionBatch(
            S=frames,
            A=np.arange(64),
            logP=np.zeros(64, np.float32),
            Rn=np.zeros(64, np.float32),
            In=np.ones(64, np.float32),
            S_next=frames,
        )
    )

    def check(b):
        np.testing.assert_array_equal(b.S[:, 5, 7], b.idx.astype(np.uint8))

    first = buffer.sample(128)  # 2 MiB per frame leaf: recycled memory when unreferenced
    kept = first.S.copy()
    view = buffer.sample(128).S_next[:3]  # only a view of this one stays referenced
    kept_view = view.copy()
    for _ in range(3):
        check(buffer.sample(128))  # dropped at once: its memory is recycled
    np.testing.assert_array_equal(first.S, kept)
    np.testing.assert_array_equal(view, kept_view)
    check(first)


def test_large_samples_work_in_a_forked_child():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import os, numpy as np
        from coax_utils.replay import SimpleReplayBuffer, TransitionBatch
        n = 64
        f, z = np.ones((n, 128, 128), np.uint8), np.zeros(n, np.float32)
        b = SimpleReplayBuffer(n, random_seed=0)
        b.add(TransitionBatch(S=f, A=np.arange(n), logP=z, Rn=z, In=z, S_next=f))
        b.sample(256)  # 4 MiB a leaf: starts the copy threads in the parent
        pid = os.fork()
        if pid == 0:
            b.sample(256)
            os._exit(7)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "7"


def test_mixed_small_dtypes_round_trip_through_packed_rows():
    n = 20
    rng = np.random.default_rng(0)
    S = {
        "flag": rng.integers(2, size=n).astype(bool),
        "byte": rng.integers(-100, 100, size=(n, 3)).astype(np.int8),
        "f64": rng.normal(size=(n, 2)),
        "i16": rng.integers(-999, 999, size=n).astype(np.int16),
        "big": rng.normal(size=(n, 80)).astype(np.float32),  # 320 bytes: stored on its own
    }
    tb = TransitionBatch(
        S=S,
        A=np.arange(n),
        logP=np.zeros(n, np.float32),
        Rn=rng.normal(size=n).astype(np.float32),
        In=np.ones(n, np.float32),
        S_next=S,
    )
    buffer = SimpleReplayBuffer(32, random_seed=0)
    buffer.add(tb[:7])
    buffer.add(tb[7:])
    for sample in (buffer.sample(50), pickle.loads(pickle.dumps(buffer)).sample(50)):
        for got, stored in zip(
            jax.tree_util.tree_leaves(sample.replace(idx=None, W=None)),
            jax.tree_util.tree_leaves(tb),
        ):
            assert got.dtype == stored.dtype and got.shape[1:] == stored.shape[1:]
            np.testing.assert_array_equal(got, stored[sample.idx])


def test_priorities_and_total_priority_of_held_transitions():
    buffer = PrioritizedReplayBuffer(4, alpha=1.0, epsilon=0.5, random_seed=0)
    assert buffer.total_priority == 0.0
    buffer.add(batch(np.arange(6)), Adv=np.array([1.0, -2.0, 3.0, -4.0, 5.0, -6.0]))
    # ids 0 and 1 were overwritten by 4 and 5
    np.testing.assert_allclose(buffer.priorities([2, 5, 4]), [3.5, 6.5, 5.5])
    assert buffer.total_priority == pytest.approx(3.5 + 4.5 + 5.5 + 6.5)
    with pytest.raises(ValueError, match=r"ids \[0\] are not held"):
        buffer.priorities([0])
    with pytest.raises(TypeError):
        buffer.priorities([1.5])


@pytest.mark.parametrize("cls", BUFFERS)
def test_a_transition_that_does_not_fit_is_refused_naming_its_field(cls):
    # e.g. epsilon-greedy: int64 actions from action_space.sample(), int32 from jnp.argmax
    env = gymnasium.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    buffer = cls(10, random_seed=0)

    def step(action):
        return TransitionBatch.from_single(
            s={"obs": obs}, a=action, logp=0.0, r=1.0, done=False, gamma=0.9
        )

    buffer.add(step(env.action_space.sample()))
    with pytest.raises(ValueError, match=r"\.A has per-item shape \(\) and dtype int32; .* int64"):
        buffer.add(step(jnp.argmax(jnp.array([0.1, 0.9]))))
    with pytest.raises(ValueError, match=r"\.S\['obs'\] has per-item shape \(2,\)"):
        buffer.add(step(0).replace(S={"obs": np.zeros((1, 2), np.float32)}))
    assert len(buffer) == 1
    env.close()
