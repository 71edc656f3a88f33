"""ReplayWriter on a real local Ray cluster: chunked adds against direct adds, a writer killed
mid-chunk, flushing on close and after max_delay, and refused arguments."""

import itertools
import pickle
import threading
import time

import numpy as np
import pytest

from coax_utils.distributed import RateLimiter, ReplayServer, ReplayShardError, ShardedReplay
from coax_utils.distributed._writer import ReplayWriter
from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer
from tests.distributed._data import keys, kill_and_wait, make_batch


class _Producer:
    """A writer process: adds numbered batches through a ReplayWriter, or directly."""

    def open(self, target, chunk_size, max_delay=None):
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

    def direct(self, target, writer_id, sizes):
        import ray

        start = 0
        for size in sizes:
            ray.get(target.add.remote(make_batch(writer_id, start, size)))
            start += size
        return start


@pytest.fixture(scope="module")
def shared(ray_cluster):
    """One prioritized server and two writer processes for the tests of this module (each
    test writes under writer ids of its own): every actor started costs seconds."""
    ray = ray_cluster
    server = ReplayServer.remote(PrioritizedReplayBuffer(50_000, alpha=1.0, random_seed=0))
    producers = [ray.remote(_Producer).remote() for _ in (0, 1)]  # one call at a time
    yield server, producers
    for actor in (server, *producers):
        ray.kill(actor)


def _rows(ray, server):
    """The (writer, seq) keys a server holds, in the buffer's insertion order."""
    return [k for tr in ray.get(server.snapshot.remote()) for k in keys(tr.S)]


def _by_writer(rows, writer_id):
    return [seq for w, seq in rows if w == writer_id]


def test_chunked_writers_add_what_direct_adds_add_in_order_within_the_limiter_band(
    ray_cluster, shared
):
    ray = ray_cluster
    direct, producers = shared
    rng = np.random.default_rng(0)
    sizes = {w: rng.integers(1, 40, size=20).tolist() for w in (0, 1)}  # uneven batches
    totals = {w: sum(s) for w, s in sizes.items()}
    spi, min_size, error_buffer = 1.0, 100, 200.0
    limiter = RateLimiter.remote(min_size, spi, error_buffer)
    chunked = ShardedReplay([SimpleReplayBuffer(2000, random_seed=1)], rate_limiter=limiter)
    with pytest.raises(ValueError, match="chunk_size must be <= 400"):  # 1.0 n <= 2 * 200
        chunked.writer(chunk_size=401)
    with pytest.raises(TypeError, match="actor handle of a ReplayServer"):
        ReplayWriter(limiter)
    ray.get([p.open.remote(chunked.shards[0], 64) for p in producers])
    refs = [p.add.remote(w, 0, sizes[w]) for w, p in enumerate(producers)]
    refs += [producers[w].flush.remote() for w in (0, 1)]
    directs = [producers[w].direct.remote(direct, 10 + w, sizes[w]) for w in (0, 1)]
    worst, sampled = 0.0, 0
    # the learner samples while inserts are still to come (each one lets it go on)
    while ray.get(limiter.counts.remote())["inserts"] < totals[0] + totals[1]:
        batch = chunked.sample(16, timeout=60)
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
        assert _by_writer(rows, w) == _by_writer(expected, 10 + w) == list(range(totals[w]))
    # one buffer add per chunk: a chunk of one writer is never interleaved with the other's
    runs = [len(list(g)) for _, g in itertools.groupby(w for w, _ in rows)]
    assert sum(runs) == len(rows) and all(r >= 64 for r in runs[:-2])
    for actor in (limiter, *chunked.shards):
        ray.kill(actor)


def test_priorities_travel_with_their_rows(ray_cluster, shared):
    ray = ray_cluster
    server, _ = shared
    writer = ReplayWriter(server, chunk_size=8, max_delay=None)
    writer.add(make_batch(20, 0, 5), np.arange(5) + 1.0)
    writer.add(make_batch(20, 5, 3))  # no Adv: the largest priority so far, in its own chunk
    writer.add(make_batch(20, 8, 4), -np.arange(4) - 1.0)
    assert writer.flush() == 12
    writer.close()
    buffer = ray.get(server.snapshot.remote())
    got = {}
    for tr in buffer:
        (w, seq), p = keys(tr.S)[0], buffer.priorities(tr.idx)[0]
        if w == 20:
            got[seq] = p
    assert sorted(got) == list(range(12))
    for seq, adv in zip([0, 1, 2, 3, 4, 8, 9, 10, 11], [1, 2, 3, 4, 5, 1, 2, 3, 4]):
        assert got[seq] == pytest.approx(adv + buffer.epsilon)
    assert got[5] == got[6] == got[7] >= got[4]  # the largest priority at their add


def test_a_writer_killed_mid_chunk_loses_only_its_unacknowledged_rows(ray_cluster, shared):
    ray = ray_cluster
    server, _ = shared
    survivor = ReplayWriter(server, chunk_size=50, max_delay=None)
    survivor.add(make_batch(31, 0, 20))
    doomed = ray.remote(_Producer).remote()
    ray.get(doomed.open.remote(server, 100))
    # 288 rows: two full chunks sent; flush sends the other 88 and waits for all of them
    ray.get(doomed.add.remote(30, 0, [32] * 9))
    assert ray.get(doomed.flush.remote()) == 288
    # 96 more rows stay in the open chunk (< 100): unflushed when the process dies
    assert ray.get(doomed.add.remote(30, 288, [32] * 3)) == (384, 288, 96)
    kill_and_wait(ray, doomed, lambda: doomed.counts.remote())
    survivor.add(make_batch(31, 20, 40))
    assert survivor.flush() == 60
    rows = _rows(ray, server)
    assert _by_writer(rows, 30) == list(range(288))  # every acknowledged row, in order
    assert _by_writer(rows, 31) == list(range(60))
    survivor.close()


