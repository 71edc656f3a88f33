"""Distributed replay on a local Ray cluster: write throughput and learner sample latency.

Measured, round robin within each table, medians with min-max over the repetitions:

1. Transitions per second into a :class:`~coax_utils.distributed.ReplayServer` (wrapping a
   PrioritizedReplayBuffer) from 1 and 2 writer actors pushing ready-made batches of 32
   CartPole-shaped transitions with up to 2 calls in flight (how RolloutWorker pushes),
   against
   - a bare Ray actor whose ``add`` only counts (the floor set by Ray's transport),
   - the blocking pattern of coax's ``Worker.buffer_add`` (``ray.get`` on every add, one
     call in flight) into the same server,
   - ``buffer.add`` in this process (no Ray: what the buffer itself takes).
2. Transitions per second from 1 and 2 :class:`~coax_utils.distributed.RolloutWorker`
   actors stepping CartPole-v1 with a uniform random policy (env-bound), against a plain
   gymnasium loop in this process.
3. Learner ``ray.get(server.sample.remote(64))`` latency with 0, 1 and 2 writers pushing,
   against ``buffer.sample(64)`` in this process.
4. Scaling out (``--sharded`` runs only these): the learner's wait per step with a
   :class:`~coax_utils.distributed.PrefetchingSampler` (2 requests in flight, a 5 ms
   simulated training step) against the plain sample round trip, with 2 writers adding;
   insert throughput of 2 writers into a :class:`~coax_utils.distributed.ShardedReplay`
   of 2 shards against 1 shard; and the samples-per-insert ratio a
   :class:`~coax_utils.distributed.RateLimiter` holds while writers and learner run at
   different speeds.

Every variant is checked: the server counts exactly the transitions the writers pushed, and
sampled batches hold pushed transitions.

Run: ``python benchmarks/bench_distributed.py`` (``--quick`` for a few-second smoke run,
``--sharded`` for section 4 only, ``--ratio-seconds`` for the length of its ratio run).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import ray

from coax_utils.distributed import (
    PrefetchingSampler,
    RateLimiter,
    ReplayServer,
    RolloutWorker,
    ShardedReplay,
)
from coax_utils.replay import PrioritizedReplayBuffer, TransitionBatch

BATCH = 32
SAMPLE = 64
CAPACITY = 2**17


def make_batch(seed: int, size: int = BATCH) -> TransitionBatch:
    rng = np.random.default_rng(seed)
    S = rng.normal(size=(size, 4)).astype(np.float32)
    return TransitionBatch(
        S=S,
        A=rng.integers(2, size=size),
        logP=np.zeros(size, np.float32),
        Rn=np.ones(size, np.float32),
        In=np.full(size, 0.99**3, np.float32),
        S_next=S + 1,
    )


class Sink:
    """The transport floor: an actor whose add only counts."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, transition_batch, Adv=None):
        self.n += transition_batch.batch_size
        return transition_batch.batch_size

    def num_added(self):
        return self.n


class Writer:
    """Pushes one ready-made batch again and again (max ``in_flight`` unacknowledged)."""

    def __init__(self, seed: int) -> None:
        self.batch = make_batch(seed)

    def push(self, target, num_batches: int, in_flight: int) -> int:
        refs: collections.deque = collections.deque()
        for _ in range(num_batches):
            refs.append(target.add.remote(self.batch))
            while len(refs) > in_flight:
                ray.get(refs.popleft())
        ray.get(list(refs))
        return num_batches * self.batch.batch_size

    def stream(self, target, seconds: float, in_flight: int = 2) -> int:
        n, stop = 0, time.perf_counter() + seconds
        while time.perf_counter() < stop:
            n += self.push(target, 8, in_flight)
        return n

    def paced(self, target, seconds: float, pause: float) -> int:
        """Push one batch, then sleep ``pause`` (a slower env), for ``seconds``."""
        n, stop = 0, time.perf_counter() + seconds
        while time.perf_counter() < stop:
            n += self.push(target, 1, 1)
            time.sleep(pause)
        return n


