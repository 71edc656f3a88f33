"""Minari datasets into replay buffers and jitted loops: coax_utils against its peers, one run.

A local Minari dataset is made first (nothing downloaded): CartPole-v1 episodes of a noisy
balancing policy (10 % random actions; episodes end by termination or by the 500-step time
limit), written with ``minari.create_dataset_from_buffers`` into a temporary data root.

1. **Filling a buffer** with the transitions of the dataset (1M by default), into a
   ``SimpleReplayBuffer`` of that capacity:

   - ``python loop``: ``for ep in dataset.iterate_episodes()``, then one
     ``buffer.add(TransitionBatch.from_single(...))`` per transition (the glue people write);
     it adds the first ``--loop`` transitions only (100k; at a few thousand transitions per
     second the whole million would take minutes), and its rate is per transition,
   - ``fill_from_minari``: ``coax_utils.replay.fill_from_minari(dataset, buffer)``, all of
     them.

   Both read the dataset from disk. Reported: seconds, transitions per second, and the
   ratio of the rates (goal: >= 5x). A check compares the loop's buffer with the first
   rows of ``fill_from_minari``'s.

2. **A jitted training loop** of small MLP updates (a 4-64-64-2 Q-network, one Adam step of
   a masked TD loss per batch of 256) running one epoch in a ``jax.lax.scan``:

   - ``ready``: the epoch's batches already on the device, scanned over (no source),
   - ``MinariSource``: batches from ``MinariSource(dataset, 256)`` (shuffled; the data in
     memory, held on the device and gathered in the compiled loop),
   - ``MinariSource sequential``: the same, ``ordering="sequential"`` (contiguous reads, no
     permutation: what the gather itself costs),
   - ``MinariSource chunked``: ``MinariSource(dataset, 256, chunk_steps=n // 10)`` (the
     path for data larger than memory: host reads through ``io_callback``, prefetch 16).

   The wait on data is ``(t_source - t_ready) / t_source``, which also counts the CPU the
   data path takes from the updates on a busy machine (goal: <= 10 %, for the data in
   memory); for the chunked source, also the time the compiled loop spends inside its host
   callback (timed around it).

3. **Streaming rate** (no training, a masked checksum of each batch), transitions per
   second over one epoch of the first ``--stream`` transitions:

   - ``MinariSource``: ``MinariSource(dataset, 256)`` (in memory),
   - ``MinariSource chunked``: the same with ``chunk_steps`` a tenth of the transitions,
   - ``cyreal DiskSource``: cyreal's ``BatchTransform(256, pad_last_batch=True)`` over its
     ``DiskSource`` whose ``sample_fn(i)`` returns transition ``i`` from the same arrays held
     in memory (prefetch 4096 items, as many as the chunked MinariSource gathers per
     callback).

   Goal: MinariSource >= 1x cyreal.

Timings are medians of round-robin repetitions (A B A B ...) after a warm-up. Run
``python benchmarks/bench_minari.py`` (a few minutes: most of it is making the dataset and the
Python loop) or ``--quick`` (100k transitions, seconds).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
import warnings

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coax_utils.replay import SimpleReplayBuffer, TransitionBatch, fill_from_minari
from coax_utils.sources import MinariSource

BATCH = 256


def make_dataset(steps: int, seed: int = 0):
    """A Minari dataset of about ``steps`` CartPole transitions (a noisy balancing policy)."""
    import minari
    from minari.data_collector import EpisodeBuffer

    env = gymnasium.make("CartPole-v1", max_episode_steps=500)
    rng = np.random.default_rng(seed)
    episodes, total = [], 0
    while total < steps:
        obs, _ = env.reset(seed=int(rng.integers(1 << 31)))
        observations, actions, rewards, terms, truncs = [obs], [], [], [], []
        done = False
        while not done:
            if rng.random() < 0.1:
                action = int(rng.integers(2))
            else:
                action = int(obs[2] + 0.5 * obs[3] > 0)
            obs, reward, term, trunc, _ = env.step(action)
            for xs, x in zip(
                (observations, actions, rewards, terms, truncs), (obs, action, reward, term, trunc)
            ):
                xs.append(x)
            done = term or trunc
        episodes.append(
            EpisodeBuffer(
                id=len(episodes),
                observations=np.stack(observations),
                actions=np.array(actions, np.int64),
                rewards=np.array(rewards),
                terminations=np.array(terms),
                truncations=np.array(truncs),
            )
        )
        total += len(actions)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Minari's metadata advice
        return minari.create_dataset_from_buffers(
            "bench/cartpole/noisy-v0", episodes, env="CartPole-v1", algorithm_name="noisy"
        )


def python_loop_fill(dataset, capacity: int, limit: int) -> SimpleReplayBuffer:
    """The hand-written glue: one add per transition (the first ``limit`` transitions)."""
    buffer = SimpleReplayBuffer(capacity)
    for ep in dataset.iterate_episodes():
        for t in range(len(ep.rewards)):
            if len(buffer) == limit:
                return buffer
            term = bool(ep.terminations[t])
            buffer.add(
                TransitionBatch.from_single(
                    s=ep.observations[t],
                    a=np.int32(ep.actions[t]),
                    logp=0.0,
                    r=float(ep.rewards[t]),
                    done=term,
                    gamma=1.0,
                    s_next=ep.observations[t] if term else ep.observations[t + 1],
                    a_next=np.int32(ep.actions[min(t + 1, len(ep.rewards) - 1)]),
                    logp_next=0.0,
                )
            )
    return buffer


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def bench_fill(dataset, repeats: int, loop_limit: int) -> str:
    n = dataset.total_steps
    counts = {"python loop": min(loop_limit, n), "fill_from_minari": n}
    times: dict[str, list[float]] = {name: [] for name in counts}
    buffers = {}
    for _ in range(repeats):
        for name in times:
            start = time.perf_counter()
            if name == "python loop":
                buffers[name] = python_loop_fill(dataset, n, counts[name])
            else:
                buffers[name] = SimpleReplayBuffer(n)
                fill_from_minari(dataset, buffers[name])
            times[name].append(time.perf_counter() - start)
    a = TransitionBatch.concatenate(*buffers["python loop"])  # the same transitions
    b = TransitionBatch.concatenate(*buffers["fill_from_minari"])
    for f in ("S", "A", "Rn", "In", "S_next"):
        x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))[: len(a)]
        np.testing.assert_array_equal(x, y)
    rate = {k: counts[k] / median(v) for k, v in times.items()}
    rows = [
        [
            k,
            str(counts[k]),
            f"{median(v):.2f}",
            f"{rate[k] / 1e3:.0f}",
            f"{rate[k] / rate['python loop']:.1f}x",
        ]
        for k, v in times.items()
    ]
    header = ["variant", "transitions", "s (median)", "k transitions/s", "vs python loop"]
    return table(header, rows)


def mlp_init(key: jax.Array) -> dict:
    sizes = [4, 64, 64, 2]
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (m, n)) / np.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n)
    return params


def q_values(params: dict, obs: jax.Array) -> jax.Array:
    h = jax.nn.relu(obs @ params["w0"] + params["b0"])
    h = jax.nn.relu(h @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


OPT = optax.adam(1e-3)


def update(params: dict, opt_state, batch: dict, mask: jax.Array):
    def loss(p):
        q = jnp.take_along_axis(q_values(p, batch["observation"]), batch["action"][:, None], 1)
        nxt = jax.lax.stop_gradient(q_values(p, batch["next_observation"]).max(axis=1))
        target = batch["reward"] + 0.99 * (1.0 - batch["terminated"]) * nxt
        return jnp.sum(jnp.where(mask, (q[:, 0] - target) ** 2, 0.0)) / jnp.maximum(mask.sum(), 1)

    grads = jax.grad(loss)(params)
    updates, opt_state = OPT.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state


class TimedMinariSource(MinariSource):
    """MinariSource that adds up the time the compiled loop spends in its host callback
    (instrumentation of this benchmark: ``_fetch`` is the callback's host side)."""

    inside = 0.0

    def _fetch(self, *args):
        start = time.perf_counter()
        try:
            return super()._fetch(*args)
        finally:
            TimedMinariSource.inside += time.perf_counter() - start


def bench_training(dataset, repeats: int) -> str:
    source = MinariSource(dataset, BATCH)
    chunk = max(dataset.total_steps // 10, 1)
    chunked = TimedMinariSource(dataset, BATCH, prefetch=16, chunk_steps=chunk)
    steps = source.steps_per_epoch
    # the same epoch's batches, gathered once and put on the device
    state = source.init_state(jax.random.key(0))
    batches = []
    for _ in range(steps):
        value, mask, state = source.next(state)
        batches.append((value, mask))
    ready = jax.device_put(jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *batches))

    @jax.jit
    def epoch_ready(carry, data):
        def body(carry, xs):
            params, opt_state = carry
            value, mask = xs
            return update(params, opt_state, value, mask), None

        return jax.lax.scan(body, carry, data)[0]

    def epoch_of(src):
        @jax.jit
        def epoch_source(carry, state):
            def body(carry, _):
                (params, opt_state), state = carry
                value, mask, state = src.next(state)
                return (update(params, opt_state, value, mask), state), None

            return jax.lax.scan(body, (carry, state), None, steps)[0]

        return epoch_source

    params = mlp_init(jax.random.key(1))
    carry = (params, OPT.init(params))
    jax.block_until_ready(epoch_ready(carry, ready))  # compile + warm-up
    sequential = MinariSource(dataset, BATCH, ordering="sequential")
    sources = {
        "MinariSource": source,
        "MinariSource sequential": sequential,
        "MinariSource chunked": chunked,
    }
    epochs = {name: epoch_of(src) for name, src in sources.items()}
    states = {name: src.init_state(jax.random.key(2)) for name, src in sources.items()}
    for name in sources:
        jax.block_until_ready(epochs[name](carry, states[name]))
    times: dict[str, list[float]] = {"ready (on device)": [], **{name: [] for name in sources}}
    inside = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(epoch_ready(carry, ready))
        times["ready (on device)"].append(time.perf_counter() - start)
        for name in sources:
            TimedMinariSource.inside = 0.0
            start = time.perf_counter()
            out, states[name] = epochs[name](carry, states[name])
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - start)
        inside.append(TimedMinariSource.inside / times["MinariSource chunked"][-1])
    t_ready = median(times["ready (on device)"])
    rows = [
        [
            k,
            f"{median(v) * 1e3:.0f}",
            f"{median(v) / steps * 1e6:.0f}",
            f"{max(median(v) - t_ready, 0.0) / median(v):.1%}",
        ]
        for k, v in times.items()
    ]
    return (
        table(["variant", "ms/epoch", "us/step", "wait on data"], rows)
        + "\nwait on data: (t - t_ready) / t (goal <= 10 % for MinariSource, the data in "
        f"memory); the chunked source spends {median(inside):.1%} of its epoch inside the "
        "host callback"
    )


