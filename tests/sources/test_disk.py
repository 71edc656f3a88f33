"""DiskSource: chunked prefetch through io_callback, epochs, spec inference, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.sources import DiskSource, DiskSourceState, Source
from tests._compiles import eager_compiles


class Recorder:
    """A sample function over files in a folder that records every call."""

    def __init__(self, folder, n):
        self.paths = []
        for i in range(n):
            path = folder / f"{i}.npz"
            np.savez(path, x=np.full((2, 3), i, np.float32), y=np.int64(i))
            self.paths.append(path)
        self.calls = []
        self.fetches = 0

    def __call__(self, i):
        self.calls.append(i)
        with np.load(self.paths[i]) as f:
            return {"x": f["x"], "y": f["y"]}


def scan_items(source, state, steps):
    def body(state, _):
        value, mask, state = source.next(state)
        return state, (value, mask, state.epoch)

    state, out = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(state)
    return out, state


def test_spec_inferred_from_first_sample(tmp_path):
    fn = Recorder(tmp_path, 3)
    source = DiskSource(3, fn)
    assert isinstance(source, Source)
    assert fn.calls == [0]
    spec = source.element_spec()
    assert spec["x"] == jax.ShapeDtypeStruct((2, 3), jnp.float32)
    # int64 is canonicalized to what JAX uses (int32 unless 64-bit mode is on).
    assert spec["y"].dtype == jax.dtypes.canonicalize_dtype(np.int64)
    assert source.steps_per_epoch == 3


@pytest.mark.parametrize("n, prefetch", [(10, 4), (8, 4), (3, 64), (7, 1)])
def test_each_index_once_per_epoch_in_chunks(tmp_path, n, prefetch):
    fn = Recorder(tmp_path, n)
    source = DiskSource(n, fn, ordering="shuffle", prefetch_size=prefetch)
    fn.calls.clear()
    chunks = []
    fetch = source._fetch

    def counting_fetch(indices, count):
        chunks.append(int(count))
        return fetch(indices, count)

    source._fetch = counting_fetch
    (values, masks, epochs), state = scan_items(source, source.init_state(jax.random.key(0)), 2 * n)
    assert bool(masks.all())
    for e in range(2):
        emitted = np.asarray(values["y"][e * n : (e + 1) * n])
        assert sorted(emitted.tolist()) == list(range(n))
        assert sorted(fn.calls[e * n : (e + 1) * n]) == list(range(n))
        # The emitted order is the order in which samples were fetched.
        assert emitted.tolist() == fn.calls[e * n : (e + 1) * n]
    assert len(fn.calls) == 2 * n
    # Chunks of prefetch_size, the last one of an epoch possibly shorter.
    per_epoch = [prefetch] * (n // prefetch) + ([n % prefetch] if n % prefetch else [])
    assert chunks == per_epoch * 2
    assert np.array_equal(values["x"][:, 0, 0], values["y"].astype(np.float32))
    assert epochs.tolist()[n - 1] == 1 and int(state.epoch) == 2


def test_sequential_order_and_shuffle_differs_between_epochs(tmp_path):
    n = 12
    fn = Recorder(tmp_path, n)
    seq = DiskSource(n, fn, ordering="sequential", prefetch_size=5)
    (values, _, _), _ = scan_items(seq, seq.init_state(jax.random.key(0)), n + 2)
    assert values["y"].tolist() == list(range(n)) + [0, 1]
    shuffled = DiskSource(n, fn, prefetch_size=5)
    (values, _, _), _ = scan_items(shuffled, shuffled.init_state(jax.random.key(0)), 2 * n)
    first, second = np.asarray(values["y"]).reshape(2, n)
    assert not np.array_equal(first, second)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))


def test_explicit_spec_and_casting(tmp_path):
    calls = []

    def fn(i):
        calls.append(i)
        return np.arange(3, dtype=np.float64) + i  # float64 matches float32 without x64

    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    source = DiskSource(4, fn, sample_spec=spec, ordering="sequential", prefetch_size=2)
    assert calls == []  # nothing is called to infer the spec
    (values, _, _), _ = scan_items(source, source.init_state(jax.random.key(0)), 4)
    assert values.dtype == jnp.float32
    assert np.array_equal(values, np.arange(3)[None, :] + np.arange(4)[:, None])


def test_eager_matches_jit(tmp_path):
    fn = Recorder(tmp_path, 6)
    source = DiskSource(6, fn, prefetch_size=4)
    state = source.init_state(jax.random.key(5))
    eager = []
    s = state
    for _ in range(9):
        value, _, s = source.next(s)
        eager.append(int(value["y"]))
    (values, _, _), _ = scan_items(source, state, 9)
    assert values["y"].tolist() == eager


def test_exception_in_sample_fn_names_index_and_message(tmp_path):
    def fn(i):
        if i == 3:
            raise KeyError("record 3 is corrupt")
        return np.float32(i)

    source = DiskSource(5, fn, ordering="sequential", prefetch_size=2)
    state = source.init_state(jax.random.key(0))
    step = jax.jit(source.next)
    _, _, state = step(state)
    _, _, state = step(state)  # first chunk (0, 1) is fine
    with pytest.raises(Exception, match=r"sample_fn\(3\) raised KeyError: 'record 3 is corrupt'"):
        jax.block_until_ready(step(state))
    # Called eagerly, the error is a plain ValueError.
    with pytest.raises(ValueError, match=r"sample_fn\(3\) raised KeyError"):
        source._fetch(np.array([3, 4]), np.int32(2))


def test_exception_while_inferring_spec():
    def fn(i):
        raise OSError("disk gone")

    with pytest.raises(ValueError, match=r"sample_fn\(0\) raised OSError: disk gone"):
        DiskSource(3, fn)


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            np.zeros(4, np.float32),
            r"sample_fn\(2\) returned leaf 0 with shape \(4,\) dtype float32"
            r"; the spec expects shape \(3,\) dtype float32",
        ),
        (np.zeros(3, np.uint8), "dtype uint8; the spec expects shape \\(3,\\) dtype float32"),
        ({"a": np.zeros(3, np.float32)}, r"sample_fn\(2\) returned a pytree of structure"),
    ],
)
def test_sample_not_matching_spec_is_a_clear_error(bad, match):
    def fn(i):
        return bad if i == 2 else np.zeros(3, np.float32)

    source = DiskSource(4, fn, ordering="sequential", prefetch_size=4)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(source.next)(source.init_state(jax.random.key(0))))


def test_no_retrace_on_second_call():
    chex.clear_trace_counter()
    source = DiskSource(5, lambda i: np.float32(i), prefetch_size=2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state):
        return source.next(state)

    state = source.init_state(jax.random.key(0))
    assert isinstance(state, DiskSourceState)
    for _ in range(7):
        _, _, state = step(state)
    assert int(state.epoch) == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(length=0), ValueError, "length must be a positive integer, got 0"),
        (dict(length=-3), ValueError, "got -3"),
        (dict(prefetch_size=0), ValueError, "prefetch_size must be a positive integer"),
        (dict(length=2.5), TypeError, "length must be a positive integer"),
        # positions are int32: refused before init_state allocates an 8 GiB order
        (dict(length=2**31), ValueError, "length must be at most 2147483647"),
        (dict(prefetch_size=2**40), ValueError, "prefetch_size must be at most"),
        (dict(ordering="backwards"), ValueError, "'backwards'"),
        (dict(sample_fn=3), TypeError, "sample_fn must be callable"),
        (dict(sample_spec={}), ValueError, "at least one leaf"),
        (dict(sample_spec=np.zeros(3)), TypeError, "jax.ShapeDtypeStruct"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(length=4, sample_fn=lambda i: np.float32(i))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        DiskSource(**args)


def test_int64_samples_beyond_int32_raise_under_jit_instead_of_wrapping():
    data = np.array([2**40, 1, 5], np.int64)
    source = DiskSource(3, lambda i: data[i], ordering="sequential")
    with pytest.raises(Exception, match="1099511627776"):
        jax.block_until_ready(jax.jit(source.next)(source.init_state(jax.random.key(0))))


def test_next_refuses_another_sources_state():
    a = DiskSource(3, lambda i: np.float32(i))
    b = DiskSource(5, lambda i: np.float32(i))
    c = DiskSource(3, lambda i: np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="another source"):
        jax.jit(a.next)(b.init_state(jax.random.key(0)))
    with pytest.raises(ValueError, match="another source"):
        jax.jit(a.next)(c.init_state(jax.random.key(0)))


def test_sample_fn_reusing_one_array_gives_each_sample(tmp_path):
    # A reader that fills one preallocated array per call (readinto) and returns it: each
    # sample must be copied before the next call overwrites it, not repeated across a chunk.
    path = tmp_path / "rows.bin"
    rows = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    rows.tofile(path)
    out = np.empty(4, np.float32)

    with open(path, "rb") as f:

        def sample_fn(i):
            f.seek(i * out.nbytes)
            f.readinto(out)
            return out

        source = DiskSource(10, sample_fn, ordering="shuffle", prefetch_size=4)
        (values, _, _), _ = scan_items(source, source.init_state(jax.random.key(0)), 20)
    values = np.asarray(values)
    for epoch in values.reshape(2, 10, 4):
        assert sorted(epoch[:, 0].tolist()) == rows[:, 0].tolist()
        np.testing.assert_array_equal(epoch, rows[(epoch[:, 0] // 4).astype(int)])


def test_eager_next_compiles_once():
    # each eager call used to trace and compile its conditional anew (about 0.2 s a call,
    # and the compiled code piled up until LLVM ran out of memory)
    source = DiskSource(5, lambda i: np.float32(i), prefetch_size=2)
    assert eager_compiles(source, source.init_state(jax.random.key(0)), 12) == 0


@pytest.mark.parametrize(
    "leaf", ["b", "abc", np.array([1, "a"], dtype=object), np.datetime64("2020-01-01")]
)
def test_non_numeric_first_sample_is_refused_at_construction(leaf):
    # a string leaf was read as a dtype name ("b" gave an int8 spec, "abc" an obscure
    # numpy error), and object or datetime leaves failed only later, inside init_state
    with pytest.raises(TypeError, match=r"leaf 1 of sample_fn\(0\) has dtype"):
        DiskSource(3, lambda i: {"x": np.float32(i), "y": leaf})


def test_sequential_source_resumed_from_a_shuffled_state_is_sequential():
    # a state saved under ordering="shuffle" and resumed by a sequential source kept
    # emitting the saved permutation in every epoch
    state = DiskSource(6, lambda i: np.int32(i), prefetch_size=4).init_state(jax.random.key(0))
    assert state.order.tolist() != list(range(6))
    source = DiskSource(6, lambda i: np.int32(i), ordering="sequential", prefetch_size=4)
    (values, _, _), _ = scan_items(source, state, 14)
    assert values.tolist() == [0, 1, 2, 3, 4, 5] * 2 + [0, 1]


@pytest.mark.parametrize("bad", [-1, 6, 2**31 - 1])
def test_order_with_an_index_out_of_range_is_refused(bad):
    # a state read back from a damaged or foreign checkpoint: sample_fn(-1) quietly read
    # the last sample (Python indexing), and larger indices reached sample_fn unchecked
    calls = []

    def sample_fn(i):
        calls.append(i)
        return np.float32(i)

    source = DiskSource(6, sample_fn, prefetch_size=4)
    calls.clear()
    state = source.init_state(jax.random.key(0))
    state = state.replace(order=state.order.at[2].set(bad))
    with pytest.raises(Exception, match=f"index {bad} outside"):
        jax.block_until_ready(source.next(state))
    assert calls == []
