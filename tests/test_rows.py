"""Rows of words (coax_utils/_rows.py): every dtype and shape comes back bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._rows import RowLayout


def test_rows_round_trip_every_dtype_with_leading_axes():
    rng = np.random.default_rng(0)
    lead = (3, 5)
    tree = {
        "f32": rng.normal(size=lead + (2, 3)).astype(np.float32),
        "i8": rng.integers(-128, 128, lead + (5,)).astype(np.int8),
        "u8": rng.integers(0, 256, lead + (84, 3)).astype(np.uint8),
        "u16": rng.integers(0, 2**16, lead + (3,)).astype(np.uint16),
        "bool": rng.random(lead) < 0.5,
        "i32": rng.integers(-(2**31), 2**31, lead + (1,)).astype(np.int32),
        "nan": np.full(lead, np.nan, np.float32),
    }
    layout = RowLayout.of(jax.tree_util.tree_map(lambda x: x[0, 0], tree))
    # each leaf takes whole words: 6, 2 (5 bytes), 63, 2 (6 bytes), 1, 1, 1
    assert layout.width == 6 + 2 + 63 + 2 + 1 + 1 + 1
    rows = layout.pack(tree)
    assert rows.shape == lead + (layout.width,) and rows.dtype == jnp.uint32
    back = jax.jit(layout.unpack)(rows)
    for name, x in tree.items():
        assert back[name].dtype == x.dtype and back[name].shape == x.shape, name
        np.testing.assert_array_equal(
            np.asarray(back[name]).view(np.uint8), x.view(np.uint8), err_msg=name
        )
    # one row of a gather is the row of the tree
    one = layout.unpack(rows[2, 4])
    np.testing.assert_array_equal(np.asarray(one["u8"]), tree["u8"][2, 4])
    assert layout.pack(jax.tree_util.tree_map(lambda x: x[2, 4], tree)).shape == (layout.width,)
