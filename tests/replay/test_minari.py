"""fill_from_minari and save_as_minari against datasets made with Minari's DataCollector."""

import sys
import warnings

import gymnasium
import jax
import minari
import numpy as np
import pytest
from minari.data_collector import EpisodeBuffer

from coax_utils.replay import (
    FrameStackReplayBuffer,
    MonteCarlo,
    NStep,
    PrioritizedReplayBuffer,
    RecordTransitions,
    SequenceReplayBuffer,
    SimpleReplayBuffer,
    TransitionBatch,
    fill_from_minari,
    make_frame_stack_buffer,
    make_sequence_buffer,
    make_uniform_buffer,
    save_as_minari,
)
from tests.minari_data import DictObservation, collect


@pytest.fixture(autouse=True)
def minari_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    return tmp_path / "minari"


def contents(buffer):
    """The buffer's transitions, oldest first, as one batch of NumPy arrays."""
    return jax.tree_util.tree_map(np.asarray, TransitionBatch.concatenate(*buffer))


def assert_same(x, y, dtypes=True):
    fields = ("S", "A", "logP", "Rn", "In", "S_next", "A_next", "logP_next", "W")
    for name in fields:
        a, b = getattr(x, name), getattr(y, name)
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), name
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            u, v = np.asarray(u), np.asarray(v)
            np.testing.assert_array_equal(u, v, err_msg=name)
            if dtypes:
                assert u.dtype == v.dtype, (name, u.dtype, v.dtype)


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory):
    # 12-step limit: random CartPole episodes end both ways
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINARI_DATASETS_PATH", str(tmp_path_factory.mktemp("minari")))
        env = gymnasium.make("CartPole-v1", max_episode_steps=12)
        return collect(env, "local/cartpole/random-v0", episodes=8)


def test_every_transition_equals_what_the_env_produced(cartpole):
    dataset, steps = cartpole
    assert {s["terminated"] for s in steps} == {True, False}
    assert any(s["truncated"] for s in steps)
    buffer = SimpleReplayBuffer(capacity=1000)
    assert fill_from_minari(dataset, buffer) is None
    got = contents(buffer)
    assert got.batch_size == len(steps) == dataset.total_steps
    for t, step in enumerate(steps):
        np.testing.assert_array_equal(got.S[t], step["obs"])
        assert got.A[t] == step["action"] and got.A.dtype == np.int32  # the bridge's int
        assert got.Rn[t] == step["reward"]
        assert got.In[t] == (0.0 if step["terminated"] else 1.0)
        if not step["terminated"]:  # truncated steps bootstrap from the real next state
            np.testing.assert_array_equal(got.S_next[t], step["next_obs"])
    # episode ends are marked: sequence windows never cross them
    sample = buffer.sample_sequences(batch_size=64, length=5)
    ep = np.array([s["episode"] for s in steps])
    idx = np.asarray(sample.indices)
    assert np.all((ep[idx] == ep[idx[:, :1]]) | ~np.asarray(sample.mask))


@pytest.mark.parametrize("tracer", [None, NStep(n=3, gamma=0.9), MonteCarlo(gamma=0.8)])
def test_tracers_give_what_the_recorder_gave_while_acting(tracer):
    # the recorder sits inside the DataCollector: it sees exactly the dataset's steps
    recorded = SimpleReplayBuffer(capacity=1000)
    dataset, _ = collect(
        gymnasium.make("CartPole-v1", max_episode_steps=12),
        "local/cartpole/traced-v0",
        episodes=6,
        wrap=lambda env: RecordTransitions(env, recorded, tracer),
    )
    filled = SimpleReplayBuffer(capacity=1000)
    fill_from_minari(dataset, filled, tracer=tracer)
    assert_same(contents(filled), contents(recorded), dtypes=False)  # actions: int32 vs int64
    if tracer is not None:
        assert len(tracer) == 0  # the caller's tracer is not used (a copy is)


