"""GymnasiumToJax vs stepping gymnasium directly; JaxToGymnasium under gymnasium's check_env."""

import warnings

import gymnasium
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.utils.passive_env_checker import env_render_passive_checker
from packaging.version import Version

from coax_utils import envs
from coax_utils.envs import GymnasiumState, GymnasiumToJax, JaxToGymnasium
from tests.envs._envs import DriftEnv, LineEnv, make_drift_env

INFINITE_BOUND_WARNINGS = ("minimum value is -infinity", "maximum value is infinity")


def oracle_rollout(env, seed, actions):
    """Step a gymnasium env directly, resetting at episode ends (what the bridge does)."""
    first, _ = env.reset(seed=seed)
    rows = []
    for a in actions:
        obs, reward, terminated, truncated, _ = env.step(a)
        final = obs
        if terminated or truncated:
            obs, _ = env.reset()
        rows.append((obs, np.float32(reward), terminated, truncated, final))
    return first, rows


def bridge_rollout(benv, actions, key=None):
    """The same rollout through the bridge, in one jitted lax.scan."""
    params = benv.default_params

    @jax.jit
    def run(key, actions):
        obs, state = benv.reset(key, params)

        def body(state, a):
            obs, state, reward, terminated, truncated, info = benv.step(key, state, a, params)
            return state, (obs, reward, terminated, truncated, info["final_obs"])

        return obs, jax.lax.scan(body, state, actions)[1]

    key = jax.random.key(0) if key is None else key
    return jax.tree_util.tree_map(np.asarray, run(key, jnp.asarray(actions)))


def assert_rollouts_equal(first, rows, bridged):
    b_first, (b_obs, b_rew, b_term, b_trunc, b_final) = bridged
    jax.tree_util.tree_map(np.testing.assert_array_equal, b_first, _np(first))
    for t, (obs, reward, terminated, truncated, final) in enumerate(rows):
        at_t = lambda tree, t=t: jax.tree_util.tree_map(lambda x: x[t], tree)  # noqa: E731
        jax.tree_util.tree_map(np.testing.assert_array_equal, at_t(b_obs), _np(obs))
        jax.tree_util.tree_map(np.testing.assert_array_equal, at_t(b_final), _np(final))
        assert b_rew[t] == reward, t
        assert bool(b_term[t]) == terminated and bool(b_trunc[t]) == truncated, t


def _np(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def test_cartpole_in_jitted_scan_matches_gymnasium():
    actions = np.random.default_rng(0).integers(0, 2, size=120)
    first, rows = oracle_rollout(gymnasium.make("CartPole-v1"), 3, actions)
    assert sum(r[2] for r in rows) >= 2  # several episodes, so autoreset is exercised
    bridged = bridge_rollout(GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=3), actions)
    assert_rollouts_equal(first, rows, bridged)


def test_custom_env_with_dict_obs_and_truncation_matches_gymnasium():
    actions = np.random.default_rng(1).integers(0, 4, size=60)
    first, rows = oracle_rollout(make_drift_env(), 11, actions)
    assert any(r[2] for r in rows) and any(r[3] for r in rows)  # both kinds of episode end
    benv = GymnasiumToJax(make_drift_env(), seed=11)
    assert isinstance(benv.observation_space(benv.default_params), envs.Dict)
    assert_rollouts_equal(first, rows, bridge_rollout(benv, actions))


def test_info_keeps_declared_keys_and_drops_the_rest():
    spec = {"noise": jax.ShapeDtypeStruct((), jnp.float32)}
    benv = GymnasiumToJax(make_drift_env(), seed=5, info_spec=spec)
    oracle = make_drift_env()
    oracle.reset(seed=5)
    obs, state = benv.reset(jax.random.key(0))
    for a in [0, 2, 1]:
        obs, state, _, _, _, info = benv.step(jax.random.key(0), state, jnp.int32(a))
        _, _, _, _, o_info = oracle.step(a)
        assert set(info) == {"final_obs", "noise"}  # "trail" has no fixed shape: dropped
        assert info["noise"].dtype == jnp.float32
        np.testing.assert_array_equal(info["noise"], o_info["noise"])

    bad = GymnasiumToJax(
        make_drift_env(), seed=5, info_spec={"noise": jax.ShapeDtypeStruct((3,), jnp.float32)}
    )
    _, state = bad.reset(jax.random.key(0))
    with pytest.raises(Exception, match=r"info\['noise'\] has shape \(\)"):
        jax.block_until_ready(bad.step(jax.random.key(0), state, jnp.int32(0)))


