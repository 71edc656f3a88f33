"""The jittable sequence buffers: the same windows and priorities as the host twins on the
same stream, samples checked against the oracle, stale versions, checkpoints, retracing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from coax_utils import utils
from coax_utils.replay import (
    PrioritizedSequenceReplayBuffer,
    SequenceReplayBuffer,
    make_prioritized_sequence_buffer,
    make_sequence_buffer,
)
from coax_utils.replay._seq_layout import window_layout
from tests.replay.test_sequence_oracle import check_sample, expected_windows, random_stream

CONFIGS = [(4, 2, 1, 3, 16), (3, 5, 0, 2, 8)]


def example(calls):
    steps, core = calls[0][0], calls[0][1]
    return jax.tree_util.tree_map(lambda x: x[0], steps), jax.tree_util.tree_map(
        lambda x: x[0], core
    )


def feed(calls, host, fn, state):
    for call in calls:
        host.add(*call)
        state = fn.add(state, *call)
    return state


def rewritten(state, **fields):
    """``state`` with some of its windows' fields (decoded: ``steps``, ``core``,
    ``seq_len``, ``seq_end``, ``seq_first``) replaced, packed again into its rows."""
    layout = window_layout(state.pending, state.pending_core, state.pos.ndim)
    meta, body = layout.unpack(state.windows)
    meta = {k: fields.get(k, v) for k, v in meta.items()}
    body = {k: fields.get(k, v) for k, v in body.items()}
    return state.replace(windows=layout.pack((meta, body)))


def ids_of(slots, count, capacity):
    """The host ids held in jittable ``slots`` (both rings fill alike)."""
    slots = np.asarray(slots, np.int64)
    return slots + capacity * ((count - 1 - slots) // capacity)


def assert_same_windows(host, state):
    h = host.__checkpoint_state__()
    n = len(host)
    assert int(state.size) == n
    np.testing.assert_array_equal(np.asarray(state.seq_len), h["seq_len"])
    np.testing.assert_array_equal(np.asarray(state.seq_end), h["seq_end"])
    np.testing.assert_array_equal(np.asarray(state.seq_first), h["seq_first"])
    np.testing.assert_array_equal(np.asarray(state.chain_n), h["chain_n"])
    np.testing.assert_array_equal(np.asarray(state.chain_first), h["chain_first"])
    t = np.arange(host.length)
    valid = t < h["seq_len"][:, None]
    for a, b in zip(jax.tree_util.tree_leaves(state.steps), jax.tree_util.tree_leaves(h["steps"])):
        v = valid.reshape(valid.shape + (1,) * (b.ndim - 2))
        np.testing.assert_array_equal(np.where(v, np.asarray(a), 0), np.where(v, b, 0))
    for a, b in zip(jax.tree_util.tree_leaves(state.core), jax.tree_util.tree_leaves(h["core"])):
        np.testing.assert_array_equal(np.asarray(a)[:n], b[:n])


@pytest.mark.parametrize("length,period,burn_in,num_envs,capacity", CONFIGS)
def test_twins_agree_on_the_same_stream(length, period, burn_in, num_envs, capacity):
    rng = np.random.default_rng(length + 10 * period)
    calls, streams = random_stream(rng, num_envs, 60)
    host = PrioritizedSequenceReplayBuffer(capacity, length, period, burn_in, num_envs, 0.7)
    fn = make_prioritized_sequence_buffer(capacity, length, period, burn_in, num_envs, 0.7)
    state = feed(calls, host, fn, fn.init(*example(calls)))
    assert_same_windows(host, state)
    # the same TD errors for the same windows give the same priorities
    sample = fn.sample(state, jax.random.key(0), 32)
    ids = ids_of(sample.indices, host._count, capacity)
    td = rng.normal(size=(32, length)).astype(np.float32)
    state = fn.update(state, sample.indices, td, sample.versions)
    host.update(ids, td)
    held = np.asarray(state.tree.nodes)[state.tree.num_leaves :][: len(host)]
    np.testing.assert_allclose(held, host._tree.values[: len(host)], rtol=1e-5)
    # the samples are windows of the oracle, with masks, flags and core states
    expected = expected_windows(streams, length, period)
    sample = fn.sample(state, jax.random.key(1), 64)
    sample = jax.tree_util.tree_map(np.asarray, sample)
    sample = sample.replace(indices=ids_of(sample.indices, host._count, capacity))
    check_sample(sample, host, expected)
    # gather: the sample of given slots, as sample returns it for the slots it drew
    drawn = fn.sample(state, jax.random.key(2), 8)
    again = jax.jit(fn.gather)(state, drawn.indices, drawn.weights, drawn.versions)
    for a, b in zip(jax.tree_util.tree_leaves(drawn), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    uniform = make_sequence_buffer(capacity, length, period, burn_in, num_envs)
    plain = SequenceReplayBuffer(capacity, length, period, burn_in, num_envs)
    assert_same_windows(plain, feed(calls, plain, uniform, uniform.init(*example(calls))))


def test_prioritized_frequencies_and_weights():
    rng = np.random.default_rng(5)
    calls, _ = random_stream(rng, 3, 40)
    L = 4
    fn = make_prioritized_sequence_buffer(256, L, 2, 1, 3, alpha=0.6, beta=0.5)
    state = fn.init(*example(calls))
    for call in calls:
        state = fn.add(state, *call)
    n = int(state.size)
    state = fn.update(state, jnp.arange(n), rng.exponential(size=(n, L)))
    p = np.asarray(state.tree.nodes)[state.tree.num_leaves :][:n].astype(np.float64)
    sample = jax.jit(fn.sample, static_argnums=2)
    counts = np.zeros(n)
    for k in range(40):
        s = sample(state, jax.random.key(k), 500)
        np.add.at(counts, np.asarray(s.indices), 1)
        w = (p[np.asarray(s.indices)] / p.sum() * n) ** -0.5
        np.testing.assert_allclose(np.asarray(s.weights), w / w.max(), rtol=1e-4)
    assert scipy.stats.chisquare(counts, counts.sum() * p / p.sum()).pvalue > 1e-3


def test_stale_versions_and_bad_input():
    rng = np.random.default_rng(6)
    calls, _ = random_stream(rng, 2, 40, p_end=0.0)
    fn = make_prioritized_sequence_buffer(4, 3, 3, 1, 2)
    state = fn.init(*example(calls))
    for call in calls[:6]:
        state = fn.add(state, *call)
    sample = fn.sample(state, jax.random.key(0), 8)
    for call in calls[6:]:
        state = fn.add(state, *call)
    new = fn.update(state, sample.indices, jnp.full((8, 3), 50.0), sample.versions)
    np.testing.assert_array_equal(new.tree.nodes, state.tree.nodes)
    steps, core, term, trunc, _ = calls[0]
    with pytest.raises(ValueError, match="td_errors"):
        fn.update(state, sample.indices, jnp.zeros((8, 4)), sample.versions)
    with pytest.raises(ValueError, match="core_state"):
        fn.add(state, steps, core._replace(cell=core.cell[:, None]), term, trunc)
    with pytest.raises(ValueError, match="steps"):
        fn.add(state, {"obs": steps["obs"]}, core, term, trunc)
    with pytest.raises(ValueError, match="terminated"):
        fn.add(state, steps, core, term[:1], trunc)
    with pytest.raises(ValueError, match="burn_in"):
        make_sequence_buffer(8, 4, burn_in=4)
    with pytest.raises(ValueError, match="period"):
        make_prioritized_sequence_buffer(8, 4, period=0)


def test_jitted_add_does_not_retrace_and_checkpoints_continue():
    rng = np.random.default_rng(7)
    calls, _ = random_stream(rng, 2, 30)
    fn = make_prioritized_sequence_buffer(16, 4, 2, 1, 2)
    traces = []

    def step(state, call):
        traces.append(1)
        return fn.add(state, *call)

    add = jax.jit(step, donate_argnums=0)
    state = fn.init(*example(calls))
    for call in calls[:20]:
        state = add(state, jax.tree_util.tree_map(jnp.asarray, call))
    assert len(traces) == 1
    restored = utils.loads(utils.dumps(state), safe=True)
    for call in calls[20:]:
        state = fn.add(state, *call)
        restored = fn.add(restored, *call)
    a = fn.sample(state, jax.random.key(3), 8)
    b = fn.sample(restored, jax.random.key(3), 8)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    forged = [
        rewritten(state, seq_len=state.seq_len.at[0].set(9)),
        state.replace(pos=state.pos + 1, size=state.size - 1),
        state.replace(chain_n=state.chain_n.at[0].set(4)),
        state.replace(chain_start=state.chain_start.at[1].set(4)),
        rewritten(state, seq_end=state.seq_end.at[0].set(3)),
        state.replace(max_mix=jnp.float32(0.5)),
    ]
    for bad in forged:
        with pytest.raises(ValueError):
            utils.loads(utils.dumps(bad), safe=True)
    # the steps past a short window's valid ones are its last valid step, stored padded
    short = int(np.flatnonzero(np.asarray(state.seq_len) < 4)[0])
    n = int(state.seq_len[short])
    obs = np.asarray(state.steps["obs"][short])
    np.testing.assert_array_equal(obs[n:], np.broadcast_to(obs[n - 1], obs[n:].shape))
    tampered = state.steps["obs"].at[short, 3].add(1.0)
    with pytest.raises(ValueError, match="the padding"):
        utils.loads(
            utils.dumps(rewritten(state, steps={**state.steps, "obs": tampered})), safe=True
        )
    nan = state.steps["obs"].at[short, n - 1 :].set(np.nan)  # NaN pads with NaN: accepted
    utils.loads(utils.dumps(rewritten(state, steps={**state.steps, "obs": nan})), safe=True)


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_vmapped_batch_of_buffers_round_trips_and_continues(prioritized):
    """Three buffers under jax.vmap, fed different streams, come back from a safe load
    exactly and go on identically; a batch with one lying member is refused, naming it."""
    members = [random_stream(np.random.default_rng(20 + i), 2, 24)[0] for i in range(3)]
    calls = [
        jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[m[k] for m in members])
        for k in range(24)
    ]
    make = make_prioritized_sequence_buffer if prioritized else make_sequence_buffer
    fn = make(8, 3, 2, 1, 2)
    ex_step, ex_core = example(members[0])
    state = jax.vmap(lambda _: fn.init(ex_step, ex_core))(jnp.arange(3))
    add = jax.jit(jax.vmap(lambda s, c: fn.add(s, *c)))
    for call in calls[:16]:
        state = add(state, call)
    restored = utils.loads(utils.dumps(state), safe=True)
    assert type(restored) is type(state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state)
    sample = jax.jit(jax.vmap(lambda s, k: fn.sample(s, k, 6)))
    keys = jax.random.split(jax.random.key(4), 3)
    for call in calls[16:]:
        state, restored = add(state, call), add(restored, call)
    if prioritized:
        update = jax.jit(jax.vmap(lambda s, x, td: fn.update(s, x.indices, td, x.versions)))
        x = sample(state, keys)
        td = jnp.asarray(np.random.default_rng(5).normal(size=(3, 6, 3)), jnp.float32)
        state, restored = update(state, x, td), update(restored, x, td)
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, sample(restored, keys), sample(state, keys)
    )
    forged = [rewritten(state, seq_len=state.seq_len.at[1, 0].set(9))]
    if prioritized:
        forged.append(state.replace(max_mix=state.max_mix.at[2].set(0.5)))
    lengths = np.asarray(state.seq_len[2])
    short = int(np.flatnonzero((lengths > 0) & (lengths < 3))[0])
    tail = state.steps["obs"].at[2, short, 2].add(1.0)
    forged.append(rewritten(state, steps={**state.steps, "obs": tail}))
    for bad, member in zip(forged, (1, 2, 2) if prioritized else (1, 2)):
        with pytest.raises(ValueError, match=rf"buffer \({member},\) of the batch"):
            utils.loads(utils.dumps(bad), safe=True)