def test_round_trip_recorded_to_minari_to_buffer():
    recorded = SimpleReplayBuffer(capacity=1000)
    collected, steps = collect(
        gymnasium.make("CartPole-v1", max_episode_steps=12),
        "local/cartpole/collected-v0",
        episodes=6,
        wrap=lambda env: RecordTransitions(env, recorded),
    )
    env = gymnasium.make("CartPole-v1")
    saved = save_as_minari(
        "local/cartpole/recorded-v0",
        recorded,
        env.observation_space,
        env.action_space,
        env="CartPole-v1",
        author="tests",
        author_email="tests@example.org",
        code_permalink="https://example.org",
        algorithm_name="random",
        description="round trip",
        eval_env="CartPole-v1",
    )
    loaded = minari.load_dataset("local/cartpole/recorded-v0")
    assert loaded.total_steps == saved.total_steps == len(steps)
    pairs = list(zip(collected.iterate_episodes(), loaded.iterate_episodes()))
    assert len(pairs) == collected.total_episodes
    for a, b in pairs:
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_array_equal(a.terminations, b.terminations)
        np.testing.assert_array_equal(a.truncations, b.truncations)
        # the terminal state is not recorded (a placeholder); every other one is
        last = len(a.rewards) if b.truncations[-1] else len(a.rewards) - 1
        np.testing.assert_array_equal(a.observations[: last + 1], b.observations[: last + 1])
    refilled = SimpleReplayBuffer(capacity=1000)
    fill_from_minari(loaded, refilled)
    assert_same(contents(refilled), contents(recorded), dtypes=False)
    with pytest.raises(ValueError, match="exists already"):
        save_as_minari(
            "local/cartpole/recorded-v0", recorded, env.observation_space, env.action_space
        )


def test_jittable_buffers_get_the_same_transitions(cartpole):
    dataset, _ = cartpole
    host = SimpleReplayBuffer(capacity=1000)
    fill_from_minari(dataset, host)
    expected = contents(host)
    n = expected.batch_size
    buffer = make_uniform_buffer(1000)  # the prioritized one takes the same add path
    state = fill_from_minari(dataset, buffer)
    got = jax.tree_util.tree_map(lambda x: np.asarray(x)[:n], state.items)
    assert_same(got, expected)
    assert int(state.size) == n
    # a second fill continues from the given state
    state = fill_from_minari(dataset, buffer, state, max_transitions=5)
    assert int(state.size) == n + 5
    # more transitions than capacity: the newest are kept, as with any add
    small = make_uniform_buffer(10)
    state = fill_from_minari(dataset, small)
    np.testing.assert_array_equal(np.sort(np.asarray(state.items.Rn)), np.ones(10))
    np.testing.assert_array_equal(
        np.sort(np.asarray(state.items.S), axis=0), np.sort(expected.S[-10:], axis=0)
    )


# Minari 0.5.3's HDF5 writer JPEG-encodes every uint8 array of 4 dims ending in 3 channels,
# a frame stack included, and fails on it (0.5.4 decides by the space: stacks stay raw)
@pytest.mark.requires(minari="0.5.4")
def test_frame_stacked_image_observations(monkeypatch):
    # CartPole's rendered frames, 24x24 RGB, stacked by 3 (stacks of frames are stored as
    # they are by Minari: only single images are JPEG-encoded)
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    env = gymnasium.make("CartPole-v1", render_mode="rgb_array", max_episode_steps=8)
    env = gymnasium.wrappers.AddRenderObservation(env, render_only=True)
    env = gymnasium.wrappers.ResizeObservation(env, (24, 24))
    env = gymnasium.wrappers.FrameStackObservation(env, 3)
    dataset, steps = collect(env, "local/cartpole-pixels/random-v0", 3)
    buffer = FrameStackReplayBuffer(capacity=100, stack_size=3)
    fill_from_minari(dataset, buffer)
    got = contents(buffer)
    assert got.S.shape == (len(steps), 3, 24, 24, 3) and got.S.dtype == np.uint8
    np.testing.assert_array_equal(got.S, np.stack([s["obs"] for s in steps]))
    for t, step in enumerate(steps):
        if not step["terminated"]:
            np.testing.assert_array_equal(got.S_next[t], step["next_obs"])
    assert buffer.frame_count < 3 * len(steps)  # each frame stored once, not per stack
    jittable = make_frame_stack_buffer(capacity=100, stack_size=3)
    state = fill_from_minari(dataset, jittable)
    sample = jittable.sample(state, jax.random.key(0), 16)
    stacks = {np.asarray(s["obs"]).tobytes() for s in steps}
    assert all(np.asarray(x).tobytes() in stacks for x in sample.S)


