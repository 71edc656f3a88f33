"""Host buffers under kills and memory limits: real subprocesses, real files, real signals."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Shared by the child processes: two different buffers, old and new, and a fingerprint.
BUILD = textwrap.dedent(
    """
    import hashlib, os, random, signal, sys, time, json
    import numpy as np
    from coax_utils import utils
    from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer, TransitionBatch

    def make(n, capacity=512, cls=PrioritizedReplayBuffer, side=64):
        ts = np.arange(n)
        obs = (ts[:, None, None] % 251).astype(np.uint8) * np.ones((1, side, side), np.uint8)
        tb = TransitionBatch(S=obs, A=ts, logP=np.zeros(n, np.float32),
                             Rn=ts.astype(np.float32), In=np.ones(n, np.float32), S_next=obs)
        buffer = cls(capacity, random_seed=n)
        buffer.add(tb, Adv=np.linspace(-1, 1, n), episode_end=ts % 7 == 6)
        return buffer

    def fingerprint(buffer):
        h = hashlib.sha256()
        for row in buffer:
            for leaf in (row.S, row.A, row.Rn, row.idx, row.W):
                h.update(np.ascontiguousarray(leaf).tobytes())
        h.update(repr(buffer._rng.bit_generator.state).encode())
        h.update(buffer._abs_adv.tobytes())
        return h.hexdigest()

    def outcome(path, old, new):
        try:
            got = fingerprint(PrioritizedReplayBuffer.load(path))
        except Exception as e:  # reported, and the test fails on it
            return f"error {type(e).__name__}: {e}"
        return {old: "old", new: "new"}.get(got, "mixed")
    """
)


def run_child(code: str, timeout: float = 300) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", BUILD + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kill_at_every_step_of_a_save(tmp_path):
    """A save killed at each of its file-system calls (in turn) leaves old or new."""
    result = run_child(
        f"""
        import shutil
        path = {str(tmp_path / "buf")!r}
        old_buffer, new_buffer = make(300), make(700)
        old, new = fingerprint(old_buffer), fingerprint(new_buffer)
        old_buffer.save(path)
        calls = ["rename", "replace", "fsync", "mkdir", "link", "unlink", "remove", "rmdir",
                 "open", "write", "ftruncate"]
        outcomes = []
        for k in range(1, 400):
            pid = os.fork()
            if pid == 0:
                count = [0]
                def wrap(f):
                    def g(*a, **kw):
                        count[0] += 1
                        if count[0] == k:
                            os._exit(9)
                        return f(*a, **kw)
                    return g
                for name in calls:
                    if hasattr(os, name):
                        setattr(os, name, wrap(getattr(os, name)))
                shutil.rmtree = wrap(shutil.rmtree)
                new_buffer.save(path)
                os._exit(0)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            outcomes.append(outcome(path, old, new))
            if status == 0:
                break
            if outcomes[-1] == "new":  # start over from the old folder
                old_buffer.save(path)
        leftovers = sorted(os.listdir(os.path.dirname(path)))
        print(json.dumps({{"outcomes": outcomes, "last": status, "leftovers": leftovers}}))
        """
    )
    outcomes = result["outcomes"]
    assert result["last"] == 0, "the save never completed"
    assert len(outcomes) > 8
    assert set(outcomes) == {"old", "new"}, outcomes
    assert outcomes[-1] == "new"


def test_sigkill_at_random_moments_leaves_old_or_new(tmp_path):
    """A process saving in a loop, killed with SIGKILL at random moments."""
    result = run_child(
        f"""
        path = {str(tmp_path / "buf")!r}
        a_buffer, b_buffer = make(300), make(700)
        a, b = fingerprint(a_buffer), fingerprint(b_buffer)
        a_buffer.save(path)
        t0 = time.perf_counter(); b_buffer.save(path); a_buffer.save(path)
        cycle = time.perf_counter() - t0
        rng = random.Random(0)
        outcomes = []
        for trial in range(25):
            pid = os.fork()
            if pid == 0:
                while True:
                    b_buffer.save(path)
                    a_buffer.save(path)
            time.sleep(rng.uniform(0, 2 * cycle))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            outcomes.append(outcome(path, a, b))
        a_buffer.save(path)  # cleans up what the kills left
        print(json.dumps({{"outcomes": outcomes, "cycle": cycle,
                          "leftovers": sorted(os.listdir(os.path.dirname(path)))}}))
        """
    )
    assert set(result["outcomes"]) <= {"old", "new"}, result["outcomes"]
    assert result["leftovers"] == [".buf.lock", "buf"]  # the lock file of saves stays


MEMORY = """
    import gc
    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    mode, path, N = MODE, PATH, 15000
    cls = PrioritizedReplayBuffer
    if mode == "save":
        buffer = make(N, capacity=N, cls=cls, side=84)  # 2 x 15000 x 84 x 84: about 210 MB
        buffer.save(path)
        utils.dump(buffer, path + ".ckpt")
        print(json.dumps({"saved": True}))
        sys.exit(0)
    if mode == "restore":
        buffer = cls.load(path, mmap_mode=None)
        state = buffer.__checkpoint_state__()
        import copy
        state = copy.deepcopy(state)  # fresh, owned arrays, as the checkpoint loader gives
        del buffer
    # load the compiled sum-tree kernels first: a one-time cost of the process (about 100 MB
    # for numba and LLVM), not a copy of the storage
    from coax_utils.utils import SumTree
    SumTree(4).set_values([0], [1.0])
    gc.collect()
    size = sum(f.stat().st_size for f in os.scandir(path) if f.name.endswith(".npy"))
    reset_peak()
    base = status("VmRSS")
    if mode == "restore":
        restored = cls.__checkpoint_restore__(state)
    elif mode == "utils.load":
        restored = utils.load(path + ".ckpt", safe=True)
    else:
        restored = cls.load(path, mmap_mode=None)
    peak = status("VmHWM") - base
    assert len(restored) == N
    print(json.dumps({"size": size, "peak": peak}))
"""


@pytest.mark.parametrize("mode", ["restore", "load", "utils.load"])
def test_restoring_does_not_copy_the_storage(mode, tmp_path):
    path = str(tmp_path / "big")
    run_child(f"MODE, PATH = 'save', {path!r}\n" + textwrap.dedent(MEMORY))
    result = run_child(f"MODE, PATH = {mode!r}, {path!r}\n" + textwrap.dedent(MEMORY))
    size, peak = result["size"], result["peak"]
    assert size > 190e6
    extra = 0.0 if mode == "restore" else 1.0  # the load reads the files into memory
    assert peak <= (extra + 0.1) * size + 64 * 2**20, (peak / 2**20, size / 2**20)
