"""NStep and MonteCarlo tracers against an independent n-step-target oracle."""

import gymnasium
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils.replay import EpisodeDoneError, InsufficientCacheError, MonteCarlo, NStep

# the 13-step episode of coax's own NStep tests
S = np.arange(13)
A = np.array([6, 3, 7, 4, 6, 9, 2, 6, 7, 4, 3, 7, 7])
R = np.array([-0.48, 0.16, 0.23, 0.11, 1.46, 1.53, -2.43, 0.60, -0.25, -0.16, -1.47, 1.48, -0.02])
GAMMA, N = 0.85, 5


def value(s):
    """An arbitrary state-value function used to compare bootstrapped targets."""
    return 0.3 * np.asarray(s, np.float64) - 1.0


def oracle_targets(rewards, states, n, gamma, end, final_state=None):
    """Targets G_t = sum_{j<k} gamma^j r_{t+j} + bootstrap, computed directly.

    end is "terminated" or "truncated"; after truncation the bootstrap state of the window
    that runs past the end is ``final_state``.
    """
    T = len(rewards)
    out = []
    for t in range(T):
        k = min(n, T - t)
        g = sum(gamma**j * rewards[t + j] for j in range(k))
        if t + n < T:
            g += gamma**n * value(states[t + n])
        elif end == "truncated":
            g += gamma**k * value(final_state)
        out.append(g)
    return np.array(out)


def feed(tracer, rewards, end, s_next=None, eager=True):
    batches = []
    T = len(rewards)
    for t in range(T):
        last = t == T - 1
        tracer.add(
            S[t] if t < len(S) else t,
            A[t % len(A)],
            rewards[t],
            done=last and end == "terminated",
            truncated=last and end == "truncated",
            s_next=s_next if last else None,
        )
        if eager:
            while tracer:
                batches.append(tracer.pop())
    if not eager:
        batches.append(tracer.flush())
    return batches


def targets_of(batches):
    from coax_utils.replay import TransitionBatch

    tb = TransitionBatch.concatenate(*batches)
    return tb, tb.Rn + tb.In * value(tb.S_next)


@pytest.mark.parametrize("eager", [True, False])
def test_nstep_matches_coax_episode(eager):
    tracer = NStep(N, GAMMA)
    tb, _ = targets_of(feed(tracer, R, "terminated", eager=eager))
    Rn = [sum(GAMMA**j * R[t + j] for j in range(min(N, 13 - t))) for t in range(13)]
    np.testing.assert_allclose(tb.Rn, Rn, rtol=1e-5)
    np.testing.assert_allclose(tb.In, [GAMMA**N] * 8 + [0.0] * 5, rtol=1e-6)
    np.testing.assert_array_equal(tb.S, S)
    np.testing.assert_array_equal(tb.S_next[:-N], S[N:])
    np.testing.assert_array_equal(tb.A_next[:-N], A[N:])
    assert not tracer and len(tracer) == 0


def test_truthiness_pop_and_errors():
    tracer = NStep(2, 0.5)
    with pytest.raises(InsufficientCacheError):
        tracer.pop()
    with pytest.raises(InsufficientCacheError):
        tracer.flush()
    tracer.add(0, 0, 1.0, False)
    tracer.add(1, 0, 1.0, False)
    assert not tracer and len(tracer) == 2
    tracer.add(2, 0, 1.0, True)
    assert tracer
    with pytest.raises(EpisodeDoneError):
        tracer.add(3, 0, 1.0, False)
    assert len(tracer) == 3  # the rejected add changed nothing
    assert tracer.flush().batch_size == 3
    tracer.add(10, 0, 1.0, False)  # a new episode after the tracer was emptied
    assert len(tracer) == 1 and not tracer
    with pytest.raises(ValueError, match="finite"):
        tracer.add(11, 0, float("nan"), False)
    with pytest.raises(ValueError):
        NStep(0, 0.9)
    with pytest.raises(ValueError):
        NStep(2, 1.1)


