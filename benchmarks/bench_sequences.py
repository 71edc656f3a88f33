"""Sequence replay for recurrent agents: sampling cost against the stored data, and against
flashbax's prioritised trajectory buffer, timed round robin in one process.

Sections:

1. sampling cost as the buffer grows: a batch of 32 windows of 80 steps (period 40, small
   observations: 4 float32, an int32 action, a float32 reward; an LSTM state of 2 x 32
   float32 per window) from buffers holding 10^5, 10^6 and 10^7 steps, for the jittable
   ``make_prioritized_sequence_buffer`` (jitted sample) and the host
   ``PrioritizedSequenceReplayBuffer``. Goal: the largest at most 1.5x the smallest.
2. one jitted training-loop step at the same capacity (10^6 steps), sequence length (80),
   period (40) and batch (32), 8 sub-envs: add one step of every sub-env, sample 32 windows
   by priority, update their priorities; ``make_prioritized_sequence_buffer`` against
   flashbax's ``make_prioritised_trajectory_buffer`` (which stores the LSTM state with every
   step, as it has no windows to store it with). 200 steps per jitted ``lax.scan``, state
   donated. Goal: flashbax's time at least 1.5x ours.

The buffers are filled through their public state (a checkpoint state for the host buffer,
the state pytree for the jittable one): adding 10^7 steps one by one would take minutes
without changing what a sample costs. Usage: ``python benchmarks/bench_sequences.py
[--quick]`` (``--quick``: 10^4 to 10^6 steps, shorter timings).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_replay import report, round_robin

from coax_utils.replay import PrioritizedSequenceReplayBuffer, make_prioritized_sequence_buffer
from coax_utils.utils import sum_tree_set

L, P, BATCH, E, H = 80, 40, 32, 8, 32


def example_step() -> dict:
    return {"obs": np.zeros(4, np.float32), "action": np.int32(0), "reward": np.float32(0)}


def filled_arrays(windows: int, rows: tuple) -> dict:
    """Step arrays of ``windows`` windows, every page written (no lazily zero pages)."""
    obs = np.empty(rows + (4,), np.float32)
    obs[...] = np.arange(4, dtype=np.float32)
    return {
        "obs": obs,
        "action": np.ones(rows, np.int32),
        "reward": np.full(rows, 0.5, np.float32),
    }


def jittable_state(num_steps: int):
    windows = num_steps // P
    fn = make_prioritized_sequence_buffer(windows, L, P, L - P, E, alpha=0.6)
    core = (np.zeros(H, np.float32), np.zeros(H, np.float32))
    state = fn.init(example_step(), core)
    steps = jax.tree_util.tree_map(jnp.asarray, filled_arrays(windows, (windows, L)))
    prio = np.random.default_rng(0).random(windows).astype(np.float32) + 0.1
    state = state.replace(
        steps=steps,
        core=(jnp.ones((windows, H)), jnp.ones((windows, H))),
        seq_len=jnp.full((windows,), L, jnp.int32),
        size=jnp.int32(windows),
        laps=jnp.int32(1),
        tree=jax.jit(sum_tree_set)(state.tree, jnp.arange(windows), jnp.asarray(prio)),
    )
    return fn, state


def host_buffer(num_steps: int) -> PrioritizedSequenceReplayBuffer:
    windows = num_steps // P
    empty = PrioritizedSequenceReplayBuffer(windows, L, P, L - P, E, alpha=0.6, random_seed=0)
    state = empty.__checkpoint_state__()
    steps = filled_arrays(windows, (windows, L))
    state.update(
        count=windows,
        step_structure=jax.tree_util.tree_map(lambda x: 0, steps),
        core_structure=(0, 0),
        steps=jax.tree_util.tree_leaves(steps),
        core=[np.ones((windows, H), np.float32), np.ones((windows, H), np.float32)],
        pending=jax.tree_util.tree_leaves(filled_arrays(E, (E, L))),
        pending_core=[np.zeros((E, L, H), np.float32), np.zeros((E, L, H), np.float32)],
        seq_len=np.full(windows, L, np.int32),
        abs_mix=np.random.default_rng(0).random(windows),
    )
    return PrioritizedSequenceReplayBuffer.__checkpoint_restore__(state)


def section_1(sizes: list[int], reps: int, rep_seconds: float) -> None:
    for kind in ("jittable", "host"):
        variants = {}
        held = []
        for n in sizes:
            if kind == "jittable":
                fn, state = jittable_state(n)
                sample = jax.jit(fn.sample, static_argnums=2)
                keys = iter(jax.random.split(jax.random.key(0), 1 << 20))
                held.append(state)

                def run(sample=sample, state=state, keys=keys):
                    jax.block_until_ready(sample(state, next(keys), BATCH))

            else:
                buffer = host_buffer(n)
                held.append(buffer)

                def run(buffer=buffer):
                    buffer.sample(BATCH)

            variants[f"{kind}, {n:.0e} steps"] = run
        times = round_robin(variants, reps, rep_seconds)
        title = f"1. {kind}: prioritized sample of {BATCH} x {L} steps (round robin)"
        report(title, times, reference=next(iter(variants)))
        small, large = np.median(times[next(iter(variants))]), np.median(times[list(variants)[-1]])
        verdict = "met" if large <= 1.5 * small else "NOT met"
        print(f"  largest / smallest: {large / small:.2f}x (goal <= 1.5x: {verdict})")
        del held, variants


def section_2(num_steps: int, iterations: int, reps: int, rep_seconds: float) -> None:
    import flashbax

    windows = num_steps // P
    ours = make_prioritized_sequence_buffer(windows, L, P, L - P, E, alpha=0.6)
    core = (jnp.zeros(H), jnp.zeros(H))
    step = jax.tree_util.tree_map(jnp.asarray, example_step())
    steps_e = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (E,) + x.shape), step)
    core_e = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (E,) + x.shape), core)

    def ours_loop(state, key):
        def body(state, key):
            state = ours.add(state, steps_e, core_e)
            sample = ours.sample(state, key, BATCH)
            td = sample.items["reward"] + sample.items["obs"][..., 0]
            return ours.update(state, sample.indices, td, sample.versions), None

        return jax.lax.scan(body, state, jax.random.split(key, iterations))[0]

    fb = flashbax.make_prioritised_trajectory_buffer(
        add_batch_size=E,
        sample_batch_size=BATCH,
        sample_sequence_length=L,
        period=P,
        min_length_time_axis=L,
        max_length_time_axis=num_steps // E,
        priority_exponent=0.6,
        device="cpu",
    )
    fb_item = {**step, "core": core}
    fb_add = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (E, 1) + x.shape), fb_item)

    def fb_loop(state, key):
        def body(state, key):
            state = fb.add(state, fb_add)
            sample = fb.sample(state, key)
            exp = sample.experience
            prio = jnp.sum(exp["reward"] + exp["obs"][..., 0], axis=1)
            return fb.set_priorities(state, sample.indices, prio), None

        return jax.lax.scan(body, state, jax.random.split(key, iterations))[0]

    ours_state = ours.init(example_step(), core)
    for _ in range(L):  # one full window per sub-env, so samples hold data
        ours_state = ours.add(ours_state, steps_e, core_e)
    fb_state = fb.init(fb_item)
    fb_state = fb.add(
        fb_state, jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (E, L) + x.shape), fb_item)
    )
    ours_jit = jax.jit(ours_loop, donate_argnums=0)
    fb_jit = jax.jit(fb_loop, donate_argnums=0)
    holder = {"ours": ours_state, "fb": fb_state}
    keys = iter(jax.random.split(jax.random.key(1), 1 << 16))

    def run_ours():
        holder["ours"] = jax.block_until_ready(ours_jit(holder["ours"], next(keys)))

    def run_fb():
        holder["fb"] = jax.block_until_ready(fb_jit(holder["fb"], next(keys)))

    names = ("make_prioritized_sequence_buffer step", "flashbax trajectory buffer step")
    times = round_robin({names[0]: run_ours, names[1]: run_fb}, reps, rep_seconds)
    times = {k: [t / iterations for t in v] for k, v in times.items()}
    report(
        f"2. jitted add + sample + update, {num_steps:.0e} steps, {E} sub-envs (per step)",
        times,
        reference=names[0],
    )
    ratio = np.median(times[names[1]]) / np.median(times[names[0]])
    print(f"  flashbax / ours: {ratio:.2f}x (goal >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller buffers, short timings")
    parser.add_argument("--only", default="", help="sections to run, e.g. 2 (default: all)")
    args = parser.parse_args()
    only = {int(s) for s in args.only.split(",") if s}
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {time.strftime('%F %T')}")
    if args.quick:
        sizes, reps, rep_seconds, cap, iterations = [10**4, 10**5, 10**6], 3, 0.1, 10**5, 50
    else:
        sizes, reps, rep_seconds, cap, iterations = [10**5, 10**6, 10**7], 7, 0.3, 10**6, 200
    if not only or 1 in only:
        section_1(sizes, reps, rep_seconds)
    if not only or 2 in only:
        section_2(cap, iterations, reps, rep_seconds)


if __name__ == "__main__":
    main()
