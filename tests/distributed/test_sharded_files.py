"""The files of a ShardedReplay checkpoint: a shard file swapped while it is restored, the
manifest's RNG state read through the checked constructor, and saves cut short or racing."""

import hashlib
import json
import os
import shutil
import threading

import numpy as np
import pytest

from coax_utils import utils
from coax_utils._files import lock_file
from coax_utils.distributed import ShardedReplay, _manifest
from coax_utils.distributed._shard import ReplayShard
from coax_utils.replay import PrioritizedReplayBuffer
from coax_utils.utils import CheckpointDamagedError
from tests.distributed._data import keys, make_batch


def _buffer(seed, rows=0, writer=0):
    buffer = PrioritizedReplayBuffer(100, alpha=0.6, beta=0.4, random_seed=seed)
    if rows:
        buffer.add(make_batch(writer, 0, rows), np.linspace(0.1, 1.0, rows))
    return buffer


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_shard_file_swapped_during_a_restore_is_never_served(tmp_path, monkeypatch):
    """The shard checks the SHA-256 of the bytes it loads: a valid file of another save put
    in place after the check is not read, one put in place before it is refused."""
    named, other = tmp_path / "named.lz4", tmp_path / "other.lz4"
    utils.dump(_buffer(1, rows=10, writer=0), named)
    utils.dump(_buffer(2, rows=20, writer=7), other)
    digest = _sha256(named)
    shard = ReplayShard(_buffer(3))  # in this process: the hook below reaches its code

    def swap():
        spare = tmp_path / "spare.lz4"
        shutil.copy(other, spare)
        os.replace(spare, named)  # as a concurrent writer would: a whole valid file

    # the file is replaced once it was read for the check, before anything is loaded
    real_load, real_loads = utils.load, utils.loads
    swaps = []

    def load(*args, **kwargs):
        swaps.append(1)
        swap()
        return real_load(*args, **kwargs)

    def loads(*args, **kwargs):
        swaps.append(1)
        swap()
        return real_loads(*args, **kwargs)

    monkeypatch.setattr(utils, "load", load)
    monkeypatch.setattr(utils, "loads", loads)
    assert shard.stage(str(named), digest) == 10
    monkeypatch.undo()
    assert swaps == [1] and _sha256(named) == _sha256(other)  # the swap did happen
    assert shard.commit_staged() == 10
    assert {w for w, _ in keys(shard.sample(200).S)} == {0}  # the checked file's rows only

    # the file replaced before the check: refused, nothing staged, the served buffer kept
    with pytest.raises(CheckpointDamagedError, match="SHA-256"):
        shard.stage(str(named), digest)
    with pytest.raises(RuntimeError, match="no checkpoint is staged"):
        shard.commit_staged()
    assert shard.size() == 10


def _folder_with_manifest(tmp_path, rng):
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    files = _manifest.new_shard_files(2)
    for name in files:
        open(os.path.join(folder, name), "wb").close()
    _manifest.write_manifest(
        folder,
        files=files,
        sha256=["0" * 64, "1" * 64],
        rng_state=rng.bit_generator.state,
        hint=[1.0, 2.0],
        next_shard=1,
        rate_limiter=None,
    )
    return folder


def test_the_manifest_rng_goes_through_the_checked_constructor(tmp_path):
    rng = np.random.default_rng(5)
    rng.random(3)
    folder = _folder_with_manifest(tmp_path, rng)
    manifest = _manifest.read_manifest(folder, 2, False)
    assert manifest.next_shard == 1 and manifest.hint.tolist() == [1.0, 2.0]
    np.testing.assert_array_equal(manifest.rng.random(5), rng.random(5))  # the same stream

    path = os.path.join(folder, _manifest.MANIFEST)
    with open(path) as f:
        saved = json.load(f)
    state = saved["rng"]
    forged = [
        dict(state, state={"state": 0, "inc": 0}),  # numpy would draw one number forever
        dict(state, state={"state": 3, "inc": 2}),  # even increment
        dict(state, state={"state": 3.0, "inc": 1}),
        dict(state, state={"state": True, "inc": 1}),
        dict(state, state={"state": 2**128, "inc": 1}),
        dict(state, has_uint32=2),
        dict(state, uinteger=-1),
        dict(state, extra=1),
        {k: v for k, v in state.items() if k != "uinteger"},
        dict(state, bit_generator="MT19937"),
        [1, 2],
    ]
    for bad in forged:
        with open(path, "w") as f:
            json.dump(dict(saved, rng=bad), f)
        with pytest.raises(CheckpointDamagedError, match="RNG state"):
            _manifest.read_manifest(folder, 2, False)

    # JSON that Python's parser refuses or chokes on: a damaged manifest, nothing else
    for text in ["[" * 100_000 + "]" * 100_000, '{"format": 1' + "0" * 5000 + "}", "{"]:
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(CheckpointDamagedError, match="corrupted"):
            _manifest.read_manifest(folder, 2, False)
    os.remove(path)
    os.mkfifo(path)  # a reader must not wait for a writer
    with pytest.raises(ValueError, match="not a regular file"):
        _manifest.read_manifest(folder, 2, False)


