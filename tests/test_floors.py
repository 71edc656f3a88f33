"""The declared floors are the tested ones: pyproject.toml and constraints/floor.txt agree.

The floor job (``make test-floor``) installs constraints/floor.txt and sets
``COAX_UTILS_FLOOR_JOB=1``: there every pinned distribution and Python itself must be
exactly at the floor; in any other run they must be at it or above.
"""

import importlib.metadata
import os
import sys
import tomllib
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from coax_utils.replay import RecordTransitions, SimpleReplayBuffer
from tests.conftest import missing_versions

ROOT = Path(__file__).resolve().parents[1]
FLOOR_JOB = os.environ.get("COAX_UTILS_FLOOR_JOB") == "1"
UNTESTED_EXTRAS = {"bench"}  # the peers the benchmarks compare with, not used by the package


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared_floors():
    """{distribution: floor} of pyproject's dependencies and tested extras."""
    project = _project()
    lines = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra not in UNTESTED_EXTRAS:
            lines += items
    floors = {}
    for line in lines:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == "coax-utils":  # dev names the other extras
            continue
        lower = [s for s in req.specifier if s.operator in (">=", "==")]
        assert len(lower) == 1, f"{line!r} must declare exactly one floor (>= or ==)"
        floor = Version(lower[0].version)
        assert floors.setdefault(name, floor) == floor, f"{name} has two floors"
    return floors


def pinned_floors():
    """{distribution: version} of constraints/floor.txt (each pinned with ==)."""
    pins = {}
    for raw in (ROOT / "constraints" / "floor.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{raw!r} is not a pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{name} is pinned twice"
        pins[name] = Version(specs[0].version)
    return pins


def test_constraints_pin_exactly_the_declared_floors():
    declared, pinned = declared_floors(), pinned_floors()
    assert sorted(declared) == sorted(pinned)
    differ = {k: (str(v), str(pinned[k])) for k, v in declared.items() if v != pinned[k]}
    assert not differ, f"declared floor, pinned version: {differ}"


@pytest.mark.parametrize("name", sorted(pinned_floors()))
def test_the_installed_version_is_the_floor_in_the_floor_job(name):
    installed = Version(importlib.metadata.version(name))
    floor = pinned_floors()[name]
    if FLOOR_JOB:
        assert installed == floor
    else:
        assert installed >= floor


def test_python_is_the_declared_floor_in_the_floor_job():
    spec = _project()["requires-python"]
    assert spec.startswith(">="), spec
    floor = tuple(int(p) for p in spec[2:].split("."))
    if FLOOR_JOB:
        assert sys.version_info[: len(floor)] == floor
    else:
        assert sys.version_info[: len(floor)] >= floor


def test_the_requires_marker_names_what_is_missing():
    assert missing_versions({"numpy": "1.0"}) == []
    installed = importlib.metadata.version("numpy")
    assert missing_versions({"numpy": "999", "pytest": "1"}) == [
        f"numpy>=999 (installed {installed})"
    ]
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        missing_versions({"nmupy": "1.0"})  # a typo fails instead of skipping


def _vector_env_declaring(mode):
    env = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 2)
    env.metadata = {**env.metadata, "autoreset_mode": mode}
    return env


def test_recording_reads_autoreset_modes_where_gymnasium_has_them():
    # gymnasium 1.1 brought autoreset modes; before, every vector env resets on the next step
    # and a mode that an env declares anyway is refused rather than misread
    env = _vector_env_declaring("SameStep")
    if Version(gymnasium.__version__) >= Version("1.1"):
        assert RecordTransitions(env, SimpleReplayBuffer(10)).num_envs == 2
    else:
        with pytest.raises(ValueError, match="autoreset_mode 'SameStep'.*gymnasium 1.1"):
            RecordTransitions(env, SimpleReplayBuffer(10))
    # the default (next-step) vector env is recorded on every version
    recorder = RecordTransitions(_vector_env_declaring("NextStep"), SimpleReplayBuffer(10))
    recorder.reset(seed=0)
    for _ in range(3):  # a 1-step tracer holds each transition until the next step
        recorder.step(np.zeros(2, np.int64))
    assert len(recorder.buffer) == 4