def test_seed_rules():
    # with a seed: the first reset is env.reset(seed=seed), later ones continue the stream
    oracle = gymnasium.make("CartPole-v1")
    expected = [oracle.reset(seed=7)[0], oracle.reset()[0]]
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=7)
    reset = jax.jit(benv.reset)
    got = [reset(jax.random.key(i), benv.default_params)[0] for i in (1, 2)]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))

    # without a seed: the key decides
    def first_obs(key):
        return np.asarray(GymnasiumToJax(gymnasium.make("CartPole-v1")).reset(key)[0])

    np.testing.assert_array_equal(first_obs(jax.random.key(4)), first_obs(jax.random.key(4)))
    assert not np.array_equal(first_obs(jax.random.key(4)), first_obs(jax.random.key(5)))


def _make_cartpole():
    return gymnasium.make("CartPole-v1")


@pytest.mark.parametrize(
    "mode",
    [
        "next_step",  # gymnasium's default, the only mode before 1.1
        pytest.param("same_step", marks=pytest.mark.requires(gymnasium="1.1")),
    ],
)
def test_sync_vector_env_gives_batched_steps_with_autoreset(mode):
    def make():
        if mode == "next_step":
            return gymnasium.vector.SyncVectorEnv([_make_cartpole] * 3)
        autoreset = gymnasium.vector.AutoresetMode.SAME_STEP
        return gymnasium.vector.SyncVectorEnv([_make_cartpole] * 3, autoreset_mode=autoreset)

    actions = np.random.default_rng(2).integers(0, 2, size=(80, 3))
    oracle = make()
    first, _ = oracle.reset(seed=21)
    rows = []
    for a in actions:
        obs, reward, terminated, truncated, info = oracle.step(a)
        final = obs.copy()
        if mode == "same_step" and "_final_obs" in info:
            for i in np.flatnonzero(info["_final_obs"]):
                final[i] = info["final_obs"][i]
        rows.append((obs, reward.astype(np.float32), terminated, truncated, final))

    benv = GymnasiumToJax(make(), seed=21)
    assert benv.num_envs == 3
    b_first, (b_obs, b_rew, b_term, b_trunc, b_final) = bridge_rollout(benv, actions)
    assert b_obs.shape == (80, 3, 4) and b_rew.shape == b_term.shape == (80, 3)
    assert b_term.sum() >= 3  # sub-envs did finish episodes and were reset
    np.testing.assert_array_equal(b_first, first)
    np.testing.assert_array_equal(b_obs, np.stack([r[0] for r in rows]))
    np.testing.assert_array_equal(b_rew, np.stack([r[1] for r in rows]))
    np.testing.assert_array_equal(b_term, np.stack([r[2] for r in rows]))
    np.testing.assert_array_equal(b_trunc, np.stack([r[3] for r in rows]))
    np.testing.assert_array_equal(b_final, np.stack([r[4] for r in rows]))
    if mode == "same_step":  # the final observations differ from the reset ones
        assert not np.array_equal(b_final, b_obs)


def test_a_declared_autoreset_mode_needs_gymnasium_1_1():
    env = gymnasium.vector.SyncVectorEnv([_make_cartpole] * 2)
    env.metadata = {**env.metadata, "autoreset_mode": "Disabled"}
    if Version(gymnasium.__version__) >= Version("1.1"):
        assert GymnasiumToJax(env, seed=0).num_envs == 2  # read as gymnasium reads it
    else:  # every vector env resets on the next step there: the mode is not misread
        with pytest.raises(ValueError, match="autoreset_mode 'Disabled'.*gymnasium 1.1"):
            GymnasiumToJax(env, seed=0)


