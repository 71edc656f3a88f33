"""Distributed replay on a local Ray cluster: write throughput and learner sample latency.

Measured, round robin within each table, medians with min-max over the repetitions:

1. Transitions per second into a :class:`~coax_utils.distributed.ReplayServer` (wrapping a
   PrioritizedReplayBuffer) from 1 and 2 writer actors pushing ready-made batches of 32
   CartPole-shaped transitions with up to 2 calls in flight (direct adds: how
   RolloutWorker pushed before it sent through a ReplayWriter), against
   - a bare Ray actor whose ``add`` only counts (the floor set by Ray's transport),
   - the blocking pattern of coax's ``Worker.buffer_add`` (``ray.get`` on every add, one
     call in flight) into the same server,
   - ``buffer.add`` in this process (no Ray: what the buffer itself takes).
2. Transitions per second from 1 and 2 :class:`~coax_utils.distributed.RolloutWorker`
   actors stepping CartPole-v1 with a uniform random policy (env-bound), against a plain
   gymnasium loop in this process.
3. Learner ``ray.get(server.sample.remote(64))`` latency with 0, 1 and 2 writers pushing,
   against ``buffer.sample(64)`` in this process.
4. Scaling out (``--sharded`` runs only these; ``--prefetch``, ``--inserts`` and
   ``--ratio`` one part each):

   - the learner's wait per step, with 2 writers adding, of a learner that runs a jitted
     DQN-like update (double-Q TD loss, 3-layer MLP, Adam; a few ms per step) on every
     batch: the plain ``ReplayServer`` sample round trip (the peer), the previous
     two-round-trip sharded sample, ``ShardedReplay.sample`` (one round trip) and a
     :class:`~coax_utils.distributed.PrefetchingSampler` with 1 and 2 requests in flight
     (priority updates sent without waiting);
   - insert throughput of 2 writers into a :class:`~coax_utils.distributed.ShardedReplay`
     of 2 shards against 1 shard, with the CPU the shard, writer and Ray processes used
     (from ``psutil``) and how busy the machine's cores were;
   - the samples-per-insert ratio a :class:`~coax_utils.distributed.RateLimiter` holds over
     one run (60 s by default) whose writers and learner switch speeds half way, against
     the band its error buffer allows.

5. Chunked writes (``--chunked`` runs only these; with ``--inserts`` only the first):

   - CPU per inserted transition (writers, shard and rate limiter processes, from their CPU
     times read with ``psutil``) and insert throughput of 2 writers into one shard, behind a
     rate limiter that never holds inserts back and without one: today's direct adds of
     batches of 32 (2 calls in flight) against a
     :class:`~coax_utils.distributed.ReplayWriter` that buffers the same batches into chunks
     of ``--chunk-sizes`` transitions (one call and one buffer add per chunk);
   - the learner wait per step of part 4 and the rate limiter run of part 4 with the writers
     adding through a ReplayWriter.

Every variant is checked: the server counts exactly the transitions the writers pushed, and
sampled batches hold pushed transitions.

Run: ``python benchmarks/bench_distributed.py`` (``--quick`` for a few-second smoke run,
``--sharded`` for section 4 only, ``--ratio`` for its rate limiter run only,
``--chunked`` for section 5 only,
``--ratio-seconds`` for that run's length).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
    ReplayWriter,
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
    """Pushes one ready-made batch again and again: directly (max ``in_flight`` unacknowledged
    ``add`` calls, today's path), or with ``chunk_size`` through a
    :class:`~coax_utils.distributed.ReplayWriter` (one call per chunk)."""

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

    def _loop(self, target, more, in_flight: int, chunk_size: int | None, pause: float = 0.0):
        """Push batches of 8 (or one, with a pause) while ``more()``; everything acknowledged."""
        n = 0
        if chunk_size is None:
            while more():
                n += self.push(target, 1 if self.paced else 8, in_flight)
                time.sleep(self.pause)
            return n
        with ReplayWriter(target, chunk_size=chunk_size, max_delay=0.1) as writer:
            while more():
                for _ in range(1 if self.paced else 8):
                    writer.add(self.batch)
                    n += self.batch.batch_size
                time.sleep(self.pause)
        return n

    def stream(self, target, seconds: float, in_flight: int = 2, chunk_size=None) -> int:
        stop = time.perf_counter() + seconds
        self.paced, self.pause = False, 0.0
        return self._loop(target, lambda: time.perf_counter() < stop, in_flight, chunk_size)

    def stream_until_stopped(self, target, in_flight: int = 2, chunk_size=None) -> int:
        """Push until :meth:`stop` (needs an actor with ``max_concurrency`` >= 2)."""
        self.stopped, self.paced, self.pause = False, False, 0.0
        return self._loop(target, lambda: not self.stopped, in_flight, chunk_size)

    def stop(self) -> None:
        self.stopped = True

    def paced_until_stopped(self, target, pause: float, chunk_size=None) -> int:
        """Push one batch, then sleep :attr:`pause` (a slower env; :meth:`set_pause` changes
        it), until :meth:`stop` (needs an actor with ``max_concurrency`` >= 2)."""
        self.stopped, self.paced, self.pause = False, True, pause
        return self._loop(target, lambda: not self.stopped, 1, chunk_size)

    def set_pause(self, pause: float) -> None:
        self.pause = pause


def uniform(params, s, rng):
    return int(rng.integers(2))


@contextlib.contextmanager
def local_ray():
    """A local Ray cluster of 2 CPUs in a temp folder, shut down and removed afterwards."""
    import ray

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
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def rates_round_robin(runs: dict, reps: int) -> dict:
    """Per run (a callable returning ``(count, seconds)``), its rates over ``reps`` rounds,
    round robin after one warm-up call each."""
    for run in runs.values():  # warm-up
        run()
    rates = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            n, elapsed = run()
            rates[name].append(n / elapsed)
    return rates


def gymnasium_loop(num_steps: int):
    """A plain gymnasium CartPole-v1 loop with a random policy in this process: a callable
    returning ``(env steps, seconds)``."""
    import gymnasium

    env = gymnasium.make("CartPole-v1")
    rng = np.random.default_rng(0)

    def run():
        env.reset(seed=0)
        tic = time.perf_counter()
        for _ in range(num_steps):
            _, _, terminated, truncated, _ = env.step(uniform(None, None, rng))
            if terminated or truncated:
                env.reset()
        return num_steps, time.perf_counter() - tic

    return run


def workers_run(server, workers: list, num_steps: int):
    """The ``workers`` (RolloutWorker actors) each running ``num_steps`` into ``server``: a
    callable returning ``(transitions added to the server, seconds)``; nothing is lost."""
    import ray

    def run():
        before = ray.get([w.stats.remote() for w in workers])
        num_before = ray.get(server.num_added.remote())
        tic = time.perf_counter()
        after = ray.get([w.run.remote(num_steps) for w in workers])
        elapsed = time.perf_counter() - tic
        added = ray.get(server.num_added.remote()) - num_before
        pushed = sum(a["transitions_added"] - b["transitions_added"] for a, b in zip(after, before))
        assert added == pushed > 0, (added, pushed)  # nothing lost
        return added, elapsed

    return run


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

    server = ReplayServer.remote(PrioritizedReplayBuffer(CAPACITY, random_seed=0))
    workers = [
        RolloutWorker.remote("CartPole-v1", uniform, server, 0, n=3, batch_size=BATCH, seed=s)
        for s in (1, 2)
    ]
    runs = {
        "RolloutWorker x1": workers_run(server, workers[:1], num_steps),
        "RolloutWorker x2": workers_run(server, workers[:2], num_steps),
        "gymnasium loop in-process (env steps/s)": gymnasium_loop(num_steps),
    }
    rates = rates_round_robin(runs, reps)
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


def make_learner(hidden: int = 512, seed: int = 0):
    """A DQN-like learner: one jitted double-Q TD update of a 3-layer MLP (Adam) per batch.

    Returns ``step(batch) -> td_errors`` (NumPy: the call blocks until the update is done).
    """
    import jax
    import jax.numpy as jnp
    import optax

    sizes = [4, hidden, hidden, hidden, 2]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    params = [
        (jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros(n))
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]
    optimizer = optax.adam(1e-4)
    state = {"params": params, "target": params, "opt": optimizer.init(params)}

    def q(params, s):
        for w, b in params[:-1]:
            s = jax.nn.relu(s @ w + b)
        w, b = params[-1]
        return s @ w + b

    def loss(params, target, S, A, Rn, In, S_next, W):
        a_next = jnp.argmax(q(params, S_next), axis=1)
        q_next = jnp.take_along_axis(q(target, S_next), a_next[:, None], axis=1)[:, 0]
        q_sa = jnp.take_along_axis(q(params, S), A[:, None], axis=1)[:, 0]
        td = Rn + In * jax.lax.stop_gradient(q_next) - q_sa
        return jnp.mean(W * td**2), td

    @jax.jit
    def update(state, S, A, Rn, In, S_next, W):
        grads, td = jax.grad(loss, has_aux=True)(
            state["params"], state["target"], S, A, Rn, In, S_next, W
        )
        updates, opt = optimizer.update(grads, state["opt"])
        params = optax.apply_updates(state["params"], updates)
        target = jax.tree_util.tree_map(lambda t, p: 0.99 * t + 0.01 * p, state["target"], params)
        return {"params": params, "target": target, "opt": opt}, td

    def step(batch: TransitionBatch) -> np.ndarray:
        new, td = update(
            state,
            batch.S,
            np.asarray(batch.A, np.int32),
            batch.Rn,
            batch.In,
            batch.S_next,
            np.asarray(batch.W, np.float32),
        )
        state.update(new)
        return np.asarray(td)

    return step


def time_learner(step, reps: int = 50) -> float:
    batch = make_batch(0, SAMPLE).replace(W=np.ones(SAMPLE, np.float32))
    step(batch)  # compile
    tic = time.perf_counter()
    for _ in range(reps):
        step(batch)
    return (time.perf_counter() - tic) / reps


def two_round_trips(replay: ShardedReplay, batch_size: int) -> list:
    """The previous ShardedReplay.sample's traffic: ask every shard's total, then its draws.

    (Only the two round trips, without combining the replies: a lower bound of its cost.)
    """
    totals = ray.get([s.totals.remote() for s in replay.shards])
    T = np.array([t["total"] for t in totals])
    counts = np.random.default_rng().multinomial(batch_size, T / T.sum())
    refs = [s.sample_with_priorities.remote(int(k)) for s, k in zip(replay.shards, counts) if k]
    return ray.get(refs)


def bench_prefetch(steps: int, rounds: int, chunk_size: int | None = None) -> None:
    """``rounds`` times round robin, ``steps`` learner steps of each variant; the writers add
    directly, or through a ReplayWriter with ``chunk_size``."""
    step = make_learner()
    step_seconds = time_learner(step)
    plain = ReplayServer.remote(PrioritizedReplayBuffer(CAPACITY, random_seed=0))
    for seed in range(16):
        ray.get(plain.add.remote(make_batch(seed, 256)))
    replay = _prefilled_shards(2)
    writers = [ray.remote(Writer).options(max_concurrency=2).remote(seed) for seed in (1, 2)]

    def with_writers(targets, run):
        before = ray.get([t.num_added.remote() for t in targets])
        streams = [
            w.stream_until_stopped.remote(t, 2, chunk_size) for w, t in zip(writers, targets)
        ]
        while ray.get([t.num_added.remote() for t in targets]) == before:
            time.sleep(0.01)  # wait until the writers are under way
        waits = run()
        ray.get([w.stop.remote() for w in writers])
        assert min(ray.get(streams)) > 0
        return waits

    def learner_loop(sample, update=None):
        def run():
            waits = []
            for _ in range(steps):
                tic = time.perf_counter()
                batch = sample()
                waits.append(time.perf_counter() - tic)
                td = step(batch)
                assert batch.batch_size == SAMPLE and td.shape == (SAMPLE,)
                if update is not None:
                    update(batch.idx, td)
            return waits

        return run

    def prefetched(num_in_flight):
        def run():
            with PrefetchingSampler(replay, SAMPLE, num_in_flight=num_in_flight) as sampler:
                return learner_loop(sampler.sample, sampler.update)()

        return run

    def two_trips():
        def sample():
            replies = two_round_trips(replay, SAMPLE)
            return TransitionBatch.concatenate(*(r["batch"] for r in replies))

        return learner_loop(sample)()

    plain_name = "plain ReplayServer: ray.get(sample.remote(64))"
    variants = {
        plain_name: ([plain, plain], learner_loop(lambda: ray.get(plain.sample.remote(SAMPLE)))),
        "ShardedReplay (2 shards), two round trips (before)": (replay.shards, two_trips),
        "ShardedReplay (2 shards): sample(64), one round trip": (
            replay.shards,
            learner_loop(lambda: replay.sample(SAMPLE)),
        ),
        "PrefetchingSampler, 1 in flight, updates async": (replay.shards, prefetched(1)),
        "PrefetchingSampler, 2 in flight, updates async": (replay.shards, prefetched(2)),
        "PrefetchingSampler, 4 in flight, updates async": (replay.shards, prefetched(4)),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    for targets, run in variants.values():  # warm-up
        with_writers(targets, run)
    loads = []
    for _ in range(rounds):  # round robin
        for name, (targets, run) in variants.items():
            results[name] += with_writers(targets, run)
        loads.append(os.getloadavg()[0])
    load = (min(loads), max(loads))
    base = statistics.median(results[plain_name])
    print(
        f"\nLearner wait per step, 2 writers adding "
        f"({'directly' if chunk_size is None else f'through ReplayWriter, chunk_size={chunk_size}'}"
        f"), {steps} steps of a jitted DQN update "
        f"({step_seconds * 1e3:.1f} ms per step alone), {rounds} rounds round robin, load "
        f"average {load[0]:.1f} - {load[1]:.1f}"
    )
    print(f"{'variant':52s} {'median (min - max)':>26s}  {'mean':>9s}  {'vs plain':>8s}")
    for name, waits in results.items():
        ratio = statistics.median(waits) / base
        print(f"{name:52s} {fmt_time(waits):>26s}  {np.mean(waits) * 1e6:6.0f} us  {ratio:8.3f}")
    for k in (1, 2, 4):
        waits = results[f"PrefetchingSampler, {k} in flight, updates async"]
        print(
            f"ratio learner wait with prefetch ({k} in flight) / plain sample round trip: "
            f"median {statistics.median(waits) / base:.3f}, mean "
            f"{np.mean(waits) / np.mean(results[plain_name]):.3f} (target <= 0.10)"
        )
    for actor in [plain, *replay.shards, *writers]:
        ray.kill(actor)


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds used so far by the processes of this machine, grouped by role."""
    import psutil

    roles = {
        "shards": 0.0,
        "writers": 0.0,
        "rate limiter": 0.0,
        "ray services": 0.0,
        "driver": 0.0,
        "other": 0.0,
    }
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] == me:
            role = "driver"
        elif "ray::ReplayShard" in cmd:
            role = "shards"
        elif "ray::Writer" in cmd:
            role = "writers"
        elif "ray::RateLimiter" in cmd:
            role = "rate limiter"
        elif any(k in cmd for k in ("raylet", "gcs_server", "ray/_private", "ray::")):
            role = "ray services"
        else:
            role = "other"
        roles[role] += times.user + times.system
    return roles


