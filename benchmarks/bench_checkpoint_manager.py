"""Training-loop stall per checkpoint: CheckpointManager(background=True) vs a synchronous dumps.

States:

- ``agent``: the agent-like checkpoint of ``bench_checkpoint.py`` (about 250 MB: Haiku-style
  params and an adam state as jax arrays, a replay block of numpy arrays);
- ``all jax``: the same with every leaf a jax array;
- ``[x] * 20``: one list ``x`` of 1M Python ints referenced 20 times (the snapshot copies it
  once; a walk that expands references copies it 20 times);
- ``cyclic agent``: the agent dict holding itself (a cycle, which ``dump`` puts in the pickle
  section);
- ``many leaves``: params of 200 small layers and their adam state, 1201 jax arrays of at most
  16 KB (10 MB; the same at ``--quick``): the cost per object of the snapshot's walk.

Per state, timed round robin after a warm-up, each call after an ``os.sync`` and with no save
pending:

- ``utils.dumps``: the synchronous serialization of the state (the loop waits for all of it);
- ``manager.save``: how long ``save`` blocks the caller with ``background=True`` (the snapshot
  of the state); compression and writing then run on a background thread;
- ``bare copy``: ``np.copy`` of every array leaf of the state into fresh memory (for the list
  state, ``list(x)``): what a snapshot that copied everything would cost at least.

The warm-up makes two saves: a manager keeps the memory of its copies from one save to the
next, so only its first saves take fresh memory; the stall of the first save is reported too.
Reported: the medians (min-max) of wall and CPU time (all threads of the process; the stall's
CPU time also counts what the writer thread does before ``save`` returns), the ratios stall /
dumps (target: at most 0.15; on a loaded machine the CPU ratio is the steadier), the time until
the background save had completed, and how fast a loop of small jitted steps (a stand-in for
training) ran while the background save was writing, relative to the same loop with nothing in
the background (the machine's cores are shared with the writer). Each restored checkpoint is
checked against the state.

Run ``python benchmarks/bench_checkpoint_manager.py`` (about 250 MB; a few minutes) or
``--quick`` (a tenth of the sizes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_checkpoint import assert_same, make_checkpoint, nbytes

from coax_utils import utils


@jax.jit
def train_step(w: jax.Array) -> jax.Array:
    return jnp.tanh(w @ w) * 0.5


def steps_per_second(until: Callable[[], bool], w: jax.Array, min_seconds: float = 0.0) -> float:
    """Run ``train_step`` until ``until()`` is true (and at least ``min_seconds``)."""
    n, t0 = 0, time.perf_counter()
    while not until() or time.perf_counter() - t0 < min_seconds:
        w = train_step(w).block_until_ready()
        n += 1
    return n / (time.perf_counter() - t0)


def bench_state(
    name: str,
    size: str,
    state: Any,
    check: Callable[[Any], None],
    bare: Callable[[], Any],
    folder: str,
    repeats: int,
) -> tuple[list[str], float, float]:
    manager = utils.CheckpointManager(tempfile.mkdtemp(dir=folder), max_to_keep=2)
    w = jnp.full((64, 64), 0.01, jnp.float32)
    step = 0
    times: dict[str, list[float]] = {
        k: [] for k in ("dumps", "dumps_cpu", "save", "save_cpu", "bare", "bare_cpu", "total")
    }
    loop_ratio: list[float] = []

    def timed(key: str, fn: Callable[[], Any]) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        times[key].append(time.perf_counter() - t0)
        times[key + "_cpu"].append(time.process_time() - c0)
        del out

    def timed_save() -> None:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        timed("save", lambda: manager.save(step, state))
        # train while the background save writes; the step shows up once it is complete
        busy = steps_per_second(lambda: manager.latest_step() == step, w)
        times["total"].append(time.perf_counter() - t0)
        manager.wait()
        idle = steps_per_second(lambda: True, w, min_seconds=0.3)
        loop_ratio.append(busy / idle)

    rounds = [lambda: timed("bare", bare), lambda: timed("dumps", lambda: utils.dumps(state))]
    rounds.append(timed_save)
    for fn in rounds + [timed_save]:  # warm-up (jit, page cache, the manager's memory)
        os.sync()
        fn()
    first_save = times["save"][0]
    for values in times.values():
        values.clear()
    loop_ratio.clear()
    for _ in range(repeats):
        for fn in rounds:
            os.sync()
            fn()
    check(manager.restore())
    manager.close()

    def cell(key: str) -> str:
        xs = times[key]
        return f"{statistics.median(xs) * 1e3:8.0f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"

    def ratio(key: str, over: str) -> float:
        return statistics.median(times[key]) / statistics.median(times[over])

    return (
        [
            f"{name}: {size}",
            f"  utils.dumps (synchronous)       ms {cell('dumps')}   CPU ms {cell('dumps_cpu')}",
            f"  manager.save stall (background) ms {cell('save')}   CPU ms {cell('save_cpu')}",
            f"  bare copy (fresh memory)        ms {cell('bare')}   CPU ms {cell('bare_cpu')}",
            f"  stall/dumps: wall {ratio('save', 'dumps'):.3f}, "
            f"CPU {ratio('save_cpu', 'dumps_cpu'):.3f}",
            f"  bare copy/dumps: wall {ratio('bare', 'dumps'):.3f}, "
            f"CPU {ratio('bare_cpu', 'dumps_cpu'):.3f}",
            f"  first save of the manager: stall {first_save * 1e3:.0f} ms",
            f"  save until complete             ms {cell('total')}",
            f"  training steps/s during the background write: "
            f"{statistics.median(loop_ratio):.2f} of the rate without one",
        ],
        ratio("save", "dumps"),
        ratio("save_cpu", "dumps_cpu"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    parser.add_argument("--scale", type=float, default=None, help="size factor (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder for the files (default: a temp dir)")
    args = parser.parse_args()
    scale = args.scale or (0.1 if args.quick else 1.0)
    agent = make_checkpoint(scale)
    all_jax = jax.tree_util.tree_map(jnp.asarray, agent)
    x = list(range(int(1_000_000 * scale)))
    cyclic = dict(agent)
    cyclic["self"] = cyclic
    rng = np.random.default_rng(0)
    layers = {
        f"layer_{i}": {"w": jnp.asarray(rng.random((64, 64), np.float32)), "b": jnp.zeros(64)}
        for i in range(200)
    }
    many = {"params": layers, "opt_state": optax.adam(1e-3).init(layers)}

    def same_list(restored: list) -> None:
        assert len(restored) == 20 and restored[0] == x
        assert all(item is restored[0] for item in restored)

    def same_cycle(restored: dict) -> None:
        assert restored["self"] is restored
        assert_same({k: v for k, v in restored.items() if k != "self"}, agent)

    def copy_arrays(tree: Any) -> Callable[[], list]:
        leaves = [x for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")]
        return lambda: [np.copy(np.asarray(x)) for x in leaves]

    mb = f"{nbytes(agent) / 1e6:.0f} MB"
    agent_copy = copy_arrays(agent)
    states = [
        (
            "agent (jax params + numpy replay)",
            mb,
            agent,
            lambda r: assert_same(r, agent),
            agent_copy,
        ),
        ("all leaves jax arrays", mb, all_jax, lambda r: assert_same(r, all_jax), agent_copy),
        ("[x] * 20, x a list of ints", f"{len(x)} ints", [x] * 20, same_list, lambda: list(x)),
        ("cyclic agent (holds itself)", mb, cyclic, same_cycle, agent_copy),
        (
            "many leaves: 200 layers + adam state",
            f"{len(jax.tree_util.tree_leaves(many))} jax arrays, {nbytes(many) / 1e6:.0f} MB",
            many,
            lambda r: assert_same(r, many),
            copy_arrays(many),
        ),
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{os.cpu_count()} CPUs, repeats={args.repeats}, load average {load:.1f}")
    out, ratios, cpu_ratios = [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for name, size, state, check, bare in states:
            lines, ratio, cpu_ratio = bench_state(
                name, size, state, check, bare, folder, args.repeats
            )
            out += lines
            ratios.append(ratio)
            cpu_ratios.append(cpu_ratio)
    print("\n".join(out))
    print(f"largest stall/dumps: wall {max(ratios):.3f}, CPU {max(cpu_ratios):.3f} (target 0.15)")


if __name__ == "__main__":
    main()