@pytest.mark.requires(gymnasium="1.1")  # gymnasium.vector.AutoresetMode
def test_vector_env_without_autoreset_is_reset_by_the_bridge():
    # with autoreset_mode DISABLED the sub-envs never reset themselves: stepping on after an
    # end failed on gymnasium's assert, or (python -O) went on past the end of the episode
    def make():
        return gymnasium.vector.SyncVectorEnv(
            [_make_cartpole] * 2, autoreset_mode=gymnasium.vector.AutoresetMode.DISABLED
        )

    actions = np.ones((60, 2), np.int64)
    oracle = make()
    first, _ = oracle.reset(seed=4)
    rows = []
    for a in actions:
        obs, reward, terminated, truncated, _ = oracle.step(a)
        final, done = obs, terminated | truncated
        if done.any():
            obs, _ = oracle.reset(options={"reset_mask": done})
        rows.append((obs, reward.astype(np.float32), terminated, truncated, final))
    assert sum(r[2].sum() for r in rows) >= 4
    benv = GymnasiumToJax(make(), seed=4)
    b_first, (b_obs, b_rew, b_term, b_trunc, b_final) = bridge_rollout(benv, actions)
    np.testing.assert_array_equal(b_first, first)
    for got, i in ((b_obs, 0), (b_rew, 1), (b_term, 2), (b_trunc, 3), (b_final, 4)):
        np.testing.assert_array_equal(got, np.stack([r[i] for r in rows]))
    assert np.abs(b_obs[..., 2]).max() < 0.2095  # every observation is within an episode

    _, state = benv.reset(jax.random.key(0))
    step_env = jax.jit(benv.step_env)
    for _ in range(60):
        _, state, _, terminated, truncated, _ = step_env(None, state, jnp.ones(2, jnp.int32))
        if bool((terminated | truncated).any()):
            break
    with pytest.raises(Exception, match="episode ended"):
        jax.block_until_ready(step_env(None, state, jnp.ones(2, jnp.int32)))


def test_async_vector_env_matches_the_sync_one():
    actions = np.random.default_rng(3).integers(0, 2, size=(30, 2))
    sync = GymnasiumToJax(gymnasium.vector.SyncVectorEnv([_make_cartpole] * 2), seed=8)
    # spawn, not fork: forking a process that runs JAX threads is unsafe
    async_env = gymnasium.vector.AsyncVectorEnv([_make_cartpole] * 2, context="spawn")
    try:
        bridged = bridge_rollout(GymnasiumToJax(async_env, seed=8), actions)
    finally:
        async_env.close()
    expected = bridge_rollout(sync, actions)
    jax.tree_util.tree_map(np.testing.assert_array_equal, bridged, expected)


def _vmap_over_a_single_env(match):
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    keys = jax.random.split(jax.random.key(0), 4)
    with pytest.raises(ValueError, match=match):
        jax.vmap(benv.reset)(keys)
    _, state = benv.reset(keys[0])
    with pytest.raises(ValueError, match=match):
        jax.jit(jax.vmap(lambda a: benv.step(keys[0], state, a)))(jnp.zeros(4, jnp.int32))
    # nothing ran: the env is still at the state of that reset
    _, _, reward, *_ = jax.jit(benv.step)(None, state, 1)
    assert float(reward) == 1.0


def test_vmap_over_a_single_env_raises():
    _vmap_over_a_single_env("(?i)cannot (be |`)vmap")  # before jax 0.8.2 in jax's own words


@pytest.mark.requires(jax="0.8.2")  # the bridge's own guard: custom_vmap keeps the effect
def test_vmap_over_a_single_env_raises_naming_the_alternative():
    _vmap_over_a_single_env("cannot be vmapped.*gymnasium vector env")


