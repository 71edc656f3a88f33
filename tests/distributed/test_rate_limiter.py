"""RateLimiter on a real local Ray cluster: waits, time-outs, and with replay shards."""

import time

import numpy as np
import pytest

from coax_utils.distributed import RateLimiter, ShardedReplay
from coax_utils.replay import SimpleReplayBuffer
from tests.distributed._data import kill_and_wait, make_batch


def _pending(ray, ref, seconds=0.5):
    ready, _ = ray.wait([ref], timeout=seconds)
    return not ready


def test_samples_wait_for_min_size_and_the_ratio(ray_cluster):
    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=10, samples_per_insert=2.0, error_buffer=20.0)
    with pytest.raises(TimeoutError, match="a sample of 1 transitions waited"):
        ray.get(limiter.sample.remote(1, 0.2))  # fewer than min_size_to_sample inserted
    ray.get(limiter.insert.remote(10))
    ray.get(limiter.sample.remote(20, 0))  # 2 * 10 - 20 = 0 >= 2 * 10 - 20
    with pytest.raises(TimeoutError, match="inserts=10, samples=20"):
        ray.get(limiter.sample.remote(1, 0.2))  # sampling would run ahead
    assert ray.get(limiter.counts.remote()) == {"inserts": 10, "samples": 20}

    # a waiting sample proceeds once enough is inserted
    waiting = limiter.sample.remote(4, 30)
    assert _pending(ray, waiting)
    ray.get(limiter.insert.remote(2))
    ray.get(waiting, timeout=10)
    assert ray.get(limiter.counts.remote()) == {"inserts": 12, "samples": 24}


def test_inserts_wait_while_they_run_ahead(ray_cluster):
    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=10, samples_per_insert=2.0, error_buffer=20.0)
    ray.get(limiter.insert.remote(20))  # 2 * 20 - 0 = 40 <= 2 * 10 + 20
    with pytest.raises(TimeoutError, match="an insert|a insert"):
        ray.get(limiter.insert.remote(1, 0.2))
    waiting = limiter.insert.remote(3, 30)
    assert _pending(ray, waiting)
    ray.get(limiter.sample.remote(5))  # 2 * 23 - 5 = 41 > 40: still waits
    assert _pending(ray, waiting, 0.3)
    ray.get(limiter.sample.remote(1))  # 46 - 6 = 40: allowed
    ray.get(waiting, timeout=10)
    assert ray.get(limiter.counts.remote()) == {"inserts": 23, "samples": 6}


def test_argument_errors():
    with pytest.raises(ValueError, match="min_size_to_sample"):
        RateLimiter.remote(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="samples_per_insert"):
        RateLimiter(1, 0.0, 1.0)
    with pytest.raises(ValueError, match="error_buffer must be >= max"):
        RateLimiter(1, 4.0, 2.0)
    with pytest.raises(TypeError, match="min_size_to_sample"):
        RateLimiter(1.5, 1.0, 1.0)
    limiter = RateLimiter(1, 1.0, 4.0)
    with pytest.raises(ValueError, match="can never fit"):
        limiter.sample(9)
    with pytest.raises(ValueError, match="timeout"):
        limiter.insert(1, timeout=-1.0)
    with pytest.raises(ValueError, match="cannot release"):
        limiter.release_inserts(1)
    assert limiter.counts() == {"inserts": 0, "samples": 0}


def test_shard_adds_and_client_samples_follow_the_limiter(ray_cluster):
    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=8, samples_per_insert=1.0, error_buffer=16.0)
    replay = ShardedReplay(
        [SimpleReplayBuffer(100, random_seed=s) for s in (1, 2)], rate_limiter=limiter
    )
    with pytest.raises(TimeoutError, match="fewer|a sample of 4"):
        replay.sample(4, timeout=0.2)
    replay.add(make_batch(0, 0, 8))
    replay.add(make_batch(0, 8, 8))  # inserts 16: 16 - 0 <= 8 + 16
    blocked = replay.add(make_batch(0, 16, 16), wait=False)  # 32 - 0 > 24: waits
    assert _pending(ray, blocked)
    assert replay.size() == 16
    replay.sample(8, timeout=5)  # 32 - 8 = 24: the add may go on
    assert ray.get(blocked, timeout=10) == 16
    assert replay.size() == 32
    # a batch the buffer rejects gives its insert permission back
    replay.sample(8, timeout=5)  # room for 4 more inserts: 36 - 16 <= 24
    bad = make_batch(0, 0, 4).replace(S=np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="shape"):
        replay.add(bad)
    assert ray.get(limiter.counts.remote()) == {"inserts": 32, "samples": 16}
    # one shard behind the limiter works the same
    single = ShardedReplay([SimpleReplayBuffer(10)], rate_limiter=limiter, insert_timeout=0.2)
    tic = time.monotonic()
    with pytest.raises(TimeoutError, match="rate limiter"):
        single.add(make_batch(0, 0, 9))  # 41 - 16 > 24
    assert time.monotonic() - tic < 10