def test_sequence_buffers_get_the_steps_of_each_episode(cartpole):
    dataset, steps = cartpole
    buffer = SequenceReplayBuffer(capacity=200, length=4, period=1, random_seed=0)
    fill_from_minari(dataset, buffer)
    assert len(buffer) > 0
    obs = np.stack([s["obs"] for s in steps])
    sample = buffer.sample(batch_size=32)
    for row in range(32):
        valid = np.asarray(sample.mask[row])
        got = np.asarray(sample.items["obs"][row])[valid]
        # every window is consecutive steps of one episode of the env's run
        start = int(np.flatnonzero((obs == got[0]).all(axis=1))[0])
        np.testing.assert_array_equal(got, obs[start : start + len(got)])
        episodes = {steps[i]["episode"] for i in range(start, start + len(got))}
        assert len(episodes) == 1
        np.testing.assert_array_equal(
            np.asarray(sample.items["next_obs"][row])[valid],
            np.stack([s["next_obs"] for s in steps[start : start + len(got)]]),
        )
    with pytest.raises(ValueError, match="sequence buffer stores steps"):
        fill_from_minari(dataset, buffer, tracer=NStep(n=2, gamma=0.9))
    # the jittable twin holds the same windows
    jittable = make_sequence_buffer(capacity=200, length=4, period=1)
    state = fill_from_minari(dataset, jittable)
    assert int(state.size) == len(buffer)
    twin = jittable.sample(state, jax.random.key(0), 32)
    for row in range(32):
        valid = np.asarray(twin.mask[row])
        got = np.asarray(twin.items["obs"][row])[valid]
        start = int(np.flatnonzero((obs == got[0]).all(axis=1))[0])
        np.testing.assert_array_equal(got, obs[start : start + len(got)])
        assert len({steps[i]["episode"] for i in range(start, start + len(got))}) == 1


def test_prioritized_host_buffer_and_pendulum_box_actions():
    dataset, steps = collect(
        gymnasium.make("Pendulum-v1", max_episode_steps=10), "local/pendulum/random-v0", 3
    )
    buffer = PrioritizedReplayBuffer(capacity=100, random_seed=0)
    fill_from_minari(dataset, buffer, tracer=NStep(n=2, gamma=0.5))
    got = contents(buffer)
    assert got.batch_size == len(steps) == 30
    np.testing.assert_array_equal(got.A, np.stack([s["action"] for s in steps]))
    assert got.A.dtype == np.float32 and got.A.shape == (30, 1)
    r = np.array([s["reward"] for s in steps], np.float32).reshape(3, 10)
    rn = got.Rn.reshape(3, 10)
    # 2-step returns; the truncated last step keeps bootstrapping (In > 0) from S_next
    np.testing.assert_allclose(rn[:, :9], r[:, :9] + 0.5 * r[:, 1:], rtol=1e-6)
    np.testing.assert_allclose(rn[:, 9], r[:, 9], rtol=1e-6)
    np.testing.assert_allclose(got.In.reshape(3, 10)[:, 9], 0.5)
    last = [s["next_obs"] for s in steps if s["truncated"]]
    np.testing.assert_array_equal(got.S_next.reshape(3, 10, 3)[:, 9], np.stack(last))


def test_dict_and_tuple_observations():
    dataset, steps = collect(
        DictObservation(gymnasium.make("CartPole-v1", max_episode_steps=8)),
        "local/cartpole-dict/random-v0",
        3,
    )
    buffer = SimpleReplayBuffer(capacity=100)
    fill_from_minari(dataset, buffer)
    got = contents(buffer)
    assert set(got.S) == {"position", "velocity"}
    for key in got.S:
        np.testing.assert_array_equal(got.S[key], np.stack([s["obs"][key] for s in steps]))
    dataset, steps = collect(gymnasium.make("Blackjack-v1"), "local/blackjack/random-v0", 5)
    buffer = SimpleReplayBuffer(capacity=100)
    fill_from_minari(dataset, buffer)
    got = contents(buffer)
    assert isinstance(got.S, tuple) and len(got.S) == 3
    for i in range(3):
        assert got.S[i].dtype == np.int32
        np.testing.assert_array_equal(got.S[i], [s["obs"][i] for s in steps])


