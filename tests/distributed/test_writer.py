"""ReplayWriter on a real local Ray cluster: chunked adds against direct adds, a writer killed
mid-chunk, flushing on close and after max_delay, and refused arguments."""

import pickle
import time

import numpy as np
import pytest

from coax_utils.distributed import RateLimiter, ReplayServer, ReplayShardError, ShardedReplay
from coax_utils.distributed._writer import ReplayWriter
from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer
from tests.distributed._data import keys, kill_and_wait, make_batch


class _Producer:
    """A writer process: adds numbered batches through a ReplayWriter, or directly."""

    def __init__(self, target, chunk_size, max_delay=None):
        self.writer = ReplayWriter(target, chunk_size=chunk_size, max_delay=max_delay)

    def add(self, writer_id, start, sizes):
        for size in sizes:
            self.writer.add(make_batch(writer_id, start, size))
            start += size
        return self.counts()

    def counts(self):
        w = self.writer
        return w.num_added, w.num_acknowledged, w.num_unacknowledged

    def flush(self):
        return self.writer.flush()

    def close(self):
        self.writer.close()
        return self.counts()

    def direct(self, target, writer_id, sizes):
        import ray

        start = 0
        for size in sizes:
            ray.get(target.add.remote(make_batch(writer_id, start, size)))
            start += size
        return start


def _rows(ray, server):
    """The (writer, seq) keys a server holds, in the buffer's insertion order."""
    return [k for tr in ray.get(server.snapshot.remote()) for k in keys(tr.S)]


def _by_writer(rows, writer_id):
    return [seq for w, seq in rows if w == writer_id]


def test_chunked_writers_add_what_direct_adds_add_in_order_within_the_limiter_band(ray_cluster):
    ray = ray_cluster
    rng = np.random.default_rng(0)
    sizes = {w: rng.integers(1, 40, size=30).tolist() for w in (0, 1)}  # uneven batches
    totals = {w: sum(s) for w, s in sizes.items()}
    spi, min_size, error_buffer = 1.0, 100, 200.0
    limiter = RateLimiter.remote(min_size, spi, error_buffer)
    chunked = ShardedReplay([SimpleReplayBuffer(2000, random_seed=1)], rate_limiter=limiter)
    direct = ReplayServer.remote(SimpleReplayBuffer(2000, random_seed=1))
    Producer = ray.remote(_Producer)
    producers = [Producer.remote(chunked.shards[0], 64) for _ in (0, 1)]
    refs = [p.add.remote(w, 0, sizes[w]) for w, p in enumerate(producers)]
    refs += [producers[w].flush.remote() for w in (0, 1)]
    directs = [producers[w].direct.remote(direct, w, sizes[w]) for w in (0, 1)]
    worst, sampled = 0.0, 0
    while ray.wait(refs, num_returns=len(refs), timeout=0)[1]:  # the learner samples
        batch = chunked.sample(16, timeout=30)
        sampled += batch.batch_size
        c = ray.get(limiter.counts.remote())
        worst = max(worst, abs(spi * c["inserts"] - c["samples"] - spi * min_size))
    assert ray.get(refs[2:]) == [totals[0], totals[1]]  # flush: everything acknowledged
    assert ray.get(directs) == [totals[0], totals[1]]
    assert worst <= error_buffer
    assert ray.get(limiter.counts.remote()) == {
        "inserts": totals[0] + totals[1],
        "samples": sampled,
    }
    rows, expected = _rows(ray, chunked.shards[0]), _rows(ray, direct)
    for w in (0, 1):  # same items, same order per writer
        assert _by_writer(rows, w) == _by_writer(expected, w) == list(range(totals[w]))
    # one buffer add per chunk: a chunk of one writer is never interleaved with the other's
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(w for w, _ in rows)]
    assert sum(runs) == len(rows) and all(r >= 64 for r in runs[:-2])


