"""Replay folders of the host buffers: checked leaves (checksums, sizes, bytes on disk), loads
that do not depend on the files, re-saves, interrupted and concurrent saves."""

import json
import os
import re
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from coax_utils import utils
from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer, TransitionBatch
from coax_utils.replay._folders import CHUNK_BYTES
from coax_utils.replay._xxh64 import xxh64
from tests.replay.test_host_integrity import BUFFERS, batch, contents, filled, frames, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def saved(cls, path, n=13, capacity=10):
    """A buffer whose S and S_next differ (a swap of the two leaves is visible), saved."""
    buffer = cls(capacity, random_seed=3)
    ts = np.arange(n)
    obs = (ts[:, None, None] % 251).astype(np.uint8) * np.ones((1, 24, 24), np.uint8)
    tb = TransitionBatch(
        S=obs,
        A=ts.astype(np.int32),
        logP=np.zeros(n, np.float32),
        Rn=ts.astype(np.float32),
        In=np.ones(n, np.float32),
        S_next=obs + 1,
    )
    buffer.add(tb, Adv=np.linspace(-2, 2, n) if cls is PrioritizedReplayBuffer else None)
    buffer.save(path)
    return buffer


def meta(path):
    return utils.load(path / "meta.lz4", safe=True)


def leaf_of(path, key, index=None, shape=None):
    """The file name of the leaf stored for ``key`` (and ``index``, or ``shape``)."""
    for entry in meta(path)["files"]:
        if entry["key"] == key and (index is None or entry["index"] == index):
            if shape is None or entry["shape"] == shape:
                return entry["file"]
    raise LookupError(key)


def refused(cls, path, leaf, mmap_mode):
    pattern = f"{re.escape(repr(str(path)))}.*{re.escape(leaf)}"
    with pytest.raises(ValueError, match=pattern):
        cls.load(path, mmap_mode=mmap_mode)


# -- every leaf is checked ----------------------------------------------------------------------


@pytest.mark.parametrize("cls", BUFFERS)
@pytest.mark.parametrize("mmap_mode", [None, "c", "r"])
def test_swapped_leaves_are_refused(cls, mmap_mode, tmp_path):
    path = tmp_path / "buf"
    saved(cls, path)
    entries = [e for e in meta(path)["files"] if e["shape"] == [10, 24, 24]]
    s, s_next = entries[0]["file"], entries[1]["file"]  # S, then S_next
    os.rename(path / s, tmp_path / "s")
    os.rename(path / s_next, path / s)
    os.rename(tmp_path / "s", path / s_next)
    refused(cls, path, s, mmap_mode)


@pytest.mark.parametrize("cls", BUFFERS)
@pytest.mark.parametrize("mmap_mode", [None, "c"])
def test_a_flipped_bit_is_refused(cls, mmap_mode, tmp_path):
    path = tmp_path / "buf"
    saved(cls, path)
    for entry in meta(path)["files"]:
        size = os.path.getsize(path / entry["file"])
        with open(path / entry["file"], "r+b") as f:
            f.seek(size - 1)  # the last byte of the data: the header is checked anyway
            byte = f.read(1)[0]
            f.seek(size - 1)
            f.write(bytes([byte ^ 0x10]))
        refused(cls, path, entry["file"], mmap_mode)
        with open(path / entry["file"], "r+b") as f:  # repaired: the next leaf's turn
            f.seek(size - 1)
            f.write(bytes([byte]))
    cls.load(path, mmap_mode=mmap_mode)


@pytest.mark.parametrize("mmap_mode", [None, "c"])
def test_rewritten_priorities_are_refused(mmap_mode, tmp_path):
    path = tmp_path / "buf"
    saved(PrioritizedReplayBuffer, path)
    leaf = leaf_of(path, "abs_adv")
    abs_adv = np.load(path / leaf)
    abs_adv[:3] = 2.0  # a valid |Adv|, in a file of the same size
    np.save(path / leaf, abs_adv)
    refused(PrioritizedReplayBuffer, path, leaf, mmap_mode)


def saved_in_chunks(path, rows=10):
    """A buffer whose S leaf spans one full chunk and a partial last one, saved; its leaf."""
    buffer = SimpleReplayBuffer(rows, random_seed=0)
    side = 1000  # rows of 10**6 bytes: 10 rows are one 8 MiB chunk and 1.6 MB more
    obs = np.random.default_rng(0).integers(0, 256, (rows, side, side), np.uint8)
    tb = TransitionBatch(
        S=obs,
        A=np.arange(rows, dtype=np.int32),
        logP=np.zeros(rows, np.float32),
        Rn=np.zeros(rows, np.float32),
        In=np.ones(rows, np.float32),
        S_next=obs[::-1],
    )
    buffer.add(tb)
    buffer.save(path)
    leaf = leaf_of(path, "leaves", shape=[rows, side, side])
    entry = next(e for e in meta(path)["files"] if e["file"] == leaf)
    assert entry["chunk_bytes"] == CHUNK_BYTES and len(entry["chunk_checksums"]) == 2
    return buffer, leaf


