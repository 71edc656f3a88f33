"""The actor side: host tracing of a vector env, and RolloutWorker env steps against a plain
gymnasium loop, timed round robin in one run.

Sections:

1. Host tracing, per transition: ``NStep(n=3, gamma=0.99)`` over the recorded steps of a
   16-env vector CartPole-v1 (``SyncVectorEnv``, random actions, next-step autoreset), the
   same stream for every variant (the env's own time is not in it):

   - one single-env ``NStep`` per sub-env, as ``RecordVectorTransitions`` traced before,
     taken from the code at git revision ``--before`` (default ``238e6bb``, the revision
     before vector tracers) and, as a check, the current single-env ``NStep``;
   - ``NStep(n=3, gamma=0.99, num_envs=16)``: one ``add`` and at most one ``pop`` per
     vector step for all sub-envs.

   Each variant adds every step and pops what it can after every step. Goal: the batched
   tracer at most 1/5 of the per-sub-env tracers' time per transition.
2. Env steps per second of 1 and 2 :class:`~coax_utils.distributed.RolloutWorker` actors
   (random policy, ``n=3``) on a local Ray cluster (num_cpus=2) sending chunks of
   ``--chunk-size`` transitions (through their ``ReplayWriter``) to a ``ReplayServer`` of a
   ``PrioritizedReplayBuffer``, against a plain gymnasium loop in
   this process (``env.step`` of one ``CartPole-v1`` with a random action, reset at episode
   ends): a worker with one env (``num_envs=None``, the worker as it was), and workers with
   ``num_envs`` 16 and 64 (``--worker-envs``) on a ``SyncVectorEnv`` of
   ``gymnasium.make("CartPole-v1")`` (the same env code as the plain loop) and on
   ``gymnasium.make_vec`` (gymnasium's NumPy ``CartPoleVectorEnv``). Workers count the
   transitions the server acknowledged (a next-step reset step gives none, so this is a
   little below their env steps). Goal: one worker >= 0.5 of the plain loop.

Usage: ``python benchmarks/bench_actors.py [--quick] [--results PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from bench_distributed import (  # noqa: E402
    gymnasium_loop,
    local_ray,
    rates_round_robin,
    uniform,
    workers_run,
)

from coax_utils.replay import NStep  # noqa: E402

NUM_ENVS = 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tracing_module_at(rev: str) -> types.ModuleType | None:
    """``coax_utils/replay/_tracing.py`` as it was at git revision ``rev`` (None if git or
    the revision is not available)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:coax_utils/replay/_tracing.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("coax_utils.replay._tracing_before")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{rev}:coax_utils/replay/_tracing.py", "exec"), module.__dict__)
    return module


def recorded_stream(num_vector_steps: int, seed: int = 0) -> list:
    """(obs, actions, rewards, terminated, truncated, next_obs, active) per vector step."""
    import gymnasium

    venv = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * NUM_ENVS)
    obs, _ = venv.reset(seed=seed)
    rng = np.random.default_rng(seed)
    skip = np.zeros(NUM_ENVS, bool)
    out = []
    for _ in range(num_vector_steps):
        actions = rng.integers(2, size=NUM_ENVS)
        nxt, r, term, trunc, _ = venv.step(actions)
        out.append((obs, actions, r, term, trunc, nxt, ~skip))
        skip = (term | trunc) & ~skip
        obs = nxt
    return out


def per_sub_env(make_tracer, stream: list):
    def run() -> int:
        tracers = [make_tracer() for _ in range(NUM_ENVS)]
        count = 0
        for obs, actions, r, term, trunc, nxt, active in stream:
            for i in range(NUM_ENVS):
                if not active[i]:
                    continue
                tracer = tracers[i]
                tracer.add(obs[i], actions[i], r[i], term[i], truncated=trunc[i], s_next=nxt[i])
                while tracer:
                    count += tracer.pop().batch_size
        return count

    return run


def batched(stream: list):
    def run() -> int:
        tracer = NStep(3, 0.99, num_envs=NUM_ENVS)
        count = 0
        for obs, actions, r, term, trunc, nxt, active in stream:
            tracer.add(obs, actions, r, term, truncated=trunc, s_next=nxt, active=active)
            if tracer:
                count += tracer.pop().batch_size
        return count

    return run


