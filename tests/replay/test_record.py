"""RecordTransitions on CartPole and on gymnasium vector envs, against manual tracing."""

import gymnasium
import numpy as np
import pytest

from coax_utils.replay import (
    NStep,
    RecordTransitions,
    RecordVectorTransitions,
    SimpleReplayBuffer,
    TransitionBatch,
)


def contents(buffer):
    rows = list(buffer)
    return TransitionBatch.concatenate(*rows) if rows else None


def test_cartpole_matches_manual_tracing():
    buffer = SimpleReplayBuffer(10_000)
    env = RecordTransitions(gymnasium.make("CartPole-v1"), buffer, NStep(n=3, gamma=0.9))
    plain = gymnasium.make("CartPole-v1")
    manual, expected = NStep(n=3, gamma=0.9), []
    rng = np.random.default_rng(0)
    for episode in range(3):
        s, _ = env.reset(seed=episode)
        p, _ = plain.reset(seed=episode)
        done = truncated = False
        while not (done or truncated):
            a = int(rng.integers(2))
            s, r, done, truncated, _ = env.step(a)
            p_next, r2, d2, t2, _ = plain.step(a)
            manual.add(p, a, r2, d2, truncated=t2, s_next=p_next)
            while manual:
                expected.append(manual.pop())
            p = p_next
        assert done and not truncated
    got, want = contents(buffer), TransitionBatch.concatenate(*expected)
    assert got.batch_size == want.batch_size == len(buffer)
    for field in ("S", "A", "Rn", "In", "S_next"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-6)
    assert np.sum(got.In == 0) == 3 * 3  # the last n transitions of each terminated episode
    # episode ends are marked for sequence sampling
    seq = buffer.sample_sequences(100, 4)
    assert not seq.mask.all()


def test_truncated_episode_keeps_bootstrapping():
    buffer = SimpleReplayBuffer(100)
    env = RecordTransitions(
        gymnasium.make("CartPole-v1", max_episode_steps=6), buffer, NStep(n=2, gamma=0.5)
    )
    env.reset(seed=1)
    truncated = done = False
    while not (truncated or done):
        s_final, _, done, truncated, _ = env.step(len(buffer) % 2)  # alternate: stays up
    assert truncated and not done
    tb = contents(buffer)
    assert tb.batch_size == 6
    np.testing.assert_allclose(tb.In, [0.25] * 5 + [0.5])
    np.testing.assert_allclose(tb.S_next[-1], s_final)
    np.testing.assert_allclose(tb.S_next[-2], s_final)


def test_default_tracer_and_validation():
    buffer = SimpleReplayBuffer(100)
    env = RecordTransitions(gymnasium.make("CartPole-v1"), buffer)
    with pytest.raises(RuntimeError):
        env.step(0)
    s, _ = env.reset(seed=0)
    s_next, r, *_ = env.step(1)
    assert len(buffer) == 0  # the tracer pops a step once the next one arrives
    env.step(0)
    tb = contents(buffer)
    np.testing.assert_allclose(tb.S[0], s)
    np.testing.assert_allclose(tb.S_next[0], s_next)
    np.testing.assert_allclose(tb.In, [1.0])  # 1-step, gamma 1
    with pytest.raises(TypeError):
        RecordTransitions(gymnasium.make("CartPole-v1"), object())


@pytest.mark.requires(gymnasium="1.1")
@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_vector_env_one_tracer_per_sub_env(mode):
    num_envs = 3
    venv = gymnasium.vector.SyncVectorEnv(
        [lambda: gymnasium.make("CartPole-v1", max_episode_steps=12)] * num_envs,
        autoreset_mode=mode,
    )
    buffer = SimpleReplayBuffer(10_000)
    env = RecordTransitions(venv, buffer)
    assert isinstance(env, RecordVectorTransitions)
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(1)
    expected = [[] for _ in range(num_envs)]  # (S, A, R, In, S_next, ended) per sub-env
    skip = np.zeros(num_envs, bool)
    for _ in range(40):
        actions = rng.integers(2, size=num_envs)
        next_obs, rewards, term, trunc, info = env.step(actions)
        for i in range(num_envs):
            if skip[i]:
                continue
            final = info["final_obs"][i] if mode == "SameStep" and (term[i] or trunc[i]) else None
            s_next = next_obs[i] if final is None else final
            row = (obs[i], actions[i], rewards[i], 0.0 if term[i] else 1.0, s_next)
            expected[i].append(row + (term[i] or trunc[i],))
        skip = (term | trunc) & (mode == "NextStep")
        obs = next_obs
    # a 1-step tracer pops a step when the next one arrives or the episode ends
    expected = [rows if rows[-1][-1] else rows[:-1] for rows in expected]
    expected = [row[:-1] for rows in expected for row in rows]
    got = contents(buffer)
    assert got.batch_size == len(expected)
    assert np.any(got.In == 0)  # some episodes terminated within 40 steps

    def key(s, a, r, i, sn):
        sn = s if i == 0 else sn  # after termination S_next is a placeholder (a copy of S)
        return (np.round(s, 5).tobytes(), int(a), float(r), float(i), np.round(sn, 5).tobytes())

    want = sorted(key(*row) for row in expected)
    have = sorted(
        key(got.S[k], got.A[k], got.Rn[k], got.In[k], got.S_next[k]) for k in range(got.batch_size)
    )
    assert have == want