def test_stale_state_and_out_of_order_calls_raise_without_side_effects():
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    oracle = gymnasium.make("CartPole-v1")
    oracle.reset(seed=0)
    step = jax.jit(benv.step)
    key = jax.random.key(0)

    with pytest.raises(Exception, match="before reset"):
        jax.block_until_ready(step(key, GymnasiumState(counter=jnp.uint32(0)), jnp.int32(0)))

    _, s0 = benv.reset(key)
    obs1, s1, *_ = step(key, s0, jnp.int32(1))
    with pytest.raises(Exception, match="stale state"):
        jax.block_until_ready(step(key, s0, jnp.int32(1)))  # s0 was already stepped
    # the refused call changed nothing: s1 still continues the episode
    obs2, s2, *_ = step(key, s1, jnp.int32(0))
    np.testing.assert_array_equal(obs1, oracle.step(1)[0])
    np.testing.assert_array_equal(obs2, oracle.step(0)[0])


def test_a_state_of_another_bridge_is_refused():
    # a train and an eval env: after one reset each, both states had the same call counter,
    # so eval.step(train_state) stepped the eval env as if nothing were wrong
    train = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    evaluation = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=1)
    _, train_state = train.reset(jax.random.key(0))
    obs, eval_state = evaluation.reset(jax.random.key(0))
    with pytest.raises(Exception, match="stale state"):
        jax.block_until_ready(evaluation.step(None, train_state, jnp.int32(1)))
    oracle = gymnasium.make("CartPole-v1")
    np.testing.assert_array_equal(obs, oracle.reset(seed=1)[0])
    obs, *_ = evaluation.step(None, eval_state, jnp.int32(1))  # the refusal stepped nothing
    np.testing.assert_array_equal(obs, oracle.step(1)[0])


def test_step_env_does_not_autoreset_and_refuses_to_continue():
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    _, state = benv.reset(jax.random.key(0))
    step_env = jax.jit(benv.step_env)
    terminated = False
    for _ in range(500):
        obs, state, _, terminated, truncated, info = step_env(None, state, jnp.int32(1))
        if terminated or truncated:
            break
    assert bool(terminated)
    np.testing.assert_array_equal(obs, info["final_obs"])  # the terminal observation
    assert abs(float(obs[2])) > 0.2094  # the pole fell: this is not a reset observation
    with pytest.raises(Exception, match="episode ended"):
        jax.block_until_ready(step_env(None, state, jnp.int32(1)))
    obs, state = benv.reset(jax.random.key(1))
    assert abs(float(obs[2])) < 0.05


def test_bad_actions_and_arguments():
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    _, state = benv.reset(jax.random.key(0))
    with pytest.raises(ValueError, match="shape"):
        benv.step(None, state, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="structure"):
        benv.step(None, state, {"a": 0})
    with pytest.raises(ValueError, match="seed"):
        GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=-1)
    with pytest.raises(TypeError, match="gymnasium env"):
        GymnasiumToJax(object())


def test_jitted_step_does_not_retrace():
    traces = []
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)

    @jax.jit
    def step(state, action):
        traces.append(1)
        return benv.step(None, state, action)

    _, state = benv.reset(jax.random.key(0))
    for a in [0, 1, 0]:
        _, state, *_ = step(state, jnp.int32(a))
    assert len(traces) == 1