def flip(file, offset):
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


@pytest.mark.parametrize("mmap_mode", [None, "c"])
def test_a_damaged_byte_in_any_chunk_is_refused(mmap_mode, tmp_path):
    path = tmp_path / "buf"
    buffer, leaf = saved_in_chunks(path)
    size = os.path.getsize(path / leaf)
    start = size - 10 * 10**6
    for offset, chunk in [
        (size - 1, f"{start + CHUNK_BYTES} to {size}"),  # the last, partial chunk
        (start + CHUNK_BYTES, f"{start + CHUNK_BYTES} to {size}"),  # its first byte
        (start + CHUNK_BYTES - 1, f"{start} to {start + CHUNK_BYTES}"),  # the first chunk
        (start, f"{start} to {start + CHUNK_BYTES}"),
    ]:
        flip(path / leaf, offset)
        with pytest.raises(ValueError, match=f"{leaf}.*its bytes {chunk} do not match"):
            SimpleReplayBuffer.load(path, mmap_mode=mmap_mode)
        flip(path / leaf, offset)  # repaired
    assert contents(SimpleReplayBuffer.load(path, mmap_mode=mmap_mode)) == contents(buffer)


def test_a_damaged_header_byte_is_refused(tmp_path):
    path = tmp_path / "buf"
    saved(SimpleReplayBuffer, path)
    leaf = leaf_of(path, "leaves", shape=[10, 24, 24])
    with open(path / leaf, "rb") as f:
        head = f.read(128)
    pad = head.index(b" \n")  # the header still parses: a space of its padding made a tab
    with open(path / leaf, "r+b") as f:
        f.seek(pad)
        f.write(b"\t")
    with pytest.raises(ValueError, match=f"{leaf}.*its header does not match its checksum"):
        SimpleReplayBuffer.load(path)


def rechunk(path, leaf, chunk_bytes):
    """Record the checksums of ``leaf`` in chunks of ``chunk_bytes``, as a save would."""
    record = meta(path)
    entry = next(e for e in record["files"] if e["file"] == leaf)
    data = np.load(path / leaf).reshape(-1).view(np.uint8)
    chunks = [xxh64(data[lo : lo + chunk_bytes]) for lo in range(0, data.size, chunk_bytes)]
    entry.update(chunk_bytes=chunk_bytes, chunk_checksums=chunks)
    utils.dump(record, path / "meta.lz4")
    return record, entry


