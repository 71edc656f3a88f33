"""Replay folders: ``save`` and ``load`` of a host buffer of Atari-like frames, in one run.

Variants, timed round robin on the same buffer (about ``--mb`` megabytes of storage):

- ``save``: the buffer's ``save`` (leaf checksums computed while writing, under the folder
  lock) against the bare bytes: ``np.save`` of the same storage arrays, each file fsynced;
- ``load``: the default ``load`` (read into memory, every leaf checked against its size and
  checksum) against ``np.load`` of the same files; ``load(mmap_mode="c")`` (mapped, the
  checksums verified by reading each file once) is reported too;
- with ``--against REV``, the same calls of the host buffers of the git revision ``REV``
  (its ``coax_utils/replay/_host.py``, loaded from ``git show``), e.g. the code before leaf
  checksums: ``--against efa8b38``; the last lines then give the ratios of today's ``save``
  and ``load`` to that code's (median over median, wall and CPU) against the goal
  (``GOAL``: at most 1.3 times the time of the code before checksums).

Each variant is timed ``--reps`` times, round robin; the tables give the median and the range
of the wall time and of the CPU time of the process (all its threads): on a busy machine the
CPU time is the steadier figure. Every loaded buffer is compared with the saved one before
it is timed. The page cache is warm (the files were just written): the figures are the CPU
and memory-bandwidth cost of a save or load, which is what checksums add to; a cold disk
read costs the same for all.

Usage: ``python benchmarks/bench_replay_folders.py [--mb 200] [--reps 7] [--against REV]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_replay import report  # noqa: E402

from coax_utils.replay import PrioritizedReplayBuffer, TransitionBatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 1.3  # save and load with checksums: at most this times the code before them


def make_buffer(mb: int) -> PrioritizedReplayBuffer:
    n = mb * 2**20 // (2 * 84 * 84 * 4)  # S and S_next, (84, 84, 4) uint8 each
    rng = np.random.default_rng(0)
    S = rng.integers(0, 256, size=(n, 84, 84, 4), dtype=np.uint8)
    tb = TransitionBatch(
        S=S,
        A=rng.integers(0, 6, n).astype(np.int32),
        logP=np.zeros(n, np.float32),
        Rn=rng.normal(size=n).astype(np.float32),
        In=np.full(n, 0.99, np.float32),
        S_next=np.roll(S, -1, axis=0),
    )
    buffer = PrioritizedReplayBuffer(n, random_seed=0)
    buffer.add(tb, Adv=rng.normal(size=n), episode_end=np.arange(n) % 500 == 499)
    return buffer


def old_class(rev: str, name: str) -> type:
    """The host buffer class ``name`` of the git revision ``rev``."""
    code = subprocess.run(
        ["git", "show", f"{rev}:coax_utils/replay/_host.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_host.py")
    with open(path, "w") as f:
        f.write(code)
    spec = importlib.util.spec_from_file_location("old_host", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def arrays_of(buffer) -> list[np.ndarray]:
    state = buffer.__checkpoint_state__()
    found = [v for v in state.values() if isinstance(v, np.ndarray)]
    return found + [v for v in state["leaves"] if isinstance(v, np.ndarray)]


def same(a, b) -> None:
    for x, y in zip(arrays_of(a), arrays_of(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a._rng.bit_generator.state == b._rng.bit_generator.state


def np_save(arrays: list[np.ndarray], folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    for i, arr in enumerate(arrays):
        with open(os.path.join(folder, f"{i}.npy"), "wb") as f:
            np.save(f, arr)
            f.flush()
            os.fsync(f.fileno())


def np_load(folder: str, n: int) -> list[np.ndarray]:
    return [np.load(os.path.join(folder, f"{i}.npy")) for i in range(n)]


def timed(variants: dict, reps: int) -> tuple[dict, dict]:
    """Wall and CPU seconds (all threads of the process) per call, round robin A B C A B C."""
    wall: dict = {name: [] for name in variants}
    cpu: dict = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="storage size in megabytes")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--against", help="a git revision whose host buffers to time too")
    parser.add_argument("--dir", default=None, help="where the folders go (default: a temp dir)")
    args = parser.parse_args()

    buffer = make_buffer(args.mb)
    arrays = arrays_of(buffer)
    size = sum(a.nbytes for a in arrays)
    work = tempfile.mkdtemp(dir=args.dir)
    paths = {k: os.path.join(work, k) for k in ("new", "old", "bare")}
    cls = type(buffer)
    saves = {
        "save": lambda: buffer.save(paths["new"]),
        "np.save + fsync": lambda: np_save(arrays, paths["bare"]),
    }
    loads = {
        "load": lambda: cls.load(paths["new"]),
        "np.load": lambda: np_load(paths["bare"], len(arrays)),
    }
    mapped = {"load(mmap_mode='c')": lambda: cls.load(paths["new"], mmap_mode="c")}
    if args.against:
        old = old_class(args.against, cls.__name__)
        old_buffer = old.__checkpoint_restore__(buffer.__checkpoint_state__())
        saves[f"save ({args.against})"] = lambda: old_buffer.save(paths["old"])
        loads[f"load(mmap_mode=None) ({args.against})"] = lambda: old.load(
            paths["old"], mmap_mode=None
        )
        mapped[f"load(mmap_mode='c') ({args.against})"] = lambda: old.load(
            paths["old"], mmap_mode="c"
        )
    try:
        for fn in saves.values():
            fn()
        same(cls.load(paths["new"]), buffer)
        same(cls.load(paths["new"], mmap_mode="c"), buffer)
        if args.against:
            same(old.load(paths["old"], mmap_mode=None), buffer)
        for x, y in zip(np_load(paths["bare"], len(arrays)), arrays, strict=True):
            np.testing.assert_array_equal(x, y)
        print(f"storage: {size / 2**20:.0f} MB in {len(arrays)} arrays; {os.cpu_count()} CPUs")
        goals = []
        for title, variants, ref in [
            ("save (fsynced)", saves, "save"),
            ("load into memory", loads, "load"),
            ("load memory-mapped", mapped, "load(mmap_mode='c')"),
        ]:
            wall, cpu = timed(variants, args.reps)
            report(f"{title}, {size / 2**20:.0f} MB: wall", wall, ref, unit=1e-3, label="ms")
            report(f"{title}, {size / 2**20:.0f} MB: CPU", cpu, ref, unit=1e-3, label="ms")
            old_name = next((k for k in variants if k.endswith(f"({args.against})")), None)
            if args.against and ref != "load(mmap_mode='c')":
                ratios = [np.median(t[ref]) / np.median(t[old_name]) for t in (wall, cpu)]
                met = "met" if ratios[0] <= GOAL else "NOT met"
                goals.append(
                    f"  {ref} / {old_name}: {ratios[0]:.2f}x wall, {ratios[1]:.2f}x CPU"
                    f" (goal: at most {GOAL}x wall: {met})"
                )
        if goals:
            print(f"\ngoals, {size / 2**20:.0f} MB, against {args.against}:", *goals, sep="\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
