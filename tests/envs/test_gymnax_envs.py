"""The bridges against the real gymnax classic-control envs."""

import warnings

import gymnasium
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from coax_utils.envs import GymnasiumToJax, JaxToGymnasium, step_without_autoreset
from tests.envs._envs import gym_discrete_dtype

CLASSIC = ["CartPole-v1", "Acrobot-v1", "MountainCar-v0", "Pendulum-v1"]
# gymnasium's advice for Pendulum's [-2, 2] action box, not an error of the bridge
ALLOWED = ("we recommend using a symmetric and normalized space",)


@pytest.mark.parametrize("name", CLASSIC)
def test_jax_to_gymnasium_passes_check_env_on_real_gymnax(name):
    env = JaxToGymnasium(*gymnax.make(name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    unexpected = [str(w.message) for w in caught if not any(a in str(w.message) for a in ALLOWED)]
    assert not unexpected, unexpected


@pytest.mark.parametrize("name", ["Pendulum-v1", "MountainCar-v0"])
def test_jax_to_gymnasium_truncates_at_the_time_limit(name):
    genv, params = gymnax.make(name)
    env = JaxToGymnasium(genv, params, seed=0)
    env.reset()
    action = env.action_space.sample() * 0  # never reaches MountainCar's goal
    for t in range(1, params.max_steps_in_episode + 1):
        _, _, terminated, truncated, _ = env.step(action)
        assert not terminated
        assert truncated == (t == params.max_steps_in_episode), t


def test_jax_to_gymnasium_keeps_the_real_terminal_observation_of_cartpole():
    genv, params = gymnax.make("CartPole-v1")
    env = JaxToGymnasium(genv, params, seed=1)
    env.reset()
    for _ in range(500):
        obs, _, terminated, truncated, _ = env.step(1)
        if terminated or truncated:
            break
    assert terminated and not truncated
    assert abs(obs[2]) > params.theta_threshold_radians  # the pole fell: not a reset obs


def test_step_without_autoreset_reads_the_old_discrete_attribute():
    # gymnax releases before 0.0.6 named Discrete's size num_categories; no installed
    # release has it, so this small space stands in for one
    class OldDiscrete:
        num_categories, shape, dtype = 3, (), jnp.int32

    from coax_utils.envs import to_gymnasium_space

    space = to_gymnasium_space(OldDiscrete())
    assert isinstance(space, gymnasium.spaces.Discrete)
    assert (space.n, space.start, space.dtype) == (3, 0, gym_discrete_dtype(np.int32))
    assert to_gymnasium_space(gymnax.make("Acrobot-v1")[0].action_space(None)).n == 3


def _synced(name, state, gym_env):
    """The gymnax ``state`` set to the gymnasium env's current physical state."""
    u = gym_env.unwrapped
    if name == "CartPole-v1":
        x, x_dot, theta, theta_dot = np.asarray(u.state, np.float32)
        state = state.replace(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot)
    else:
        theta, theta_dot = np.asarray(u.state, np.float32)
        state = state.replace(theta=theta, theta_dot=theta_dot)
    return state


@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_gymnasium_bridge_matches_the_gymnax_twin_step_by_step(name):
    gym_env = gymnasium.make(name)
    benv = GymnasiumToJax(gym_env, seed=5)
    rng = np.random.default_rng(0)
    space = benv.action_space(None)
    steps = 200
    if name == "CartPole-v1":
        actions = jnp.asarray(rng.integers(0, 2, steps), jnp.int32)
    else:
        actions = jnp.asarray(rng.uniform(-2, 2, (steps, 1)), jnp.float32)
    assert bool(jax.vmap(space.contains)(actions).all())
    _, bstate = benv.reset(jax.random.key(0))
    genv, params = gymnax.make(name)
    _, gstate = genv.reset(jax.random.key(0), params)
    gstep = jax.jit(lambda s, a: step_without_autoreset(genv, jax.random.key(0), s, a, params))
    bstep = jax.jit(benv.step_env)
    compared = 0
    for t, a in enumerate(actions):
        # step by step: both start each step from the same (float32) state, as gymnax's own
        # tests/classic_control/test_gym_env.py does; the step count carries on
        gstate = _synced(name, gstate, gym_env).replace(time=jnp.int32(t))
        g_obs, gstate, g_rew, g_term, g_trunc, _ = gstep(gstate, a)
        b_obs, bstate, b_rew, b_term, b_trunc, _ = bstep(None, bstate, a)
        np.testing.assert_allclose(b_obs, g_obs, rtol=0, atol=5e-7)
        np.testing.assert_allclose(b_rew, g_rew, rtol=0, atol=3e-6)
        assert bool(b_term) == bool(g_term) and bool(b_trunc) == bool(g_trunc)
        compared += 1
        if b_term or b_trunc:
            break
    assert compared >= 10


def test_jax_to_gymnasium_discrete_observations_are_in_the_space():
    # FrozenLake-misc observes a Discrete(16) of dtype int32: an int64 scalar is not in it
    # (gymnasium before 1.2.2 has int64 Discrete spaces only)
    env = JaxToGymnasium(*gymnax.make("FrozenLake-misc"), seed=0)
    assert env.observation_space.dtype == gym_discrete_dtype(np.int32)
    obs, _ = env.reset()
    assert type(obs) is int  # noqa: E721 (exactly a Python int, as gymnasium's envs give)
    assert env.observation_space.contains(obs)
    obs, *_ = env.step(env.action_space.sample())
    assert env.observation_space.contains(obs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    assert not caught, [str(w.message) for w in caught]


def test_wrapped_gymnax_envs_step_through_their_wrappers():
    # gymnax wrappers forward unknown attributes to the inner env: its step_env skips the
    # wrapper (an unflattened observation, or the inner env fed the wrapper's state)
    from gymnax.wrappers.purerl import FlattenObservationWrapper, LogWrapper

    genv, params = gymnax.make("Breakout-MinAtar")
    env = JaxToGymnasium(FlattenObservationWrapper(genv), params, seed=0)
    obs, _ = env.reset()
    for _ in range(300):
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        assert obs.shape == (400,) and env.observation_space.contains(obs)
        if terminated or truncated:
            break
    assert terminated

    genv, params = gymnax.make("CartPole-v1")
    env = JaxToGymnasium(LogWrapper(genv), params, seed=1)
    env.reset()
    for _ in range(500):
        obs, _, terminated, truncated, info = env.step(1)
        if terminated or truncated:
            break
    assert terminated and not truncated and bool(info["returned_episode"])
    assert abs(obs[2]) > params.theta_threshold_radians  # the terminal obs, not a reset one


def test_gymnax_gymnasium_wrappers_that_reset_themselves_keep_the_last_observation():
    # gymnax's gymnasium wrappers reset an ended episode in the same step and report the
    # last observation in info["final_observation"]: the bridge gave the reset observation
    # as final_obs, and reset the single env a second time
    from gymnax.wrappers.gym import GymnaxToGymWrapper, GymnaxToVectorGymWrapper

    genv, params = gymnax.make("CartPole-v1")
    fell = params.theta_threshold_radians

    benv = GymnasiumToJax(GymnaxToVectorGymWrapper(genv, num_envs=3, seed=0), seed=0)
    _, state = benv.reset(jax.random.key(0))
    for _ in range(100):
        obs, state, _, terminated, _, info = benv.step(None, state, jnp.ones(3, jnp.int32))
        if bool(terminated.any()):
            break
    ended = np.asarray(terminated)
    assert ended.any()
    assert np.all(np.abs(np.asarray(info["final_obs"])[ended, 2]) > fell)
    assert np.all(np.abs(np.asarray(obs)[ended, 2]) <= 0.05)  # reset observations
    np.testing.assert_array_equal(np.asarray(info["final_obs"])[~ended], np.asarray(obs)[~ended])

    oracle = GymnaxToGymWrapper(genv, seed=0)
    oracle.reset(seed=0)
    benv = GymnasiumToJax(GymnaxToGymWrapper(genv, seed=0), seed=0)
    _, state = benv.reset(jax.random.key(0))
    ends = 0
    for _ in range(40):
        obs, state, _, terminated, _, info = benv.step(None, state, jnp.int32(1))
        o_obs, _, o_terminated, _, o_info = oracle.step(1)
        np.testing.assert_array_equal(obs, o_obs)  # one reset per episode, not two
        if o_terminated:
            ends += 1
            assert bool(terminated) and abs(float(info["final_obs"][2])) > fell
            np.testing.assert_array_equal(info["final_obs"], o_info["final_observation"])
    assert ends >= 2
