"""Tests of utils.dump/dumps/load/loads: round trips, format integrity, atomicity, safe mode."""

import collections
import contextlib
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import zlib

import cloudpickle
import haiku as hk
import jax
import jax.numpy as jnp
import lz4.frame
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils import replay, utils
from coax_utils.utils import _checkpoint

# -- helpers -------------------------------------------------------------------------------


@contextlib.contextmanager
def small_chunks(chunk_size=1024, inband_limit=256, threads=2):
    """Shrink the chunk size so that small objects exercise chunking and the thread pool."""
    saved = _checkpoint.CHUNK_SIZE, _checkpoint.INBAND_LIMIT, _checkpoint.MAX_THREADS
    _checkpoint.CHUNK_SIZE, _checkpoint.INBAND_LIMIT = chunk_size, inband_limit
    _checkpoint.MAX_THREADS = threads
    try:
        yield
    finally:
        _checkpoint.CHUNK_SIZE, _checkpoint.INBAND_LIMIT, _checkpoint.MAX_THREADS = saved


@contextlib.contextmanager
def python_lz4_only():
    """Use python-lz4's functions instead of the ctypes fast path."""
    saved = _checkpoint._lz4_native
    _checkpoint._lz4_native = lambda: None
    try:
        yield
    finally:
        _checkpoint._lz4_native = saved


def assert_tree_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        if isinstance(x, (np.ndarray, jax.Array)):
            assert x.dtype == y.dtype and x.shape == y.shape
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y


def net(x):
    return hk.nets.MLP([16, 3])(x)


def agent_state():
    """Haiku params, an optax adam state after one step, replay arrays, a jitted apply."""
    model = hk.without_apply_rng(hk.transform(net))
    x = jnp.ones((2, 5))
    params = model.init(jax.random.key(0), x)
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    rng = np.random.default_rng(0)
    replay_block = {
        "S": rng.integers(0, 255, (64, 12, 12, 4), dtype=np.uint8),
        "A": rng.integers(0, 3, 64).astype(np.int32),
        "Rn": rng.standard_normal(64).astype(np.float32),
    }
    return {
        "params": params,
        "opt_state": opt_state,
        "replay": replay_block,
        "step": 17,
        "key": jax.random.key(3),
    }, model.apply


# -- round trips ---------------------------------------------------------------------------


def test_agent_state_round_trip_in_memory_and_on_disk(tmp_path):
    state, apply = agent_state()
    jitted = jax.jit(apply)
    obj = {"state": state, "apply": jitted, "apply_utils_jit": utils.jit(apply)}
    x = jnp.arange(10.0).reshape(2, 5)
    expected = jitted(state["params"], x)

    path = tmp_path / "deeper" / "folder" / "agent.pkl.lz4"  # parents get created
    utils.dump(obj, path)
    for restored in (utils.loads(utils.dumps(obj)), utils.load(path), utils.load(str(path))):
        assert_tree_equal(restored["state"]["params"], state["params"])
        assert_tree_equal(restored["state"]["replay"], state["replay"])
        adam = restored["state"]["opt_state"][0]
        assert type(adam) is type(state["opt_state"][0])  # optax's ScaleByAdamState
        assert_tree_equal(adam.mu, state["opt_state"][0].mu)
        assert_tree_equal(adam.nu, state["opt_state"][0].nu)
        assert int(adam.count) == 1
        assert restored["state"]["step"] == 17
        key = restored["state"]["key"]
        assert jax.random.key_impl(key) == jax.random.key_impl(state["key"])
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(state["key"]))
        for name in ("apply", "apply_utils_jit"):
            out = restored[name](restored["state"]["params"], x)
            np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6)
        # jax arrays stay jax arrays; numpy arrays come back as writable numpy arrays
        assert all(
            isinstance(p, jax.Array) for p in jax.tree_util.tree_leaves(restored["state"]["params"])
        )
        frames = restored["state"]["replay"]["S"]
        assert type(frames) is np.ndarray and frames.flags.writeable
        frames[0, 0, 0, 0] ^= 1  # writable for real


