"""Tests of the host-side segment trees against naive NumPy oracles.

The built-in reducers run numba kernels; other reducers run the NumPy code, which the oracle
tests reach through reducers the kernels do not know (a Python-level sum among them)."""

import functools
import operator
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils.utils import MaxTree, MinTree, SegmentTree, SumTree


def _oracle_reduce(reducer, init, values, start, stop):
    return functools.reduce(reducer, values[start:stop], init)


def _snapshot(tree):
    return tree._arr.copy()


# -- construction and lookups ----------------------------------------------------------------


@pytest.mark.parametrize("capacity", [1, 2, 3, 4, 5, 7, 8, 9, 1000, 1024])
def test_any_capacity_shapes(capacity):
    tree = SumTree(capacity)
    assert tree.values.shape == (capacity,)
    assert tree.height == int(np.ceil(np.log2(capacity))) + 1
    assert len(tree) == capacity
    assert tree[0].shape == (1,)
    assert tree[-1].shape == (capacity,)
    # a level never shows nodes that cover only padding
    for level in range(tree.height):
        assert tree[level].size == -(-capacity // 2 ** (tree.height - 1 - level))
    assert tree.root_value == 0.0


def test_level_lookups_and_views_are_read_only():
    tree = SumTree(5)
    tree.set_values(..., [1.0, 2.0, 3.0, 4.0, 5.0])
    assert tree[0].tolist() == [15.0]
    assert tree[1].tolist() == [10.0, 5.0]
    assert tree[2].tolist() == [3.0, 7.0, 5.0]
    assert tree[3].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert tree[3, 1] == 2.0
    assert tree[-1, [0, 4]].tolist() == [1.0, 5.0]
    assert tree[(2,)].tolist() == [3.0, 7.0, 5.0]
    with pytest.raises(ValueError):
        tree.values[0] = 100.0
    with pytest.raises(ValueError):
        tree[1][0] = 100.0
    assert tree.root_value == 15.0
    with pytest.raises(IndexError, match="level"):
        tree[4]
    with pytest.raises(IndexError):
        tree["a"]
    assert "level=3" in repr(tree)


@pytest.mark.parametrize("capacity", [0, -1])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match="capacity"):
        SumTree(capacity)


def test_bad_capacity_type():
    with pytest.raises(TypeError, match="capacity"):
        MinTree(3.5)
    with pytest.raises(TypeError, match="reducer"):
        SegmentTree(3, reducer=None, init_value=0.0)


# -- set_values ------------------------------------------------------------------------------


def test_set_values_index_forms():
    tree = SumTree(6)
    tree.set_values(..., 1.0)
    assert tree.values.tolist() == [1.0] * 6
    tree.set_values(None, np.arange(6.0))
    assert tree.values.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    tree.set_values(2, 7.0)
    tree.set_values(np.int32(3), 8.0)
    tree.set_values([0, -1], [9.0, 10.0])
    tree.set_values(np.array([1], np.uint8), np.array([11.0], np.float32))
    tree.set_values(np.array([], np.int64), [])
    assert tree.values.tolist() == [9.0, 11.0, 7.0, 8.0, 4.0, 10.0]
    assert tree.root_value == 49.0


def test_duplicate_indices_last_write_wins():
    tree = SumTree(8)
    tree.set_values(..., 1.0)
    tree.set_values(np.array([3, 5, 3, 3, 5]), np.array([10.0, 20.0, 30.0, 40.0, 50.0]))
    assert tree[-1, 3] == 40.0
    assert tree[-1, 5] == 50.0
    assert tree.root_value == tree.values.sum() == 96.0
    assert tree.partial_reduce(2, 6) == 40.0 + 1.0 + 50.0 + 1.0


