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
   step, as it has no windows to store it with). Both buffers are first filled to capacity
   through their own jitted ``add`` (the steady state of a training run: samples read
   windows from all over the buffer, not from a few recent ones still in the caches). Both
   steps read the same things of a sample, as a learner's loss does: every step's
   observation, action and reward, the LSTM state at each window's start and the importance
   weights (flashbax returns probabilities: the weights are computed from them); bounded
   TD errors come from them, and the priorities are R2D2's mixture (computed by ``update``
   for ours, by the step for flashbax). 200 steps per jitted ``lax.scan``, state donated
   (both allow it), a warm-up call, then rounds alternating the two, medians. Goal:
   flashbax's time at least 1.5x ours.

Section 1's buffers are filled through their public state (a checkpoint state for the host buffer,
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
from coax_utils.replay._seq_functional import window_layout
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
    meta = {
        "seq_len": jnp.full((windows,), L, jnp.int32),
        "seq_end": jnp.zeros((windows,), jnp.int8),
        "seq_first": jnp.zeros((windows,), jnp.bool_),
    }
    body = {"steps": steps, "core": (jnp.ones((windows, H)), jnp.ones((windows, H)))}
    state = state.replace(
        windows=window_layout(state.pending, state.pending_core).pack((meta, body)),
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


def _steps_at(i: jax.Array) -> tuple:
    """The steps and LSTM states of every sub-env at add number ``i`` (all distinct)."""
    obs = (i * E + jnp.arange(E, dtype=jnp.int32)).astype(jnp.float32)
    steps = {
        "obs": obs[:, None] + jnp.arange(4, dtype=jnp.float32),
        "action": (i + jnp.arange(E, dtype=jnp.int32)) % 3,
        "reward": jnp.full((E,), 0.5, jnp.float32),
    }
    core = (jnp.broadcast_to(obs[:, None], (E, H)), jnp.broadcast_to(-obs[:, None], (E, H)))
    return steps, core


def _td_errors(obs, action, reward, core_sum, weights) -> jax.Array:
    """What a learner's loss reads of a sample, reduced to bounded TD errors ``(B, L)``: every
    step's observation, action and reward, the core state at each window's start and the
    importance weights (the same arithmetic for both buffers)."""
    x = obs.sum(-1) * 0.618 + action + reward + (core_sum + weights)[:, None]
    return x - jnp.floor(x) - 0.5


def section_2(num_steps: int, iterations: int, reps: int, rep_seconds: float) -> None:
    import flashbax

    windows = num_steps // P
    eta, beta = 0.9, 0.6
    ours = make_prioritized_sequence_buffer(windows, L, P, L - P, E, alpha=0.6, beta=beta, eta=eta)
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

    def ours_step(state, key, i):
        state = ours.add(state, *_steps_at(i))
        x = ours.sample(state, key, BATCH)
        core_sum = x.core_state[0].sum(-1) + x.core_state[1].sum(-1)
        items = x.items
        td = _td_errors(items["obs"], items["action"], items["reward"], core_sum, x.weights)
        return ours.update(state, x.indices, td, x.versions)  # the R2D2 mixture inside

    def fb_add(state, steps, core):  # one step of every sub-env: a time axis of 1
        return fb.add(state, jax.tree_util.tree_map(lambda x: x[:, None], {**steps, "c": core}))

    def fb_step(state, key, i):
        state = fb_add(state, *_steps_at(i))
        x = fb.sample(state, key)
        w = (x.probabilities * windows) ** -beta  # the importance weights, as ours
        exp = x.experience
        core_sum = exp["c"][0][:, 0].sum(-1) + exp["c"][1][:, 0].sum(-1)  # at the window start
        td = _td_errors(exp["obs"], exp["action"], exp["reward"], core_sum, w / w.max())
        a = jnp.abs(td)  # the R2D2 mixture, computed by the learner for flashbax
        return fb.set_priorities(state, x.indices, eta * a.max(1) + (1 - eta) * a.mean(1) + 1e-4)

    def loop(step):
        def run(state, key, i0):
            def body(state, x):
                return step(state, *x), None

            xs = (jax.random.split(key, iterations), i0 + jnp.arange(iterations))
            return jax.lax.scan(body, state, xs)[0]

        return jax.jit(run, donate_argnums=0)

    def fill(add, state, adds):  # the buffer filled to capacity through its own add
        def body(state, i):
            return add(state, *_steps_at(i)), None

        return jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(adds))[0], donate_argnums=0)(
            state
        )

    adds = num_steps // E + L  # a little more than the capacity: the rings are full
    example = {k: v[0] for k, v in _steps_at(jnp.int32(0))[0].items()}
    core = (jnp.zeros(H), jnp.zeros(H))
    holder = {
        "ours": fill(ours.add, ours.init(example, core), adds),
        "fb": fill(fb_add, fb.init({**example, "c": core}), adds),
    }
    print(f"  filled with {adds} adds: ours holds {int(holder['ours'].size)} of {windows} windows")
    steps = {"ours": loop(ours_step), "fb": loop(fb_step)}
    counter = iter(range(adds, 2**30, iterations))

    def runner(name):
        def run():
            i = next(counter)
            holder[name] = jax.block_until_ready(
                steps[name](holder[name], jax.random.key(i), jnp.int32(i))
            )

        return run

    names = ("make_prioritized_sequence_buffer step", "flashbax trajectory buffer step")
    times = round_robin({names[0]: runner("ours"), names[1]: runner("fb")}, reps, rep_seconds)
    times = {k: [t / iterations for t in v] for k, v in times.items()}
    report(
        f"2. jitted add + sample + update, {num_steps:.0e} steps (full), {E} sub-envs (per step)",
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
