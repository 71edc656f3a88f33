"""Checkpoint speed: coax_utils.utils.dump(s)/load(s) against coax's functions, in one run.

The object is an agent-like checkpoint: Haiku-style params (jax float32), an optax adam state
(mu, nu) over them, and a replay block of redundant uint8 frames plus random float columns.
Variants, timed round robin (A B C A B C ...) after a warm-up:

- ``coax``: coax's own ``dumps``/``loads`` (``lz4.frame.compress(cloudpickle.dumps(obj))``)
  and ``dump``/``load`` (an ``lz4.frame`` file of the same pickle), loaded from coax's source
  file.
- ``coax_utils``: this package (a data tree: JSON structure plus array buffers compressed in
  chunks with lz4 on threads, CRC-32; ``dump`` writes a temp file, fsyncs it and renames it,
  which coax does not do).
- ``coax + fsync``: coax's ``dump`` followed by an ``os.fsync`` of the file (like with like).
- ``write + fsync``: a bare write of coax_utils's bytes over the file the last call wrote
  (``O_TRUNC``, which frees its blocks) and an fsync: the disk's limit for replacing a
  checkpoint, as ``dump`` does.
- ``lz4 (all cores)``: lz4 compression of the object's array bytes in the chunks and with
  the calls ``dump`` uses, spread over every core, writing nothing: the CPU side of the
  pipeline limit of a compressed durable write. The limit is the larger of this and
  ``write + fsync``; both parts are reported, since which one binds depends on the disk.
- ``lz4, write + fsync``: the two above one after the other, the plain pipeline that
  overlaps nothing; reported beside the limit (not a goal): it shows how much of the limit
  a dump can reach without overlapping the disk's flush with the compression.
- ``zstd-1 (2 threads)``: coax's expression with zstandard level 1 on 2 threads instead of
  lz4, to weigh a codec switch.

The run ends with the goals (ratios of medians of this run): ``dumps`` >= 2.5x coax,
``loads`` >= 3x, load from a file >= 3x, size within 1 % of coax's, dump to a file >= 2x
coax + fsync and >= 0.8 of the pipeline limit.

Run ``python benchmarks/bench_checkpoint.py`` (about 250 MB; a minute or two) or
``--quick`` (about 25 MB; a few seconds). ``--memory GB`` measures instead the peak memory
of ``dump`` and ``load`` of a replay-like dict of ``GB`` gigabytes, each in a fresh process,
and of the same arrays held by an object of no registered kind (the pickle section).
``--small`` times instead the loads (``safe=True``) of crafted files under 1 MB that hold
as many jax arrays as a file of their size may (zero-size ones of distinct shapes, strong
and weak; one-element ones as ``dumps`` writes them) and one that holds more (refused), each
in a fresh process, ten loads in a row: the slowest load (wall and CPU time) and the peak
memory after the first and after the last load, against the promise of 1 s and 100 MB.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import optax
import zstandard

from coax_utils import utils
from coax_utils.utils._checkpoint import container


def load_coax_misc() -> types.ModuleType:
    """coax's utils/_misc.py on its own (coax's package __init__ fails on current JAX)."""
    spec = importlib.util.find_spec("coax")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "_misc.py")
    # _misc.py imports pandas for a helper unrelated to checkpoints; pandas is not installed.
    sys.modules.setdefault("pandas", types.ModuleType("pandas"))
    mspec = importlib.util.spec_from_file_location("coax_utils_bench_coax_misc", path)
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    return module


def make_checkpoint(scale: float, seed: int = 0) -> dict:
    """An agent-like checkpoint of about ``250 * scale`` MB."""
    rng = np.random.default_rng(seed)
    # params: 20 MB of float32 in a Haiku-style nested dict (a few big layers, small biases)
    n_params = int(5_000_000 * scale)
    sizes = [
        n_params // 2,
        n_params // 4,
        n_params // 8,
        n_params - n_params // 2 - n_params // 4 - n_params // 8,
    ]
    params = {
        f"mlp/~/linear_{i}": {
            "w": jnp.asarray(rng.standard_normal(n, dtype=np.float32) * 0.05),
            "b": jnp.asarray(rng.standard_normal(256, dtype=np.float32) * 0.01),
        }
        for i, n in enumerate(sizes)
    }
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.standard_normal(p.shape, dtype=np.float32)), params
    )
    _, opt_state = opt.update(grads, opt_state, params)  # mu and nu hold real (random) values
    # replay block: 84x84 uint8 frames (frame-stacked, so each frame appears 4 times), with
    # a static background and noisy sprites; plus random float columns
    n_frames = int(5300 * scale)
    background = np.repeat(np.repeat(rng.integers(0, 255, (7, 7), dtype=np.uint8), 12, 0), 12, 1)
    frames = np.empty((n_frames + 3, 84, 84), np.uint8)
    frames[:] = background
    for t in range(n_frames + 3):
        r, c = (t * 3) % 38, (t * 7) % 38
        frames[t, r : r + 46, c : c + 46] = rng.integers(0, 255, (46, 46), dtype=np.uint8)
    stacked = np.stack([frames[i : i + n_frames] for i in range(4)], axis=-1)
    replay = {
        "S": stacked,
        "A": rng.integers(0, 6, n_frames).astype(np.int32),
        "Rn": rng.standard_normal(n_frames).astype(np.float32),
        "logP": rng.standard_normal(n_frames).astype(np.float32),
        "features": rng.standard_normal((n_frames, 2048)).astype(np.float32),
        "priorities": rng.random(n_frames),
    }
    return {"params": params, "opt_state": opt_state, "replay": replay, "step": 12345}


def nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))


def assert_same(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert np.asarray(x).dtype == np.asarray(y).dtype


def zstd_dumps(obj) -> bytes:
    return zstandard.ZstdCompressor(level=1, threads=2).compress(cloudpickle.dumps(obj))


def zstd_loads(s: bytes):
    return cloudpickle.loads(zstandard.ZstdDecompressor().decompress(s))


def zstd_dump(obj, path) -> None:
    with open(path, "wb") as f:
        f.write(zstd_dumps(obj))


def zstd_load(path):
    with open(path, "rb") as f:
        return zstd_loads(f.read())


def compress_all_cores(obj, pool: concurrent.futures.ThreadPoolExecutor):
    """lz4 compression of the array bytes of ``obj`` as ``dump`` compresses them (chunks of
    the same size, the same calls), on ``pool`` (one thread per core): the CPU limit."""
    leaves = [x for x in jax.tree_util.tree_leaves(obj) if hasattr(x, "dtype")]
    views = [memoryview(np.asarray(x).reshape(-1).view(np.uint8)) for x in leaves]
    n = container.CHUNK_SIZE
    chunks = [v[i : i + n] for v in views for i in range(0, v.nbytes, n)]

    def compress(obj_unused, path_unused) -> None:
        sum(len(c) for c, _, _ in pool.map(container._compress, chunks))

    return compress


def fsynced(dump):
    """``dump`` followed by an fsync of the file it wrote."""

    def wrapped(obj, path) -> None:
        dump(obj, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    return wrapped


def one_then_other(first, second):
    """``first`` then ``second``, with the same arguments."""

    def both(obj, path) -> None:
        first(obj, path)
        second(obj, path)

    return both


def write_fsync(data: bytes):
    """A bare write of ``data`` to a file and an fsync: what the disk allows."""

    def write(obj, path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    return write


_MEMORY_CHILD = """
import os, sys, time, types
import numpy as np
from coax_utils import utils
gb, mode, kind, path = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024
n = int(gb * 2**30) // (84 * 84 * 4)
rng = np.random.default_rng(0)
if mode == 'dump':
    frames = np.zeros((n, 84, 84, 4), np.uint8)
    for i in range(0, n, 4096):
        frames[i : i + 4096, ::7, ::5] = rng.integers(0, 255, frames[i : i + 4096, ::7, ::5].shape)
    obj = {'S': frames, 'Rn': rng.standard_normal(n).astype(np.float32)}
    size = frames.nbytes + obj['Rn'].nbytes
    if kind == 'pickled':  # the same arrays in an object of no registered kind
        obj = types.SimpleNamespace(**obj)
    base = hwm()
    t = time.perf_counter(); utils.dump(obj, path); t = time.perf_counter() - t
