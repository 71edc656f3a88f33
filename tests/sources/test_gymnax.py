"""GymnaxSource on the real gymnax envs, and on a small env written here for the old API.

No installed gymnax release has the pre-1.0 step (a 5-tuple with the time limit folded
into ``done``), so ``Chain(new_api=False)`` below stands in for it; ``Chain(new_api=True)``
is a 6-tuple env without ``step_env``.
"""

import chex
import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.envs import GymnasiumToJax
from coax_utils.sources import BatchedSource, GymnaxSource, GymnaxSourceState, Source
from tests._compiles import eager_compiles


class Chain:
    """Walk right along a chain: terminated at ``goal``, truncated after ``max_steps``.

    ``new_api=True`` gives the gymnax >= 1.0 step (terminated, truncated); otherwise the old
    step with a single ``done``. Every executed reset is counted on the host.
    """

    def __init__(self, new_api):
        self.new_api = new_api
        self.resets = 0

    def _count_reset(self):
        self.resets += 1

    def reset(self, key, params):
        jax.debug.callback(self._count_reset)
        pos = jax.random.randint(key, (), 0, 2)
        state = {"pos": pos, "t": jnp.zeros([], jnp.int32)}
        return jnp.stack([pos, state["t"]]).astype(jnp.float32), state

    def step(self, key, state, action, params):
        pos = state["pos"] + action
        t = state["t"] + 1
        obs = jnp.stack([pos, t]).astype(jnp.float32)
        reward = pos.astype(jnp.float32)
        terminated = pos >= params["goal"]
        truncated = jnp.logical_and(~terminated, t >= params["max_steps"])
        info = {"t": t}
        new_state = {"pos": pos, "t": t}
        if self.new_api:
            return obs, new_state, reward, terminated, truncated, info
        return obs, new_state, reward, jnp.logical_or(terminated, truncated), info


PARAMS = {"goal": jnp.int32(4), "max_steps": jnp.int32(3)}


def policy(obs, policy_state, new_episode, key):
    """Step right with probability 1/2; count calls and episode starts."""
    action = jax.random.bernoulli(key).astype(jnp.int32)
    return action, {
        "calls": policy_state["calls"] + 1,
        "episodes": policy_state["episodes"] + new_episode.astype(jnp.int32),
    }


TEMPLATE = {"calls": jnp.int32(0), "episodes": jnp.int32(0)}


def rollout(source, steps, key=0):
    state = source.init_state(jax.random.key(key)).replace(policy_state=TEMPLATE)

    def body(state, _):
        item, mask, new = source.next(state)
        return new, (item, mask, state.new_episode, new.epoch)

    return jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(state)


@pytest.mark.parametrize("new_api", [False, True])
def test_transitions_are_consistent(new_api):
    env = Chain(new_api)
    source = GymnaxSource(env, PARAMS, policy, TEMPLATE, steps_per_epoch=1000)
    assert isinstance(source, Source)
    steps = 200
    state, (items, masks, new_episode, epochs) = rollout(source, steps)
    items = jax.tree_util.tree_map(np.asarray, items)
    assert bool(np.all(masks)) and masks.shape == (steps,)
    assert np.all(epochs == 0)
    done = items["done"]
    assert np.array_equal(done, items["terminated"] | items["truncated"])
    assert items["terminated"].any()
    if new_api:
        assert items["truncated"].any()
    else:  # a 5-tuple without a time limit to read: done is termination
        assert not items["truncated"].any()
    assert done.any() and not done.all()
    # Within an episode, next_state of one step is the state of the following step.
    cont = ~done[:-1]
    assert np.array_equal(items["next_state"][:-1][cont], items["state"][1:][cont])
    # After a terminal step a fresh episode starts at time 0.
    assert np.all(items["state"][1:][done[:-1]][:, 1] == 0)
    assert np.array_equal(np.asarray(new_episode)[1:], done[:-1])
    assert bool(new_episode[0])
    # Rewards and actions agree with the dynamics.
    assert np.array_equal(items["next_state"][:, 0], items["state"][:, 0] + items["action"])
    assert np.array_equal(items["reward"], items["next_state"][:, 0])
    assert np.array_equal(items["info"]["t"], items["next_state"][:, 1])
    # The policy state is threaded through every step and sees every episode start.
    assert int(state.policy_state["calls"]) == steps
    assert int(state.policy_state["episodes"]) == 1 + int(done[:-1].sum())
    # The environment is reset once at init and once per finished episode, not more.
    assert env.resets == 1 + int(done.sum())


@pytest.mark.parametrize("new_api", [False, True])
def test_element_spec_matches_emitted_items(new_api):
    source = GymnaxSource(Chain(new_api), PARAMS, policy, TEMPLATE, steps_per_epoch=8)
    state = source.init_state(jax.random.key(1)).replace(policy_state=TEMPLATE)
    item, mask, _ = jax.jit(source.next)(state)
    spec = source.element_spec()
    expected = {"state", "action", "reward", "next_state", "done", "terminated", "truncated"}
    expected.add("info")
    assert set(item) == expected
    chex.assert_trees_all_equal_shapes_and_dtypes(
        item, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), spec)
    )
    assert mask.shape == () and mask.dtype == jnp.bool_


