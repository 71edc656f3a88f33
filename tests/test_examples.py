"""The examples run end to end with ``--smoke`` (a few hundred steps each), as CI runs them."""

from __future__ import annotations

import functools
import pathlib

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

from coax_utils import utils
from coax_utils.replay import make_prioritized_buffer
from tests._examples import EXAMPLES, load_example_module, run_example


def check_returns(outdir: pathlib.Path, script: str, max_step: int) -> np.ndarray:
    """The run's learning curve: ``outdir/returns.csv`` names the command, holds at least
    one episode, and its env steps are positive, non-decreasing and at most ``max_step``.
    Returns the episode returns."""
    path = outdir / "returns.csv"
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# command: python {EXAMPLES.as_posix()}/{script} --smoke"), first
    steps, returns = load_example_module("_common").read_returns(path)
    assert len(steps) == len(returns) >= 1
    assert steps[0] > 0 and np.all(np.diff(steps) >= 0) and steps[-1] <= max_step, steps
    assert np.all(np.isfinite(returns))
    return returns


def test_dqn_cartpole_smoke(tmp_path):
    stdout = run_example("dqn_cartpole.py", "--smoke", "--outdir", str(tmp_path))
    assert "resumed from the checkpoint at step" in stdout
    assert "smoke run finished" in stdout
    checkpoint = tmp_path / "checkpoint.pkl.lz4"
    gif = tmp_path / "dqn_cartpole.gif"
    assert checkpoint.is_file()
    assert gif.read_bytes()[:6] in (b"GIF87a", b"GIF89a")
    agent = utils.load(checkpoint)
    assert agent["step"] > 0
    assert len(agent["buffer"]) > 0
    assert jax.tree_util.tree_structure(agent["params"]) == jax.tree_util.tree_structure(
        agent["target_params"]
    )
    # every CartPole episode returns its length (at least 8 steps); the file holds the
    # episodes of both phases, as the agent does
    returns = check_returns(tmp_path, "dqn_cartpole.py", max_step=agent["step"])
    np.testing.assert_array_equal(returns, agent["returns"])
    np.testing.assert_array_equal(
        np.loadtxt(tmp_path / "returns.csv", delimiter=",", skiprows=2, ndmin=2)[:, 0],
        agent["episode_ends"],
    )
    assert np.all(returns >= 8) and np.all(returns == np.round(returns))

    # --resume continues from the newest checkpoint: at max_steps there is nothing left to
    # train, and the curve holds the same episodes
    stdout = run_example("dqn_cartpole.py", "--smoke", "--outdir", str(tmp_path), "--resume")
    assert f"resumed from the checkpoint at step {agent['step']}" in stdout
    np.testing.assert_array_equal(check_returns(tmp_path, "dqn_cartpole.py", 600), returns)


def test_dqn_atari_smoke(tmp_path):
    stdout = run_example("dqn_atari.py", "--smoke", "--outdir", str(tmp_path))
    assert "smoke run finished" in stdout
    from coax_utils.replay import PrioritizedFrameStackReplayBuffer

    buffer = PrioritizedFrameStackReplayBuffer.load(tmp_path / "buffer")
    # each frame is stored about once (stacked storage would hold 4 per transition); episode
    # starts and the frames a match may not reference add a few, never a multiple
    assert 0 < buffer.frame_count < 1.5 * len(buffer)
    assert buffer.sample(2).S.shape == (2, 4, 84, 84)
    # smoke episodes are cut at 60 agent steps: a Pong score lies in [-21, 21]
    returns = check_returns(tmp_path, "dqn_atari.py", max_step=160)
    assert np.all(np.abs(returns) <= 21)


