"""Steps per second of CartPole through GymnasiumToJax inside a jitted lax.scan, against a
plain Python loop over the same gymnasium env.

Variants (timed round robin, A B C D A B C D ...):

- ``python loop``: ``env.step(a)`` in a Python loop over a precomputed action array,
  resetting at episode ends (the floor: no agent at all);
- ``bridge scan``: the same actions through ``GymnasiumToJax.step`` in one jitted
  ``lax.scan`` (autoreset inside the bridge);
- ``python loop + jit policy``: the loop a JAX agent runs without the bridge: a jitted
  linear policy called on every observation;
- ``bridge scan + policy``: the same policy inside the scan;
- ``vector x16: python loop`` / ``vector x16: bridge scan``: a ``SyncVectorEnv`` of 16
  CartPoles (``--num-envs``) stepped directly and through the bridge (one callback serves
  all sub-envs); steps/s counts env steps.

Correctness: the bridged rollout must reproduce the Python loop exactly (same seed and
actions), checked before timing.

Run: ``python benchmarks/bench_env_bridge.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np

from coax_utils.envs import GymnasiumToJax

SEED = 0


def make_env() -> gymnasium.Env:
    return gymnasium.make("CartPole-v1")


def python_loop(env: gymnasium.Env, actions: np.ndarray) -> tuple[np.ndarray, float]:
    env.reset(seed=SEED)
    obs_sum = np.zeros(4, np.float64)
    total = 0.0
    for a in actions:
        obs, r, terminated, truncated, _ = env.step(int(a))
        total += r
        if terminated or truncated:
            obs, _ = env.reset()
        obs_sum += obs
    return obs_sum, total


W = jnp.asarray(np.random.default_rng(0).normal(size=(4, 2)), jnp.float32)


@jax.jit
def policy(obs: jax.Array) -> jax.Array:
    return jnp.argmax(obs @ W).astype(jnp.int32)


def python_loop_policy(env: gymnasium.Env, n: int) -> tuple[np.ndarray, float]:
    obs, _ = env.reset(seed=SEED)
    obs_sum = np.zeros(4, np.float64)
    total = 0.0
    for _ in range(n):
        a = int(policy(obs))
        obs, r, terminated, truncated, _ = env.step(a)
        total += r
        if terminated or truncated:
            obs, _ = env.reset()
        obs_sum += obs
    return obs_sum, total


def make_bridge_runs(benv: GymnasiumToJax, n: int):
    params = benv.default_params

    @jax.jit
    def run_actions(key, actions):
        _, state = benv.reset(key, params)

        def body(carry, a):
            state, obs_sum, total = carry
            obs, state, r, *_ = benv.step(key, state, a, params)
            return (state, obs_sum + obs, total + r), None

        init = (state, jnp.zeros(4, jnp.float32), jnp.zeros([], jnp.float32))
        (_, obs_sum, total), _ = jax.lax.scan(body, init, actions)
        return obs_sum, total

    @jax.jit
    def run_policy(key):
        obs, state = benv.reset(key, params)

        def body(carry, _):
            obs, state, obs_sum, total = carry
            obs, state, r, *_ = benv.step(key, state, policy(obs), params)
            return (obs, state, obs_sum + obs, total + r), None

        init = (obs, state, jnp.zeros(4, jnp.float32), jnp.zeros([], jnp.float32))
        (_, _, obs_sum, total), _ = jax.lax.scan(body, init, None, length=n)
        return obs_sum, total

    return run_actions, run_policy


NUM_ENVS = 16


def make_vector_env() -> gymnasium.vector.SyncVectorEnv:
    return gymnasium.vector.SyncVectorEnv([make_env] * NUM_ENVS)


def vector_loop(venv: gymnasium.vector.VectorEnv, actions: np.ndarray) -> tuple:
    venv.reset(seed=SEED)
    obs_sum = np.zeros((NUM_ENVS, 4), np.float64)
    total = np.zeros(NUM_ENVS, np.float64)
    for a in actions:
        obs, r, *_ = venv.step(a)
        total += r
        obs_sum += obs
    return obs_sum, total


def make_vector_run(benv: GymnasiumToJax):
    params = benv.default_params

    @jax.jit
    def run(key, actions):
        _, state = benv.reset(key, params)

        def body(carry, a):
            state, obs_sum, total = carry
            obs, state, r, *_ = benv.step(key, state, a, params)
            return (state, obs_sum + obs, total + r), None

        init = (state, jnp.zeros((NUM_ENVS, 4), jnp.float32), jnp.zeros(NUM_ENVS, jnp.float32))
        (_, obs_sum, total), _ = jax.lax.scan(body, init, actions)
        return obs_sum, total

    return run


def main() -> None:
    global NUM_ENVS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: time.perf_counter; cpu: CPU time of this process (all its threads), "
        "which does not count waiting for a core on a shared machine",
    )
    parser.add_argument("--num-envs", type=int, default=NUM_ENVS, help="vector env width")
    args = parser.parse_args()
    NUM_ENVS = args.num_envs
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    n = 500 if args.quick else 2000
    reps = 3 if args.quick else 11

    actions = np.random.default_rng(1).integers(0, 2, size=n).astype(np.int32)
    j_actions = jnp.asarray(actions)
    key = jax.random.key(0)

    plain_env = make_env()

    # correctness: same seed, same actions -> same trajectory (a fresh bridge per check, so
    # that its first reset is the seeded one)
    ref_obs, ref_total = python_loop(plain_env, actions)
    check_actions, _ = make_bridge_runs(GymnasiumToJax(make_env(), seed=SEED), n)
    b_obs, b_total = jax.block_until_ready(check_actions(key, j_actions))
    assert float(b_total) == ref_total, (float(b_total), ref_total)
    np.testing.assert_allclose(np.asarray(b_obs), ref_obs, rtol=1e-4, atol=1e-3)
    ref_obs, ref_total = python_loop_policy(plain_env, n)
    _, check_policy = make_bridge_runs(GymnasiumToJax(make_env(), seed=SEED), n)
    b_obs, b_total = jax.block_until_ready(check_policy(key))
    assert float(b_total) == ref_total, (float(b_total), ref_total)
    np.testing.assert_allclose(np.asarray(b_obs), ref_obs, rtol=1e-4, atol=1e-3)

    nv = max(1, 2 * n // NUM_ENVS)
    v_actions = np.random.default_rng(2).integers(0, 2, size=(nv, NUM_ENVS)).astype(np.int32)
    jv_actions = jnp.asarray(v_actions)
    plain_venv = make_vector_env()
    ref_obs, ref_total = vector_loop(plain_venv, v_actions)
    b_obs, b_total = jax.block_until_ready(
        make_vector_run(GymnasiumToJax(make_vector_env(), seed=SEED))(key, jv_actions)
    )
    np.testing.assert_array_equal(np.asarray(b_total), ref_total)
    np.testing.assert_allclose(np.asarray(b_obs), ref_obs, rtol=1e-4, atol=1e-3)

    benv = GymnasiumToJax(make_env(), seed=SEED)
    run_actions, run_policy = make_bridge_runs(benv, n)
    run_vector = make_vector_run(GymnasiumToJax(make_vector_env(), seed=SEED))
    jax.block_until_ready((run_actions(key, j_actions), run_policy(key)))  # warm-up
    jax.block_until_ready(run_vector(key, jv_actions))

    variants = {
        "python loop": lambda: python_loop(plain_env, actions),
        "bridge scan": lambda: jax.block_until_ready(run_actions(key, j_actions)),
        "python loop + jit policy": lambda: python_loop_policy(plain_env, n),
        "bridge scan + policy": lambda: jax.block_until_ready(run_policy(key)),
        f"vector x{NUM_ENVS}: python loop": lambda: vector_loop(plain_venv, v_actions),
        f"vector x{NUM_ENVS}: bridge scan": lambda: jax.block_until_ready(
            run_vector(key, jv_actions)
        ),
    }
    env_steps = {k: n for k in variants}
    env_steps[f"vector x{NUM_ENVS}: python loop"] = nv * NUM_ENVS
    env_steps[f"vector x{NUM_ENVS}: bridge scan"] = nv * NUM_ENVS
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)

    def rate(ts: list[float], steps: int) -> tuple[float, float, float]:
        rates = sorted(steps / t for t in ts)
        return statistics.median(rates), rates[0], rates[-1]

    print(
        f"CartPole-v1, {n} steps per repetition ({nv} x {NUM_ENVS} for vector envs), "
        f"{reps} repetitions, {args.clock} clock, jax {jax.__version__}, "
        f"gymnasium {gymnasium.__version__}"
    )
    print(f"{'variant':<30}{'steps/s median':>16}{'min':>10}{'max':>10}{'us/step':>10}")
    for name, ts in times.items():
        med, lo, hi = rate(ts, env_steps[name])
        print(f"{name:<30}{med:>16,.0f}{lo:>10,.0f}{hi:>10,.0f}{1e6 / med:>10.1f}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        "overhead ratio (time per step, median): "
        f"bridge scan / python loop = {med['bridge scan'] / med['python loop']:.2f}x; "
        f"bridge scan + policy / python loop + jit policy = "
        f"{med['bridge scan + policy'] / med['python loop + jit policy']:.2f}x; "
        f"vector x{NUM_ENVS}: bridge / loop = "
        f"{med[f'vector x{NUM_ENVS}: bridge scan'] / med[f'vector x{NUM_ENVS}: python loop']:.2f}x"
    )


if __name__ == "__main__":
    main()
