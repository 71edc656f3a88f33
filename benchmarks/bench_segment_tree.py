"""Prioritized-replay step on a sum tree: coax_utils vs cpprb, flashbax and coax.

A PER training step is ``idx = tree.sample(B)`` followed by ``tree.set_values(idx, new_p)``
with fresh priorities (every update changes something). Variants, timed round robin in one
process over the grid N in {2^14, 2^17, 2^20} x B in {32, 256, 1024}:

- ``coax_utils``: :class:`coax_utils.utils.SumTree` (host, float64, numba kernels).
- ``cpprb``: ``cpprb.PrioritizedReplayBuffer.sample(B)`` + ``update_priorities`` (its
  segment trees are C++ internals; the stored item is one float).
- ``flashbax``: ``flashbax.buffers.sum_tree.stratified_sample`` + ``set_batch_scan`` (its
  CPU choice) in one ``jax.jit`` with the tree state donated; the key is split inside.
- ``coax``: coax's NumPy ``SumTree`` (file loaded on its own; coax's package does not import
  on current JAX).
- ``cu_functional`` (informative): ``coax_utils.utils.sum_tree_sample`` +
  ``sum_tree_set``, jitted with the state donated.

Before timing, every variant's sampler is checked: 200k draws at B in {1, 32, 256, 1024}
from 32 slots with known priorities; the total-variation distance to the priorities is
reported (it must stay below 0.01). After timing, every variant's stored priorities are
checked against the last written ones.

Run ``python benchmarks/bench_segment_tree.py`` (``--quick`` for a smoke run of a few
seconds).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

from coax_utils.utils import SumTree, sum_tree_init, sum_tree_sample, sum_tree_set, sum_tree_values

GRID_N = [2**14, 2**17, 2**20]
GRID_B = [32, 256, 1024]
POOL = 16  # distinct priority batches cycled through, so every update changes values


def load_coax_segment_tree():
    spec = importlib.util.find_spec("coax")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("coax is not installed: pip install --no-deps coax")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "_segment_tree.py")
    mod_spec = importlib.util.spec_from_file_location("_coax_segment_tree", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


# -- variants: each has fill(priorities), step(new_priorities) -> idx, values() ---------------


class CoaxUtilsVariant:
    name = "coax_utils"

    def __init__(self, n):
        self.tree = SumTree(n, random_seed=0)

    def fill(self, p):
        self.tree.set_values(..., p)

    def sample(self, b):
        return self.tree.sample(b)

    def step(self, b, new_p):
        idx = self.tree.sample(b)
        self.tree.set_values(idx, new_p)
        return idx

    def values(self):
        return np.asarray(self.tree.values)


class CoaxVariant(CoaxUtilsVariant):
    name = "coax"
    module = None

    def __init__(self, n):
        if CoaxVariant.module is None:
            CoaxVariant.module = load_coax_segment_tree()
        self.tree = CoaxVariant.module.SumTree(n, random_seed=0)


class CpprbVariant:
    name = "cpprb"

    def __init__(self, n):
        from cpprb import PrioritizedReplayBuffer

        self.n = n
        # alpha = 1 and a negligible eps: stored priorities equal the given ones
        self.rb = PrioritizedReplayBuffer(n, {"obs": {"shape": 1}}, alpha=1.0, eps=1e-12)

    def fill(self, p):
        self.rb.clear()
        self.rb.add(obs=np.zeros((self.n, 1), np.float32), priorities=p)

    def sample(self, b):
        return self.rb.sample(b)["indexes"]

    def step(self, b, new_p):
        idx = self.rb.sample(b)["indexes"]
        self.rb.update_priorities(idx, new_p)
        return idx

    def values(self):
        # read back through a sampling-free path: ask for the priority of every slot
        return None


class FlashbaxVariant:
    name = "flashbax"

    def __init__(self, n):
        from flashbax.buffers import sum_tree

        self.st = sum_tree
        self.n = n
        self.state = sum_tree.init(n)
        self.key = jax.random.key(0)
        self._steps = {}

    def _step_fn(self, b):
        if b not in self._steps:
            st = self.st

            @functools.partial(jax.jit, donate_argnums=0)
            def step(state, key, new_p):
                key, sub = jax.random.split(key)
                idx = st.stratified_sample(state, b, sub)
                return st.set_batch_scan(state, idx, new_p), key, idx

            @jax.jit
            def sample(state, key):
                key, sub = jax.random.split(key)
                return st.stratified_sample(state, b, sub), key

            self._steps[b] = (step, sample)
        return self._steps[b]

    def fill(self, p):
        self.state = self.st.init(self.n)
        self.state = jax.jit(self.st.set_batch_scan)(
            self.state, jnp.arange(self.n), jnp.asarray(p, jnp.float32)
        )

    def sample(self, b):
        idx, self.key = self._step_fn(b)[1](self.state, self.key)
        return np.asarray(idx)

    def step(self, b, new_p):
        self.state, self.key, idx = self._step_fn(b)[0](self.state, self.key, new_p)
        return jax.block_until_ready(idx)

    def prepare(self, pool):
        return [jnp.asarray(p, jnp.float32) for p in pool]

    def values(self):
        return np.asarray(self.st.get_batch(self.state, jnp.arange(self.n)))


class FunctionalVariant(FlashbaxVariant):
    name = "cu_functional"

    def __init__(self, n):
        self.n = n
        self.state = sum_tree_init(n)
        self.key = jax.random.key(0)
        self._steps = {}

    def _step_fn(self, b):
        if b not in self._steps:

            @functools.partial(jax.jit, donate_argnums=0)
            def step(state, key, new_p):
                key, sub = jax.random.split(key)
                idx = sum_tree_sample(state, sub, b, stratified=True)
                return sum_tree_set(state, idx, new_p), key, idx

            @jax.jit
            def sample(state, key):
                key, sub = jax.random.split(key)
                return sum_tree_sample(state, sub, b, stratified=True), key

            self._steps[b] = (step, sample)
        return self._steps[b]

    def fill(self, p):
        self.state = jax.jit(sum_tree_set)(
            sum_tree_init(self.n), jnp.arange(self.n), jnp.asarray(p, jnp.float32)
        )

    def values(self):
        return np.asarray(sum_tree_values(self.state))


VARIANTS = [CoaxUtilsVariant, CpprbVariant, FlashbaxVariant, CoaxVariant, FunctionalVariant]
PEERS = ["cpprb", "flashbax", "coax"]


# -- correctness --------------------------------------------------------------------------------


def check_sampling(draws, batch_sizes, threshold):
    """Total-variation distance of each sampler to known priorities over 32 slots."""
    rng = np.random.default_rng(1)
    p = rng.random(32) ** 2 + 1e-3
    target = p / p.sum()
    print(f"sampling check: TV distance over {draws} draws from 32 slots (must be < {threshold})")
    print(f"{'variant':<15}" + "".join(f"{'B=' + str(b):>10}" for b in batch_sizes))
    tvs = {}
    for cls in VARIANTS:
        v = cls(32)
        v.fill(p)
        row = []
        for b in batch_sizes:
            v.sample(b)  # warm up / compile
            idx = np.concatenate([np.asarray(v.sample(b)) for _ in range(max(1, draws // b))])
            freq = np.bincount(idx, minlength=32) / idx.size
            tv = 0.5 * np.abs(freq - target).sum()
            tvs[(cls.name, b)] = tv
            row.append(f"{tv:>9.4f}" + ("!" if tv >= threshold else " "))
        print(f"{cls.name:<15}" + "".join(row))
    print("(! marks a sampler that fails the check)\n")
    return tvs


def check_updates(variant, last_idx, last_p):
    """The stored priorities of the last step equal the last written ones (last write wins).

    flashbax sets a leaf by adding a float32 delta to it, hence the loose tolerance.
    """
    values = variant.values()
    if values is None:
        return True
    expected = {}
    for i, x in zip(np.asarray(last_idx).tolist(), np.asarray(last_p).tolist()):
        expected[i] = x
    keys = np.array(list(expected))
    return bool(np.allclose(values[keys], np.array(list(expected.values())), rtol=1e-4))


# -- timing -------------------------------------------------------------------------------------


def time_config(n, b, reps, target_s, names):
    rng = np.random.default_rng(0)
    p0 = rng.random(n) + 0.01
    pool = [rng.random(b) + 0.01 for _ in range(POOL)]
    variants = [cls(n) for cls in VARIANTS if cls.name in names]
    pools = {}
    for v in variants:
        v.fill(p0)
        pools[v.name] = v.prepare(pool) if hasattr(v, "prepare") else pool
        for i in range(3):  # warm up (jit compile, numba load)
            v.step(b, pools[v.name][i % POOL])
    # calibrate the number of steps per repetition on the slowest variant
    counts = {}
    for v in variants:
        k = 1
        while True:
            t0 = time.perf_counter()
            for i in range(k):
                v.step(b, pools[v.name][i % POOL])
            dt = time.perf_counter() - t0
            if dt >= target_s / 4 or k >= 1 << 16:
                break
            k *= 2
        counts[v.name] = max(1, int(k * target_s / max(dt, 1e-9)))
    times = {v.name: [] for v in variants}
    last = {}
    for _ in range(reps):
        for v in variants:  # round robin
            pl = pools[v.name]
            k = counts[v.name]
            t0 = time.perf_counter()
            for i in range(k):
                idx = v.step(b, pl[i % POOL])
            times[v.name].append((time.perf_counter() - t0) / k * 1e6)
            last[v.name] = (idx, pl[(k - 1) % POOL])
    ok = {v.name: check_updates(v, *last[v.name]) for v in variants}
    return times, ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--reps", type=int, default=None)
    _results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        # TV noise grows as 1 / sqrt(draws): 20k draws need a looser bound than 200k
        grid = [(2**14, 256)]
        reps, target_s, draws, sampling_bs, threshold = args.reps or 3, 0.01, 5_000, [1, 32], 0.05
    else:
        grid = [(n, b) for n in GRID_N for b in GRID_B]
        reps, target_s, draws = args.reps or 7, 0.1, 200_000
        sampling_bs, threshold = [1, 32, 256, 1024], 0.01
    import cpprb  # noqa: F401
    import flashbax  # noqa: F401

    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, jax {jax.__version__}, "
        f"{os.cpu_count()} cpus"
    )
    tvs = check_sampling(draws, sampling_bs, threshold)
    names = [cls.name for cls in VARIANTS]
    print("PER step (sample B + update B), microseconds per step: median [min-max]")
    header = f"{'N':>8} {'B':>5} " + "".join(f"{name:>25}" for name in names)
    print(header + "   ratios (peer median / coax_utils median)")
    worst, rows = {}, []
    for n, b in grid:
        times, ok = time_config(n, b, reps, target_s, names)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows += [
            dict(N=n, B=b, variant=k, median_us=med[k], min_us=min(t), max_us=max(t), ok=ok[k])
            for k, t in times.items()
        ]
        cells = []
        for name in names:
            t = times[name]
            flag = "" if ok[name] else "?"
            cells.append(f"{med[name]:>8.1f} [{min(t):.1f}-{max(t):.1f}]{flag}".rjust(25))
        ratios = "  ".join(f"{p} {med[p] / med['coax_utils']:.2f}x" for p in PEERS)
        print(f"{'2^' + str(n.bit_length() - 1):>8} {b:>5} " + "".join(cells) + "   " + ratios)
        fastest_peer = min(PEERS, key=lambda p: med[p])
        worst[(n, b)] = (fastest_peer, med[fastest_peer] / med["coax_utils"])
    print("(? marks a variant whose stored priorities did not match the last update)")
    ratio = min(r for _, r in worst.values())
    print(f"\nslowest margin over the fastest peer: {ratio:.2f}x")
    _results.write(args.results, "segment_tree", rows)
    fails = [k for k, tv in tvs.items() if tv >= threshold]
    print("sampling check failures:", ", ".join(f"{v} B={b}" for v, b in fails) or "none")


if __name__ == "__main__":
    main()
