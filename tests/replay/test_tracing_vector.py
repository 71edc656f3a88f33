"""Vector tracers against one single-env tracer per sub-env fed the same streams."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils.replay import (
    EpisodeDoneError,
    InsufficientCacheError,
    MonteCarlo,
    NStep,
    TransitionBatch,
)
from coax_utils.replay._vector_tracing import VectorMonteCarlo, VectorNStep

FIELDS = ("S", "A", "logP", "Rn", "In", "S_next", "A_next", "logP_next", "W")


def assert_same_rows(got, want):
    """Bit-for-bit equal fields (dict observations flattened leaf by leaf)."""
    import jax

    for field in FIELDS:
        g, w = getattr(got, field), getattr(want, field)
        gl, wl = jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)
        assert len(gl) == len(wl), field
        for x, y in zip(gl, wl):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape, (field, x.dtype, y.dtype)
            np.testing.assert_array_equal(x, y, err_msg=field)


def drain(tracer):
    rows = []
    while tracer:
        rows.append(tracer.pop())
    return rows


@st.composite
def streams(draw):
    num_envs = draw(st.integers(1, 4))
    T = draw(st.integers(1, 25))
    events = draw(
        st.lists(st.sampled_from("....etb"), min_size=T * num_envs, max_size=T * num_envs)
    )
    rewards = draw(
        st.lists(st.floats(-10, 10, width=32), min_size=T * num_envs, max_size=T * num_envs)
    )
    pops = draw(st.lists(st.booleans(), min_size=T, max_size=T))
    mode = draw(st.sampled_from(["NextStep", "SameStep", "Disabled"]))
    return (
        num_envs,
        T,
        np.array(events).reshape(T, num_envs),
        np.reshape(rewards, (T, num_envs)),
        pops,
        mode,
    )


def run_both(make_single, vector, stream, monte_carlo=False):
    """Feed the vector tracer and one single tracer per sub-env the same steps; pop both
    at the same times. Under next-step autoreset the step after an episode end is a reset
    step (inactive); a sub-env whose ended episode is still held sits the step out."""
    num_envs, T, events, rewards, pops, mode = stream
    singles = [make_single() for _ in range(num_envs)]
    rng = np.random.default_rng(0)
    skip = np.zeros(num_envs, bool)
    got, want = [], []
    for t in range(T):
        held_ended = np.array([bool(len(x)) and x._ended for x in singles])
        active = ~skip & ~held_ended
        s = {"pos": rng.normal(size=(num_envs, 2)).astype(np.float32), "t": np.full(num_envs, t)}
        s_next = {
            "pos": rng.normal(size=(num_envs, 2)).astype(np.float32),
            "t": np.full(num_envs, 1000 + t),
        }
        a = rng.integers(3, size=num_envs)
        logp = rng.normal(size=num_envs).astype(np.float32)
        done = np.isin(events[t], ["e", "b"])
        trunc = np.isin(events[t], ["t", "b"])
        vector.add(s, a, rewards[t], done, logp, truncated=trunc, s_next=s_next, active=active)
        for i in np.flatnonzero(active):
            singles[i].add(
                {k: v[i] for k, v in s.items()},
                a[i],
                rewards[t, i],
                bool(done[i]),
                logp[i],
                truncated=bool(trunc[i]),
                s_next={k: v[i] for k, v in s_next.items()},
            )
        if pops[t] or t == T - 1:
            if vector:
                got.append(vector.pop())
            for x in singles:
                rows = drain(x)
                if monte_carlo and rows:
                    rows = [TransitionBatch.concatenate(*rows)[::-1]]
                want.extend(rows)
            assert not vector and len(vector) == sum(len(x) for x in singles)
        skip = active & (done | trunc) & (mode == "NextStep")
    assert bool(got) == bool(want)
    if got:
        assert_same_rows(TransitionBatch.concatenate(*got), TransitionBatch.concatenate(*want))


@settings(max_examples=60, deadline=None)
@given(stream=streams(), n=st.integers(1, 4), gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_vector_nstep_equals_one_nstep_per_sub_env(stream, n, gamma):
    vector = NStep(n, gamma, num_envs=stream[0])
    assert isinstance(vector, VectorNStep)
    run_both(lambda: NStep(n, gamma), vector, stream)


@settings(max_examples=40, deadline=None)
@given(stream=streams(), gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_vector_monte_carlo_equals_one_monte_carlo_per_sub_env(stream, gamma):
    vector = MonteCarlo(gamma, num_envs=stream[0])
    assert isinstance(vector, VectorMonteCarlo)
    run_both(lambda: MonteCarlo(gamma), vector, stream, monte_carlo=True)


def test_long_episodes_grow_the_ring_and_keep_every_step():
    vector, singles = NStep(2, 0.9, num_envs=2), [NStep(2, 0.9) for _ in range(2)]
    for t in range(20):  # never popped: the ring must grow past n + 1 steps
        done = np.array([t == 19, False])
        vector.add(np.array([t, -t]), np.array([0, 1]), np.array([1.0, t]), done)
        for i in range(2):
            singles[i].add(np.array([t, -t])[i], i, [1.0, t][i], bool(done[i]))
    want = [b for x in singles for b in drain(x)]
    assert_same_rows(vector.pop(), TransitionBatch.concatenate(*want))
    assert vector.counts.tolist() == [0, 2]


def test_refusals_change_nothing():
    tracer = NStep(2, 0.5, num_envs=2)
    with pytest.raises(InsufficientCacheError):
        tracer.pop()
    s, a = np.zeros((2, 3), np.float32), np.zeros(2, np.int64)
    tracer.add(s, a, np.ones(2), np.array([True, False]))
    with pytest.raises(EpisodeDoneError, match=r"\[0\]"):
        tracer.add(s, a, np.ones(2), False)
    with pytest.raises(ValueError, match="finite"):
        tracer.add(s, a, np.array([1.0, np.nan]), False, active=[False, True])
    with pytest.raises(ValueError, match="s_next"):
        tracer.add(s, a, np.ones(2), False, truncated=[False, True], active=[False, True])
    with pytest.raises(ValueError, match="leading sub-env axis"):
        tracer.add(s[:1], a, np.ones(2), False, active=[False, True])
    with pytest.raises(TypeError, match="dtype"):
        tracer.add(s.astype(np.float64), a, np.ones(2), False, active=[False, True])
    with pytest.raises(TypeError, match="bools"):
        tracer.add(s, a, np.ones(2), "no", active=[False, True])
    with pytest.raises(ValueError, match="shape"):
        tracer.add(s, a, np.ones(3), False, active=[False, True])
    assert tracer.counts.tolist() == [1, 1]  # every refused add left the tracer as it was
    assert tracer.pop().batch_size == 1
    huge = np.array([3e38, 3e38])
    tracer.add(s, a, huge, False)
    tracer.add(s, a, huge, True)
    with pytest.raises(ValueError, match="overflows float32"):
        tracer.pop()
    assert tracer.counts.tolist() == [2, 3]
    tracer.reset(np.array([True, True]))
    assert len(tracer) == 0 and not tracer
    with pytest.raises(ValueError, match="record_extra_info"):
        NStep(2, 0.5, record_extra_info=True, num_envs=2)
    with pytest.raises(ValueError):
        NStep(2, 0.5, num_envs=0)
    with pytest.raises(TypeError):
        MonteCarlo("0.5", num_envs=2)
