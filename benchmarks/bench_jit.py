"""Cached-call overhead of ``coax_utils.utils.jit`` against ``jax.jit`` and coax's ``jit``.

Each variant wraps the same function; after a warm-up (compilation), every repetition calls
it ``n`` times on the same inputs and blocks on the last result, inside the timed region.
Variants run round robin (A B C A B C ...). Reported: microseconds per call, median and
min-max over repetitions, and the ratio of medians against ``jax.jit`` (plus the ratio of the
minima, which is less sensitive to other processes on a busy machine). ``--clock cpu`` times
with the CPU time of this process instead of wall time, which is what to use on a machine
shared with other jobs.

Run: ``python benchmarks/bench_jit.py`` (``--quick`` for a smoke run of a few seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils import utils


def load_coax_jit():
    """coax's jit, loaded from its single file (coax's __init__ does not import on new JAX)."""
    package = importlib.util.find_spec("coax")  # locate without importing coax/__init__
    path = pathlib.Path(package.submodule_search_locations[0]) / "utils" / "_jit.py"
    spec = importlib.util.spec_from_file_location("coax_jit_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.jit


def one_array(x):
    return x * 2.0 + 1.0


def pytree_args(params, x):
    return params["w"] @ x + params["b"] + params["c"].sum() + params["d"]


def static_kwarg(x, n):
    for _ in range(n):
        x = x + 1.0
    return x


def workloads():
    x = jnp.ones((8,), jnp.float32)
    params = {
        "w": jnp.ones((4, 8)),
        "b": jnp.zeros(4),
        "c": jnp.ones((2, 2)),
        "d": jnp.ones(()),
    }
    return [
        ("f(x)", one_array, {}, (x,), {}),
        ("f(params, x)", pytree_args, {}, (params, x), {}),
        ("f(x, n=3) static", static_kwarg, {"static_argnames": "n"}, (x,), {"n": 3}),
    ]


def make_variants(func, options, coax_jit):
    variants = {
        "jax.jit": jax.jit(func, **options),
        "coax_utils.utils.jit": utils.jit(func, **options),
    }
    if "static_argnames" not in options:  # coax's jit has no static_argnames
        variants["coax.utils.jit"] = coax_jit(func, **options)
    return variants


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_calls(f, args, kwargs, n, clock=time.perf_counter):
    t0 = clock()
    for _ in range(n):
        out = f(*args, **kwargs)
    jax.block_until_ready(out)
    return clock() - t0


def calibrate(f, args, kwargs, target_s):
    n = 100
    while True:
        dt = time_calls(f, args, kwargs, n)
        if dt >= target_s / 4:
            return max(1, int(n * target_s / dt))
        n *= 4


def run(quick: bool, clock_name: str = "wall") -> str:
    coax_jit = load_coax_jit()
    clock = CLOCKS[clock_name]
    reps, target_s = (3, 0.05) if quick else (25, 0.06)
    lines = [
        f"jax {jax.__version__}, backend {jax.default_backend()}, {reps} repetitions of "
        f"~{target_s:.2f} s per variant, round robin, {clock_name} clock",
        f"{'workload':<18} {'variant':<22} {'us/call median':>14} {'[min - max]':>17} "
        f"{'ratio vs jax.jit':>16} {'(ratio of mins)':>15}",
    ]
    for name, func, options, args, kwargs in workloads():
        variants = make_variants(func, options, coax_jit)
        # correctness of every variant, and warm-up (compilation) outside the timing
        expected = np.asarray(func(*args, **kwargs))
        for f in variants.values():
            np.testing.assert_allclose(np.asarray(f(*args, **kwargs)), expected, rtol=1e-6)
            time_calls(f, args, kwargs, 200)
        n = calibrate(variants["jax.jit"], args, kwargs, target_s)
        samples = {label: [] for label in variants}
        for _ in range(reps):
            for label, f in variants.items():
                samples[label].append(time_calls(f, args, kwargs, n, clock) / n * 1e6)
        base = statistics.median(samples["jax.jit"])
        base_min = min(samples["jax.jit"])
        for label, values in samples.items():
            med = statistics.median(values)
            lines.append(
                f"{name:<18} {label:<22} {med:>14.3f} "
                f"[{min(values):>6.3f} - {max(values):>6.3f}] {med / base:>16.3f} "
                f"{min(values) / base_min:>15.3f}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fast smoke run")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: time.perf_counter; cpu: time.process_time (CPU time of this process, "
        "robust to other processes competing for the cores)",
    )
    args = parser.parse_args()
    print(run(args.quick, args.clock))


if __name__ == "__main__":
    main()
