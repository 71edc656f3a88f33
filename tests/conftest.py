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


def missing_versions(versions: dict[str, str]) -> list[str]:
    """``"jax>=0.8 (installed 0.4.36)"`` for each distribution older than required."""
    out = []
    for name, needed in versions.items():
        dist = name.replace("_", "-")
        installed = importlib.metadata.version(dist)  # PackageNotFoundError: a typo fails
        if Version(installed) < Version(str(needed)):
            out.append(f"{dist}>={needed} (installed {installed})")
    return out


# Tests of other areas that need a newer version than the floor, until their files carry
# the marker themselves: node id (a prefix covers every parameter) -> versions needed.
NEEDS_NEWER = {
    # gymnasium.vector.SyncVectorEnv(autoreset_mode=...)
    "tests/replay/test_record.py::test_vector_env_one_tracer_per_sub_env": {"gymnasium": "1.1"},
    # jax.enable_x64
    "tests/sources/test_array.py::test_int64_data_is_kept_exact_with_x64": {"jax": "0.8"},
    "tests/utils/test_schedules.py::test_int64_steps_are_exact": {"jax": "0.8"},
    "tests/utils/test_segment_tree_fn.py::test_float64_state_agrees_with_host_sum_tree": {
        "jax": "0.8"
    },
    # jax.export without importing it
    "tests/utils/test_segment_tree_fn.py::"
    "test_auto_strategy_follows_the_platform_it_is_compiled_for": {"jax": "0.8"},
    # jax.monitoring.unregister_event_duration_listener
    "tests/utils/test_checkpoint_weak.py::"
    "test_a_small_file_of_300_distinct_weak_shapes_compiles_nothing": {"jax": "0.8.1"},
    "tests/utils/test_checkpoint_weak.py::"
    "test_weak_and_strong_arrays_round_trip_with_their_types": {"jax": "0.8.1"},
    # the test expects Pillow's OverflowError for a frame too wide for a GIF (Pillow 13;
    # earlier releases raise struct.error, and the earlier file is kept all the same)
    "tests/utils/test_gif.py::test_a_failed_save_leaves_the_earlier_file": {"pillow": "13.0"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for prefix, versions in NEEDS_NEWER.items():
            if item.nodeid == prefix or item.nodeid.startswith(prefix + "["):
                item.add_marker(pytest.mark.requires(**versions))


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(name="requires"):
        if mark.args:
            raise TypeError(f"requires takes keyword arguments only, got {mark.args!r}")
        missing = missing_versions(mark.kwargs)
        if missing:
            pytest.skip(f"needs {', '.join(missing)}")
