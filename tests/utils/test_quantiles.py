"""Tests of quantile fractions and the cosine quantile embedding."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils


@pytest.mark.parametrize("use_jit", [False, True])
def test_quantiles_equally_spaced(use_jit):
    f = jax.jit(utils.quantiles, static_argnums=(0, 1)) if use_jit else utils.quantiles
    tau = f(3, 8)
    assert tau.shape == (3, 8) and tau.dtype == jnp.float32
    for row in np.asarray(tau):
        np.testing.assert_allclose(row, np.arange(8) / 8)
    assert utils.quantiles(2).shape == (2, 200)  # default num_quantiles
    assert utils.quantiles(0, 4).shape == (0, 4)


@pytest.mark.parametrize("use_jit", [False, True])
def test_quantiles_uniform_properties(use_jit):
    f = utils.quantiles_uniform
    if use_jit:
        f = jax.jit(f, static_argnums=(1, 2))
    tau = np.asarray(f(jax.random.PRNGKey(0), 16, 10))
    assert tau.shape == (16, 10)
    assert (tau > 0).all() and (tau <= 1).all()
    assert (np.diff(tau, axis=-1) > 0).all()
    np.testing.assert_array_equal(tau[:, -1], 1.0)
    assert len({tuple(r) for r in tau.round(6)}) == 16  # rows differ
    assert utils.quantiles_uniform(jax.random.PRNGKey(0), 2).shape == (2, 32)  # default
    other = np.asarray(f(jax.random.PRNGKey(1), 16, 10))
    assert not np.allclose(other, tau)
    again = np.asarray(f(jax.random.PRNGKey(0), 16, 10))
    np.testing.assert_array_equal(again, tau)


@pytest.mark.parametrize("num_quantiles", [1000, 100_000])
def test_quantiles_uniform_rows_never_decrease_for_many_quantiles(num_quantiles):
    # cumsum of the normalized increments rounded past 1 before the end of a row, and the
    # last entry, set to 1, then lay below the one before it (65 drops in 64 rows of 1e5)
    tau = np.asarray(utils.quantiles_uniform(jax.random.PRNGKey(1), 64, num_quantiles))
    assert (np.diff(tau, axis=-1) >= 0).all()
    assert (tau > 0).all() and (tau <= 1).all()
    np.testing.assert_array_equal(tau[:, -1], 1.0)
    # the increments are still normalized uniforms
    np.testing.assert_allclose(np.diff(tau, axis=-1, prepend=0).mean(), 1 / num_quantiles)


def test_quantiles_uniform_vmap_over_keys():
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    tau = jax.vmap(partial(utils.quantiles_uniform, batch_size=2, num_quantiles=4))(keys)
    assert tau.shape == (5, 2, 4)
    # the increments are normalized uniforms: their mean is 1 / num_quantiles
    np.testing.assert_allclose(np.diff(tau, axis=-1, prepend=0).mean(), 0.25, rtol=1e-5)


def _oracle_embedding(tau, n):
    tau = np.asarray(tau, dtype=np.float64)
    return np.cos(np.pi * np.arange(n) * tau[..., None])


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 4)])
@pytest.mark.parametrize("use_jit", [False, True])
def test_quantile_cos_embedding_formula_and_shapes(shape, use_jit):
    tau = jax.random.uniform(jax.random.PRNGKey(len(shape)), shape)
    f = partial(utils.quantile_cos_embedding, n=6)
    if use_jit:
        f = jax.jit(f)
    emb = f(tau)
    assert emb.shape == (*shape, 6)
    np.testing.assert_allclose(emb, _oracle_embedding(tau, 6), atol=1e-5)
    # i = 0 gives the constant 1 (the documented formula starts at i = 0)
    np.testing.assert_allclose(emb[..., 0], 1.0)


def test_quantile_cos_embedding_default_and_vmap():
    tau = utils.quantiles(4, 8)
    emb = utils.quantile_cos_embedding(tau)
    assert emb.shape == (4, 8, 64)
    per_row = jax.vmap(utils.quantile_cos_embedding)(tau)
    np.testing.assert_allclose(per_row, emb, atol=1e-6)
    ints = utils.quantile_cos_embedding(jnp.array([0, 1]), n=2)
    np.testing.assert_allclose(ints, [[1.0, 1.0], [1.0, -1.0]], atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_quantile_cos_embedding_of_half_floats_beyond_their_exact_integers(dtype):
    # float16 holds integers exactly only up to 2048, bfloat16 up to 256: with i built in the
    # fractions' dtype, rows i > 2048 (or 256) were embedded with the wrong frequency
    tau = jnp.array([0.5, 0.25], dtype)
    emb = utils.quantile_cos_embedding(tau, n=4100)
    assert emb.dtype == dtype and emb.shape == (2, 4100)
    expected = np.cos(np.pi * np.arange(4100) * np.array([[0.5], [0.25]]))
    np.testing.assert_allclose(np.asarray(emb, np.float32), expected, atol=1e-2)


def test_quantile_errors():
    with pytest.raises(ValueError, match="num_quantiles must be >= 1"):
        utils.quantiles(2, 0)
    with pytest.raises(ValueError, match="batch_size must be >= 0"):
        utils.quantiles_uniform(jax.random.PRNGKey(0), -1)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        utils.quantiles(2.0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        utils.quantile_cos_embedding(jnp.zeros(3), n=0)
