"""The Anakin-style DQN example runs end to end with ``--smoke`` on 8 forced CPU devices."""

from __future__ import annotations

import re

from tests._examples import run_example


def test_anakin_dqn_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    stdout = run_example("anakin_dqn.py", "--smoke", "--outdir", str(tmp_path))
    assert "smoke run OK" in stdout
    assert stdout.startswith("== 8 devices (cpu)")
    # 3 chunks of 20 steps of 8 envs on each of the 8 devices, all of them stored and restored
    assert len(re.findall(r"^chunk ", stdout, re.M)) == 3
    assert (
        "buffer of 3840 transitions saved" in stdout and "restored onto the 8-device mesh" in stdout
    )
    assert (tmp_path / "buffer.ckpt").is_file() and (tmp_path / "returns.csv").is_file()
