"""Tests of the Ornstein-Uhlenbeck noise: host object and pure jittable form."""

import copy
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.utils import (
    OrnsteinUhlenbeckNoise,
    OUNoiseState,
    ou_noise_init,
    ou_noise_reset,
    ou_noise_step,
)


def test_host_follows_the_recursion_with_its_own_white_noise():
    mu = np.array([0.0, 1.0, -1.0])
    sigma, theta = 0.3, 0.2
    noise = OrnsteinUhlenbeckNoise(mu=mu, sigma=sigma, theta=theta, random_seed=42)
    rng = np.random.default_rng(42)  # the documented stream: standard normals of the action shape
    x = mu.copy()
    for t in range(5):
        a = np.full(3, float(t))
        x = x - theta * (x - mu) + sigma * rng.standard_normal(3)
        np.testing.assert_allclose(noise(a), a + x, rtol=1e-12)


def test_host_is_reproducible_and_reset_restarts_from_mu():
    a = np.zeros((2, 2), np.float32)
    n1 = OrnsteinUhlenbeckNoise(mu=0.5, random_seed=1)
    n2 = OrnsteinUhlenbeckNoise(mu=0.5, random_seed=1)
    out1 = [n1(a) for _ in range(3)]
    out2 = [n2(a) for _ in range(3)]
    for x, y in zip(out1, out2):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == np.float32 and x.shape == (2, 2)
    assert not np.array_equal(out1[0], out1[1])
    n1.reset()
    # after a reset, X_1 = mu + sigma * eps: no memory of the previous episode
    eps = np.random.default_rng(1)
    for _ in range(3):
        eps.standard_normal((2, 2))
    expected = 0.5 + eps.standard_normal((2, 2)).astype(np.float32)
    np.testing.assert_allclose(n1(a), expected, rtol=1e-6)


def test_host_clips_the_output_action_not_the_noise():
    sigma, theta = 5.0, 0.15
    noise = OrnsteinUhlenbeckNoise(
        sigma=sigma, theta=theta, min_value=-1.0, max_value=[0.5, 1.0], random_seed=0
    )
    rng = np.random.default_rng(0)
    x = np.zeros(2)
    for _ in range(50):
        out = noise(np.zeros(2))
        x = x - theta * x + sigma * rng.standard_normal(2)  # the unclipped process
        np.testing.assert_allclose(out, np.clip(x, -1.0, [0.5, 1.0]), rtol=1e-12)
    assert np.abs(x).max() > 1.0  # clipping was exercised


def test_host_broadcasts_parameters_and_integer_actions():
    noise = OrnsteinUhlenbeckNoise(mu=[0.0, 10.0], sigma=0.0, theta=0.5, random_seed=0)
    out = noise(np.array([[1, 1], [2, 2]]))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, [[1.0, 11.0], [2.0, 12.0]])


def test_host_rejects_shape_change_without_reset():
    noise = OrnsteinUhlenbeckNoise(random_seed=0)
    noise(np.zeros(3))
    with pytest.raises(ValueError, match="reset"):
        noise(np.zeros(4))
    noise.reset()
    assert noise(np.zeros(4)).shape == (4,)


@pytest.mark.parametrize(
    "kwargs",
    [dict(sigma=-1.0), dict(theta=-0.1), dict(sigma=np.nan), dict(min_value=1.0, max_value=0.0)],
)
def test_bad_parameters_raise(kwargs):
    with pytest.raises(ValueError):
        OrnsteinUhlenbeckNoise(**kwargs)
    with pytest.raises(ValueError):
        ou_noise_init(jnp.zeros(2), **kwargs)