def bench_shard_inserts(reps: int, seconds: float) -> None:
    import psutil

    writers = [ray.remote(Writer).remote(seed) for seed in (1, 2)]
    replays = {k: _prefilled_shards(k) for k in (1, 2)}
    rates: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    busy: dict[int, list[float]] = {1: [], 2: []}
    loads = []
    for _ in range(reps):
        for k, replay in replays.items():
            before = replay.num_added()
            cpu_before, machine_before = _cpu_by_role(), psutil.cpu_times()
            tic = time.perf_counter()
            refs = [w.stream.remote(replay.shards[i % k], seconds) for i, w in enumerate(writers)]
            pushed = sum(ray.get(refs))
            elapsed = time.perf_counter() - tic
            cpu_after, machine_after = _cpu_by_role(), psutil.cpu_times()
            assert replay.num_added() - before == pushed  # nothing lost
            rates[k].append(pushed / elapsed)
            cpu[k].append({r: (cpu_after[r] - cpu_before[r]) / elapsed for r in cpu_after})
            idle = (machine_after.idle - machine_before.idle) / elapsed
            busy[k].append(psutil.cpu_count() - idle)
            loads.append(os.getloadavg()[0])
    print(
        f"\nInsert throughput, 2 writers (batches of {BATCH}, 2 in flight), writer i -> shard "
        f"i mod k; load average {statistics.median(loads):.1f} (median over the runs)"
    )
    roles = list(cpu[1][0])
    print(
        f"{'':10s} {'transitions/s median (min - max)':>34s}  CPU cores busy, by process "
        f"({', '.join(roles)}; machine)"
    )
    for k in (1, 2):
        used = {r: statistics.median(c[r] for c in cpu[k]) for r in roles}
        shown = ", ".join(f"{used[r]:.2f}" for r in roles)
        print(
            f"{k} shard(s) {fmt_rate(rates[k]):>34s}  {shown}; "
            f"{statistics.median(busy[k]):.2f} of {psutil.cpu_count()}"
        )
    print(
        f"ratio 2 shards / 1 shard: {statistics.median(rates[2]) / statistics.median(rates[1]):.2f}"
        " (target 1.6; one shard's process is the ceiling only while a core is free for it)"
    )
    for actor in [*writers, *replays[1].shards, *replays[2].shards]:
        ray.kill(actor)