@pytest.mark.parametrize(
    "tree_factory, idx, values, error",
    [
        (lambda: SumTree(5), [0, 1], [1.0, -1.0], ValueError),
        (lambda: SumTree(5), [0, 1], [1.0, np.nan], ValueError),
        (lambda: SumTree(5), [0, 1], [np.inf, 1.0], ValueError),
        (lambda: SumTree(5), [0, 5], [1.0, 1.0], IndexError),
        (lambda: SumTree(5), [0, -6], [1.0, 1.0], IndexError),
        (lambda: SumTree(5), [0, 1], [1.0, 2.0, 3.0], ValueError),
        (lambda: SumTree(5), ..., [1.0, 2.0], ValueError),
        (lambda: SumTree(5), np.array([0.0]), [1.0], IndexError),
        (lambda: SumTree(5), np.zeros((1, 1), int), [1.0], IndexError),
        (lambda: SumTree(5), [0, 1], ["a", "b"], TypeError),
        (lambda: MinTree(5), [0, 1], [1.0, np.nan], ValueError),
        (lambda: MaxTree(5), [3, 9], [1.0, 1.0], IndexError),
        (
            lambda: SegmentTree(5, np.multiply, 1.0),
            [0, 1],
            [2.0, np.nan],
            ValueError,
        ),
    ],
)
def test_bad_input_raises_before_writing(tree_factory, idx, values, error):
    tree = tree_factory()
    tree.set_values(..., 2.0)
    before = _snapshot(tree)
    with pytest.raises(error):
        tree.set_values(idx, values)
    np.testing.assert_array_equal(tree._arr, before)


def test_error_messages_name_the_bad_entry():
    tree = SumTree(4)
    with pytest.raises(ValueError, match=r"values\[2\] = -3.0"):
        tree.set_values([0, 1, 2], [1.0, 1.0, -3.0])
    with pytest.raises(IndexError, match=r"idx\[1\] = 4"):
        tree.set_values([0, 4], [1.0, 1.0])


def test_min_max_trees_accept_infinities():
    tmin, tmax = MinTree(3), MaxTree(3)
    tmin.set_values(..., [np.inf, -np.inf, 1.0])
    tmax.set_values(..., [np.inf, -np.inf, 1.0])
    assert tmin.root_value == -np.inf
    assert tmax.root_value == np.inf
    assert tmin.partial_reduce(2) == 1.0
    assert tmax.partial_reduce(1, 3) == 1.0


# -- partial_reduce --------------------------------------------------------------------------


TREES = {
    "sum": (lambda c: SumTree(c), np.add, 0.0),
    "min": (lambda c: MinTree(c), np.minimum, np.inf),
    "max": (lambda c: MaxTree(c), np.maximum, -np.inf),
    # not known to the kernels: these run the generic NumPy code
    "sum_numpy": (lambda c: SegmentTree(c, lambda a, b: a + b, 0.0), np.add, 0.0),
    "logaddexp": (lambda c: SegmentTree(c, np.logaddexp, -np.inf), np.logaddexp, -np.inf),
}


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(TREES)),
    capacity=st.integers(1, 70),
    data=st.data(),
)
def test_matches_naive_oracle(kind, capacity, data):
    factory, reducer, init = TREES[kind]
    tree = factory(capacity)
    ref = np.full(capacity, init)
    for _ in range(3):
        k = data.draw(st.integers(0, 2 * capacity))
        idx = data.draw(st.lists(st.integers(-capacity, capacity - 1), min_size=k, max_size=k))
        vals = data.draw(
            st.lists(st.floats(0, 100, allow_subnormal=False), min_size=k, max_size=k)
        )
        for i, v in zip(idx, vals):
            ref[i] = v
        tree.set_values(np.array(idx, dtype=np.int64), np.array(vals))
        np.testing.assert_array_equal(tree.values, ref)
        np.testing.assert_allclose(tree.root_value, functools.reduce(reducer, ref, init))
    starts = data.draw(st.lists(st.integers(0, capacity - 1), min_size=1, max_size=6))
    stops = [data.draw(st.integers(s + 1, capacity)) for s in starts]
    got = tree.partial_reduce(np.array(starts), np.array(stops))
    expected = [_oracle_reduce(reducer, init, ref, a, b) for a, b in zip(starts, stops)]
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert tree.partial_reduce(starts[0], stops[0]) == pytest.approx(expected[0], rel=1e-12)


@pytest.mark.parametrize("capacity", [4, 8, 16, 7])
def test_ranges_ending_at_the_last_leaf(capacity):
    tree = SumTree(capacity)
    tree.set_values(..., np.arange(1.0, capacity + 1))
    values = np.arange(1.0, capacity + 1)
    for start in range(capacity):
        assert tree.partial_reduce(start) == values[start:].sum()
        assert tree.partial_reduce(start, capacity) == values[start:].sum()
    assert tree.partial_reduce(-1) == values[-1]
    assert tree.partial_reduce(0, -1) == values[:-1].sum()
    np.testing.assert_array_equal(
        tree.partial_reduce(np.arange(capacity), capacity),
        np.cumsum(values[::-1])[::-1],
    )


