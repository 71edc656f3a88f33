"""ParameterServer: versioned parameters on a real local Ray cluster."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.distributed import ParameterServer


def test_versions_and_pull_only_when_newer(ray_cluster):
    ray = ray_cluster
    params = {"linear": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}}
    store = ParameterServer.remote(params)
    assert ray.get(store.version.remote()) == 1
    version, got = ray.get(store.get.remote())
    assert version == 1
    assert isinstance(got["linear"]["w"], np.ndarray)  # host copies: no device needed
    assert got["linear"]["b"].dtype == jnp.bfloat16
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), got, params)
    )
    assert ray.get(store.get_if_newer.remote(1)) is None

    new = jax.tree_util.tree_map(lambda x: x + 1, params)
    assert ray.get(store.set.remote(new)) == 2
    version, got = ray.get(store.get_if_newer.remote(1))
    assert version == 2
    np.testing.assert_array_equal(got["linear"]["w"], np.full((2, 3), 2.0))
    assert ray.get(store.get_if_newer.remote(2)) is None

    with pytest.raises(ValueError, match="got None"):
        ray.get(store.set.remote(None))
    assert ray.get(store.version.remote()) == 2
    ray.kill(store)


def test_published_parameters_are_copies_nobody_changes_in_place():
    w = np.array([1.0, 2.0])
    store = ParameterServer({"w": w})
    w[0] = 99.0  # the learner reuses its array after publishing
    version, got = store.get()
    np.testing.assert_array_equal(got["w"], [1.0, 2.0])
    with pytest.raises(ValueError, match="read-only"):
        got["w"][1] = -5.0  # a reader cannot change what the others get
    assert store.get()[1]["w"][1] == 2.0
    for bad in (1.5, "2", True):
        with pytest.raises(TypeError, match="version must be an int"):
            store.get_if_newer(bad)
    assert store.get_if_newer(np.int64(0))[0] == 1


def test_a_version_ahead_of_the_store_is_refused_not_answered_with_none(ray_cluster):
    ray = ray_cluster
    store = ParameterServer.options(max_restarts=1).remote({"w": np.zeros(2)})
    for value in (1.0, 2.0):
        ray.get(store.set.remote({"w": np.full(2, value)}))
    assert ray.get(store.get.remote())[0] == 3  # a worker now holds version 3
    ray.kill(store, no_restart=False)  # Ray restarts it: version 1, the initial parameters
    deadline = time.monotonic() + 60
    while True:  # ray.kill is asynchronous: a call may still reach the old process
        try:
            if ray.get(store.version.remote()) == 1:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the store did not restart"
        time.sleep(0.1)
    # "nothing newer" would keep the worker on version 3 while the store serves version 1
    with pytest.raises(ValueError, match="ahead"):
        ray.get(store.get_if_newer.remote(3))
    assert ray.get(store.get_if_newer.remote(0))[0] == 1
    ray.kill(store)


def test_a_reader_that_rebinds_a_leaf_of_its_copy_changes_nothing_for_the_others():
    # in-process: the leaves were read-only, but every reader got the store's own dicts, so
    # assigning into one (a common way to "edit" haiku params) changed what all others got
    store = ParameterServer({"linear": {"w": np.array([1.0, 2.0])}})
    _, mine = store.get()
    mine["linear"]["w"] = np.zeros(2)
    mine["extra"] = np.ones(1)
    _, newer = store.get_if_newer(0)
    for _, got in (store.get(), (1, newer)):
        assert set(got) == {"linear"}
        np.testing.assert_array_equal(got["linear"]["w"], [1.0, 2.0])