def uniform(params, s, rng):
    return int(rng.integers(2))


def summarize(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt_rate(values: list[float]) -> str:
    med, lo, hi = summarize(values)
    return f"{med:10,.0f}  ({lo:,.0f} - {hi:,.0f})"


def fmt_time(values: list[float]) -> str:
    med, lo, hi = summarize([v * 1e6 for v in values])
    return f"{med:8.0f} us  ({lo:.0f} - {hi:.0f})"


def bench_writes(reps: int, num_batches: int) -> None:
    server = ReplayServer.remote(PrioritizedReplayBuffer(CAPACITY, random_seed=0))
    blocking_server = ReplayServer.remote(PrioritizedReplayBuffer(CAPACITY, random_seed=0))
    threaded = ReplayServer.options(max_concurrency=4).remote(
        PrioritizedReplayBuffer(CAPACITY, random_seed=0)
    )
    sink = ray.remote(Sink).remote()
    writers = [ray.remote(Writer).remote(seed) for seed in (1, 2)]
    local = PrioritizedReplayBuffer(CAPACITY, random_seed=0)
    local_batch = make_batch(1)
    local_count = [0]

    def remote_variant(target, num_writers, in_flight, batches):
        def run():
            refs = [w.push.remote(target, batches, in_flight) for w in writers[:num_writers]]
            return sum(ray.get(refs))

        return run

    def local_variant():
        for _ in range(num_batches):
            local.add(local_batch)
        local_count[0] += num_batches * BATCH
        return num_batches * BATCH

    variants = {}
    for k in (1, 2):
        variants[f"ReplayServer, {k} writer(s), 2 in flight"] = (server, k, 2)
        variants[f"bare Ray actor (floor), {k} writer(s)"] = (sink, k, 2)
        variants[f"blocking add (coax.Worker), {k} writer(s)"] = (blocking_server, k, 0)
    variants["ReplayServer max_concurrency=4, 2 writer(s)"] = (threaded, 2, 2)
    runs = {name: remote_variant(t, k, f, num_batches) for name, (t, k, f) in variants.items()}
    runs["buffer.add in-process (no Ray)"] = local_variant
    expected = {server: 0, blocking_server: 0, sink: 0, threaded: 0}

    for run in runs.values():  # warm-up (worker processes, first allocation)
        run()
    for target in expected:
        expected[target] = ray.get(target.num_added.remote())
    rates = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            tic = time.perf_counter()
            n = run()
            rates[name].append(n / (time.perf_counter() - tic))
            if name in variants:
                expected[variants[name][0]] += n
    for target, n in expected.items():  # nothing lost
        assert ray.get(target.num_added.remote()) == n, (n, ray.get(target.num_added.remote()))
    assert len(local) == min(CAPACITY, local_count[0])

    floor = {k: statistics.median(rates[f"bare Ray actor (floor), {k} writer(s)"]) for k in (1, 2)}
    print(f"\nTransitions/s into the server (batches of {BATCH}, CartPole-shaped)")
    print(f"{'variant':45s} {'median (min - max)':>32s}  {'vs floor':>8s}")
    for name, values in rates.items():
        k = 2 if "2 writer" in name else 1
        ratio = statistics.median(values) / floor[k]
        print(f"{name:45s} {fmt_rate(values):>32s}  {ratio:8.2f}")
    for k in (1, 2):
        ours = statistics.median(rates[f"ReplayServer, {k} writer(s), 2 in flight"])
        blocking = statistics.median(rates[f"blocking add (coax.Worker), {k} writer(s)"])
        print(f"ratio ReplayServer / blocking add, {k} writer(s): {ours / blocking:.2f}")
    for actor in [server, blocking_server, threaded, sink, *writers]:
        ray.kill(actor)


def bench_rollouts(reps: int, num_steps: int) -> None:
    import gymnasium

    server = ReplayServer.remote(PrioritizedReplayBuffer(CAPACITY, random_seed=0))
    workers = [
        RolloutWorker.remote("CartPole-v1", uniform, server, 0, n=3, batch_size=BATCH, seed=s)
        for s in (1, 2)
    ]
    env = gymnasium.make("CartPole-v1")
    rng = np.random.default_rng(0)

    def local_loop():
        env.reset(seed=0)
        tic = time.perf_counter()
        for _ in range(num_steps):
            _, _, terminated, truncated, _ = env.step(uniform(None, None, rng))
            if terminated or truncated:
                env.reset()
        return num_steps, time.perf_counter() - tic

    def workers_variant(k):
        def run():
            before = ray.get([w.stats.remote() for w in workers[:k]])
            num_before = ray.get(server.num_added.remote())
            tic = time.perf_counter()
            after = ray.get([w.run.remote(num_steps) for w in workers[:k]])
            elapsed = time.perf_counter() - tic
            added = ray.get(server.num_added.remote()) - num_before
            pushed = sum(
                a["transitions_added"] - b["transitions_added"] for a, b in zip(after, before)
            )
            assert added == pushed > 0, (added, pushed)  # nothing lost
            return added, elapsed

        return run

    runs = {
        "RolloutWorker x1": workers_variant(1),
        "RolloutWorker x2": workers_variant(2),
        "gymnasium loop in-process (env steps/s)": local_loop,
    }
    for run in runs.values():  # warm-up
        run()
    rates = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            n, elapsed = run()
            rates[name].append(n / elapsed)
    sample = ray.get(server.sample.remote(SAMPLE))
    assert set(np.unique(sample.In).tolist()) <= {0.0, float(np.float32(0.99**3))}
    base = statistics.median(rates["gymnasium loop in-process (env steps/s)"])
    print(f"\nTransitions/s from rollout workers (CartPole-v1, random policy, n=3, push {BATCH})")
    print(f"{'variant':45s} {'median (min - max)':>32s}  {'vs loop':>8s}")
    for name, values in rates.items():
        print(f"{name:45s} {fmt_rate(values):>32s}  {statistics.median(values) / base:8.2f}")
    for actor in [server, *workers]:
        ray.kill(actor)


def bench_sample_latency(reps: int, calls: int) -> None:
    buffer = PrioritizedReplayBuffer(CAPACITY, random_seed=0)
    for seed in range(64):
        buffer.add(make_batch(seed, 256))
    server = ReplayServer.remote(buffer)
    threaded = ReplayServer.options(max_concurrency=4).remote(buffer)
    writers = [ray.remote(Writer).remote(seed) for seed in (1, 2)]
    known = {tuple(row) for seed in range(64) for row in make_batch(seed, 256).S.tolist()}
    known |= {tuple(row) for seed in (1, 2) for row in make_batch(seed).S.tolist()}

    def measure(server, num_writers):
        def run():
            seconds = 0.05 + 0.004 * calls
            streams = [w.stream.remote(server, seconds) for w in writers[:num_writers]]
            tic = time.perf_counter()
            for _ in range(calls):
                batch = ray.get(server.sample.remote(SAMPLE))
            elapsed = (time.perf_counter() - tic) / calls
            ray.get(streams)
            assert batch.batch_size == SAMPLE and batch.W.max() == 1.0
            assert all(tuple(row) in known for row in batch.S.tolist())
            return elapsed

        return run

    def local():
        tic = time.perf_counter()
        for _ in range(calls):
            buffer.sample(SAMPLE)
        return (time.perf_counter() - tic) / calls

    runs = {f"server.sample, {k} writer(s) pushing": measure(server, k) for k in (0, 1, 2)}
    runs["same, 2 writers, max_concurrency=4"] = measure(threaded, 2)
    runs["buffer.sample in-process (no Ray)"] = local
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            times[name].append(run())
    for target in (server, threaded):  # the writers did push
        assert ray.get(target.num_added.remote()) > 0
    idle = statistics.median(times["server.sample, 0 writer(s) pushing"])
    print(f"\nLearner sample latency, batch {SAMPLE} from {64 * 256} transitions")
    print(f"{'variant':45s} {'median (min - max)':>32s}  {'vs idle':>8s}")
    for name, values in times.items():
        print(f"{name:45s} {fmt_time(values):>32s}  {statistics.median(values) / idle:8.2f}")
    for actor in [server, threaded, *writers]:
        ray.kill(actor)


def _prefilled_shards(num_shards: int, limiter=None) -> ShardedReplay:
    buffers = [PrioritizedReplayBuffer(CAPACITY, random_seed=i) for i in range(num_shards)]
    replay = ShardedReplay(buffers, rate_limiter=limiter, seed=0)
    for seed in range(16):
        replay.add(make_batch(seed, 256), shard=seed % num_shards)
    return replay


def bench_prefetch(steps: int, train_seconds: float) -> None:
    plain = ReplayServer.remote(PrioritizedReplayBuffer(CAPACITY, random_seed=0))
    for seed in range(16):
        ray.get(plain.add.remote(make_batch(seed, 256)))
    replay = _prefilled_shards(2)
    writers = [ray.remote(Writer).remote(seed) for seed in (1, 2)]
    seconds = steps * (train_seconds + 0.01) + 2

    def with_writers(targets, run):
        streams = [w.stream.remote(t, seconds) for w, t in zip(writers, targets)]
        waits = run()
        ray.get(streams)
        return waits

    def plain_round_trip():
        waits = []
        for _ in range(steps):
            tic = time.perf_counter()
            batch = ray.get(plain.sample.remote(SAMPLE))
            waits.append(time.perf_counter() - tic)
            time.sleep(train_seconds)
        assert batch.batch_size == SAMPLE
        return waits

    def sharded_round_trip():
        waits = []
        for _ in range(steps):
            tic = time.perf_counter()
            batch = replay.sample(SAMPLE)
            waits.append(time.perf_counter() - tic)
            time.sleep(train_seconds)
        assert batch.batch_size == SAMPLE
        return waits

    def prefetched():
        waits = []
        with PrefetchingSampler(replay, SAMPLE, num_in_flight=2) as sampler:
            for _ in range(steps):
                tic = time.perf_counter()
                batch = sampler.sample()
                waits.append(time.perf_counter() - tic)
                time.sleep(train_seconds)
                sampler.update(batch.idx, np.ones(SAMPLE))
        return waits

    results = {
        "plain ReplayServer: ray.get(sample.remote(64))": with_writers(
            [plain, plain], plain_round_trip
        ),
        "ShardedReplay (2 shards): sample(64)": with_writers(replay.shards, sharded_round_trip),
        "PrefetchingSampler (2 in flight) on the shards": with_writers(replay.shards, prefetched),
    }
    base = statistics.median(results["plain ReplayServer: ray.get(sample.remote(64))"])
    print(
        f"\nLearner wait per step, 2 writers adding, {steps} steps of "
        f"{train_seconds * 1e3:.0f} ms simulated training (sleep)"
    )
    print(f"{'variant':50s} {'median (min - max)':>28s}  {'mean':>9s}  {'vs plain':>8s}")
    for name, waits in results.items():
        ratio = statistics.median(waits) / base
        print(f"{name:50s} {fmt_time(waits):>28s}  {np.mean(waits) * 1e6:6.0f} us  {ratio:8.3f}")
    for actor in [plain, *replay.shards, *writers]:
        ray.kill(actor)


def bench_shard_inserts(reps: int, seconds: float) -> None:
    writers = [ray.remote(Writer).remote(seed) for seed in (1, 2)]
    replays = {k: _prefilled_shards(k) for k in (1, 2)}
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(reps):
        for k, replay in replays.items():
            before = replay.num_added()
            tic = time.perf_counter()
            refs = [w.stream.remote(replay.shards[i % k], seconds) for i, w in enumerate(writers)]
            pushed = sum(ray.get(refs))
            elapsed = time.perf_counter() - tic
            assert replay.num_added() - before == pushed  # nothing lost
            rates[k].append(pushed / elapsed)
    print(f"\nInsert throughput, 2 writers (batches of {BATCH}, 2 in flight), writer i -> shard i")
    for k in (1, 2):
        print(f"{k} shard(s){'':38s} {fmt_rate(rates[k]):>32s}")
    print(
        f"ratio 2 shards / 1 shard: {statistics.median(rates[2]) / statistics.median(rates[1]):.2f}"
    )
    for actor in [*writers, *replays[1].shards, *replays[2].shards]:
        ray.kill(actor)


def bench_ratio(seconds: float) -> None:
    spi, min_size, error_buffer = 4.0, 1000, 4.0 * BATCH * 4 + SAMPLE * 3
    print(
        f"\nRate limiter: samples_per_insert={spi}, min_size_to_sample={min_size}, "
        f"error_buffer={error_buffer:.0f}; 2 writers, learner batches of {SAMPLE}"
    )
    for phase, (pause, train) in {
        "writers slow (20 ms/batch), learner fast (1 ms/step)": (0.02, 0.001),
        "writers fast (no pause), learner slow (10 ms/step)": (0.0, 0.01),
    }.items():
        limiter = RateLimiter.remote(min_size, spi, error_buffer)
        buffers = [PrioritizedReplayBuffer(CAPACITY, random_seed=i) for i in range(2)]
        replay = ShardedReplay(buffers, rate_limiter=limiter, seed=0)
        writers = [ray.remote(Writer).remote(seed) for seed in (1, 2)]
        refs = [w.paced.remote(s, seconds + 5, pause) for w, s in zip(writers, replay.shards)]
        worst, steps = 0.0, 0
        with PrefetchingSampler(replay, SAMPLE, num_in_flight=2, timeout=30) as sampler:
            sampler.sample()
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop:
                sampler.update(sampler.sample().idx, np.ones(SAMPLE))
                time.sleep(train)
                steps += 1
                if steps % 20 == 0:
                    c = ray.get(limiter.counts.remote())
                    worst = max(worst, abs(spi * c["inserts"] - c["samples"] - spi * min_size))
            c = ray.get(limiter.counts.remote())
        ratio = c["samples"] / c["inserts"]
        print(
            f"{phase:55s} {seconds:.0f} s: {c['inserts']:7d} inserted, {c['samples']:8d} "
            f"sampled, samples/insert {ratio:.3f} (target {spi}); largest "
            f"|r I - S - r m| seen {worst:.0f} <= error_buffer {error_buffer:.0f}: "
            f"{worst <= error_buffer}"
        )
        for actor in [*writers, *replay.shards, limiter]:
            ray.kill(actor)
        del refs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--sharded", action="store_true", help="only section 4 (scaling out)")
    parser.add_argument("--ratio-seconds", type=float, default=30.0, help="per phase")
    args = parser.parse_args()
    reps = 2 if args.quick else 9
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
    )
    try:
        print(f"Ray {ray.__version__}, {os.cpu_count()} CPUs, local cluster with num_cpus=2")
        if args.sharded or args.quick:
            bench_prefetch(steps=20 if args.quick else 300, train_seconds=0.005)
            bench_shard_inserts(reps if args.quick else 3, seconds=0.5 if args.quick else 3.0)
            bench_ratio(3.0 if args.quick else args.ratio_seconds)
            if args.sharded:
                return
        bench_writes(reps, num_batches=10 if args.quick else 100)
        bench_rollouts(reps, num_steps=100 if args.quick else 1500)
        bench_sample_latency(reps, calls=5 if args.quick else 60)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
