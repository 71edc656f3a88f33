"""Training-loop stall per checkpoint: CheckpointManager(background=True) vs a synchronous dump.

The state is the agent-like checkpoint of ``bench_checkpoint.py`` (about 250 MB: Haiku-style
params and an adam state as jax arrays, a replay block of numpy arrays), and the same state
with every leaf a jax array. Per state, timed round robin after a warm-up, each call after
an ``os.sync`` and with no save pending:

- ``utils.dump``: the synchronous dump of the state to a file (the loop waits for all of it);
- ``manager.save``: how long ``save`` blocks the caller with ``background=True`` (the copy
  of the state to host memory); compression and writing then run on a background thread.

Reported: the medians (min-max), the ratio stall / dump (target: at most 0.15), the time
until the background save had completed, and how fast a loop of small jitted steps (a
stand-in for training) ran while the background save was writing, relative to the same
loop with nothing in the background (the machine's cores are shared with the writer).

Run ``python benchmarks/bench_checkpoint_manager.py`` (about 250 MB; a minute or two) or
``--quick`` (about 25 MB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from bench_checkpoint import assert_same, make_checkpoint, nbytes

from coax_utils import utils


@jax.jit
def train_step(w: jax.Array) -> jax.Array:
    return jnp.tanh(w @ w) * 0.5


def steps_per_second(until, w: jax.Array, min_seconds: float = 0.0) -> float:
    """Run ``train_step`` until ``until()`` is true (and at least ``min_seconds``)."""
    n, t0 = 0, time.perf_counter()
    while not until() or time.perf_counter() - t0 < min_seconds:
        w = train_step(w).block_until_ready()
        n += 1
    return n / (time.perf_counter() - t0)


def bench_state(name: str, state, folder: str, repeats: int) -> list[str]:
    folder = tempfile.mkdtemp(dir=folder)
    dump_path = os.path.join(folder, "dump.ckpt")
    manager = utils.CheckpointManager(os.path.join(folder, "managed"), max_to_keep=2)
    w = jnp.full((64, 64), 0.01, jnp.float32)
    step = 0
    dump_s, stall_s, total_s, loop_ratio = [], [], [], []

    def timed_dump() -> None:
        t0 = time.perf_counter()
        utils.dump(state, dump_path)
        dump_s.append(time.perf_counter() - t0)

    def timed_save() -> None:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        manager.save(step, state)
        stall_s.append(time.perf_counter() - t0)
        # train while the background save writes; the step shows up once it is complete
        busy = steps_per_second(lambda: manager.latest_step() == step, w)
        total_s.append(time.perf_counter() - t0)
        manager.wait()
        idle = steps_per_second(lambda: True, w, min_seconds=0.3)
        loop_ratio.append(busy / idle)

    for fn in (timed_dump, timed_save):  # warm-up (jit, page cache, allocator)
        os.sync()
        fn()
    dump_s.clear(), stall_s.clear(), total_s.clear(), loop_ratio.clear()
    for _ in range(repeats):
        for fn in (timed_dump, timed_save):
            os.sync()
            fn()
    assert_same(manager.restore(), state)
    assert_same(utils.load(dump_path), state)
    manager.close()

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:8.0f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"

    ratio = statistics.median(stall_s) / statistics.median(dump_s)
    return [
        f"{name}: {nbytes(state) / 1e6:.0f} MB",
        f"  utils.dump (synchronous)        ms {cell(dump_s)}",
        f"  manager.save stall (background) ms {cell(stall_s)}   stall/dump {ratio:.3f}",
        f"  save until complete             ms {cell(total_s)}",
        f"  training steps/s during the background write: "
        f"{statistics.median(loop_ratio):.2f} of the rate without one",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small object, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dir", default=None, help="folder for the files (default: a temp dir)")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    repeats = args.repeats or 3
    agent = make_checkpoint(scale)
    all_jax = jax.tree_util.tree_map(jnp.asarray, agent)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{os.cpu_count()} CPUs, repeats={repeats}, load average {load:.1f}")
    out = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        out += bench_state("agent (jax params + numpy replay)", agent, folder, repeats)
        out += bench_state("all leaves jax arrays", all_jax, folder, repeats)
    print("\n".join(out))


if __name__ == "__main__":
    main()