def test_episode_subset_limit_and_progress(cartpole, capsys):
    dataset, steps = cartpole
    ep = np.array([s["episode"] for s in steps])
    buffer = SimpleReplayBuffer(capacity=1000)
    fill_from_minari(dataset, buffer, episodes=[3, 1], progress=True)
    got = contents(buffer)
    order = np.concatenate([np.flatnonzero(ep == 3), np.flatnonzero(ep == 1)])
    np.testing.assert_array_equal(got.S, np.stack([steps[i]["obs"] for i in order]))
    assert "step" in capsys.readouterr().err  # tqdm's bar
    buffer = SimpleReplayBuffer(capacity=1000)
    first = int((ep == 0).sum())
    fill_from_minari(dataset, buffer, max_transitions=first + 2)
    got = contents(buffer)
    assert got.batch_size == first + 2
    # the cut episode ends truncated: its last transition bootstraps from the real state
    assert got.In[-1] == 1.0
    np.testing.assert_array_equal(got.S_next[-1], steps[first + 1]["next_obs"])
    with pytest.raises(ValueError, match="episode 99 is not in the dataset"):
        fill_from_minari(dataset, buffer, episodes=[99])
    with pytest.raises(TypeError, match="max_transitions"):
        fill_from_minari(dataset, buffer, max_transitions=1.5)
    assert len(buffer) == first + 2


def _bad_dataset(episodes):
    space = gymnasium.spaces.Box(-1, 1, (2,), np.float32)
    with warnings.catch_warnings():  # Minari advises an env (for evaluation): none here
        warnings.simplefilter("ignore", UserWarning)
        return _create(episodes, space)


def _create(episodes, space):
    return minari.create_dataset_from_buffers(
        "local/bad/data-v0",
        episodes,
        observation_space=space,
        action_space=gymnasium.spaces.Discrete(2),
        author="tests",
        author_email="tests@example.org",
        code_permalink="https://example.org",
        algorithm_name="none",
        description="bad data",
    )


def _episode(i, steps, obs_rows=None, reward=1.0):
    rows = steps + 1 if obs_rows is None else obs_rows
    truncations = np.zeros(steps, bool)
    truncations[-1] = True
    return EpisodeBuffer(
        id=i,
        observations=np.full((rows, 2), 0.5, np.float32),
        actions=np.zeros(steps, np.int64),
        rewards=np.full(steps, reward),
        terminations=np.zeros(steps, bool),
        truncations=truncations,
    )


def test_bad_episodes_are_refused_naming_episode_and_field_buffer_unchanged(cartpole):
    cart, _ = cartpole
    buffer = SimpleReplayBuffer(capacity=1000)
    fill_from_minari(cart, buffer)
    before = contents(buffer)
    dataset = _bad_dataset([_episode(0, 4), _episode(1, 3, obs_rows=3)])
    with pytest.raises(ValueError, match=r"episode 1: observations has shape \(3, 2\)"):
        fill_from_minari(dataset, buffer)
    minari.delete_dataset("local/bad/data-v0")
    dataset = _bad_dataset([_episode(0, 4), _episode(1, 3, reward=np.nan)])
    fill_from_minari(dataset, SimpleReplayBuffer(10))  # NaN checks are asked for
    with pytest.raises(ValueError, match="episode 1: rewards is not finite .* step 0"):
        fill_from_minari(dataset, buffer, check_finite=True)
    minari.delete_dataset("local/bad/data-v0")
    # a dataset whose spaces do not fit what the buffer holds
    dataset = _bad_dataset([_episode(0, 4)])
    with pytest.raises(ValueError, match="do not fit the buffer .*first episode read: 0"):
        fill_from_minari(dataset, buffer)
    assert_same(contents(buffer), before)
    with pytest.raises(ValueError):
        fill_from_minari(
            dataset,
            make_uniform_buffer(10),
            make_uniform_buffer(10).init(jax.tree_util.tree_map(lambda x: x[0], before)),
        )


def test_without_minari_the_error_names_the_extra(cartpole, monkeypatch):
    dataset, _ = cartpole
    monkeypatch.setitem(sys.modules, "minari", None)
    with pytest.raises(ImportError, match=r"coax_utils\[offline\]"):
        fill_from_minari(dataset, SimpleReplayBuffer(10))
