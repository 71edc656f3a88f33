"""TransitionBatch: a pytree with coax's fields, batch helpers and concatenation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils.replay import TransitionBatch


def make(t, done=False, gamma=0.9):
    s = np.full(3, t, np.float32)
    return TransitionBatch.from_single(
        s=s, a=t, logp=-0.5, r=float(t), done=done, gamma=gamma, s_next=s + 1, a_next=t + 1
    )


def test_from_single_fields_and_bootstrap_factor():
    tb = make(2)
    assert tb.batch_size == 1 and len(tb) == 1
    np.testing.assert_array_equal(tb.S, [[2, 2, 2]])
    np.testing.assert_array_equal(tb.S_next, [[3, 3, 3]])
    np.testing.assert_allclose(tb.In, [0.9])
    np.testing.assert_allclose(make(2, done=True).In, [0.0])
    np.testing.assert_allclose(tb.W, [1.0])
    assert tb.idx is None and tb.extra_info is None
    with pytest.raises(ValueError, match="gamma"):
        make(0, gamma=1.5)


def test_is_a_pytree_without_recomputed_defaults():
    tb = TransitionBatch.concatenate(make(0), make(1), make(2))
    leaves, treedef = jax.tree_util.tree_flatten(tb)
    assert len(leaves) == 8  # S A logP Rn In S_next A_next W (None fields are no leaves)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.idx is None and back.logP_next is None
    doubled = jax.tree_util.tree_map(lambda x: x * 2, tb)
    np.testing.assert_array_equal(doubled.Rn, [0, 2, 4])

    @jax.jit
    def target(batch):
        return batch.Rn + batch.In * jnp.sum(batch.S_next, axis=1)

    np.testing.assert_allclose(target(tb), [0 + 0.9 * 3, 1 + 0.9 * 6, 2 + 0.9 * 9], rtol=1e-6)


def test_to_singles_and_concatenate_round_trip():
    tb = TransitionBatch.concatenate(*(make(t) for t in range(4)))
    assert tb.batch_size == 4
    singles = list(tb.to_singles())
    assert [s.batch_size for s in singles] == [1] * 4
    assert [int(s.A[0]) for s in singles] == [0, 1, 2, 3]
    again = TransitionBatch.concatenate(*singles)
    for a, b in zip(jax.tree_util.tree_leaves(tb), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(tb[1:3].A, [1, 2])
    np.testing.assert_array_equal(tb[2].A, [2])


def test_concatenate_rejects_different_structures():
    with_idx = make(0).replace(idx=np.array([7]))
    with pytest.raises(ValueError, match="structure"):
        TransitionBatch.concatenate(make(1), with_idx)
    with pytest.raises(ValueError):
        TransitionBatch.concatenate()


def test_copy_and_equality_for_any_batch_size():
    rows = [
        TransitionBatch.from_single(
            s=np.full(2, t, np.float32), a=t, logp=0.0, r=1.0, done=False, gamma=0.9
        )
        for t in range(5)
    ]
    batch = TransitionBatch.concatenate(*rows)
    shallow, deep = batch.copy(), batch.copy(deep=True)
    assert shallow == batch and deep == batch and batch == batch
    assert shallow.S is batch.S and deep.S is not batch.S
    assert batch.replace(Rn=batch.Rn + 1e-9) == batch  # allclose, as coax
    assert batch.replace(Rn=batch.Rn + 1) != batch
    assert batch.replace(A_next=batch.A) != batch  # other structure
    assert batch[:3] != batch  # other shapes
    assert batch != "batch"


def test_getitem_int_like_indices_keep_the_batch_axis_and_check_the_range():
    tb = TransitionBatch.concatenate(*(make(t) for t in range(3)))
    for i in (1, np.int32(1), np.array(1), jnp.array(1), -2):
        row = tb[i]
        assert row.batch_size == 1 and row.S.shape == (1, 3), type(i)
        np.testing.assert_array_equal(row.A, [1])
    np.testing.assert_array_equal(tb[-1].A, [2])
    # a traced index (inside jit or vmap) selects the same row, with the batch axis
    np.testing.assert_array_equal(jax.jit(lambda b, i: b[i].A)(tb, 2), [2])
    np.testing.assert_array_equal(jax.vmap(lambda i: tb[i].Rn)(jnp.arange(3)), [[0], [1], [2]])
    for i in (3, -4, np.int64(7), np.array(3)):
        with pytest.raises(IndexError, match="out of range"):
            tb[i]
    for bad in (True, np.bool_(False), None, (0, 1)):
        with pytest.raises(TypeError, match="index"):
            tb[bad]
    with pytest.raises(IndexError, match="one-dimensional"):
        tb[np.array([[0, 1]])]
    np.testing.assert_array_equal(tb[np.array([True, False, True])].A, [0, 2])  # a row mask
    np.testing.assert_array_equal(tb[[2, 0]].A, [2, 0])


def single(**changes):
    kwargs = dict(s=np.zeros(2, np.float32), a=0, logp=-0.5, r=1.0, done=False, gamma=0.9)
    kwargs.update(changes)
    return TransitionBatch.from_single(**kwargs)


def test_from_single_refuses_what_it_would_store_wrongly():
    # scalars given with a batch axis (or as several numbers) made fields of shape (1, k)
    for name in ("logp", "r", "w", "logp_next", "gamma", "done", "idx"):
        with pytest.raises(ValueError, match=f"{name} must be a single"):
            single(**{name: np.array([1])})
    with pytest.raises(ValueError, match="done must be a single"):
        single(done=np.array([True, False]))
    # a float idx was truncated (3.7 -> 3), a string done was truthy (In = 0)
    with pytest.raises(TypeError, match="idx must be an int"):
        single(idx=3.7)
    with pytest.raises(TypeError, match="done must be a bool"):
        single(done="False")
    with pytest.raises(TypeError, match="r must be a real number"):
        single(r="1.0")
    # a reward beyond float32 became inf; NaN weights and log-propensities went through
    with pytest.raises(ValueError, match="r must be finite"):
        single(r=1e39)
    with pytest.raises(ValueError, match="w must be finite"):
        single(w=float("nan"))
    # what stays accepted: NumPy and JAX scalars, 0-d arrays, 0/1 flags
    tb = single(r=np.float64(2.0), logp=jnp.float32(-1.0), done=np.int8(1), idx=np.uint32(5))
    assert tb.Rn.shape == tb.logP.shape == tb.In.shape == tb.idx.shape == (1,)
    np.testing.assert_array_equal(tb.In, [0.0])
    np.testing.assert_array_equal(tb.idx, [5])
    assert single(gamma=np.array(0.5), w=np.array(2.0)).In.tolist() == [0.5]


def test_from_single_copies_the_arrays_it_is_given():
    obs = {"pos": np.zeros(3, np.float32), "frame": np.zeros((2, 2), np.uint8)}
    action = np.array([0.5, -0.5])
    tb = TransitionBatch.from_single(
        s=obs, a=action, logp=0.0, r=1.0, done=False, gamma=0.9, extra_info={"x": action}
    )
    obs["pos"] += 1  # e.g. an env or wrapper that updates its observation array in place
    obs["frame"][0, 0] = 255
    action[:] = 7
    np.testing.assert_array_equal(tb.S["pos"], np.zeros((1, 3)))
    np.testing.assert_array_equal(tb.S["frame"], np.zeros((1, 2, 2)))
    np.testing.assert_array_equal(tb.S_next["pos"], np.zeros((1, 3)))
    np.testing.assert_array_equal(tb.A, [[0.5, -0.5]])
    np.testing.assert_array_equal(tb.extra_info["x"], [[0.5, -0.5]])
    assert tb.S["frame"].dtype == np.uint8 and tb.A.dtype == np.float64


def test_fields_with_another_number_of_rows_are_refused():
    tb = TransitionBatch.concatenate(*(make(t) for t in range(3)))
    short = tb.replace(S=tb.S[:2])  # e.g. a field sliced and the others not
    for use in (
        lambda: short.batch_size,
        lambda: len(short),
        lambda: list(short.to_singles()),
        lambda: short[0],
        lambda: short[:2],
        lambda: TransitionBatch.concatenate(short, tb),
        lambda: TransitionBatch.concatenate(tb, short),
    ):
        with pytest.raises(ValueError, match=r"\.S has shape \(2, 3\)"):
            use()
    with pytest.raises(ValueError, match="extra_info"):
        len(tb.replace(extra_info={"t": np.zeros(4)}))
    assert tb.batch_size == 3 and tb.replace(extra_info={"t": np.zeros((3, 2))}).batch_size == 3


def test_concatenate_refuses_per_row_shapes_and_dtypes_that_do_not_join():
    a, b = make(0), make(1)
    with pytest.raises(ValueError, match=r"\.S with per-row shapes \[\(3,\), \(4,\)\]"):
        TransitionBatch.concatenate(a.replace(S=np.zeros((1, 4), np.float32)), b)
    # uint64 with int64 promotes to float64, which rounds large ids and actions
    big = a.replace(A=np.array([2**62 + 1], np.uint64))
    rounded = r"\.A: the dtypes \['int64', 'uint64'\] promote to float64"
    with pytest.raises(TypeError, match=rounded):
        TransitionBatch.concatenate(big, b)
    with pytest.raises(TypeError, match=r"\.A: .*changes values"):
        TransitionBatch.concatenate(a.replace(A=np.array([2**60 + 1])), b.replace(A=np.ones(1)))
    # promotions that keep every value are fine: int32 with int64, small ints with floats
    mixed = TransitionBatch.concatenate(a.replace(A=np.array([5], np.int32)), b)
    assert mixed.A.dtype == np.int64 and mixed.A.tolist() == [5, 1]
    rewards = TransitionBatch.concatenate(a.replace(A=np.array([1])), b.replace(A=np.array([0.5])))
    assert rewards.A.tolist() == [1.0, 0.5]
    nan = a.replace(logP=np.array([np.nan], np.float32))
    assert np.isnan(TransitionBatch.concatenate(nan, b.replace(logP=np.zeros(1))).logP[0])


def test_concatenate_under_jit_equals_eager():
    batches = [make(t) for t in range(3)]
    eager = TransitionBatch.concatenate(*batches)
    traced = jax.jit(lambda *bs: TransitionBatch.concatenate(*bs))(*batches)
    assert traced.batch_size == 3
    for x, y in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(traced)):
        np.testing.assert_array_equal(x, y)


def test_equality_compares_integers_exactly():
    batch = TransitionBatch.concatenate(*(make(t) for t in range(2)))
    ids = np.array([10**6, 2 * 10**6])
    # allclose's relative tolerance took ids (or actions) 1 apart for equal
    assert batch.replace(idx=ids) != batch.replace(idx=ids + 1)
    assert batch.replace(A=np.array([2**40, 0])) != batch.replace(A=np.array([2**40 + 1, 0]))
    assert batch.replace(idx=ids) == batch.replace(idx=ids.astype(np.int32))
    assert batch.replace(Rn=batch.Rn + 1e-9) == batch  # floats stay allclose, as coax


def test_repr_describes_any_leaf():
    tb = make(1)
    assert "S='float32[1, 3]'" in repr(tb) and "idx=None" in repr(tb)
    sums = jax.tree_util.tree_map(lambda x: float(x.sum()), tb)  # Python numbers as leaves
    assert "Rn='float'" in repr(sums)
    assert "A='int32[]'" in repr(tb.replace(A=jnp.int32(0)))  # a JAX scalar


def test_concatenate_names_the_field_whose_structure_differs():
    a = make(0).replace(S={"pos": np.zeros((1, 2)), "vel": np.zeros((1, 2))})
    b = make(1).replace(S={"pos": np.zeros((1, 2))})
    with pytest.raises(ValueError, match=r"structure: S is .*'vel'.* in batch 0 and .* in batch 2"):
        TransitionBatch.concatenate(a, a, b)
    with pytest.raises(ValueError, match=r"structure: W is .* in batch 0 and None in batch 1"):
        TransitionBatch.concatenate(a, a.replace(W=None))
    with pytest.raises(TypeError, match="TransitionBatch objects, got dict"):
        TransitionBatch.concatenate(a, {"S": 1})


_take = jax.jit(lambda b, i: b[i])  # compiled once per batch shape, not per example


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 6), max_size=3), st.booleans())
def test_slices_singles_and_concatenate_round_trip(n, cuts, pytree_obs):
    rows = [make(t) for t in range(n)]
    if pytree_obs:
        rows = [r.replace(S={"b": r.S, "a": (r.A, r.S[:, :1])}) for r in rows]
    tb = TransitionBatch.concatenate(*rows)
    bounds = [0, *sorted(min(c, n) for c in cuts), n]
    parts = [tb[lo:hi] for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    assert TransitionBatch.concatenate(*parts) == tb
    assert TransitionBatch.concatenate(*tb.to_singles()) == tb
    for i in range(-n, n):
        assert tb[i] == tb[i % n : i % n + 1] == rows[i % n]
        assert _take(tb, i) == tb[i]


def test_batch_size_of_a_row_without_batch_axis_is_a_clear_error():
    tb = TransitionBatch.concatenate(make(0), make(1))
    for bad in (
        lambda: jax.vmap(lambda row: row.batch_size)(tb),  # rows inside vmap have no batch axis
        lambda: tb.replace(Rn=np.float32(1.0)).batch_size,
        lambda: len(tb.replace(Rn=None)),
    ):
        with pytest.raises(ValueError, match="Rn must be an array with a leading batch axis"):
            bad()