def bench_chunked_inserts(reps: int, seconds: float, chunk_sizes: tuple[int, ...]) -> None:
    """CPU per inserted transition and insert throughput: 2 writers into one shard (behind a
    rate limiter, and without one), today's direct adds of 32 (2 in flight) against chunked
    writers."""
    import psutil

    # a limiter that never holds an insert back (its window is far larger than the run), so
    # its CPU per call is measured, not its waits
    limiter = RateLimiter.remote(1, 1e-3, 1e9)
    limited, bare = _prefilled_shards(1, limiter), _prefilled_shards(1)
    writers = [ray.remote(Writer).remote(seed) for seed in (1, 2)]
    today = f"direct adds of {BATCH}, 2 in flight (today)"
    variants = {}
    for replay, where in ((limited, "rate limiter"), (bare, "no limiter")):
        variants[f"{where}: {today}"] = (replay, None)
        for c in chunk_sizes if replay is limited else chunk_sizes[-1:]:
            variants[f"{where}: ReplayWriter, chunk_size={c}"] = (replay, c)
    roles = ("writers", "shards", "rate limiter")
    rates: dict[str, list[float]] = {name: [] for name in variants}
    per_row: dict[str, list[float]] = {name: [] for name in variants}
    by_role: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    loads = []

    def run(replay, chunk_size, seconds):
        before = replay.num_added()
        cpu_before = _cpu_by_role()
        tic = time.perf_counter()
        refs = [w.stream.remote(replay.shards[0], seconds, 2, chunk_size) for w in writers]
        pushed = sum(ray.get(refs))
        elapsed = time.perf_counter() - tic
        cpu_after = _cpu_by_role()
        assert replay.num_added() - before == pushed  # nothing lost
        return pushed, elapsed, {r: cpu_after[r] - cpu_before[r] for r in cpu_after}

    for replay, chunk_size in variants.values():  # warm-up
        run(replay, chunk_size, 0.3)
    for _ in range(reps):
        for name, (replay, chunk_size) in variants.items():
            pushed, elapsed, cpu = run(replay, chunk_size, seconds)
            rates[name].append(pushed / elapsed)
            per_row[name].append(sum(cpu[r] for r in roles) / pushed)
            by_role[name].append({r: cpu[r] / pushed for r in cpu})
            loads.append(os.getloadavg()[0])
    counts = ray.get(limiter.counts.remote())
    assert counts["inserts"] == limited.num_added()  # the limiter counted every row
    print(
        f"\nInserts into one shard, 2 writers pushing batches of {BATCH}, {reps} runs of "
        f"{seconds:g} s round robin; load average {min(loads):.1f} - {max(loads):.1f} "
        f"(median {statistics.median(loads):.1f}), {psutil.cpu_count()} cores"
    )
    print(
        f"{'variant':52s} {'transitions/s (min - max)':>32s} {'x today':>7s}  CPU us per "
        f"transition: {' + '.join(roles)} = total  {'/ today':>7s}"
    )
    for name in variants:
        base = next(n for n in variants if n.endswith(today) and n[:5] == name[:5])
        parts = [statistics.median(c[r] for c in by_role[name]) * 1e6 for r in roles]
        total = statistics.median(per_row[name]) * 1e6
        speed = statistics.median(rates[name]) / statistics.median(rates[base])
        cpu_ratio = statistics.median(per_row[name]) / statistics.median(per_row[base])
        print(
            f"{name:52s} {fmt_rate(rates[name]):>32s} {speed:7.2f}  "
            f"{' + '.join(f'{p:5.2f}' for p in parts)} = {total:6.2f}  {cpu_ratio:7.3f}"
        )
    print("goals: CPU per transition <= 0.25 of today's, throughput >= 3x today's")
    for actor in [*writers, *limited.shards, *bare.shards, limiter]:
        ray.kill(actor)


