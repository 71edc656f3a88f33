"""ShardedReplay on a real local Ray cluster: exact sampling, routing, failures, checkpoints."""

import gc
import json
import shutil
import threading
import time
import weakref

import numpy as np
import pytest
from scipy import stats

from coax_utils.distributed import (
    PrefetchingSampler,
    RateLimiter,
    ReplayShardError,
    ShardedReplay,
)
from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer, TransitionBatch
from coax_utils.utils import CheckpointDamagedError, CheckpointNotReadableError
from tests.distributed._data import keys, kill_and_wait, make_batch

ALPHA, BETA, EPS = 0.7, 0.5, 1e-4


def _prioritized(seeds, capacity=200):
    return [
        PrioritizedReplayBuffer(capacity, alpha=ALPHA, beta=BETA, epsilon=EPS, random_seed=s)
        for s in seeds
    ]


def _fill(replay, adv_by_shard):
    """Rows of writer ``s`` go to shard ``s`` with the given advantages; returns key -> adv."""
    expected = {}
    for s, adv in enumerate(adv_by_shard):
        batch = make_batch(s, 0, len(adv))
        replay.add(batch, adv, shard=s)
        expected.update(zip(keys(batch.S), adv))
    return expected


def _draw(sample, calls, batch_size):
    counts, batches = {}, []
    for _ in range(calls):
        batch = sample(batch_size)
        batches.append(batch)
        for k in keys(batch.S):
            counts[k] = counts.get(k, 0) + 1
    return counts, batches


def test_prioritized_sampling_across_shards_equals_one_buffer(ray_cluster):
    rng = np.random.default_rng(0)
    # shard 1 holds more and larger priorities: the shards' totals differ by ~5x
    adv = [rng.uniform(0.0, 1.0, 20), rng.uniform(0.5, 3.0, 40)]
    replay = ShardedReplay(_prioritized([1, 2]), seed=3)
    expected_adv = _fill(replay, adv)
    local = _prioritized([4], capacity=400)[0]
    for s, a in enumerate(adv):
        local.add(make_batch(s, 0, len(a)), a)

    items = sorted(expected_adv)
    priority = np.array([(expected_adv[k] + EPS) ** ALPHA for k in items])
    P = dict(zip(items, priority / priority.sum()))
    N = len(items)

    calls, size = 40, 250
    sharded_counts, sharded_batches = _draw(replay.sample, calls, size)
    local_counts, local_batches = _draw(local.sample, calls, size)
    f_sharded = np.array([sharded_counts.get(k, 0) for k in items])
    f_local = np.array([local_counts.get(k, 0) for k in items])
    exact = np.array([P[k] for k in items]) * calls * size
    # goodness of fit against the exact distribution of one buffer, and against the buffer
    assert stats.chisquare(f_sharded, exact).pvalue > 1e-4
    assert stats.chi2_contingency(np.stack([f_sharded, f_local])).pvalue > 1e-4
    tv = 0.5 * np.abs(f_sharded / f_sharded.sum() - f_local / f_local.sum()).sum()
    assert tv < 0.05

    # importance weights: (N P(i))^-beta normalised per batch, from one buffer and from shards
    for batch in sharded_batches[:5] + local_batches[:5]:
        w = np.array([(N * P[k]) ** -BETA for k in keys(batch.S)])
        np.testing.assert_allclose(batch.W, w / w.max(), rtol=1e-5)

    # ids encode the owning shard: writer s's rows live on shard s
    batch = sharded_batches[0]
    np.testing.assert_array_equal(batch.idx % 2, batch.S[:, 0].astype(int))
    assert replay.size() == N and replay.num_added() == N