@pytest.mark.parametrize(
    "start, stop, error",
    [
        (0, 0, IndexError),
        (3, 2, IndexError),
        (0, 9, IndexError),
        (-9, 2, IndexError),
        (np.array([0, 3]), np.array([2, 3]), IndexError),
        (np.array([0, 1]), np.array([2, 3, 4]), ValueError),
        (0.5, 2, TypeError),
        (0, np.array([1.0]), TypeError),
        # unsigned bounds past the capacity must not wrap to -1 (a valid negative bound)
        (np.array([2**64 - 1], np.uint64), np.array([8], np.uint64), IndexError),
        (np.array([0], np.uint64), np.array([2**64 - 1], np.uint64), IndexError),
        (2**70, None, IndexError),
        ([0, -(2**70)], 8, IndexError),
    ],
)
def test_partial_reduce_rejects_bad_ranges(start, stop, error):
    tree = SumTree(8)
    tree.set_values(..., 1.0)
    with pytest.raises(error):
        tree.partial_reduce(start, stop)


# -- inverse_cdf and sampling ------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [4, 5, 8, 1000])
def test_inverse_cdf_never_returns_zero_or_padded_slots(capacity):
    values = np.zeros(capacity)
    values[1] = 0.3
    values[capacity - 2] = 0.1  # the last slot and the padding stay zero
    tree = SumTree(capacity)
    tree.set_values(..., values)
    u = np.concatenate([[0.0, 1.0, 0.75, np.nextafter(1.0, 0)], np.linspace(0, 1, 1001)])
    idx = tree.inverse_cdf(u)
    assert idx.shape == u.shape
    assert (values[idx] > 0).all()
    assert tree.inverse_cdf(1.0) == capacity - 2
    assert tree.inverse_cdf(0.0) == 1
    assert tree.inverse_cdf(0.75) == capacity - 2
    assert isinstance(tree.inverse_cdf(0.5), int)


def test_inverse_cdf_matches_searchsorted():
    rng = np.random.default_rng(3)
    values = rng.random(333)
    values[rng.random(333) < 0.3] = 0.0
    tree = SumTree(333)
    tree.set_values(..., values)
    u = rng.random((20, 50))
    expected = np.searchsorted(np.cumsum(values), u * values.sum(), side="right")
    np.testing.assert_array_equal(tree.inverse_cdf(u), expected)


def test_inverse_cdf_and_sample_reject_bad_input():
    tree = SumTree(4)
    with pytest.raises(ValueError, match="zero"):
        tree.sample(3)
    with pytest.raises(ValueError, match="zero"):
        tree.inverse_cdf(0.5)
    tree.set_values(0, 1.0)
    for bad in [1.5, -0.1, np.nan, [0.2, 2.0]]:
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            tree.inverse_cdf(bad)
    with pytest.raises(TypeError):
        tree.inverse_cdf("x")
    with pytest.raises(ValueError, match="n must be"):
        tree.sample(0)
    with pytest.raises(TypeError, match="n must be"):
        tree.sample(2.0)


