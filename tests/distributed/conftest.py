"""One local Ray cluster shared by every test of tests/distributed (it takes seconds to start)."""

import os
import shutil
import tempfile
import warnings

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """Start a 2-CPU local Ray cluster once; shut it down after the last test."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray puts unix sockets under its temp dir, whose path must stay short (about 100 chars),
    # so the folder lives directly under /tmp rather than under pytest's deeper tmp_path.
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    with warnings.catch_warnings():
        # ray.init starts its services with fork + exec (subprocess with a preexec_fn);
        # once JAX is loaded, its at-fork hook warns about forking a multithreaded process,
        # a hazard that exec removes here.
        warnings.filterwarnings("ignore", "os.fork\\(\\) was called", RuntimeWarning)
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _temp_dir=temp_dir,
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
