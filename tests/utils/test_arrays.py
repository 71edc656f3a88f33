"""Tests of the array helpers: tie-breaking argmax/argmin, checks and small transforms."""

from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils

N_KEYS = 600  # enough draws that each tied position's frequency is within a few std of 1/k


def _keys(n, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), n)


# -- argmax / argmin without ties: equal to jnp ---------------------------------------------


@pytest.mark.parametrize("shape,axis", [((7,), -1), ((4, 5), 0), ((4, 5), -1), ((3, 4, 5), 1)])
@pytest.mark.parametrize("use_jit", [False, True])
def test_argmax_argmin_match_jnp_without_ties(shape, axis, use_jit):
    x = jax.random.normal(jax.random.PRNGKey(1), shape)  # continuous: no ties
    fmax = partial(utils.argmax, axis=axis)
    fmin = partial(utils.argmin, axis=axis)
    if use_jit:
        fmax, fmin = jax.jit(fmax), jax.jit(fmin)
    key = jax.random.PRNGKey(2)
    np.testing.assert_array_equal(fmax(key, x), jnp.argmax(x, axis=axis))
    np.testing.assert_array_equal(fmin(key, x), jnp.argmin(x, axis=axis))


def test_argmax_axis_none_is_flat_index():
    x = jnp.array([[0.0, 1.0], [5.0, 2.0]])
    assert int(utils.argmax(jax.random.PRNGKey(0), x, axis=None)) == 2
    assert int(utils.argmin(jax.random.PRNGKey(0), x, axis=None)) == 0


def test_argmax_accepts_new_style_keys_and_lists():
    assert int(utils.argmax(jax.random.key(3), [1, 9, 2])) == 1


def test_argmin_exact_for_unsigned_and_bool():
    # -x would wrap around for unsigned dtypes; argmin must not negate.
    x = jnp.array([3, 0, 255, 7], dtype=jnp.uint8)
    assert int(utils.argmin(jax.random.PRNGKey(0), x)) == 1
    assert int(utils.argmax(jax.random.PRNGKey(0), x)) == 2
    b = jnp.array([True, False, True])
    assert int(utils.argmin(jax.random.PRNGKey(0), b)) == 1


def test_single_nan_behaves_like_jnp():
    x = jnp.array([1.0, jnp.nan, 3.0])
    key = jax.random.PRNGKey(0)
    assert int(utils.argmax(key, x)) == int(jnp.argmax(x)) == 1
    assert int(utils.argmin(key, x)) == int(jnp.argmin(x)) == 1


# -- tie statistics ------------------------------------------------------------------------


def _assert_uniform(counts, tied, n):
    """counts: frequency per position; tied: the tied positions."""
    expected = n / len(tied)
    std = np.sqrt(n * (1 / len(tied)) * (1 - 1 / len(tied)))
    for j, c in enumerate(counts):
        if j in tied:
            assert abs(c - expected) < 5 * std, (counts, tied)
        else:
            assert c == 0, (counts, tied)


def test_argmax_ties_uniform_1d_under_vmap_and_jit():
    x = jnp.array([1.0, 3.0, 3.0, 0.0, 3.0])
    f = jax.jit(jax.vmap(utils.argmax, in_axes=(0, None)))
    picks = np.asarray(f(_keys(N_KEYS), x))
    _assert_uniform(np.bincount(picks, minlength=5), {1, 2, 4}, N_KEYS)


@pytest.mark.parametrize("use_jit", [False, True])
def test_argmax_ties_uniform_along_last_axis_2d(use_jit):
    x = jnp.array([[2, 2, 1, 2], [0, 5, 5, 1], [7, 7, 7, 7]])
    f = jax.vmap(utils.argmax, in_axes=(0, None))
    if use_jit:
        f = jax.jit(f)
    picks = np.asarray(f(_keys(N_KEYS, 1), x))  # (N_KEYS, 3)
    assert picks.shape == (N_KEYS, 3)
    _assert_uniform(np.bincount(picks[:, 0], minlength=4), {0, 1, 3}, N_KEYS)
    _assert_uniform(np.bincount(picks[:, 1], minlength=4), {1, 2}, N_KEYS)
    _assert_uniform(np.bincount(picks[:, 2], minlength=4), {0, 1, 2, 3}, N_KEYS)


