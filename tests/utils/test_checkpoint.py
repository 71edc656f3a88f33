"""Tests of utils.dump/dumps/load/loads: round trips, format integrity, atomic files."""

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import pickle
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from typing import NamedTuple

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

from coax_utils import utils
from coax_utils.utils._checkpoint import container as _ckpt_container
from coax_utils.utils._checkpoint import encoder as _ckpt_encoder
from coax_utils.utils._checkpoint import io as _checkpoint

DATA = pathlib.Path(__file__).parent / "data"

# -- helpers -------------------------------------------------------------------------------


@contextlib.contextmanager
def small_chunks(chunk_size=1024, small=256):
    """Shrink the chunk size so that small objects exercise chunking and the threads."""
    saved = _ckpt_container.CHUNK_SIZE, _ckpt_encoder.SMALL
    _ckpt_container.CHUNK_SIZE, _ckpt_encoder.SMALL = chunk_size, small
    try:
        yield
    finally:
        _ckpt_container.CHUNK_SIZE, _ckpt_encoder.SMALL = saved


def assert_tree_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        if isinstance(x, (np.ndarray, jax.Array)):
            assert x.dtype == y.dtype and x.shape == y.shape
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                assert jax.random.key_impl(x) == jax.random.key_impl(y)
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            assert getattr(x, "weak_type", False) == getattr(y, "weak_type", False)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y


def net(x):
    return hk.nets.MLP([16, 3])(x)


def with_state(x):
    counter = hk.get_state("counter", [], jnp.int32, init=jnp.zeros)
    hk.set_state("counter", counter + 1)
    return hk.BatchNorm(True, True, 0.9)(hk.Linear(4)(x), is_training=True)


def agent_state():
    """Haiku params and state, optax states after one step, replay arrays, keys."""
    model = hk.without_apply_rng(hk.transform(net))
    x = jnp.ones((2, 5))
    params = model.init(jax.random.key(0), x)
    stateful = hk.transform_with_state(with_state)
    hk_params, hk_state = stateful.init(jax.random.key(1), x)
    _, hk_state = stateful.apply(hk_params, hk_state, None, x)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    optimizers = {
        "adam": optax.adam(1e-3),
        "adamw": optax.adamw(1e-3),
        "chain": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        "inject": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    }
    opt_states = {}
    for name, opt in optimizers.items():
        _, opt_states[name] = opt.update(grads, opt.init(params), params)
    rng = np.random.default_rng(0)
    replay_block = {
        "S": rng.integers(0, 255, (64, 12, 12, 4), dtype=np.uint8),
        "A": rng.integers(0, 3, 64).astype(np.int32),
        "Rn": rng.standard_normal(64).astype(np.float32),
    }
    return {
        "params": params,
        "hk_params": hk_params,
        "hk_state": hk_state,
        "opt_states": opt_states,
        "replay": replay_block,
        "step": 17,
        "key": jax.random.key(3),
        "rbg_key": jax.random.key(4, impl="rbg"),
        "raw_key": jax.random.PRNGKey(5),
        "weak": jnp.asarray(0.5),
        "bf16": jnp.ones((3, 2), jnp.bfloat16),
        "numpy_rng": np.random.default_rng(9),
    }, model.apply


def forge(structure, segments, pickled=b"", version=2):
    """A container holding a hand-made structure and segments (what an attacker can write)."""
    data = [
        [memoryview(json.dumps(structure).encode())],
        [memoryview(pickled)],
        *[[memoryview(s)] for s in segments],
    ]
    return _ckpt_container.container_bytes(version, {"format": "forged"}, data, uncompressed=1)


def tree(root, buffers=(), pickled=()):
    return {"root": root, "buffers": list(buffers), "pickled": list(pickled)}


# -- round trips ---------------------------------------------------------------------------


def test_agent_state_round_trips_with_safe_mode_in_memory_and_on_disk(tmp_path):
    state, apply = agent_state()
    path = tmp_path / "deeper" / "folder" / "agent.ckpt"  # parents get created
    utils.dump(state, path)
    s = utils.dumps(state)
    assert path.read_bytes() == s  # the file holds the bytes of dumps
    x = jnp.arange(10.0).reshape(2, 5)
    for restored in (utils.loads(s, safe=True), utils.load(path, safe=True), utils.load(path)):
        assert_tree_equal(
            {k: v for k, v in restored.items() if k != "numpy_rng"},
            {k: v for k, v in state.items() if k != "numpy_rng"},
        )
        for name, opt_state in state["opt_states"].items():
            assert jax.tree_util.tree_structure(restored["opt_states"][name]) == (
                jax.tree_util.tree_structure(opt_state)
            )
        np.testing.assert_allclose(
            apply(restored["params"], x), apply(state["params"], x), rtol=1e-6
        )
        frames = restored["replay"]["S"]
        assert type(frames) is np.ndarray and frames.flags.writeable
        frames[0, 0, 0, 0] ^= 1  # writable for real
        # the numpy generator continues the same stream
        assert restored["numpy_rng"].integers(1 << 30) == np.random.default_rng(9).integers(1 << 30)


def test_functions_go_to_the_pickle_section_and_load_with_safe_false():
    state, apply = agent_state()
    obj = {"params": state["params"], "apply": jax.jit(apply), "utils_jit": utils.jit(apply)}
    x = jnp.ones((2, 5))
    restored = utils.loads(utils.dumps(obj))
    for name in ("apply", "utils_jit"):
        np.testing.assert_allclose(restored[name](restored["params"], x), apply(obj["params"], x))
    with pytest.raises(utils.UnsafeCheckpointError, match=r"PjitFunction at \['apply'\]"):
        utils.loads(utils.dumps(obj), safe=True)