def test_truncation_keeps_bootstrapping_from_s_next():
    tracer = NStep(3, 0.9)
    rewards = np.ones(5)
    tb, targets = targets_of(feed(tracer, rewards, "truncated", s_next=100))
    np.testing.assert_allclose(targets, oracle_targets(rewards, S, 3, 0.9, "truncated", 100))
    np.testing.assert_allclose(tb.In, [0.9**3, 0.9**3, 0.9**3, 0.9**2, 0.9], rtol=1e-6)
    np.testing.assert_array_equal(tb.S_next, [3, 4, 100, 100, 100])


def test_truncation_without_s_next_bootstraps_from_last_state():
    tracer = NStep(3, 0.9)
    rewards = np.arange(1.0, 6.0)
    tb, targets = targets_of(feed(tracer, rewards, "truncated"))
    assert tb.batch_size == 4  # the last step has nothing left to accumulate: dropped
    expected = oracle_targets(rewards[:4], S, 3, 0.9, "truncated", final_state=S[4])
    np.testing.assert_allclose(targets, expected, rtol=1e-6)
    np.testing.assert_array_equal(tb.A_next[-1], A[4])  # the action actually taken at S_next


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 12),
    n=st.integers(1, 6),
    gamma=st.floats(0.0, 1.0),
    end=st.sampled_from(["terminated", "truncated"]),
    eager=st.booleans(),
)
def test_nstep_targets_property(T, n, gamma, end, eager):
    rewards = np.random.default_rng(T * 7 + n).normal(size=T)
    tb, targets = targets_of(feed(NStep(n, gamma), rewards, end, s_next=50, eager=eager))
    expected = oracle_targets(rewards, S, n, gamma, end, final_state=50)
    np.testing.assert_allclose(targets, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(tb.S, S[:T])


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 12),
    gamma=st.floats(0.0, 1.0),
    end=st.sampled_from(["terminated", "truncated"]),
)
def test_monte_carlo_targets_property(T, gamma, end):
    rewards = np.random.default_rng(T).normal(size=T)
    tracer = MonteCarlo(gamma)
    batches = feed(tracer, rewards, end, s_next=50, eager=False)
    tb, targets = targets_of(batches)
    np.testing.assert_array_equal(tb.S, S[:T][::-1])  # popped last step first
    expected = oracle_targets(rewards, S, T + 1, gamma, end, final_state=50)[::-1]
    np.testing.assert_allclose(targets, expected, rtol=1e-4, atol=1e-4)
    if end == "terminated":
        assert np.all(tb.In == 0)


def test_monte_carlo_waits_for_episode_end():
    tracer = MonteCarlo(0.5)
    tracer.add(0, 0, 1.0, False)
    assert not tracer
    with pytest.raises(InsufficientCacheError):
        tracer.pop()
    tracer.add(1, 0, 2.0, True)
    with pytest.raises(EpisodeDoneError):
        tracer.add(2, 0, 1.0, False)
    tb = tracer.flush()
    np.testing.assert_allclose(tb.Rn, [2.0, 2.0])


def test_extra_info_records_windows():
    tracer = NStep(N, GAMMA, record_extra_info=True)
    for t in range(N + 2):
        tracer.add(S[t], A[t], R[t], t == N + 1)
    tb = tracer.flush()
    assert isinstance(tb.extra_info, dict)
    states = np.stack(tb.extra_info["states"])  # (n + 1, batch)
    np.testing.assert_array_equal(states[0], tb.S)
    np.testing.assert_array_equal(states[1, 0], S[1])
    dones = np.stack(tb.extra_info["dones"])
    for i in range(N + 2):
        assert dones[:, i].sum() == i


def _traced(tracer, steps, **last):
    for t in range(steps):
        tracer.add(s=np.full(2, t), a=t, r=float(t), done=False, **(last if t == steps - 1 else {}))
    return tracer


def _pops(tracer):
    out = []
    while tracer:
        b = tracer.pop()
        out.append((b.S.tolist(), b.Rn.tolist(), b.In.tolist(), b.S_next.tolist()))
    return out


