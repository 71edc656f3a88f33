"""Tests of the functional sum tree against naive NumPy oracles and the host-side SumTree."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils import utils
from coax_utils.utils import (
    SUM_TREE_STRATEGIES,
    SumTree,
    SumTreeState,
    _segment_tree_fn,
    sum_tree_init,
    sum_tree_inverse_cdf,
    sum_tree_reduce,
    sum_tree_sample,
    sum_tree_set,
    sum_tree_total,
    sum_tree_values,
)


def oracle_inverse_cdf(values, u):
    """Naive inverse CDF: first i with u * total < cumsum[i], restricted to positive slots."""
    cs = np.cumsum(values)
    i = np.searchsorted(cs, u * cs[-1], side="right")
    return np.minimum(i, np.flatnonzero(values > 0)[-1])


@pytest.mark.parametrize("capacity", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 100])
def test_init_shapes_and_zero_values(capacity):
    state = sum_tree_init(capacity)
    assert isinstance(state, SumTreeState)
    assert state.capacity == capacity
    assert sum_tree_values(state).shape == (capacity,)
    assert state.nodes.dtype == jnp.float32
    assert float(sum_tree_total(state)) == 0.0
    # capacity is static metadata, not a leaf
    assert len(jax.tree_util.tree_leaves(state)) == 1


@pytest.mark.parametrize("bad", [0, -3])
def test_init_rejects_non_positive_capacity(bad):
    with pytest.raises(ValueError, match="capacity"):
        sum_tree_init(bad)


def test_init_rejects_bad_types():
    with pytest.raises(TypeError, match="capacity"):
        sum_tree_init(3.0)
    with pytest.raises(TypeError, match="dtype"):
        sum_tree_init(3, jnp.int32)


def test_exported_from_utils():
    for name in ["SumTreeState", "sum_tree_init", "sum_tree_set", "sum_tree_sample"]:
        assert name in utils.__all__


# module-level jitted functions: hypothesis examples of the same capacity reuse the compilation
_set = jax.jit(sum_tree_set)
# both strategies forced: the accelerator path (all writes of a level at once) runs on CPU too
_set_sequential = jax.jit(functools.partial(sum_tree_set, strategy="sequential"))
_set_vectorized = jax.jit(functools.partial(sum_tree_set, strategy="vectorized"))
_reduce = jax.jit(sum_tree_reduce)
_inverse_cdf = jax.jit(sum_tree_inverse_cdf)
_K = 12  # fixed batch size; unused slots carry the ignored index -1


@settings(max_examples=25, deadline=None)
@given(
    capacity=st.sampled_from([1, 2, 3, 5, 8, 13, 16, 33]),
    data=st.data(),
)
def test_set_reduce_match_naive_oracle(capacity, data):
    state = sum_tree_init(capacity)
    state_sequential = state_vectorized = state
    ref = np.zeros(capacity, np.float32)
    for _ in range(3):
        k = data.draw(st.integers(1, _K))
        idx = np.full(_K, -1)
        idx[:k] = data.draw(st.lists(st.integers(0, capacity - 1), min_size=k, max_size=k))
        vals = np.array(
            data.draw(
                st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0]), min_size=_K, max_size=_K)
            ),
            np.float32,
        )
        for i, v in zip(idx[:k], vals[:k]):  # last write wins
            ref[i] = v
        state = _set(state, jnp.asarray(idx), jnp.asarray(vals))
        state_sequential = _set_sequential(state_sequential, jnp.asarray(idx), jnp.asarray(vals))
        state_vectorized = _set_vectorized(state_vectorized, jnp.asarray(idx), jnp.asarray(vals))
        np.testing.assert_array_equal(np.asarray(state_vectorized.nodes), np.asarray(state.nodes))
        np.testing.assert_array_equal(np.asarray(state_sequential.nodes), np.asarray(state.nodes))
        # every parent is the sum of its children (naive oracle of the whole heap)
        nodes = np.asarray(state_vectorized.nodes)
        n = state.num_leaves
        np.testing.assert_array_equal(nodes[1:n], nodes[2 : 2 * n : 2] + nodes[3 : 2 * n : 2])
        np.testing.assert_array_equal(np.asarray(sum_tree_values(state)), ref)
        np.testing.assert_allclose(float(sum_tree_total(state)), ref.sum(), rtol=1e-6)
    start = np.array(data.draw(st.lists(st.integers(0, capacity), min_size=5, max_size=5)))
    stop = np.array(data.draw(st.lists(st.integers(0, capacity), min_size=5, max_size=5)))
    start, stop = np.minimum(start, stop), np.maximum(start, stop)
    got = np.asarray(_reduce(state, jnp.asarray(start), jnp.asarray(stop)))
    expected = np.array([ref[a:b].sum() for a, b in zip(start, stop)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    if ref.sum() > 0:
        u = np.linspace(0, 1, 33, dtype=np.float32)
        got = np.asarray(_inverse_cdf(state, jnp.asarray(u)))
        assert (ref[got] > 0).all()
        np.testing.assert_array_equal(got, oracle_inverse_cdf(ref, u))


def test_reduce_scalar_and_full_range_at_power_of_two():
    state = sum_tree_set(sum_tree_init(8), jnp.arange(8), jnp.arange(1.0, 9.0))
    assert float(sum_tree_reduce(state, 0, 8)) == 36.0
    assert float(sum_tree_reduce(state, 7, 8)) == 8.0
    assert float(sum_tree_reduce(state, 3, 3)) == 0.0
    assert sum_tree_reduce(state, jnp.array([[0, 1]]), jnp.array([[8, 8]])).shape == (1, 2)


def test_reduce_clips_wide_bounds_instead_of_wrapping():
    # int32 conversion would wrap 2**32 + 1 to 1 and uint32 2**32 - 1 to -1
    state = sum_tree_set(sum_tree_init(5), jnp.arange(5), jnp.arange(1.0, 6.0))
    reduce_jit = jax.jit(sum_tree_reduce)
    for stop in (np.array([2**32 + 1]), np.array([2**64 - 1], np.uint64), 2**40):
        assert float(sum_tree_reduce(state, 0, stop).sum()) == 15.0
    for stop in (jnp.array([2**32 - 1], jnp.uint32), jnp.array([127], jnp.int8)):
        assert float(sum_tree_reduce(state, 0, stop)[0]) == 15.0
        assert float(reduce_jit(state, 0, stop)[0]) == 15.0
    assert float(sum_tree_reduce(state, np.array([-(2**40)]), 2)[0]) == 3.0
    assert float(sum_tree_reduce(state, jnp.array([-128], jnp.int8), 2)[0]) == 3.0


@pytest.mark.parametrize("bound", [0.5, np.array([2.7]), True, jnp.array([1.0])])
def test_reduce_rejects_non_integer_bounds(bound):
    state = sum_tree_set(sum_tree_init(5), jnp.arange(5), jnp.arange(1.0, 6.0))
    with pytest.raises(TypeError, match="integers"):
        sum_tree_reduce(state, bound, 5)
    with pytest.raises(TypeError, match="integers"):
        sum_tree_reduce(state, 0, bound)


def test_duplicate_indices_last_write_wins_under_jit():
    state = sum_tree_init(10)
    set_ = jax.jit(sum_tree_set)
    idx = jnp.array([3, 3, 7, 3, 7, 1])
    vals = jnp.array([1.0, 2.0, 5.0, 4.0, 6.0, 0.5])
    state = set_(state, idx, vals)
    expected = np.zeros(10, np.float32)
    expected[[3, 7, 1]] = [4.0, 6.0, 0.5]
    np.testing.assert_array_equal(np.asarray(sum_tree_values(state)), expected)
    assert float(sum_tree_total(state)) == 10.5


def test_out_of_range_indices_are_ignored():
    state = sum_tree_set(sum_tree_init(5), jnp.array([-1, 2, 5, 9]), jnp.ones(4))
    np.testing.assert_array_equal(np.asarray(sum_tree_values(state)), [0, 0, 1, 0, 0])
    assert float(sum_tree_total(state)) == 1.0
    assert float(state.nodes[0]) == 0.0


@pytest.mark.parametrize("capacity", [4, 5, 8])
def test_inverse_cdf_never_returns_zero_or_padded_slot(capacity):
    values = np.zeros(capacity, np.float32)
    values[1] = 0.3
    values[capacity - 2] = 0.1  # last slot stays zero, and padded slots (capacity 5) too
    state = sum_tree_set(sum_tree_init(capacity), jnp.arange(capacity), jnp.asarray(values))
    u = jnp.array([0.0, 0.5, 0.74, 0.75, 0.9999999, 1.0])
    idx = np.asarray(jax.jit(sum_tree_inverse_cdf)(state, u))
    assert (values[idx] > 0).all()
    assert idx[-1] == capacity - 2
    assert idx[0] == 1
    assert sum_tree_inverse_cdf(state, 1.0).dtype == jnp.int32


def test_inverse_cdf_rounding_cannot_reach_trailing_zeros():
    # float32 totals are inexact; a descent by plain comparisons would end on the zero slot
    values = np.array([0.1, 0.2, 0.7, 1e-3, 0.0, 0.0, 0.0], np.float32)
    state = sum_tree_set(sum_tree_init(7), jnp.arange(7), jnp.asarray(values))
    u = jnp.asarray(np.linspace(0.99, 1.0, 1001, dtype=np.float32))
    idx = np.asarray(sum_tree_inverse_cdf(state, u))
    assert (values[idx] > 0).all()


@pytest.mark.parametrize("stratified", [False, True])
@pytest.mark.parametrize("n", [1, 1000])
def test_sample_distribution_total_variation(n, stratified):
    rng = np.random.default_rng(0)
    capacity = 50
    values = rng.random(capacity).astype(np.float32)
    values[rng.random(capacity) < 0.2] = 0.0
    state = sum_tree_set(sum_tree_init(capacity), jnp.arange(capacity), jnp.asarray(values))
    draws = 200_000
    sample = jax.jit(
        jax.vmap(sum_tree_sample, in_axes=(None, 0, None, None)), static_argnums=(2, 3)
    )
    keys = jax.random.split(jax.random.key(1), draws // n)
    idx = np.asarray(sample(state, keys, n, stratified)).reshape(-1)
    assert idx.dtype == np.int32
    freq = np.bincount(idx, minlength=capacity) / idx.size
    p = values / values.sum()
    assert 0.5 * np.abs(freq - p).sum() < 0.01
    assert (values[idx] > 0).all()


def test_stratified_sample_covers_strata():
    values = jnp.ones(8)
    state = sum_tree_set(sum_tree_init(8), jnp.arange(8), values)
    idx = np.asarray(sum_tree_sample(state, jax.random.key(3), 8, stratified=True))
    np.testing.assert_array_equal(idx, np.arange(8))


def test_sample_rejects_bad_n():
    state = sum_tree_init(3)
    with pytest.raises(ValueError, match="n must be"):
        sum_tree_sample(state, jax.random.key(0), 0)
    with pytest.raises(TypeError, match="n must be"):
        sum_tree_sample(state, jax.random.key(0), 2.0)


def test_strategy_is_checked():
    state = sum_tree_init(3)
    assert SUM_TREE_STRATEGIES == ("auto", "sequential", "vectorized")
    with pytest.raises(ValueError, match="'gpu'"):
        sum_tree_set(state, jnp.array([0]), jnp.array([1.0]), strategy="gpu")
    with pytest.raises(TypeError, match="strategy"):
        sum_tree_set(state, jnp.array([0]), jnp.array([1.0]), strategy=None)


@pytest.mark.parametrize("capacity", [1, 45])
@pytest.mark.parametrize("strategy", SUM_TREE_STRATEGIES)
def test_strategies_agree_with_duplicates_and_ignored_entries(strategy, capacity):
    rng = np.random.default_rng(11)
    ref = np.zeros(capacity, np.float32)
    state = sum_tree_init(capacity)
    set_ = jax.jit(functools.partial(sum_tree_set, strategy=strategy))
    for _ in range(20):
        idx = rng.integers(-3, capacity + 3, 64)  # out-of-range entries are ignored
        vals = rng.choice([0.0, 0.25, 1.0, 3.0, np.nan, -1.0], 64).astype(np.float32)
        for i, v in zip(idx, vals):
            if 0 <= i < capacity and np.isfinite(v) and v >= 0:
                ref[i] = v  # last valid write wins
        state = set_(state, jnp.asarray(idx, jnp.int32), jnp.asarray(vals))
        np.testing.assert_array_equal(np.asarray(sum_tree_values(state)), ref)
        np.testing.assert_allclose(float(sum_tree_total(state)), ref.sum(), rtol=1e-6)
        # ignored entries leave node 0 at zero, and every parent is its children's sum
        nodes = np.asarray(state.nodes)
        half = len(nodes) // 2
        assert nodes[0] == 0
        np.testing.assert_array_equal(nodes[1:half], nodes[2::2] + nodes[3::2])


def _exported_text(fn, platform, *args):
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


@pytest.mark.requires(jax="0.8")
def test_auto_strategy_follows_the_platform_it_is_compiled_for():
    # "auto" is resolved when lowering for the target device, not from the default backend:
    # lowered for CUDA or TPU (possible without such a device) the program holds the
    # vectorized writes (a sort for the last-write mask, no loop), for a CPU the loop only
    state, idx, vals = sum_tree_init(64), jnp.arange(4), jnp.ones(4)
    for platform, vectorized in (("cpu", False), ("cuda", True), ("tpu", True)):
        text = _exported_text(sum_tree_set, platform, state, idx, vals)
        assert ("stablehlo.sort" in text) == vectorized, platform
        assert ("stablehlo.while" in text) == (not vectorized), platform
    forced = functools.partial(sum_tree_set, strategy="vectorized")
    assert "stablehlo.sort" in _exported_text(forced, "cpu", state, idx, vals)


def _tree_copies(compiled_text, num_nodes):
    return re.findall(rf"f32\[{num_nodes}\]\{{0\}} copy\(", compiled_text)


@pytest.mark.parametrize("capacity", [1 << 12, 1 << 17])  # 2**17: the descent reads a slice
def test_sample_then_update_step_does_not_copy_the_tree(capacity):
    state = sum_tree_set(sum_tree_init(capacity), jnp.arange(capacity), jnp.ones(capacity))
    num_nodes = state.nodes.shape[0]

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, key):
        u = jax.random.uniform(key, (32,))
        idx, val = sum_tree_inverse_cdf(state, u, return_values=True)
        return sum_tree_set(state, idx, jnp.full(32, 2.0)), val

    text = step.lower(state, jax.random.key(0)).compile().as_text()
    assert _tree_copies(text, num_nodes) == []

    # the check can fail: a read of the old tree that nothing orders before the update
    # (here the leaves' values read after the descent) makes XLA copy the tree
    @functools.partial(jax.jit, donate_argnums=0)
    def copying_step(state, key):
        idx = sum_tree_inverse_cdf(state, jax.random.uniform(key, (32,)))
        val = state.nodes[state.num_leaves + idx]
        return sum_tree_set(state, idx, jnp.full(32, 2.0)), val

    text = copying_step.lower(state, jax.random.key(0)).compile().as_text()
    assert _tree_copies(text, num_nodes) != []


def test_a_bfloat16_tree_is_written_and_read_without_converting_the_whole_tree():
    # XLA's CPU backend has no bfloat16 arithmetic: a dynamic slice or gather of a few
    # bfloat16 nodes used to run as a conversion of the whole tree to float32 and back
    capacity = (1 << 12) + 3
    rng = np.random.default_rng(3)
    slots = rng.choice(capacity, 96, replace=False)
    values = rng.permutation(np.repeat(np.float32([1, 2]), [64, 32]))  # total 128: every
    # partial sum is exact in bfloat16, and so are the targets u * 128 of u = k / 256
    states = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        state = sum_tree_init(capacity, dtype)
        write = jax.jit(sum_tree_set, donate_argnums=0)
        for part in np.array_split(np.arange(96), 4):
            state = write(state, jnp.asarray(slots[part]), jnp.asarray(values[part]))
        states[dtype] = state
    bf16, f32 = states[jnp.bfloat16], states[jnp.float32]
    np.testing.assert_array_equal(np.asarray(bf16.nodes, np.float32), np.asarray(f32.nodes))
    np.testing.assert_array_equal(np.asarray(bf16.nodes), _with_sums(bf16.nodes))
    u = jnp.arange(257) / 256
    descent = jax.jit(lambda s, u: sum_tree_inverse_cdf(s, u, return_values=True))
    idx, val = descent(bf16, u)
    f32_idx, f32_val = descent(f32, u)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(f32_idx))
    np.testing.assert_array_equal(np.asarray(val, np.float32), np.asarray(f32_val))

    # XLA's count of the bytes the write accesses (its loop body counted once): the bits
    # view copies the tree in and out (4 tree sizes); converting the whole tree at every
    # level of the loop accessed 28
    cost = write.lower(bf16, jnp.arange(4), jnp.ones(4)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one in older jax (0.4.36)
    assert cost["bytes accessed"] < 8 * bf16.nodes.nbytes


def test_inverse_cdf_returns_the_values_of_the_sampled_slots():
    values = jnp.array([0.5, 0.0, 2.0, 1.5, 0.0])
    state = sum_tree_set(sum_tree_init(5), jnp.arange(5), values)
    u = jnp.linspace(0, 1, 17)
    idx, val = jax.jit(functools.partial(sum_tree_inverse_cdf, return_values=True))(state, u)
    np.testing.assert_array_equal(np.asarray(val), np.asarray(values)[np.asarray(idx)])
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(sum_tree_inverse_cdf(state, u)))
    single = sum_tree_set(sum_tree_init(1), jnp.array([0]), jnp.array([4.0]))
    idx, val = sum_tree_inverse_cdf(single, jnp.array([0.3, 1.0]), return_values=True)
    assert idx.tolist() == [0, 0] and val.tolist() == [4.0, 4.0]


def test_jit_matches_eager_and_does_not_retrace():
    rng = np.random.default_rng(2)
    capacity = 37

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, key, new_values):
        idx = sum_tree_sample(state, key, 16, stratified=True)
        return sum_tree_set(state, idx, new_values), idx

    state_jit = sum_tree_set(sum_tree_init(capacity), jnp.arange(capacity), jnp.ones(capacity))
    state_eager = state_jit
    key = jax.random.key(0)
    for _ in range(3):
        key, sub = jax.random.split(key)
        new_values = jnp.asarray(rng.random(16) + 0.1, jnp.float32)
        state_jit, idx_jit = step(state_jit, sub, new_values)
        idx_eager = sum_tree_sample(state_eager, sub, 16, stratified=True)
        state_eager = sum_tree_set(state_eager, idx_eager, new_values)
        np.testing.assert_array_equal(np.asarray(idx_jit), np.asarray(idx_eager))
        np.testing.assert_allclose(np.asarray(state_jit.nodes), np.asarray(state_eager.nodes))


def test_donated_set_updates_in_place():
    set_donated = jax.jit(sum_tree_set, donate_argnums=0)
    state = sum_tree_init(1000)
    for i in range(3):
        state = set_donated(state, jnp.array([i, 999]), jnp.array([1.0, 2.0]))
    assert float(sum_tree_total(state)) == 5.0


def test_vmap_over_a_batch_of_states():
    states = jax.vmap(lambda _: sum_tree_init(6))(jnp.arange(3))
    assert states.nodes.shape == (3, 16)
    idx = jnp.array([[0, 5], [1, 1], [2, 4]])
    vals = jnp.array([[1.0, 3.0], [2.0, 4.0], [0.0, 5.0]])
    states = jax.jit(jax.vmap(sum_tree_set))(states, idx, vals)
    np.testing.assert_array_equal(np.asarray(jax.vmap(sum_tree_total)(states)), [4.0, 4.0, 5.0])
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(sum_tree_reduce, in_axes=(0, None, None))(states, 1, 5)),
        [0.0, 4.0, 5.0],
    )
    keys = jax.random.split(jax.random.key(0), 3)
    samples = jax.vmap(lambda s, k: sum_tree_sample(s, k, 100))(states, keys)
    assert set(np.asarray(samples[0]).tolist()) <= {0, 5}
    assert set(np.asarray(samples[1]).tolist()) == {1}
    assert set(np.asarray(samples[2]).tolist()) == {4}


@pytest.mark.requires(jax="0.8")
def test_float64_state_agrees_with_host_sum_tree():
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        capacity = 300
        host = SumTree(capacity)
        state = sum_tree_init(capacity, jnp.float64)
        set_ = jax.jit(sum_tree_set)
        for _ in range(20):
            idx = rng.integers(0, capacity, 64)
            vals = rng.random(64)
            host.set_values(idx, vals)
            state = set_(state, jnp.asarray(idx), jnp.asarray(vals))
        np.testing.assert_array_equal(np.asarray(sum_tree_values(state)), host.values)
        np.testing.assert_allclose(float(sum_tree_total(state)), host.root_value, rtol=1e-12)
        u = rng.random(500)
        np.testing.assert_array_equal(
            np.asarray(jax.jit(sum_tree_inverse_cdf)(state, jnp.asarray(u))), host.inverse_cdf(u)
        )
        start = rng.integers(0, capacity // 2, 20)
        stop = start + rng.integers(1, capacity // 2, 20)
        np.testing.assert_allclose(
            np.asarray(jax.jit(sum_tree_reduce)(state, jnp.asarray(start), jnp.asarray(stop))),
            host.partial_reduce(start, stop),
            rtol=1e-12,
        )


def test_no_drift_after_many_updates():
    # parents are recomputed from children, so the root tracks the leaves over many updates
    capacity = 1 << 10
    rng = np.random.default_rng(7)

    @jax.jit
    def many_updates(state, key):
        def body(state, key):
            k1, k2 = jax.random.split(key)
            idx = sum_tree_sample(state, k1, 64)
            vals = jax.random.uniform(k2, (64,)) * 1e3 + 1e-3
            return sum_tree_set(state, idx, vals), None

        return jax.lax.scan(body, state, jax.random.split(key, 500))[0]

    values = jnp.asarray(rng.random(capacity) * 1e3, jnp.float32)
    state = sum_tree_set(sum_tree_init(capacity), jnp.arange(capacity), values)
    state = many_updates(state, jax.random.key(0))
    leaves = np.asarray(sum_tree_values(state), np.float64)
    np.testing.assert_allclose(float(sum_tree_total(state)), leaves.sum(), rtol=1e-6)


# -- bad indices and values never corrupt the tree -----------------------------------------


def test_float_indices_are_refused_at_trace_time():
    state = sum_tree_init(4)
    with pytest.raises(TypeError, match="float32"):
        jax.jit(sum_tree_set)(state, jnp.array([1.7]), jnp.array([1.0]))


def test_indices_beyond_int32_never_write_a_slot():
    state = sum_tree_init(4)
    out = sum_tree_set(state, np.array([2**32 + 1, -1, 4], np.int64), np.array([5.0, 6.0, 7.0]))
    assert sum_tree_values(out).tolist() == [0.0] * 4


def test_nan_and_huge_values_keep_the_total_finite():
    state = sum_tree_set(sum_tree_init(4), jnp.arange(4), jnp.array([1.0, 2.0, 3.0, 4.0]))
    out = sum_tree_set(state, jnp.array([0, 1, 2]), jnp.array([np.nan, 3e38, -1.0]))
    assert np.isfinite(float(sum_tree_total(out)))
    values = np.asarray(sum_tree_values(out))
    assert values[0] == 1.0 and values[2] == 3.0  # NaN and negative writes are ignored
    assert 0 < values[1] < 3e38


def test_inverse_cdf_never_returns_a_zero_slot():
    state = sum_tree_set(sum_tree_init(4), jnp.arange(4), jnp.array([0.0, 1.0, 0.0, 0.0]))
    state = sum_tree_set(state, jnp.array([2]), jnp.array([np.nan]))
    u = jnp.array([0.0, 0.3, 1.0, np.nan])
    assert sum_tree_inverse_cdf(state, u).tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "capacity, dtype", [(65537, jnp.float32), ((1 << 17) + 3, jnp.float16)], ids=["f32", "f16"]
)
def test_large_tree_descent_reads_the_root_levels_from_a_slice_with_the_same_result(
    capacity, dtype, monkeypatch
):
    # trees of 512 KiB or more read their upper levels from a slice of the first nodes;
    # the result is the one of the plain descent (forced here by a larger size limit)
    rng = np.random.default_rng(5)
    values = rng.random(capacity).astype(np.float32) + 0.01
    values[rng.random(capacity) < 0.3] = 0.0
    values[-5:] = 0.0  # trailing zeros, and the padded slots past capacity
    state = sum_tree_set(sum_tree_init(capacity, dtype), jnp.arange(capacity), values)
    assert state.nodes.size * state.nodes.dtype.itemsize >= 512 << 10
    u = jnp.concatenate([jnp.linspace(0, 1, 4001), jnp.asarray(rng.random(4000))])
    top_pairs = f"tensor<{(128 << 10) // np.dtype(dtype).itemsize // 2}x2x"  # the slice's rows
    sliced = jax.jit(lambda s, u: sum_tree_inverse_cdf(s, u, return_values=True))
    assert top_pairs in sliced.lower(state, u).as_text()
    idx, val = sliced(state, u)
    monkeypatch.setattr(_segment_tree_fn, "_SPLIT_BYTES", 1 << 40)
    plain = jax.jit(lambda s, u: sum_tree_inverse_cdf(s, u, return_values=True))  # a new trace
    assert top_pairs not in plain.lower(state, u).as_text()
    plain_idx, plain_val = plain(state, u)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(plain_idx))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(plain_val))
    tree_values = np.asarray(sum_tree_values(state))
    assert (tree_values[np.asarray(idx)] > 0).all()
    np.testing.assert_array_equal(np.asarray(val), tree_values[np.asarray(idx)])
    assert len(np.unique(np.asarray(idx))) > 1000


def test_sum_tree_reduce_takes_lists_of_traced_bounds_under_jit():
    state = sum_tree_set(sum_tree_init(4), jnp.arange(4), jnp.arange(1.0, 5.0))
    reduce = jax.jit(lambda a: sum_tree_reduce(state, [a, a + 1], [a + 2, a + 4]))
    np.testing.assert_array_equal(reduce(jnp.int32(0)), [3.0, 9.0])


@pytest.mark.parametrize(
    "values",
    [np.array([1e39, 1e300]), [1e39, 1e300], np.array([70000.0, 1e5], np.float32)],
    ids=["float64", "list", "float32-into-float16"],
)
def test_values_beyond_the_tree_dtype_are_clipped_not_dropped(values):
    # finite values that overflow only when cast to the tree's dtype are clipped like any
    # other value above max_value (they were cast to inf first and then ignored)
    dtype = jnp.float16 if np.asarray(values).dtype == np.float32 else jnp.float32
    state = sum_tree_set(sum_tree_init(4, dtype), jnp.arange(4), jnp.ones(4, dtype))
    out = sum_tree_set(state, jnp.array([0, 1]), values)
    assert sum_tree_values(out).tolist() == [state.max_value, state.max_value, 1.0, 1.0]
    assert np.isfinite(float(sum_tree_total(out)))
    # infinities, NaN and negative values are still ignored, in any dtype
    out = sum_tree_set(state, jnp.array([0, 1, 2]), np.array([np.inf, np.nan, -1e300]))
    assert sum_tree_values(out).tolist() == [1.0] * 4


def test_values_whose_shape_does_not_match_the_indices_are_refused():
    # indices (2, 3) with values (3, 2) were both flattened and paired in C order, so the
    # values went to the wrong slots silently; (2, 3) values for 6 indices likewise
    state = sum_tree_init(8)
    for indices, values in [
        (jnp.arange(6).reshape(2, 3), jnp.arange(6.0).reshape(3, 2)),
        (jnp.arange(6), jnp.ones((2, 3))),
        (jnp.arange(3), jnp.ones(2)),
    ]:
        with pytest.raises(ValueError, match="values"):
            sum_tree_set(state, indices, values)
        with pytest.raises(ValueError, match="values"):
            jax.jit(sum_tree_set)(state, indices, values)
    # a scalar, a single value, equal shapes, and shapes equal up to axes of size 1 work
    for values in (2.0, jnp.full((1,), 2.0), jnp.full((3,), 2.0), jnp.full((3, 1), 2.0)):
        out = sum_tree_set(state, jnp.array([1, 4, 7]), values)
        assert sum_tree_values(out).tolist() == [0, 2, 0, 0, 2, 0, 0, 2]
    out = sum_tree_set(state, jnp.array([[1, 4], [5, 0]]), jnp.array([[1.0, 2.0], [3.0, 4.0]]))
    assert sum_tree_values(out).tolist() == [4, 1, 0, 0, 2, 3, 0, 0]


# -- restored states are checked (SumTreeState.__checkpoint_check__) -------------------------


def _with_sums(nodes):
    """``nodes`` (NumPy) with every parent recomputed from its children, in their dtype."""
    nodes = np.array(nodes)
    n = nodes.shape[-1] // 2
    while n > 1:
        nodes[..., n // 2 : n] = nodes[..., n : 2 * n : 2] + nodes[..., n + 1 : 2 * n : 2]
        n //= 2
    return nodes


def _reloaded(state, safe=True):
    return utils.loads(utils.dumps(state), safe=safe)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("capacity", [1, 5, 8])
def test_honest_trees_round_trip_through_checkpoints(tmp_path, capacity, dtype):
    state = sum_tree_set(
        sum_tree_init(capacity, dtype), jnp.arange(capacity), jnp.arange(1.0, capacity + 1)
    )
    state = sum_tree_set(state, jnp.array([0]), jnp.array([0.0]))  # a zero leaf is fine
    utils.dump(state, tmp_path / "tree.lz4")
    for restored in (utils.load(tmp_path / "tree.lz4", safe=True), _reloaded(state, False)):
        assert restored.capacity == capacity and restored.nodes.dtype == state.nodes.dtype
        np.testing.assert_array_equal(np.asarray(restored.nodes), np.asarray(state.nodes))
    # a vmapped batch of trees, and huge values up to max_value, round trip too
    batch = jax.vmap(lambda v: sum_tree_set(sum_tree_init(capacity), jnp.arange(capacity), v))(
        jnp.stack([jnp.ones(capacity), jnp.full(capacity, 3e38)])
    )
    np.testing.assert_array_equal(_reloaded(batch).nodes, batch.nodes)


def test_a_large_tree_is_checked():
    n = 2**20
    values = jnp.asarray(np.random.default_rng(0).random(n), jnp.float32)
    state = sum_tree_set(sum_tree_init(n), jnp.arange(n), values)
    state.__checkpoint_check__()  # honest: no error
    nodes = np.asarray(state.nodes).copy()
    nodes[n + 12345] += 0.5  # one leaf changed, its ancestors not
    with pytest.raises(ValueError, match=f"node {(n + 12345) // 2} holds"):
        state.replace(nodes=nodes).__checkpoint_check__()


def _lying_trees():
    good = np.asarray(
        sum_tree_set(sum_tree_init(5), jnp.arange(5), jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])).nodes
    )
    nodes = good.copy()  # the case: node 2 says 0, node 3 carries the total
    nodes[2], nodes[3] = 0.0, good[1]
    yield "node 2 holds 0.0", nodes, 5
    nodes = good.copy()
    nodes[8:10] = 0.0  # slots 0 and 1 empty ...
    nodes = _with_sums(nodes)
    nodes[4] = 1e-30  # ... under a parent that is positive: far below the tolerance of the
    yield "node 4 holds", nodes, 5  # sums, but sampling could reach the zero slots
    leaves = good.copy()
    leaves[9] = -2.0  # a negative leaf with consistent sums
    yield "finite and >= 0", _with_sums(leaves), 5
    leaves = good.copy()
    leaves[10] = np.nan
    yield "finite and >= 0", _with_sums(leaves), 5
    leaves = good.copy()
    leaves[14] = 7.0  # a padded leaf (capacity 5 of 8 leaves)
    yield "padded leaves", _with_sums(leaves), 5
    nodes = good.copy()
    nodes[0] = 1.0
    yield "node 0", nodes, 5
    leaves = good.copy()
    leaves[8] = np.float32(3e38 / 16 * 1.5)  # above max_value, sums still finite
    yield "exceeds max_value", _with_sums(leaves), 5
    yield "has 16 nodes", good[:8], 5
    yield "floating point", good.astype(np.int32), 5
    yield "capacity must be an int", good, 5.0
    yield "capacity must be an int", good, 0
    yield "has 8 nodes", good, 4  # capacity 4 needs 4 leaves, the nodes have 8


@pytest.mark.parametrize("case", range(12))
def test_lying_trees_are_refused_on_load(case):
    message, nodes, capacity = list(_lying_trees())[case]
    state = SumTreeState(nodes=jnp.asarray(nodes), capacity=capacity)
    data = utils.dumps(state)
    for safe in (True, False):
        with pytest.raises(utils.CheckpointDamagedError, match=re.escape(message)):
            utils.loads(data, safe=safe)
    with pytest.raises(ValueError, match=re.escape(message)):
        state.__checkpoint_check__()


def test_lying_trees_in_a_batch_are_refused():
    good = sum_tree_set(sum_tree_init(4), jnp.arange(4), jnp.ones(4))
    nodes = np.stack([np.asarray(good.nodes)] * 3)
    nodes[2, 2], nodes[2, 3] = 0.0, 4.0  # the third tree of the batch lies
    with pytest.raises(utils.CheckpointDamagedError, match="node 2 holds 0.0"):
        _reloaded(SumTreeState(nodes=jnp.asarray(nodes), capacity=4))
