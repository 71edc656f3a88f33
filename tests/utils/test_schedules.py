"""Tests of StepwiseLinearFunction on Python numbers, NumPy arrays and traced JAX scalars."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils.utils import StepwiseLinearFunction

STEPS = ((0, 1.0), (100, 0.1), (300, 0.01))


def naive(steps, t):
    """Oracle: flat outside, linear interpolation between neighbouring steps."""
    if t <= steps[0][0]:
        return steps[0][1]
    for (t0, v0), (t1, v1) in zip(steps, steps[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return steps[-1][1]


def test_python_numbers_give_floats():
    f = StepwiseLinearFunction(*STEPS)
    assert f(-10) == 1.0 and isinstance(f(-10), float)
    assert f(0) == 1.0
    assert f(50) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1)
    assert f(200) == pytest.approx(0.055)
    assert f(300) == 0.01
    assert f(10**12) == 0.01
    assert f(np.int64(50)) == pytest.approx(0.55)
    assert f(50.5) == pytest.approx(1.0 - 0.9 * 50.5 / 100)


def test_numpy_arrays():
    f = StepwiseLinearFunction(*STEPS)
    t = np.array([-1, 0, 50, 100, 200, 300, 400])
    np.testing.assert_allclose(f(t), [naive(STEPS, x) for x in t])


@settings(max_examples=25, deadline=None)
@given(
    deltas=st.lists(st.integers(1, 1000), min_size=0, max_size=5),
    values=st.lists(st.floats(-10, 10), min_size=6, max_size=6),
    t=st.integers(-100, 5000),
    t0=st.integers(-50, 50),
)
def test_matches_naive_oracle(deltas, values, t, t0):
    ts = list(np.cumsum([t0, *deltas]).tolist())
    steps = tuple(zip(ts, values))
    f = StepwiseLinearFunction(*steps)
    assert f(t) == pytest.approx(naive(steps, t), abs=1e-9)
    assert float(f(jnp.asarray(t))) == pytest.approx(naive(steps, t), abs=1e-4, rel=1e-5)


def test_traced_scalar_under_jit_without_retrace():
    f = StepwiseLinearFunction(*STEPS)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def g(t):
        return f(t)

    for t in [0, 50, 150, 1000]:
        out = g(jnp.int32(t))
        assert out.dtype == jnp.float32
        assert float(out) == pytest.approx(naive(STEPS, t), rel=1e-6)
    grads = jax.grad(lambda t: f(t))(jnp.float32(50.0))
    assert float(grads) == pytest.approx(-0.9 / 100, rel=1e-5)


@pytest.mark.parametrize("kind", ["adam", "scale_by_schedule"])
def test_as_optax_schedule_inside_jit(kind):
    lr = StepwiseLinearFunction((0, 0.1), (2, 0.0))
    if kind == "adam":
        tx = optax.adam(learning_rate=lr)
    else:
        tx = optax.chain(optax.scale_by_schedule(lr), optax.scale(-1.0))
    params = jnp.array(1.0)
    state = tx.init(params)

    @jax.jit
    def update(params, state):
        updates, state = tx.update(jnp.array(1.0), state, params)
        return optax.apply_updates(params, updates), state

    history = []
    for _ in range(4):
        new_params, state = update(params, state)
        history.append(float(params - new_params))
        params = new_params
    # step sizes follow the schedule 0.1, 0.05, 0, 0 (adam's first steps have |update| = lr)
    np.testing.assert_allclose(history, [0.1, 0.05, 0.0, 0.0], rtol=1e-3, atol=1e-6)


def test_single_step_is_constant():
    f = StepwiseLinearFunction((10, 0.3))
    assert f(0) == f(10) == f(99) == 0.3
    assert float(jax.jit(f)(jnp.int32(5))) == pytest.approx(0.3)


@pytest.mark.parametrize(
    "steps",
    [
        (),
        ((10, 1.0), (5, 0.5)),
        ((0, 1.0), (0, 0.5)),
        ((0, 1.0), (float("inf"), 0.5)),
        ((0, float("nan")),),
    ],
)
def test_bad_steps_raise_value_error(steps):
    with pytest.raises(ValueError):
        StepwiseLinearFunction(*steps)


@pytest.mark.parametrize("steps", [((0, 1.0, 2.0),), (0,), (("a", 1.0),), ((True, 1.0),)])
def test_malformed_steps_raise_type_error(steps):
    with pytest.raises(TypeError):
        StepwiseLinearFunction(*steps)


def test_repr_and_steps():
    f = StepwiseLinearFunction((0, 1), (10, 0))
    assert f.steps == ((0, 1.0), (10, 0.0))
    assert "StepwiseLinearFunction" in repr(f)


# -- exact for integer steps; NaN refused --------------------------------------------------


def test_integer_steps_near_1e9_are_exact_under_jit():
    f = StepwiseLinearFunction((10**9, 0.0), (10**9 + 10, 5.0))
    assert float(jax.jit(f)(jnp.int32(10**9 + 5))) == 2.5
    assert float(f(jnp.int32(10**9 + 4))) == 2.0
    assert f(np.array([10**9 + 5], np.int64)).tolist() == [2.5]


@pytest.mark.requires(jax="0.8")
def test_int64_steps_are_exact():
    f = StepwiseLinearFunction((2**50, 0.0), (2**50 + 4, 1.0))
    assert f(np.array([2**50 + 1, 2**50 + 3], np.int64)).tolist() == [0.25, 0.75]
    assert f(2**50 + 2) == 0.5
    with jax.enable_x64(True):
        assert float(jax.jit(f)(jnp.int64(2**50 + 1))) == 0.25


def test_int32_steps_against_breakpoints_beyond_int32():
    f = StepwiseLinearFunction((0.5, 1.0), (2**40, 2.0))
    t = np.array([-(2**31), 0, 1, 2**31 - 1], np.int64)
    expected = [f(int(x)) for x in t]
    np.testing.assert_allclose(f(jnp.asarray(t, jnp.int32)), expected, rtol=1e-7)


def test_nan_step_is_refused():
    f = StepwiseLinearFunction((0, 1.0), (10, 0.0))
    with pytest.raises(ValueError, match="nan"):
        f(float("nan"))
    with pytest.raises(ValueError, match="nan"):
        f(np.array([1.0, np.nan]))


def test_checkpoint_round_trip_and_validation():
    import pickle

    f = StepwiseLinearFunction((0, 1.0), (100, 0.1))
    for g in (StepwiseLinearFunction.__checkpoint_restore__(f.__checkpoint_state__()),
              pickle.loads(pickle.dumps(f))):
        assert g.steps == f.steps and g(50) == f(50)
    for bad, error in [
        ({"steps": [[0, 1.0], [0, 2.0]]}, ValueError),
        ({"steps": [[0, float("nan")]]}, ValueError),
        ({"steps": []}, ValueError),
        ({"steps": [[0, 1.0]], "extra": 1}, ValueError),
        ({"steps": "x"}, TypeError),
        ({"steps": [["a", 1.0]]}, TypeError),
    ]:
        with pytest.raises(error):
            StepwiseLinearFunction.__checkpoint_restore__(bad)


def test_numpy_scalar_steps_compute_like_python_numbers():
    # NumPy scalars as steps were kept as they are: int64 arithmetic on them wrapped around
    # (a 0 -> 1 schedule gave -4.6e18 at its midpoint) and float32 ones lost precision
    lo, hi = -(2**63) + 1, 2**63 - 1
    f = StepwiseLinearFunction((np.int64(lo), 0.0), (np.int64(hi), 1.0))
    assert f(0) == pytest.approx(0.5)
    assert f(np.int64(0)) == pytest.approx(0.5)
    np.testing.assert_allclose(f(np.array([0], np.int64)), [0.5])
    g = StepwiseLinearFunction((np.float32(0.25), 0.0), (np.float32(0.75), 1.0))
    assert g(0.5) == 0.5 and isinstance(g(0.5), float)
    assert all(type(t) in (int, float) for t, _ in f.steps + g.steps)
    assert StepwiseLinearFunction((np.int32(3), np.float32(0.5))).steps == ((3, 0.5),)


def test_uint64_steps_beyond_the_int64_range():
    # the segment reference points went through an int64 array, which raised OverflowError
    # for breakpoints past 2**63 (reachable only by uint64 step counters)
    f = StepwiseLinearFunction((2**63, 0.0), (2**64 - 1, 1.0))
    t = np.array([0, 2**63, 2**63 + 2**62, 2**64 - 1], np.uint64)
    np.testing.assert_allclose(f(t), [0.0, 0.0, 0.5, 1.0])
    assert [f(int(x)) for x in t] == pytest.approx(f(t).tolist())


def test_python_int_steps_beyond_64_bits():
    # Python ints of 65 bits or more were refused with numpy's "ufunc 'isfinite' not
    # supported" TypeError, though ints are exact and the scalar path handles them
    f = StepwiseLinearFunction((-(2**70), 1.0), (0, 0.5), (10**20, 0.0))
    assert f(-(2**69)) == pytest.approx(0.75) and f(5 * 10**19) == pytest.approx(0.25)
    np.testing.assert_allclose(f(np.array([2**63], np.uint64)), [0.5 - 0.5 * 2**63 / 10**20])
    np.testing.assert_allclose(f(jnp.int32(-5)), 0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="finite"):
        StepwiseLinearFunction((0, 1.0), (10**400, 0.0))  # not even a float


def test_steps_cannot_be_replaced_silently():
    # steps was a plain attribute: assigning to it changed the repr and the checkpoint but
    # not the values the function gave
    f = StepwiseLinearFunction((0, 1.0), (10, 0.0))
    with pytest.raises(AttributeError, match="steps"):
        f.steps = ((0, 0.5), (10, 0.5))
    assert f.steps == ((0, 1.0), (10, 0.0)) and f(5) == 0.5
