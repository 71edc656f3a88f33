"""The R2D2 example runs end to end with ``--smoke``, as CI runs it."""

from __future__ import annotations

import re

import numpy as np

from tests._examples import run_example


def test_r2d2_cartpole_smoke(tmp_path):
    stdout = run_example("r2d2_cartpole.py", "--smoke", "--outdir", str(tmp_path))
    assert "smoke run finished" in stdout
    # it trained (a finite loss was logged) and evaluated the greedy LSTM policy
    losses = [float(x) for x in re.findall(r"loss (\S+)", stdout)]
    assert losses and all(np.isfinite(losses))
    match = re.search(r"greedy evaluation over 10 episodes: average return (\S+)", stdout)
    assert match and float(match.group(1)) >= 8.0  # CartPole episodes last 8 steps at least