def test_epochs_reset_the_environment():
    env = Chain(True)
    source = GymnaxSource(
        env,
        {"goal": jnp.int32(100), "max_steps": jnp.int32(100)},
        policy,
        TEMPLATE,
        steps_per_epoch=5,
    )
    state, (items, _, new_episode, epochs) = rollout(source, 12)
    assert epochs.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    starts = [True, False, False, False, False] * 2 + [True, False]
    assert np.asarray(new_episode).tolist() == starts
    assert np.asarray(items["state"][:, 1]).tolist() == [0, 1, 2, 3, 4] * 2 + [0, 1]
    # the last step of an epoch cuts its episode: a truncation (the env never terminated),
    # so whoever reads the stream (n-step returns, replay) ends the episode there
    cut = [False, False, False, False, True] * 2 + [False, False]
    assert np.asarray(items["truncated"]).tolist() == cut
    assert np.asarray(items["done"]).tolist() == cut
    assert not np.asarray(items["terminated"]).any()
    assert env.resets == 3
    assert int(state.step) == 2 and int(state.epoch) == 2


def test_different_keys_give_different_rollouts():
    source = GymnaxSource(Chain(False), PARAMS, policy, TEMPLATE, steps_per_epoch=50)
    _, (a, _, _, _) = rollout(source, 50, key=0)
    _, (b, _, _, _) = rollout(source, 50, key=1)
    _, (c, _, _, _) = rollout(source, 50, key=0)
    assert not np.array_equal(a["action"], b["action"])
    chex.assert_trees_all_equal(a, c)


def test_next_requires_a_policy_state():
    source = GymnaxSource(Chain(False), PARAMS, policy, TEMPLATE)
    state = source.init_state(jax.random.key(0))
    assert isinstance(state, GymnaxSourceState) and state.policy_state is None
    with pytest.raises(ValueError, match=r"state.replace\(policy_state=...\)"):
        source.next(state)
    with pytest.raises(ValueError, match="no policy_state"):
        jax.jit(source.next)(state)
    item, _, state = source.next(state.replace(policy_state=TEMPLATE))
    assert int(state.policy_state["calls"]) == 1


def test_batched_rollouts():
    source = BatchedSource(
        GymnaxSource(Chain(True), PARAMS, policy, TEMPLATE, steps_per_epoch=10), batch_size=4
    )
    assert source.steps_per_epoch == 3
    state = source.init_state(jax.random.key(0))
    state = state.replace(inner=state.inner.replace(policy_state=TEMPLATE))
    step = jax.jit(source.next)
    masks = []
    for _ in range(3):
        batch, mask, state = step(state)
        masks.append(np.asarray(mask).tolist())
    assert batch["state"].shape == (4, 2)
    assert masks == [[True] * 4, [True] * 4, [True, True, False, False]]
    assert int(state.epoch) == 1 and int(state.inner.epoch) == 1
    assert int(state.inner.policy_state["calls"]) == 10


def test_no_retrace_on_second_call():
    chex.clear_trace_counter()
    source = GymnaxSource(Chain(True), PARAMS, policy, TEMPLATE, steps_per_epoch=3)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state):
        return source.next(state)

    state = source.init_state(jax.random.key(0)).replace(policy_state=TEMPLATE)
    for _ in range(5):
        _, _, state = step(state)
    assert int(state.epoch) == 1


class ThreeTuple:
    def reset(self, key, params):
        return jnp.zeros(2), jnp.zeros(())

    def step(self, key, state, action, params):
        return jnp.zeros(2), state, jnp.float32(0)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (
            (Chain(False), PARAMS, policy, TEMPLATE),
            dict(steps_per_epoch=0),
            ValueError,
            "steps_per_epoch must be a positive integer, got 0",
        ),
        (
            (Chain(False), PARAMS, policy, TEMPLATE),
            dict(steps_per_epoch=2**31),
            ValueError,
            "steps_per_epoch must be at most 2147483647",
        ),
        ((Chain(False), PARAMS, policy, None), {}, ValueError, "policy_state_template"),
        ((Chain(False), PARAMS, "policy", TEMPLATE), {}, TypeError, "callable"),
        ((ThreeTuple(), None, policy, TEMPLATE), {}, ValueError, "got 3"),
    ],
)
def test_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        GymnaxSource(*args, **kwargs)


