"""An independent oracle of sequence replay: every window a stream of steps must produce.

It follows the documented rule literally (no chains, no incremental state): cut each
sub-env's steps into episodes, then list the windows of each episode by their start.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import gymnasium
import haiku as hk
import jax
import numpy as np
import pytest
import scipy.stats

from coax_utils import utils
from coax_utils.replay import (
    PrioritizedSequenceReplayBuffer,
    RecordVectorSequences,
    SequenceReplayBuffer,
)


class Step(NamedTuple):
    add: int  # the index of the add call that gave the step
    value: Any  # the step (a pytree; tests use arrays)
    core: Any  # the core state given with it
    terminated: bool
    truncated: bool


class Window(NamedTuple):
    key: tuple  # (add call of its last step, sub-env): the write order
    steps: list  # its valid steps
    core: Any  # the core state of its first step
    end: int  # 0: none, 1: terminated, 2: truncated
    first: bool  # starts its episode


def expected_windows(streams: list[list[Step]], length: int, period: int) -> list[Window]:
    """The windows of ``streams`` (one list of active steps per sub-env), in write order."""
    out = []
    for env, steps in enumerate(streams):
        episodes, current = [], []
        for step in steps:
            current.append(step)
            if step.terminated or step.truncated:
                episodes.append((current, True))
                current = []
        episodes.append((current, False))
        for episode, finished in episodes:
            T = len(episode)
            for s in range(0, T, period):
                if s + length > T:  # a partial window: only at the end, when needed
                    if not finished or (s > 0 and s - period + length >= T):
                        continue
                w = episode[s : s + length]
                end = 0
                if finished and s + length >= T:
                    end = 1 if w[-1].terminated else 2
                out.append(Window((w[-1].add, env), w, w[0].core, end, s == 0))
    out.sort(key=lambda w: w.key)
    return out


def stored_windows(buffer: Any) -> list[dict]:
    """The windows a host sequence buffer holds, oldest first, read from its state."""
    state = buffer.__checkpoint_state__()
    C, count = state["capacity"], state["count"]
    for key, structure in (("steps", "step_structure"), ("core", "core_structure")):
        treedef = jax.tree_util.tree_structure(state[structure])
        state[key] = treedef.unflatten(state[key])
    out = []
    for i in range(max(0, count - C), count):
        slot = i % C
        n = int(state["seq_len"][slot])
        out.append(
            dict(
                id=i,
                steps=jax.tree_util.tree_map(lambda x, s=slot, n=n: x[s, :n], state["steps"]),
                core=jax.tree_util.tree_map(lambda x, s=slot: x[s], state["core"]),
                end=int(state["seq_end"][slot]),
                first=bool(state["seq_first"][slot]),
            )
        )
    return out


def window_arrays(window: Window) -> Any:
    """The steps of an oracle window stacked along a time axis."""
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[s.value for s in window.steps])


# -- tests --------------------------------------------------------------------------------------


def random_stream(rng: np.random.Generator, num_envs: int, num_adds: int, p_end: float = 0.08):
    """Random adds: per call the steps, core states (an LSTMState), flags and active mask,
    and per sub-env the active steps (for the oracle)."""
    calls, streams = [], [[] for _ in range(num_envs)]
    for k in range(num_adds):
        v = k * num_envs + np.arange(num_envs)
        steps = {"obs": np.stack([v, -v], axis=1).astype(np.float32), "t": v.astype(np.int64)}
        core = hk.LSTMState(hidden=v[:, None] * 10.0, cell=v.astype(np.int32))
        term = rng.random(num_envs) < p_end
        trunc = rng.random(num_envs) < p_end
        active = rng.random(num_envs) < 0.85
        calls.append((steps, core, term, trunc, active))
        for e in np.flatnonzero(active):
            value = jax.tree_util.tree_map(lambda x, e=e: x[e], steps)
            c = jax.tree_util.tree_map(lambda x, e=e: x[e], core)
            streams[e].append(Step(k, value, c, bool(term[e]), bool(trunc[e])))
    return calls, streams


def check_stored(buffer, expected: list[Window]) -> None:
    held = stored_windows(buffer)
    expected = expected[len(expected) - len(held) :]
    assert len(held) == len(expected) and held
    for got, want in zip(held, expected):
        jax.tree_util.tree_map(np.testing.assert_array_equal, got["steps"], window_arrays(want))
        jax.tree_util.tree_map(np.testing.assert_array_equal, got["core"], want.core)
        assert (got["end"], got["first"]) == (want.end, want.first)


def check_sample(sample, buffer, expected: list[Window]) -> None:
    """Every sampled row is the window its id names, with mask, padding, flags, core."""
    L, B = buffer.length, buffer.burn_in
    t = np.arange(L)
    for row, i in enumerate(sample.indices):
        want = expected[int(i)]
        n = len(want.steps)
        steps = window_arrays(want)["t"]
        np.testing.assert_array_equal(sample.items["t"][row], steps[np.minimum(t, n - 1)])
        np.testing.assert_array_equal(sample.mask[row], t < n)
        np.testing.assert_array_equal(sample.loss_mask[row], (t < n) & ((t >= B) | want.first))
        np.testing.assert_array_equal(sample.terminated[row], (t == n - 1) & (want.end == 1))
        np.testing.assert_array_equal(sample.truncated[row], (t == n - 1) & (want.end == 2))
        np.testing.assert_array_equal(sample.core_state.hidden[row], want.core.hidden)


@pytest.mark.parametrize(
    "length,period,burn_in,num_envs",
    [(4, 2, 1, 3), (5, 5, 0, 2), (3, 5, 0, 2), (6, 1, 2, 4), (1, 1, 0, 1)],
)
def test_windows_of_interleaved_sub_envs_match_the_oracle(length, period, burn_in, num_envs):
    rng = np.random.default_rng(length * 100 + period)
    calls, streams = random_stream(rng, num_envs, 120)
    expected = expected_windows(streams, length, period)
    assert any(w.end == 1 for w in expected) and any(w.end == 2 for w in expected)
    big = SequenceReplayBuffer(10_000, length, period, burn_in, num_envs, random_seed=1)
    small = PrioritizedSequenceReplayBuffer(16, length, period, burn_in, num_envs, random_seed=2)
    for call in calls:
        big.add(*call)
        small.add(*call)
    assert len(big) == len(expected)
    check_stored(big, expected)
    check_stored(small, expected)  # the newest 16
    check_sample(big.sample(64), big, expected)
    check_sample(small.sample(64), small, expected)


def test_prioritized_frequencies_match_the_r2d2_mixture():
    rng = np.random.default_rng(0)
    calls, streams = random_stream(rng, 3, 60)
    L, P, B = 4, 2, 1
    buffer = PrioritizedSequenceReplayBuffer(
        1000, L, P, B, 3, alpha=0.7, eta=0.8, epsilon=0.01, random_seed=3
    )
    for call in calls:
        buffer.add(*call)
    expected = expected_windows(streams, L, P)
    ids = np.arange(len(expected))
    td = rng.normal(size=(len(ids), L)) * rng.exponential(size=(len(ids), 1))
    buffer.update(ids, td)
    # the oracle's priority: over the loss steps of each window
    t = np.arange(L)
    prio = []
    for w, d in zip(expected, np.abs(td)):
        counted = (t < len(w.steps)) & ((t >= B) | w.first)
        a = d[counted]
        mix = 0.8 * a.max() + 0.2 * a.mean() if a.size else 0.0
        prio.append((mix + 0.01) ** 0.7)
    prio = np.array(prio)
    np.testing.assert_allclose(buffer.priorities(ids), prio, rtol=1e-12)
    counts = np.zeros(len(ids))
    for k in range(100):
        sample = buffer.sample(200)
        if k < 3:
            check_sample(sample, buffer, expected)
        np.add.at(counts, sample.indices, 1)
        w = (len(ids) * prio[sample.indices] / prio.sum()) ** -buffer.beta
        np.testing.assert_allclose(sample.weights, w / w.max(), rtol=1e-5)
    p_value = scipy.stats.chisquare(counts, counts.sum() * prio / prio.sum()).pvalue
    assert p_value > 1e-3, p_value


def test_stale_ids_are_ignored_and_bad_input_changes_nothing():
    rng = np.random.default_rng(1)
    calls, _ = random_stream(rng, 2, 40, p_end=0.0)
    buffer = PrioritizedSequenceReplayBuffer(4, 3, 3, 1, 2, random_seed=0)
    for call in calls[:6]:
        buffer.add(*call)
    sample = buffer.sample(8)
    for call in calls[6:]:
        buffer.add(*call)  # every window sampled above is overwritten
    before = utils.dumps(buffer)
    buffer.update(sample.indices, np.full((8, 3), 50.0))
    assert utils.dumps(buffer) == before
    steps, core, term, trunc, active = calls[0]
    held = buffer.sample(2).indices
    bad_calls = [
        lambda: buffer.add(steps, core._replace(cell=core.cell[:, None]), term, trunc),
        lambda: buffer.add(steps, (core.hidden, core.cell), term, trunc),
        lambda: buffer.add({"obs": steps["obs"]}, core, term, trunc),
        lambda: buffer.add(steps, core, term[:1], trunc),
        lambda: buffer.add(steps, core, term, trunc, active=np.ones(3, bool)),
        lambda: buffer.update(held, np.zeros((2, 4))),
        lambda: buffer.update(held, np.zeros((3, 3))),
        lambda: buffer.update(held[:1], np.array([[np.nan, 0, 0]])),
        lambda: buffer.update(np.array([-1]), np.zeros((1, 3))),
    ]
    for call in bad_calls:
        state = utils.dumps(buffer)
        with pytest.raises((ValueError, TypeError)):
            call()
        assert utils.dumps(buffer) == state
    with pytest.raises(ValueError, match="burn_in"):
        SequenceReplayBuffer(8, 4, burn_in=4)
    with pytest.raises(ValueError, match="period"):
        SequenceReplayBuffer(8, 4, period=0)
    with pytest.raises(TypeError, match="length"):
        SequenceReplayBuffer(8, 4.0)


def test_folders_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    calls, _ = random_stream(rng, 3, 40)
    buffer = PrioritizedSequenceReplayBuffer(16, 5, 3, 2, 3, random_seed=5)
    for call in calls[:25]:
        buffer.add(*call)
    buffer.update(np.arange(len(buffer)), rng.random((len(buffer), 5)))
    buffer.save(tmp_path / "buffer")
    buffer.save(tmp_path / "buffer")  # replaces its own folder
    files = sorted(p.name for p in (tmp_path / "buffer").iterdir())
    assert len(files) > 10 and "meta.lz4" in files  # every storage array in its own file
    for mode in (None, "c"):
        loaded = PrioritizedSequenceReplayBuffer.load(tmp_path / "buffer", mmap_mode=mode)
        a, b = buffer.__checkpoint_state__(), loaded.__checkpoint_state__()
        assert a.pop("rng").bit_generator.state == b.pop("rng").bit_generator.state
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    for call in calls[25:]:
        buffer.add(*call)
        loaded.add(*call)
    jax.tree_util.tree_map(np.testing.assert_array_equal, buffer.sample(8), loaded.sample(8))
    (tmp_path / "buffer" / "leaf_0.npy").write_bytes(b"not a leaf")
    with pytest.raises(ValueError):
        PrioritizedSequenceReplayBuffer.load(tmp_path / "buffer")


def test_checkpoints_continue_the_stream(tmp_path):
    rng = np.random.default_rng(2)
    calls, _ = random_stream(rng, 3, 50)
    buffer = PrioritizedSequenceReplayBuffer(32, 5, 3, 2, 3, random_seed=4)
    for call in calls[:30]:
        buffer.add(*call)
    buffer.update(np.arange(len(buffer)), rng.random((len(buffer), 5)))
    manager = utils.CheckpointManager(tmp_path / "ckpt")
    manager.save(1, {"buffer": buffer})
    manager.wait()
    copies = [utils.loads(utils.dumps(buffer), safe=True), manager.restore(safe=True)["buffer"]]
    manager.close()
    for call in calls[30:]:
        buffer.add(*call)
        for other in copies:
            other.add(*call)
    for other in copies:
        assert type(other) is PrioritizedSequenceReplayBuffer
        a, b = utils.loads(utils.dumps(buffer)).sample(16), other.sample(16)
        jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def play_single_envs(mode: str, actions: np.ndarray, cores: np.ndarray, limits, seed: int):
    """The oracle's episodes: each sub-env replayed as its own gymnasium env."""
    streams = []
    for i, limit in enumerate(limits):
        env = gymnasium.make("CartPole-v1", max_episode_steps=limit)
        obs, _ = env.reset(seed=seed + i)
        steps, skip = [], False
        for k, a in enumerate(actions[:, i]):
            if skip:  # NEXT_STEP: this vector step only reset the sub-env
                skip = False
                continue
            next_obs, r, term, trunc, _ = env.step(a)
            value = {"action": a, "next_obs": next_obs, "obs": obs, "reward": np.float32(r)}
            steps.append(Step(k, value, cores[k, i], term, trunc))
            obs = next_obs
            if term or trunc:
                obs, _ = env.reset()
                skip = mode == "NextStep"
        streams.append(steps)
    return streams


