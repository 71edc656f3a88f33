"""The Ape-X example runs end to end (`--smoke`) on its own local Ray cluster."""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "apex_dqn_ray.py"


def test_apex_example_smoke_run(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray needs a short socket path
    try:
        out = subprocess.run(
            [
                sys.executable,
                str(EXAMPLE),
                "--smoke",
                "--temp-dir",
                temp_dir,
                "--outdir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "smoke run OK" in out.stdout
    assert "learner step    200" in out.stdout
    assert "evaluation: average return" in out.stdout
    # the learning curve: CartPole episodes of the workers, stamped with the env steps of
    # all workers together (at most what the run reports)
    lines = (tmp_path / "returns.csv").read_text().splitlines()
    assert lines[0].startswith("# command: python ") and "--smoke" in lines[0]
    assert lines[1] == "env_step,episode_return"
    rows = np.array([line.split(",") for line in lines[2:]], float)
    assert len(rows) >= 1
    env_steps = int(out.stdout.split(" learner steps, ")[1].split(" env steps")[0])
    assert np.all(np.diff(rows[:, 0]) >= 0) and 0 < rows[-1, 0] <= env_steps
    assert np.all(rows[:, 1] >= 8) and np.all(rows[:, 1] <= 500)