def test_argmax_and_argmin_ties_uniform_along_axis_0_of_3d():
    # x[:, i, j]: along axis 0 the maxima are tied at positions {0, 2} for (0, 0) and at
    # all three positions for (1, 1); elsewhere the maximum is unique.
    x = np.zeros((3, 2, 2), dtype=np.float32)
    x[:, 0, 0] = [4, 1, 4]
    x[:, 0, 1] = [1, 2, 3]
    x[:, 1, 0] = [9, 1, 1]
    x[:, 1, 1] = [6, 6, 6]
    keys = _keys(N_KEYS, 2)
    picks = np.asarray(jax.vmap(partial(utils.argmax, axis=0), in_axes=(0, None))(keys, x))
    assert picks.shape == (N_KEYS, 2, 2)
    _assert_uniform(np.bincount(picks[:, 0, 0], minlength=3), {0, 2}, N_KEYS)
    assert set(picks[:, 0, 1]) == {2}
    assert set(picks[:, 1, 0]) == {0}
    _assert_uniform(np.bincount(picks[:, 1, 1], minlength=3), {0, 1, 2}, N_KEYS)

    mins = np.asarray(jax.vmap(partial(utils.argmin, axis=0), in_axes=(0, None))(keys, x))
    _assert_uniform(np.bincount(mins[:, 1, 0], minlength=3), {1, 2}, N_KEYS)
    assert set(mins[:, 0, 1]) == {0}


def test_argmax_vmapped_over_arrays_with_axis():
    x = jax.random.randint(jax.random.PRNGKey(5), (6, 4, 3), 0, 3)  # many ties
    keys = _keys(6, 3)
    picks = jax.vmap(partial(utils.argmax, axis=0))(keys, x)  # per-item axis 0 of (4, 3)
    assert picks.shape == (6, 3)
    xs = np.asarray(x)
    for b in range(6):
        for j in range(3):
            assert xs[b, picks[b, j], j] == xs[b, :, j].max()


def test_argmax_is_random_per_key_but_deterministic_per_key():
    x = jnp.ones(10)
    key = jax.random.PRNGKey(9)
    assert int(utils.argmax(key, x)) == int(utils.argmax(key, x))
    assert len({int(utils.argmax(k, x)) for k in _keys(50)}) > 3


def test_argmax_no_retrace_on_second_call():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(key, x):
        return utils.argmax(key, x, axis=0)

    x = jnp.ones((3, 2))
    f(jax.random.PRNGKey(0), x)
    f(jax.random.PRNGKey(1), x + 1)


def test_argmax_errors():
    key = jax.random.PRNGKey(0)
    with pytest.raises(IndexError, match="axis=2 is out of bounds"):
        utils.argmax(key, jnp.ones((2, 2)), axis=2)
    with pytest.raises(ValueError, match="empty axis"):
        utils.argmin(key, jnp.ones((2, 0)))
    with pytest.raises(TypeError, match="axis must be an int"):
        utils.argmax(key, jnp.ones(3), axis=1.0)


# -- idx, isscalar, check_array --------------------------------------------------------------


def test_idx_eager_and_jit():
    x = np.zeros((2, 5, 3))
    np.testing.assert_array_equal(utils.idx(x), np.arange(2))
    np.testing.assert_array_equal(utils.idx(x, axis=-2), np.arange(5))
    np.testing.assert_array_equal(jax.jit(partial(utils.idx, axis=2))(jnp.asarray(x)), np.arange(3))
    with pytest.raises(TypeError, match="ndim at least 1"):
        utils.idx(np.array(1.0))
    with pytest.raises(IndexError):
        utils.idx(x, axis=3)


def test_isscalar():
    assert utils.isscalar(1) and utils.isscalar(2.5) and utils.isscalar(np.float32(1))
    assert utils.isscalar(np.array([[3]])) and utils.isscalar(jnp.array(1.0))
    assert not utils.isscalar(np.zeros(2)) and not utils.isscalar(jnp.zeros((1, 2)))
    assert not utils.isscalar("abc") and not utils.isscalar([1])

    seen = []

    @jax.jit
    def f(x, y):
        seen.append((utils.isscalar(x), utils.isscalar(y)))
        return x

    f(jnp.ones((1, 1)), jnp.ones(3))
    assert seen == [(True, False)]


