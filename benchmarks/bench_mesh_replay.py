"""Replay across devices: the mesh-sharded prioritized buffer on 8 forced CPU devices.

One step is ``add`` of ``B`` small items (CartPole-sized: 4 + 4 float32, an action, a
reward), ``sample`` of ``B`` items and ``update`` of their ``B`` priorities (fresh ones
every step; the sampled items and weights are read into a per-row checksum, as a loss
would read them). ``K`` steps run as one ``jax.lax.scan`` in one ``jax.jit`` call with the
state donated (``--steps-per-call K``, 50 by default: chunks of steps in one call are how
``examples/anakin_dqn.py`` trains; ``K = 1`` times a call per step, which on forced host
devices mostly times the hand-over of the call to the 8 device threads), over the grid of
``bench_segment_tree.py``: total capacity ``N`` in {2^14, 2^17, 2^20} x total batch ``B``
in {32, 256, 1024}, buffers full before timing. Variants, timed round robin in one process:

- ``sharded_mesh``: ``shard_buffer(make_prioritized_buffer(N), mesh, "data")`` on 8
  devices: each device holds ``N / 8`` rows and writes ``B / 8`` items; the sample
  (``scope="mesh"``) is exact over the whole buffer (its ``B`` rows come out sharded,
  ``B / 8`` per device), the update routes each priority to its owner.
- ``sharded_shard``: the same buffer with ``scope="shard"`` sample and update: each device
  samples ``B / 8`` rows of its own shard by its own priorities and updates them; no
  collective.
- ``one_device``: ``make_prioritized_buffer(N)`` on one device doing the same total work
  (goal: sharded <= 1.25x its time).
- ``flashbax_pmap``: flashbax's prioritised item buffer under ``jax.pmap`` on the same 8
  devices, ``N / 8`` rows and a sample of ``B / 8`` per device drawn from that device's
  buffer only (per-device priorities, as flashbax does it; goal: ours >= 1x as fast).
  Like with like is ``sharded_shard``; ``sharded_mesh`` is compared too, although its
  sample is over the whole buffer.

Before timing, each variant's sampler is checked at one size: with priority 8 on every
fourth slot and 1 elsewhere, the share of those slots in 64 samples must match
``8**a / (8**a + 3)`` (a = 0.6) within 6 standard errors.

The 8 devices are host devices (``--xla_force_host_platform_device_count=8``, set here
before jax starts) sharing the machine's cores, so the figures show the cost of sharding
and of the collectives, not a speed-up from more hardware.

Run ``python benchmarks/bench_mesh_replay.py`` (``--quick`` for a smoke run of one
configuration).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

from coax_utils.replay import make_prioritized_buffer, shard_buffer  # noqa: E402

GRID_N = [2**14, 2**17, 2**20]
GRID_B = [32, 256, 1024]
ALPHA = 0.6
NKEYS = 256
D = 8  # devices


def items(n: int, start: int = 0) -> dict:
    i = np.arange(start, start + n)
    return {
        "s": np.stack([i, -i, i, -i], 1).astype(np.float32),
        "a": (i % 2).astype(np.int32),
        "r": i.astype(np.float32),
        "s_next": np.stack([i + 1, -i, i, -i], 1).astype(np.float32),
    }


def new_priorities(indices: jax.Array, step: jax.Array) -> jax.Array:
    # changes every step (a rewrite of the same value could be skipped by a variant)
    x = indices.astype(jnp.float32) * 0.6180339 + step.astype(jnp.float32) * 0.1
    return x - jnp.floor(x) + 0.05


def pattern(indices: jax.Array) -> jax.Array:
    return jnp.where(indices % 4 == 0, 8.0, 1.0)


def checksum(items: dict, weights: jax.Array) -> jax.Array:
    """One number per sampled row from all it holds (row-wise: no sum across devices)."""
    return items["s"].sum(-1) + items["s_next"].sum(-1) + items["a"] + items["r"] + weights


def scanned(step, steps: int):
    """``steps`` calls of ``step(state, batch, t) -> (state, items, weights)`` as one scan:
    ``(state, batch, t, acc) -> (state, t + steps, acc + the rows' checksums)``."""

    def run(state, batch, t, acc):
        def body(carry, _):
            state, t, acc = carry
            state, items, weights = step(state, batch, t)
            return (state, t + 1, acc + checksum(items, weights)), None

        return jax.lax.scan(body, (state, t, acc), None, length=steps)[0]

    return run


# -- variants: fill(), step(), share() ----------------------------------------------------------


class OneDevice:
    name = "one_device"

    def __init__(self, n: int, b: int, mesh: Mesh, steps: int):
        self.n, self.b = n, b
        self.buf = make_prioritized_buffer(n, alpha=ALPHA, beta=0.4, epsilon=1e-6)
        dev = jax.devices()[0]
        self.put = lambda x: jax.device_put(x, dev)
        self.keys = self.put(jax.random.split(jax.random.key(1), NKEYS))
        self.batches = [self.put(items(b, k * b)) for k in range(4)]
        buf, keys = self.buf, self.keys

        def step(state, batch, t):
            state = buf.add(state, batch)
            s = buf.sample(state, keys[t % NKEYS], b)
            state = buf.update(state, s.indices, new_priorities(s.indices, t), s.versions)
            return state, s.items, s.weights

        self._run = jax.jit(scanned(step, steps), donate_argnums=(0, 3))
        self.state = buf.init(jax.tree_util.tree_map(lambda x: x[0], self.batches[0]))
        self.t = self.put(np.int32(0))
        self.acc = self.put(np.zeros(b, np.float32))

    def fill(self):
        add = jax.jit(self.buf.add, donate_argnums=0)
        chunk = min(self.n, 65536)
        for lo in range(0, self.n, chunk):
            self.state = add(self.state, self.put(items(chunk, lo)))

    def step(self, k: int):
        """One call: ``--steps-per-call`` steps."""
        out = self._run(self.state, self.batches[k % 4], self.t, self.acc)
        self.state, self.t, self.acc = jax.block_until_ready(out)

    def share(self) -> float:
        idx = jnp.arange(self.n, dtype=jnp.int32)
        state = jax.jit(self.buf.update)(self.state, idx, pattern(idx))
        r = [np.asarray(self.buf.sample(state, self.keys[k], self.b).items["r"]) for k in range(64)]
        return float(np.mean(np.concatenate(r) % 4 == 0))


class Sharded(OneDevice):
    name, scope = "sharded_mesh", "mesh"

    def __init__(self, n: int, b: int, mesh: Mesh, steps: int):
        self.n, self.b = n, b
        big = make_prioritized_buffer(n, alpha=ALPHA, beta=0.4, epsilon=1e-6)
        self.buf = mb = shard_buffer(big, mesh, "data")
        scope = self.scope
        rep, shard = mb.replicated, mb.batch_sharding
        self.put = lambda x: jax.device_put(x, shard)
        self.keys = keys = jax.device_put(jax.random.split(jax.random.key(1), NKEYS), rep)
        self.batches = [self.put(items(b, k * b)) for k in range(4)]

        def step(state, batch, t):
            state = mb.add(state, batch)
            s = mb.sample(state, keys[t % NKEYS], b, scope=scope)
            p = new_priorities(s.indices, t)
            state = mb.update(state, s.indices, p, s.versions, scope=scope)
            return state, s.items, s.weights

        self._run = jax.jit(scanned(step, steps), donate_argnums=(0, 3))
        self.state = mb.init(jax.tree_util.tree_map(lambda x: x[0], items(1)))
        self.t = jax.device_put(np.int32(0), rep)
        self.acc = self.put(np.zeros(b, np.float32))

    def share(self) -> float:
        idx = self.put(np.arange(self.n, dtype=np.int32))
        # waited for: several collective programs in flight can deadlock on host devices
        state = jax.block_until_ready(self.buf.update(self.state, idx, jax.jit(pattern)(idx)))
        r = [
            np.asarray(self.buf.sample(state, self.keys[k], self.b, scope=self.scope).items["r"])
            for k in range(64)
        ]
        return float(np.mean(np.concatenate(r) % 4 == 0))


class ShardedShard(Sharded):
    name, scope = "sharded_shard", "shard"


class FlashbaxPmap(OneDevice):
    name = "flashbax_pmap"

    def __init__(self, n: int, b: int, mesh: Mesh, steps: int):
        import flashbax

        self.n, self.b = n, b
        self.fb = fb = flashbax.make_prioritised_item_buffer(
            max_length=n // D,
            min_length=1,
            sample_batch_size=b // D,
            add_batches=True,
            priority_exponent=ALPHA,
        )
        devices = jax.devices()[:D]
        # arrays laid out as pmap lays out its outputs, so no step copies its inputs
        self.put = jax.pmap(lambda x: x, devices=devices)
        split = lambda x: np.reshape(x, (D, -1) + np.shape(x)[1:])  # noqa: E731
        self.split = lambda tree: jax.tree_util.tree_map(split, tree)
        keys = np.stack(
            [jax.random.key_data(jax.random.split(jax.random.key(d), NKEYS)) for d in range(D)]
        )
        self.keys = self.put(keys)
        self.batches = [self.put_tree(self.split(items(b, k * b))) for k in range(4)]

        def run(state, batch, t, acc, keys):
            def step(state, batch, t):
                state = fb.add(state, batch)
                s = fb.sample(state, jax.random.wrap_key_data(keys[t % NKEYS]))
                state = fb.set_priorities(state, s.indices, new_priorities(s.indices, t))
                # flashbax returns probabilities: the weights, as ours (same formula)
                w = (s.probabilities * (n // D)) ** -0.4
                return state, s.experience, w / jnp.max(w)

            return scanned(step, steps)(state, batch, t, acc)

        self._run = jax.pmap(run, axis_name="data", donate_argnums=(0, 3), devices=devices)
        example = jax.tree_util.tree_map(lambda x: x[0], items(1))
        self.state = jax.pmap(lambda _: fb.init(example), devices=devices)(jnp.arange(D))
        self.t = self.put(np.zeros(D, np.int32))
        self.acc = self.put(np.zeros((D, b // D), np.float32))

    def put_tree(self, tree):
        return jax.tree_util.tree_map(self.put, tree)

    def fill(self):
        add = jax.pmap(self.fb.add, donate_argnums=0, devices=jax.devices()[:D])
        chunk = min(self.n, 65536)
        for lo in range(0, self.n, chunk):
            self.state = add(self.state, self.put_tree(self.split(items(chunk, lo))))

    def step(self, k: int):
        out = self._run(self.state, self.batches[k % 4], self.t, self.acc, self.keys)
        self.state, self.t, self.acc = jax.block_until_ready(out)

    def share(self) -> float:
        fb = self.fb

        def set_and_sample(state, keys):
            idx = jnp.arange(self.n // D, dtype=jnp.int32)
            state = fb.set_priorities(state, idx, pattern(idx))
            draw = lambda k: fb.sample(state, jax.random.wrap_key_data(k)).experience["r"]  # noqa: E731
            return jax.lax.map(draw, keys[:64])

        r = jax.pmap(set_and_sample, devices=jax.devices()[:D])(self.state, self.keys)
        # each device's rows r = d * (n / D) + slot... within a device's own buffer: slot % 4
        return float(np.mean((np.asarray(r) % (self.n // D)) % 4 == 0))


VARIANTS = [Sharded, ShardedShard, OneDevice, FlashbaxPmap]
RATIOS = [  # (numerator, denominator, goal, "<=" or ">=")
    ("sharded_mesh", "one_device", 1.25, "<="),
    ("sharded_shard", "one_device", 1.25, "<="),
    ("flashbax_pmap", "sharded_shard", 1.0, ">="),
    ("flashbax_pmap", "sharded_mesh", 1.0, ">="),
]


def floors(mesh: Mesh, steps: int, reps: int) -> list[float]:
    """Microseconds per step of three steps that do almost nothing, ``steps`` to a call as
    the variants run: add 1 to a donated array on one device; the same on every device of
    ``mesh`` (a shard each); and there, add the sum over the devices (one collective of 8
    floats, as the exact sample's totals). What a step costs at least on the forced host
    devices, and what each collective adds."""

    def chain(f):
        return lambda x: jax.lax.scan(lambda x, _: (f(x), None), x, None, length=steps)[0]

    spec = jax.sharding.PartitionSpec("data")
    on_mesh = functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
    fns = [
        chain(lambda x: x + 1),
        on_mesh(chain(lambda x: x + 1)),
        on_mesh(chain(lambda x: x + jax.lax.psum(x, "data") * 1e-9)),
    ]
    fns = [jax.jit(f, donate_argnums=0) for f in fns]
    sharding = jax.sharding.NamedSharding(mesh, spec)
    states = [jnp.zeros(D)] + [jax.device_put(jnp.zeros(D), sharding) for _ in range(2)]
    times: list[list[float]] = [[] for _ in fns]
    calls = max(1, 2000 // steps)
    for r in range(reps + 1):  # the first round warms up
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                states[i] = jax.block_until_ready(f(states[i]))
            if r:
                times[i].append((time.perf_counter() - t0) / (calls * steps) * 1e6)
    return [statistics.median(t) for t in times]


def time_config(
    n: int, b: int, mesh: Mesh, steps: int, reps: int, rep_s: float, check: bool
) -> dict:
    """Microseconds per step (a call runs ``steps``) of every variant, ``reps`` rounds."""
    variants = [cls(n, b, mesh, steps) for cls in VARIANTS]
    for v in variants:
        v.fill()
    shares = {}
    if check:
        expected = 8.0**ALPHA / (8.0**ALPHA + 3.0)
        tol = 6 * np.sqrt(expected * (1 - expected) / (64 * b))
        for v in variants:
            shares[v.name] = v.share()
            ok = abs(shares[v.name] - expected) < tol
            print(
                f"  sampling check {v.name}: share {shares[v.name]:.4f} (expected "
                f"{expected:.4f} +- {tol:.4f}) {'ok' if ok else 'FAILED'}"
            )
            if not ok:
                raise AssertionError(f"{v.name} does not sample by priority")
    counts = {}
    for v in variants:
        for k in range(3):
            v.step(k)  # warm up (compile)
        m = 1
        while True:
            t0 = time.perf_counter()
            for k in range(m):
                v.step(k)
            dt = time.perf_counter() - t0
            if dt >= rep_s / 4 or m >= 1 << 14:
                break
            m *= 2
        counts[v.name] = max(1, int(m * rep_s / max(dt, 1e-9)))
    times = {v.name: [] for v in variants}
    for _ in range(reps):
        for v in variants:  # round robin
            m = counts[v.name]
            t0 = time.perf_counter()
            for k in range(m):
                v.step(k)
            times[v.name].append((time.perf_counter() - t0) / (m * steps) * 1e6)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of one configuration")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument(
        "--steps-per-call", type=int, default=50, help="steps in one jitted call (default 50)"
    )
    _results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        grid, reps, rep_s = [(2**14, 256)], args.reps or 3, 0.05
    else:
        grid, reps, rep_s = [(n, b) for n in GRID_N for b in GRID_B], args.reps or 5, 0.2
    import flashbax  # noqa: F401

    assert len(jax.devices()) == D, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, jax {jax.__version__}, "
        f"{os.cpu_count()} cpus, {D} forced host devices, load average "
        f"{os.getloadavg()[0]:.2f} at start"
    )
    one, every, psum = floors(mesh, args.steps_per_call, reps)
    print(
        f"an empty step (x + 1, donated, {args.steps_per_call} per call): {one:.1f} us on one "
        f"device, {every:.1f} us on the {D} devices, {psum:.1f} us there with one psum"
    )
    print(
        f"step (add B + sample B + update B), {args.steps_per_call} steps per call, "
        "microseconds per step: median [min-max]"
    )
    names = [cls.name for cls in VARIANTS]
    print(f"{'N':>6} {'B':>5} " + "".join(f"{x:>24}" for x in names))
    rows, ratios = [], {r: [] for r in RATIOS}
    for i, (n, b) in enumerate(grid):
        times = time_config(n, b, mesh, args.steps_per_call, reps, rep_s, check=i == 0)
        med = {k: statistics.median(t) for k, t in times.items()}
        rows += [
            dict(
                N=n,
                B=b,
                steps_per_call=args.steps_per_call,
                variant=k,
                median_us=med[k],
                min_us=min(t),
                max_us=max(t),
            )
            for k, t in times.items()
        ]
        for r in RATIOS:
            ratios[r].append(med[r[0]] / med[r[1]])
        cells = "".join(
            f"{med[k]:>8.1f} [{min(times[k]):.1f}-{max(times[k]):.1f}]".rjust(24) for k in names
        )
        print(f"{'2^' + str(n.bit_length() - 1):>6} {b:>5} {cells}", flush=True)
    print("\nratios of median times (columns as in the grid above)")
    print(f"{'N':>6} {'B':>5} " + "".join(f"{a + '/' + b:>29}" for a, b, _, _ in RATIOS))
    for i, (n, b) in enumerate(grid):
        cells = "".join(f"{ratios[r][i]:>28.2f}x" for r in RATIOS)
        print(f"{'2^' + str(n.bit_length() - 1):>6} {b:>5} {cells}")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    for r in RATIOS:
        a, b, goal, how = r
        worst = max(ratios[r]) if how == "<=" else min(ratios[r])
        met = worst <= goal if how == "<=" else worst >= goal
        word = "largest" if how == "<=" else "smallest"
        print(f"{word} {a}/{b}: {worst:.2f}x (goal {how} {goal}x: {'met' if met else 'not met'})")
    _results.write(args.results, "mesh_replay", rows)


if __name__ == "__main__":
    main()