@pytest.mark.parametrize("mmap_mode", [None, "c"])
def test_the_recorded_chunk_size_is_used_and_checked(mmap_mode, tmp_path):
    path = tmp_path / "buf"
    buffer, leaf = saved_in_chunks(path)
    record, entry = rechunk(path, leaf, 2**16)  # the smallest size a load accepts
    assert len(entry["chunk_checksums"]) == -(-10 * 10**6 // 2**16)
    assert contents(SimpleReplayBuffer.load(path, mmap_mode=mmap_mode)) == contents(buffer)
    chunks = entry["chunk_checksums"]
    for change, error in [
        (dict(chunk_bytes=2**15), "chunk size must be a power of two"),
        (dict(chunk_bytes=2**31), "chunk size must be a power of two"),
        (dict(chunk_bytes=3 * 2**16), "chunk size must be a power of two"),
        (dict(chunk_bytes=float(2**16)), "chunk size must be a power of two"),
        (dict(chunk_bytes=True), "chunk size must be a power of two"),
        (dict(chunk_bytes=None), "chunk size must be a power of two"),
        (dict(chunk_bytes=2**17), "one checksum per 131072 bytes"),
        (dict(chunk_checksums=chunks[:-1]), "one checksum per 65536 bytes"),
        (dict(chunk_checksums=[*chunks, 0]), "one checksum per 65536 bytes"),
        (dict(chunk_checksums=[]), "one checksum per 65536 bytes"),
        (dict(chunk_checksums=[2**64, *chunks[1:]]), "one checksum per"),
        (dict(chunk_checksums=[-1, *chunks[1:]]), "one checksum per"),
        (dict(chunk_checksums=[str(c) for c in chunks]), "one checksum per"),
        (dict(chunk_checksums=tuple(chunks)), "checksums must be recorded"),
        (dict(header_checksum=None), "checksums must be recorded"),
        (dict(chunk_checksums=[chunks[1], chunks[0], *chunks[2:]]), "bytes"),
    ]:
        damaged = dict(record, files=[dict(e) for e in record["files"]])
        next(e for e in damaged["files"] if e["file"] == leaf).update(change)
        utils.dump(damaged, path / "meta.lz4")
        with pytest.raises(ValueError, match=f"{leaf}.*{error}"):
            SimpleReplayBuffer.load(path, mmap_mode=mmap_mode)


def test_a_leaf_keeps_its_checksums_over_saves(tmp_path):
    """The same array saved twice gets the same checksums: they depend on its bytes only."""
    path = tmp_path / "buf"
    buffer = saved(SimpleReplayBuffer, path)
    first = {e["file"]: e for e in meta(path)["files"]}
    buffer.save(path)
    assert {e["file"]: e for e in meta(path)["files"]} == first
    for entry in first.values():
        data = np.load(path / entry["file"]).reshape(-1).view(np.uint8)
        assert entry["chunk_checksums"] == ([xxh64(data)] if data.size else [])
        assert all(0 <= c < 2**64 for c in entry["chunk_checksums"])


@pytest.mark.parametrize("mmap_mode", [None, "c"])
def test_truncated_and_extended_leaves_are_refused(mmap_mode, tmp_path):
    for k, change in enumerate([-1, +1, -(10**9)]):
        path = tmp_path / f"buf{k}"
        saved(SimpleReplayBuffer, path)
        leaf = leaf_of(path, "leaves", shape=[10, 24, 24])
        size = os.path.getsize(path / leaf)
        os.truncate(path / leaf, max(0, size + change))
        refused(SimpleReplayBuffer, path, leaf, mmap_mode)


def forge(path, entry, shape, data):
    """Rewrite the leaf of ``entry`` with ``shape``: ``data`` then a hole (a sparse file) up
    to its size; record its true size and checksum, as a save of such data would."""
    dtype = np.dtype(entry["dtype"])
    with open(path / entry["file"], "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": entry["dtype"], "fortran_order": False, "shape": tuple(shape)}
        )
        header = f.tell()
        f.write(data)
        size = header + dtype.itemsize * int(np.prod(shape))
        f.truncate(size)
    with open(path / entry["file"], "rb") as f:
        header_checksum = xxh64(np.frombuffer(f.read(header), np.uint8))
    zeros = xxh64(np.zeros(CHUNK_BYTES, np.uint8))
    chunks = []
    for lo in range(0, size - header, CHUNK_BYTES):
        hi = min(lo + CHUNK_BYTES, size - header)
        if lo >= len(data) and hi - lo == CHUNK_BYTES:
            chunks.append(zeros)
        else:
            piece = data[lo:hi] + bytes(hi - lo - len(data[lo:hi]))
            chunks.append(xxh64(np.frombuffer(piece, np.uint8)))
    entry.update(shape=list(shape), size=size, header_checksum=header_checksum)
    entry.update(chunk_bytes=CHUNK_BYTES, chunk_checksums=chunks)


def test_a_sparse_folder_declaring_a_huge_capacity_allocates_nothing(tmp_path):
    path = tmp_path / "buf"
    buffer = PrioritizedReplayBuffer(10, random_seed=0)
    buffer.add(batch(np.arange(7)))
    buffer.save(path)
    record = meta(path)
    huge = 2**25  # 2**25 slots: about 1.7 GB of storage, ids and sum tree
    record["state"]["capacity"] = huge
    for entry in record["files"]:
        if entry["shape"][:1] == [10]:
            data = np.load(path / entry["file"]).tobytes()  # the rows held, then a hole
            forge(path, entry, [huge, *entry["shape"][1:]], data)
    utils.dump(record, path / "meta.lz4")
    on_disk = sum(os.stat(path / e["file"]).st_blocks * 512 for e in record["files"])
    assert on_disk < 2**20  # a folder of a few KiB really on disk
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="sparse file"):
            PrioritizedReplayBuffer.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


def test_a_declared_capacity_the_leaves_do_not_hold_is_refused(tmp_path):
    path = tmp_path / "buf"
    saved(PrioritizedReplayBuffer, path)
    record = meta(path)
    record["state"]["capacity"] = 2**25
    utils.dump(record, path / "meta.lz4")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="episode must be int64"):
            PrioritizedReplayBuffer.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


