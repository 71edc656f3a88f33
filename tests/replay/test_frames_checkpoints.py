"""A prioritized frame-stacked buffer whose oldest transitions lost frames keeps their
priority 0 through every rebuild of its priorities: save/load, dump/load, pickle, alpha and
epsilon; a restored buffer continues the original's sample stream exactly."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from coax_utils import utils
from coax_utils.replay import PrioritizedFrameStackReplayBuffer, TransitionBatch

K, ALPHA, EPS = 2, 0.7, 1e-4


def stream(steps, episode, seed=0, first=0):
    """FrameStackObservation-like transitions over distinct random frames, ``Rn`` naming
    each, episodes of ``episode`` steps (each starts with its reset frame repeated)."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (2 * steps + 2, 3, 3), dtype=np.uint8)
    out, f, t = [], 0, 0
    for i in range(steps):
        if i % episode == 0:  # reset: a new frame, padded
            f, t = f + 1, 0
            stack = [f] * K
        s, s_next = list(stack), stack[1:] + [f + 1]
        out.append(
            TransitionBatch.from_single(
                s=frames[s],
                a=0,
                logp=0.0,
                r=float(first + i),
                done=False,
                gamma=0.9,
                s_next=frames[s_next],
            )
        )
        stack, f, t = s_next, f + 1, t + 1
    return out


def lossy(seed=0):
    """Capacity 30, frame_capacity 20, episodes of 3 steps: the oldest transitions lose
    frames while they are held; random advantages."""
    buffer = PrioritizedFrameStackReplayBuffer(
        capacity=30, stack_size=K, frame_capacity=20, alpha=ALPHA, epsilon=EPS, random_seed=seed
    )
    adv = np.random.default_rng(1).normal(size=45)
    for tr, a in zip(stream(45, 3), adv):
        buffer.add(tr, Adv=np.array([a]))
    return buffer, adv


def live_and_lost(buffer, added=45):
    """The ids of the held transitions that can be sampled, and of those that lost frames."""
    live = {int(tr.idx[0]) for tr in buffer}
    held = set(range(added - len(buffer), added))
    return live, held - live


def expected_total(buffer, adv, live, alpha=ALPHA, epsilon=EPS):
    return sum((abs(adv[i]) + epsilon) ** alpha for i in live)


def assert_same_stream(a, b, calls=4):
    for call in range(calls):
        x, y = a.sample(24), b.sample(24)
        np.testing.assert_array_equal(x.idx, y.idx)
        np.testing.assert_array_equal(x.W, y.W)
        np.testing.assert_array_equal(x.S, y.S)
        np.testing.assert_array_equal(x.S_next, y.S_next)
        td = np.linspace(-2, 3, 24) + call
        a.update(x.idx, td)
        b.update(y.idx, td)
    assert a.total_priority == b.total_priority


def test_lost_transitions_have_priority_zero_from_the_add_on():
    buffer, adv = lossy()
    live, lost = live_and_lost(buffer)
    assert lost and live  # the case the test is about
    np.testing.assert_array_equal(buffer.priorities(np.array(sorted(lost))), 0.0)
    # the total is that of the transitions that can be sampled, before any sample
    assert buffer.total_priority == pytest.approx(expected_total(buffer, adv, live))


@pytest.mark.parametrize("how", ["dumps-safe", "dumps", "pickle", "folder", "folder-mmap"])
def test_a_restored_buffer_continues_the_sample_stream(how, tmp_path):
    buffer, _ = lossy()
    if how.startswith("dumps"):
        restored = utils.loads(utils.dumps(buffer), safe=how == "dumps-safe")
    elif how == "pickle":
        restored = pickle.loads(pickle.dumps(buffer))
    else:
        buffer.save(tmp_path / "buf")
        mode = "c" if how == "folder-mmap" else None
        restored = PrioritizedFrameStackReplayBuffer.load(tmp_path / "buf", mmap_mode=mode)
    assert restored.total_priority == buffer.total_priority
    _, lost = live_and_lost(buffer)
    np.testing.assert_array_equal(restored.priorities(np.array(sorted(lost))), 0.0)
    assert_same_stream(buffer, restored)
    # both keep going the same way: more adds lose more transitions, in both alike
    for tr in stream(12, 2, seed=5, first=100):
        buffer.add(tr)
        restored.add(tr)
    assert restored.total_priority == buffer.total_priority
    assert_same_stream(buffer, restored)


@pytest.mark.parametrize("name, value", [("alpha", 0.4), ("epsilon", 0.5)])
def test_alpha_and_epsilon_keep_lost_transitions_at_zero(name, value):
    buffer, adv = lossy()
    twin, _ = lossy()
    live, lost = live_and_lost(buffer)
    setattr(buffer, name, value)
    np.testing.assert_array_equal(buffer.priorities(np.array(sorted(lost))), 0.0)
    kwargs = {name: value}
    assert buffer.total_priority == pytest.approx(expected_total(buffer, adv, live, **kwargs))
    # and back: the buffer equals one that never changed, sample for sample
    setattr(buffer, name, ALPHA if name == "alpha" else EPS)
    assert buffer.total_priority == twin.total_priority
    assert_same_stream(buffer, twin)
    assert {int(i) for i in buffer.sample(500).idx} <= live


def test_every_lost_transition_is_found_when_frames_go_in_bursts():
    # a full scan after every add agrees with the frontier scan, through episodes of every
    # length (1 to 7 steps) and batches of several transitions
    buffer = PrioritizedFrameStackReplayBuffer(
        capacity=25, stack_size=K, frame_capacity=18, random_seed=0
    )
    rng = np.random.default_rng(0)
    trs = []
    for e in range(30):
        trs += stream(int(rng.integers(1, 8)), 100, seed=e, first=len(trs))
    losses = 0
    for i in range(0, len(trs), 3):
        buffer.add(TransitionBatch.concatenate(*trs[i : i + 3]))
        added = min(i + 3, len(trs))
        live, lost = live_and_lost(buffer, added)
        held = np.arange(added - len(buffer), added)
        assert {int(i) for i in held[buffer.priorities(held) == 0]} == lost
        assert buffer.priorities(np.array(sorted(live))).min() > 0
        losses = max(losses, len(lost))
    assert losses > 0
