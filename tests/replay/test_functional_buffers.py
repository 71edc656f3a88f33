"""Jittable buffers: ring semantics, sampling laws, jit/vmap/donation and no retracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.replay import make_prioritized_buffer, make_uniform_buffer


def items(ts, dim=2):
    ts = jnp.asarray(ts, jnp.int32)
    return {"obs": jnp.repeat(ts[:, None].astype(jnp.float32), dim, axis=1), "t": ts}


EXAMPLE = {"obs": jnp.zeros(2), "t": jnp.int32(0)}


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_ring_overwrite_and_only_filled_slots_sampled(make):
    buffer = make(7)
    add = jax.jit(buffer.add, donate_argnums=0)
    sample = jax.jit(buffer.sample, static_argnums=2)
    state = buffer.init(EXAMPLE)
    assert not bool(buffer.can_sample(state, 1))
    state = add(state, items([0, 1, 2]))
    assert bool(buffer.can_sample(state, 3)) and not bool(buffer.can_sample(state, 4))
    out = sample(state, jax.random.key(0), 200)
    t = out["t"] if make is make_uniform_buffer else out.items["t"]
    assert set(np.asarray(t).tolist()) == {0, 1, 2}
    np.testing.assert_array_equal(
        np.asarray(t, np.float32),
        np.asarray(out["obs"] if isinstance(out, dict) else out.items["obs"])[:, 0],
    )
    for start in range(3, 12, 3):
        state = add(state, items(range(start, start + 3)))
    assert int(state.size) == 7 and int(state.pos) == 12 % 7
    assert sorted(np.asarray(state.items["t"]).tolist()) == list(range(5, 12))


def test_uniform_sampling_law_and_key_determinism():
    buffer = make_uniform_buffer(13)
    state = buffer.add(buffer.init(EXAMPLE), items(range(13)))
    sample = jax.jit(buffer.sample, static_argnums=2)
    a = sample(state, jax.random.key(1), 64)["t"]
    b = sample(state, jax.random.key(1), 64)["t"]
    c = sample(state, jax.random.key(2), 64)["t"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    keys = jax.random.split(jax.random.key(0), 100)
    t = jax.vmap(lambda k: sample(state, k, 130)["t"])(keys)
    counts = np.bincount(np.asarray(t).ravel(), minlength=13)
    n, p = 13000, 1 / 13
    np.testing.assert_array_less(np.abs(counts - n * p), 5 * np.sqrt(n * p * (1 - p)))
    # raw uint32 keys work too
    raw = sample(state, jax.random.PRNGKey(3), 8)["t"]
    assert raw.shape == (8,)


def test_no_retrace_on_second_call():
    traces = {"add": 0, "sample": 0, "update": 0}
    buffer = make_prioritized_buffer(32)

    def counted(name, fn):
        def wrapper(*args):
            traces[name] += 1
            return fn(*args)

        return wrapper

    add = jax.jit(counted("add", buffer.add), donate_argnums=0)
    sample = jax.jit(counted("sample", buffer.sample), static_argnums=2)
    update = jax.jit(counted("update", buffer.update), donate_argnums=0)
    state = buffer.init(EXAMPLE)
    for step in range(3):
        state = add(state, items([step, step + 1]))
        out = sample(state, jax.random.key(step), 4)
        state = update(state, out.indices, jnp.arange(4, dtype=jnp.float32))
    assert traces == {"add": 1, "sample": 1, "update": 1}


def test_vmap_over_many_buffers():
    buffer = make_uniform_buffer(5)
    states = jax.jit(jax.vmap(lambda _: buffer.init(EXAMPLE)))(jnp.arange(3))
    batch = jax.jit(jax.vmap(lambda k: items(jnp.arange(4) + 10 * k)))(jnp.arange(3))
    states = jax.jit(jax.vmap(buffer.add))(states, batch)
    keys = jax.random.split(jax.random.key(0), 3)
    out = jax.jit(jax.vmap(buffer.sample, in_axes=(0, 0, None)), static_argnums=2)(states, keys, 16)
    t = np.asarray(out["t"])
    for k in range(3):
        assert set(t[k].tolist()) <= set(range(10 * k, 10 * k + 4))

    pbuffer = make_prioritized_buffer(6, alpha=1.0)

    @jax.jit
    def run(keys):
        pstates = jax.vmap(lambda _: pbuffer.init(EXAMPLE))(jnp.arange(2))
        batch = jax.vmap(lambda k: items(jnp.arange(3)))(jnp.arange(2))
        pstates = jax.vmap(pbuffer.add)(pstates, batch)
        # buffer 0 favours slot 0, buffer 1 slot 2
        prios = jnp.array([[9.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
        pstates = jax.vmap(pbuffer.update, in_axes=(0, None, 0))(pstates, jnp.arange(3), prios)
        return jax.vmap(pbuffer.sample, in_axes=(0, 0, None))(pstates, keys, 32)

    out = run(keys[:2])
    assert set(np.asarray(out.indices[0]).tolist()) == {0}
    assert set(np.asarray(out.indices[1]).tolist()) == {2}


def test_trace_time_validation():
    buffer = make_uniform_buffer(4)
    state = buffer.init(EXAMPLE)
    with pytest.raises(ValueError, match="per-item shape"):
        buffer.add(state, items([0], dim=3))
    with pytest.raises(ValueError, match="dtype"):
        buffer.add(state, {"obs": jnp.zeros((1, 2), jnp.int32), "t": jnp.zeros(1, jnp.int32)})
    with pytest.raises(ValueError, match="structure"):
        buffer.add(state, {"obs": jnp.zeros((1, 2))})
    with pytest.raises(ValueError, match="capacity"):
        buffer.add(state, items(range(5)))
    with pytest.raises(ValueError):
        buffer.sample(state, jax.random.key(0), 0)
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError):
            make_uniform_buffer(bad)
    with pytest.raises(ValueError):
        make_prioritized_buffer(4, alpha=-0.1)
    with pytest.raises(ValueError):
        make_prioritized_buffer(4, epsilon=0.0)


def test_prioritized_frequencies_weights_and_update_rules():
    alpha, beta, eps = 0.8, 0.5, 1e-3
    buffer = make_prioritized_buffer(16, alpha=alpha, beta=beta, epsilon=eps)
    add, update = jax.jit(buffer.add), jax.jit(buffer.update)
    state = add(buffer.init(EXAMPLE), items(range(5)))
    delta = jnp.array([0.5, -2.0, 1.0, 0.0, 3.0])
    state = update(state, jnp.arange(5), delta)
    p = (np.abs(np.asarray(delta)) + eps) ** alpha
    P = p / p.sum()
    sample = jax.jit(buffer.sample, static_argnums=2)
    keys = jax.random.split(jax.random.key(0), 40)
    out = jax.jit(jax.vmap(lambda k: sample(state, k, 500)))(keys)
    idx = np.asarray(out.indices)
    assert idx.max() < 5  # empty slots are never sampled
    counts = np.bincount(idx.ravel(), minlength=5)
    n = idx.size
    np.testing.assert_array_less(np.abs(counts - n * P), 5 * np.sqrt(n * P * (1 - P)) + 1)
    w = (5 * P[idx]) ** -beta
    np.testing.assert_allclose(out.weights, w / w.max(axis=1, keepdims=True), rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(out.items["t"]), idx)
    # beta may be overridden (and traced)
    out0 = sample(state, keys[0], 500, 0.0)
    np.testing.assert_allclose(out0.weights, 1.0)

    # new items get the max priority set so far; NaN and empty-slot updates are ignored
    state2 = jax.jit(buffer.add)(state, items([5]))
    np.testing.assert_allclose(state2.tree.nodes[16 + 5], p.max(), rtol=1e-5)
    state3 = update(state2, jnp.array([0, 9, 2, 3, 4]), jnp.array([jnp.nan, 7.0, 1, 0, 3]))
    np.testing.assert_array_equal(state3.tree.nodes, state2.tree.nodes)
    # duplicates: the last write wins
    state4 = update(state2, jnp.array([1, 1, 2, 3, 4]), jnp.array([9.0, 0.0, 1, 0, 3]))
    np.testing.assert_allclose(state4.tree.nodes[16 + 1], eps**alpha, rtol=1e-4)


def test_prioritized_alpha_zero_is_uniform():
    buffer = make_prioritized_buffer(4, alpha=0.0)

    @jax.jit
    def run(key):
        state = buffer.add(buffer.init(EXAMPLE), items(range(4)))
        state = buffer.update(state, jnp.arange(4), jnp.array([0.0, 1.0, 10.0, 100.0]))
        return buffer.sample(state, key, 8000)

    out = run(jax.random.key(3))
    counts = np.bincount(np.asarray(out.indices), minlength=4)
    np.testing.assert_array_less(np.abs(counts - 2000), 200)
    np.testing.assert_allclose(out.weights, 1.0)


def test_states_checkpoint_with_utils_dump(tmp_path):
    from coax_utils import utils

    buffer = make_prioritized_buffer(8)
    add, sample = jax.jit(buffer.add), jax.jit(buffer.sample, static_argnums=2)
    state = add(buffer.init(EXAMPLE), items(range(5)))
    state = jax.jit(buffer.update)(state, jnp.arange(5), jnp.arange(5.0))
    utils.dump(state, tmp_path / "state.lz4")
    restored = utils.load(tmp_path / "state.lz4", safe=True)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    key = jax.random.key(9)
    np.testing.assert_array_equal(sample(state, key, 16).indices, sample(restored, key, 16).indices)


def test_looped_tree_traversals_match_the_functional_sum_tree():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from coax_utils.replay._functional import _tree_inverse_cdf, _tree_set
    from coax_utils.utils import sum_tree_init, sum_tree_inverse_cdf, sum_tree_set

    inv = jax.jit(_tree_inverse_cdf)
    set_ = jax.jit(_tree_set)
    ref_inv = jax.jit(sum_tree_inverse_cdf)
    ref_set = jax.jit(sum_tree_set)

    @settings(max_examples=25, deadline=None)
    @given(
        capacity=st.sampled_from([2, 5, 8, 13]),
        data=st.lists(st.tuples(st.integers(0, 12), st.floats(0, 10), st.booleans()), max_size=8),
        seed=st.integers(0, 100),
    )
    def check(capacity, data, seed):
        rng = np.random.default_rng(seed)
        tree = sum_tree_set(
            sum_tree_init(capacity), jnp.arange(capacity), rng.uniform(0, 2, capacity)
        )
        idx = jnp.asarray([i % capacity for i, _, _ in data] + [0], jnp.int32)
        val = jnp.asarray([v for _, v, _ in data] + [1.0], jnp.float32)
        ok = jnp.asarray([k for _, _, k in data] + [False])
        got = set_(tree, idx, val, ok)
        want = ref_set(tree, jnp.where(ok, idx, capacity), val)  # out of range: ignored
        np.testing.assert_array_equal(got.nodes, want.nodes)
        u = jnp.asarray(np.r_[rng.uniform(size=16), 0.0, 1.0], jnp.float32)
        i, value = inv(got, u)
        np.testing.assert_array_equal(i, ref_inv(got, u))
        values = np.asarray(got.nodes[got.num_leaves :][:capacity])
        if values.sum() > 0:  # an all-zero tree has no distribution (documented precondition)
            np.testing.assert_array_equal(value, values[np.asarray(i)])
            assert np.all(np.asarray(value) > 0)

    check()


def test_row_loop_and_gather_paths_agree(monkeypatch):
    from coax_utils.replay import _functional

    buffer = make_uniform_buffer(50)
    state = jax.jit(buffer.add)(buffer.init(EXAMPLE), items(range(40)))
    key = jax.random.key(4)
    looped = buffer.sample(state, key, 64)  # small items on the CPU: the row loop
    monkeypatch.setattr(_functional, "_ROW_LOOP_MAX_BYTES", 0)
    gathered = buffer.sample(state, key, 64)  # (not jitted: traced again with the new limit)
    for a, b in zip(jax.tree_util.tree_leaves(looped), jax.tree_util.tree_leaves(gathered)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(looped["obs"])[:, 0], np.asarray(looped["t"]))


# -- bad indices and priorities never corrupt the buffer -----------------------------------


def _filled(capacity=8, n=4):
    buffer = make_prioritized_buffer(capacity, alpha=1.0, beta=1.0)
    return buffer, buffer.add(buffer.init(jnp.zeros(2)), jnp.ones((n, 2)))


def test_update_refuses_float_indices_at_trace_time():
    buffer, state = _filled()
    with pytest.raises(TypeError, match="float32"):
        jax.jit(buffer.update)(state, jnp.array([1.7]), jnp.array([1.0]))


def test_update_ignores_indices_beyond_int32():
    buffer, state = _filled()
    out = buffer.update(state, np.array([2**32 + 1], np.int64), np.array([7.0]))
    np.testing.assert_array_equal(out.tree.nodes, state.tree.nodes)


def test_huge_priorities_never_give_nan_weights():
    buffer, state = _filled()
    state = buffer.update(state, jnp.array([0, 1]), jnp.array([3e38, 3e38], jnp.float32))
    sample = buffer.sample(state, jax.random.key(0), 64)
    assert np.all(np.isfinite(np.asarray(sample.weights)))
    assert np.isfinite(float(state.tree.nodes[1]))


def test_nan_priorities_and_beta_never_give_nan_weights():
    buffer, state = _filled()
    state = buffer.update(state, jnp.array([0, 1]), jnp.array([np.nan, 1e-30], jnp.float32))
    weights = jax.jit(buffer.sample, static_argnums=2)(state, jax.random.key(1), 64, jnp.nan)
    assert np.all(np.isfinite(np.asarray(weights.weights)))
    with pytest.raises(ValueError, match="nan"):
        buffer.sample(state, jax.random.key(1), 4, float("nan"))
    empty = buffer.init(jnp.zeros(2))
    assert np.asarray(buffer.sample(empty, jax.random.key(0), 3).weights).tolist() == [1.0] * 3
