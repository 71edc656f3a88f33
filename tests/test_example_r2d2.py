"""The R2D2 example runs end to end with ``--smoke``, as CI runs it."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np

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


def test_r2d2_cartpole_smoke(tmp_path):
    stdout = run_example("r2d2_cartpole.py", "--smoke", "--outdir", str(tmp_path))
    assert "smoke run finished" in stdout
    # it trained (a finite loss was logged) and evaluated the greedy LSTM policy
    losses = [float(x) for x in re.findall(r"loss (\S+)", stdout)]
    assert losses and all(np.isfinite(losses))
    match = re.search(r"greedy evaluation over 10 episodes: average return (\S+)", stdout)
    assert match and float(match.group(1)) >= 8.0  # CartPole episodes last 8 steps at least