def test_vector_actions_as_a_list_are_recorded_like_an_array():
    def run(as_list):
        venv = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 2)
        buffer = SimpleReplayBuffer(100)
        env = RecordTransitions(venv, buffer)
        env.reset(seed=3)
        for t in range(5):
            actions = [t % 2, 1 - t % 2]
            env.step(actions if as_list else np.array(actions))
        return contents(buffer)

    got, want = run(as_list=True), run(as_list=False)
    assert got.batch_size == want.batch_size == 8
    np.testing.assert_array_equal(got.A, want.A)
    np.testing.assert_array_equal(got.S, want.S)
    env = RecordTransitions(
        gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 2),
        SimpleReplayBuffer(100),
    )
    s, _ = env.reset(seed=0)
    with pytest.raises(ValueError, match="one action per sub-env"):
        env.step([0])  # refused before the env steps
    env.step(np.array([1, 1]))
    env.step(np.array([1, 1]))
    np.testing.assert_allclose(contents(env.buffer).S, s)  # the steps started from s


def nan_reward_at(step):
    """CartPole whose reward at its given step (counted over the env's life) is NaN."""
    count = [0]

    def reward(r):
        count[0] += 1
        return float("nan") if count[0] == step else r

    return gymnasium.wrappers.TransformReward(gymnasium.make("CartPole-v1"), reward)


@pytest.mark.parametrize("vector", [False, True])
def test_a_step_whose_recording_fails_refuses_steps_until_reset(vector):
    buffer = SimpleReplayBuffer(100)
    if vector:
        env = RecordTransitions(
            gymnasium.vector.SyncVectorEnv([lambda: nan_reward_at(3)] * 2), buffer
        )
        action = np.array([0, 1])
    else:
        env = RecordTransitions(nan_reward_at(3), buffer)
        action = 0
    env.reset(seed=0)
    env.step(action)
    env.step(action)
    with pytest.raises(ValueError, match="finite"):
        env.step(action)  # the env stepped, the recorder could not follow
    with pytest.raises(RuntimeError, match="reset"):
        env.step(action)  # would record a transition from a stale observation
    s, _ = env.reset(seed=1)
    env.step(action)
    env.step(action)
    newest = list(buffer)[-2 if vector else -1]
    np.testing.assert_allclose(newest.S[0], s[0] if vector else s)


def test_monte_carlo_episodes_reach_the_buffer_in_time_order():
    from coax_utils.replay import MonteCarlo

    buffer = SimpleReplayBuffer(100, random_seed=0)
    env = RecordTransitions(
        gymnasium.make("CartPole-v1", max_episode_steps=5), buffer, MonteCarlo(0.9)
    )
    states = [env.reset(seed=0)[0]]
    for t in range(5):
        states.append(env.step(t % 2)[0])
    got = contents(buffer)
    np.testing.assert_allclose(got.S, states[:5])  # oldest first, as stepped
    np.testing.assert_allclose(got.Rn, [sum(0.9**j for j in range(5 - t)) for t in range(5)])
    window = buffer.sample_sequences(1, 5)
    assert window.mask.all()  # one episode, its last step marked as the end
    np.testing.assert_allclose(window.items.S[0], states[:5])


def assert_rows_equal(got, want):
    for field in ("S", "A", "logP", "Rn", "In", "S_next", "A_next", "logP_next", "W"):
        g, w = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert g.shape == w.shape, field
        np.testing.assert_array_equal(g, w, err_msg=field)