def test_stationary_variance_host_and_pure():
    sigma, theta = 0.4, 0.3
    expected_var = sigma**2 / (theta * (2 - theta))
    host = OrnsteinUhlenbeckNoise(sigma=sigma, theta=theta, random_seed=0)
    xs = np.stack([host(np.zeros(64)) for _ in range(600)])[100:]
    assert xs.var() == pytest.approx(expected_var, rel=0.1)

    state = ou_noise_init(jnp.zeros(64), sigma=sigma, theta=theta)

    def body(state, key):
        a, state = ou_noise_step(key, jnp.zeros(64), state)
        return state, a

    _, ys = jax.lax.scan(body, state, jax.random.split(jax.random.key(0), 600))
    assert float(jnp.var(ys[100:])) == pytest.approx(expected_var, rel=0.1)


def test_pure_step_matches_formula_and_is_jittable_without_retrace():
    state = ou_noise_init(
        jnp.zeros(3), mu=jnp.array([0.0, 1.0, 2.0]), sigma=0.5, theta=0.1, max_value=2.5
    )
    assert isinstance(state, OUNoiseState)
    np.testing.assert_array_equal(np.asarray(state.noise), [0.0, 1.0, 2.0])

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(key, action, state):
        return ou_noise_step(key, action, state)

    x = np.array([0.0, 1.0, 2.0], np.float32)
    for i in range(4):
        key = jax.random.key(i)
        action = jnp.full(3, 0.25 * i)
        noisy, state = step(key, action, state)
        eps = np.asarray(jax.random.normal(key, (3,), jnp.float32))
        x = x - 0.1 * (x - np.array([0.0, 1.0, 2.0])) + 0.5 * eps
        np.testing.assert_allclose(np.asarray(state.noise), x, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(noisy), np.minimum(0.25 * i + x, 2.5), rtol=1e-5)
        eager_noisy, _ = ou_noise_step(key, action, jax.tree_util.tree_map(jnp.asarray, state))
        assert eager_noisy.shape == (3,)


def test_pure_reset_and_vmap_over_states():
    states = jax.vmap(lambda mu: ou_noise_init(jnp.zeros(2), mu=mu, sigma=1.0))(jnp.arange(4.0))
    keys = jax.random.split(jax.random.key(0), 4)
    noisy, states = jax.vmap(ou_noise_step)(keys, jnp.zeros((4, 2)), states)
    assert noisy.shape == (4, 2)
    assert len(set(np.asarray(noisy[:, 0]).tolist())) == 4  # independent keys per state
    reset = jax.vmap(ou_noise_reset)(states)
    np.testing.assert_array_equal(
        np.asarray(reset.noise), np.repeat(np.arange(4.0), 2).reshape(4, 2)
    )


def test_pure_keeps_dtype():
    state = ou_noise_init(jnp.zeros(2, jnp.bfloat16))
    noisy, state = ou_noise_step(jax.random.key(0), jnp.zeros(2, jnp.bfloat16), state)
    assert noisy.dtype == jnp.bfloat16 and state.noise.dtype == jnp.bfloat16


# -- bad input is refused before anything changes ------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(mu=np.nan), "mu.*nan"), (dict(mu=np.inf), "mu.*inf"), (dict(min_value=np.nan), "nan")],
)
def test_non_finite_mean_and_nan_bounds_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OrnsteinUhlenbeckNoise(**kwargs)
    with pytest.raises(ValueError, match=match):
        ou_noise_init(jnp.zeros(2), **kwargs)


def test_sigma_shape_mismatch_raises_before_storing_noise_or_drawing():
    noise = OrnsteinUhlenbeckNoise(sigma=np.ones(3), random_seed=0)
    before = noise._rng.bit_generator.state
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        noise(np.zeros(2))
    assert noise._noise is None and noise._rng.bit_generator.state == before
    assert noise(np.zeros(3)).shape == (3,)


def test_jitted_ou_noise_step_refuses_another_shape_at_trace_time():
    state = ou_noise_init(jnp.zeros(3))
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        jax.jit(ou_noise_step)(jax.random.key(0), jnp.zeros(2), state)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        jax.jit(ou_noise_step)(jax.random.key(0), jnp.zeros((2, 3)), state)


