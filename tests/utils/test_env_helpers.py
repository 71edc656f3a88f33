"""Env helpers of coax_utils.utils: wrapper attributes, sampling, preprocessors, dummy
transitions, render_episode and make_dmc (really stepping and rendering a dm_control task)."""

import os
import sys

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils import utils
from coax_utils.replay import TransitionBatch

gs = gymnasium.spaces


class Inner(gymnasium.Env):
    observation_space = gs.Discrete(3)
    action_space = gs.Discrete(2)
    inner_only = "inner"
    shared = "inner"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        return 0, 0.0, True, False, {}


class Tagged(gymnasium.Wrapper):
    shared = "outer"


# -- get_env_attr / has_env_attr ---------------------------------------------------------


def test_env_attr_walks_wrappers_from_the_outside_in():
    env = gymnasium.wrappers.TimeLimit(Tagged(gymnasium.wrappers.OrderEnforcing(Inner())), 5)
    assert utils.has_env_attr(env, "inner_only")
    assert utils.get_env_attr(env, "inner_only") == "inner"
    assert utils.get_env_attr(env, "shared") == "outer"  # the outermost one wins
    assert utils.get_env_attr(env, "_max_episode_steps") == 5
    assert not utils.has_env_attr(env, "inner_only", max_depth=3)  # Inner is 4 levels down
    assert utils.get_env_attr(env, "inner_only", default=None, max_depth=3) is None
    assert utils.has_env_attr(env, "inner_only", max_depth=4)


def test_get_env_attr_missing_raises_attribute_error_unless_default():
    env = gymnasium.make("CartPole-v1")
    with pytest.raises(AttributeError, match="no_such_attribute"):
        utils.get_env_attr(env, "no_such_attribute")
    assert utils.get_env_attr(env, "no_such_attribute", default=0) == 0
    assert utils.get_env_attr(env, "tau") == pytest.approx(0.02)  # CartPole's own attribute
    with pytest.raises(ValueError, match="max_depth"):
        utils.has_env_attr(env, "tau", max_depth=0)


# -- safe_sample ---------------------------------------------------------------------------

SPACES = [
    gs.Box(-1.0, 1.0, (3,), np.float32),
    gs.Box(5.0, 10.0, (2,), np.float64),
    gs.Box(-np.inf, np.inf, (4,), np.float32),
    gs.Box(np.array([0.0, -np.inf], np.float32), np.array([np.inf, 2.0], np.float32)),
    gs.Box(-1e30, 1e30, (3,), np.float32),
    gs.Box(0, 255, (2, 2, 3), np.uint8),
    gs.Discrete(4, start=-2),
    gs.MultiDiscrete([[3, 2], [5, 1]], start=[[0, 1], [2, -3]]),
    gs.MultiBinary([2, 3]),
    gs.Tuple([gs.Discrete(2), gs.Box(0.0, 1.0, (1,), np.float32)]),
    gs.Dict({"b": gs.Discrete(2), "a": gs.MultiBinary(2)}),
    gs.Text(4),
]


@pytest.mark.parametrize("space", SPACES, ids=repr)
def test_safe_sample_returns_members_reproducibly(space):
    rng_state = space.np_random.bit_generator.state
    xs = [utils.safe_sample(space, seed=s) for s in range(30)]
    for x in xs:
        assert space.contains(x), x
    again = utils.safe_sample(space, seed=3)
    jax.tree_util.tree_map(np.testing.assert_array_equal, again, xs[3])
    assert space.np_random.bit_generator.state == rng_state  # the space's RNG is untouched
    if isinstance(space, gs.Box) and np.issubdtype(space.dtype, np.floating):
        assert np.abs(np.stack(xs)).max() < 50  # no huge numbers, even for unbounded boxes


