"""BatchedSource: step counts, padding masks, drop_last, nesting, both code paths."""

import math
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coax_utils.sources import ArraySource, BatchedSource, BatchedSourceState, DiskSource, Source
from tests._compiles import eager_compiles


class Plain:
    """A minimal Source that only has the protocol (forces the generic batching path)."""

    def __init__(self, source):
        self.inner = source
        self.steps_per_epoch = source.steps_per_epoch

    def init_state(self, key):
        return self.inner.init_state(key)

    def next(self, state):
        return self.inner.next(state)

    def element_spec(self):
        return self.inner.element_spec()


def scan_batches(source, steps, key=0):
    def body(state, _):
        batch, mask, state = source.next(state)
        return state, (batch, mask, state.epoch)

    state = source.init_state(jax.random.key(key))
    return jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(state)


def oracle(n, batch_size, drop_last, epochs):
    """Expected sequential batches (value, mask) over ``epochs`` epochs, built with lists."""
    out = []
    for _ in range(epochs):
        for start in range(0, n, batch_size):
            rows = list(range(start, min(start + batch_size, n)))
            if drop_last and len(rows) < batch_size:
                break
            pad = batch_size - len(rows)
            out.append(([r + 1 for r in rows] + [0] * pad, [True] * len(rows) + [False] * pad))
    return out


# Each example compiles a scan, so few random examples plus the edge cases explicitly.
@settings(max_examples=6, deadline=None)
@given(
    n=st.integers(1, 23), batch_size=st.integers(1, 9), drop_last=st.booleans(), plain=st.booleans()
)
@example(n=12, batch_size=4, drop_last=False, plain=True)
@example(n=3, batch_size=5, drop_last=False, plain=True)
@example(n=11, batch_size=4, drop_last=True, plain=True)
@example(n=11, batch_size=4, drop_last=True, plain=False)
@example(n=5, batch_size=1, drop_last=False, plain=False)
def test_sequential_batches_match_oracle(n, batch_size, drop_last, plain):
    if drop_last and n < batch_size:
        return
    inner = ArraySource(jnp.arange(1, n + 1), ordering="sequential")
    source = BatchedSource(Plain(inner) if plain else inner, batch_size, drop_last=drop_last)
    steps = n // batch_size if drop_last else math.ceil(n / batch_size)
    assert source.steps_per_epoch == steps
    state, (values, masks, epochs) = scan_batches(source, 2 * steps)
    expected = oracle(n, batch_size, drop_last, 2)
    assert np.asarray(values).tolist() == [v for v, _ in expected]
    assert np.asarray(masks).tolist() == [m for _, m in expected]
    assert np.asarray(epochs).tolist() == [0] * (steps - 1) + [1] * steps + [2]
    # The wrapped source's epochs stay aligned with the batched ones.
    assert int(state.inner.epoch) == 2 and int(state.inner.position) == 0


@settings(max_examples=6, deadline=None)
@given(
    n=st.integers(1, 30),
    batch_size=st.integers(1, 8),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
)
@example(n=10, batch_size=3, drop_last=False, seed=0)
@example(n=10, batch_size=3, drop_last=True, seed=1)
def test_fast_path_equals_generic_path(n, batch_size, drop_last, seed):
    if drop_last and n < batch_size:
        return
    data = {"x": jnp.arange(n, dtype=jnp.float32)[:, None] * jnp.ones(3), "i": jnp.arange(n)}
    inner = ArraySource(data)
    fast = BatchedSource(inner, batch_size, drop_last)
    slow = BatchedSource(Plain(inner), batch_size, drop_last)
    steps = 3 * fast.steps_per_epoch + 1
    chex.assert_trees_all_equal(scan_batches(fast, steps, seed), scan_batches(slow, steps, seed))


