"""ArraySource: epochs, orderings, scan usage, errors, no retrace."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils.sources import ArraySource, ArraySourceState, BatchedSource, Source
from tests._compiles import eager_compiles


def run_epochs(source, key, steps, jit=True):
    """Scan ``steps`` calls of ``next``; return (values, masks, epochs after each call)."""

    def body(state, _):
        value, mask, state = source.next(state)
        return state, (value, mask, state.epoch)

    fn = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps)) if jit else None
    state = source.init_state(key)
    if jit:
        state, out = fn(state)
    else:
        outs = []
        for _ in range(steps):
            state, o = body(state, None)
            outs.append(o)
        out = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outs)
    return out, state


def test_protocol_and_spec():
    data = {"x": jnp.zeros((7, 3), jnp.float32), "y": np.arange(7, dtype=np.int8)}
    source = ArraySource(data)
    assert isinstance(source, Source)
    assert source.steps_per_epoch == 7
    spec = source.element_spec()
    assert spec["x"] == jax.ShapeDtypeStruct((3,), jnp.float32)
    assert spec["y"] == jax.ShapeDtypeStruct((), jnp.int8)


def test_sequential_order_and_epoch_counter():
    n = 5
    source = ArraySource({"i": jnp.arange(n) * 10}, ordering="sequential")
    (values, masks, epochs), state = run_epochs(source, jax.random.key(0), 3 * n)
    assert values["i"].tolist() == [10 * i for i in range(n)] * 3
    assert masks.dtype == jnp.bool_ and bool(masks.all())
    # The epoch counter increments exactly when the last item of an epoch is emitted.
    assert epochs.tolist() == [0] * (n - 1) + [1] * n + [2] * n + [3]
    assert int(state.epoch) == 3 and int(state.position) == 0


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_shuffle_covers_every_index_once_per_epoch(n, seed):
    source = ArraySource(jnp.arange(n), ordering="shuffle")
    (values, _, _), _ = run_epochs(source, jax.random.key(seed), 3 * n)
    per_epoch = np.asarray(values).reshape(3, n)
    for epoch in per_epoch:
        assert sorted(epoch.tolist()) == list(range(n))


def test_shuffle_differs_between_epochs_and_seeds():
    n = 50
    source = ArraySource(jnp.arange(n))
    (values, _, _), _ = run_epochs(source, jax.random.key(1), 3 * n)
    epochs = np.asarray(values).reshape(3, n)
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(epochs[0], np.arange(n))
    (other, _, _), _ = run_epochs(source, jax.random.key(2), n)
    assert not np.array_equal(np.asarray(other), epochs[0])
    # Same key, same stream.
    (again, _, _), _ = run_epochs(source, jax.random.key(1), n)
    assert np.array_equal(np.asarray(again), epochs[0])


def test_rows_stay_aligned_across_leaves():
    n = 20
    data = {"a": jnp.arange(n), "b": (jnp.arange(n)[:, None] * jnp.ones((1, 3))).astype(jnp.int32)}
    (values, _, _), _ = run_epochs(ArraySource(data), jax.random.key(3), n)
    expected = np.repeat(np.asarray(values["a"])[:, None], 3, 1)
    assert np.array_equal(np.asarray(values["b"]), expected)


def test_eager_equals_jit():
    source = ArraySource(jnp.arange(6.0))
    (jit_values, _, _), jit_state = run_epochs(source, jax.random.key(4), 8, jit=True)
    (eager_values, _, _), eager_state = run_epochs(source, jax.random.key(4), 8, jit=False)
    assert np.array_equal(jit_values, eager_values)
    chex.assert_trees_all_equal(jit_state, eager_state)


def test_state_is_a_frozen_pytree_with_replace():
    source = ArraySource(jnp.arange(4))
    state = source.init_state(jax.random.key(0))
    assert isinstance(state, ArraySourceState)
    assert state.epoch.dtype == jnp.int32 and state.position.dtype == jnp.int32
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.epoch = jnp.int32(3)
    moved = state.replace(position=jnp.int32(2))
    assert int(moved.position) == 2 and int(state.position) == 0
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert jax.tree_util.tree_unflatten(treedef, leaves).replace is not None


def test_raw_uint32_key_works():
    source = ArraySource(jnp.arange(5))
    (values, _, _), _ = run_epochs(source, jax.random.PRNGKey(0), 5)
    assert sorted(np.asarray(values).tolist()) == list(range(5))


def test_no_retrace_on_second_call():
    chex.clear_trace_counter()
    source = ArraySource(jnp.arange(10))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state):
        return source.next(state)

    state = source.init_state(jax.random.key(0))
    for _ in range(12):  # crosses an epoch boundary
        _, _, state = step(state)
    assert int(state.epoch) == 1


@pytest.mark.parametrize(
    "data, match",
    [
        ({}, "at least one array"),
        ([], "at least one array"),
        ({"a": jnp.zeros((3, 2)), "b": jnp.zeros((4,))}, "share the leading axis"),
        (jnp.zeros((0, 3)), "zero samples"),
        ({"a": jnp.zeros(()), "b": jnp.zeros((2,))}, "leading sample axis"),
    ],
)
def test_bad_data_raises(data, match):
    with pytest.raises(ValueError, match=match):
        ArraySource(data)


def test_unknown_ordering_raises():
    with pytest.raises(ValueError, match="'random'"):
        ArraySource(jnp.arange(3), ordering="random")


def test_int64_data_beyond_int32_is_refused_without_x64():
    with pytest.raises(ValueError, match="1099511627776"):
        ArraySource(np.array([2**40, 1, 5], np.int64))


@pytest.mark.requires(jax="0.8")
def test_int64_data_is_kept_exact_with_x64():
    with jax.enable_x64(True):
        source = ArraySource(np.array([2**40, 1, 5], np.int64), ordering="sequential")
        state = source.init_state(jax.random.key(0))
        value, _, _ = source.next(state)
        assert int(value) == 2**40


def test_next_refuses_another_sources_state():
    a, b = ArraySource(np.arange(3)), ArraySource(np.arange(5))
    with pytest.raises(ValueError, match="another source"):
        a.next(b.init_state(jax.random.key(0)))
    with pytest.raises(ValueError, match="another source"):
        jax.jit(a.next)(b.init_state(jax.random.key(0)))
    with pytest.raises(TypeError, match="ArraySourceState"):
        a.next({"order": jnp.arange(3)})


def test_eager_next_compiles_once():
    # each eager call used to trace and compile its conditional anew (about 0.2 s a call,
    # and the compiled code piled up until LLVM ran out of memory)
    for ordering in ("shuffle", "sequential"):
        source = ArraySource(jnp.arange(5.0), ordering=ordering)
        assert eager_compiles(source, source.init_state(jax.random.key(0)), 12) == 0


def test_sequential_source_resumed_from_a_shuffled_state_is_sequential():
    # a state saved under ordering="shuffle" and resumed by a sequential source: its saved
    # permutation was never redrawn (sequential orders never change), so the "sequential"
    # source emitted that permutation in every epoch
    data = jnp.arange(6)
    state = ArraySource(data).init_state(jax.random.key(0))
    assert state.order.tolist() != list(range(6))
    source = ArraySource(data, ordering="sequential")
    out = []
    for _ in range(8):
        value, _, state = source.next(state)
        out.append(int(value))
    assert out == [0, 1, 2, 3, 4, 5, 0, 1]
    batched = BatchedSource(source, 4)
    state = batched.init_state(jax.random.key(0))
    state = state.replace(inner=ArraySource(data).init_state(jax.random.key(0)))
    rows = []
    for _ in range(3):
        batch, mask, state = batched.next(state)
        rows += np.asarray(batch)[np.asarray(mask)].tolist()
    assert rows == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