def bench_tracing(reps: int, num_vector_steps: int, before: str) -> list[dict]:
    stream = recorded_stream(num_vector_steps)
    variants = {}
    old = tracing_module_at(before)
    if old is None:
        print(f"(git revision {before} not available: the per-sub-env baseline is today's)")
    else:
        variants[f"NStep per sub-env (code at {before})"] = per_sub_env(
            lambda: old.NStep(3, 0.99), stream
        )
    variants["NStep per sub-env (today's single-env NStep)"] = per_sub_env(
        lambda: NStep(3, 0.99), stream
    )
    variants[f"NStep(num_envs={NUM_ENVS}), batched"] = batched(stream)
    counts = {name: run() for name, run in variants.items()}  # warm-up, and the same rows
    assert len(set(counts.values())) == 1, counts
    transitions = next(iter(counts.values()))
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            tic = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - tic) / transitions)
    base = statistics.median(next(iter(times.values())))
    print(
        f"\n1. Host tracing, NStep(n=3) over a {NUM_ENVS}-env vector CartPole-v1 "
        f"({num_vector_steps} vector steps, {transitions} transitions), per transition"
    )
    print(f"  {'variant':52s} {'median':>9s} {'min - max':>17s}  {'vs first':>8s}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:52s} {med * 1e6:6.2f} us {min(ts) * 1e6:7.2f} - {max(ts) * 1e6:6.2f}"
            f"  {med / base:8.3f}"
        )
        rows.append(
            {
                "section": "tracing",
                "variant": name,
                "us_per_transition": med * 1e6,
                "ratio": med / base,
            }
        )
    print(f"  goal: batched <= 0.2 of the per-sub-env tracers: {med / base <= 0.2}")
    return rows


def uniform_batch(params, S, rng):
    return rng.integers(2, size=len(S))


def sync_cartpoles(num_envs: int):
    import gymnasium

    return gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * num_envs)


def bench_rollouts(reps: int, seconds: float, chunk_size: int, env_counts: list[int]) -> list[dict]:
    import functools

    import ray

    from coax_utils.distributed import ReplayServer, RolloutWorker
    from coax_utils.replay import PrioritizedReplayBuffer

    server = ReplayServer.remote(PrioritizedReplayBuffer(2**17, random_seed=0))
    kinds = {"1 env (num_envs=None)": dict(env_fn="CartPole-v1", policy=uniform)}
    for k in env_counts:
        kinds[f"SyncVectorEnv x{k}"] = dict(
            env_fn=functools.partial(sync_cartpoles, k), policy=uniform_batch, num_envs=k
        )
        kinds[f"make_vec x{k} (CartPoleVectorEnv)"] = dict(
            env_fn="CartPole-v1", policy=uniform_batch, num_envs=k
        )
    workers = {
        kind: [
            RolloutWorker.remote(server=server, params=0, n=3, chunk_size=chunk_size, seed=s, **kw)
            for s in (1, 2)
        ]
        for kind, kw in kinds.items()
    }
    loop_steps = max(1000, int(seconds * 50_000))

    loop_name = "gymnasium loop in-process (env steps/s)"
    runs = {loop_name: gymnasium_loop(loop_steps)}
    for kind, group in workers.items():
        num_steps = max(2 * chunk_size, int(seconds * (10_000 if "None" in kind else 60_000)))
        for k in (1, 2):
            runs[f"RolloutWorker x{k}, {kind}"] = workers_run(server, group[:k], num_steps)
    rates = rates_round_robin(runs, reps)
    base = statistics.median(rates[loop_name])
    print(
        f"\n2. Env steps/s (workers: transitions acknowledged/s) on CartPole-v1, random policy, "
        f"n=3, chunks of {chunk_size}"
    )
    print(f"  {'variant':62s} {'median':>9s} {'(min - max)':>21s}  {'vs loop':>7s}")
    rows = []
    for name, values in rates.items():
        med = statistics.median(values)
        print(
            f"  {name:62s} {med:9,.0f} ({min(values):9,.0f} - {max(values):9,.0f})"
            f"  {med / base:7.2f}"
        )
        rows.append(
            {"section": "rollouts", "variant": name, "steps_per_s": med, "ratio": med / base}
        )
    for group in workers.values():
        for w in group:
            ray.kill(w)
    ray.kill(server)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--before", default="238e6bb", help="git revision of the baseline")
    parser.add_argument(
        "--chunk-size", type=int, default=1024, help="transitions per chunk the workers send"
    )
    parser.add_argument("--tracing-only", action="store_true", help="only section 1")
    parser.add_argument(
        "--worker-envs", default="16,64", help="num_envs of the vector workers (comma list)"
    )
    _results.add_argument(parser)
    args = parser.parse_args()
    reps = 2 if args.quick else 7
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start")
    rows = bench_tracing(reps, 50 if args.quick else 400, args.before)
    if not args.tracing_only:
        with local_ray():
            env_counts = [int(k) for k in args.worker_envs.split(",")]
            rows += bench_rollouts(reps, 0.1 if args.quick else 1.0, args.chunk_size, env_counts)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    _results.write(args.results, "actors", rows)


if __name__ == "__main__":
    main()