def test_checkpoint_round_trip_continues_the_same_stream():
    noise = OrnsteinUhlenbeckNoise(mu=0.5, sigma=np.full(2, 0.3), min_value=-1, random_seed=3)
    noise(np.zeros(2))
    # the loader hands restore fresh objects: a deep copy of the state stands for that
    state = copy.deepcopy(noise.__checkpoint_state__())
    direct = OrnsteinUhlenbeckNoise.__checkpoint_restore__(state)
    pickled = pickle.loads(pickle.dumps(noise))
    expected = noise(np.zeros(2))
    np.testing.assert_array_equal(direct(np.zeros(2)), expected)
    np.testing.assert_array_equal(pickled(np.zeros(2)), expected)


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda s: s.pop("rng"), ValueError),
        (lambda s: s.update(extra=1), ValueError),
        (lambda s: s.update(mu=np.nan), ValueError),
        (lambda s: s.update(sigma=-1.0), ValueError),
        (lambda s: s.update(rng=7), TypeError),
        (lambda s: s.update(noise=np.zeros(3)), ValueError),  # sigma has shape (2,)
        (lambda s: s.update(noise=np.array([np.nan, 0.0])), ValueError),
        (lambda s: s.update(noise=np.zeros(2, np.int64)), TypeError),
        (lambda s: s.update(random_seed=1.5), TypeError),
    ],
)
def test_checkpoint_restore_checks_every_field(change, error):
    noise = OrnsteinUhlenbeckNoise(sigma=np.full(2, 0.3), random_seed=3)
    noise(np.zeros(2))
    state = noise.__checkpoint_state__()
    change(state)
    with pytest.raises(error):
        OrnsteinUhlenbeckNoise.__checkpoint_restore__(state)


def test_parameters_set_after_construction_are_checked_on_call():
    # attributes are public (annealing sigma is common), but a value set later was used
    # unchecked: sigma of shape (3, 1) turned a (3,) action into a (3, 3) one, a negative
    # sigma was used as it was
    noise = OrnsteinUhlenbeckNoise(sigma=0.5, random_seed=0)
    first = noise(np.zeros(3))
    noise.sigma *= 0.5  # a valid change keeps working
    assert noise(np.zeros(3)).shape == (3,)
    running, before = noise._noise.copy(), noise._rng.bit_generator.state
    for name, value, match in (
        ("sigma", np.ones((3, 1)), r"\(3, 1\).*\(3,\)"),
        ("mu", np.zeros(2), "broadcast"),
        ("sigma", -1.0, "sigma"),
        ("theta", np.nan, "theta"),
        ("max_value", -10.0, "min_value"),
    ):
        old = getattr(noise, name)
        if name == "max_value":
            noise.min_value = 0.0
        setattr(noise, name, value)
        with pytest.raises(ValueError, match=match):
            noise(np.zeros(3))
        np.testing.assert_array_equal(noise._noise, running)
        assert noise._rng.bit_generator.state == before
        setattr(noise, name, old)
        noise.min_value = None
    assert noise(np.zeros(3)).shape == first.shape


def test_every_accepted_seed_survives_pickle_and_deepcopy():
    # seeds of 2**128 and above were accepted, but the object then failed to pickle, deepcopy
    # or checkpoint (the restore refuses them); they are now refused up front
    with pytest.raises(ValueError, match="random_seed"):
        OrnsteinUhlenbeckNoise(random_seed=2**128)
    with pytest.raises(ValueError, match="random_seed"):
        OrnsteinUhlenbeckNoise(random_seed=-1)
    noise = OrnsteinUhlenbeckNoise(random_seed=2**128 - 1)
    noise(np.zeros(2))
    for other in (pickle.loads(pickle.dumps(noise)), copy.deepcopy(noise)):
        np.testing.assert_array_equal(other(np.zeros(2)), copy.deepcopy(noise)(np.zeros(2)))