def test_check_array_passes_and_fails():
    x = jnp.zeros((2, 3), dtype=jnp.float32)
    utils.check_array(x, ndim=2, ndim_min=1, ndim_max=2, dtype=jnp.float32, shape=(2, 3))
    utils.check_array(x, ndim=[1, 2], dtype=(jnp.int32, np.floating), axis_size=[3, 4], axis=1)
    utils.check_array(np.zeros(2), except_np=True)
    cases = [
        (dict(), np.zeros(2), "expected input to be a jax.Array"),
        (dict(except_np=True), [1.0], "expected input to be an ndarray"),
        (dict(ndim=3), x, r"ndim\(s\) 3, got ndim: 2"),
        (dict(ndim_min=3), x, "ndim at least 3"),
        (dict(ndim_max=1), x, "ndim at most 1"),
        (dict(dtype=jnp.int32), x, "dtype"),
        (dict(shape=(3, 2)), x, r"shape \(3, 2\), got shape: \(2, 3\)"),
        (dict(axis_size=2, axis=1), x, "size"),
    ]
    for kwargs, arr, msg in cases:
        with pytest.raises(TypeError, match=msg):
            utils.check_array(arr, **kwargs)
    with pytest.raises(IndexError):
        utils.check_array(x, axis_size=2, axis=5)

    @jax.jit
    def f(y):
        utils.check_array(y, ndim=1)
        return y

    f(jnp.zeros(3))
    with pytest.raises(TypeError):
        f(jnp.zeros((3, 1)))


# -- clipped_logit, double_relu ------------------------------------------------------------


@pytest.mark.parametrize("use_jit", [False, True])
def test_clipped_logit(use_jit):
    f = jax.jit(utils.clipped_logit) if use_jit else utils.clipped_logit
    x = np.array([0.0, 1e-20, 0.1, 0.5, 0.9, 1.0])
    eps = 1e-15
    expected = np.log(np.clip(x, eps, 1)) - np.log(np.clip(1 - x, eps, 1))
    np.testing.assert_allclose(f(jnp.asarray(x, jnp.float32)), expected, rtol=1e-5, atol=1e-6)
    out = f(jnp.array([0, 1]))  # ints are promoted to float
    assert jnp.issubdtype(out.dtype, jnp.floating) and bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(
        utils.clipped_logit(jnp.array([0.0]), epsilon=0.01), [np.log(0.01)], rtol=1e-6
    )


@pytest.mark.parametrize("use_jit", [False, True])
def test_double_relu(use_jit):
    f = jax.jit(utils.double_relu) if use_jit else utils.double_relu
    x = np.random.default_rng(0).normal(size=(3, 4, 5)).astype(np.float32)
    out = f(x)
    assert out.shape == (3, 4, 10)
    np.testing.assert_array_equal(out[..., :5], np.minimum(x, 0))
    np.testing.assert_array_equal(out[..., 5:], np.maximum(x, 0))


# -- diff transform ------------------------------------------------------------------------


def test_diff_transform_matrix_matches_documented_matrix():
    documented = np.array([[-1, 0, 0, 0], [3, 1, 0, 0], [-3, -2, -1, 0], [1, 1, 1, 1]])
    m = utils.diff_transform_matrix(4)
    assert m.dtype == jnp.float32
    np.testing.assert_array_equal(m, documented)
    assert utils.diff_transform_matrix(2, dtype="int32").dtype == jnp.int32
    np.testing.assert_array_equal(utils.diff_transform_matrix(1), [[1.0]])


@pytest.mark.parametrize("num_frames", [1, 2, 3, 5, 6])
def test_diff_transform_columns_are_backward_differences(num_frames):
    # Oracle: column b of X @ M is the (n-1-b)-th backward difference at the latest frame.
    X = np.random.default_rng(num_frames).normal(size=(2, 3, num_frames))
    out = np.asarray(utils.diff_transform(jnp.asarray(X, jnp.float32)))
    for b in range(num_frames):
        k = num_frames - 1 - b
        np.testing.assert_allclose(out[..., b], np.diff(X, n=k, axis=-1)[..., -1], atol=1e-4)
    jitted = jax.jit(utils.diff_transform)(jnp.asarray(X, jnp.float32))
    np.testing.assert_allclose(jitted, out, atol=1e-6)


def test_diff_transform_matrix_errors():
    with pytest.raises(ValueError, match="num_frames must be >= 1, got 0"):
        utils.diff_transform_matrix(0)
    with pytest.raises(TypeError):
        utils.diff_transform_matrix(2.0)
    with pytest.raises(ValueError, match="frame-stack axis"):
        utils.diff_transform(jnp.float32(1.0))


# -- exactness for every dtype ---------------------------------------------------------------