def test_safe_sample_integer_boxes_stay_small_unless_narrow():
    # unbounded or very wide integer boxes were sampled uniformly over their whole range
    # (values of order 1e18 for Box(-inf, inf, dtype=int64)), unlike float boxes
    cases = [
        (gs.Box(-np.inf, np.inf, (50,), np.int64), lambda x: np.abs(x).max() < 50),
        (gs.Box(-3, np.inf, (50,), np.int64), lambda x: (x >= -3).all() and x.max() < 50),
        (gs.Box(0, 2**64 - 1, (50,), np.uint64), lambda x: x.max() < 50),
        (gs.Box(-(2**31), 7, (50,), np.int32), lambda x: x.min() > -50 and (x <= 7).all()),
        (gs.Box(2**62, 2**63 - 1, (50,), np.int64), lambda x: (x - 2**62 < 50).all()),
        (gs.Box(-(2**63), -(2**62), (50,), np.int64), lambda x: (-(2**62) - x < 50).all()),
    ]
    for space, small in cases:
        xs = [utils.safe_sample(space, seed=s) for s in range(10)]
        for x in xs:
            assert space.contains(x) and small(x), (space, x)
        np.testing.assert_array_equal(utils.safe_sample(space, seed=4), xs[4])
    # narrow boxes (width below 1e6) are still sampled uniformly, wherever they lie
    far = gs.Box(2**64 - 4, 2**64 - 1, (200,), np.uint64)
    x = utils.safe_sample(far, seed=0)
    assert far.contains(x) and {int(v) for v in x} == {2**64 - 4, 2**64 - 3, 2**64 - 2, 2**64 - 1}
    full = gs.Box(-128, 127, (4000,), np.int8)
    assert len(set(utils.safe_sample(full, seed=1).tolist())) == 256


def test_safe_sample_narrow_float_boxes_far_from_zero_are_not_constant():
    # a bound beyond 1e6 was dropped even when the box was narrow, so Box(2e6, 2e6 + 10)
    # gave the standard normal clipped to its low bound: 2e6 in every sample
    for space in (
        gs.Box(2e6, 2e6 + 10, (50,), np.float32),
        gs.Box(-1e7 - 1, -1e7, (50,), np.float64),
    ):
        x = utils.safe_sample(space, seed=0)
        assert space.contains(x) and len(np.unique(x)) > 20, x  # float32: steps of 0.25
        np.testing.assert_array_equal(utils.safe_sample(space, seed=0), x)


def test_safe_sample_wide_boxes_away_from_zero_start_from_their_near_bound():
    # a wide box whose bounds both lay beyond 1e6 on one side of zero had both dropped, so
    # the normal clipped into it gave the same bound in every sample
    for space, near in (
        (gs.Box(2e6, 1e9, (50,), np.float64), 2e6),
        (gs.Box(-np.inf, -3e6, (50,), np.float32), -3e6),
        (gs.Box(2**40, 2**50, (50,), np.int64), 2**40),
        (gs.Box(-(2**50), -(2**40), (50,), np.int64), -(2**40)),
    ):
        x = utils.safe_sample(space, seed=0)
        assert space.contains(x) and len(np.unique(x)) > 1, x
        assert (np.abs(x.astype(np.float64) - near) < 50).all(), x
    # both bounds infinite on one side: inf - inf gives no warning (errors in this setup)
    degenerate = gs.Box(np.array([np.inf, 0.0], np.float32), np.array([np.inf, 1.0], np.float32))
    assert utils.safe_sample(degenerate, seed=0)[0] == np.inf


def test_safe_sample_covers_discrete_ranges():
    space = gs.Discrete(4, start=-2)
    assert {int(utils.safe_sample(space, s)) for s in range(100)} == {-2, -1, 0, 1}
    with pytest.raises(TypeError, match="gymnasium.Space"):
        utils.safe_sample([1, 2])
    with pytest.raises(TypeError, match="seed"):
        utils.safe_sample(space, seed="x")


# -- default_preprocessor / check_preprocessors ---------------------------------------------


def test_default_preprocessor_per_space_kind():
    key = jax.random.key(0)
    box = utils.default_preprocessor(gs.Box(-1.0, 1.0, (2,), np.float32))
    np.testing.assert_array_equal(box(key, [0.5, 3.0]), [[0.5, 1.0]])  # batch axis, clipped
    assert box(key, np.zeros((5, 2))).shape == (5, 2)

    disc = utils.default_preprocessor(gs.Discrete(3, start=1))
    np.testing.assert_array_equal(disc(key, 3), [[0, 0, 1]])
    np.testing.assert_array_equal(disc(key, jnp.array([1, 2])), [[1, 0, 0], [0, 1, 0]])

    md = utils.default_preprocessor(gs.MultiDiscrete([2, 3]))
    out = md(key, np.array([1, 2]))
    assert isinstance(out, list) and len(out) == 2
    np.testing.assert_array_equal(out[0], [[0, 1]])
    np.testing.assert_array_equal(out[1], [[0, 0, 1]])

    mb = utils.default_preprocessor(gs.MultiBinary(3))
    y = mb(key, np.array([1, 0, 1], np.int8))
    assert y.dtype == jnp.float32 and y.shape == (1, 3)

    dct = utils.default_preprocessor(
        gs.Dict({"d": gs.Discrete(2), "t": gs.Tuple([gs.MultiBinary(1)])})
    )
    y = jax.jit(dct)(key, {"d": 1, "t": (np.array([1], np.int8),)})
    np.testing.assert_array_equal(y["d"], [[0, 1]])
    np.testing.assert_array_equal(y["t"][0], [[1.0]])

    with pytest.raises(TypeError, match="Text"):
        utils.default_preprocessor(gs.Text(3))