def record_vector_env(mode: str, limits, seed: int, num_steps: int = 80):
    kwargs = {} if mode == "NextStep" else {"autoreset_mode": mode}
    fns = [lambda k=k: gymnasium.make("CartPole-v1", max_episode_steps=k) for k in limits]
    venv = gymnasium.vector.SyncVectorEnv(fns, **kwargs)
    buffer = PrioritizedSequenceReplayBuffer(1000, 5, 3, 1, len(limits), random_seed=0)
    recorder = RecordVectorSequences(venv, buffer)
    recorder.reset(seed=seed)
    rng = np.random.default_rng(seed)
    actions = rng.integers(0, 2, (num_steps, len(limits)))
    cores = rng.normal(size=(num_steps, len(limits))).astype(np.float32)
    for a, c in zip(actions, cores):
        _, _, term, trunc, _ = recorder.step(a, core_state=c)
        if mode == "Disabled" and np.any(term | trunc):
            recorder.reset(options={"reset_mask": term | trunc})
    venv.close()
    return buffer, actions, cores


@pytest.mark.parametrize(
    "mode",
    [
        "NextStep",
        pytest.param("SameStep", marks=pytest.mark.requires(gymnasium="1.1")),
        pytest.param("Disabled", marks=pytest.mark.requires(gymnasium="1.1")),
    ],
)
def test_recorded_vector_env_windows_match_single_envs(mode):
    limits = [6, 11, 200]  # truncations in the first two, terminations in the third
    buffer, actions, cores = record_vector_env(mode, limits, seed=7)
    streams = play_single_envs(mode, actions, cores, limits, seed=7)
    expected = expected_windows(streams, 5, 3)
    assert {w.end for w in expected} == {0, 1, 2}
    check_stored(buffer, expected)
    sample = buffer.sample(32)
    for row, i in enumerate(sample.indices):
        np.testing.assert_array_equal(sample.core_state[row], expected[int(i)].core)