def test_references_preserved_within_one_object_only():
    a = [13]
    b = {"a": a}
    a_new, b_new = utils.loads(utils.dumps((a, b)), safe=True)
    b_new["a"].append(7)
    assert b_new == {"a": [13, 7]} and a_new == [13, 7]

    a_new = utils.loads(utils.dumps(a))
    b_new = utils.loads(utils.dumps(b))
    b_new["a"].append(7)
    assert b_new == {"a": [13, 7]} and a_new == [13]

    for n in (10, 100_000):  # the same array twice (shared segment or its own) stays one
        arr = np.arange(n)
        x, y = utils.loads(utils.dumps((arr, arr)), safe=True)
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
        "f8": np.arange(7, dtype=ml_dtypes.float8_e4m3fn),
        "big_endian": np.arange(5, dtype=">i4"),
        "strings": np.array(["ab", "cde"]),
        "bytes": np.array([b"ab", b"c"]),
        "empty": np.zeros((0, 4), np.int16),
        "zero_d": np.array(3.5, np.float32),
        "complex": np.arange(4) * (1 + 2j),
        "jax_bf16": jnp.arange(5, dtype=jnp.bfloat16),
        "jax_bool": jnp.array([True, False]),
        "jax_weak": jnp.asarray(2.0),
        "jax_weak_int": jnp.asarray(3),
        "jax_empty": jnp.zeros((3, 0)),
    }
    restored = utils.loads(utils.dumps(obj), safe=True)
    for name, x in obj.items():
        y = restored[name]
        assert type(y) is type(x) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        assert y.dtype == x.dtype and y.shape == x.shape, name
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        if isinstance(x, np.ndarray):
            assert y.flags.writeable, name
    assert restored["fortran"].flags.f_contiguous
    assert restored["big_fortran"].flags.f_contiguous
    assert restored["jax_weak"].weak_type and restored["jax_weak_int"].weak_type
    assert not restored["jax_bf16"].weak_type


def test_plain_python_values_round_trip_exactly():
    obj = {
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(10**400), 10**5000],
        "floats": [0.1, -0.0, float("inf"), float("-inf"), 1e-310, 5e-324],
        "complex": 3 - 4.5j,
        "text": "naïve \u2603 \udcff",
        "bytes": b"\x00\xff" * 40_000,
        "bytearray": bytearray(b"abc"),
        "nested": ((1, (2, [3, {4: (5,)}])),),
        "keys": {(1, "a"): 1, 2.5: "x", None: [], frozenset({1}): 0, b"k": 1},
        "sets": [{1, 2}, frozenset({"a"})],
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "numpy_scalars": (np.float32(1.5), np.int64(-2), np.bool_(True), ml_dtypes.bfloat16(2)),
        "dtypes": (np.dtype("float32"), np.dtype(ml_dtypes.bfloat16), np.float16, np.int8),
        "empty": ([], (), {}, set(), "", b""),
    }
    restored = utils.loads(utils.dumps(obj), safe=True)
    assert restored == obj
    assert type(restored["ordered"]) is collections.OrderedDict
    assert list(restored["ordered"]) == ["b", "a"]
    assert [type(v) for v in restored["numpy_scalars"]] == [type(v) for v in obj["numpy_scalars"]]
    assert np.isnan(utils.loads(utils.dumps(float("nan")), safe=True))
    assert type(restored["bytearray"]) is bytearray


def test_numpy_random_generators_continue_their_streams():
    gens = [np.random.Generator(cls(3)) for cls in (np.random.PCG64, np.random.PCG64DXSM)]
    gens += [np.random.Generator(cls(3)) for cls in (np.random.MT19937, np.random.Philox)]
    gens += [np.random.Generator(np.random.SFC64(3)), np.random.RandomState(3)]
    for g in gens:
        g.random(3)  # not at the start of its stream
        if isinstance(g, np.random.Generator):
            g.integers(0, 5, dtype=np.uint32)  # a cached half word (has_uint32)
        else:
            g.standard_normal()  # a cached gaussian
        restored = utils.loads(utils.dumps(g), safe=True)
        assert type(restored) is type(g)
        np.testing.assert_array_equal(restored.random(5), g.random(5))


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
    kind = draw(st.sampled_from(["numpy", "jax"]))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    size = int(np.prod(shape))
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


pytrees = st.recursive(st.one_of(arrays(), st.integers(), st.floats()), _containers, max_leaves=6)


def assert_same_tree(x, y):
    if isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y)
        for a, b in zip(x, y):
            assert_same_tree(a, b)
    elif isinstance(x, dict):
        assert list(x) == list(y)
        for k in x:
            assert_same_tree(x[k], y[k])
    elif isinstance(x, (np.ndarray, jax.Array)):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        assert x.dtype == y.dtype and x.shape == y.shape
        bx = np.ascontiguousarray(np.asarray(x)).view(np.uint8)  # bitwise, NaNs included
        by = np.ascontiguousarray(np.asarray(y)).view(np.uint8)
        np.testing.assert_array_equal(bx, by)
        if isinstance(x, np.ndarray):
            assert y.flags.writeable
    else:
        assert type(x) is type(y) and (x == y or (x != x and y != y))


@settings(max_examples=30, deadline=None)
@given(tree=pytrees, tiny_chunks=st.booleans())
def test_hypothesis_round_trip_of_pytrees(tree, tiny_chunks):
    chunks = small_chunks(chunk_size=64, small=16) if tiny_chunks else contextlib.nullcontext()
    with chunks:
        s = utils.dumps(tree)
    assert_same_tree(tree, utils.loads(s, safe=True))
    assert_same_tree(tree, utils.loads(s))


def test_threads_and_chunking_give_the_same_result_as_large_chunks():
    obj = {
        "a": np.arange(50_000, dtype=np.float64),
        "b": np.tile(np.arange(256, dtype=np.uint8), 500),
    }
    with small_chunks(chunk_size=4096, small=1024):
        s = utils.dumps(obj)
    assert len(json.loads(s[16 : 16 + int.from_bytes(s[12:16], "little")])) > 0
    assert_tree_equal(utils.loads(s, safe=True), obj)