def test_file_holds_the_same_bytes_as_dumps_and_output_is_deterministic(tmp_path):
    state, _ = agent_state()
    with small_chunks(threads=1):
        single = utils.dumps(state)
    with small_chunks(threads=4):
        multi = utils.dumps(state)
        utils.dump(state, tmp_path / "a.ckpt")
    assert single == multi  # chunking is independent of the number of threads
    assert (tmp_path / "a.ckpt").read_bytes() == multi
    assert multi.startswith(_checkpoint.MAGIC)


def test_bytes_builder_writes_in_place_and_trims():
    api = _checkpoint._bytes_api()
    assert api is not None  # CPython: the in-place path is the one used
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    pieces = [b"head", memoryview(arr)[: 1 << 20], b"", arr[(1 << 20) + 5 :], bytearray(b"tail")]
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    builder = _checkpoint._BytesBuilder(api, len(expected) + 12345)
    offsets = np.cumsum([0] + [memoryview(p).nbytes for p in pieces])
    for i in (3, 0, 4, 1, 2):  # any order
        builder.write(int(offsets[i]), pieces[i])
    with pytest.raises(ValueError, match="outside"):  # never past the end of the object
        builder.write(len(expected) + 12340, b"0123456789")
    out = builder.finish(len(expected))
    assert type(out) is bytes and out == expected and hash(out) == hash(expected)
    assert sys.getrefcount(out) == 2  # only ours (and the argument): nothing leaked
    builder.close()  # finished: nothing left to release
    discarded = _checkpoint._BytesBuilder(api, 1 << 20)
    discarded.close()
    discarded.close()


@pytest.mark.parametrize("in_place", [True, False])
def test_dumps_output_is_the_same_with_or_without_the_in_place_path(in_place, monkeypatch):
    rng = np.random.default_rng(5)
    obj = {"x": np.repeat(rng.integers(0, 9, 300_000), 4), "y": rng.random(150_000)}
    with small_chunks(chunk_size=1 << 16, threads=1):
        single = utils.dumps(obj)
    if not in_place:
        monkeypatch.setattr(_checkpoint, "_bytes_api", lambda: None)
    for join_min in (0, 1 << 30):
        monkeypatch.setattr(_checkpoint, "_DIRECT_JOIN_MIN", join_min)
        with small_chunks(chunk_size=1 << 16, threads=3):
            s = utils.dumps(obj)
        assert type(s) is bytes and s == single
    assert_tree_equal(utils.loads(s), obj)


def test_large_dumps_is_bytes_and_matches_the_file(tmp_path):
    rng = np.random.default_rng(4)
    obj = {
        "frames": np.repeat(rng.integers(0, 255, (40, 1 << 14), dtype=np.uint8), 4, 0),
        "noise": rng.random(200_000),  # 1.6 MB that lz4 cannot shrink (stored as is)
    }
    with small_chunks(chunk_size=1 << 18, threads=2):
        s = utils.dumps(obj)
        utils.dump(obj, tmp_path / "f.ckpt")
    assert type(s) is bytes and len(s) > _checkpoint._DIRECT_JOIN_MIN
    assert (tmp_path / "f.ckpt").read_bytes() == s
    assert_tree_equal(utils.loads(s), obj)