@pytest.mark.parametrize(
    "x,expected_max,expected_min",
    [
        (np.array([2**40, 1, 3], dtype=np.uint64), 0, 1),  # 2**40 wraps to 0 in 32 bits
        (np.array([2**40, -(2**41), 3], dtype=np.int64), 0, 1),
        (np.array([1.0, 1.0 + 1e-12, 1.0 - 1e-12]), 1, 2),  # one value in float32
        (np.array([1e300, 1e301, -1e300]), 1, 2),  # inf in float32
        (np.array([1e-300, 1e-301, 1e-299]), 2, 1),  # 0 in float32
    ],
)
def test_argmax_argmin_exact_for_64_bit_numpy_input(x, expected_max, expected_min):
    for key in _keys(8):
        assert int(utils.argmax(key, x)) == int(np.argmax(x)) == expected_max
        assert int(utils.argmin(key, x)) == int(np.argmin(x)) == expected_min


def test_argmax_numpy_input_matches_jax_input_draw_for_draw():
    x = np.array([[3, 3, 1, 3], [0, 2, 2, 2]], dtype=np.int32)
    for key in _keys(5):
        np.testing.assert_array_equal(utils.argmax(key, x), utils.argmax(key, jnp.asarray(x)))
        np.testing.assert_array_equal(utils.argmin(key, x), utils.argmin(key, jnp.asarray(x)))


def test_argmax_rejects_non_numeric_input():
    with pytest.raises(TypeError, match="numbers or booleans"):
        utils.argmax(jax.random.PRNGKey(0), ["a", "b"])


def test_clipped_logit_finite_in_float16_and_checks_epsilon():
    z = utils.clipped_logit(np.array([0.0, 1.0, 0.5], np.float16))
    assert z.dtype == jnp.float16
    assert bool(jnp.isfinite(z).all()) and float(z[0]) < -9 and float(z[1]) > 9
    for bad in (0, -1.0, 0.7, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="epsilon"):
            utils.clipped_logit(jnp.array([0.3]), epsilon=bad)
    with pytest.raises(TypeError, match="epsilon"):
        utils.clipped_logit(jnp.array([0.3]), epsilon="0.1")


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32, np.float16, np.float32])
def test_double_relu_exact_for_every_dtype(dtype):
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else np.finfo(dtype)
    x = np.array([info.min, 0, 1, info.max], dtype=dtype)
    expected = np.concatenate([np.minimum(x, 0), np.maximum(x, 0)])
    out = utils.double_relu(x)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="at least one axis"):
        utils.double_relu(np.float32(1.0))


@pytest.mark.parametrize(
    "num_frames,dtype", [(3, "uint8"), (2, "bool"), (12, "int8"), (40, "int32"), (30, "float16")]
)
def test_diff_transform_matrix_refuses_a_dtype_that_cannot_hold_it(num_frames, dtype):
    with pytest.raises(ValueError, match="cannot hold"):
        utils.diff_transform_matrix(num_frames, dtype=dtype)
    with pytest.raises(ValueError, match="cannot hold"):
        utils.diff_transform(np.ones(num_frames), dtype=dtype)


def test_diff_transform_of_int64_numpy_input_does_not_wrap():
    x = np.array([2**40, 2**40 + 2**20])
    np.testing.assert_allclose(utils.diff_transform(x), [2.0**20, 2.0**40 + 2**20], rtol=1e-6)


def test_argmax_argmin_accept_numpy_bfloat16_with_nan_and_ties():
    x = np.array([1.0, 3.0, 3.0, -2.0], dtype=jnp.bfloat16)
    y = np.array([1.0, np.nan, -2.0], dtype=jnp.bfloat16)
    seen = set()
    for key in _keys(16):
        seen.add(int(utils.argmax(key, x)))
        assert int(utils.argmin(key, x)) == 3
        assert int(utils.argmax(key, y)) == int(utils.argmin(key, y)) == 1  # NaN wins
    assert seen == {1, 2}


def test_double_relu_gradient_at_zero_is_that_of_relu():
    grad = jax.grad(lambda x: utils.double_relu(x).sum())(jnp.array([0.0, 2.0, -3.0]))
    np.testing.assert_array_equal(grad, [0.0, 1.0, 1.0])
    out = utils.double_relu(jnp.array([np.nan, -1.0]))
    np.testing.assert_array_equal(out, [np.nan, -1.0, np.nan, 0.0])  # NaN stays NaN, as relu


def test_lists_of_traced_values_are_taken_under_jit():
    key = jax.random.PRNGKey(0)
    pick = jax.jit(lambda a, b: (utils.argmax(key, [a, b]), utils.argmin(key, [a, b])))
    assert [int(i) for i in pick(jnp.float32(1), jnp.float32(2))] == [1, 0]
    diff = jax.jit(lambda a: utils.diff_transform([a, a + 1, a + 3]))
    np.testing.assert_array_equal(diff(jnp.float32(1)), [1.0, 2.0, 4.0])