def test_priorities_travel_with_their_rows(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(PrioritizedReplayBuffer(100, alpha=1.0, random_seed=0))
    writer = ReplayWriter(server, chunk_size=8, max_delay=None)
    writer.add(make_batch(0, 0, 5), np.arange(5) + 1.0)
    writer.add(make_batch(0, 5, 3))  # no Adv: the largest priority so far, in its own chunk
    writer.add(make_batch(0, 8, 4), -np.arange(4) - 1.0)
    assert writer.flush() == 12
    buffer = ray.get(server.snapshot.remote())
    batch = next(iter([b for b in [buffer.sample(200)]]))
    got = dict(zip((seq for _, seq in keys(batch.S)), buffer.priorities(batch.idx)))
    want = [1, 2, 3, 4, 5, 5, 5, 5, 1, 2, 3, 4]
    for seq, p in got.items():
        assert p == pytest.approx(want[seq] + buffer.epsilon)
    writer.close()


def test_a_writer_killed_mid_chunk_loses_only_its_unacknowledged_rows(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(1000))
    survivor = ReplayWriter(server, chunk_size=50, max_delay=None)
    survivor.add(make_batch(1, 0, 20))
    doomed = ray.remote(_Producer).remote(server, 100)
    # 288 rows: two full chunks sent; flush sends the other 88 and waits for all of them
    ray.get(doomed.add.remote(0, 0, [32] * 9))
    assert ray.get(doomed.flush.remote()) == 288
    # 96 more rows stay in the open chunk (< 100): unflushed when the process dies
    assert ray.get(doomed.add.remote(0, 288, [32] * 3)) == (384, 288, 96)
    kill_and_wait(ray, doomed, lambda: doomed.counts.remote())
    survivor.add(make_batch(1, 20, 40))
    assert survivor.flush() == 60
    rows = _rows(ray, server)
    assert _by_writer(rows, 0) == list(range(288))  # every acknowledged row, in order
    assert _by_writer(rows, 1) == list(range(60))
    assert ray.get(server.num_added.remote()) == 348
    survivor.close()


def test_a_writer_killed_while_streaming_leaves_whole_chunks_in_order(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(20_000))
    doomed = ray.remote(_Producer).options(max_concurrency=2).remote(server, 50)
    ref = doomed.add.remote(0, 0, [7] * 2000)
    acknowledged = 0
    while acknowledged < 500:
        acknowledged = ray.get(doomed.counts.remote())[1]
    kill_and_wait(ray, doomed, lambda: doomed.counts.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ref, timeout=30)
    # a chunk it had sent may still land after its death: read until nothing changes
    while True:
        before = ray.get(server.num_added.remote())
        rows = _rows(ray, server)
        if ray.get(server.num_added.remote()) == before:
            break
    seqs = _by_writer(rows, 0)
    assert seqs == list(range(len(seqs)))  # a prefix, in order
    assert len(seqs) >= acknowledged and len(seqs) % 50 == 0  # whole chunks only


def test_close_flushes_and_max_delay_sends_a_partial_chunk(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(1000))
    with ReplayWriter(server, chunk_size=100, max_delay=None) as writer:
        writer.add(make_batch(0, 0, 30))
        time.sleep(0.3)
        assert ray.get(server.num_added.remote()) == 0  # no delay limit: held until flushed
        assert writer.num_unacknowledged == 30
    assert writer.num_acknowledged == 30 and ray.get(server.num_added.remote()) == 30
    with pytest.raises(RuntimeError, match="closed"):
        writer.add(make_batch(0, 30, 1))
    writer.close()  # idempotent

    timed = ReplayWriter(server, chunk_size=100, max_delay=0.05)
    timed.add(make_batch(1, 0, 7))  # no further call: the background thread sends it
    deadline = time.monotonic() + 60.0
    while ray.get(server.num_added.remote()) < 37:
        assert time.monotonic() < deadline, "max_delay never sent the partial chunk"
        time.sleep(0.01)
    assert _by_writer(_rows(ray, server), 1) == list(range(7))
    timed.close()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(timed)


def test_bad_arguments_are_refused_before_anything_is_sent(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(1000))
    for kwargs, error, match in [
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=2.0), TypeError, "chunk_size"),
        (dict(chunk_size=True), TypeError, "chunk_size"),
        (dict(max_delay=0.0), ValueError, "max_delay"),
        (dict(max_delay=float("nan")), ValueError, "max_delay"),
        (dict(timeout=-1.0), ValueError, "timeout"),
        (dict(interrupt=3), TypeError, "interrupt"),
    ]:
        with pytest.raises(error, match=match):
            ReplayWriter(server, **kwargs)
    for target in (None, ReplayServer(SimpleReplayBuffer(10)), RateLimiter.remote(1, 1.0, 1.0)):
        with pytest.raises(TypeError, match="actor handle of a ReplayServer"):
            ReplayWriter(target)
    limiter = RateLimiter.remote(min_size_to_sample=1, samples_per_insert=4.0, error_buffer=100.0)
    replay = ShardedReplay([SimpleReplayBuffer(100)], rate_limiter=limiter)
    assert ray.get(limiter.max_insert.remote()) == 50  # 4 n <= 2 * 100
    with pytest.raises(ValueError, match="chunk_size must be <= 50"):
        replay.writer(chunk_size=51)
    with pytest.raises(ValueError, match="shard"):
        replay.writer(shard=1)
    assert replay.writer(chunk_size=50).chunk_size == 50

    writer = ReplayWriter(server, chunk_size=10, max_delay=None)
    writer.add(make_batch(0, 0, 4))
    bad = [
        ("not a batch", None, TypeError, "TransitionBatch"),
        (make_batch(0, 4, 3).replace(S=np.zeros((3, 5), np.float32)), None, ValueError, "S"),
        (make_batch(0, 4, 3).replace(A=np.zeros(3, np.int64)), None, TypeError, "A"),
        (make_batch(0, 4, 3).replace(W=np.ones(3, np.float32)), None, ValueError, "structure"),
        (make_batch(0, 4, 3), np.ones(2), ValueError, "Adv must have shape"),
        (make_batch(0, 4, 3), [1.0, np.nan, 1.0], ValueError, "finite"),
        (make_batch(0, 4, 3), np.array(["a", "b", "c"]), TypeError, "numeric"),
    ]
    for batch, adv, error, match in bad:
        with pytest.raises(error, match=match):
            writer.add(batch, adv)
        assert (writer.num_added, writer.num_unacknowledged) == (4, 4)  # nothing taken
    assert ray.get(server.num_added.remote()) == 0  # nothing sent
    writer.add(make_batch(0, 4, 3))
    assert writer.flush() == 7
    assert _by_writer(_rows(ray, server), 0) == list(range(7))
    writer.close()