def record_against_single_tracers(venv, make_tracer, num_steps, mode, seed=0):
    """Record ``venv`` and trace the same steps with one single-env tracer per sub-env, the
    reference being stepped through the env's own outputs: ``final`` gives the observation a
    step led to. Returns (what the buffer holds, the reference rows in the same order)."""
    from coax_utils.replay import MonteCarlo

    buffer = SimpleReplayBuffer(100_000)
    env = RecordTransitions(venv, buffer, make_tracer())
    num_envs = env.num_envs
    singles = [make_tracer() for _ in range(num_envs)]
    obs, _ = env.reset(seed=seed)
    obs = np.asarray(obs)
    rng = np.random.default_rng(seed)
    skip = np.zeros(num_envs, bool)
    expected = []
    for _ in range(num_steps):
        actions = rng.integers(2, size=num_envs)
        next_obs, rewards, term, trunc, info = env.step(actions)
        next_obs, term, trunc = np.asarray(next_obs), np.asarray(term), np.asarray(trunc)
        ended = (term | trunc) & ~skip
        for i in range(num_envs):
            if skip[i]:
                continue
            if "final_observation" in info:  # gymnax: every sub-env's, batched
                s_next = np.asarray(info["final_observation"])[i]
            elif mode == "SameStep" and ended[i]:
                s_next = info["final_obs"][i]
            else:
                s_next = next_obs[i]
            singles[i].add(
                obs[i],
                actions[i],
                float(rewards[i]),
                bool(term[i]),
                truncated=bool(trunc[i]),
                s_next=s_next,
            )
            rows = []
            while singles[i]:
                rows.append(singles[i].pop())
            if rows and isinstance(singles[i], MonteCarlo):
                rows = [TransitionBatch.concatenate(*rows)[::-1]]
            expected.extend(rows)
        if mode == "Disabled" and ended.any():
            next_obs, _ = env.reset(options={"reset_mask": ended})
            next_obs = np.asarray(next_obs)
        skip = ended & (mode == "NextStep")
        obs = next_obs
    return contents(buffer), TransitionBatch.concatenate(*expected)


@pytest.mark.requires(gymnasium="1.1")
@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
@pytest.mark.parametrize("tracer", ["nstep", "monte_carlo"])
def test_vector_recording_equals_one_tracer_per_sub_env_in_every_autoreset_mode(mode, tracer):
    from coax_utils.replay import MonteCarlo

    venv = gymnasium.vector.SyncVectorEnv(
        [lambda: gymnasium.make("CartPole-v1", max_episode_steps=14)] * 4, autoreset_mode=mode
    )
    make = (lambda: NStep(n=3, gamma=0.9)) if tracer == "nstep" else (lambda: MonteCarlo(0.9))
    got, want = record_against_single_tracers(venv, make, 60, mode)
    assert got.batch_size == want.batch_size > 40
    assert np.any(got.In == 0) and np.any(np.isclose(got.In, 0.9))  # ends of both kinds
    assert_rows_equal(got, want)


def test_gymnax_vector_wrapper_final_observation_is_recorded():
    import gymnax
    from gymnax.wrappers.gym import GymnaxToVectorGymWrapper

    gx_env, params = gymnax.make("CartPole-v1")
    params = params.replace(max_steps_in_episode=7)  # truncations as well as terminations
    venv = GymnaxToVectorGymWrapper(gx_env, num_envs=3, params=params, seed=0)
    got, want = record_against_single_tracers(venv, lambda: NStep(n=2, gamma=0.9), 30, None)
    assert got.batch_size == want.batch_size >= 30 * 3 - 3 * 2
    assert_rows_equal(got, want)
    assert np.isclose(got.In, 0.9).sum() >= 3  # truncated episodes ended


def test_vector_recorder_refuses_tracers_it_cannot_vectorize():
    venv = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 2)
    with pytest.raises(ValueError, match="record_extra_info"):
        RecordTransitions(venv, SimpleReplayBuffer(10), NStep(2, 0.9, record_extra_info=True))
    with pytest.raises(ValueError, match="num_envs=3"):
        RecordTransitions(venv, SimpleReplayBuffer(10), NStep(2, 0.9, num_envs=3))
    with pytest.raises(TypeError, match="NStep or MonteCarlo"):
        RecordTransitions(venv, SimpleReplayBuffer(10), object())


def test_gymnax_final_observation_reaches_recorded_sequences():
    import gymnax
    from gymnax.wrappers.gym import GymnaxToVectorGymWrapper

    from coax_utils.replay import RecordVectorSequences, SequenceReplayBuffer

    class Logged(SequenceReplayBuffer):  # the real buffer, with a log of what it was given
        def add(self, steps, **kwargs):
            self.log.append((steps, kwargs))
            return super().add(steps, **kwargs)

    gx_env, params = gymnax.make("CartPole-v1")
    venv = GymnaxToVectorGymWrapper(
        gx_env, num_envs=2, params=params.replace(max_steps_in_episode=4), seed=0
    )
    buffer = Logged(100, 2, num_envs=2)
    buffer.log = []
    recorder = RecordVectorSequences(venv, buffer)
    obs, _ = recorder.reset(seed=0)
    for t in range(9):
        next_obs, _, term, trunc, info = recorder.step(np.array([t % 2, 1 - t % 2]))
        steps, kwargs = buffer.log[-1]
        np.testing.assert_array_equal(steps["obs"], np.asarray(obs))
        np.testing.assert_array_equal(steps["next_obs"], np.asarray(info["final_observation"]))
        assert kwargs["active"].all()  # gymnax resets within the step: no reset step follows
        if np.any(trunc):
            assert not np.allclose(steps["next_obs"], np.asarray(next_obs))
        obs = next_obs
    assert len(buffer) > 0