def test_check_preprocessors():
    space = gs.Box(-2.0, 2.0, (3,), np.float32)
    f = utils.default_preprocessor(space)
    same = lambda rng, x: jnp.clip(jnp.asarray(x, jnp.float32)[None], -2.0, 2.0)  # noqa: E731
    scaled = lambda rng, x: 1.01 * f(rng, x)  # noqa: E731
    nested = lambda rng, x: (f(rng, x),)  # noqa: E731
    assert utils.check_preprocessors(space, f, same, random_seed=1)
    assert utils.check_preprocessors(space, f, same, f, num_samples=3)
    assert not utils.check_preprocessors(space, f, scaled, random_seed=1)
    assert not utils.check_preprocessors(space, f, nested, random_seed=1)
    with pytest.raises(ValueError, match="at least two"):
        utils.check_preprocessors(space, f)
    with pytest.raises(ValueError, match="num_samples"):
        utils.check_preprocessors(space, f, same, num_samples=0)


def test_check_preprocessors_treats_nan_in_the_same_place_as_equal():
    # a preprocessor giving NaN (here: scaling a box whose low equals its high) did not
    # match even itself
    space = gs.Box(np.array([0.0, 1.0], np.float32), np.array([1.0, 1.0], np.float32))

    def scaled(rng, x):
        return (jnp.asarray(x) - space.low) / (space.high - space.low)

    def scaled_again(rng, x):
        return jnp.asarray((np.asarray(x) - space.low) / (space.high - space.low))

    with np.errstate(invalid="ignore"):
        assert utils.check_preprocessors(space, scaled, scaled_again, random_seed=0)
        moved = lambda rng, x: scaled(rng, x)[::-1]  # noqa: E731  NaN in another place
        assert not utils.check_preprocessors(space, scaled, moved, random_seed=0)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 6), start=st.integers(-5, 5), seed=st.integers(0, 1000))
def test_discrete_preprocessor_is_one_hot_of_the_offset(n, start, seed):
    space = gs.Discrete(n, start=start)
    x = utils.safe_sample(space, seed)
    y = np.asarray(utils.default_preprocessor(space)(jax.random.key(0), x))
    assert y.shape == (1, n) and y.sum() == 1 and y[0, int(x) - start] == 1


# -- get_transition_batch ------------------------------------------------------------------


def test_get_transition_batch():
    env = gymnasium.make("CartPole-v1")
    tb = utils.get_transition_batch(env, batch_size=7, gamma=0.8, random_seed=13)
    assert isinstance(tb, TransitionBatch) and tb.batch_size == 7
    assert tb.S.shape == tb.S_next.shape == (7, 4)
    assert tb.A.shape == tb.A_next.shape == (7,)
    for s in tb.S:
        assert env.observation_space.contains(s)
    for a in tb.A:
        assert env.action_space.contains(a)
    assert set(np.unique(tb.In)) <= {np.float32(0.0), np.float32(0.8)}
    assert np.all(tb.logP <= 0) and np.all(tb.W > 0)
    again = utils.get_transition_batch(env, batch_size=7, gamma=0.8, random_seed=13)
    jax.tree_util.tree_map(np.testing.assert_array_equal, again, tb)
    # pytree leaves have a batch axis: jax transformations apply
    assert jax.tree_util.tree_map(lambda x: x.shape[0], tb).Rn == 7