def test_tracer_checkpoint_round_trip_and_pickle():
    import copy
    import pickle

    for make in (
        lambda: _traced(NStep(3, 0.9, record_extra_info=True), 5),
        lambda: _traced(NStep(2, 0.5), 4, truncated=True, s_next=np.full(2, 99)),
        lambda: _traced(MonteCarlo(0.9), 4, truncated=True, s_next=np.full(2, 99)),
        lambda: _traced(MonteCarlo(0.9), 2),
    ):
        tracer, reference = make(), make()
        for t in (tracer, reference):
            if isinstance(t, MonteCarlo) and t:
                t.pop()  # mid-way through popping
        ended = bool(reference)
        clones = [
            type(tracer).__checkpoint_restore__(copy.deepcopy(tracer.__checkpoint_state__())),
            pickle.loads(pickle.dumps(tracer)),
        ]
        for t in [reference] + clones:
            if not ended:  # still in the episode: end it the same way everywhere
                t.add(s=np.full(2, 50), a=50, r=5.0, done=True)
        expected = _pops(reference)
        assert expected
        for clone in clones:
            assert type(clone) is type(tracer)
            assert _pops(clone) == expected


def test_tracer_checkpoint_restore_checks_every_invariant():
    nstep = _traced(NStep(2, 0.9), 3, truncated=True, s_next=np.full(2, 9)).__checkpoint_state__()
    mc = _traced(MonteCarlo(0.9), 2).__checkpoint_state__()
    bad = [
        (NStep, dict(nstep, n=0)),
        (NStep, dict(nstep, n=2.0)),
        (NStep, dict(nstep, gamma=1.5)),
        (NStep, dict(nstep, gamma="0.9")),
        (NStep, dict(nstep, record_extra_info=1)),
        (NStep, dict(nstep, steps=[(0, 0, float("nan"), 0.0, 1.0)])),
        (NStep, dict(nstep, steps=[(0, 0, 1.0)])),
        (NStep, dict(nstep, steps="steps")),
        (NStep, dict(nstep, final=None)),
        (NStep, dict(nstep, terminated=True)),
        (NStep, dict(nstep, truncated=1)),
        (NStep, dict(nstep, bogus=1)),
        (NStep, {k: v for k, v in nstep.items() if k != "n"}),
        (MonteCarlo, dict(mc, g=1.0)),
        (MonteCarlo, dict(mc, k=-1)),
        (MonteCarlo, dict(mc, g=float("inf"))),
        (MonteCarlo, dict(mc, final=(0, 0, 0.0))),
        (MonteCarlo, nstep),
    ]
    for cls, state in bad:
        with pytest.raises((ValueError, TypeError)):
            cls.__checkpoint_restore__(state)
            pytest.fail(f"accepted {state}")


@pytest.mark.parametrize("cls", [NStep, MonteCarlo])
def test_steps_that_cannot_be_traced_are_refused_before_anything_changes(cls):
    from coax_utils import utils

    tracer = NStep(2, 0.9) if cls is NStep else MonteCarlo(0.9)
    tracer.add(0, 0, 1.0, False)
    before = utils.dumps(tracer)
    bad = [
        dict(r=np.array([1.0, 2.0])),  # one reward per step, not an array
        dict(r="1.5"),  # a string is not a reward
        dict(r=None),
        dict(logp=np.zeros(3)),
        dict(w=np.ones(2)),
        dict(done="False"),  # a string flag would read as True
        dict(done=None),
        dict(truncated="no"),
        dict(done=np.array([True, False])),
    ]
    for kwargs in bad:
        step = dict(s=1, a=0, r=1.0, done=False) | kwargs
        with pytest.raises((TypeError, ValueError)):
            tracer.add(**step)
            pytest.fail(f"accepted {kwargs}")
        assert utils.dumps(tracer) == before
    # 0-d arrays and numbers that are 0 or 1 are fine
    tracer.add(1, 0, np.float32(2.0), np.bool_(False), logp=np.array(0.0), w=np.array(1.0))
    tracer.add(2, 0, 1.0, 1)
    batch = tracer.flush()
    assert batch.batch_size == 3 and batch.Rn.shape == batch.logP.shape == (3,)