def test_a_rejected_batch_never_lets_a_waiting_sample_through(ray_cluster):
    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=8, samples_per_insert=1.0, error_buffer=8.0)
    replay = ShardedReplay(
        [SimpleReplayBuffer(100, random_seed=s) for s in (1, 2)], rate_limiter=limiter
    )
    replay.add(make_batch(0, 0, 8))
    replay.add(make_batch(0, 8, 8))
    replay.sample(16, timeout=5)  # 16 - 16 = 0 = r m - e: the next sample waits
    waiting = replay.sample_async(8, timeout=2.0)
    time.sleep(0.5)
    assert not waiting.done()
    bad = make_batch(0, 0, 8).replace(S=np.zeros((8, 5), np.float32))
    with pytest.raises(ValueError, match="shape"):
        replay.add(bad)
    with pytest.raises(TimeoutError, match="a sample of 8"):
        waiting.result()  # the rejected batch's permission did not count as inserted
    assert ray.get(limiter.counts.remote()) == {"inserts": 16, "samples": 16}
    replay.add(make_batch(0, 16, 8))
    assert replay.sample(8, timeout=5).batch_size == 8


def test_adds_waiting_for_the_limiter_do_not_starve_the_samples_that_free_them(ray_cluster):
    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=4, samples_per_insert=1.0, error_buffer=8.0)
    replay = ShardedReplay([SimpleReplayBuffer(1000)], rate_limiter=limiter, timeout=20)
    # the shard is up before the clock starts: the deadlines time the adds and samples, not
    # the start of a worker process on a loaded machine
    assert replay.size() == 0
    # more waiting adds than the shard has threads (a writer that does not wait for acks)
    refs = [replay.add(make_batch(0, 4 * i, 4), wait=False) for i in range(24)]
    deadline = time.monotonic() + 20
    while ray.get(limiter.counts.remote())["inserts"] < 12:  # 3 adds allowed: 12 <= 4 + 8
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tic = time.monotonic()
    for _ in range(21):  # each sample of 4 lets one more add of 4 in
        assert replay.sample(4, timeout=10).batch_size == 4
    assert time.monotonic() - tic < 20
    assert ray.get(refs, timeout=20) == [4] * 24
    assert replay.size() == 96


def test_reserved_inserts_hold_back_inserts_but_not_samples():
    limiter = RateLimiter(min_size_to_sample=2, samples_per_insert=1.0, error_buffer=4.0)
    limiter.reserve_inserts(2)
    with pytest.raises(TimeoutError, match="a sample of 1"):
        limiter.sample(1, timeout=0)  # reserved inserts are not in the buffer yet
    limiter.reserve_inserts(4)  # 6 - 0 <= 2 + 4
    with pytest.raises(TimeoutError, match="a reserved insert of 1"):
        limiter.reserve_inserts(1, timeout=0)
    with pytest.raises(ValueError, match="cannot confirm 7"):
        limiter.confirm_inserts(7)
    limiter.confirm_inserts(2)
    limiter.release_inserts(4)
    assert limiter.counts() == {"inserts": 2, "samples": 0}
    limiter.sample(2, timeout=0)
    with pytest.raises(ValueError, match="cannot release 1 inserts: only 0 reserved"):
        limiter.release_inserts(1)


