"""The examples run end to end with ``--smoke`` (a few hundred steps each), as CI runs them."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from coax_utils import utils

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(script: str, *args: str) -> str:
    """Run ``examples/<script>`` in a fresh interpreter; return its stdout (must exit 0)."""
    env = {**os.environ, "SDL_VIDEODRIVER": "dummy", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


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


def test_iqn_cartpole_smoke(tmp_path):
    stdout = run_example("iqn_cartpole.py", "--smoke", "--outdir", str(tmp_path))
    assert "step    300  episodes" in stdout
    assert "evaluation: average return" in stdout
    assert "smoke run OK" in stdout
    params = utils.load(tmp_path / "params.pkl.lz4")
    assert jax.tree_util.tree_leaves(params)


def test_ddpg_pendulum_smoke(tmp_path):
    stdout = run_example("ddpg_pendulum.py", "--smoke", "--outdir", str(tmp_path))
    assert "step    300  episodes" in stdout
    assert "evaluation: average return" in stdout
    assert "smoke run OK" in stdout
    params = utils.load(tmp_path / "params.pkl.lz4")
    assert set(params) == {"actor", "critic"}


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