def test_gymnasium_cartpole_through_the_bridge():
    env = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=3)
    steps_per_epoch = 40

    def random_policy(obs, count, new_episode, key):
        return jax.random.randint(key, (), 0, 2), count + 1

    source = GymnaxSource(
        env, env.default_params, random_policy, jnp.int32(0), steps_per_epoch=steps_per_epoch
    )
    spec = source.element_spec()
    assert spec["state"] == jax.ShapeDtypeStruct((4,), jnp.float32)
    assert {"terminated", "truncated"} <= set(spec)
    state = source.init_state(jax.random.key(0)).replace(policy_state=jnp.int32(0))

    def body(state, _):
        item, _, state = source.next(state)
        return state, item

    steps = 90
    state, items = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(state)
    items = jax.tree_util.tree_map(np.asarray, items)
    assert items["done"].any()  # random play on CartPole ends episodes quickly
    assert int(state.epoch) == 2 and int(state.policy_state) == steps

    # Replay the emitted actions on a plain gymnasium CartPole. The source steps the bridge
    # with step_env (no autoreset), so next_state is the real last observation of an episode
    # and the env is reset once, by the source, at each episode end and epoch end.
    oracle = gymnasium.make("CartPole-v1")
    obs, _ = oracle.reset(seed=3)
    for t in range(steps):
        np.testing.assert_allclose(items["state"][t], obs, rtol=1e-6)
        obs, reward, terminated, truncated, _ = oracle.step(int(items["action"][t]))
        np.testing.assert_allclose(items["next_state"][t], obs, rtol=1e-6)
        assert items["reward"][t] == reward
        epoch_ends = (t + 1) % steps_per_epoch == 0  # cuts the episode: a truncation
        assert items["terminated"][t] == terminated
        assert items["truncated"][t] == (truncated or epoch_ends)
        if terminated or truncated or epoch_ends:
            obs, _ = oracle.reset()


# -- the real gymnax ----------------------------------------------------------------------


def _random_source(name, steps_per_epoch=1000):
    import gymnax

    env, params = gymnax.make(name)
    space = env.action_space(params)

    def act(obs, count, new_episode, key):
        return space.sample(key), count + 1

    return GymnaxSource(env, params, act, jnp.int32(0), steps_per_epoch=steps_per_epoch), params


def _roll(source, steps, seed=0):
    state = source.init_state(jax.random.key(seed)).replace(policy_state=jnp.int32(0))

    def body(state, _):
        item, _, state = source.next(state)
        return state, (item, state.env_state)

    _, (items, env_states) = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(state)
    return jax.tree_util.tree_map(np.asarray, items), env_states


@pytest.mark.parametrize("name", ["Pendulum-v1", "MountainCar-v0"])
def test_real_gymnax_time_limit_truncates(name):
    # gymnax >= 1.0's step_env has no time limit: the source must apply max_steps_in_episode
    source, params = _random_source(name)
    limit = int(params.max_steps_in_episode)
    items, _ = _roll(source, 2 * limit + 5)
    ends = np.flatnonzero(items["truncated"]).tolist()
    assert ends == [limit - 1, 2 * limit - 1]
    assert not items["terminated"].any()  # random play never reaches the goal / Pendulum never ends
    np.testing.assert_array_equal(items["done"], items["truncated"])


def test_real_gymnax_cartpole_keeps_the_terminal_next_state():
    source, params = _random_source("CartPole-v1")
    items, _ = _roll(source, 300)
    term = items["terminated"]
    assert term.sum() >= 5 and not items["truncated"].any()
    # the terminal next_state is the state that ended the episode (pole fallen or cart out),
    # not the first observation of the next episode
    last = items["next_state"][term]
    fallen = (np.abs(last[:, 2]) > params.theta_threshold_radians) | (
        np.abs(last[:, 0]) > params.x_threshold
    )
    assert fallen.all()
    # and the episode after it starts from a reset state
    starts = items["state"][1:][term[:-1]]
    assert np.all(np.abs(starts) <= 0.05)
    # within an episode, next_state is the next step's state
    cont = ~items["done"][:-1]
    np.testing.assert_array_equal(items["next_state"][:-1][cont], items["state"][1:][cont])


def test_an_episode_that_terminates_at_the_epoch_end_is_not_also_truncated():
    params = {"goal": jnp.int32(2), "max_steps": jnp.int32(100)}
    source = GymnaxSource(Chain(True), params, policy, TEMPLATE, steps_per_epoch=3)
    _, (items, _, _, _) = rollout(source, 300)
    terminated, truncated = np.asarray(items["terminated"]), np.asarray(items["truncated"])
    epoch_ends = (np.arange(300) + 1) % 3 == 0
    assert (terminated & epoch_ends).any()  # the case under test occurs
    assert not (terminated & truncated).any()  # as the env reports them: one or the other
    np.testing.assert_array_equal(truncated, epoch_ends & ~terminated)
    np.testing.assert_array_equal(np.asarray(items["done"]), terminated | epoch_ends)


def test_eager_next_compiles_once():
    # each eager call used to trace and compile its conditionals anew
    source, _ = _random_source("CartPole-v1", steps_per_epoch=4)
    state = source.init_state(jax.random.key(0)).replace(policy_state=jnp.int32(0))
    assert eager_compiles(source, state, 10) == 0