@pytest.mark.parametrize("batch_size", [1, 32, 1024])
def test_sample_distribution_total_variation(batch_size):
    rng = np.random.default_rng(0)
    capacity = 100
    values = rng.random(capacity) ** 2
    values[rng.random(capacity) < 0.2] = 0.0
    tree = SumTree(capacity, random_seed=1)
    tree.set_values(..., values)
    draws = 200_000
    idx = np.concatenate([tree.sample(batch_size) for _ in range(draws // batch_size)])
    assert idx.shape == (draws // batch_size * batch_size,)
    assert (values[idx] > 0).all()
    freq = np.bincount(idx, minlength=capacity) / idx.size
    tv = 0.5 * np.abs(freq - values / values.sum()).sum()
    assert tv < 0.01


def test_seeded_sampling_is_reproducible():
    def make(seed):
        tree = SumTree(50, random_seed=seed)
        tree.set_values(..., np.arange(50.0))
        return tree

    a, b = make(7), make(7)
    np.testing.assert_array_equal(a.sample(100), b.sample(100))
    assert not np.array_equal(make(7).sample(100), make(8).sample(100))
    # setting the seed restarts the stream
    first = make(7).sample(20)
    a.random_seed = 7
    assert a.random_seed == 7
    np.testing.assert_array_equal(a.sample(20), first)


@pytest.mark.parametrize("seed", [True, False, np.True_])
def test_a_bool_seed_is_refused_and_changes_nothing(seed):
    # True was taken as seed 1 (False as 0): a flag passed by mistake seeded the stream
    with pytest.raises(TypeError, match="random_seed"):
        SumTree(8, random_seed=seed)
    tree = SumTree(8, random_seed=5)
    tree.set_values(..., 1.0)
    expected = SumTree(8, random_seed=5)
    expected.set_values(..., 1.0)
    with pytest.raises(TypeError, match="random_seed"):
        tree.random_seed = seed
    assert tree.random_seed == 5
    np.testing.assert_array_equal(tree.sample(50), expected.sample(50))


def test_kernel_and_numpy_reducers_agree():
    # np.add runs the numba kernels, a Python-level sum the NumPy code: same trees, bit for bit
    rng = np.random.default_rng(11)
    trees = [SegmentTree(777, np.add, 0.0), SegmentTree(777, lambda a, b: a + b, 0.0)]
    for _ in range(50):
        idx = rng.integers(-777, 777, 64)
        vals = rng.random(64)
        for tree in trees:
            tree.set_values(idx, vals)
    np.testing.assert_array_equal(trees[0]._arr, trees[1]._arr)
    start = rng.integers(0, 700, 30)
    stop = start + rng.integers(1, 77, 30)
    np.testing.assert_array_equal(
        trees[0].partial_reduce(start, stop), trees[1].partial_reduce(start, stop)
    )


def test_no_drift_after_a_million_updates():
    rng = np.random.default_rng(0)
    capacity = 1 << 14
    tree = SumTree(capacity, random_seed=0)
    tree.set_values(..., rng.random(capacity) * 1e3)
    for _ in range(1000):  # 1000 PER steps of 1024 updates: over a million writes
        idx = tree.sample(1024)
        tree.set_values(idx, rng.random(1024) * rng.choice([1e-6, 1.0, 1e6]))
    # the root is recomputed from the leaves, so it agrees to float64 rounding
    assert tree.root_value == pytest.approx(tree.values.sum(), rel=1e-12)
    assert tree.root_value == pytest.approx(np.sum(np.sort(tree.values)), rel=1e-12)


def test_pickle_round_trip_keeps_values_and_rng_stream():
    tree = SumTree(10, random_seed=3)
    tree.set_values(..., np.arange(10.0))
    clone = pickle.loads(pickle.dumps(tree))
    np.testing.assert_array_equal(clone.values, tree.values)
    np.testing.assert_array_equal(clone.sample(50), tree.sample(50))
    clone.set_values(0, 5.0)
    assert tree[-1, 0] == 0.0


def test_accepts_jax_arrays():
    import jax.numpy as jnp

    tree = SumTree(6)
    tree.set_values(jnp.arange(6), jnp.arange(6.0))
    tree.set_values(jnp.array([0, 0]), jnp.array([4.0, 2.0]))
    assert tree.values.tolist() == [2.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    np.testing.assert_array_equal(
        tree.partial_reduce(jnp.array([0, 2]), jnp.array([2, 6])), [3.0, 14.0]
    )
    assert np.ndim(tree.partial_reduce(jnp.int32(1), 3)) == 0
    assert tree.partial_reduce(jnp.int32(1), 3) == 3.0
    with pytest.raises(IndexError):
        tree.set_values(jnp.array([0.5]), 1.0)


@pytest.mark.parametrize("reducer, expected", [(min, 1.0), (max, 7.0), (operator.add, 13.0)])
def test_builtin_reducers(reducer, expected):
    tree = SegmentTree(3, reducer, {min: np.inf, max: -np.inf}.get(reducer, 0.0))
    tree.set_values(..., [5.0, 1.0, 7.0])
    assert tree.root_value == expected
    assert tree.partial_reduce(0, 3) == expected


# -- hostile input and checkpoints -------------------------------------------------------------


@pytest.mark.parametrize("idx", [np.array([2**64 - 1], np.uint64), [2**64 - 1], 2**64 - 1])
def test_indices_never_wrap(idx):
    tree = SumTree(4)
    tree.set_values(..., [1.0, 2.0, 3.0, 4.0])
    before = _snapshot(tree)
    with pytest.raises(IndexError):
        tree.set_values(idx, 100.0)
    np.testing.assert_array_equal(_snapshot(tree), before)


@pytest.mark.parametrize("cls", [SumTree, MinTree, MaxTree])
def test_strings_are_not_numbers(cls):
    tree = cls(4)
    before = _snapshot(tree)
    for bad in ("1.0", ["1.0"], np.array(["1.0"]), [object()]):
        with pytest.raises(TypeError):
            tree.set_values([0], bad)
    np.testing.assert_array_equal(_snapshot(tree), before)
    if cls is SumTree:
        tree.set_values(..., 1.0)
        for bad_u in ("0.5", np.array(["0.5"])):
            with pytest.raises(TypeError):
                tree.inverse_cdf(bad_u)


def test_a_total_that_overflows_is_undone_exactly():
    tree = SumTree(5)
    tree.set_values(..., [1e308, 1.0, 2.0, 0.0, 3.0])
    before = _snapshot(tree)
    for idx, values in [([3], [1e308]), ([1, 3], [1e308, 1e308]), ([0, 3, 3], [1e308, 5.0, 1e308])]:
        with pytest.raises(ValueError, match="overflow"):
            tree.set_values(idx, values)
        np.testing.assert_array_equal(_snapshot(tree), before)
    tree.set_values([0, 3], [1.0, 1e308])  # the large one moves: the total stays finite
    assert tree.root_value == 1e308 + 6.0


def _filled_trees():
    rng = np.random.default_rng(0)
    trees = [SumTree(7, random_seed=3), MinTree(5), MaxTree(9), SegmentTree(6, np.multiply, 1.0)]
    for tree in trees:
        tree.set_values(..., rng.uniform(0.5, 2.0, tree.capacity))
    trees[0].sample(3)
    return trees


def test_checkpoint_round_trip_adopts_the_nodes():
    for tree in _filled_trees():
        state = tree.__checkpoint_state__()
        copied = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        restored = type(tree).__checkpoint_restore__(copied)
        assert restored._arr is copied["nodes"]
        np.testing.assert_array_equal(restored._arr, tree._arr)
        assert restored.reducer in (tree.reducer, np.add)
        for clone in (pickle.loads(pickle.dumps(tree)), restored):
            np.testing.assert_array_equal(clone._arr, tree._arr)
            assert type(clone) is type(tree) and clone.capacity == tree.capacity
            assert clone.partial_reduce(1, 4) == tree.partial_reduce(1, 4)
    tree = _filled_trees()[0]
    clone = pickle.loads(pickle.dumps(tree))
    np.testing.assert_array_equal(clone.sample(20), tree.sample(20))
    assert clone.random_seed == 3


def test_checkpoint_restore_checks_every_invariant():
    def nodes(f):
        def mutate(state):
            state["nodes"] = state["nodes"].copy()
            f(state["nodes"])

        return mutate

    mutations = {
        "extra key": lambda s: s.update(bogus=1),
        "missing key": lambda s: s.pop("capacity"),
        "capacity type": lambda s: s.update(capacity=7.0),
        "capacity zero": lambda s: s.update(capacity=0),
        "capacity disagrees with nodes": lambda s: s.update(capacity=9),
        "nodes dtype": lambda s: s.update(nodes=s["nodes"].astype(np.float32)),
        "nodes list": lambda s: s.update(nodes=s["nodes"].tolist()),
        "negative leaf": nodes(lambda a: a.__setitem__(8, -1.0)),
        "nan leaf": nodes(lambda a: a.__setitem__(8, np.nan)),
        "padding": nodes(lambda a: a.__setitem__(15, 1.0)),
        "stale parent": nodes(lambda a: a.__setitem__(4, a[4] + 1)),
        "root": nodes(lambda a: a.__setitem__(1, a[1] * 2)),
        "rng type": lambda s: s.update(rng=3),
        "seed type": lambda s: s.update(random_seed="3"),
    }
    tree = _filled_trees()[0]
    for name, mutate in mutations.items():
        state = dict(tree.__checkpoint_state__())
        mutate(state)
        with pytest.raises((ValueError, TypeError)):
            SumTree.__checkpoint_restore__(state)
            pytest.fail(f"accepted: {name}")
    base = _filled_trees()[3].__checkpoint_state__()
    for reducer in ("system", "sin", 3):
        with pytest.raises((ValueError, TypeError)):
            SegmentTree.__checkpoint_restore__(dict(base, reducer=reducer))


def test_sum_tree_restore_refuses_a_seed_no_generator_takes():
    state = SumTree(8, random_seed=3).__checkpoint_state__()
    for seed, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="random_seed"):
            SumTree.__checkpoint_restore__(dict(state, random_seed=seed))