def _check_env_quietly(env, allowed=()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    messages = [str(w.message) for w in caught]
    unexpected = [m for m in messages if not any(a in m for a in allowed)]
    assert not unexpected, unexpected


@pytest.mark.parametrize("api", ["new", "old"])
def test_jax_to_gymnasium_passes_check_env(api):
    env = JaxToGymnasium(LineEnv(api), render_mode="rgb_array")
    assert env.observation_space == gymnasium.spaces.Box(-5.0, 5.0, (2,), np.float32)
    assert env.action_space == gymnasium.spaces.Discrete(4)
    _check_env_quietly(env)
    env.reset(seed=0)
    frame = env_render_passive_checker(env)
    assert frame.shape == (8, 8, 3) and frame.dtype == np.uint8


@pytest.mark.parametrize("api", ["new", "old"])
def test_jax_to_gymnasium_returns_the_real_terminal_observation(api):
    env = JaxToGymnasium(LineEnv(api), seed=3)
    obs, _ = env.reset()
    ends = 0
    for t in range(400):
        obs, reward, terminated, truncated, info = env.step(t % 2 * 2)  # drifts up and right
        if terminated:
            # the observation of the terminal state (outside the square), not a reset one
            assert np.abs(obs).max() > 3.0
            assert reward == pytest.approx(-np.abs(obs).sum(), rel=1e-6)
            ends += 1
        if terminated or truncated:
            obs, _ = env.reset()
            assert np.abs(obs).max() <= 1.0
    assert ends >= 3


def test_jax_to_gymnasium_seeding_and_errors():
    a, b = JaxToGymnasium(LineEnv(), seed=5), JaxToGymnasium(LineEnv(), seed=5)
    np.testing.assert_array_equal(a.reset()[0], b.reset()[0])  # constructor seed
    np.testing.assert_array_equal(a.reset(seed=1)[0], b.reset(seed=1)[0])
    assert not np.array_equal(a.reset(seed=1)[0], a.reset(seed=2)[0])
    with pytest.raises(ValueError, match="before reset"):
        JaxToGymnasium(LineEnv()).step(0)
    with pytest.raises(ValueError, match="not an element"):
        a.step(7)
    with pytest.raises(ValueError, match="render"):
        JaxToGymnasium(DriftEnvWithoutRender(), render_mode="rgb_array")


class LineEnvWithFloatFrames(LineEnv):
    def render(self, state, params):  # colours in [0, 1], as many JAX renderers draw
        return super().render(state, params) / 255.0


def test_jax_to_gymnasium_refuses_frames_it_cannot_give_as_uint8():
    # a float frame in [0, 1] was cast to uint8 as it was: a black frame, and no error
    env = JaxToGymnasium(LineEnvWithFloatFrames(), seed=0, render_mode="rgb_array")
    env.reset()
    with pytest.raises(TypeError, match="float"):
        env.render()
    frame = JaxToGymnasium(LineEnv(), seed=0, render_mode="rgb_array")
    frame.reset()
    assert frame.render().max() == 255  # uint8 frames come through as they are


def test_the_constructor_seed_survives_a_look_at_np_random():
    # reading np_random or np_random_seed (gymnasium's public properties) before the first
    # reset made gymnasium seed the env at random, and the constructor seed was then ignored
    def make():
        return JaxToGymnasium(*gymnax.make("CartPole-v1"), seed=5)

    expected = make().reset()[0]
    env = make()
    assert env.np_random_seed != 5  # gymnasium's random seed, until the first reset
    np.testing.assert_array_equal(env.reset()[0], expected)
    assert env.np_random_seed == 5
    vec = gymnasium.vector.SyncVectorEnv([make])
    assert len(vec.np_random) == 1  # asks every sub-env
    np.testing.assert_array_equal(vec.reset()[0][0], expected)


class DriftEnvWithoutRender(LineEnv):
    render = None


def test_round_trip_of_both_bridges_passes_check_env():
    # gymnasium -> JAX -> gymnasium: the outer env steps through io_callback inside jit
    env = JaxToGymnasium(GymnasiumToJax(gymnasium.make("CartPole-v1")))
    _check_env_quietly(env, allowed=INFINITE_BOUND_WARNINGS)
    env.reset(seed=0)
    for _ in range(500):
        obs, _, terminated, truncated, _ = env.step(1)
        if terminated or truncated:
            break
    assert terminated and abs(obs[2]) > 0.2094  # step_env kept the terminal observation


def test_closing_the_round_trip_closes_the_gymnasium_env():
    # JaxToGymnasium.close was gymnasium.Env's no-op: the wrapped env stayed open
    inner = gymnasium.make("CartPole-v1", render_mode="rgb_array")
    env = JaxToGymnasium(GymnasiumToJax(inner, seed=0))
    env.reset()
    inner.render()  # opens CartPole's pygame surface
    assert inner.unwrapped.isopen
    env.close()
    assert not inner.unwrapped.isopen
    JaxToGymnasium(LineEnv()).close()  # a JAX env without close: nothing to close


def test_bridged_jax_env_matches_the_jax_env():
    # JAX -> gymnasium -> JAX, compared with a gymnasium-level rollout of the same env
    actions = np.random.default_rng(4).integers(0, 4, size=50)
    first, rows = oracle_rollout(JaxToGymnasium(LineEnv()), 9, actions)
    assert any(r[2] for r in rows)
    bridged = bridge_rollout(GymnasiumToJax(JaxToGymnasium(LineEnv()), seed=9), actions)
    assert_rollouts_equal(first, rows, bridged)


def test_a_drift_env_instance_is_a_valid_gymnasium_env():
    # the custom env used above is itself well-formed
    _check_env_quietly(DriftEnv())


def test_jax_to_gymnasium_does_not_retrace():
    traces = []

    class Counted(LineEnv):
        def step_env(self, *args):
            traces.append(1)
            return super().step_env(*args)

    env = JaxToGymnasium(Counted(), seed=0)
    env.reset()
    for a in [0, np.int64(1), 2, np.int32(3)]:
        env.step(a)
    env.reset(seed=1)
    env.step(1)
    assert len(traces) == 1


def test_observations_that_do_not_fit_the_space_raise_clearly():
    class WrongShape(DriftEnv):
        def reset(self, *, seed=None, options=None):
            obs, info = super().reset(seed=seed)
            obs["pos"] = np.zeros(3, np.float32)
            return obs, info

    class WrongStructure(DriftEnv):
        def reset(self, *, seed=None, options=None):
            return np.zeros(2, np.float32), {}

    with pytest.raises(Exception, match=r"of shape \(3,\), but its observation space"):
        jax.block_until_ready(GymnasiumToJax(WrongShape(), seed=0).reset(jax.random.key(0)))
    with pytest.raises(Exception, match="does not have the structure of its observation space"):
        jax.block_until_ready(GymnasiumToJax(WrongStructure(), seed=0).reset(jax.random.key(0)))


@pytest.mark.parametrize(
    "scale, match",
    [(lambda s: s / 15.0, "float64"), (lambda s: np.int64(s) + 2**32, "range")],
    ids=["float", "wide-int"],
)
def test_observations_that_an_integer_space_cannot_hold_are_refused(scale, match):
    # a FrozenLake whose observations were rescaled without updating its Discrete(16)
    # space: the floats were truncated (every state but the goal became 0) and the wide
    # ints wrapped around in 32 bits, both silently
    env = gymnasium.wrappers.TransformObservation(
        gymnasium.make("FrozenLake-v1"), scale, gymnasium.make("FrozenLake-v1").observation_space
    )
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(GymnasiumToJax(env, seed=0).reset(jax.random.key(0)))


def test_a_float_seed_is_refused():
    with pytest.raises(TypeError, match="3.0"):
        GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=3.0)