# -- loaded buffers and the files ---------------------------------------------------------------


@pytest.mark.parametrize("cls", BUFFERS)
def test_a_default_load_does_not_depend_on_the_files(cls, tmp_path):
    path = tmp_path / "buf"
    original = saved(cls, path)
    loaded = cls.load(path)
    before = snapshot(loaded)
    for entry in meta(path)["files"]:  # every leaf rewritten, then truncated
        size = os.path.getsize(path / entry["file"])
        with open(path / entry["file"], "r+b") as f:
            f.seek(128)
            f.write(b"\xff" * (size - 128))
        os.truncate(path / entry["file"], 130)
    assert snapshot(loaded) == before
    assert contents(loaded) == contents(original)
    for _ in range(3):
        a, b = loaded.sample(16), original.sample(16)
        np.testing.assert_array_equal(a.S, b.S)
        np.testing.assert_array_equal(a.W, b.W)
        assert np.all(np.isfinite(a.W))


@pytest.mark.parametrize("cls", BUFFERS)
@pytest.mark.parametrize("mmap_mode", ["c", None])
def test_resave_into_the_loaded_folder_keeps_every_transition(cls, mmap_mode, tmp_path):
    path = tmp_path / "buf"
    filled(cls).save(path)
    loaded = cls.load(path, mmap_mode=mmap_mode)
    loaded.add(frames([100]))
    expected = contents(loaded)
    loaded.save(path)
    assert contents(loaded) == expected  # in memory
    again = cls.load(path)
    assert contents(again) == expected  # on disk
    assert snapshot(again) == snapshot(loaded)
    assert sorted(os.listdir(tmp_path)) == [".buf.lock", "buf"]  # no leftovers


# -- folders that are not what the metadata says ------------------------------------------------


