"""ReplayServer on a real local Ray cluster: writers, learner calls, checkpoints, bad input."""

import collections
import copy
import pathlib

import numpy as np
import pytest

from coax_utils.distributed import ReplayServer
from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer
from tests.distributed._data import keys, make_batch

NUM_WRITERS, NUM_BATCHES, BATCH = 3, 8, 10


def _write(server, writer, num_batches, batch_size):
    """A Ray task: add ``num_batches`` batches of writer-tagged rows, some calls in flight."""
    import ray

    refs = [
        server.add.remote(make_batch(writer, i * batch_size, batch_size))
        for i in range(num_batches)
    ]
    return sum(ray.get(refs))


def _run_writers(ray, server):
    write = ray.remote(_write)
    refs = [write.remote(server, w, NUM_BATCHES, BATCH) for w in range(NUM_WRITERS)]
    return sum(ray.get(refs))


def _stored_keys(ray, server):
    return [k for tr in ray.get(server.snapshot.remote()) for k in keys(tr.S)]


# max_concurrency=4: Ray runs calls on 4 threads of the actor; the server's lock must hold
@pytest.mark.parametrize("max_concurrency", [1, 4])
def test_concurrent_writers_lose_nothing(ray_cluster, max_concurrency):
    ray = ray_cluster
    total = NUM_WRITERS * NUM_BATCHES * BATCH
    buffer = PrioritizedReplayBuffer(capacity=2 * total, random_seed=0)
    server = ReplayServer.options(max_concurrency=max_concurrency).remote(buffer)
    assert _run_writers(ray, server) == total
    assert ray.get(server.num_added.remote()) == total
    assert ray.get(server.size.remote()) == total
    stored = _stored_keys(ray, server)
    expected = [(w, s) for w in range(NUM_WRITERS) for s in range(NUM_BATCHES * BATCH)]
    assert sorted(stored) == expected  # every row once: none lost, none duplicated


def test_concurrent_writers_into_a_full_ring_count_every_row(ray_cluster):
    ray = ray_cluster
    capacity = 45
    server = ReplayServer.remote(PrioritizedReplayBuffer(capacity=capacity, random_seed=0))
    total = _run_writers(ray, server)
    assert ray.get(server.num_added.remote()) == total
    assert ray.get(server.size.remote()) == capacity
    stored = _stored_keys(ray, server)
    assert len(set(stored)) == capacity
    # The ring evicts the oldest rows and each writer's rows arrive in order, so what is left
    # of every writer is the tail of its sequence.
    per_writer = collections.defaultdict(list)
    for w, s in stored:
        per_writer[w].append(s)
    last = NUM_BATCHES * BATCH - 1
    for seqs in per_writer.values():
        assert sorted(seqs) == list(range(last - len(seqs) + 1, last + 1))
    # the last batch added by anyone is always kept whole
    assert any(len(seqs) >= BATCH for seqs in per_writer.values())


def _filled(buffer, num_rows=64):
    for i in range(0, num_rows, 16):
        buffer.add(make_batch(0, i, 16), Adv=np.linspace(0.1, 2.0, 16))
    return buffer