def test_a_float_action_for_a_discrete_space_is_refused():
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    _, state = benv.reset(jax.random.key(0))
    with pytest.raises(TypeError, match="float32"):
        benv.step(None, state, jnp.float32(0.9))


@pytest.mark.parametrize(
    "action", [np.int64(2**32 + 1), np.uint64(2**32 + 1), 2**32 + 1], ids=repr
)
def test_a_64_bit_action_that_wraps_in_32_bits_is_refused(action):
    # without x64 the NumPy int64 2**32 + 1 became the int32 1, and CartPole was pushed right
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    _, state = benv.reset(jax.random.key(0))
    with pytest.raises(ValueError, match="range"):
        benv.step(None, state, action)
    oracle = gymnasium.make("CartPole-v1")
    oracle.reset(seed=0)
    obs, *_ = benv.step(None, state, 0)  # nothing was stepped
    np.testing.assert_array_equal(obs, oracle.step(0)[0])


def test_an_out_of_range_action_raises_the_bridge_error_and_steps_nothing():
    benv = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    oracle = gymnasium.make("CartPole-v1")
    oracle.reset(seed=0)
    _, state = benv.reset(jax.random.key(0))
    step = jax.jit(benv.step)
    with pytest.raises(Exception, match="not an element of the action space") as info:
        jax.block_until_ready(step(None, state, jnp.int32(5)))
    assert "AssertionError" not in str(info.value)
    obs, *_ = step(None, state, jnp.int32(1))  # the refused call changed nothing
    np.testing.assert_array_equal(obs, oracle.step(1)[0])