def test_sampling_stays_exact_when_the_totals_moved_since_the_last_sample(ray_cluster):
    """The totals swing between samples: the shards draw too few for their new share, the
    client asks for the rest, and the batches still follow one buffer's distribution."""
    replay = ShardedReplay(_prioritized([1, 2]), seed=0)
    _fill(replay, [np.ones(20), np.ones(20)])
    first = replay.sample(2000)  # equal priorities: every one of the 40 items appears
    idx_of = dict(zip(keys(first.S), first.idx.tolist()))
    assert len(idx_of) == 40
    items = sorted(idx_of)
    idx = np.array([idx_of[k] for k in items])
    base = np.array([0.5 + (seq % 20) / 20 for _, seq in items])
    on_shard0 = np.array([w == 0 for w, _ in items])
    # shard 0 holds ~83% of the total priority, then ~17%: the last totals mislead
    configs = [np.where(on_shard0, 3.0, 0.3) * base, np.where(on_shard0, 0.3, 3.0) * base]
    calls, size = 30, 200
    freq = [np.zeros(40), np.zeros(40)]
    position = {k: j for j, k in enumerate(items)}
    for call in range(calls):
        adv = configs[call % 2]
        replay.update(idx, adv)
        batch = replay.sample(size)
        for k in keys(batch.S):
            freq[call % 2][position[k]] += 1
        priority = (adv + EPS) ** ALPHA
        P = priority / priority.sum()
        w = np.array([(40 * P[position[k]]) ** -BETA for k in keys(batch.S)])
        np.testing.assert_allclose(batch.W, w / w.max(), rtol=1e-5)
    for adv, f in zip(configs, freq):
        priority = (adv + EPS) ** ALPHA
        exact = priority / priority.sum() * f.sum()
        assert f.sum() == calls // 2 * size
        assert stats.chisquare(f, exact).pvalue > 1e-4


def test_uniform_shards_of_different_sizes_sample_uniformly(ray_cluster):
    buffers = [SimpleReplayBuffer(100, random_seed=s) for s in (1, 2, 3)]
    replay = ShardedReplay(buffers, seed=0)
    for s, n in enumerate((5, 15, 40)):
        replay.add(make_batch(s, 0, n), shard=s)
    counts, batches = _draw(replay.sample, 20, 300)
    assert len(counts) == 60
    f = np.array(list(counts.values()))
    assert stats.chisquare(f).pvalue > 1e-4
    assert all(np.all(b.W == 1.0) for b in batches)


def test_updates_are_routed_to_the_owning_shard(ray_cluster):
    replay = ShardedReplay(_prioritized([1, 2]), seed=0)
    _fill(replay, [np.ones(30), np.ones(30)])
    batch = replay.sample(64)
    favourite = int(batch.idx[np.nonzero(batch.idx % 2 == 1)[0][0]])  # on shard 1
    replay.update(batch.idx, np.where(batch.idx == favourite, 1e4, 0.0))
    after = replay.sample(400)
    assert np.mean(after.idx == favourite) > 0.5
    # bad ids or values are refused before anything is sent
    with pytest.raises(ValueError, match="idx"):
        replay.update(np.array([-1]), np.array([1.0]))
    with pytest.raises(ValueError, match="shape"):
        replay.update(batch.idx, np.ones(3))
    with pytest.raises(ValueError, match="finite"):
        replay.update(batch.idx[:1], np.array([np.nan]))
    # an unsigned id beyond int64 would wrap to -1 (shard 1): nothing reaches shard 0 either
    totals = [t["total"] for t in replay.totals()]
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        replay.update(np.array([2**64 - 1, 0], np.uint64), np.array([1.0, 1e4]))
    assert [t["total"] for t in replay.totals()] == totals
    assert np.mean(replay.sample(400).idx == favourite) > 0.5