def direct_io_supported(folder):
    """Whether files in ``folder`` accept O_DIRECT (ext4, xfs, ...; not every file system)."""
    fd = os.open(os.path.join(folder, "probe"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        return _checkpoint._set_direct(fd, True)
    finally:
        os.close(fd)
        os.unlink(os.path.join(folder, "probe"))


def count_direct_dumps(monkeypatch):
    calls = []
    real = _checkpoint._DirectWriter.finish

    def finish(self, size):
        real(self, size)
        calls.append(self._direct)  # whether every block went to the file with O_DIRECT

    monkeypatch.setattr(_checkpoint._DirectWriter, "finish", finish)
    return calls


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
@pytest.mark.parametrize("size", [3 * 8192, 3 * 8192 + 1234, 100])
def test_direct_writer_stages_pieces_written_in_any_order(direct, size, tmp_path, monkeypatch):
    monkeypatch.setattr(_checkpoint, "DIRECT_BLOCK", 8192)
    rng = np.random.default_rng(size)
    data = rng.integers(0, 255, size, dtype=np.uint8)
    cuts = np.unique(np.concatenate([[0, size], rng.integers(0, size, 12)]))
    pieces = [(int(a), data[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    rng.shuffle(pieces)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert _checkpoint._set_direct(fd, direct) == (direct and direct_io_supported(tmp_path))
        writer = _checkpoint._DirectWriter(fd, size + 5000)
        threads = [
            threading.Thread(target=lambda k=k: [writer.write(o, p) for o, p in pieces[k::3]])
            for k in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        writer.finish(size)
        writer.close()  # closing twice is harmless
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data.tobytes()


@pytest.mark.parametrize("unnamed_temp", [True, False], ids=["O_TMPFILE", "named-temp"])
@pytest.mark.parametrize("use_direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_dump_with_and_without_o_direct_holds_the_bytes_of_dumps(
    use_direct, unnamed_temp, tmp_path, monkeypatch
):
    rng = np.random.default_rng(6)
    obj = {"x": np.repeat(rng.integers(0, 9, 100_000), 4), "y": rng.random(50_000), "z": [1]}
    monkeypatch.setattr(_checkpoint, "USE_O_DIRECT", use_direct)
    monkeypatch.setattr(_checkpoint, "DIRECT_BLOCK", 1 << 16)
    if not unnamed_temp:
        monkeypatch.setattr(_checkpoint, "_write_unnamed", lambda *args: None)
    calls = count_direct_dumps(monkeypatch)
    with small_chunks(chunk_size=1 << 15, threads=2):
        expected = utils.dumps(obj)
        utils.dump(obj, tmp_path / "d.ckpt")
        utils.dump([7], tmp_path / "small.ckpt")  # a single block, shorter than the alignment
        small = utils.dumps([7])
    assert calls == ([True, True] if use_direct and direct_io_supported(tmp_path) else [])
    assert (tmp_path / "d.ckpt").read_bytes() == expected
    assert (tmp_path / "small.ckpt").read_bytes() == small
    assert_tree_equal(utils.load(tmp_path / "d.ckpt"), obj)
    assert sorted(os.listdir(tmp_path)) == ["d.ckpt", "small.ckpt"]


def test_dump_switches_o_direct_off_when_direct_writes_fail_with_einval(tmp_path, monkeypatch):
    import errno
    import fcntl

    real, refused = os.pwrite, []

    def pwrite(fd, data, offset):  # a file system that refuses direct writes of this alignment
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(_checkpoint, "DIRECT_BLOCK", 1 << 16)
    obj = {"x": np.arange(100_000) % 7}
    with small_chunks(chunk_size=1 << 15):
        utils.dump(obj, tmp_path / "e.ckpt")
        expected = utils.dumps(obj)
    assert len(refused) == (1 if direct_io_supported(tmp_path) else 0)
    assert (tmp_path / "e.ckpt").read_bytes() == expected


@pytest.mark.parametrize("writer_native", [True, False])
@pytest.mark.parametrize("reader_native", [True, False])
def test_ctypes_and_python_lz4_paths_read_each_other(writer_native, reader_native, tmp_path):
    rng = np.random.default_rng(1)
    obj = {"x": np.repeat(rng.integers(0, 9, 3000), 7), "y": rng.random(2000)}
    with small_chunks(chunk_size=4096):
        with contextlib.nullcontext() if writer_native else python_lz4_only():
            s = utils.dumps(obj)
            utils.dump(obj, tmp_path / "o.ckpt")
        with contextlib.nullcontext() if reader_native else python_lz4_only():
            assert_tree_equal(utils.loads(s), obj)
            assert_tree_equal(utils.load(tmp_path / "o.ckpt"), obj)


def test_file_load_without_preadv(tmp_path, monkeypatch):
    state, _ = agent_state()
    utils.dump(state["replay"], tmp_path / "r.ckpt")
    monkeypatch.delattr(os, "preadv")
    assert_tree_equal(utils.load(tmp_path / "r.ckpt"), state["replay"])


def test_references_preserved_within_one_object_only():
    a = [13]
    b = {"a": a}
    a_new, b_new = utils.loads(utils.dumps((a, b)))
    b_new["a"].append(7)
    assert b_new == {"a": [13, 7]} and a_new == [13, 7]

    a_new = utils.loads(utils.dumps(a))
    b_new = utils.loads(utils.dumps(b))
    b_new["a"].append(7)
    assert b_new == {"a": [13, 7]} and a_new == [13]

    # the same array twice (small: in-band; large: out-of-band) stays one array
    for n in (10, 100_000):
        arr = np.arange(n)
        x, y = utils.loads(utils.dumps((arr, arr)))
        assert x is y


def test_layouts_dtypes_and_flags():
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    readonly = np.arange(5000.0)
    readonly.flags.writeable = False
    obj = {
        "fortran": np.asfortranarray(base),
        "strided": base[::2, ::3],
        "negative": base[::-1],
        "big_fortran": np.asfortranarray(np.arange(100_000.0).reshape(200, 500)),
        "big_strided": np.arange(300_000.0)[::3],
        "readonly": readonly,
        "bf16": np.arange(7, dtype=ml_dtypes.bfloat16),
        "datetime": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
        "structured": np.zeros(3, dtype=[("a", "<i4"), ("b", ">f8")]),
        "strings": np.array(["ab", "cde"]),
        "string_dtype": np.array(["a", "bb", ""], dtype=np.dtypes.StringDType()),
        "object": np.array([1, "a", None, [2]], dtype=object),
        "empty": np.zeros((0, 4), np.int16),
        "zero_d": np.array(3.5, np.float32),
        "scalar": np.float16(1.5),
        "jax_bf16": jnp.arange(5, dtype=jnp.bfloat16),
        "jax_bool": jnp.array([True, False]),
        "jax_weak": jnp.asarray(2.0),
        "jax_empty": jnp.zeros((3, 0)),
    }
    restored = utils.loads(utils.dumps(obj), safe=True)
    for name, x in obj.items():
        y = restored[name]
        assert type(y) is type(x) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        assert y.dtype == x.dtype and y.shape == x.shape, name
        if x.dtype.hasobject:
            assert y.tolist() == x.tolist()
        else:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        if isinstance(x, np.ndarray):
            assert y.flags.writeable, name
    assert restored["fortran"].flags.f_contiguous
    assert restored["big_fortran"].flags.f_contiguous
    assert restored["jax_weak"].weak_type and not restored["jax_bf16"].weak_type


ARRAY_DTYPES = [
    np.bool_,
    np.int8,
    np.uint16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    ml_dtypes.bfloat16,
]
JAX_DTYPES = [np.bool_, np.int8, np.int32, np.float16, np.float32, ml_dtypes.bfloat16]


@st.composite
def arrays(draw):
    kind = draw(st.sampled_from(["numpy", "jax", "object"]))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    size = int(np.prod(shape))
    if kind == "object":
        values = draw(
            st.lists(
                st.one_of(st.integers(), st.text(max_size=3), st.none()),
                min_size=size,
                max_size=size,
            )
        )
        arr = np.empty(size, dtype=object)
        arr[:] = values
        return arr.reshape(shape)
    dtype = np.dtype(draw(st.sampled_from(JAX_DTYPES if kind == "jax" else ARRAY_DTYPES)))
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, size * dtype.itemsize, dtype=np.uint8)
    arr = (
        raw.view(dtype).reshape(shape)
        if dtype != np.bool_
        else (raw % 2).astype(bool).reshape(shape)
    )
    if kind == "jax":
        return jnp.asarray(arr)
    layout = draw(st.sampled_from(["C", "F", "strided"]))
    if layout == "F":
        arr = np.asfortranarray(arr)
    elif layout == "strided" and arr.ndim:
        arr = np.repeat(arr, 2, axis=0)[::2]
    return arr


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
        st.tuples(children, children),
    )


pytrees = st.recursive(arrays(), _containers, max_leaves=6)


def assert_same_array_tree(x, y):
    if isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y)
        for a, b in zip(x, y):
            assert_same_array_tree(a, b)
    elif isinstance(x, dict):
        assert list(x) == list(y)
        for k in x:
            assert_same_array_tree(x[k], y[k])
    else:
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype.hasobject:
            assert x.tolist() == y.tolist()
        else:  # bitwise equality (NaNs of random bits included)
            bx = np.ascontiguousarray(np.asarray(x)).view(np.uint8)
            by = np.ascontiguousarray(np.asarray(y)).view(np.uint8)
            np.testing.assert_array_equal(bx, by)
        if isinstance(x, np.ndarray):
            assert y.flags.writeable


@settings(max_examples=25, deadline=None)
@given(tree=pytrees, tiny_chunks=st.booleans(), native=st.booleans())
def test_hypothesis_round_trip_of_array_pytrees(tree, tiny_chunks, native):
    chunks = (
        small_chunks(chunk_size=64, inband_limit=16) if tiny_chunks else contextlib.nullcontext()
    )
    lz4 = contextlib.nullcontext() if native else python_lz4_only()
    with chunks, lz4:
        s = utils.dumps(tree)
        assert_same_array_tree(tree, utils.loads(s))
        assert_same_array_tree(tree, utils.loads(s, safe=True))


# -- integrity -----------------------------------------------------------------------------


def small_checkpoint():
    rng = np.random.default_rng(5)
    obj = {"w": rng.integers(0, 4, 600).astype(np.uint8), "noise": rng.random(40), "n": 3}
    with small_chunks(chunk_size=256, inband_limit=128):
        return obj, utils.dumps(obj)


def test_every_single_byte_flip_is_detected():
    obj, s = small_checkpoint()
    assert_tree_equal(utils.loads(s), obj)
    for i in range(len(s)):
        damaged = bytearray(s)
        damaged[i] ^= 0x10
        with pytest.raises(ValueError, match="not a valid coax_utils checkpoint"):
            utils.loads(bytes(damaged))


def test_every_truncation_is_detected(tmp_path):
    _, s = small_checkpoint()
    for n in range(len(s)):
        with pytest.raises(ValueError, match="not a valid coax_utils checkpoint"):
            utils.loads(s[:n])
    path = tmp_path / "truncated.ckpt"
    for n in (0, 5, len(s) // 2, len(s) - 1):
        path.write_bytes(s[:n])
        with pytest.raises(ValueError, match=r"file '.*truncated\.ckpt' is not a valid coax_utils"):
            utils.load(path)


def test_flipped_bytes_in_a_large_file_name_the_file(tmp_path):
    obj = {"frames": np.tile(np.arange(256, dtype=np.uint8), 40_000)}
    path = tmp_path / "big.ckpt"
    utils.dump(obj, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a compressed chunk
    path.write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=r"big\.ckpt' is not a valid coax_utils checkpoint: chunk checksum"
    ):
        utils.load(path)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"hello world, this is not a checkpoint at all" * 3,
        b"\x89PNG\r\n\x1a\n" + bytes(100),
        pickle.dumps({"a": 1}),
        _checkpoint.MAGIC[:-1] + b"?" + bytes(80),
    ],
    ids=["empty", "text", "png", "plain-pickle", "wrong-magic"],
)
def test_foreign_data_is_refused(data, tmp_path):
    with pytest.raises(ValueError, match="the given data is not a valid coax_utils checkpoint"):
        utils.loads(data)
    path = tmp_path / "foreign.bin"
    path.write_bytes(data)
    with pytest.raises(
        ValueError, match=r"file '.*foreign\.bin' is not a valid coax_utils checkpoint"
    ):
        utils.load(path)


def test_newer_format_version_is_refused_with_a_clear_message():
    _, s = small_checkpoint()
    meta_len = int.from_bytes(s[12:16], "little")
    header = bytearray(s[: 16 + meta_len])
    header[8:12] = (2).to_bytes(4, "little")
    crc = zlib.crc32(bytes(header)).to_bytes(4, "little")
    forged = bytes(header) + crc + s[16 + meta_len + 4 :]
    with pytest.raises(ValueError, match="format version 2 is not supported"):
        utils.loads(forged)


def test_argument_types():
    with pytest.raises(TypeError, match="bytes"):
        utils.loads("not bytes")
    with pytest.raises(TypeError, match="filepath"):
        utils.dump({}, 123)
    with pytest.raises(TypeError, match="filepath"):
        utils.load(None)
    assert utils.loads(bytearray(utils.dumps([1]))) == [1]
    assert utils.loads(memoryview(utils.dumps([2]))) == [2]


def test_load_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        utils.load(tmp_path / "nope.ckpt")


# -- legacy coax files ---------------------------------------------------------------------


def test_legacy_coax_bytes_and_files_load(tmp_path):
    state, _ = agent_state()
    obj = {"params": state["params"], "replay": state["replay"], "step": 3}
    legacy = lz4.frame.compress(cloudpickle.dumps(obj))  # coax.utils.dumps
    assert_tree_equal(utils.loads(legacy), obj)
    assert_tree_equal(utils.loads(legacy, safe=True), obj)
    path = tmp_path / "coax.pkl.lz4"
    with lz4.frame.open(path, "wb") as f:  # coax.utils.dump
        f.write(cloudpickle.dumps(obj))
    assert_tree_equal(utils.load(path), obj)
    path.write_bytes(legacy[: len(legacy) // 2])
    with pytest.raises(ValueError, match=r"coax\.pkl\.lz4' is not a valid coax_utils checkpoint"):
        utils.load(path)


# -- atomic dump ---------------------------------------------------------------------------


def fail_after_first_chunk(monkeypatch):
    real = _checkpoint._compress_chunk
    calls = []

    def compress(chunk, *args):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk on fire")
        return real(chunk, *args)

    monkeypatch.setattr(_checkpoint, "_compress_chunk", compress)
    return calls


@pytest.mark.parametrize("unnamed_temp", [True, False], ids=["O_TMPFILE", "named-temp"])
def test_failed_dump_keeps_the_old_file_and_leaves_no_temp_file(
    unnamed_temp, tmp_path, monkeypatch
):
    path = tmp_path / "ckpt.lz4"
    utils.dump({"version": "old"}, path)
    old = path.read_bytes()
    if not unnamed_temp:
        monkeypatch.setattr(_checkpoint, "_write_unnamed", lambda *args: None)

    with pytest.raises(TypeError):  # unpicklable: fails before the file system is touched
        utils.dump({"version": "new", "lock": threading.Lock()}, path)
    calls = fail_after_first_chunk(monkeypatch)
    with small_chunks(), pytest.raises(OSError, match="disk on fire"):  # fails while writing
        utils.dump({"version": "new", "data": np.arange(10_000)}, path)
    assert len(calls) > 1

    assert sorted(os.listdir(tmp_path)) == ["ckpt.lz4"]
    assert path.read_bytes() == old
    assert utils.load(path) == {"version": "old"}


@pytest.mark.parametrize("unnamed_temp", [True, False], ids=["O_TMPFILE", "named-temp"])
@pytest.mark.parametrize("use_direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_dump_that_cannot_write_keeps_the_old_file(use_direct, unnamed_temp, tmp_path, monkeypatch):
    import errno

    path = tmp_path / "ckpt.lz4"
    utils.dump({"version": "old"}, path)
    old = path.read_bytes()
    monkeypatch.setattr(_checkpoint, "USE_O_DIRECT", use_direct)
    monkeypatch.setattr(_checkpoint, "DIRECT_BLOCK", 1 << 14)
    if not unnamed_temp:
        monkeypatch.setattr(_checkpoint, "_write_unnamed", lambda *args: None)
    real = os.pwrite

    def pwrite(fd, data, offset):
        if offset >= 1 << 15:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with small_chunks(chunk_size=1 << 12), pytest.raises(OSError, match="No space"):
        utils.dump({"version": "new", "data": np.arange(100_000)}, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.lz4"]
    assert path.read_bytes() == old


@pytest.mark.parametrize("unnamed_temp", [True, False], ids=["O_TMPFILE", "named-temp"])
def test_dump_replaces_the_file_and_keeps_permissions_sane(unnamed_temp, tmp_path, monkeypatch):
    if not unnamed_temp:
        monkeypatch.setattr(_checkpoint, "_write_unnamed", lambda *args: None)
    path = pathlib.Path(tmp_path) / "ckpt.lz4"
    utils.dump([1], path)
    utils.dump([2], path)
    assert utils.load(path) == [2]
    assert sorted(os.listdir(tmp_path)) == ["ckpt.lz4"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


KILLED_CHILD = textwrap.dedent(
    """
    import sys, threading
    import numpy as np
    from coax_utils.utils import _checkpoint, dump

    real = _checkpoint._compress_chunk
    calls = []

    def compress(chunk, *args):  # hang the dump in the middle, with the temp file open
        out = real(chunk, *args)
        calls.append(1)
        if len(calls) == 4:
            print("dumping", flush=True)
            threading.Event().wait()
        return out

    _checkpoint._compress_chunk = compress
    _checkpoint.CHUNK_SIZE = 1 << 16
    dump({"version": "new", "data": np.arange(1_000_000)}, sys.argv[1])
    """
)


def open_files(pid):
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed in the meantime
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return links


def test_dump_killed_with_sigkill_leaves_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "ckpt.lz4"
    utils.dump({"version": "old"}, path)
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "dumping"
        # the child holds its temp file in tmp_path open right now, and the file has no name
        temp = [link for link in open_files(child.pid) if link.startswith(str(tmp_path))]
        assert len(temp) == 1 and temp[0].endswith("(deleted)"), temp
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert sorted(os.listdir(tmp_path)) == ["ckpt.lz4"]
    assert utils.load(path) == {"version": "old"}


# -- safe mode -----------------------------------------------------------------------------


class RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Plain:
    pass


def test_safe_mode_refuses_os_system_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payload = utils.dumps({"innocent": np.arange(3), "evil": RunsShell(marker)})
    with pytest.raises(
        pickle.UnpicklingError, match=r"refusing to load global '(posix|nt)\.system'"
    ):
        utils.loads(payload, safe=True)
    path = tmp_path / "evil.ckpt"
    utils.dump(RunsShell(marker), path)
    with pytest.raises(pickle.UnpicklingError, match=r"system' from file '.*evil\.ckpt'"):
        utils.load(path, safe=True)
    legacy = lz4.frame.compress(cloudpickle.dumps(RunsShell(marker)))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        utils.loads(legacy, safe=True)
    assert not marker.exists()
    utils.loads(payload)  # the default mode trusts the data: the command runs
    assert marker.exists()


def crafted(module, name):
    """A legacy-format payload whose pickle just loads one global."""
    return lz4.frame.compress(b"\x80\x04c" + f"{module}\n{name}\n".encode() + b".")


@pytest.mark.parametrize(
    "module,name",
    [
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("os", "system"),
        ("subprocess", "Popen"),
        ("functools", "partial"),
        ("numpy", "load"),
        ("numpy", "memmap"),
        ("numpy", "ndarray.__new__"),
        ("jax.numpy", "load"),
        ("jax.numpy", "array"),
        ("numpy.lib.format", "open_memmap"),
        ("haiku", "transform"),
        ("optax", "adam"),
        ("coax_utils.utils", "dump"),
        ("coax_utils.utils._checkpoint", "os"),  # a module re-exported under an innocent name
        ("coax_utils.utils._checkpoint", "Callable"),  # a foreign class re-exported
        ("cloudpickle.cloudpickle", "_make_function"),
        ("this", "s"),  # not even imported
        ("coax_utils_lookalike", "Thing"),
    ],
)
def test_safe_mode_refuses_non_data_globals(module, name):
    was_imported = module in sys.modules
    with pytest.raises(pickle.UnpicklingError, match=f"refusing to load global '{module}.{name}'"):
        utils.loads(crafted(module, name), safe=True)
    assert (module in sys.modules) == was_imported


POINTER_FORGERY = textwrap.dedent(
    """
    import pickle, lz4.frame
    from coax_utils.utils import loads
    # numpy.ndarray((1,), 'O', b'AAAAAAAA'): an object array whose pointer comes from the file
    payload = b"\\x80\\x02cnumpy\\nndarray\\n(K\\x01\\x85X\\x01\\x00\\x00\\x00OC\\x08AAAAAAAAtR."
    try:
        loads(lz4.frame.compress(payload), safe=True)
    except pickle.UnpicklingError as e:
        print(e)
    """
)


def test_safe_mode_refuses_to_build_object_arrays_from_file_bytes():
    # run in a child: if the check were missing, the forged pointer would crash the process
    out = subprocess.run(
        [sys.executable, "-c", POINTER_FORGERY], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "refusing to call global 'numpy.ndarray'" in out.stdout


def test_safe_mode_refuses_lambdas_and_foreign_classes():
    for obj in (lambda x: x, Plain(), jax.jit(jnp.sin), collections.namedtuple("P", "x")(1)):
        with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
            utils.loads(utils.dumps(obj), safe=True)


def test_safe_mode_accepts_agent_state_and_package_state_classes(tmp_path):
    state, _ = agent_state()
    tree = utils.SumTree(8, random_seed=1)
    tree.set_values(np.arange(3), [1.0, 2.0, 3.0])
    tb = replay.TransitionBatch.from_single(
        s=np.zeros(4, np.float32), a=1, logp=0.0, r=1.0, done=False, gamma=0.9
    )
    host = replay.PrioritizedReplayBuffer(16, random_seed=3)
    host.add(tb)
    functional = replay.make_uniform_buffer(8)
    obj = {
        "agent": state,
        "sum_tree": tree,
        "min_tree": utils.MinTree(4),
        "sum_tree_state": utils.sum_tree_init(8),
        "transition": tb,
        "host_buffer": host,
        "buffer_state": functional.init({"x": jnp.zeros(3)}),
        "numpy_rng": np.random.default_rng(7),
        "legacy_rng": np.random.RandomState(7),
        "containers": collections.OrderedDict(
            a=collections.defaultdict(list, b=[1]), c=collections.deque([1, 2]), d={1, 2}
        ),
        "scalars": (np.float32(1.5), np.int64(2), 3 + 4j, b"bytes", None, True),
        "dtype": np.dtype(ml_dtypes.bfloat16),
        "dtype_types": (np.float32, jnp.float32, jnp.bfloat16, ml_dtypes.bfloat16),
    }
    path = tmp_path / "agent.ckpt"
    utils.dump(obj, path)
    restored = utils.load(path, safe=True)
    assert_tree_equal(restored["agent"], state)
    assert restored["sum_tree"].root_value == tree.root_value == 6.0
    assert type(restored["host_buffer"]) is replay.PrioritizedReplayBuffer
    assert len(restored["host_buffer"]) == 1
    assert restored["numpy_rng"].integers(1000) == np.random.default_rng(7).integers(1000)
    assert restored["legacy_rng"].randint(1000) == np.random.RandomState(7).randint(1000)
    assert restored["containers"] == obj["containers"]
    assert restored["scalars"] == obj["scalars"]
    assert restored["dtype"] == obj["dtype"]
    assert restored["dtype_types"] == obj["dtype_types"]


def test_docstrings_warn_about_trust_and_references():
    for fn in (utils.load, utils.loads):
        assert "trust" in fn.__doc__ and "safe=True" in fn.__doc__
    for fn in (utils.dump, utils.dumps, utils.load, utils.loads):
        assert "References between objects are only preserved" in fn.__doc__
        assert "{references}" not in fn.__doc__


def test_metadata_block_is_json_with_format_details():
    s = utils.dumps(1)
    meta_len = int.from_bytes(s[12:16], "little")
    meta = json.loads(s[16 : 16 + meta_len])
    assert meta["codec"] == "lz4.block" and meta["checksum"] == "crc32"
    assert meta["pickle_protocol"] == 5 and meta["chunk_size"] == _checkpoint.CHUNK_SIZE
    assert int.from_bytes(s[8:12], "little") == _checkpoint.FORMAT_VERSION
