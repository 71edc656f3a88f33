"""Tests of the pytree helpers, with hypothesis properties and real Haiku params."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils import utils

SETTINGS = settings(max_examples=25, deadline=None)

# A tree spec: a dict of leaf name -> shape; trees are nested ({"a": .., "sub": (.., ..)}).
shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)
specs = st.dictionaries(st.sampled_from("abcdef"), shapes, min_size=1, max_size=4)


def make_tree(spec, seed):
    rng = np.random.default_rng(seed)
    names = sorted(spec)
    leaves = {k: rng.normal(size=spec[k]).astype(np.float32) for k in names}
    half = len(names) // 2
    return {
        "top": {k: leaves[k] for k in names[:half]},
        "sub": tuple(leaves[k] for k in names[half:]),
    }


def assert_trees_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- stack / unstack ----------------------------------------------------------------------


@SETTINGS
@given(spec=specs, n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_stack_unstack_round_trip(spec, n, seed):
    trees = [make_tree(spec, seed + i) for i in range(n)]
    stacked = utils.stack_trees(*trees)
    # oracle: np.stack per leaf
    for leaf, *per_tree in zip(
        jax.tree_util.tree_leaves(stacked), *map(jax.tree_util.tree_leaves, trees)
    ):
        np.testing.assert_array_equal(leaf, np.stack(per_tree))
    back = utils.unstack_trees(stacked)
    assert isinstance(back, tuple) and len(back) == n
    for t, b in zip(trees, back):
        assert_trees_equal(t, b)
    assert_trees_equal(utils.stack_trees(*back), stacked)


@SETTINGS
@given(spec=specs, n=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_batch_to_single_and_single_to_batch(spec, n, seed):
    trees = [make_tree(spec, seed + i) for i in range(n)]
    stacked = utils.stack_trees(*trees)
    for i in range(n):
        assert_trees_equal(utils.batch_to_single(stacked, i), trees[i])
    assert_trees_equal(utils.batch_to_single(stacked, -1), trees[-1])
    batch = utils.single_to_batch(trees[0])
    for leaf, orig in zip(jax.tree_util.tree_leaves(batch), jax.tree_util.tree_leaves(trees[0])):
        assert leaf.shape == (1, *orig.shape)
    assert_trees_equal(utils.batch_to_single(batch, 0), trees[0])


@SETTINGS
@given(spec=specs, seed=st.integers(0, 2**16))
def test_tree_ravel_matches_manual_concat(spec, seed):
    tree = make_tree(spec, seed)
    expected = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
    np.testing.assert_array_equal(utils.tree_ravel(tree), expected)


def test_pytree_helpers_under_jit():
    trees = [{"w": jnp.full((2,), float(i)), "b": (jnp.array(i),)} for i in range(3)]
    stacked = jax.jit(utils.stack_trees)(*trees)
    assert_trees_equal(stacked, utils.stack_trees(*trees))
    back = jax.jit(utils.unstack_trees)(stacked)
    for t, b in zip(trees, back):
        assert_trees_equal(t, b)
    idx = jnp.array(2)  # a traced index
    assert_trees_equal(jax.jit(utils.batch_to_single)(stacked, idx), trees[2])
    numpy_batch = {"a": np.arange(6).reshape(3, 2)}  # NumPy leaves closed over, traced index
    out = jax.jit(lambda i: utils.batch_to_single(numpy_batch, i))(idx)
    np.testing.assert_array_equal(out["a"], [4, 5])
    assert_trees_equal(jax.jit(utils.single_to_batch)(trees[0]), utils.single_to_batch(trees[0]))
    np.testing.assert_array_equal(jax.jit(utils.tree_ravel)(trees[1]), [1.0, 1.0, 1.0])


def test_tree_ravel_casts_int64_numpy_leaves_straight_to_the_result_dtype():
    # int64 -> int32 -> float32 wrapped 2**40 to 0
    out = utils.tree_ravel({"a": np.array([2**40, -(2**33)]), "b": np.ones(1, np.float32)})
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.array([2.0**40, -(2.0**33), 1.0], np.float32))


def test_tree_ravel_empty_and_mixed_dtypes():
    assert utils.tree_ravel({}).shape == (0,)
    out = utils.tree_ravel({"a": jnp.array([1], jnp.int32), "b": jnp.array([0.5])})
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [1.0, 0.5])


def test_pytree_helper_errors():
    with pytest.raises(ValueError, match="at least one pytree"):
        utils.stack_trees()
    with pytest.raises(ValueError, match="structure"):
        utils.stack_trees({"a": np.zeros(2)}, {"b": np.zeros(2)})
    with pytest.raises(ValueError, match=r"\['a'\] has different shapes"):
        utils.stack_trees({"a": np.zeros(2)}, {"a": np.zeros(3)})
    with pytest.raises(ValueError, match="leading axis sizes differ"):
        utils.unstack_trees({"a": np.zeros(2), "b": np.zeros(3)})
    with pytest.raises(ValueError, match="0-d"):
        utils.unstack_trees({"a": np.float32(1)})
    with pytest.raises(ValueError, match="at least one leaf"):
        utils.unstack_trees({})
    with pytest.raises(IndexError, match="out of range"):
        utils.batch_to_single({"a": jnp.zeros(3)}, 3)
    with pytest.raises(ValueError, match="0-d"):
        utils.batch_to_single({"a": jnp.zeros(())})


@pytest.mark.parametrize(
    "index", [True, np.True_, jnp.array(True), None, slice(0, 2), (0, 1), np.array([0, 1]), 1.0]
)
def test_batch_to_single_refuses_indices_that_are_not_one_int(index):
    # True indexed as a new axis (a batch of the whole batch), a slice or an array kept a batch
    batch = {"a": np.arange(6).reshape(3, 2), "b": jnp.arange(3.0)}
    with pytest.raises(TypeError, match="index"):
        utils.batch_to_single(batch, index)
    with pytest.raises(TypeError, match="index"):
        jax.jit(utils.batch_to_single)(batch, jnp.asarray(index) if index is True else index)


def test_batch_to_single_takes_int_like_indices_eagerly_and_traced():
    batch = {"a": np.arange(6).reshape(3, 2), "b": jnp.arange(3.0)}
    for index in (np.int64(-1), jnp.array(2), np.array(2, np.uint8)):
        out = utils.batch_to_single(batch, index)
        np.testing.assert_array_equal(out["a"], [4, 5])
        assert float(out["b"]) == 2.0
    out = jax.jit(utils.batch_to_single)(batch, 2)
    np.testing.assert_array_equal(out["a"], [4, 5])


# -- unvectorize ------------------------------------------------------------------------


@pytest.fixture
def rngs():
    return hk.PRNGSequence(42)


def test_unvectorize_single_output(rngs):
    x_batch = jax.random.normal(jax.random.PRNGKey(13), (7, 11))
    x_single = x_batch[3]

    init, f_batch = hk.transform(lambda x: hk.Linear(5)(x))
    params = init(next(rngs), x_batch)
    f_single = utils.unvectorize(f_batch, in_axes=(None, None, 0), out_axes=0)
    y_single = f_single(params, None, x_single)
    assert y_single.shape == (5,)
    np.testing.assert_allclose(y_single, f_batch(params, None, x_batch)[3], rtol=1e-5)
    y_jit = jax.jit(f_single)(params, None, x_single)
    np.testing.assert_allclose(y_jit, y_single, rtol=1e-5)

    f_bad = utils.unvectorize(f_batch, in_axes=(None, None, 0), out_axes=(0,))
    msg = r"out_axes must be an int for functions with a single output; got: out_axes=\(0,\)"
    with pytest.raises(TypeError, match=msg):
        f_bad(params, None, x_single)

    f_bad = utils.unvectorize(f_batch, in_axes=(None, None, 0, 0), out_axes=(0,))
    with pytest.raises(ValueError, match="number of in_axes must match the number of function"):
        f_bad(params, None, x_single)


def test_unvectorize_multi_output(rngs):
    x_batch = jnp.ones((7, 11))
    init, f_batch = hk.transform(lambda x: (hk.Linear(3)(x), hk.Linear(4)(x)))
    params = init(next(rngs), x_batch)
    x = jnp.ones(11)

    y = utils.unvectorize(f_batch, in_axes=(None, None, 0), out_axes=0)(params, None, x)
    assert (y[0].shape, y[1].shape) == ((3,), (4,))
    y = utils.unvectorize(f_batch, in_axes=(None, None, 0), out_axes=(0, None))(params, None, x)
    assert (y[0].shape, y[1].shape) == ((3,), (1, 4))
    y = utils.unvectorize(f_batch, in_axes=(None, None, 0), out_axes=None)(params, None, x)
    assert (y[0].shape, y[1].shape) == ((1, 3), (1, 4))
    f_bad = utils.unvectorize(f_batch, in_axes=(None, None, 0), out_axes=(0,))
    with pytest.raises(ValueError, match="number of out_axes must match the number of function"):
        f_bad(params, None, x)


def test_unvectorize_before_transform_and_kwargs():
    def f(x, scale=1.0):
        assert x.ndim == 2  # the batched function sees a batch
        return hk.Linear(6)(x) * scale

    init, f_single = hk.transform(utils.unvectorize(f))
    params = init(jax.random.PRNGKey(0), jnp.zeros(4))
    y1 = f_single(params, None, jnp.ones(4))
    y2 = f_single(params, None, jnp.ones(4), scale=2.0)
    assert y1.shape == (6,)
    np.testing.assert_allclose(y2, 2 * y1, rtol=1e-6)


def test_unvectorize_validates_axes_at_construction():
    with pytest.raises(TypeError, match="in_axes must be"):
        utils.unvectorize(lambda x: x, in_axes="0")
    with pytest.raises(TypeError, match="out_axes must be"):
        utils.unvectorize(lambda x: x, out_axes=(0, 1.5))
    with pytest.raises(TypeError, match="callable"):
        utils.unvectorize(3)


# -- sync_shared_params (real Haiku params) -------------------------------------------------


def _actor(x):
    h = jax.nn.relu(hk.Linear(8, name="torso")(x))
    return hk.Linear(2, name="pi_head")(h)


def _critic(x):
    h = jax.nn.relu(hk.Linear(8, name="torso")(x))
    return hk.Linear(1, name="v_head")(h)


def _other(x):
    return hk.Linear(3, name="pi_head")(x)


@pytest.fixture
def haiku_params():
    x = jnp.ones((1, 5))
    actor, critic, other = (
        hk.without_apply_rng(hk.transform(f)) for f in (_actor, _critic, _other)
    )
    pa = actor.init(jax.random.PRNGKey(1), x)
    pc = critic.init(jax.random.PRNGKey(2), x)
    po = other.init(jax.random.PRNGKey(3), x)
    return (actor, critic), (pa, pc, po)


@pytest.mark.parametrize("use_jit", [False, True])
def test_sync_shared_params_weighted_average(haiku_params, use_jit):
    (actor, critic), (pa, pc, _) = haiku_params
    before = jax.tree_util.tree_map(np.array, (pa, pc))
    sync = lambda a, c: utils.sync_shared_params(a, c, weights=[1.0, 3.0])  # noqa: E731
    if use_jit:
        sync = jax.jit(sync)
    qa, qc = sync(pa, pc)
    for name in ("w", "b"):
        expected = 0.25 * before[0]["torso"][name] + 0.75 * before[1]["torso"][name]
        np.testing.assert_allclose(qa["torso"][name], expected, rtol=1e-6)
        np.testing.assert_allclose(qc["torso"][name], expected, rtol=1e-6)
    # modules not shared are untouched, inputs are not mutated
    np.testing.assert_array_equal(qa["pi_head"]["w"], before[0]["pi_head"]["w"])
    np.testing.assert_array_equal(qc["v_head"]["w"], before[1]["v_head"]["w"])
    np.testing.assert_array_equal(pa["torso"]["w"], before[0]["torso"]["w"])
    assert set(qa) == set(pa) and set(qc) == set(pc)
    # the synced params still work with their networks
    x = jnp.ones((2, 5))
    assert actor.apply(qa, x).shape == (2, 2) and critic.apply(qc, x).shape == (2, 1)


def test_sync_shared_params_keeps_the_dtype_of_every_dict(haiku_params):
    # a bfloat16 actor and a float32 critic: the critic's torso came back in bfloat16 (the
    # dtype of the first dict), silently changing its precision and its params' dtypes
    (_, critic), (pa, pc, _) = haiku_params
    pa16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), pa)
    qa, qc = utils.sync_shared_params(pa16, pc)
    for name in ("w", "b"):
        assert qa["torso"][name].dtype == jnp.bfloat16 and qc["torso"][name].dtype == jnp.float32
        expected = (np.asarray(pa16["torso"][name], np.float32) + pc["torso"][name]) / 2
        np.testing.assert_allclose(qc["torso"][name], expected, rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(qa["torso"][name], np.float32), expected, rtol=1e-2, atol=1e-3
        )
    assert critic.apply(qc, jnp.ones((2, 5))).dtype == jnp.float32


def test_sync_shared_params_only_modules_present_in_all(haiku_params):
    _, (pa, pc, po) = haiku_params
    qa, qc, qo = utils.sync_shared_params(pa, pc, po)
    # torso is missing from po and pi_head from pc: nothing is shared by all three
    assert qa["torso"] is pa["torso"] and qc["torso"] is pc["torso"]
    assert qa["pi_head"] is pa["pi_head"] and qo["pi_head"] is po["pi_head"]
    qa, qc = utils.sync_shared_params(pa, pc)  # equal weights
    np.testing.assert_allclose(
        qa["torso"]["w"], (pa["torso"]["w"] + pc["torso"]["w"]) / 2, rtol=1e-6
    )


def test_sync_shared_params_errors_and_trivial_cases(haiku_params):
    _, (pa, pc, po) = haiku_params
    assert utils.sync_shared_params(pa) == (pa,)
    assert utils.sync_shared_params() == ()
    with pytest.raises(ValueError, match="len\\(weights\\) = 1 does not match"):
        utils.sync_shared_params(pa, pc, weights=[1.0])
    with pytest.raises(ValueError, match="non-negative"):
        utils.sync_shared_params(pa, pc, weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="positive sum"):
        utils.sync_shared_params(pa, pc, weights=[0.0, 0.0])
    with pytest.raises(ValueError, match="'pi_head'.*different shapes"):
        utils.sync_shared_params(pa, po)
    with pytest.raises(TypeError, match="mapping"):
        utils.sync_shared_params(pa, [1, 2])


# -- diagnostics ----------------------------------------------------------------------


@pytest.mark.parametrize("use_jit", [False, True])
def test_get_magnitude_quantiles_matches_numpy(use_jit):
    tree = {"a": np.array([[-3.0, 1.0], [0.5, -7.0]]), "b": (np.array([2.0, -0.25, 4.0]),)}
    f = utils.get_magnitude_quantiles
    out = (jax.jit(f, static_argnums=1) if use_jit else f)(tree, "p/")
    flat = np.abs(np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)]))
    expected = np.quantile(flat, [0, 0.25, 0.5, 0.75, 1])
    names = ["p/min", "p/p25", "p/p50", "p/p75", "p/max"]
    assert set(out) == set(names)  # (jit returns dicts with sorted keys)
    np.testing.assert_allclose([float(out[k]) for k in names], expected, rtol=1e-6)
    with pytest.raises(ValueError, match="at least one element"):
        utils.get_magnitude_quantiles({})


@pytest.mark.parametrize("use_jit", [False, True])
def test_get_grads_diagnostics(use_jit):
    grads = {"w": jnp.array([[3.0, 0.0], [0.0, -4.0]]), "b": jnp.array([12.0])}
    f = (
        jax.jit(utils.get_grads_diagnostics, static_argnums=(1, 2))
        if use_jit
        else (utils.get_grads_diagnostics)
    )
    d = f(grads, "g/", False)
    flat = np.abs(np.array([12.0, 3.0, 0.0, 0.0, -4.0]))
    assert set(d) == {"g/min", "g/p25", "g/p50", "g/p75", "g/max", "g/norm"}
    np.testing.assert_allclose(float(d["g/norm"]), 13.0, rtol=1e-6)
    np.testing.assert_allclose(float(d["g/p50"]), np.quantile(flat, 0.5), rtol=1e-6)
    per_leaf = f(grads, "", True)
    assert set(per_leaf) == {"w", "b"}
    np.testing.assert_allclose(float(per_leaf["w"]["norm"]), 5.0, rtol=1e-6)
    np.testing.assert_allclose(float(per_leaf["b"]["max"]), 12.0, rtol=1e-6)


@pytest.mark.parametrize("use_jit", [False, True])
def test_magnitudes_of_the_most_negative_int_are_not_negative(use_jit):
    # abs of int8 -128 (int32 -2**31) wraps to itself in its own dtype
    tree = {"a": np.array([-128, 1], np.int8), "b": jnp.array([-(2**31), 3], jnp.int32)}
    f = jax.jit(utils.get_magnitude_quantiles) if use_jit else utils.get_magnitude_quantiles
    out = f(tree)
    expected = np.quantile(np.abs([-128.0, 1.0, -(2.0**31), 3.0]), [0, 0.25, 0.5, 0.75, 1])
    names = ["min", "p25", "p50", "p75", "max"]
    np.testing.assert_allclose([float(out[k]) for k in names], expected, rtol=1e-6)
    d = utils.get_grads_diagnostics({"a": jnp.array([-128, 0], jnp.int8)}, keep_tree_structure=True)
    assert float(d["a"]["max"]) == 128.0 and float(d["a"]["min"]) == 0.0
    # complex leaves: the magnitudes are their moduli
    d = utils.get_grads_diagnostics({"a": jnp.array([3 + 4j, 1j])})
    assert float(d["max"]) == 5.0 and float(d["min"]) == 1.0
    np.testing.assert_allclose(float(d["norm"]), np.sqrt(26.0), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_grads_norm_of_half_floats_does_not_overflow(dtype):
    # 1000 entries of 10: the squares sum to 1e5, beyond float16's maximum 65504
    grads = {"w": jnp.full((1000,), 10.0, dtype)}
    per_leaf = utils.get_grads_diagnostics(grads, "", True)["w"]
    for d in (utils.get_grads_diagnostics(grads), per_leaf):
        np.testing.assert_allclose(float(d["norm"]), np.sqrt(1000) * 10, rtol=1e-2)
        assert d["norm"].dtype == dtype