@pytest.mark.parametrize("cls", BUFFERS)
def test_incomplete_or_mismatched_folders_raise_value_error(cls, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    filled(cls, n=13).save(a)
    cls(10, random_seed=0).save(b)  # empty: fewer files
    with pytest.raises(FileNotFoundError):
        cls.load(tmp_path / "missing")

    def damaged(name, damage):
        path = tmp_path / name
        filled(cls, n=13).save(path)
        damage(path)
        with pytest.raises(ValueError, match=name):
            cls.load(path)

    damaged("no_meta", lambda p: os.remove(p / "meta.lz4"))
    damaged("no_leaf", lambda p: os.remove(p / "leaf_1.npy"))
    damaged("extra", lambda p: open(p / "leaf_99.npy", "wb").close())
    damaged("truncated_meta", lambda p: os.truncate(p / "meta.lz4", 20))
    damaged("truncated_leaf", lambda p: os.truncate(p / "leaf_1.npy", 100))

    def swap_leaf(p):
        np.save(p / "leaf_1.npy", np.zeros((10, 24, 23), np.uint8))

    damaged("shape", swap_leaf)

    def dtype_leaf(p):
        np.save(p / "leaf_1.npy", np.zeros((10, 24, 24), np.int8))

    damaged("dtype", dtype_leaf)

    def object_leaf(p):
        np.save(p / "leaf_1.npy", np.zeros((10, 24, 24), object), allow_pickle=True)

    damaged("object", object_leaf)

    def other_meta(p):
        os.replace(b / "meta.lz4", p / "meta.lz4")

    damaged("mixed", other_meta)

    def fifo(name):
        def damage(p):
            os.remove(p / name)
            os.mkfifo(p / name)  # reading it would block forever

        return damage

    def link(name):
        def damage(p):
            elsewhere = p.parent / f"{p.name}_{name}"
            os.rename(p / name, elsewhere)
            os.symlink(elsewhere, p / name)  # a valid leaf, but not in the folder

        return damage

    damaged("link_leaf", link("leaf_1.npy"))
    damaged("fifo_leaf", fifo("leaf_0.npy"))
    damaged("fifo_meta", fifo("meta.lz4"))
    other = PrioritizedReplayBuffer if cls is SimpleReplayBuffer else SimpleReplayBuffer
    with pytest.raises(ValueError, match="holds"):
        other.load(a)


@pytest.mark.parametrize("mmap_mode", ["c", None])
def test_a_leaf_header_claiming_a_huge_array_is_refused_before_allocating(mmap_mode, tmp_path):
    path = tmp_path / "buf"
    filled(SimpleReplayBuffer, n=13).save(path)
    record = meta(path)
    entry = record["files"][1]
    huge = [1 << 40] + entry["shape"][1:]  # far more than any machine can allocate
    with open(path / entry["file"], "wb") as f:
        header = {"descr": entry["dtype"], "fortran_order": False, "shape": tuple(huge)}
        np.lib.format.write_array_header_1_0(f, header)
        f.write(bytes(64))
    with pytest.raises(ValueError, match="the metadata says"):
        SimpleReplayBuffer.load(path, mmap_mode=mmap_mode)
    # the metadata agrees, the file is far too short
    entry.update(shape=huge, size=os.path.getsize(path / entry["file"]))
    utils.dump(record, path / "meta.lz4")
    with pytest.raises(ValueError, match="is not that of its header and array"):
        SimpleReplayBuffer.load(path, mmap_mode=mmap_mode)


def test_save_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me")
    buffer = filled(SimpleReplayBuffer)
    for name in ("mine", "file"):
        with pytest.raises(ValueError, match="not a folder written by save"):
            buffer.save(tmp_path / name)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "keep me"


# -- interrupted and concurrent saves -----------------------------------------------------------


def test_interrupted_saves_are_recovered(tmp_path):
    """The two states a killed save can leave, built by hand from real saves."""
    path = tmp_path / "buf"
    old, new = filled(SimpleReplayBuffer, n=5), filled(SimpleReplayBuffer, n=17)
    new.save(tmp_path / "new")
    old.save(path)
    # killed between the two renames: the old folder moved away, the new one staged
    os.rename(path, tmp_path / ".buf.old-1")
    os.rename(tmp_path / "new", tmp_path / ".buf.saving-1")
    assert contents(SimpleReplayBuffer.load(path)) == contents(new)
    # killed while staging: a partial folder beside a complete one
    os.mkdir(tmp_path / ".buf.saving-2")
    old.save(path)  # rolls the interrupted swap forward, then saves; leftovers removed
    assert [n for n in sorted(os.listdir(tmp_path)) if not n.endswith(".lock")] == ["buf"]
    assert contents(SimpleReplayBuffer.load(path)) == contents(old)


CONCURRENT = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    from coax_utils.replay import SimpleReplayBuffer, TransitionBatch

    def size(tag):  # every save holds a different number of transitions
        return 40 + 7 * (tag % 1000) + tag // 1000

    def make(tag):
        n = size(tag)
        ts = np.arange(n)
        obs = np.full((n, 64, 64), tag, np.int32)
        tb = TransitionBatch(S=obs, A=ts, logP=np.zeros(n, np.float32),
                             Rn=ts.astype(np.float32), In=np.ones(n, np.float32),
                             S_next=obs + 1)
        buffer = SimpleReplayBuffer(256, random_seed=tag)
        buffer.add(tb)
        return buffer

    def complete(buffer):
        S, S_next, Rn, idx = (np.concatenate([getattr(r, k) for r in buffer])
                              for k in ("S", "S_next", "Rn", "idx"))
        tag = int(S.flat[0])
        return (len(buffer) == size(tag) and np.all(S == tag) and np.all(S_next == tag + 1)
                and np.array_equal(Rn, idx.astype(np.float32)))

    role, path, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    if role == "writer":
        writer, done = int(sys.argv[4]), 0
        for r in range(15):
            make(1000 * writer + r).save(path)
            done += 1
        print(json.dumps({"saves": done}))
    else:
        while not os.path.exists(path):
            time.sleep(0.001)
        loads, failures = 0, []
        while True:
            last = os.path.exists(stop)
            try:
                if not complete(SimpleReplayBuffer.load(path)):
                    failures.append("an incomplete buffer")
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")
            loads += 1
            if last:
                break
        print(json.dumps({"loads": loads, "failures": failures[:5]}))
    """
)


def test_two_processes_save_into_one_folder_while_a_third_loads(tmp_path):
    path, stop = str(tmp_path / "buf"), str(tmp_path / "stop")
    env = dict(os.environ, PYTHONPATH=ROOT)

    def start(*args):
        return subprocess.Popen(
            [sys.executable, "-c", CONCURRENT, args[0], path, stop, *args[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )

    reader = start("reader")
    writers = [start("writer", "1"), start("writer", "2")]
    results = []
    for process in writers:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    open(stop, "w").close()
    out, err = reader.communicate(timeout=300)
    assert reader.returncode == 0, err[-3000:]
    loaded = json.loads(out.strip().splitlines()[-1])
    assert results == [{"saves": 15}, {"saves": 15}]  # every save succeeded
    assert loaded["failures"] == [] and loaded["loads"] >= 2, loaded
    assert [n for n in os.listdir(tmp_path) if n.startswith(".buf.")] == [".buf.lock"]