def test_iqn_cartpole_smoke(tmp_path):
    stdout = run_example("iqn_cartpole.py", "--smoke", "--outdir", str(tmp_path))
    assert "step    300  episodes" in stdout
    assert "evaluation: average return" in stdout
    assert "smoke run OK" in stdout
    params = utils.load(tmp_path / "params.pkl.lz4")
    assert jax.tree_util.tree_leaves(params)
    assert np.all(check_returns(tmp_path, "iqn_cartpole.py", max_step=300) >= 8)


def test_ddpg_pendulum_smoke(tmp_path):
    stdout = run_example("ddpg_pendulum.py", "--smoke", "--outdir", str(tmp_path))
    assert "step    300  episodes" in stdout
    assert "evaluation: average return" in stdout
    assert "smoke run OK" in stdout
    params = utils.load(tmp_path / "params.pkl.lz4")
    assert set(params) == {"actor", "critic"}
    # Pendulum episodes last 200 steps, each step's reward in [-16.3, 0]
    returns = check_returns(tmp_path, "ddpg_pendulum.py", max_step=300)
    assert len(returns) == 1 and -16.3 * 200 <= returns[0] <= 0


@pytest.mark.parametrize("env", ["jax", "gymnasium"])
def test_jitted_dqn_smoke(tmp_path, env):
    stdout = run_example("jitted_dqn.py", "--smoke", "--env", env, "--outdir", str(tmp_path))
    assert f"on the {env} CartPole" in stdout
    assert "step    300  episodes" in stdout
    assert "smoke run OK" in stdout
    state = utils.load(tmp_path / "state.pkl.lz4")
    # 300 collected transitions went through the donated, jitted prioritized buffer
    assert int(state["step"]) == 300
    assert int(state["buffer"].size) == 300
    returns = check_returns(tmp_path, "jitted_dqn.py", max_step=300)
    assert np.all(returns >= 8) and np.all(returns == np.round(returns))


@functools.cache
def _load_jitted_dqn():
    return load_example_module("jitted_dqn")


@settings(max_examples=15, deadline=None)
@given(
    dones=st.lists(st.booleans(), min_size=1, max_size=12),
    capacity=st.integers(min_value=1, max_value=8),
)
def test_jitted_dqn_n_step_batch_matches_a_naive_oracle(dones, capacity):
    jdqn = _load_jitted_dqn()
    gamma, n = jdqn.GAMMA, jdqn.N_STEP
    buffer = make_prioritized_buffer(capacity)
    example = {
        "s": np.zeros(1, np.float32),
        "a": np.int32(0),
        "r": np.float32(0.0),
        "terminated": np.bool_(False),
        "s_next": np.zeros(1, np.float32),
    }
    state = buffer.init(example)
    # step t has reward t + 1 and next state t + 1; the episode ends (terminated) where done
    history = []
    for t, done in enumerate(dones):
        item = {
            "s": np.full((1, 1), t, np.float32),
            "a": np.zeros(1, np.int32),
            "r": np.full(1, t + 1, np.float32),
            "terminated": np.full(1, done),
            "s_next": np.full((1, 1), t + 1, np.float32),
        }
        state = buffer.add(state, item, episode_end=np.full(1, done))
        history.append((t + 1.0, done))
    stored = list(range(max(0, len(dones) - capacity), len(dones)))  # steps still in the buffer
    slots = np.array([t % capacity for t in stored], np.int32)
    batch = jdqn.n_step_batch(state, slots)

    for row, t in enumerate(stored):
        rn, discount, k = 0.0, 0.0, 0
        while True:  # the oracle: walk forward in time within the episode and the buffer
            r, done = history[t + k]
            rn += gamma**k * r
            k += 1
            if done:
                discount = 0.0
                break
            discount = gamma**k
            if k == n or t + k >= len(history):
                break
        np.testing.assert_allclose(batch["s"][row, 0], t)
        np.testing.assert_allclose(batch["rn"][row], rn, rtol=1e-5)
        np.testing.assert_allclose(batch["discount"][row], discount, rtol=1e-5)
        np.testing.assert_allclose(batch["s_next"][row, 0], t + k)