def bench_ratio(seconds: float, chunk_size: int | None = None) -> None:
    spi, min_size, error_buffer = 4.0, 1000, 4.0 * BATCH * 4 + SAMPLE * 3
    phases = [  # (writers' pause per batch, learner's step time), each half of the run
        ("writers slow (20 ms/batch), learner fast (1 ms/step)", 0.02, 0.001),
        ("writers fast (no pause), learner slow (10 ms/step)", 0.0, 0.01),
    ]
    print(
        f"\nRate limiter: samples_per_insert={spi}, min_size_to_sample={min_size}, "
        f"error_buffer={error_buffer:.0f}; 2 writers ("
        f"{'direct adds' if chunk_size is None else f'ReplayWriter, chunk_size={chunk_size}'}), "
        f"learner batches of {SAMPLE}; one run of "
        f"{seconds:.0f} s, speeds switched half way"
    )
    limiter = RateLimiter.remote(min_size, spi, error_buffer)
    buffers = [PrioritizedReplayBuffer(CAPACITY, random_seed=i) for i in range(2)]
    replay = ShardedReplay(buffers, rate_limiter=limiter, seed=0)
    writers = [ray.remote(Writer).options(max_concurrency=2).remote(seed) for seed in (1, 2)]
    half = seconds / 2
    refs = [
        w.paced_until_stopped.remote(s, phases[0][1], chunk_size)
        for w, s in zip(writers, replay.shards)
    ]
    worst, steps, loads = 0.0, 0, []
    with PrefetchingSampler(replay, SAMPLE, num_in_flight=2, timeout=30) as sampler:
        sampler.sample()  # waits for min_size_to_sample
        start = time.perf_counter()
        for phase, (name, pause, train) in enumerate(phases):
            ray.get([w.set_pause.remote(pause) for w in writers])
            c0 = ray.get(limiter.counts.remote())
            stop = start + half * (phase + 1)
            while time.perf_counter() < stop:
                sampler.update(sampler.sample().idx, np.ones(SAMPLE))
                time.sleep(train)
                steps += 1
                if steps % 5 == 0:
                    c = ray.get(limiter.counts.remote())
                    worst = max(worst, abs(spi * c["inserts"] - c["samples"] - spi * min_size))
            c1 = ray.get(limiter.counts.remote())
            loads.append(os.getloadavg()[0])
            inserted, sampled = c1["inserts"] - c0["inserts"], c1["samples"] - c0["samples"]
            print(
                f"  {name:55s} {inserted:7d} inserted, {sampled:8d} sampled: "
                f"samples/insert {sampled / inserted:.3f}"
            )
        c = ray.get(limiter.counts.remote())
    ray.get([w.stop.remote() for w in writers])
    ins, smp = c["inserts"], c["samples"]
    low = spi - (spi * min_size + error_buffer) / ins
    high = spi - (spi * min_size - error_buffer) / ins
    print(
        f"  whole run: {ins} inserted, {smp} sampled, samples/insert {smp / ins:.4f} (target "
        f"{spi}); the error buffer allows [{low:.4f}, {high:.4f}] after {ins} inserts: "
        f"{low <= smp / ins <= high}"
    )
    print(
        f"  largest |r I - S - r m| seen (every 5 learner steps) {worst:.0f} <= error_buffer "
        f"{error_buffer:.0f}: {worst <= error_buffer}; load average {max(loads):.1f} at most"
    )
    for actor in [*writers, *replay.shards, limiter]:
        ray.kill(actor)
    del refs  # the writers were stopped, or killed while waiting for the limiter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--sharded", action="store_true", help="only section 4 (scaling out)")
    parser.add_argument("--prefetch", action="store_true", help="only the learner wait of 4")
    parser.add_argument("--inserts", action="store_true", help="only the shard inserts of 4")
    parser.add_argument("--ratio", action="store_true", help="only the rate limiter run of 4")
    parser.add_argument("--ratio-seconds", type=float, default=60.0, help="rate limiter run")
    parser.add_argument(
        "--chunked",
        action="store_true",
        help="only the chunked writes: CPU per transition and throughput against direct adds, "
        "then the learner wait and the rate limiter run with chunked writers",
    )
    parser.add_argument(
        "--chunk-sizes", default="128,256,1024", help="chunk sizes, comma-separated"
    )
    args = parser.parse_args()
    reps = 2 if args.quick else 9
    with local_ray():
        print(f"Ray {ray.__version__}, {os.cpu_count()} CPUs, local cluster with num_cpus=2")
        if args.chunked:
            sizes = tuple(int(c) for c in args.chunk_sizes.split(","))
            bench_chunked_inserts(
                2 if args.quick else 5, seconds=0.5 if args.quick else 3.0, chunk_sizes=sizes
            )
            if not args.inserts:
                bench_prefetch(
                    steps=20 if args.quick else 100,
                    rounds=2 if args.quick else 5,
                    chunk_size=max(sizes),
                )
                bench_ratio(4.0 if args.quick else args.ratio_seconds, chunk_size=128)
            return
        only = {"prefetch": args.prefetch, "inserts": args.inserts, "ratio": args.ratio}
        if any(only.values()) or args.sharded or args.quick:
            run_all = args.sharded or args.quick or not any(only.values())
            if run_all or only["prefetch"]:
                bench_prefetch(steps=20 if args.quick else 100, rounds=2 if args.quick else 5)
            if run_all or only["inserts"]:
                bench_shard_inserts(reps if args.quick else 5, seconds=0.5 if args.quick else 3.0)
            if run_all or only["ratio"]:
                bench_ratio(4.0 if args.quick else args.ratio_seconds)
            if args.sharded or any(only.values()):
                return
        bench_writes(reps, num_batches=10 if args.quick else 100)
        bench_rollouts(reps, num_steps=100 if args.quick else 1500)
        bench_sample_latency(reps, calls=5 if args.quick else 60)


if __name__ == "__main__":
    main()