def test_round_robin_adds_and_argument_errors(ray_cluster):
    replay = ShardedReplay([SimpleReplayBuffer(50, random_seed=s) for s in (1, 2)])
    for i in range(4):
        assert replay.add(make_batch(0, 10 * i, 10)) == 10
    assert [t["size"] for t in replay.totals()] == [20, 20]
    with pytest.raises(ValueError, match="shard must be"):
        replay.add(make_batch(0, 0, 2), shard=2)
    with pytest.raises(TypeError, match="TransitionBatch"):
        replay.add({"S": 1})
    with pytest.raises(ValueError, match="batch_size"):
        replay.sample(0)
    with pytest.raises(TypeError, match="one type"):
        ShardedReplay([SimpleReplayBuffer(5), PrioritizedReplayBuffer(5)])
    with pytest.raises(ValueError, match="share beta"):
        ShardedReplay([PrioritizedReplayBuffer(5, beta=0.4), PrioritizedReplayBuffer(5)])
    with pytest.raises(ValueError, match="at least one"):
        ShardedReplay([])
    with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
        ShardedReplay([SimpleReplayBuffer(5)], timeout=0)  # every call would time out
    with pytest.raises(ValueError, match="timeout"):
        replay.sample(4, timeout=float("nan"))
    empty = ShardedReplay([SimpleReplayBuffer(5)])
    with pytest.raises(ValueError, match="empty"):
        empty.sample(4)


def test_a_killed_shard_is_named_on_the_next_call(ray_cluster):
    ray = ray_cluster
    replay = ShardedReplay(_prioritized([1, 2]), seed=0, timeout=20.0)
    _fill(replay, [np.ones(10), np.ones(10)])
    sampler = PrefetchingSampler(replay, 8, num_in_flight=2)
    batch = sampler.sample()
    tic = time.monotonic()
    kill_and_wait(ray, replay.shards[1], replay.shards[1].size.remote)
    with pytest.raises(ReplayShardError, match="replay shard 1 of 2"):
        # at most num_in_flight batches were requested before the shard was gone
        for _ in range(3):
            sampler.sample()
    # a priority update is sent without waiting: its failure surfaces on a later call
    assert sampler.update(batch.idx, np.ones(8)) is None
    with pytest.raises(ReplayShardError, match="replay shard 1 of 2"):
        replay.add(make_batch(1, 10, 2), shard=1)
    with pytest.raises(ReplayShardError, match="replay shard 1 of 2"):
        replay.update(np.array([1]), np.array([1.0]))
    assert time.monotonic() - tic < 30.0  # no hang
    assert replay.add(make_batch(0, 10, 2), shard=0) == 2  # the live shard still serves
    with pytest.raises(ReplayShardError, match="replay shard 1 of 2"):
        sampler.close()  # waits for the pending updates: the one sent to the dead shard


class _Writer:
    """Adds writer-tagged batches through a ShardedReplay until told to stop."""

    def run(self, replay, writer, num_batches, batch_size):
        for i in range(num_batches):
            replay.add(make_batch(writer, i * batch_size, batch_size))
        return num_batches * batch_size


def test_a_killed_writer_leaves_the_shards_and_other_writers_intact(ray_cluster):
    ray = ray_cluster
    replay = ShardedReplay([SimpleReplayBuffer(10_000, random_seed=s) for s in (1, 2)])
    Writer = ray.remote(_Writer)
    doomed, survivor = Writer.remote(), Writer.remote()
    doomed_ref = doomed.run.remote(replay, 0, 10_000, 5)
    survivor_ref = survivor.run.remote(replay, 1, 40, 5)
    while replay.num_added() < 300:  # the survivor adds 200 at most: the doomed one >= 100
        time.sleep(0.05)
    ray.kill(doomed)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed_ref, timeout=30)
    assert ray.get(survivor_ref, timeout=60) == 200
    # the add the doomed writer had sent may still land after its death: read the contents
    # until no add landed while they were read
    deadline = time.monotonic() + 30.0
    while True:
        before = ray.get([s.num_added.remote() for s in replay.shards])
        snapshots = ray.get([s.snapshot.remote() for s in replay.shards])
        if ray.get([s.num_added.remote() for s in replay.shards]) == before:
            break
        assert time.monotonic() < deadline
    stored = [k for snapshot in snapshots for tr in snapshot for k in keys(tr.S)]
    assert len(stored) == len(set(stored)) == sum(before)
    assert sorted(k for k in stored if k[0] == 1) == [(1, i) for i in range(200)]
    doomed_rows = sorted(seq for w, seq in stored if w == 0)
    assert len(doomed_rows) % 5 == 0 and len(doomed_rows) >= 50  # whole batches only
    assert set(doomed_rows) == set(range(len(doomed_rows)))  # a prefix: its calls in order
    assert replay.sample(16).batch_size == 16


