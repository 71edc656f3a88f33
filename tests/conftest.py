"""Suite-wide test settings: the ``requires`` marker for tests that need a newer dependency.

``@pytest.mark.requires(jax="0.8", gymnasium="1.2.2")`` skips a test when an installed
distribution is older than the version given, with a reason naming both versions. The
floor job (``make test-floor``, the declared floors pinned exactly) skips only such tests;
on the latest versions nothing is skipped by it. A keyword names a distribution (``_`` for
``-``: ``dm_haiku="0.0.14"``); a distribution that is not installed fails the test, so a
typo cannot hide one. The marker is registered in pyproject.toml.
"""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.version import Version

# scripts the tests run in processes of their own (they read their arguments at import)
collect_ignore = ["replay/mesh_driver.py"]


def missing_versions(versions: dict[str, str]) -> list[str]:
    """``"jax>=0.8 (installed 0.4.36)"`` for each distribution older than required."""
    out = []
    for name, needed in versions.items():
        dist = name.replace("_", "-")
        installed = importlib.metadata.version(dist)  # PackageNotFoundError: a typo fails
        if Version(installed) < Version(str(needed)):
            out.append(f"{dist}>={needed} (installed {installed})")
    return out


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(name="requires"):
        if mark.args:
            raise TypeError(f"requires takes keyword arguments only, got {mark.args!r}")
        missing = missing_versions(mark.kwargs)
        if missing:
            pytest.skip(f"needs {', '.join(missing)}")