def test_restored_host_states_are_checked():
    rng = np.random.default_rng(3)
    calls, _ = random_stream(rng, 2, 30)
    buffer = PrioritizedSequenceReplayBuffer(8, 4, 2, 1, 2, random_seed=0)
    for call in calls:
        buffer.add(*call)
    good = buffer.__checkpoint_state__()
    restored = PrioritizedSequenceReplayBuffer.__checkpoint_restore__(dict(good))
    assert utils.dumps(restored) == utils.dumps(buffer)

    def forged(**changes):
        state = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in good.items()}
        for key in ("steps", "core", "pending", "pending_core"):
            state[key] = [x.copy() for x in state[key]]
        for key, fn in changes.items():
            state[key] = fn(state[key])
        return state

    def at(i, v):
        def set_(x):
            x[i] = v
            return x

        return set_

    bad = [
        forged(seq_len=at(0, 5)),  # longer than length
        forged(seq_len=at(0, 2), seq_end=at(0, 0)),  # short without an episode end
        forged(seq_end=at(0, 3)),
        forged(chain_n=at(0, 4)),
        forged(chain_n=at(0, -1), chain_first=at(0, True)),
        forged(abs_mix=at(0, 1e9)),
        forged(max_abs_mix=lambda x: 0.5),
        forged(count=lambda x: -1),
        forged(burn_in=lambda x: 4),
        forged(period=lambda x: 0),
        forged(core=lambda x: [x[0], x[1][:, None]]),
        forged(pending=lambda x: x[:1]),
        forged(steps=lambda x: [x[0], x[1].astype(np.int32)]),
        forged(step_structure=lambda x: {"obs": 0}),
        forged(step_structure=lambda x: {"obs": 0, "t": 1}),
        forged(core_structure=lambda x: None),
    ]
    for state in bad:
        with pytest.raises((ValueError, TypeError)):
            PrioritizedSequenceReplayBuffer.__checkpoint_restore__(state)