def _files(folder):
    """The shard files a checkpoint's manifest names."""
    with open(f"{folder}/sharded_replay.json") as f:
        return json.load(f)["files"]


def _assert_same(a, b):
    for field in ("S", "A", "Rn", "W", "idx"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_save_and_restore_all_shards_continue_the_rng_streams(ray_cluster, tmp_path):
    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=4, samples_per_insert=100.0, error_buffer=1e6)
    replay = ShardedReplay(_prioritized([1, 2]), rate_limiter=limiter, seed=5)
    _fill(replay, [np.linspace(0, 1, 20), np.linspace(1, 2, 30)])
    replay.add(make_batch(7, 0, 3))  # round robin moves on
    replay.sample(8)
    replay.save(tmp_path / "ckpt")
    folder = replay.save(tmp_path / "ckpt")  # a second save replaces the first's files
    files = _files(folder)
    assert [name[:8] for name in files] == ["shard-0-", "shard-1-"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".sharded_replay.lock",  # held by saves (one at a time) and restores
        *files,
        "sharded_replay.json",
    ]
    counts = ray.get(limiter.counts.remote())
    after_save = [replay.sample(16) for _ in range(3)]
    replay.add(make_batch(8, 0, 2))

    limiter2 = RateLimiter.remote(min_size_to_sample=4, samples_per_insert=100.0, error_buffer=1e6)
    other = ShardedReplay(_prioritized([11, 12]), rate_limiter=limiter2, seed=99)
    assert other.restore(folder) == 53
    assert ray.get(limiter2.counts.remote()) == counts
    for expected in after_save:
        _assert_same(other.sample(16), expected)
    other.add(make_batch(8, 0, 2))
    assert [t["size"] for t in other.totals()] == [t["size"] for t in replay.totals()]

    # one shard on its own: ReplayServer.save/restore
    path = ray.get(replay.shards[0].save.remote(tmp_path / "one.lz4"))
    assert ray.get(other.shards[0].restore.remote(path)) == ray.get(replay.shards[0].size.remote())

    # a checkpoint for another layout is refused, nothing changes
    two = ShardedReplay(_prioritized([1, 2, 3]))
    with pytest.raises(ValueError, match="holds 2 shards"):
        two.restore(folder)
    no_limiter = ShardedReplay(_prioritized([1, 2]))
    with pytest.raises(ValueError, match="rate limiter"):
        no_limiter.restore(folder)
    with pytest.raises(ValueError, match="no ShardedReplay checkpoint"):
        no_limiter.restore(tmp_path)
    assert no_limiter.size() == 0

    # a manifest that lies (hand-edited JSON) is refused with a ValueError, nothing changes
    manifest = json.loads((tmp_path / "ckpt" / "sharded_replay.json").read_text())
    zero_rng = dict(manifest["rng"], state={"state": 0, "inc": 0})  # numpy: a constant stream
    lies = [
        ("hint", [1.0]),
        ("hint", [1.0, -2.0]),
        ("hint", [1.0, float("nan")]),
        ("hint", [True, 1.0]),
        ("hint", [10**400, 1.0]),
        ("rng", dict(manifest["rng"], state={"state": 10**400, "inc": 1})),
        ("rng", dict(manifest["rng"], state={"state": -1, "inc": 1})),
        ("rng", zero_rng),
        ("rng", dict(manifest["rng"], bit_generator="MT19937")),
        ("format", 2),  # a checkpoint of an older version: named as such
    ]
    fresh = ShardedReplay(
        _prioritized([1, 2]),
        rate_limiter=RateLimiter.remote(
            min_size_to_sample=4, samples_per_insert=100.0, error_buffer=1e6
        ),
    )
    for i, (key, value) in enumerate(lies):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(tmp_path / "ckpt", bad)
        (bad / "sharded_replay.json").write_text(json.dumps(dict(manifest, **{key: value})))
        match = {"hint": "hint", "rng": "RNG state", "format": "another version"}[key]
        error = CheckpointNotReadableError if key == "format" else CheckpointDamagedError
        with pytest.raises(error, match=match):
            fresh.restore(bad)
        assert fresh.size() == 0 and fresh.num_added() == 0


