"""Weakly typed jax arrays come back weak, and rebuilding them compiles nothing: a small file
naming hundreds of shapes costs neither compilations nor the memory their executables hold."""

from __future__ import annotations

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils
from coax_utils.utils._checkpoint import container as _ckpt_container


@contextlib.contextmanager
def compilations():
    """Collect the names of the backend compilations that happen inside the block."""
    seen: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event.endswith("backend_compile_duration"):
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def forge(root, buffers, data: bytes) -> bytes:
    structure = json.dumps({"root": root, "buffers": buffers, "pickled": []}).encode()
    segments = [[memoryview(structure)], [memoryview(b"")], [memoryview(data)]]
    return _ckpt_container.container_bytes(2, {"format": "forged"}, segments, uncompressed=1)


@pytest.mark.requires(jax="0.8.1")
def test_a_small_file_of_300_distinct_weak_shapes_compiles_nothing():
    shapes = [[i, 0, 3] for i in range(300)]  # zero-size: no bytes in the file
    items = [["j", i + 1, "<f4", shape, True, i] for i, shape in enumerate(shapes)]
    s = forge(["l", 0, items], [[2, 0, 0]] * 300, b"")
    assert len(s) < 20_000
    for _ in range(2):  # and again: nothing was cached that a second load could reuse
        with compilations() as seen:
            restored = utils.loads(s, safe=True)
        assert seen == []
        assert [list(x.shape) for x in restored] == shapes
        assert all(x.weak_type and x.dtype == jnp.float32 for x in restored)


@pytest.mark.requires(jax="0.8.1")
def test_weak_and_strong_arrays_round_trip_with_their_types():
    weak = {
        "scalar": jnp.asarray(2.5),
        "int": jnp.asarray(7),
        "complex": jnp.asarray(1 + 2j),
        "matrix": jnp.full((3, 4), 0.5).at[1, 2].set(3.0),
        "empty": jnp.full((0, 5), 1.0),
    }
    strong = {"f": jnp.arange(4.0), "h": jnp.ones(3, jnp.float16), "b": jnp.ones(2, bool)}
    assert all(x.weak_type for x in weak.values())
    s = utils.dumps({"weak": weak, "strong": strong})
    with compilations() as seen:
        restored = utils.loads(s, safe=True)
    assert seen == []
    for group, original in (("weak", weak), ("strong", strong)):
        for k, x in original.items():
            y = restored[group][k]
            assert isinstance(y, jax.Array)
            assert (y.dtype, y.shape, y.weak_type) == (x.dtype, x.shape, x.weak_type)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    # weak semantics survive: a weak float adopts the dtype of a strong half-precision operand
    assert (restored["weak"]["matrix"] + jnp.ones((), jnp.float16)).dtype == jnp.float16
    assert (restored["strong"]["f"] + jnp.ones((), jnp.float16)).dtype == jnp.float32
