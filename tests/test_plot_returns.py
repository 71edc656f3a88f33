"""examples/plot_returns.py turns the examples' returns files into PNG learning curves."""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests._examples import EXAMPLES, ROOT
from tests._examples import load_example_module as load


def run_plot(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "plot_returns.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def png_size(path: pathlib.Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk (fails on anything else)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_writes_one_png_per_returns_file(tmp_path):
    common = load("_common")
    run = tmp_path / "runs" / "dqn_cartpole"
    steps = np.cumsum(np.arange(10, 60))
    common.write_returns(run, steps, np.arange(10, 60, dtype=float))
    other = tmp_path / "ddpg_pendulum.csv"
    other.write_text("env_step,episode_return\n200,-1500.5\n400,-1200\n600,-300.25\n")
    out = run_plot(str(run / "returns.csv"), str(other), "--outdir", str(tmp_path / "png"))
    assert out.returncode == 0, out.stdout + out.stderr
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert pngs == ["curve_ddpg_pendulum.png", "curve_dqn_cartpole.png"]
    # 6.4 x 3.6 inches at the default 90 dpi
    assert png_size(tmp_path / "png" / "curve_dqn_cartpole.png") == (576, 324)
    assert png_size(tmp_path / "png" / "curve_ddpg_pendulum.png") == (576, 324)


def test_dpi_sets_the_size(tmp_path, capsys):
    path = tmp_path / "iqn.csv"
    path.write_text("# command: python examples/iqn_cartpole.py\nenv_step,episode_return\n9,9\n")
    assert load("plot_returns").main([str(path), "--outdir", str(tmp_path), "--dpi", "50"]) == 0
    assert png_size(tmp_path / "curve_iqn.png") == (320, 180)
    assert capsys.readouterr().out == f"{path} -> {tmp_path / 'curve_iqn.png'}\n"


@pytest.mark.parametrize(
    "text", ["step,return\n1,2\n", "env_step,episode_return\n", "", "# command: x\n"]
)
def test_rejects_a_file_that_is_not_a_learning_curve(tmp_path, capsys, text):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    assert load("plot_returns").main([str(path), "--outdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("plot_returns.py: error: ") and "bad.csv" in err
    assert not (tmp_path / "curve_bad.png").exists()


def test_moving_average_matches_a_naive_one():
    plot_returns = load("plot_returns")
    rng = np.random.default_rng(0)
    values = rng.normal(size=37)
    for window in (1, 5, 37, 50):
        naive = [values[max(0, i + 1 - window) : i + 1].mean() for i in range(len(values))]
        np.testing.assert_allclose(plot_returns.moving_average(values, window), naive)


def test_write_returns_refuses_mismatched_lengths_and_writes_nothing(tmp_path):
    common = load("_common")
    with pytest.raises(ValueError, match="differ in length"):
        common.write_returns(tmp_path, [1, 2], [1.0])
    assert list(tmp_path.iterdir()) == []