def test_server_errors_surface_at_the_next_call(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(100))
    ray.get(server.add.remote(make_batch(0, 0, 2)))
    writer = ReplayWriter(server, chunk_size=10, max_delay=None)
    odd = make_batch(1, 0, 3).replace(S=np.zeros((3, 3), np.float32))  # the buffer holds (2,)
    writer.add(odd)
    with pytest.raises(ValueError):
        writer.flush()  # the server refused the chunk: its rows are dropped, nothing added
    assert (writer.num_acknowledged, writer.num_unacknowledged) == (0, 0)
    assert ray.get(server.num_added.remote()) == 2

    writer = ReplayWriter(server, chunk_size=10, max_delay=None)
    writer.add(make_batch(2, 0, 3))
    kill_and_wait(ray, server, lambda: server.size.remote())
    with pytest.raises(ReplayShardError, match="died"):
        writer.flush()
    with pytest.raises(ReplayShardError, match="died"):
        ReplayWriter(server)


def test_insert_limits_in_process():
    assert ReplayServer(SimpleReplayBuffer(4)).insert_limit() is None
    for spi, error_buffer in [(0.1, 1.5), (3.0, 4.0), (4.0, 100.0), (0.3, 1.0)]:
        limiter = RateLimiter(1, spi, error_buffer)
        n = limiter.max_insert()
        with pytest.raises(ValueError, match="can never fit"):
            limiter.insert(n + 1, timeout=0)
        try:
            limiter.insert(n, timeout=0)  # fits in the window (allowed now or later)
        except TimeoutError:
            pass
