"""The Ape-X example runs end to end (`--smoke`) on its own local Ray cluster."""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "apex_dqn_ray.py"


def test_apex_example_smoke_run():
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray needs a short socket path
    try:
        out = subprocess.run(
            [sys.executable, str(EXAMPLE), "--smoke", "--temp-dir", temp_dir],
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