def test_get_transition_batch_with_nested_spaces_and_bad_arguments():
    env = Inner()
    env.observation_space = gs.Dict({"pos": gs.Box(-1.0, 1.0, (2,)), "k": gs.Discrete(3)})
    tb = utils.get_transition_batch(env, batch_size=3, random_seed=0)
    assert tb.S["pos"].shape == (3, 2) and tb.S["k"].shape == (3,)
    with pytest.raises(ValueError, match="batch_size"):
        utils.get_transition_batch(env, batch_size=0)
    with pytest.raises(TypeError, match="batch_size"):
        utils.get_transition_batch(env, batch_size=2.0)
    with pytest.raises(ValueError, match="gamma"):
        utils.get_transition_batch(env, gamma=1.5)
    # a bool seed (e.g. a --deterministic flag) was taken as seed 1; other bad seeds raised
    # NumPy's SeedSequence messages, which do not name the argument
    for seed, error in ((True, TypeError), (1.5, TypeError), (-1, ValueError)):
        with pytest.raises(error, match="random_seed"):
            utils.get_transition_batch(env, random_seed=seed)


# -- render_episode ------------------------------------------------------------------------


class Counting(gymnasium.Env):
    observation_space = gs.Discrete(10)
    action_space = gs.Discrete(3)

    def __init__(self):
        self.renders = 0
        self.actions = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.t, {}

    def step(self, action):
        self.actions.append(int(action))
        self.t += 1
        return self.t, float(action), self.t >= 4, False, {}

    def render(self):
        self.renders += 1


def test_render_episode_renders_every_step():
    env = Counting()
    total = utils.render_episode(env, policy=lambda s: 2)
    assert env.actions == [2, 2, 2, 2] and env.renders == 5 and total == 8.0
    env = Counting()
    utils.render_episode(env, step_delay_ms=1)
    assert len(env.actions) == 4 and env.renders == 5
    with pytest.raises(ValueError, match="step_delay_ms"):
        utils.render_episode(Counting(), step_delay_ms=-1)


# -- make_dmc ------------------------------------------------------------------------------


def test_make_dmc_steps_and_renders_a_real_task():
    env = utils.make_dmc("cartpole", "swingup", seed=1, max_episode_steps=4, height=24, width=32)
    assert os.environ.get("MUJOCO_GL")
    obs, _ = env.reset(seed=3)
    assert obs.dtype == np.float32 and obs.shape == env.observation_space.shape == (5,)
    assert env.action_space == gs.Box(-1.0, 1.0, (1,), np.float32)
    frame = env.render()
    assert frame.shape == (24, 32, 3) and frame.dtype == np.uint8 and frame.std() > 0
    steps = []
    for _ in range(4):
        obs, reward, terminated, truncated, _ = env.step(np.array([1.0], np.float32))
        steps.append((obs, reward, terminated, truncated))
    assert [s[3] for s in steps] == [False, False, False, True]  # the TimeLimit
    assert not any(s[2] for s in steps)
    assert not np.array_equal(steps[0][0], steps[-1][0])  # the cart moved
    assert 0.0 <= steps[-1][1] <= 1.0
    # a seeded reset is reproducible
    np.testing.assert_array_equal(env.reset(seed=3)[0], obs0 := env.reset(seed=3)[0])
    assert not np.array_equal(obs0, env.reset(seed=4)[0])
    env.close()


def test_make_dmc_frames_make_a_gif(tmp_path):
    env = utils.make_dmc("cartpole", "balance", max_episode_steps=3, height=16, width=16)
    utils.generate_gif(env, tmp_path / "dmc.gif", duration=10)
    from PIL import Image

    with Image.open(tmp_path / "dmc.gif") as im:
        assert im.size == (16, 16)