else:
    base = hwm()
    t = time.perf_counter(); obj = utils.load(path, safe=kind == 'tree')
    t = time.perf_counter() - t
    obj = vars(obj) if kind == 'pickled' else obj
    size = obj['S'].nbytes + obj['Rn'].nbytes
print(size, hwm() - base, t)
"""


def memory(gb: float, folder: str | None) -> None:
    """Peak memory of dump and load of a ``gb`` GB replay-like dict, each in a new process;
    then of the same arrays in an object of no registered kind (the pickle section)."""
    import subprocess

    with tempfile.TemporaryDirectory(dir=folder) as d:
        path = os.path.join(d, "big.ckpt")
        for kind in ("tree", "pickled"):
            for mode in ("dump", "load"):
                out = subprocess.run(
                    [sys.executable, "-c", _MEMORY_CHILD, str(gb), mode, kind, path],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.split()
                size, extra, seconds = int(out[0]), int(out[1]), float(out[2])
                print(
                    f"{mode:<5} {kind:<8} {size / 2**30:.2f} GiB: peak extra memory "
                    f"{extra / 2**20:.0f} MiB = {extra / size:.3f}x the object ({seconds:.1f} s)"
                )


_SMALL_CHILD = """
import json, sys, time
import jax
import jax.numpy as jnp
import numpy as np
from coax_utils import utils
from coax_utils.utils._checkpoint import container
from coax_utils.utils._checkpoint.registry import jax_array_budget
kind = sys.argv[1]
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024
def forge(n, weak, pad):  # n zero-size jax arrays of distinct shapes, and a string
    items = [['j', i + 1, '<f4', [0, i], weak, i] for i in range(n)] + ['x' * pad]
    tree = json.dumps({'root': ['l', 0, items], 'buffers': [[2, 0, 0]] * n, 'pickled': []})
    segments = [[memoryview(tree.encode())], [memoryview(b'')], [memoryview(b'')]]
    return container.container_bytes(2, {}, segments, uncompressed=1)
