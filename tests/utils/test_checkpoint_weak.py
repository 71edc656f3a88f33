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


def test_a_file_may_hold_only_so_many_jax_arrays_for_its_size():
    # each jax array costs a fixed time to create, even a zero-size one that needs no bytes
    # of the file: past jax_array_budget(file size), a file is refused before the rest is made
    from coax_utils.utils._checkpoint.registry import jax_array_budget

    def zero_size_arrays(n: int) -> bytes:
        items = [["j", i + 1, "<f4", [0, i], False, i] for i in range(n)]
        return forge(["l", 0, items], [[2, 0, 0]] * n, b"")

    budget = jax_array_budget(len(zero_size_arrays(3000)))
    assert budget < 3000
    with pytest.raises(utils.CheckpointDamagedError, match=f"more than {budget} jax arrays"):
        utils.loads(zero_size_arrays(3000), safe=True)
    s = zero_size_arrays(1000)
    assert 1000 <= jax_array_budget(len(s)) <= jax_array_budget(10**6) == 2000
    restored = utils.loads(s, safe=True)
    assert [x.shape for x in restored] == [(0, i) for i in range(1000)]


@pytest.mark.parametrize("to_file", [False, True])
def test_many_tiny_jax_arrays_past_the_budget_go_to_the_pickle_section(tmp_path, to_file):
    from coax_utils.utils._checkpoint.registry import jax_array_budget

    obj = {"arrays": [jnp.full((1,), i, jnp.float32) for i in range(3000)], "step": 7}
    path = tmp_path / "tiny.ckpt"
    if to_file:
        utils.dump(obj, path)
        s = path.read_bytes()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.ckpt"]  # no temp left
    else:
        s = utils.dumps(obj)
    source = _ckpt_container.MemorySource(memoryview(s))
    container = _ckpt_container.parse(source, 2)
    tree = json.loads(_ckpt_container.read_segments(source, container, [0])[0].tobytes())
    (arrays_node,) = [v for k, v in tree["root"][2] if k == "arrays"]
    held = sum(1 for x in arrays_node[2] if x[0] == "j")
    assert 1024 <= held <= jax_array_budget(len(s)) < 3000  # the rest went to the pickle section
    restored = utils.loads(s)  # safe=False unpickles the rest
    assert restored["step"] == 7
    assert all(isinstance(x, jax.Array) for x in restored["arrays"])
    assert [float(x[0]) for x in restored["arrays"]] == list(range(3000))
    with pytest.raises(utils.UnsafeCheckpointError, match="jax arrays a file of this size"):
        utils.loads(s, safe=True)