def test_shuffled_epochs_cover_every_index_once():
    n, batch_size = 23, 5
    source = BatchedSource(ArraySource(jnp.arange(n)), batch_size)
    _, (values, masks, _) = scan_batches(source, 3 * source.steps_per_epoch)
    per_epoch = np.asarray(values).reshape(3, -1)
    per_mask = np.asarray(masks).reshape(3, -1)
    for vals, mask in zip(per_epoch, per_mask):
        assert sorted(vals[mask].tolist()) == list(range(n))
        assert np.all(vals[~mask] == 0) and (~mask).sum() == 2
    assert not np.array_equal(per_epoch[0], per_epoch[1])


def test_drop_last_skips_the_tail_but_stays_in_the_epoch():
    n, batch_size = 10, 4
    source = BatchedSource(ArraySource(jnp.arange(n)), batch_size, drop_last=True)
    assert source.steps_per_epoch == 2
    state, (values, masks, _) = scan_batches(source, 6)
    assert bool(np.asarray(masks).all())
    for epoch in np.asarray(values).reshape(3, 8):
        assert len(set(epoch.tolist())) == 8  # one permutation per epoch, no repeats
    assert int(state.inner.epoch) == 3


def test_nested_batches_and_masks():
    inner = BatchedSource(ArraySource({"a": jnp.arange(1, 11)}, ordering="sequential"), 3)
    for outer_inner in (inner, Plain(inner)):
        source = BatchedSource(outer_inner, 3)
        assert source.steps_per_epoch == 2  # 4 inner batches -> ceil(4 / 3)
        assert source.element_spec()["a"] == jax.ShapeDtypeStruct((3, 3), jnp.int32)
        _, (values, masks, epochs) = scan_batches(source, 2)
        assert masks.shape == (2, 3, 3)
        assert np.asarray(values["a"]).tolist() == [
            [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
            [[10, 0, 0], [0, 0, 0], [0, 0, 0]],
        ]
        assert np.asarray(masks[1]).tolist() == [[True, False, False], [False] * 3, [False] * 3]
        assert bool(masks[0].all()) and np.asarray(epochs).tolist() == [0, 1]


def test_wraps_disk_source():
    calls = []

    def fn(i):
        calls.append(i)
        return {"v": np.float32(i)}

    source = BatchedSource(DiskSource(7, fn, prefetch_size=3), 4)
    calls.clear()
    _, (values, masks, _) = scan_batches(source, 4)
    values, masks = np.asarray(values["v"]), np.asarray(masks)
    for e in range(2):
        epoch = slice(2 * e, 2 * e + 2)
        assert sorted(values[epoch][masks[epoch]].tolist()) == list(range(7))
    assert sorted(calls) == sorted(list(range(7)) * 2)


def test_state_spec_and_protocol():
    source = BatchedSource(ArraySource({"x": jnp.zeros((5, 2), jnp.uint8)}), 2)
    assert isinstance(source, Source)
    assert source.element_spec()["x"] == jax.ShapeDtypeStruct((2, 2), jnp.uint8)
    state = source.init_state(jax.random.key(0))
    assert isinstance(state, BatchedSourceState)
    assert state.epoch.dtype == jnp.int32 and state.step.dtype == jnp.int32
    batch, mask, _ = source.next(state)  # eager use works too
    assert batch["x"].shape == (2, 2) and mask.shape == (2,)


@pytest.mark.parametrize("plain", [False, True])
def test_no_retrace_on_second_call(plain):
    chex.clear_trace_counter()
    inner = ArraySource(jnp.arange(7))
    source = BatchedSource(Plain(inner) if plain else inner, 3)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state):
        return source.next(state)

    state = source.init_state(jax.random.key(0))
    for _ in range(4):
        _, _, state = step(state)
    assert int(state.epoch) == 1


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((ArraySource(jnp.arange(4)), 0), ValueError, "batch_size must be a positive integer"),
        ((ArraySource(jnp.arange(4)), -2), ValueError, "got -2"),
        ((ArraySource(jnp.arange(4)), True), TypeError, "batch_size"),
        ((ArraySource(jnp.arange(4)), 5, True), ValueError, "would drop every batch"),
        ((jnp.arange(4), 2), TypeError, "Source protocol"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        BatchedSource(*args)


def test_drop_last_must_be_a_bool():
    with pytest.raises(TypeError, match="'no'"):
        BatchedSource(ArraySource(jnp.arange(5)), 2, drop_last="no")


def test_a_subclass_that_changes_next_is_batched_through_its_next():
    class Doubled(ArraySource):
        def next(self, state):
            value, mask, state = super().next(state)
            return value * 2, mask, state

    source = BatchedSource(Doubled(jnp.arange(1, 6), ordering="sequential"), 2)
    state = source.init_state(jax.random.key(0))
    batches = []
    for _ in range(3):
        batch, mask, state = jax.jit(source.next)(state)
        batches.append((batch.tolist(), mask.tolist()))
    assert batches == [([2, 4], [True, True]), ([6, 8], [True, True]), ([10, 0], [True, False])]


@pytest.mark.parametrize("plain", [False, True])
def test_eager_next_compiles_once(plain):
    # each eager call used to trace and compile its conditionals anew
    inner = ArraySource(jnp.arange(7.0)) if not plain else DiskSource(7, lambda i: np.float32(i))
    source = BatchedSource(inner, 3, drop_last=plain)
    assert eager_compiles(source, source.init_state(jax.random.key(0)), 6) == 0


class Halved(Plain):
    """Emits the items halved (floats) but keeps the wrapped source's (int) spec: it lies."""

    def next(self, state):
        value, mask, state = self.inner.next(state)
        return value / 2, mask, state


class Widened(Plain):
    """Emits items of shape (1,) while its spec says (3,)."""

    def next(self, state):
        value, mask, state = self.inner.next(state)
        return value[None], mask, state

    def element_spec(self):
        return jax.ShapeDtypeStruct((3,), jnp.int32)


@pytest.mark.parametrize("wrapper", [Halved, Widened])
def test_items_that_differ_from_the_spec_are_refused(wrapper):
    # they were cast to the spec's dtype (0.5 became 0) or written into the first columns
    # of wider rows (the rest left 0), silently
    source = BatchedSource(wrapper(ArraySource(jnp.arange(1, 7, dtype=jnp.int32))), 3)
    state = source.init_state(jax.random.key(0))
    with pytest.raises(ValueError, match="element_spec"):
        source.next(state)
    with pytest.raises(ValueError, match="element_spec"):
        jax.jit(source.next)(state)


@pytest.mark.parametrize("plain", [False, True])
def test_state_of_a_batched_source_with_other_batches_is_refused(plain):
    # resumed with another batch_size (or drop_last), the padding was placed by the old
    # count of batches: item 9 of an epoch of 10 came in one batch with items 0, 1, 2 of the
    # next epoch, and the batch and item epochs stayed misaligned from then on
    inner = DiskSource(10, lambda i: np.int32(i), ordering="sequential", prefetch_size=4)
    inner = Plain(inner) if plain else inner
    three = BatchedSource(inner, 3)
    state = three.next(three.init_state(jax.random.key(0)))[2]
    for other in (BatchedSource(inner, 4), BatchedSource(inner, 3, drop_last=True)):
        with pytest.raises(ValueError, match="batch_size=3, drop_last=False"):
            other.next(state)
        with pytest.raises(ValueError, match="another BatchedSource"):
            jax.jit(other.next)(state)
    batch, _, _ = three.next(state)  # its own source goes on
    assert batch.tolist() == [3, 4, 5]


def test_sources_pickle_after_next():
    # the compiled next is made again after unpickling, not pickled with the source
    source = BatchedSource(DiskSource(5, np.float32, ordering="sequential"), 2)
    arrays = BatchedSource(ArraySource(jnp.arange(5), ordering="sequential"), 2)
    for s in (source, arrays):
        state = s.init_state(jax.random.key(0))
        first, _, _ = s.next(state)
        copy = pickle.loads(pickle.dumps(s))
        np.testing.assert_array_equal(copy.next(state)[0], first)
        np.testing.assert_array_equal(s.next(state)[0], first)