def test_a_killed_limiter_is_named_on_the_next_sample_and_add(ray_cluster):
    from coax_utils.distributed import PrefetchingSampler, ReplayShardError

    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=4, samples_per_insert=1.0, error_buffer=64.0)
    replay = ShardedReplay(
        [SimpleReplayBuffer(100, random_seed=s) for s in (1, 2)], rate_limiter=limiter, timeout=20
    )
    replay.add(make_batch(0, 0, 16))
    replay.add(make_batch(0, 16, 16))
    assert replay.sample(8, timeout=5).batch_size == 8  # the permission and the draws: one trip
    tic = time.monotonic()
    kill_and_wait(ray, limiter, limiter.counts.remote)
    with pytest.raises(ReplayShardError, match="the rate limiter died"):
        replay.sample(8, timeout=5)
    with PrefetchingSampler(replay, 8, timeout=5) as sampler:
        with pytest.raises(ReplayShardError, match="the rate limiter died"):
            sampler.sample()
    # a writer's add waits for the limiter inside the shard: the same error reaches it
    with pytest.raises(ReplayShardError, match="^the rate limiter died"):
        replay.add(make_batch(0, 32, 4))
    assert time.monotonic() - tic < 30.0  # no hang
    assert ray.get(replay.shards[0].totals.remote())["size"] == 16  # the shard is alive


def test_closing_a_prefetching_sampler_wakes_a_sample_waiting_in_another_thread(ray_cluster):
    # the samples wait at the limiter (too few inserts): close() from another thread used to
    # end the background thread without waking the waiting sample(), which hung forever
    import threading

    from coax_utils.distributed import PrefetchingSampler

    limiter = RateLimiter.remote(min_size_to_sample=100, samples_per_insert=1.0, error_buffer=64.0)
    replay = ShardedReplay([SimpleReplayBuffer(50)], rate_limiter=limiter, timeout=60.0)
    replay.add(make_batch(0, 0, 4))
    sampler = PrefetchingSampler(replay, 4, num_in_flight=1, timeout=None)
    outcome = []

    def wait_for_a_batch():
        try:
            sampler.sample()
        except RuntimeError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_a_batch, daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not outcome  # waiting for a batch that cannot come yet
    sampler.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and "closed" in str(outcome[0])


def test_closing_a_prefetching_sampler_ends_its_thread_while_the_limiter_holds_a_sample(
    ray_cluster,
):
    # timeout=None: the background thread's request waits at the limiter for inserts that
    # never come; close() must not leave that thread (and its requests) behind for good
    import threading

    from coax_utils.distributed import PrefetchingSampler

    limiter = RateLimiter.remote(min_size_to_sample=100, samples_per_insert=1.0, error_buffer=64.0)
    replay = ShardedReplay([SimpleReplayBuffer(50)], rate_limiter=limiter, timeout=60.0)
    replay.add(make_batch(0, 0, 4))
    before = set(threading.enumerate())
    sampler = PrefetchingSampler(replay, 4, num_in_flight=2, timeout=None)
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "prefetch"]
    sampler.close()
    assert not thread.is_alive()  # close() returns once the thread ended


def test_a_prefetching_sampler_keeps_the_client_time_limit_on_an_unresponsive_limiter(
    ray_cluster,
):
    # 80 samples waiting without limit take every one of the limiter's 64 threads, so the
    # sampler's request is not even read: the client's limit (timeout + the sampler's) must
    # fire. (Ray does not promise threaded actors run calls in order: should the request
    # overtake 17 earlier ones and get a thread, the limiter's own 0.5 s limit fires.)
    from coax_utils.distributed import PrefetchingSampler

    ray = ray_cluster
    limiter = RateLimiter.remote(min_size_to_sample=100, samples_per_insert=1.0, error_buffer=64.0)
    replay = ShardedReplay([SimpleReplayBuffer(50)], rate_limiter=limiter, timeout=1.0)
    replay.add(make_batch(0, 0, 4))
    blocked = [limiter.sample.remote(1, None) for _ in range(80)]
    with PrefetchingSampler(replay, 4, num_in_flight=1, timeout=0.5) as sampler:
        with pytest.raises(TimeoutError, match="the rate limiter did not answer within|waited"):
            sampler.sample()
    ray.kill(limiter)
    del blocked