class _Killed(BaseException):
    """The process died here: this call and every file operation after it fail."""


_FILE_CALLS = ("open", "pwrite", "write", "fsync", "replace", "rename", "remove", "unlink")


def _die_at(monkeypatch, n):
    """From the ``n``-th file operation (1-based) of this process on, every one raises
    :class:`_Killed`, so nothing after it (clean-up included) reaches the disk."""
    count = [0]

    def wrap(real):
        def call(*args, **kwargs):
            count[0] += 1
            if count[0] >= n:
                raise _Killed(f"killed at file operation {count[0]} ({real.__name__})")
            return real(*args, **kwargs)

        return call

    for name in _FILE_CALLS:
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))


def _same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.S, y.S)
        np.testing.assert_array_equal(x.idx, y.idx)


def test_a_save_killed_at_any_point_leaves_the_old_or_the_new_save(
    ray_cluster, tmp_path, monkeypatch
):
    """The save is killed at its 1st, 2nd, ... file operation in the client (every later
    one fails: no clean-up runs); the folder then restores to the earlier save or to the
    new one, exactly (the same sample stream), never to a mix or to nothing."""
    replay = ShardedReplay([_buffer(1), _buffer(2)], seed=0)
    replay.add(make_batch(0, 0, 10), np.ones(10), shard=0)
    replay.add(make_batch(1, 0, 12), np.ones(12), shard=1)
    folder = replay.save(tmp_path / "ckpt")
    old_stream = [replay.sample(8) for _ in range(2)]  # what the earlier save continues with
    replay.add(make_batch(0, 10, 5), np.ones(5), shard=0)
    outcomes = []
    for n in range(1, 100):
        with monkeypatch.context() as patch:
            _die_at(patch, n)
            try:
                replay.save(folder)
                killed = False
            except _Killed:
                killed = True
        new_stream = [replay.sample(8) for _ in range(2)]  # what this save continues with
        size = replay.restore(folder)
        got = [replay.sample(8) for _ in range(2)]
        if size == 22:
            _same(got, old_stream)
            outcomes.append("old")
            replay.add(make_batch(0, 10, 5), np.ones(5), shard=0)
        else:
            assert size == 27
            _same(got, new_stream)
            outcomes.append("new")
        if not killed:
            break
    # killed before the manifest's rename: the earlier save; after it: the new one
    assert outcomes[-1] == "new" and outcomes.count("old") >= 3
    assert outcomes == sorted(outcomes, reverse=True)  # old ... old new ... new

    # the next save removes the leftovers of killed ones (the temp files of dead writers
    # go with the next write into the folder: this writer is alive, so its own stay)
    replay.save(folder)
    names = sorted(n for n in os.listdir(folder) if not n.startswith(".coax_utils-"))
    assert names == sorted([".sharded_replay.lock", "sharded_replay.json", *_files(folder)])

    # saves into one folder take turns: a save waits while another holds the folder's lock
    lock = lock_file(os.path.join(folder, ".sharded_replay.lock"))
    done = []
    saver = threading.Thread(target=lambda: done.append(replay.save(folder)))
    try:
        saver.start()
        saver.join(timeout=3.0)
        assert saver.is_alive() and not done  # waiting for the lock, nothing written
        assert sorted(n for n in os.listdir(folder) if not n.startswith(".coax_utils-")) == names
    finally:
        os.close(lock)
    saver.join(timeout=60.0)
    assert done == [folder] and replay.restore(folder) == 27


def _files(folder):
    with open(os.path.join(folder, "sharded_replay.json")) as f:
        return json.load(f)["files"]