def test_chunks_that_finish_out_of_order_land_where_one_thread_puts_them(tmp_path, monkeypatch):
    obj = {
        "noise": np.random.default_rng(0).random(3000),  # stored raw
        "ramp": np.tile(np.arange(256, dtype=np.uint8), 200),  # compressed
        "step": 7,
    }
    with small_chunks(chunk_size=1024, small=256):
        monkeypatch.setattr(_ckpt_container, "num_threads", lambda: 1)
        serial = utils.dumps(obj)
        monkeypatch.setattr(_ckpt_container, "num_threads", lambda: 4)
        compress, lock, started, finished = _ckpt_container._compress, threading.Lock(), [], []

        def every_third_late(chunk):
            with lock:
                k = len(started)
                started.append(k)
            if k % 3 == 0:
                time.sleep(0.02)  # the next chunks finish first
            result = compress(chunk)
            with lock:
                finished.append(k)
            return result

        monkeypatch.setattr(_ckpt_container, "_compress", every_third_late)
        threaded = utils.dumps(obj)
        utils.dump(obj, tmp_path / "ckpt")
    assert finished != sorted(finished)  # the chunks did finish out of order
    assert threaded == serial
    assert (tmp_path / "ckpt").read_bytes() == serial
    assert_tree_equal(utils.loads(serial, safe=True), obj)


def _late_every_third(monkeypatch):
    """Delay every third chunk's compression, so that later chunks finish first."""
    compress, lock, started = _ckpt_container._compress, threading.Lock(), []

    def late(chunk):
        with lock:
            k = len(started)
            started.append(k)
        if k % 3 == 0:
            time.sleep(0.01)
        return compress(chunk)

    monkeypatch.setattr(_ckpt_container, "_compress", late)


OBJ_OF_MANY_CHUNKS = {
    "noise": np.random.default_rng(1).random(20_000),  # stored raw
    "ramp": np.tile(np.arange(256, dtype=np.uint8), 700),  # compressed
    "tail": np.arange(1001, dtype=np.int16),
}


# -- registered types ----------------------------------------------------------------------


class Point(NamedTuple):
    x: float
    y: np.ndarray


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    sizes: tuple


class Counter:
    """A stateful object with the checkpoint protocol, checking its state on restore."""

    def __init__(self, n=0):
        self.n = n

    def __checkpoint_state__(self):
        return {"n": self.n}

    @classmethod
    def __checkpoint_restore__(cls, state):
        if set(state) != {"n"} or type(state["n"]) is not int or state["n"] < 0:
            raise ValueError(f"bad counter state {state!r}")
        return cls(state["n"])


class Unregistered(NamedTuple):
    a: int


def test_registered_namedtuples_dataclasses_and_stateful_objects_round_trip():
    utils.register_checkpoint_type(Point, "tests.Point")
    utils.register_checkpoint_type(Config)
    assert utils.register_checkpoint_type(Counter, "tests.Counter") is Counter
    obj = [Point(1.0, np.ones(2)), Config("c", (1, 2)), Counter(4)]
    p, c, k = utils.loads(utils.dumps(obj), safe=True)
    assert type(p) is Point and p.x == 1.0 and p.y.tolist() == [1.0, 1.0]
    assert c == Config("c", (1, 2))
    assert type(k) is Counter and k.n == 4
    with pytest.raises(utils.UnsafeCheckpointError, match=r"test_checkpoint\.Unregistered"):
        utils.loads(utils.dumps({"x": Unregistered(1)}), safe=True)
    assert utils.loads(utils.dumps(Unregistered(1))) == Unregistered(1)


def test_stateful_restore_checks_reach_the_caller_as_value_errors():
    utils.register_checkpoint_type(Counter, "tests.Counter")
    s = forge(tree(["o", 0, "tests.Counter", ["d", 1, [["n", -5]]]]), [b""])
    with pytest.raises(ValueError, match=r"invalid tests\.Counter state: bad counter state"):
        utils.loads(s, safe=True)


def test_register_checkpoint_type_rejects_bad_arguments():
    with pytest.raises(TypeError, match="NamedTuple, a dataclass"):
        utils.register_checkpoint_type(dict)
    with pytest.raises(TypeError, match="NamedTuple, a dataclass"):
        utils.register_checkpoint_type(lambda: None)
    with pytest.raises(ValueError, match="already registered"):
        utils.register_checkpoint_type(Config, "tests.Point")
    with pytest.raises(TypeError, match="non-empty str"):
        utils.register_checkpoint_type(Config, "")


# -- format integrity ----------------------------------------------------------------------


def small_checkpoint():
    rng = np.random.default_rng(5)
    obj = {"w": rng.integers(0, 4, 600).astype(np.uint8), "noise": rng.random(40), "n": 3}
    with small_chunks(chunk_size=256, small=128):
        return obj, utils.dumps(obj)


def test_every_single_byte_flip_is_detected():
    obj, s = small_checkpoint()
    assert_tree_equal(utils.loads(s), obj)
    for i in range(len(s)):
        damaged = bytearray(s)
        damaged[i] ^= 0x10
        with pytest.raises(utils.CheckpointDamagedError, match="damaged or forged"):
            utils.loads(bytes(damaged), safe=True)