def test_a_writer_killed_while_streaming_leaves_whole_chunks_in_order(ray_cluster, shared):
    ray = ray_cluster
    server, _ = shared
    doomed = ray.remote(_Producer).options(max_concurrency=2).remote()
    ray.get(doomed.open.remote(server, 50))
    ref = doomed.add.remote(40, 0, [7] * 2000)
    acknowledged = 0
    while acknowledged < 300:
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
    seqs = _by_writer(rows, 40)
    assert seqs == list(range(len(seqs)))  # a prefix, in order
    assert len(seqs) >= acknowledged and len(seqs) % 50 == 0  # whole chunks only


def test_close_flushes_and_max_delay_sends_a_partial_chunk(ray_cluster, shared):
    ray = ray_cluster
    server, _ = shared
    before = ray.get(server.num_added.remote())
    with ReplayWriter(server, chunk_size=100, max_delay=None) as writer:
        writer.add(make_batch(50, 0, 30))
        time.sleep(0.3)
        assert ray.get(server.num_added.remote()) == before  # held until flushed
        assert writer.num_unacknowledged == 30
    assert writer.num_acknowledged == 30
    assert _by_writer(_rows(ray, server), 50) == list(range(30))
    with pytest.raises(RuntimeError, match="closed"):
        writer.add(make_batch(50, 30, 1))
    writer.close()  # idempotent

    timed = ReplayWriter(server, chunk_size=100, max_delay=0.05)
    timed.add(make_batch(51, 0, 7))  # no further call: the background thread sends it
    deadline = time.monotonic() + 60.0
    while ray.get(server.num_added.remote()) < before + 37:
        assert time.monotonic() < deadline, "max_delay never sent the partial chunk"
        time.sleep(0.01)
    assert _by_writer(_rows(ray, server), 51) == list(range(7))
    timed.close()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(timed)


def test_bad_arguments_are_refused_before_anything_is_sent(ray_cluster, shared):
    ray = ray_cluster
    server, producers = shared
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
    for target in (None, ReplayServer(SimpleReplayBuffer(10)), producers[0]):
        with pytest.raises(TypeError, match="actor handle of a ReplayServer"):
            ReplayWriter(target)

    before = ray.get(server.num_added.remote())
    writer = ReplayWriter(server, chunk_size=10, max_delay=None)
    writer.add(make_batch(60, 0, 4))
    bad = [
        ("not a batch", None, TypeError, "TransitionBatch"),
        (make_batch(60, 4, 3).replace(S=np.zeros((3, 5), np.float32)), None, ValueError, "S"),
        (make_batch(60, 4, 3).replace(A=np.zeros(3, np.int64)), None, TypeError, "A"),
        (make_batch(60, 4, 3).replace(W=np.ones(3, np.float32)), None, ValueError, "structure"),
        (make_batch(60, 4, 3), np.ones(2), ValueError, "Adv must have shape"),
        (make_batch(60, 4, 3), [1.0, np.nan, 1.0], ValueError, "finite"),
        (make_batch(60, 4, 3), np.array(["a", "b", "c"]), TypeError, "numeric"),
    ]
    for batch, adv, error, match in bad:
        with pytest.raises(error, match=match):
            writer.add(batch, adv)
        assert (writer.num_added, writer.num_unacknowledged) == (4, 4)  # nothing taken
    assert ray.get(server.num_added.remote()) == before  # nothing sent
    writer.add(make_batch(60, 4, 3))
    assert writer.flush() == 7
    assert _by_writer(_rows(ray, server), 60) == list(range(7))
    writer.close()


def test_a_stop_flag_interrupts_a_writer_held_by_the_rate_limiter(ray_cluster):
    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=10, samples_per_insert=1.0, error_buffer=10.0)
    replay = ShardedReplay([SimpleReplayBuffer(100)], rate_limiter=limiter)
    stop = threading.Event()
    writer = replay.writer(chunk_size=10, max_delay=None, interrupt=stop.is_set)
    assert writer.timeout is None  # the client's timeout plus insert_timeout (None)
    # inserts run up to 20 (r I - S <= r m + e): chunk 3 waits at the limiter, chunk 4 is
    # held back, and a fifth full chunk makes add wait until the stop flag is raised
    threading.Timer(0.5, stop.set).start()
    writer.add(make_batch(70, 0, 50))
    assert stop.is_set() and writer.num_acknowledged == 20 and writer.num_unacknowledged == 30
    with pytest.raises(TimeoutError, match="interrupted"):
        writer.flush()
    stop.clear()
    with pytest.raises(TimeoutError, match="did not come within 0.2 s"):
        writer.flush(timeout=0.2)
    for _ in range(3):  # the learner samples: the held chunks go in, in order
        replay.sample(10, timeout=30)
    assert writer.flush(timeout=60) == 50
    writer.close()
    assert _by_writer(_rows(ray, replay.shards[0]), 70) == list(range(50))
    for actor in (limiter, *replay.shards):
        ray.kill(actor)


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