def test_parameters_that_overflow_the_action_dtype_are_refused():
    # mu = 1e5 does not fit float16 (max 65504): the host object returned NaN actions and
    # the pure state started from inf, silently
    a16 = np.zeros(2, np.float16)
    noise = OrnsteinUhlenbeckNoise(mu=1e5, random_seed=0)
    with pytest.raises(ValueError, match=r"mu.*float16"):
        noise(a16)
    assert noise._noise is None
    assert np.isfinite(noise(np.zeros(2, np.float32))).all()  # fits float32
    with pytest.raises(ValueError, match=r"sigma.*float16"):
        ou_noise_init(jnp.zeros(2, jnp.float16), sigma=np.array([1.0, 7e4]))
    state = ou_noise_init(jnp.zeros(2, jnp.float16), min_value=-1e9, max_value=1e9)
    assert state.min_value == -jnp.inf  # bounds beyond the dtype: no bound, as before


def test_parameter_arrays_changed_in_place_are_checked_on_call():
    sigma = np.full(3, 0.5)
    noise = OrnsteinUhlenbeckNoise(sigma=sigma, random_seed=0)
    noise(np.zeros(3))
    sigma[1] = -1.0  # the object holds the caller's array
    running, before = noise._noise.copy(), noise._rng.bit_generator.state
    with pytest.raises(ValueError, match="sigma"):
        noise(np.zeros(3))
    np.testing.assert_array_equal(noise._noise, running)
    assert noise._rng.bit_generator.state == before
    sigma[1] = np.nan
    with pytest.raises(ValueError, match="sigma"):
        noise(np.zeros(3))
    sigma[1] = 0.25
    assert noise(np.zeros(3)).shape == (3,)


def test_pure_step_keeps_the_noise_dtype_of_a_replaced_state():
    # a state whose parameters were replaced by arrays of a wider dtype promoted the noise
    # (float16 -> float32) on the first step, so a scan over steps failed on its carry
    state = ou_noise_init(jnp.zeros(3, jnp.float16), sigma=0.1)
    state = state.replace(mu=jnp.full(3, 0.5, jnp.float32), sigma=jnp.float32(0.2))
    a, new = ou_noise_step(jax.random.key(0), jnp.zeros(3, jnp.float16), state)
    assert a.dtype == new.noise.dtype == jnp.float16

    def body(s, key):
        a, s = ou_noise_step(key, jnp.zeros(3, jnp.float16), s)
        return s, a

    _, actions = jax.lax.scan(body, state, jax.random.split(jax.random.key(1), 4))
    assert actions.shape == (4, 3) and actions.dtype == jnp.float16


def test_pure_functions_take_plain_sequences_as_actions():
    # jnp.shape of a list warns (DeprecationWarning: a future JAX error), which the
    # warnings-as-errors test setup turned into a failure of ou_noise_init([0.0, 0.0])
    state = ou_noise_init([0.0, 0.0], sigma=0.1)
    assert state.noise.shape == (2,) and state.noise.dtype == jnp.float32
    a, state = ou_noise_step(jax.random.key(0), [0.5, 0.5], state)
    assert a.shape == (2,)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        ou_noise_step(jax.random.key(0), [0.0, 0.0, 0.0], state)


def test_random_seed_cannot_be_reassigned_silently():
    # random_seed was a plain attribute: setting it (to restart a reproducible stream) did
    # not reseed anything, the numbers went on from the old stream
    noise = OrnsteinUhlenbeckNoise(random_seed=1)
    with pytest.raises(AttributeError, match="random_seed"):
        noise.random_seed = 7
    assert noise.random_seed == 1
    first = noise(np.zeros(2))
    np.testing.assert_array_equal(OrnsteinUhlenbeckNoise(random_seed=1)(np.zeros(2)), first)