@pytest.mark.parametrize("cls", [NStep, MonteCarlo])
def test_a_return_that_overflows_float32_is_refused_not_stored_as_inf(cls):
    from coax_utils import utils

    tracer = NStep(3, 1.0) if cls is NStep else MonteCarlo(1.0)
    for t in range(3):
        tracer.add(t, 0, 2e38, done=t == 2)
    if cls is MonteCarlo:
        assert tracer.pop().Rn[0] == np.float32(2e38)  # the last step alone still fits
    before = utils.dumps(tracer)
    with pytest.raises(ValueError, match="overflows"):
        tracer.pop()
    assert utils.dumps(tracer) == before


def test_restored_steps_must_hold_single_numbers():
    nstep = _traced(NStep(2, 0.9), 3, truncated=True, s_next=np.full(2, 9)).__checkpoint_state__()
    step = nstep["steps"][0]
    bad = [
        dict(nstep, steps=[(step[0], step[1], np.ones(3), 0.0, 1.0)] * 2),
        dict(nstep, steps=[(step[0], step[1], "1.0", 0.0, 1.0)] * 2),
        dict(nstep, final=(nstep["final"][0], 0, np.ones(2))),
    ]
    for state in bad:
        with pytest.raises((ValueError, TypeError)):
            NStep.__checkpoint_restore__(state)
            pytest.fail(f"accepted {state}")


@pytest.mark.parametrize("cls", [NStep, MonteCarlo])
def test_bfloat16_rewards_and_flags_are_accepted(cls):
    import jax.numpy as jnp

    tracer = NStep(1, 0.9) if cls is NStep else MonteCarlo(0.9)
    tracer.add(0, 0, jnp.bfloat16(1.5), jnp.asarray(0, jnp.bfloat16), logp=jnp.bfloat16(-1))
    tracer.add(1, 0, np.asarray(2.0, jnp.bfloat16), True)
    batch = tracer.flush()
    expected = [2.0, 1.5 + 0.9 * 2.0] if cls is MonteCarlo else [1.5, 2.0]
    np.testing.assert_allclose(sorted(batch.Rn.tolist()), sorted(expected), rtol=1e-6)
    with pytest.raises(ValueError, match="finite"):
        tracer.add(0, 0, jnp.asarray(np.nan, jnp.bfloat16), False)
    with pytest.raises(TypeError, match="bool"):
        tracer.add(0, 0, 1.0, jnp.asarray(0.5, jnp.bfloat16))


@pytest.mark.parametrize("cls", [NStep, MonteCarlo])
def test_steps_are_kept_as_given_when_the_caller_updates_its_arrays_in_place(cls):
    # a preallocated history of the last two observations, shifted in place every step (as
    # hand-written frame stacking does), is passed as the state at each step
    env = gymnasium.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    history = np.stack([obs, obs])
    tracer = NStep(2, 0.9) if cls is NStep else MonteCarlo(0.9)
    seen = []
    for t in range(6):
        seen.append(history.copy())
        obs, r, _, _, _ = env.step(t % 2)
        after = np.stack([history[1], obs])
        tracer.add(history, t % 2, float(r), False, truncated=t == 5, s_next=after)
        history[0] = history[1]
        history[1] = obs
        after[:] = 0  # the caller reuses this array too
    env.close()
    final = np.stack([seen[-1][1], obs])
    batch = tracer.flush()
    if cls is MonteCarlo:
        batch = batch[::-1]
        expected_next = [final] * 6
    else:
        expected_next = [seen[t + 2] for t in range(4)] + [final, final]
    np.testing.assert_array_equal(batch.S, np.stack(seen))
    np.testing.assert_array_equal(batch.S_next, np.stack(expected_next))