class _CodeRunner:
    """Looks like a replay buffer; unpickling it would run code in the shard."""

    def __reduce__(self):
        return (print, ("code from a checkpoint ran",))


def test_a_damaged_or_mixed_checkpoint_is_refused_before_any_shard_changes(ray_cluster, tmp_path):
    import hashlib

    from coax_utils import utils

    ray = ray_cluster
    saved = ShardedReplay(_prioritized([1, 2]), seed=0)
    _fill(saved, [np.ones(10), np.ones(12)])
    good = saved.save(tmp_path / "good")
    other = ShardedReplay(
        [PrioritizedReplayBuffer(200, alpha=0.2, beta=BETA, epsilon=EPS) for _ in range(2)]
    )
    _fill(other, [np.ones(30), np.ones(30)])
    foreign = other.save(tmp_path / "other")
    uniform = ShardedReplay([SimpleReplayBuffer(50), SimpleReplayBuffer(50)])
    uniform.add(make_batch(0, 0, 3), shard=1)
    plain = uniform.save(tmp_path / "uniform")
    utils.dump(_CodeRunner(), tmp_path / "code.lz4")

    def damaged(name, edit):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        edit(folder)
        return folder

    def shard(folder, i):
        return f"{folder}/{_files(folder)[i]}"

    def forge(folder, i, source):
        """Put ``source`` in place of a shard file and make the manifest name its digest."""
        shutil.copy(source, shard(folder, i))
        manifest = json.loads((folder / "sharded_replay.json").read_text())
        with open(shard(folder, i), "rb") as f:
            manifest["sha256"][i] = hashlib.sha256(f.read()).hexdigest()
        (folder / "sharded_replay.json").write_text(json.dumps(manifest))

    def flip(folder):
        with open(shard(folder, 1), "r+b") as f:
            f.seek(200)
            byte = f.read(1)[0]
            f.seek(200)
            f.write(bytes([byte ^ 0xFF]))

    cases = [
        ("another save's shard", lambda f: shutil.copy(shard(foreign, 1), shard(f, 1)), "SHA-256"),
        ("a shard twice", lambda f: shutil.copy(shard(f, 0), shard(f, 1)), "SHA-256"),
        ("an edited byte", flip, "SHA-256"),
        ("other exponents", lambda f: forge(f, 1, shard(foreign, 1)), "alpha=0.2"),
        ("another type", lambda f: forge(f, 1, shard(plain, 1)), "SimpleReplayBuffer"),
        ("code", lambda f: forge(f, 1, tmp_path / "code.lz4"), "unpickl|pickle"),
    ]
    target = ShardedReplay(_prioritized([5, 6]), seed=1)
    target.add(make_batch(9, 0, 4), np.ones(4), shard=0)
    totals = target.totals()
    for name, edit, message in cases:
        folder = damaged(name.replace(" ", "_").replace("'", ""), lambda f, edit=edit: edit(f))
        with pytest.raises(ValueError, match=message):
            target.restore(folder)
        assert target.totals() == totals, name  # shard 0 was not restored either
    assert target.restore(good) == 22

    # rate-limiter counts that the limiter would refuse: refused before the shards change
    limiter = RateLimiter.remote(min_size_to_sample=4, samples_per_insert=1.0, error_buffer=1e3)
    limited = ShardedReplay(_prioritized([1, 2]), rate_limiter=limiter, seed=0)
    limited.add(make_batch(0, 0, 8), np.ones(8), shard=0)
    folder = limited.save(tmp_path / "limited")
    manifest = json.loads((tmp_path / "limited" / "sharded_replay.json").read_text())
    manifest["rate_limiter"] = {"inserts": -5, "samples": 0}
    (tmp_path / "limited" / "sharded_replay.json").write_text(json.dumps(manifest))
    limited.add(make_batch(0, 8, 8), np.ones(8), shard=1)
    with pytest.raises(ValueError, match="rate_limiter"):
        limited.restore(folder)
    assert [t["size"] for t in limited.totals()] == [8, 8]
    assert ray.get(limiter.counts.remote()) == {"inserts": 16, "samples": 0}

    # one shard on its own takes only a buffer of the kind its siblings serve
    with pytest.raises(ValueError, match="SimpleReplayBuffer"):
        ray.get(target.shards[1].restore.remote(shard(plain, 1)))
    with pytest.raises(ValueError, match="pickl"):
        ray.get(target.shards[1].restore.remote(tmp_path / "code.lz4"))
    assert [t["size"] for t in target.totals()] == [10, 12]

    # a save that fails (a dead shard) leaves the earlier checkpoint in its folder intact
    saved.add(make_batch(0, 10, 5), np.ones(5), shard=0)
    kill_and_wait(ray, saved.shards[1], saved.shards[1].size.remote)
    with pytest.raises(ReplayShardError, match="replay shard 1 of 2"):
        saved.save(good)
    assert sorted(p.name for p in (tmp_path / "good").iterdir()) == [
        ".sharded_replay.lock",
        *_files(good),
        "sharded_replay.json",
    ]
    assert target.restore(good) == 22