def test_every_truncation_is_detected(tmp_path):
    _, s = small_checkpoint()
    for n in range(len(s)):
        with pytest.raises(utils.CheckpointDamagedError, match="damaged or forged"):
            utils.loads(s[:n])
    path = tmp_path / "truncated.ckpt"
    for n in (0, 5, len(s) // 2, len(s) - 1):
        path.write_bytes(s[:n])
        with pytest.raises(utils.CheckpointDamagedError, match=r"file '.*truncated\.ckpt' is dam"):
            utils.load(path, safe=True)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"hello world, this is not a checkpoint at all" * 3,
        b"\x89PNG\r\n\x1a\n" + bytes(100),
        pickle.dumps({"a": 1}),
        _ckpt_container.MAGIC[:-1] + b"?" + bytes(80),
    ],
    ids=["empty", "text", "png", "plain-pickle", "wrong-magic"],
)
def test_foreign_data_is_refused(data, tmp_path):
    with pytest.raises(utils.CheckpointDamagedError, match="the given data is damaged or forged"):
        utils.loads(data)
    path = tmp_path / "foreign.bin"
    path.write_bytes(data)
    with pytest.raises(utils.CheckpointDamagedError, match=r"file '.*foreign\.bin' is damaged"):
        utils.load(path)


def test_newer_format_version_is_refused_with_a_clear_message():
    s = forge(tree(None), [b""], version=3)
    with pytest.raises(utils.CheckpointNotReadableError, match="version 3, written by a newer"):
        utils.loads(s)


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


def test_fifo_folder_and_device_are_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    for path in (fifo, tmp_path, "/dev/zero"):
        with pytest.raises(ValueError, match="is not a regular file"):
            utils.load(path, safe=True)


def test_metadata_block_is_json_with_format_details():
    s = utils.dumps(1)
    meta_len = int.from_bytes(s[12:16], "little")
    meta = json.loads(s[16 : 16 + meta_len])
    assert meta["codec"] == "lz4.block" and meta["checksum"] == "crc32"
    assert meta["chunk_size"] == _ckpt_container.CHUNK_SIZE
    assert int.from_bytes(s[8:12], "little") == _checkpoint.FORMAT_VERSION == 2


# -- older files ---------------------------------------------------------------------------


def test_version_1_files_load_with_safe_false_only():
    path = DATA / "checkpoint_v1.ckpt"  # written by coax_utils 0.1 (format version 1)
    obj = utils.load(path)
    assert obj["step"] == 42 and obj["name"] == "v1"
    np.testing.assert_array_equal(obj["w"], np.arange(20000, dtype=np.float32).reshape(100, 200))
    assert obj["w"].flags.writeable and obj["small"].dtype == np.int16
    assert isinstance(obj["j"], jax.Array) and obj["weak"].weak_type
    np.testing.assert_array_equal(
        jax.random.key_data(obj["key"]), jax.random.key_data(jax.random.key(7))
    )
    with pytest.raises(utils.UnsafeCheckpointError, match=r"format version 1"):
        utils.load(path, safe=True)


