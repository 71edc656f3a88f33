"""Replay across devices: the mesh-sharded prioritized buffer on 8 forced CPU devices.

One step is ``add`` of ``B`` small items (CartPole-sized: 4 + 4 float32, an action, a
reward), ``sample`` of ``B`` items and ``update`` of their ``B`` priorities (fresh ones
every step), one ``jax.jit`` with the state donated, over the grid of
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


# -- variants: fill(), step(), share() ----------------------------------------------------------


class OneDevice:
    name = "one_device"

    def __init__(self, n: int, b: int, mesh: Mesh):
        self.n, self.b = n, b
        self.buf = make_prioritized_buffer(n, alpha=ALPHA, beta=0.4, epsilon=1e-6)
        dev = jax.devices()[0]
        self.put = lambda x: jax.device_put(x, dev)
        self.keys = self.put(jax.random.split(jax.random.key(1), NKEYS))
        self.batches = [self.put(items(b, k * b)) for k in range(4)]
        buf, keys = self.buf, self.keys

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, batch, step):
            state = buf.add(state, batch)
            s = buf.sample(state, keys[step % NKEYS], b)
            state = buf.update(state, s.indices, new_priorities(s.indices, step), s.versions)
            return state, (s.items, s.weights), step + 1

        self._step = step
        self.state = buf.init(jax.tree_util.tree_map(lambda x: x[0], self.batches[0]))
        self.t = self.put(np.int32(0))

    def fill(self):
        add = jax.jit(self.buf.add, donate_argnums=0)
        chunk = min(self.n, 65536)
        for lo in range(0, self.n, chunk):
            self.state = add(self.state, self.put(items(chunk, lo)))

    def step(self, k: int):
        self.state, out, self.t = self._step(self.state, self.batches[k % 4], self.t)
        jax.block_until_ready((self.state, out))

    def share(self) -> float:
        idx = jnp.arange(self.n, dtype=jnp.int32)
        state = jax.jit(self.buf.update)(self.state, idx, pattern(idx))
        r = [np.asarray(self.buf.sample(state, self.keys[k], self.b).items["r"]) for k in range(64)]
        return float(np.mean(np.concatenate(r) % 4 == 0))


class Sharded(OneDevice):
    name, scope = "sharded_mesh", "mesh"

    def __init__(self, n: int, b: int, mesh: Mesh):
        self.n, self.b = n, b
        big = make_prioritized_buffer(n, alpha=ALPHA, beta=0.4, epsilon=1e-6)
        self.buf = mb = shard_buffer(big, mesh, "data")
        scope = self.scope
        rep, shard = mb.replicated, mb.batch_sharding
        self.put = lambda x: jax.device_put(x, shard)
        self.keys = keys = jax.device_put(jax.random.split(jax.random.key(1), NKEYS), rep)
        self.batches = [self.put(items(b, k * b)) for k in range(4)]

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, batch, step):
            state = mb.add(state, batch)
            s = mb.sample(state, keys[step % NKEYS], b, scope=scope)
            p = new_priorities(s.indices, step)
            state = mb.update(state, s.indices, p, s.versions, scope=scope)
            return state, (s.items, s.weights), step + 1

        self._step = step
        self.state = mb.init(jax.tree_util.tree_map(lambda x: x[0], items(1)))
        self.t = jax.device_put(np.int32(0), rep)

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

    def __init__(self, n: int, b: int, mesh: Mesh):
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

        def step(state, batch, keys, step):
            state = fb.add(state, batch)
            s = fb.sample(state, jax.random.wrap_key_data(keys[step % NKEYS]))
            state = fb.set_priorities(state, s.indices, new_priorities(s.indices, step))
            return state, (s.experience, s.probabilities), step + 1

        self._pstep = jax.pmap(step, axis_name="data", donate_argnums=0, devices=devices)
        example = jax.tree_util.tree_map(lambda x: x[0], items(1))
        self.state = jax.pmap(lambda _: fb.init(example), devices=devices)(jnp.arange(D))
        self.t = self.put(np.zeros(D, np.int32))

    def put_tree(self, tree):
        return jax.tree_util.tree_map(self.put, tree)

    def fill(self):
        add = jax.pmap(self.fb.add, donate_argnums=0, devices=jax.devices()[:D])
        chunk = min(self.n, 65536)
        for lo in range(0, self.n, chunk):
            self.state = add(self.state, self.put_tree(self.split(items(chunk, lo))))

    def step(self, k: int):
        self.state, out, self.t = self._pstep(self.state, self.batches[k % 4], self.keys, self.t)
        jax.block_until_ready((self.state, out))

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


def dispatch_floor(mesh: Mesh, reps: int) -> tuple[float, float]:
    """Microseconds per step of a jitted step that does nothing but add 1 to a donated
    array: on one device, and on every device of ``mesh`` (a shard each). The second is
    what any step sharded over the forced host devices costs at least."""
    one = jax.jit(lambda x: x + 1, donate_argnums=0)
    spec = jax.sharding.PartitionSpec("data")
    every = jax.jit(
        jax.shard_map(lambda x: x + 1, mesh=mesh, in_specs=spec, out_specs=spec),
        donate_argnums=0,
    )
    sharding = jax.sharding.NamedSharding(mesh, spec)
    states = [jnp.zeros(D), jax.device_put(jnp.zeros(D), sharding)]
    times: list[list[float]] = [[], []]
    for r in range(reps + 1):  # the first round warms up
        for i, f in enumerate((one, every)):
            t0 = time.perf_counter()
            for _ in range(200):
                states[i] = f(states[i])
                jax.block_until_ready(states[i])
            if r:
                times[i].append((time.perf_counter() - t0) / 200 * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def time_config(n: int, b: int, mesh: Mesh, reps: int, rep_s: float, check: bool) -> dict:
    variants = [cls(n, b, mesh) for cls in VARIANTS]
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
            times[v.name].append((time.perf_counter() - t0) / m * 1e6)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of one configuration")
    parser.add_argument("--reps", type=int, default=None)
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
    floor_one, floor_all = dispatch_floor(mesh, reps)
    print(
        f"an empty step (x + 1, donated): {floor_one:.1f} us on one device, {floor_all:.1f} us "
        f"on the {D} devices ({floor_all / floor_one:.1f}x)"
    )
    print("step (add B + sample B + update B), microseconds per step: median [min-max]")
    names = [cls.name for cls in VARIANTS]
    print(f"{'N':>6} {'B':>5} " + "".join(f"{x:>24}" for x in names))
    rows, ratios = [], {r: [] for r in RATIOS}
    for i, (n, b) in enumerate(grid):
        times = time_config(n, b, mesh, reps, rep_s, check=i == 0)
        med = {k: statistics.median(t) for k, t in times.items()}
        rows += [
            dict(N=n, B=b, variant=k, median_us=med[k], min_us=min(t), max_us=max(t))
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