target = 990_000  # bytes: as many jax arrays as a file of this size may hold (or more)
if kind == 'one-element':  # honest, from dumps: padded with random bytes
    arrays = [jnp.full((1,), i, jnp.float32) for i in range(1900)]
    pad = np.random.default_rng(0).integers(0, 256, target - len(utils.dumps(arrays)), np.uint8)
    s = utils.dumps([arrays, pad])
else:
    n = jax_array_budget(target) - 8 + (1000 if kind == 'over budget' else 0)
    s = forge(n, kind == 'weak', target - len(forge(n, kind == 'weak', 0)))
jax.devices()  # the backend starts before the clock and the memory baseline
base, times, peaks = hwm(), [], []
for _ in range(10):
    t, c = time.perf_counter(), time.process_time()
    try:
        n = len(jax.tree_util.tree_leaves(utils.loads(s, safe=True)))
    except ValueError:
        n = 0
    times.append((time.perf_counter() - t, time.process_time() - c))
    peaks.append(hwm() - base)
print(len(s), n, *max(times), peaks[0], peaks[-1])
"""


def small() -> None:
    """Loads of crafted files under 1 MB, each kind in a fresh process (see the docstring)."""
    import subprocess

    print(
        f"{'file':<14}{'bytes':>9}{'arrays':>8}{'slowest load':>14}{'(CPU)':>9}{'peak, 1st':>11}"
        f"{'peak, 10th':>11}   (promise: under 1 s and 100 MB)"
    )
    for kind in ("zero-size", "weak", "one-element", "over budget"):
        out = subprocess.run(
            [sys.executable, "-c", _SMALL_CHILD, kind], check=True, capture_output=True, text=True
        ).stdout.split()
        size, n, seconds, cpu = int(out[0]), int(out[1]), float(out[2]), float(out[3])
        first, last = int(out[4]), int(out[5])
        met = size < 1e6 and seconds < 1 and last < 100 << 20
        print(
            f"{kind:<14}{size:>9}{n - 1 if n else 'refused':>8}{seconds:>12.3f} s{cpu:>7.3f} s"
            f"{first / 2**20:>8.1f} MiB{last / 2**20:>7.1f} MiB   {'met' if met else 'NOT MET'}"
        )


def run(variants: dict, repeats: int, settle=None) -> dict:
    """Time each variant (a zero-argument callable) round robin.

    ``settle`` (if given) is called, untimed, before every timed call: for the file runs it
    is :func:`os.sync`, so that no variant's writes still wait for the disk while the next
    variant is timed (coax does not fsync, and its 176 MB would otherwise be written back
    during the next variant's dump and slow down its fsync).

    Returns, per variant, a list of (wall seconds, CPU seconds of the process: all threads).
    The clock stops when the call returns: its result is dropped afterwards (freeing a
    176 MB bytes object or a 253 MB restored object takes 10-20 ms, the same for every
    variant, and is the caller's business, not the call's).
    """
    times = {name: [] for name in variants}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            if settle is not None:
                settle()
            c0, t0 = time.process_time(), time.perf_counter()
            result = fn()
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
            del result
    return times


def report(title: str, times: dict, size: int, sizes: dict, peer: str) -> list[str]:
    lines = [
        title,
        f"{'variant':<20}{'MB/s median':>12}{'(min-max)':>12}{'vs coax':>9}"
        f"{'CPU s':>8}{'vs coax':>9}{'size ratio':>12}",
    ]
    peer_wall = statistics.median(w for w, _ in times[peer])
    peer_cpu = statistics.median(c for _, c in times[peer])
    for name, ts in times.items():
        wall = statistics.median(w for w, _ in ts)
        cpu = statistics.median(c for _, c in ts)
        lo = size / max(w for w, _ in ts) / 1e6
        hi = size / min(w for w, _ in ts) / 1e6
        lines.append(
            f"{name:<20}{size / wall / 1e6:>12.0f}{f'({lo:.0f}-{hi:.0f})':>12}"
            f"{peer_wall / wall:>8.2f}x{cpu:>8.3f}{peer_cpu / cpu:>8.2f}x"
            f"{size / sizes[name]:>12.3f}"
        )
    return lines


def median(ts: list) -> float:
    return statistics.median(w for w, _ in ts)


def files(obj, blobs: dict, coax, size: int, repeats: int, folder: str | None, goals: list):
    """The file runs: dump (with fsync where stated) and load from a warm page cache."""
    out = []
    cores = os.cpu_count() or 1
    pool = concurrent.futures.ThreadPoolExecutor(cores)
    with tempfile.TemporaryDirectory(dir=folder) as d:
        paths = {k: os.path.join(d, k.split()[0] + ".ckpt") for k in blobs}
        paths["coax + fsync"] = os.path.join(d, "coax_fsync.ckpt")
        paths["write + fsync"] = os.path.join(d, "bare.ckpt")
        paths["lz4 (all cores)"] = os.path.join(d, "nothing-written")
        paths["lz4, write + fsync"] = os.path.join(d, "serial.ckpt")
        writers = {
            "coax": coax.dump,
            "coax + fsync": fsynced(coax.dump),
            "coax_utils": utils.dump,
            "write + fsync": write_fsync(blobs["coax_utils"]),
            "lz4 (all cores)": compress_all_cores(obj, pool),
            "lz4, write + fsync": one_then_other(
                compress_all_cores(obj, pool), write_fsync(blobs["coax_utils"])
            ),
            "zstd-1 (2 threads)": zstd_dump,
        }
        readers = {"coax": coax.load, "coax_utils": utils.load, "zstd-1 (2 threads)": zstd_load}
        sync = getattr(os, "sync", None)
        t = run({k: (lambda k=k: writers[k](obj, paths[k])) for k in writers}, repeats, sync)
        pool.shutdown()
        disk_sizes = {k: os.path.getsize(p) for k, p in paths.items() if os.path.exists(p)}
        disk_sizes["lz4 (all cores)"] = disk_sizes["coax_utils"]
        out += report("dump (file; coax_utils fsyncs, coax does not)", t, size, disk_sizes, "coax")
        out += report("  the same against coax + fsync", t, size, disk_sizes, "coax + fsync")[2:]
        out += report("  the same against write + fsync", t, size, disk_sizes, "write + fsync")[
            2:
        ] + [""]
        dump, bare, lz4, serial = (
            median(t[k])
            for k in ("coax_utils", "write + fsync", "lz4 (all cores)", "lz4, write + fsync")
        )
        limit = max(bare, lz4)
        out += [
            f"pipeline limit {limit:.3f} s: the larger of write + fsync of the output "
            f"{bare:.3f} s and lz4 of the input on {cores} cores {lz4:.3f} s; "
            f"dump {dump:.3f} s = {limit / dump:.2f} of the limit",
            f"lz4, write + fsync {serial:.3f} s = {limit / serial:.2f} of the limit (the "
            f"plain pipeline); dump = {serial / dump:.2f} of the plain pipeline",
            "",
        ]
        goals.append(("dump to a file vs coax + fsync", median(t["coax + fsync"]) / dump, 2.0))
        goals.append(("dump to a file vs the pipeline limit", limit / dump, 0.8))
        for k in writers:
            if k in ("coax", "coax + fsync", "coax_utils", "zstd-1 (2 threads)"):
                assert_same((readers.get(k) or utils.load)(paths[k]), obj)
        t = run({k: (lambda k=k: readers[k](paths[k])) for k in blobs}, repeats)
        out += report("load (file, page cache warm)", t, size, disk_sizes, "coax")
        goals.append(("load from a file vs coax", median(t["coax"]) / median(t["coax_utils"]), 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small object, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--dir", default=None, help="folder for the on-disk runs (default: a temp dir)"
    )
    parser.add_argument("--memory", type=float, default=None, metavar="GB")
    parser.add_argument("--small", action="store_true", help="loads of crafted small files")
    parser.add_argument(
        "--only",
        choices=["dumps", "loads", "files"],
        default=None,
        help="run one section: in-memory dumps, in-memory loads, or the file runs",
    )
    args = parser.parse_args()
    if args.memory:
        memory(args.memory, args.dir)
        return
    if args.small:
        small()
        return
    scale = 0.1 if args.quick else 1.0
    repeats = args.repeats or (3 if args.quick else 7)
    coax = load_coax_misc()

    obj = make_checkpoint(scale)
    size = nbytes(obj)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"checkpoint: {size / 1e6:.0f} MB of arrays, {os.cpu_count()} CPUs, "
        f"repeats={repeats}, load average {load:.1f}"
    )

    blobs = {
        "coax": coax.dumps(obj),
        "coax_utils": utils.dumps(obj),
        "zstd-1 (2 threads)": zstd_dumps(obj),
    }
    sizes = {k: len(v) for k, v in blobs.items()}
    assert_same(coax.loads(blobs["coax"]), obj)
    assert_same(utils.loads(blobs["coax_utils"]), obj)
    assert_same(utils.loads(blobs["coax_utils"], safe=True), obj)
    assert_same(zstd_loads(blobs["zstd-1 (2 threads)"]), obj)
    assert_same(utils.loads(blobs["coax"]), obj)  # legacy files load too

    out, goals = [], [("size vs coax (1 +- 0.01)", sizes["coax_utils"] / sizes["coax"], 0.99)]
    sections = [args.only] if args.only else ["dumps", "loads", "files"]
    if "dumps" in sections:
        t = run(
            {
                "coax": lambda: coax.dumps(obj),
                "coax_utils": lambda: utils.dumps(obj),
                "zstd-1 (2 threads)": lambda: zstd_dumps(obj),
            },
            repeats,
        )
        out += report("dumps (in memory)", t, size, sizes, "coax") + [""]
        goals.append(("dumps vs coax", median(t["coax"]) / median(t["coax_utils"]), 2.5))
    if "loads" in sections:
        t = run(
            {
                "coax": lambda: coax.loads(blobs["coax"]),
                "coax_utils": lambda: utils.loads(blobs["coax_utils"]),
                "zstd-1 (2 threads)": lambda: zstd_loads(blobs["zstd-1 (2 threads)"]),
            },
            repeats,
        )
        out += report("loads (in memory)", t, size, sizes, "coax") + [""]
        goals.append(("loads vs coax", median(t["coax"]) / median(t["coax_utils"]), 3.0))
    if "files" in sections:
        out += files(obj, blobs, coax, size, repeats, args.dir, goals)
    out.append("goals (ratios of medians of this run)")
    for name, value, goal in goals:
        met = value >= goal and (not name.startswith("size") or value <= 1.01)
        out.append(f"  {name:<40}{value:>7.2f}  goal {goal:<5} {'met' if met else 'NOT MET'}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