def test_make_dmc_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown DeepMind Control task"):
        utils.make_dmc("cartpole", "fly")
    with pytest.raises(ValueError, match="height"):
        utils.make_dmc("cartpole", "swingup", height=0)
    for name in [m for m in sys.modules if m == "dm_control" or m.startswith("dm_control.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "dm_control", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install coax_utils\[dmc\]"):
        utils.make_dmc("cartpole", "swingup")


def test_box_preprocessor_keeps_wide_integer_bounds_without_x64():
    # int64 bounds do not fit the int32 that JAX uses without x64: cast as they are they
    # wrapped around (iinfo(int64) -> 0 and -1), and every value was clipped to garbage
    key = jax.random.key(0)
    unbounded = gs.Box(-np.inf, np.inf, (3,), np.int64)  # gymnasium: iinfo(int64) bounds
    f = utils.default_preprocessor(unbounded)
    np.testing.assert_array_equal(f(key, np.array([1, -2, 3])), [[1, -2, 3]])
    wide = utils.default_preprocessor(gs.Box(-5, 2**40, (2,), np.int64))
    np.testing.assert_array_equal(wide(key, np.array([-7, 2**20])), [[-5, 2**20]])
    np.testing.assert_array_equal(jax.jit(wide)(key, np.array([4, 0])), [[4, 0]])


def test_render_episode_refuses_an_infinite_delay_before_resetting():
    # an infinite delay was accepted, and time.sleep raised OverflowError only after the env
    # had been reset and stepped
    env = gymnasium.make("CartPole-v1", render_mode="rgb_array")
    with pytest.raises(ValueError, match="step_delay_ms"):
        utils.render_episode(env, step_delay_ms=float("inf"))
    assert env.unwrapped.state is None  # never reset
    env.close()


def test_preprocessors_refuse_elements_of_another_shape():
    # elements were reshaped to (-1, *shape) whatever their shape: a (3, 2) array for a
    # (2, 3) box came out as one (transposed-wrong) element, a (6,) array for a (3,) box as
    # two elements
    key = jax.random.key(0)
    for space, bad, good in (
        (gs.Box(-1.0, 1.0, (2, 3)), np.zeros((3, 2)), np.zeros((4, 5, 2, 3))),
        (gs.Box(-1.0, 1.0, (3,)), np.zeros(6), np.zeros((2, 3))),
        (gs.MultiBinary([2, 3]), np.zeros((3, 2), np.int8), np.zeros((2, 3), np.int8)),
        (gs.MultiDiscrete([2, 3]), np.zeros(4, np.int64), np.zeros((5, 2), np.int64)),
    ):
        f = utils.default_preprocessor(space)
        for g in (f, jax.jit(f)):
            with pytest.raises(ValueError, match=r"shape"):
                g(key, bad)
            leaves = jax.tree_util.tree_leaves(g(key, good))
            assert leaves[0].shape[0] == int(np.prod(good.shape[: good.ndim - len(space.shape)]))
    scalar = utils.default_preprocessor(gs.Box(0.0, 1.0, ()))  # any shape is a batch of scalars
    assert scalar(key, np.zeros((2, 3))).shape == (6,)
    one = utils.default_preprocessor(gs.Box(0.0, 1.0, (1,)))  # so for a space of size one
    assert one(key, 0.5).shape == (1, 1) and one(key, np.zeros(4)).shape == (4, 1)
    unit = utils.default_preprocessor(gs.Box(0.0, 1.0, (1, 3)))  # unit axes of one element
    assert unit(key, np.zeros(3)).shape == (1, 1, 3)
    assert unit(key, np.zeros((5, 1, 3))).shape == (5, 1, 3)


def test_make_dmc_checks_seed_and_camera_before_use():
    # a float seed or camera_id was truncated silently (1.5 -> 1), and a camera the task does
    # not have was accepted, failing only at the first render
    for kwargs, error in (
        (dict(seed=1.5), TypeError),
        (dict(seed=-1), ValueError),
        (dict(seed=2**32), ValueError),
        (dict(camera_id=1.5), TypeError),
        (dict(camera_id=True), TypeError),
        (dict(camera_id=-2), ValueError),
        (dict(camera_id=2), ValueError),  # cartpole has the fixed cameras 0 and 1
    ):
        with pytest.raises(error, match="seed" if "seed" in kwargs else "camera_id"):
            utils.make_dmc("cartpole", "swingup", height=8, width=8, **kwargs)
    for camera_id in (-1, 1):  # -1: mujoco's free camera
        env = utils.make_dmc("cartpole", "swingup", height=8, width=8, camera_id=camera_id)
        env.reset(seed=0)
        assert env.render().shape == (8, 8, 3)
        env.close()


def test_make_dmc_reset_refuses_a_bad_seed_before_reseeding():
    # reset(seed=2**32) reseeded the gymnasium generator, then dm_control refused the seed:
    # the env was left half reset
    env = utils.make_dmc("cartpole", "swingup", height=8, width=8)
    env.reset(seed=1)
    unwrapped = env.unwrapped
    before = unwrapped.np_random.bit_generator.state
    physics = unwrapped._env.physics.get_state().copy()
    for seed, error in ((2**32, ValueError), (-1, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="seed"):
            env.reset(seed=seed)
        assert unwrapped.np_random.bit_generator.state == before
        np.testing.assert_array_equal(unwrapped._env.physics.get_state(), physics)
    env.close()