def test_prefetching_sampler_serves_batches_and_sends_updates(ray_cluster):
    replay = ShardedReplay(_prioritized([1, 2]), seed=0)
    _fill(replay, [np.ones(30), np.ones(30)])
    with PrefetchingSampler(replay, 32, num_in_flight=3, max_pending_updates=2) as sampler:
        favourite = None
        for _ in range(10):
            batch = sampler.sample()
            assert isinstance(batch, TransitionBatch) and batch.batch_size == 32
            favourite = int(batch.idx[0]) if favourite is None else favourite
            sampler.update(batch.idx, np.where(batch.idx == favourite, 1e4, 1e-3))
    with pytest.raises(RuntimeError, match="closed"):
        sampler.sample()
    pending = replay.sample_async(16)  # the requests are out; the batch is collected later
    batch = pending.result()
    assert pending.done() and batch.batch_size == 16
    assert pending.result() is batch  # combined once: no second draw of the counts
    assert np.mean(replay.sample(400).idx == favourite) > 0.5  # the updates all landed
    with pytest.raises(ValueError, match="num_in_flight"):
        PrefetchingSampler(replay, 32, num_in_flight=0)

    # a sampler dropped without close is collected, and its thread stops
    before = set(threading.enumerate())
    sampler = PrefetchingSampler(replay, 8, num_in_flight=2)
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "prefetch"]
    assert sampler.sample().batch_size == 8
    dropped = weakref.ref(sampler)
    del sampler
    gc.collect()
    assert dropped() is None
    thread.join(timeout=30)
    assert not thread.is_alive()
    with pytest.raises(TypeError, match="sample_async and update"):
        PrefetchingSampler(object(), 32)