def bench_stream(dataset, transitions: int, repeats: int) -> str:
    from cyreal.sources import DiskSource as CyDiskSource
    from cyreal.transforms import BatchTransform

    source = MinariSource(dataset, BATCH, max_transitions=transitions)
    n = source.num_transitions
    chunked = MinariSource(
        dataset, BATCH, prefetch=16, max_transitions=transitions, chunk_steps=max(n // 10, 1)
    )
    # the same transitions as arrays in memory, read one by one by cyreal's callback
    state = MinariSource(dataset, n, ordering="sequential", max_transitions=transitions)
    arrays, _, _ = state.next(state.init_state(jax.random.key(0)))
    arrays = jax.tree_util.tree_map(np.asarray, arrays)
    arrays["terminated"] = arrays["terminated"].astype(np.float32)
    del arrays["truncated"]

    def sample_fn(i: int) -> dict:
        return {k: v[i] for k, v in arrays.items()}

    cyreal = BatchTransform(batch_size=BATCH, pad_last_batch=True)(
        CyDiskSource(n, sample_fn, prefetch_size=16 * BATCH)
    )
    steps = math.ceil(n / BATCH)

    def checksum(value: dict, mask: jax.Array) -> jax.Array:
        rows = value["observation"].sum(axis=1) + value["reward"] + value["action"]
        return jnp.sum(jnp.where(mask, rows, 0.0))

    def runner(src):
        @jax.jit
        def run(state):
            def body(carry, _):
                state, total = carry
                value, mask, state = src.next(state)
                return (state, total + checksum(value, mask)), None

            return jax.lax.scan(body, (state, jnp.zeros([])), None, steps)[0]

        return run

    variants = {
        "MinariSource": source,
        "MinariSource chunked": chunked,
        "cyreal DiskSource": cyreal,
    }
    runs, states, totals = {}, {}, {}
    for name, src in variants.items():
        runs[name] = runner(src)
        states[name], totals[name] = runs[name](src.init_state(jax.random.key(0)))
    expected = float(checksum(arrays, np.ones(n, bool)))
    for name, total in totals.items():  # every transition once per epoch
        if not math.isclose(float(total), expected, rel_tol=1e-3):
            raise AssertionError(f"{name}: epoch checksum {float(total)} != {expected}")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name in variants:
            start = time.perf_counter()
            states[name], total = runs[name](states[name])
            jax.block_until_ready(total)
            times[name].append(time.perf_counter() - start)
    base = median(times["cyreal DiskSource"])
    rows = [
        [k, f"{n / median(v) / 1e6:.2f}", f"{median(v) * 1e3:.0f}", f"{base / median(v):.2f}x"]
        for k, v in times.items()
    ]
    return table(["variant", "M transitions/s", "ms/epoch", "vs cyreal"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k transitions, seconds")
    parser.add_argument("--transitions", type=int, default=None)
    parser.add_argument("--stream", type=int, default=None, help="transitions streamed (3.)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--loop", type=int, default=None, help="transitions the Python loop adds (1.)"
    )
    args = parser.parse_args()
    n = args.transitions or (100_000 if args.quick else 1_000_000)
    repeats = args.repeats or (2 if args.quick else 5)
    stream = args.stream or (50_000 if args.quick else 200_000)
    with tempfile.TemporaryDirectory() as root:
        os.environ["MINARI_DATASETS_PATH"] = root
        start = time.perf_counter()
        dataset = make_dataset(n)
        ends = [bool(ep.terminations[-1]) for ep in dataset.iterate_episodes()]
        print(
            f"dataset: {dataset.total_steps} transitions, {dataset.total_episodes} episodes "
            f"({sum(ends)} terminated, {len(ends) - sum(ends)} truncated), made in "
            f"{time.perf_counter() - start:.0f} s; jax {jax.__version__} on "
            f"{jax.devices()[0].platform}\n"
        )
        print(f"1. Fill a SimpleReplayBuffer with all {dataset.total_steps} transitions")
        loop = args.loop or (20_000 if args.quick else 100_000)
        print(bench_fill(dataset, repeats, loop) + "\n")
        print(f"2. One epoch of MLP updates (batch {BATCH}) in a jitted scan")
        print(bench_training(dataset, repeats) + "\n")
        print(f"3. Streaming one epoch of {min(stream, dataset.total_steps)} transitions")
        print(bench_stream(dataset, stream, repeats))


if __name__ == "__main__":
    main()