def test_legacy_coax_files_load_with_safe_false_only(tmp_path):
    state, _ = agent_state()
    obj = {"params": state["params"], "replay": state["replay"], "step": 3}
    legacy = lz4.frame.compress(cloudpickle.dumps(obj))  # coax.utils.dumps
    assert_tree_equal(utils.loads(legacy), obj)
    with pytest.raises(utils.UnsafeCheckpointError, match="legacy coax pickle"):
        utils.loads(legacy, safe=True)
    path = tmp_path / "coax.pkl.lz4"
    with lz4.frame.open(path, "wb") as f:  # coax.utils.dump
        f.write(cloudpickle.dumps(obj))
    assert_tree_equal(utils.load(path), obj)
    path.write_bytes(legacy[: len(legacy) // 2])
    with pytest.raises(utils.CheckpointDamagedError, match=r"coax\.pkl\.lz4' is damaged or forged"):
        utils.load(path)


# -- hostile files -------------------------------------------------------------------------

ATTACKS = {
    # pickle streams an attacker could write: each would run code when unpickled
    "os.system": b"\x80\x04cposix\nsystem\n\x8c\x04true\x85R.",
    "f2py main": b"\x80\x04cnumpy.f2py.__main__\nmain\n).",
    "numpy seed": b"\x80\x04cnumpy.random\nseed\nK\x01\x85R.",
    "setattr": b"\x80\x04cbuiltins\nsetattr\ncnumpy\nfloat32\n\x8c\x05dtype\nK\x01\x87R.",
    "object array": (b"\x80\x02cnumpy\nndarray\n(K\x01\x85X\x01\x00\x00\x00OC\x08AAAAAAAAtR."),
}

HOSTILE_CHILD = textwrap.dedent(
    """
    import json, sys, threading
    import numpy as np
    from coax_utils import utils
    utils.loads(utils.dumps({"warm": 1}), safe=True)
    results = []
    for data in json.loads(sys.stdin.read()):
        before_modules, before_threads = set(sys.modules), threading.active_count()
        before_rng = np.random.get_state()[1].copy()
        before_attr = np.float32.dtype
        try:
            utils.loads(bytes.fromhex(data), safe=True)
            outcome = "loaded"
        except utils.UnsafeCheckpointError as e:
            outcome = "unsafe: " + str(e)
        except ValueError as e:
            outcome = "invalid: " + str(e)
        results.append({
            "outcome": outcome,
            "new_modules": sorted(set(sys.modules) - before_modules),
            "threads": threading.active_count() - before_threads,
            "rng_same": bool((np.random.get_state()[1] == before_rng).all()),
            "attr_same": np.float32.dtype is before_attr,
        })
    print(json.dumps(results))
    """
)


def run_hostile(payloads):
    """Load each payload with safe=True in one child process; what each did to the process."""
    out = subprocess.run(
        [sys.executable, "-c", HOSTILE_CHILD],
        input=json.dumps([p.hex() for p in payloads]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr  # the process survived
    return json.loads(out.stdout.strip().splitlines()[-1])


def wrappers(stream):
    """The pickle stream wrapped in each kind of file an attacker could hand over."""
    yield "legacy coax frame", lz4.frame.compress(stream)
    yield "pickle section", forge(tree(["p", 0], pickled=["builtins.int at x"]), [b""], stream)
    yield "format version 1", _ckpt_container.container_bytes(1, {}, [[memoryview(stream)]])


def test_safe_mode_never_unpickles_hostile_streams():
    cases = [(a, kind, data) for a in sorted(ATTACKS) for kind, data in wrappers(ATTACKS[a])]
    results = run_hostile([data for _, _, data in cases])
    for (attack, kind, _), result in zip(cases, results):
        assert result["outcome"].startswith("unsafe: "), (attack, kind, result)
        assert "safe=False only if you trust" in result["outcome"]
        assert result["new_modules"] == [], (attack, kind, result)
        assert result["threads"] == 0 and result["rng_same"] and result["attr_same"]


def test_a_hostile_data_tree_in_a_subprocess_changes_nothing():
    # a Generator whose MT19937 position is out of range (read past the key when drawing)
    key = np.zeros(624, np.uint32).tobytes()
    data = forge(tree(["g", 0, "MT19937", mt_state(pos=10**6)], [[2, 0, len(key)]]), [key])
    (result,) = run_hostile([data])
    assert result["outcome"].startswith("invalid: ") and "position" in result["outcome"]
    assert result["new_modules"] == [] and result["threads"] == 0 and result["rng_same"]


def mt_state(pos=0, key_dtype="<u4", key_len=624):
    return [
        "d",
        1,
        [
            ["bit_generator", "MT19937"],
            ["state", ["d", 2, [["key", ["a", 3, key_dtype, [key_len], "C", 0]], ["pos", pos]]]],
        ],
    ]


BAD_TREES = {
    "mt position": (["g", 0, "MT19937", mt_state(pos=625)], "position"),
    "mt key shape": (["g", 0, "MT19937", mt_state(key_len=623)], "key must be"),
    "pcg state": (
        [
            "g",
            0,
            "PCG64",
            [
                "d",
                1,
                [
                    ["bit_generator", "PCG64"],
                    ["state", ["d", 2, [["state", ["I", hex(2**130)]], ["inc", 1]]]],
                    ["has_uint32", 0],
                    ["uinteger", 0],
                ],
            ],
        ],
        "state must be an int",
    ),
    "unknown bit generator": (["g", 0, "ThreeFry", ["d", 1, []]], "bit generator"),
    "object dtype": (["a", 0, "|O", [1], "C", 0], "not an allowed plain-data dtype"),
    "structured dtype": (["a", 0, "[('a', 'O')]", [1], "C", 0], "not an allowed"),
    "shape lies": (["a", 0, "<f8", [1000], "C", 0], "holds 8 bytes, its node needs 8000"),
    "huge shape": (["a", 0, "<f8", [2**40, 2**40], "C", 0], "its node needs"),
    "negative shape": (["a", 0, "<f8", [-1], "C", 0], "dimension"),
    "bool as size": (["a", 0, "<f8", [True], "C", 0], "dimension"),
    "order": (["a", 0, "<f8", [1], "X", 0], "order"),
    "missing buffer": (["a", 0, "<f8", [1], "C", 7], "does not exist"),
    "unregistered record": (["n", 0, "os.system", []], "not registered"),
    "unregistered object": (["o", 0, "subprocess.Popen", ["d", 1, []]], "not registered"),
    "record fields": (["n", 0, "optax.ScaleByAdamState", []], "has fields"),
    "record field twice": (
        ["n", 0, "optax.EmptyState", [["a", None], ["a", None]]],
        "a field twice",
    ),
    "undefined reference": (["l", 0, [["@", 5]]], "not an object defined and finished"),
    "reference to itself": (["l", 0, [["@", 0]]], "a reference forward, or a cycle"),
    "id reused": (["l", 0, [["l", 0, []]]], "not a new integer id"),
    "unknown tag": (["eval", "1+1"], "unknown node tag"),
    "pickle node in safe mode": (["p", 0], "does not exist"),
    "key impl": (["k", 0, "evil", None], "PRNG implementation"),
    "unhashable key": (["d", 0, [[["l", 1, []], 1]]], "malformed"),
    "too deep": (["l", 0, [["l", 1, [["l", 2, [None]]]]]], None),
}


@pytest.mark.parametrize("name", sorted(BAD_TREES))
def test_malformed_data_trees_raise_value_error_naming_the_file(name, tmp_path):
    root, message = BAD_TREES[name]
    words = {"mt position": 624, "mt key shape": 623}.get(name, 2)
    buf = np.zeros(words, np.uint32).tobytes()
    if name == "too deep":
        for i in range(3, 200):
            root = ["l", i, [root]]
        message = "nested deeper"
    path = tmp_path / "bad.ckpt"
    path.write_bytes(forge(tree(root, [[2, 0, len(buf)]]), [buf]))
    # a type unknown here, or of another version (other fields): intact, not readable
    readable = message not in ("not registered", "has fields")
    family = utils.CheckpointDamagedError if readable else utils.CheckpointNotReadableError
    with pytest.raises(family, match=r"bad\.ckpt' is (damaged|intact but cannot be read)") as e:
        utils.load(path, safe=True)
    assert message in str(e.value)
    assert not isinstance(e.value, utils.UnsafeCheckpointError)


def test_buffers_must_lie_inside_their_segments_and_own_them():
    big = bytes(100_000)
    bad_tables = [
        [[2, 0, 9]],  # past the end of the shared segment
        [[3, 0, 10]],  # a part of a large segment
        [[3, 0, len(big)], [3, 0, len(big)]],  # one large segment for two arrays
        [[9, 0, 1]],  # no such segment
        [[1, 0, 0]],  # the pickle section is not a buffer
        [["2", 0, 1]],
        [[2, 0, 4], [2, 0, 4]],  # small buffers that overlap
        [[2, 4, 4]],  # a gap before a small buffer
    ]
    for table in bad_tables:
        data = forge(tree(None, table), [bytes(8), big])
        with pytest.raises(ValueError, match="buffer entry"):
            utils.loads(data, safe=True)
    for segment in (0, 3):  # a 60 kB buffer made 120 MB by a 74 kB file: refused
        root = ["l", 0, [["a", i + 1, "|u1", [60_000], "C", 0] for i in range(2000)]]
        buffers = [[2, 0, 60_000]] if segment == 0 else [[3, 0, 60_000]]
        data = forge(tree(root, buffers), [bytes(60_000) if segment == 0 else b"", bytes(60_000)])
        assert len(data) < 80_000
        with pytest.raises(ValueError, match="used twice"):
            utils.loads(data, safe=True)


class Holder:
    """A class of no registered kind: it goes to the pickle section."""

    def __init__(self, **arrays):
        self.__dict__.update(arrays)


class Raw:
    """Bytes handed to pickle as a buffer of their own (protocol 5)."""

    def __init__(self, data):
        self.data = bytes(data)

    def __reduce_ex__(self, protocol):
        return Raw, (pickle.PickleBuffer(self.data),)


def test_large_buffers_of_pickled_objects_are_stored_out_of_band(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((300, 200)).astype(np.float32)
    frozen = np.arange(50_000, dtype=np.int64)
    frozen.flags.writeable = False
    holder = Holder(
        big=big,
        same=big,  # one array, twice
        fortran=np.asfortranarray(rng.random((200, 100))),
        strided=big[:, ::2],  # not contiguous: copied into the pickle
        frozen=frozen,
        blob=bytearray(b"\x01" * 1000),
        small=np.arange(3),
        raw=Raw(b"raw" * 30_000),
    )
    data = utils.dumps({"holder": holder, "data": np.ones(70_000)})
    source = _ckpt_container.MemorySource(memoryview(data))
    container = _ckpt_container.parse(source, 2)
    structure = json.loads(_ckpt_container.read_segments(source, container, [0])[0].tobytes())
    assert len(structure["pickle_buffers"]) == 4  # big, fortran, frozen, raw
    assert container.segments[1][0] < 130_000  # the pickle holds the strided copy, not more
    utils.dump({"holder": holder}, tmp_path / "h.ckpt")
    for restored in (utils.loads(data), utils.load(tmp_path / "h.ckpt")):
        h = restored["holder"]
        for name, value in vars(holder).items():
            assert type(getattr(h, name)) is type(value)
            if name != "raw":
                np.testing.assert_array_equal(getattr(h, name), value)
        assert h.raw.data == holder.raw.data
        assert h.same is h.big and h.big.flags.writeable and not h.frozen.flags.writeable
        assert h.fortran.flags.f_contiguous and h.fortran.dtype == np.float64
    np.testing.assert_array_equal(utils.loads(data)["data"], np.ones(70_000))
    with pytest.raises(utils.UnsafeCheckpointError):
        utils.loads(data, safe=True)


def test_pickle_buffers_are_checked_like_every_buffer():
    big = bytes(100_000)
    pickled = pickle.dumps(
        [np.frombuffer(big, np.uint8)], protocol=5, buffer_callback=lambda b: False
    )
    good = tree(["p", 0], [[3, 0, len(big)]], ["numpy.ndarray"])
    assert utils.loads(forge({**good, "pickle_buffers": [0]}, [b"", big], pickled)).nbytes == (
        len(big)
    )
    cases = {
        "not a list": ({"pickle_buffers": 0}, pickled, "not a list"),
        "missing buffer": ({"pickle_buffers": [1]}, pickled, "does not exist"),
        "too few buffers": ({"pickle_buffers": []}, pickled, "pickle is damaged"),
        "no pickle section": ({"pickle_buffers": [0]}, b"", "does not have"),
        "unknown key": ({"pickle_buffers": [0], "more": 1}, pickled, "not a checkpoint tree"),
    }
    for name, (extra, section, message) in cases.items():
        data = forge({**good, **extra}, [b"", big], section)
        for safe in (False, True):
            if safe and section:
                with pytest.raises(utils.UnsafeCheckpointError):
                    utils.loads(data, safe=True)
                continue
            with pytest.raises(ValueError, match="not a valid coax_utils checkpoint") as e:
                utils.loads(data, safe=safe)
            assert message in str(e.value), (name, str(e.value))
    root = ["l", 0, [["p", 0], ["a", 1, "|u1", [len(big)], "C", 0]]]
    used_twice = forge(
        {**tree(root, [[3, 0, len(big)]], ["x"]), "pickle_buffers": [0]}, [b"", big], pickled
    )
    with pytest.raises(ValueError, match="used twice"):
        utils.loads(used_twice)


def test_references_count_as_what_they_stand_for():
    # a chain of tuples, each holding the one before: shallow in the JSON, deep when built
    chain = [["t", 1, []]] + [["t", i + 1, [["@", i]]] for i in range(1, 500)]
    deep = tree(["l", 0, chain])
    # each tuple holds the one before twice: 60 levels stand for 2**60 nodes
    dag = [["t", 1, ["x"]]] + [["t", i + 1, [["@", i], ["@", i]]] for i in range(1, 60)]
    wide = tree(["l", 0, [*dag, ["d", 99, [[["@", 60], 1]]]]])  # the last one as a dict key
    for structure, message in [(deep, "nested deeper"), (wide, "counting each reference")]:
        data = forge(structure, [b""])
        assert len(data) < 20_000
        with pytest.raises(ValueError, match=message):
            utils.loads(data, safe=True)


def test_the_structure_is_stored_as_it_is_and_a_compressed_one_is_refused():
    # "[]," is 3 bytes of JSON and 60 bytes once parsed; lz4 packs 255 of them in a byte
    bomb = ("[" + "[]," * 1_000_000 + "[]]").encode()
    data = _ckpt_container.container_bytes(
        2, {}, [[memoryview(bomb)], [memoryview(b"")], [memoryview(b"")]]
    )
    assert len(data) < len(bomb) // 100
    with pytest.raises(ValueError, match="structure is stored compressed"):
        utils.loads(data, safe=True)
    honest = utils.dumps([0] * 100_000)  # compresses well, yet stored as it is
    assert len(honest) > 200_000 and utils.loads(honest, safe=True) == [0] * 100_000


def test_references_to_unfinished_objects_are_damage():
    # X_k = (A_k,) is made inside the dict A_k while A_k is unfinished, then dropped from A_k
    # by a repeated key; A_k goes on to hold X_{k-1} (once: a chain; twice: doubling). The
    # tree is a DAG: a reference to an object not yet finished is refused at once.
    for copies in (1, 2):
        items, prev = [], None
        for k in range(60 if copies == 2 else 200):
            a, x, held = 3 * k + 1, 3 * k + 2, 3 * k + 3
            second = 0 if prev is None else ["l", held, [["@", prev]] * copies]
            items.append(["d", a, [["x", ["t", x, [["@", a]]]], ["x", second]]])
            prev = x
        data = forge(tree(["l", 0, [*items, ["@", prev]]]), [b""])
        assert len(data) < 20_000
        for safe in (True, False):
            with pytest.raises(utils.CheckpointDamagedError, match="forward, or a cycle"):
                utils.loads(data, safe=safe)
    # plain values count: a tuple of 20000 ints used 700 times as a dict key (hashed each time)
    keys = ["t", 1, list(range(20_000))]
    root = ["l", 0, [keys, *(["d", i + 2, [[["@", 1], i]]] for i in range(700))]]
    with pytest.raises(ValueError, match="counting each reference"):
        utils.loads(forge(tree(root), [b""]), safe=True)


def test_keys_that_share_a_hash_are_refused():
    # ints that differ by multiples of 2**61 - 1 hash alike: n of them cost n**2 to insert
    keys = [k * (2**61 - 1) for k in range(1, 2001)]
    for root in (
        ["d", 0, [[["I", hex(k)], None] for k in keys]],
        ["S", 0, [["I", hex(k)] for k in keys]],
        ["n", 0, "optax.EmptyState", [[["I", hex(k)], None] for k in keys]],  # record fields
    ):
        with pytest.raises(ValueError, match="share a hash"):
            utils.loads(forge(tree(root), [b""]), safe=True)
    honest = {k: k for k in range(-100, 1000)} | {-(2**61): 1, 2**200: 2}
    assert utils.loads(utils.dumps([honest, set(honest)]), safe=True) == [honest, set(honest)]


def test_states_are_written_whole_and_read_without_references():
    shared = np.ones(3)
    noise = utils.OrnsteinUhlenbeckNoise(mu=shared, sigma=shared, random_seed=1)
    other = utils.OrnsteinUhlenbeckNoise(mu=shared, random_seed=2)
    obj = {"a": shared, "noise": noise, "other": other, "again": shared}
    restored = utils.loads(utils.dumps(obj), safe=True)
    assert restored["again"] is restored["a"]
    for name in ("noise", "other"):
        np.testing.assert_array_equal(restored[name].mu, shared)
        np.testing.assert_array_equal(restored[name](np.zeros(3)), obj[name](np.zeros(3)))
    # a forged state that refers to an object outside it (several states could share it)
    rng = ["d", 3, [["bit_generator", "PCG64"]]]
    for root in (
        ["l", 0, [["l", 1, []], ["o", 2, "coax_utils.utils.OrnsteinUhlenbeckNoise", ["@", 1]]]],
        ["l", 0, [["l", 1, []], ["g", 2, "PCG64", ["d", 4, [["state", ["@", 1]]]]]]],
        ["l", 0, [["l", 1, []], ["r", 2, ["d", 4, [["x", ["@", 1]], ["y", rng]]]]]],
    ):
        with pytest.raises(ValueError, match="a reference inside the state"):
            utils.loads(forge(tree(root), [b""]), safe=True)


def test_json_nesting_and_number_bombs_are_value_errors():
    deep = "[" * 100_000 + "]" * 100_000
    data = _ckpt_container.container_bytes(
        2, {}, [[memoryview(deep.encode())], [memoryview(b"")], [memoryview(b"")]], 1
    )
    with pytest.raises(ValueError, match="not valid JSON"):
        utils.loads(data)
    with pytest.raises(ValueError, match="not a valid coax_utils checkpoint"):
        utils.loads(forge(tree(["I", "f" * (2 << 20)]), [b""]))


def test_sizes_that_claim_more_than_the_file_can_hold_allocate_nothing():
    s = forge(tree(None), [b""])
    meta_len = int.from_bytes(s[12:16], "little")
    head = s[: 16 + meta_len + 4]
    # a new index: segment 0 claims a whole chunk (16 MiB) stored in 3 bytes of lz4
    n = _ckpt_container.CHUNK_SIZE
    index = json.dumps({"segments": [[n, [[3, 0, 1]]], [0, []], [0, []]]}).encode()
    offset = len(head) + 3
    fields = struct.pack("<QQI", offset, len(index), zlib.crc32(index))
    footer = struct.pack(
        "<QQII8s", *struct.unpack("<QQI", fields), zlib.crc32(fields), _ckpt_container.END_MAGIC
    )
    forged = head + bytes(3) + index + footer
    assert len(forged) < 400
    with pytest.raises(ValueError, match="claims more data than the stored chunks can hold"):
        utils.loads(forged)


def test_jax_arrays_that_need_x64_are_refused_while_it_is_off():
    data = np.arange(3, dtype=np.int64) + 2**40
    s = forge(tree(["j", 0, "<i8", [3], False, 0], [[2, 0, 24]]), [data.tobytes()])
    with pytest.raises(utils.CheckpointNotReadableError, match="jax_enable_x64"):
        utils.loads(s, safe=True)


# -- files ---------------------------------------------------------------------------------


def fail_after_first_chunk(monkeypatch):
    real = _ckpt_container._compress
    calls = []

    def compress(chunk):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk on fire")
        return real(chunk)

    monkeypatch.setattr(_ckpt_container, "_compress", compress)
    return calls


@pytest.mark.parametrize("path_type", [str, bytes, pathlib.Path])
def test_failed_dump_keeps_the_old_file_and_leaves_no_temp_file(path_type, tmp_path, monkeypatch):
    path = path_type(
        os.fsencode(tmp_path / "ckpt.lz4") if path_type is bytes else tmp_path / "ckpt.lz4"
    )
    utils.dump({"version": "old"}, path)
    old = (tmp_path / "ckpt.lz4").read_bytes()
    with pytest.raises(TypeError):  # cannot be pickled: fails before the file system is touched
        utils.dump({"version": "new", "lock": threading.Lock()}, path)
    calls = fail_after_first_chunk(monkeypatch)
    with small_chunks(), pytest.raises(OSError, match="disk on fire"):  # fails while writing
        utils.dump({"version": "new", "data": np.arange(10_000)}, path)
    assert len(calls) > 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt.lz4"]
    assert (tmp_path / "ckpt.lz4").read_bytes() == old


def test_dump_keeps_the_mode_bits_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "private.ckpt"
    utils.dump(1, path)
    os.chmod(path, 0o600)
    utils.dump(2, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path, 0o640)
    utils.dump(3, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    old = os.umask(0o027)
    try:
        utils.dump(4, tmp_path / "new.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.ckpt").st_mode) == 0o640
    assert utils.load(path) == 3


KILLED_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from coax_utils import utils
    from coax_utils.utils._checkpoint import container as _ckpt_container
    real = _ckpt_container._compress
    def slow(chunk):
        print("dumping", flush=True)
        import time; time.sleep(60)
    _ckpt_container._compress = slow
    utils.dump({"version": "new", "data": np.arange(10)}, sys.argv[1])
    """
)


def test_dump_killed_with_sigkill_keeps_the_old_file_and_the_next_dump_cleans_up(tmp_path):
    path = tmp_path / "ckpt.lz4"
    utils.dump({"version": "old"}, path)
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "dumping"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    left = sorted(os.listdir(tmp_path))
    assert len(left) == 2 and left[0].startswith(".coax_utils-") and left[1] == "ckpt.lz4"
    assert utils.load(path) == {"version": "old"}
    utils.dump({"version": "newer"}, tmp_path / "other.ckpt")  # any dump into the folder
    assert sorted(os.listdir(tmp_path)) == ["ckpt.lz4", "other.ckpt"]


def test_temp_files_of_live_processes_are_left_alone(tmp_path):
    live = tmp_path / f".coax_utils-{os.getpid()}-{'0' * 12}.tmp"
    live.write_bytes(b"in progress")
    utils.dump(1, tmp_path / "x.ckpt")
    assert live.exists()


# -- memory --------------------------------------------------------------------------------

MEMORY_CHILD = textwrap.dedent(
    """
    import sys, types
    import numpy as np
    from coax_utils import utils
    def hwm():
        for line in open('/proc/self/status'):
            if line.startswith('VmHWM'):
                return int(line.split()[1]) * 1024
    mode, kind, path = sys.argv[1], sys.argv[2], sys.argv[3]
    utils.loads(utils.dumps({"warm": np.ones(10)}), safe=True)
    if mode == "dump":
        rng = np.random.default_rng(0)
        obj = {"frames": np.zeros((3000, 84, 84, 4), np.uint8), "f": rng.random(4_000_000)}
        obj["frames"][:, ::9, ::7] = rng.integers(0, 255, obj["frames"][:, ::9, ::7].shape)
        if kind == "pickled":  # a class of another package: the pickle section
            obj = {"agent": types.SimpleNamespace(**obj)}
        base = hwm()
        utils.dump(obj, path)
    else:
        base = hwm()
        obj = utils.load(path, safe=kind == "tree")
    arrays = vars(obj["agent"]) if kind == "pickled" else obj
    assert all(a.flags.writeable for a in arrays.values())
    print(arrays["frames"].nbytes + arrays["f"].nbytes, hwm() - base)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tree", "pickled"])
def test_dump_and_load_memory_stay_within_their_bounds(kind, tmp_path):
    path = str(tmp_path / "big.ckpt")
    peaks = {}
    for mode in ("dump", "load"):
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, mode, kind, path],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout.split()
        size, peaks[mode] = int(out[0]), int(out[1])
    assert size > 100 << 20
    assert peaks["dump"] <= 0.1 * size + (64 << 20), peaks
    assert peaks["load"] <= 1.1 * size + (64 << 20), peaks


def test_docstrings_warn_about_trust_and_references():
    for fn in (utils.load, utils.loads):
        assert "trust" in fn.__doc__ and "safe=True" in fn.__doc__
    for fn in (utils.dump, utils.dumps, utils.load, utils.loads):
        assert "References between objects are only preserved" in fn.__doc__
        assert "{references}" not in fn.__doc__


def test_file_load_without_preadv(tmp_path, monkeypatch):
    state = {"w": np.arange(100_000.0), "n": 1}
    utils.dump(state, tmp_path / "x.ckpt")
    monkeypatch.delattr(os, "preadv")
    assert_tree_equal(utils.load(tmp_path / "x.ckpt", safe=True), state)


def test_version_1_stateful_objects_are_refused_rather_than_half_built():
    # a SimpleReplayBuffer pickled by coax_utils 0.1 with its attributes of that version
    with pytest.raises(utils.CheckpointNotReadableError, match="SimpleReplayBuffer of coax_util"):
        utils.load(DATA / "buffer_v1.ckpt")
