"""Source throughput: coax_utils.sources against the cyreal package, in one run.

Two measurements, each timed round robin (A B C A B C ...) after a warm-up:

1. **Batched epoch through jax.lax.scan.** An MNIST-sized array (60000 x 28 x 28 uint8 images,
   int32 labels), batch 128 with the last batch padded, shuffled every epoch. One jitted
   ``jax.lax.scan`` runs a whole epoch; the loop body consumes every batch (a masked sum of
   all pixels and labels) so no gather can be skipped. Variants:

   - ``coax_utils``: ``BatchedSource(ArraySource(data), 128)``,
   - ``cyreal``: ``BatchTransform(128, pad_last_batch=True)(ArraySource(data))`` from cyreal.

   Reported: items (images) per second. Correctness: each variant's per-epoch checksum equals
   the checksum of the whole data set (every image exactly once per epoch).

2. **DiskSource cost per item.** ``sample_fn(i)`` reads image ``i`` and its label from a
   ``np.memmap`` file. Variants:

   - ``python loop``: a plain Python loop calling ``sample_fn(i)`` over a permutation,
   - ``coax_utils``: ``DiskSource(..., prefetch_size=64)`` (the default) through a jitted scan,
   - ``coax_utils p=512``: the same with ``prefetch_size=512``,
   - ``cyreal``: cyreal's ``DiskSource(..., prefetch_size=64)`` through a jitted scan.

   Reported: microseconds per item; the ratios are each variant's median cost over the
   loop's and over cyreal's (lower is better).

Run ``python benchmarks/bench_sources.py`` (about a minute) or ``--quick`` (a few seconds, a
tenth of the data); ``--clock cpu`` times with the process's CPU time instead of the wall
clock (steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from cyreal.sources import ArraySource as CyArraySource
from cyreal.sources import DiskSource as CyDiskSource
from cyreal.transforms import BatchTransform

from coax_utils.sources import ArraySource, BatchedSource, DiskSource


def make_mnist_like(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        "label": rng.integers(0, 10, n).astype(np.int32),
    }


def checksum(batch: dict, mask: jax.Array) -> jax.Array:
    """Masked sum of every pixel and label (int32; wraps around, compared exactly)."""
    mask = mask.reshape(mask.shape[0], -1).all(axis=1)
    pixels = jnp.sum(batch["image"].astype(jnp.int32), axis=(1, 2))
    return jnp.sum(jnp.where(mask, pixels + batch["label"], 0))


def expected_checksum(data: dict[str, np.ndarray]) -> int:
    """The int32 (wrapped-around) checksum of one epoch over the whole data set."""
    total = int(data["image"].astype(np.int64).sum() + data["label"].astype(np.int64).sum())
    return ((total + (1 << 31)) % (1 << 32)) - (1 << 31)


def make_epoch_runner(source, steps: int) -> Callable:
    """A jitted function running ``steps`` calls of ``source.next`` in a scan."""

    def body(carry, _):
        state, total = carry
        batch, mask, state = source.next(state)
        return (state, total + checksum(batch, mask)), None

    @jax.jit
    def run(state):
        (state, total), _ = jax.lax.scan(body, (state, jnp.zeros([], jnp.int32)), None, steps)
        return state, total

    return run


# ``--clock cpu`` switches to the CPU time of this process, which leaves out the time spent
# waiting for a core on a shared machine.
CLOCK = {"clock": time.perf_counter}


def now() -> float:
    return CLOCK["clock"]()


def round_robin(variants: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Time each variant ``repeats`` times, interleaved A B C A B C ..."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = now()
            fn()
            times[name].append(now() - start)
    return times


def calibrate(fn: Callable[[], None], target: float = 0.1) -> int:
    """How many calls of ``fn`` make one repetition of about ``target`` seconds."""
    start = now()
    fn()
    once = max(now() - start, 1e-6)
    return max(1, min(1000, round(target / once)))


def stateful(run: Callable, state, calls: int) -> tuple[Callable[[], None], list]:
    """Wrap a jitted ``run(state) -> (state, out)`` into a no-argument timed closure."""
    box = [state]
    outs: list = []

    def go() -> None:
        for _ in range(calls):
            box[0], out = run(box[0])
            outs.append(jax.block_until_ready(out))

    return go, outs


def fmt_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, sep, *body])


def bench_batched(repeats: int, n: int = 60000, batch_size: int = 128) -> str:
    data = make_mnist_like(n)
    n = len(data["label"])
    expected = expected_checksum(data)

    ours = BatchedSource(ArraySource(data, ordering="shuffle"), batch_size)
    theirs = BatchTransform(batch_size=batch_size, pad_last_batch=True)(
        CyArraySource({k: jnp.asarray(v) for k, v in data.items()}, ordering="shuffle")
    )
    steps = math.ceil(n / batch_size)
    assert ours.steps_per_epoch == theirs.steps_per_epoch == steps

    runners = {}
    for name, source in (("coax_utils", ours), ("cyreal", theirs)):
        run = make_epoch_runner(source, steps)
        state = source.init_state(jax.random.key(0))
        state, total = run(state)  # warm-up: compile + one epoch
        if int(total) != expected:
            raise AssertionError(f"{name}: epoch checksum {int(total)} != {expected}")
        probe, _ = stateful(run, state, 1)
        calls = calibrate(probe)
        runners[name] = (stateful(run, state, calls), calls)

    times = round_robin({name: r[0][0] for name, r in runners.items()}, repeats)
    for name, ((_, outs), _) in runners.items():
        bad = [int(o) for o in outs if int(o) != expected]
        if bad:
            raise AssertionError(f"{name}: {len(bad)} epochs with a wrong checksum")

    rates = {}
    rows = []
    for name, (_, calls) in runners.items():
        per_epoch = [t / calls for t in times[name]]
        rate = [n / t for t in per_epoch]
        rates[name] = statistics.median(rate)
        rows.append(
            [
                name,
                f"{statistics.median(rate) / 1e6:.2f}",
                f"{min(rate) / 1e6:.2f}-{max(rate) / 1e6:.2f}",
                f"{statistics.median(per_epoch) * 1e3:.1f}",
            ]
        )
    for row in rows:
        row.append(f"{rates[row[0]] / rates['cyreal']:.2f}")
    title = (
        f"Batched epoch via jax.lax.scan: {n} x 28 x 28 uint8, batch {batch_size}, shuffle, "
        f"padded last batch ({repeats} repetitions)"
    )
    header = ["variant", "M items/s (median)", "min-max", "ms/epoch", "ratio vs cyreal"]
    return title + "\n" + fmt_table(header, rows)


def bench_disk(repeats: int, n: int, chunk: int) -> str:
    data = make_mnist_like(n, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        images = np.memmap(f"{tmp}/images.u8", np.uint8, "w+", shape=(n, 28, 28))
        images[:] = data["image"]
        images.flush()
        images = np.memmap(f"{tmp}/images.u8", np.uint8, "r", shape=(n, 28, 28))
        labels = data["label"]

        def sample_fn(i: int) -> dict:
            return {"image": np.asarray(images[i]), "label": labels[i]}

        perm = np.random.default_rng(0).permutation(n)
        expected = expected_checksum(data)
        variants: dict[str, Callable[[], None]] = {}
        per_call_items: dict[str, int] = {}

        loop_pos = [0]
        loop_out: list[int] = []

        def python_loop() -> None:
            start = loop_pos[0]
            acc = 0
            for i in perm[(start + np.arange(chunk)) % n]:
                acc += int(sample_fn(int(i))["label"])
            loop_out.append(acc)
            loop_pos[0] = (start + chunk) % n

        full = sum(int(sample_fn(int(i))["label"]) for i in perm)  # warm-up and check
        if full != int(labels.astype(np.int64).sum()):
            raise AssertionError(f"python loop: label sum {full} != {labels.sum()}")
        variants["python loop"] = python_loop
        per_call_items["python loop"] = chunk

        sources = {
            "coax_utils": DiskSource(n, sample_fn, prefetch_size=64),
            "coax_utils p=512": DiskSource(n, sample_fn, prefetch_size=512),
            "cyreal": CyDiskSource(n, sample_fn, prefetch_size=64),
        }
        for name, source in sources.items():
            run = make_epoch_runner(_ItemAsBatch(source), n)
            state = source.init_state(jax.random.key(0))
            state, total = run(state)  # warm-up: compile + one full epoch
            if int(total) != expected:
                raise AssertionError(f"{name}: epoch checksum {int(total)} != {expected}")
            run_chunk = make_epoch_runner(_ItemAsBatch(source), chunk)
            jax.block_until_ready(run_chunk(state))  # compile
            variants[name], _ = stateful(run_chunk, state, 1)
            per_call_items[name] = chunk

        times = round_robin(variants, repeats)

    median = {name: statistics.median(ts) / per_call_items[name] for name, ts in times.items()}
    rows = []
    for name, ts in times.items():
        per_item = [t / per_call_items[name] * 1e6 for t in ts]
        rows.append(
            [
                name,
                f"{median[name] * 1e6:.2f}",
                f"{min(per_item):.2f}-{max(per_item):.2f}",
                f"{median[name] / median['python loop']:.2f}",
                f"{median[name] / median['cyreal']:.2f}",
            ]
        )
    title = (
        f"DiskSource cost per item: {n} memmapped 28 x 28 uint8 images, {chunk} items per "
        f"repetition ({repeats} repetitions)"
    )
    header = ["variant", "us/item (median)", "min-max", "vs python loop", "vs cyreal"]
    return title + "\n" + fmt_table(header, rows)


class _ItemAsBatch:
    """View a single-item source as a source of batches of one (for the shared runner)."""

    def __init__(self, source) -> None:
        self._source = source

    def next(self, state):
        value, mask, state = self._source.next(state)
        value = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], value)
        return value, jnp.reshape(mask, (1,)), state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="wall clock or process CPU time"
    )
    args = parser.parse_args()
    if args.clock == "cpu":
        CLOCK["clock"] = time.process_time
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, clock {args.clock}")
    if args.quick:
        print(bench_batched(repeats=3, n=6000))
        print()
        print(bench_disk(repeats=3, n=2000, chunk=512))
    else:
        print(bench_batched(repeats=15))
        print()
        print(bench_disk(repeats=15, n=10000, chunk=8192))


if __name__ == "__main__":
    main()