@pytest.mark.requires(gymnasium="1.1")
def test_a_masked_reset_keeps_the_other_chains():
    # gymnasium's vector envs pop options["reset_mask"]: the recorders read it first, so a
    # masked reset restarts only the reset sub-envs (sequence chains and n-step tracers)
    from coax_utils.replay import NStep, RecordTransitions, SimpleReplayBuffer

    def make():
        fns = [lambda: gymnasium.make("CartPole-v1", max_episode_steps=5)] * 2
        return gymnasium.vector.SyncVectorEnv(fns, autoreset_mode="Disabled")

    chains = SequenceReplayBuffer(100, 4, num_envs=2)
    transitions = SimpleReplayBuffer(100)
    for recorder in (
        RecordVectorSequences(make(), chains),
        RecordTransitions(make(), transitions, NStep(n=3, gamma=0.9)),
    ):
        recorder.reset(seed=0)
        for _ in range(3):
            recorder.step(np.zeros(2, np.int64))
        recorder.reset(options={"reset_mask": np.array([True, False])})
        for _ in range(2):  # sub-env 1 reaches its time limit: 5 steps, none lost
            recorder.step(np.zeros(2, np.int64))
    assert [int(x) for x in chains.__checkpoint_state__()["chain_n"]] == [2, 0]
    assert len(chains) == 2  # sub-env 1's windows: steps 0..3 and step 4 (truncated)
    assert len(transitions) == 5  # sub-env 1's five transitions (sub-env 0's still traced)