def test_a_step_whose_result_cannot_be_converted_needs_a_reset():
    class BadSecondStep(DriftEnv):
        """Returns an observation of the wrong shape on the second step of an episode."""

        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            self.steps_taken = getattr(self, "steps_taken", 0) + 1
            if self._t == 2:
                obs["pos"] = np.zeros(3, np.float32)
            return obs, reward, terminated, truncated, info

    env = BadSecondStep()
    benv = GymnasiumToJax(env, seed=0)
    step = jax.jit(benv.step)
    _, state = benv.reset(jax.random.key(0))
    _, state, *_ = step(None, state, jnp.int32(0))
    with pytest.raises(Exception, match="observation space"):
        jax.block_until_ready(step(None, state, jnp.int32(0)))
    assert env.steps_taken == 2
    # the env moved on: a retry with the same state would silently skip the failed step
    with pytest.raises(Exception, match="could not be converted"):
        jax.block_until_ready(step(None, state, jnp.int32(0)))
    assert env.steps_taken == 2
    obs, state = benv.reset(jax.random.key(1))
    obs, state, *_ = step(None, state, jnp.int32(1))
    assert env.steps_taken == 3 and int(obs["steps"]) == 1


@pytest.mark.parametrize(
    "space",
    [
        gymnasium.spaces.Box(0, 2**40, (1,), np.int64),
        gymnasium.spaces.Discrete(2**40),
        gymnasium.spaces.Box(0, 2**63, (1,), np.uint64),
        gymnasium.spaces.Dict({"a": gymnasium.spaces.MultiDiscrete([3], start=[2**35])}),
    ],
)
def test_integer_observations_beyond_what_jax_holds_are_refused(space):
    class Wide(gymnasium.Env):
        observation_space = space
        action_space = gymnasium.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return self.observation_space.sample(), {}

        def step(self, action):
            return self.observation_space.sample(), 0.0, False, False, {}

    if jax.config.jax_enable_x64:  # 64-bit values are kept
        GymnasiumToJax(Wide(), seed=0)
        return
    # an observation of 2**33 + 7 would arrive as 7
    with pytest.raises(ValueError, match="observation space.*jax_enable_x64"):
        GymnasiumToJax(Wide(), seed=0)


def test_integer_observations_within_32_bits_are_accepted():
    space = gymnasium.spaces.Box(-(2**31), 2**31 - 1, (2,), np.int64)

    class Fits(gymnasium.Env):
        observation_space = space
        action_space = gymnasium.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return np.array([-(2**31), 2**31 - 1], np.int64), {}

    obs, _ = GymnasiumToJax(Fits(), seed=0).reset(jax.random.key(0))
    np.testing.assert_array_equal(obs, [-(2**31), 2**31 - 1])


def test_a_reset_whose_observation_cannot_be_converted_needs_a_reset():
    class BadSecondReset(DriftEnv):
        def reset(self, *, seed=None, options=None):
            obs, info = super().reset(seed=seed)
            self.resets = getattr(self, "resets", 0) + 1
            if self.resets == 2:
                obs["pos"] = np.zeros(3, np.float32)
            return obs, info

    env = BadSecondReset()
    benv = GymnasiumToJax(env, seed=0)
    step = jax.jit(benv.step)
    _, state = benv.reset(jax.random.key(0))
    _, state, *_ = step(None, state, jnp.int32(0))
    with pytest.raises(Exception, match="observation space"):
        jax.block_until_ready(benv.reset(jax.random.key(1)))
    # the env was reset: stepping the old episode's state would continue the new episode
    with pytest.raises(Exception, match="could not be converted"):
        jax.block_until_ready(step(None, state, jnp.int32(0)))
    obs, state = benv.reset(jax.random.key(2))
    assert env.resets == 3 and int(obs["steps"]) == 0
    obs, state, *_ = step(None, state, jnp.int32(0))
    assert int(obs["steps"]) == 1