def _assert_same_batch(a, b):
    for field in ("S", "A", "Rn", "In", "S_next", "W", "idx"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_sample_and_update_match_the_local_buffer(ray_cluster):
    ray = ray_cluster
    local = _filled(PrioritizedReplayBuffer(capacity=100, alpha=0.7, beta=0.5, random_seed=3))
    server = ReplayServer.remote(copy.deepcopy(local))
    for step in range(3):
        remote_batch = ray.get(server.sample.remote(16))
        local_batch = local.sample(16)
        _assert_same_batch(remote_batch, local_batch)
        assert remote_batch.W.max() == 1.0
        adv = np.arange(16, dtype=np.float32) * (step + 1)
        ray.get(server.update.remote(remote_batch.idx, adv))
        local.update(local_batch.idx, adv)
    _assert_same_batch(ray.get(server.sample.remote(32)), local.sample(32))


def test_priority_updates_from_the_learner_steer_sampling(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(_filled(PrioritizedReplayBuffer(capacity=100, random_seed=0)))
    batch = ray.get(server.sample.remote(64))
    favourite = int(batch.idx[0])
    adv = np.where(batch.idx == favourite, 1e3, 0.0)
    ray.get(server.update.remote(batch.idx, adv))
    # every other sampled row keeps a small priority; the favourite now dominates
    after = ray.get(server.sample.remote(200))
    assert np.mean(after.idx == favourite) > 0.5
    assert ray.get(server.size.remote()) == 64


def test_save_and_restore(ray_cluster, tmp_path):
    ray = ray_cluster
    from coax_utils import utils

    original = ReplayServer.remote(
        _filled(PrioritizedReplayBuffer(capacity=100, alpha=0.6, random_seed=5))
    )
    path = ray.get(original.save.remote(tmp_path / "replay.lz4"))
    assert path == str(tmp_path / "replay.lz4")

    # the file holds the buffer itself
    loaded = utils.load(path)
    assert isinstance(loaded, PrioritizedReplayBuffer)
    assert [keys(tr.S) for tr in loaded] == [
        keys(tr.S) for tr in ray.get(original.snapshot.remote())
    ]

    # a fresh server restored from it continues exactly like the original (same RNG stream)
    restored = ReplayServer.remote(PrioritizedReplayBuffer(capacity=7, random_seed=0))
    assert ray.get(restored.restore.remote(path)) == 64
    assert ray.get(restored.size.remote()) == 64
    for _ in range(2):
        _assert_same_batch(ray.get(restored.sample.remote(8)), ray.get(original.sample.remote(8)))
    ray.get(restored.add.remote(make_batch(1, 0, 4)))
    assert ray.get(restored.size.remote()) == 68

    # a later save replaces the file atomically; the restored server saved it again
    ray.get(restored.save.remote(path))
    assert len(utils.load(path)) == 68
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay.lz4"]


def test_restore_rejects_bad_files_and_keeps_the_buffer(ray_cluster, tmp_path):
    ray = ray_cluster
    from coax_utils import utils

    server = ReplayServer.remote(_filled(SimpleReplayBuffer(capacity=100, random_seed=0)))
    good = ray.get(server.save.remote(tmp_path / "good.lz4"))
    corrupt = tmp_path / "corrupt.lz4"
    corrupt.write_bytes(pathlib.Path(good).read_bytes()[:-20])
    with pytest.raises(ValueError, match="corrupt"):
        ray.get(server.restore.remote(corrupt))
    not_a_buffer = tmp_path / "dict.lz4"
    utils.dump({"a": np.zeros(3)}, not_a_buffer)
    with pytest.raises(TypeError, match="does not hold a replay buffer"):
        ray.get(server.restore.remote(not_a_buffer))
    assert ray.get(server.size.remote()) == 64


def test_bad_input_is_rejected_and_nothing_is_written(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(PrioritizedReplayBuffer(capacity=100, random_seed=0))
    ray.get(server.add.remote(make_batch(0, 0, 8)))

    wrong_shape = make_batch(0, 8, 4)
    wrong_shape = wrong_shape.replace(S=np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="shape"):
        ray.get(server.add.remote(wrong_shape))
    wrong_dtype = make_batch(0, 8, 4).replace(A=np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="dtype"):
        ray.get(server.add.remote(wrong_dtype))
    with pytest.raises(ValueError, match="Adv"):
        ray.get(server.add.remote(make_batch(0, 8, 4), np.ones(3)))
    with pytest.raises(TypeError, match="TransitionBatch"):
        ray.get(server.add.remote({"S": np.zeros((4, 2))}))
    # the Ray error is also the original type, with the buffer's message
    try:
        ray.get(server.add.remote(wrong_shape))
    except ray.exceptions.RayTaskError as exc:
        assert isinstance(exc.as_instanceof_cause(), ValueError)
    else:
        raise AssertionError("a batch of the wrong shape was accepted")

    with pytest.raises(ValueError, match="batch_size"):
        ray.get(server.sample.remote(0))
    with pytest.raises(ValueError, match="idx"):
        ray.get(server.update.remote(np.array([-1]), np.array([1.0])))
    with pytest.raises(ValueError, match="Adv"):
        ray.get(server.update.remote(np.array([0, 1]), np.array([np.nan, 1.0])))

    assert ray.get(server.size.remote()) == 8
    assert ray.get(server.num_added.remote()) == 8
    assert sorted(_stored_keys(ray, server)) == [(0, s) for s in range(8)]
    assert ray.get(server.add.remote(make_batch(0, 8, 4))) == 4  # still serving


def test_server_argument_and_buffer_kind_errors(ray_cluster):
    ray = ray_cluster
    with pytest.raises(TypeError, match="without add, sample"):
        ReplayServer.remote(object())
    with pytest.raises(TypeError, match="list without add, sample"):
        ReplayServer.options(num_cpus=0).remote([1, 2])  # a list has no add or sample
    uniform = ReplayServer.remote(SimpleReplayBuffer(capacity=10))
    with pytest.raises(ValueError, match="empty"):
        ray.get(uniform.sample.remote(4))
    ray.get(uniform.add.remote(make_batch(0, 0, 4)))
    with pytest.raises(TypeError, match="no priorities"):
        ray.get(uniform.update.remote(np.array([0]), np.array([1.0])))


def test_size_follows_num_added_when_adds_are_refused():
    """In-process: refused adds count and write nothing; a pre-filled buffer counts."""
    prefilled = PrioritizedReplayBuffer(capacity=3, alpha=2.0, random_seed=0)
    prefilled.add(make_batch(0, 0, 2))
    server = ReplayServer(prefilled)
    assert server.size() == min(server.num_added(), 3) == 2
    for adv in ([1e200], [float("nan")]):
        with pytest.raises(ValueError):
            server.add(make_batch(1, 0, 1), np.array(adv))
        assert server.size() == min(server.num_added(), 3) == 2
    with pytest.raises(ValueError):
        server.update(np.array([2**64 - 1], np.uint64), np.array([1.0]))
    for _ in range(3):
        server.add(make_batch(1, 0, 1), np.array([-1.0]))  # signed Adv is fine
        assert server.size() == min(server.num_added(), 3)
    assert server.num_added() == 5


def test_a_buffer_class_instead_of_a_buffer_is_refused_by_remote(ray_cluster):
    # the class has add, sample and __len__ as functions: it used to pass the check, and the
    # actor died in its constructor (len of a class), seen only as RayActorError later
    for cls in (SimpleReplayBuffer, PrioritizedReplayBuffer):
        with pytest.raises(TypeError, match="got the class"):
            ReplayServer.remote(cls)
        with pytest.raises(TypeError, match="got the class"):
            ReplayServer(cls)
