"""Jittable buffers: ring semantics, sampling laws, jit/vmap/donation and no retracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.replay import make_prioritized_buffer, make_uniform_buffer
from coax_utils.utils import SUM_TREE_STRATEGIES, sum_tree_values
from tests._compiles import compiles_again


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
    with pytest.raises(TypeError):
        buffer.sample(state, jax.random.key(0), 2.0)
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError):
            make_uniform_buffer(bad)
    with pytest.raises(ValueError):
        make_prioritized_buffer(4, alpha=-0.1)
    with pytest.raises(ValueError):
        make_prioritized_buffer(4, epsilon=0.0)


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_a_state_of_a_buffer_of_another_capacity_is_refused(make):
    # it used to be read and written at the other buffer's rows: writes past the end were
    # dropped and samples came from slots the buffer never filled, without an error
    state = make(6).init(EXAMPLE)
    for other in (make(5), make(8)):
        with pytest.raises(ValueError, match="does not fit this buffer"):
            other.add(state, items([0, 1]))
        with pytest.raises(ValueError, match="does not fit this buffer"):
            other.sample(state, jax.random.key(0), 2)
        with pytest.raises(ValueError, match="does not fit this buffer"):
            other.sample_sequences(state, jax.random.key(0), 2, 2)
        if hasattr(other, "update"):
            with pytest.raises(ValueError, match="does not fit this buffer"):
                other.update(state, jnp.arange(2), jnp.ones(2))
    if make is make_prioritized_buffer:  # items of the right size, a tree of another one
        eight = make(8).init(EXAMPLE)
        state = state.replace(tree=eight.tree)
        with pytest.raises(ValueError, match="sum tree"):
            make(6).sample(state, jax.random.key(0), 2)


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


def test_tree_strategies_give_identical_states_and_samples():
    # the buffer writes through the one functional sum tree; the accelerator (vectorized)
    # strategy is forced here on the CPU and must agree with the sequential one and "auto"
    rng = np.random.default_rng(3)
    capacity = 37
    buffers = [
        make_prioritized_buffer(capacity, alpha=0.7, tree_strategy=s) for s in SUM_TREE_STRATEGIES
    ]
    states = [buf.add(buf.init(EXAMPLE), items(range(30))) for buf in buffers]
    steps = [
        (jax.jit(buf.update), jax.jit(buf.sample, static_argnums=2), jax.jit(buf.add))
        for buf in buffers
    ]
    ref = np.zeros(capacity)
    ref[:30] = 1.0
    for r in range(12):
        idx = rng.integers(-2, capacity + 2, 24)  # out of range and empty slots are ignored
        delta = rng.choice([0.0, 0.5, -2.0, 7.0, np.nan], 24).astype(np.float32)
        for i, d in zip(idx, delta):
            if 0 <= i < 30 + min(r, 7) and np.isfinite(d):
                ref[i] = (abs(d) + 1e-4) ** 0.7
        key = jax.random.key(r)
        out = []
        for k, (update, sample, add) in enumerate(steps):
            states[k] = update(states[k], jnp.asarray(idx, jnp.int32), jnp.asarray(delta))
            out.append(sample(states[k], key, 16))
            if r < 7:  # new items get the max priority
                states[k] = add(states[k], items([30 + r]))
        for i in range(30, 30 + min(r + 1, 7)):
            ref[i] = float(states[0].max_priority) if ref[i] == 0 else ref[i]
        for k in (1, 2):
            np.testing.assert_array_equal(np.asarray(states[k].tree.nodes), states[0].tree.nodes)
            np.testing.assert_array_equal(np.asarray(out[k].indices), out[0].indices)
        leaves = np.asarray(sum_tree_values(states[0].tree))
        np.testing.assert_allclose(leaves[: 30 + min(r, 7)], ref[: 30 + min(r, 7)], rtol=1e-5)


def test_tree_strategy_is_checked_in_the_factory():
    with pytest.raises(ValueError, match="tree_strategy"):
        make_prioritized_buffer(4, tree_strategy="gpu")
    with pytest.raises(TypeError, match="tree_strategy"):
        make_prioritized_buffer(4, tree_strategy=1)
    assert make_prioritized_buffer(4, tree_strategy="vectorized").tree_strategy == "vectorized"


@pytest.mark.parametrize(
    "make_key",
    [
        lambda seed: jax.random.key(seed),
        lambda seed: jax.random.key(seed, impl="rbg"),
        lambda seed: jax.random.key(seed, impl="unsafe_rbg"),
        lambda seed: jax.random.PRNGKey(seed),  # a raw uint32 key of the default impl
    ],
    ids=["threefry", "rbg", "unsafe_rbg", "raw"],
)
def test_randomness_goes_through_jax_random_with_the_callers_key(make_key):
    size = 29
    ubuf = make_uniform_buffer(32)
    ustate = jax.jit(ubuf.add)(ubuf.init(EXAMPLE), items(range(size)))
    key = make_key(5)
    got = np.asarray(jax.jit(ubuf.sample, static_argnums=2)(ustate, key, 64)["t"])
    # the indices are the caller's key's own random bits, reduced modulo the size (up to 512
    # words are drawn in blocks of 16 under fold_in(key, block))
    words = np.concatenate(
        [
            np.asarray(jax.random.bits(jax.random.fold_in(key, b), (16,), jnp.uint32))
            for b in range(4)
        ]
    )
    expected = words % size
    np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(got, np.asarray(ubuf.sample(ustate, make_key(6), 64)["t"]))
    # the law is uniform whatever the implementation
    keys = jax.random.split(key, 200)
    t = np.asarray(jax.jit(jax.vmap(lambda k: ubuf.sample(ustate, k, 64)["t"]))(keys)).ravel()
    counts = np.bincount(t, minlength=size)
    assert counts.min() > 0 and np.abs(counts - t.size / size).max() < 6 * np.sqrt(t.size / size)

    pbuf = make_prioritized_buffer(8)
    pstate = pbuf.add(pbuf.init(EXAMPLE), items(range(4)))
    pstate = pbuf.update(pstate, jnp.arange(4), jnp.array([1.0, 0.0, 3.0, 0.0]))
    s = jax.jit(pbuf.sample, static_argnums=2)(pstate, key, 64)
    # uniforms: the top 24 bits of the key's words, drawn in one call
    u = (np.asarray(jax.random.bits(key, (64,), jnp.uint32)) >> 8) * np.float32(2.0**-24)
    p = np.array([1.0, 1e-4, 3.0, 1e-4]) + np.array([1e-4, 0, 1e-4, 0])
    cdf = np.cumsum(p) / p.sum()
    np.testing.assert_array_equal(np.asarray(s.indices), np.searchsorted(cdf, u, side="right"))


def test_twin_buffers_share_defaults_and_exception_types():
    import inspect

    from coax_utils.replay import PrioritizedReplayBuffer

    host = inspect.signature(PrioritizedReplayBuffer).parameters
    jit = inspect.signature(make_prioritized_buffer).parameters
    for name, value in (("alpha", 1.0), ("beta", 1.0), ("epsilon", 1e-4)):
        assert host[name].default == jit[name].default == value, name
    buffer = make_prioritized_buffer(4)
    assert (buffer.alpha, buffer.beta, buffer.epsilon) == (1.0, 1.0, 1e-4)
    # the same mistake raises the same exception type in both
    for kwargs, error in (
        (dict(capacity=4.0), TypeError),
        (dict(capacity=True), TypeError),
        (dict(capacity=0), ValueError),
        (dict(capacity=4, alpha="1"), TypeError),
        (dict(capacity=4, alpha=-1.0), ValueError),
        (dict(capacity=4, beta=np.nan), ValueError),
        (dict(capacity=4, epsilon=None), TypeError),
        (dict(capacity=4, epsilon=0.0), ValueError),
    ):
        with pytest.raises(error):
            PrioritizedReplayBuffer(**kwargs)
        with pytest.raises(error):
            make_prioritized_buffer(**kwargs)
    host_buffer = PrioritizedReplayBuffer(4)
    state = buffer.add(buffer.init(EXAMPLE), items(range(2)))
    for bad, error in ((2.0, TypeError), (True, TypeError), (0, ValueError)):
        with pytest.raises(error):
            host_buffer.sample(batch_size=bad)
        with pytest.raises(error):
            buffer.sample(state, jax.random.key(0), bad)
    with pytest.raises(TypeError):
        buffer.sample(state, jax.random.key(0), 2, beta="x")
    with pytest.raises(ValueError):
        buffer.sample(state, jax.random.key(0), 2, beta=-1.0)


def test_row_loop_and_gather_paths_agree(monkeypatch):
    from coax_utils.replay import _functional_common

    buffer = make_uniform_buffer(50)
    state = jax.jit(buffer.add)(buffer.init(EXAMPLE), items(range(40)))
    key = jax.random.key(4)
    looped = buffer.sample(state, key, 64)  # small items on the CPU: the row loop
    monkeypatch.setattr(_functional_common, "ROW_LOOP_MAX_BYTES", 0)
    # a new buffer: its sample is traced (and compiled) anew, with the new limit
    gathered = make_uniform_buffer(50).sample(state, key, 64)
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


def test_eager_calls_compile_once():
    # called outside jit, sample, add and update traced and compiled their loops and
    # platform-dependent branches anew on every call (0.1-0.2 s each)
    uniform, prioritized = make_uniform_buffer(50), make_prioritized_buffer(50)
    u = uniform.add(uniform.init(EXAMPLE), items(range(10)))
    p = prioritized.add(prioritized.init(EXAMPLE), items(range(10)))
    calls = [
        lambda i: uniform.add(u, items(range(i, i + 3))),
        lambda i: uniform.sample(u, jax.random.key(i), 8),
        lambda i: prioritized.add(p, items(range(i, i + 3))),
        lambda i: prioritized.sample(p, jax.random.key(i), 8, beta=0.5),
        lambda i: prioritized.update(p, np.array([i, i + 1]), np.array([1.0, 2.0])),
    ]
    assert compiles_again(calls) == 0


def test_update_refuses_priorities_that_do_not_pair_up_with_the_indices():
    # both used to be flattened: (3, 2) priorities for (2, 3) indices went to the wrong slots
    buffer, state = _filled(capacity=8, n=6)
    indices = np.arange(6).reshape(2, 3)
    with pytest.raises(ValueError, match="priorities"):
        buffer.update(state, indices, np.ones((3, 2)))
    with pytest.raises(ValueError, match="priorities"):
        jax.jit(buffer.update)(state, jnp.asarray(indices), jnp.ones((3, 2)))
    # the same layout, a column of one per index, or one for all are fine
    p = np.arange(1.0, 7.0).reshape(2, 3)
    same = buffer.update(state, indices, p)
    flat = buffer.update(state, indices.reshape(-1), p.reshape(-1))
    np.testing.assert_array_equal(same.tree.nodes, flat.tree.nodes)
    column = buffer.update(state, indices.reshape(-1), p.reshape(-1, 1))
    np.testing.assert_array_equal(column.tree.nodes, flat.tree.nodes)
    one = buffer.update(state, indices, 2.0)
    np.testing.assert_array_equal(
        sum_tree_values(one.tree)[:6],
        sum_tree_values(buffer.update(state, indices, 2.0 * np.ones((2, 3))).tree)[:6],
    )


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
@pytest.mark.parametrize("batch_size", [0, 2**31, 2**40])
def test_sample_refuses_batch_sizes_outside_int32(make, batch_size):
    buffer = make(8)
    state = buffer.add(buffer.init(jnp.zeros(2)), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="batch_size must be >= 1 and <= 2147483647"):
        buffer.sample(state, jax.random.key(0), batch_size)
