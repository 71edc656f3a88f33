"""The mesh-sharded jittable buffers (``coax_utils/replay/_mesh.py``).

The checks on 1, 2 and 8 forced CPU devices run in ``tests/replay/mesh_driver.py``, one
process per device count (the device count is fixed when jax starts): sampled distributions
against one buffer's (chi-square) and the importance-weight formula, and with
``scope="shard"`` each shard's frequencies against its own priorities, the per-shard weights
and no collective in the compiled sample and update; updates reaching the owning shard,
checkpoints restored onto the mesh continuing the same stream, bad input refused before
anything is written, everything under ``jax.transfer_guard("disallow")``. The same for the
sequence buffers (sub-envs split over the devices: every sampled window is one that a big
buffer fed the same stream holds, R2D2 priorities set by the owning shard) and the frame-stack
buffers (stacks rebuilt as added, transitions that lost frames never sampled, also when
drawn uniformly over the whole mesh).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from coax_utils.replay import SimpleReplayBuffer, make_uniform_buffer
from coax_utils.replay._mesh import shard_buffer

DRIVER = pathlib.Path(__file__).with_name("mesh_driver.py")


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_mesh_buffers_on_forced_cpu_devices(devices, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run(
        [sys.executable, str(DRIVER), str(devices), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert f"mesh checks passed on {devices} devices" in out.stdout


def test_shard_buffer_refuses_what_it_cannot_shard():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        shard_buffer(make_uniform_buffer(8), mesh, "batch")
    with pytest.raises(TypeError, match="make_uniform_buffer, make_prioritized_buffer, "):
        shard_buffer(SimpleReplayBuffer(8), mesh, "data")  # a host buffer
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        shard_buffer(make_uniform_buffer(8), jax.devices(), "data")
