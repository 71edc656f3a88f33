"""ShardedReplay over prioritized frame-stacked shards samples as one local buffer holding the
transitions that can be sampled: a shard whose oldest transitions lost frames weighs only
what it can return."""

import numpy as np
import pytest
from scipy import stats

from coax_utils.distributed import ShardedReplay
from coax_utils.replay import PrioritizedFrameStackReplayBuffer
from tests.replay.test_frames_checkpoints import stream

K, ALPHA, BETA, EPS = 2, 0.7, 0.5, 1e-4


def frame_buffer(seed, capacity=40, frame_capacity=30):
    return PrioritizedFrameStackReplayBuffer(
        capacity,
        stack_size=K,
        alpha=ALPHA,
        beta=BETA,
        epsilon=EPS,
        frame_capacity=frame_capacity,
        random_seed=seed,
    )


def test_frame_stacked_shards_sample_as_one_local_buffer(ray_cluster):
    rng = np.random.default_rng(0)
    # shard 0: episodes of one step (two new frames each): most of its 40 transitions lost
    # frames; shard 1: one long episode of 20 steps, all of them held with their frames
    streams = [stream(40, 1, seed=1, first=0), stream(20, 100, seed=2, first=1000)]
    adv = [rng.uniform(0.5, 3.0, 40), rng.uniform(0.0, 1.0, 20)]
    replay = ShardedReplay([frame_buffer(1), frame_buffer(2)], seed=3)
    replicas = [frame_buffer(1), frame_buffer(2)]  # the shards' contents, here
    for s, (trs, a) in enumerate(zip(streams, adv)):
        for tr, x in zip(trs, a):
            replay.add(tr, np.array([x]), shard=s)
            replicas[s].add(tr, np.array([x]))
    live = [{int(tr.Rn[0]) for tr in r} for r in replicas]
    assert 0 < len(live[0]) < 20 and len(live[1]) == 20
    # one local buffer with every transition that can be sampled, and its advantage
    local = frame_buffer(4, capacity=100, frame_capacity=None)
    for s, (trs, a) in enumerate(zip(streams, adv)):
        for tr, x in zip(trs, a):
            if int(tr.Rn[0]) in live[s]:
                local.add(tr, np.array([x]))
    items = sorted(live[0] | live[1])
    by_rn = {int(tr.Rn[0]): x for trs, a in zip(streams, adv) for tr, x in zip(trs, a)}
    by_tr = {int(tr.Rn[0]): tr for trs in streams for tr in trs}
    priority = np.array([(abs(by_rn[k]) + EPS) ** ALPHA for k in items])
    P = dict(zip(items, priority / priority.sum()))

    # the first sample already weighs the shards by what they can return
    first = replay.sample(4000)
    on_shard0 = int(np.sum(first.Rn < 1000))
    p0 = sum(P[k] for k in items if k < 1000)
    assert stats.binomtest(on_shard0, 4000, p0).pvalue > 1e-4
    # the shards' totals are those of what they can return
    total = sum(r.total_priority for r in replicas)
    assert local.total_priority == pytest.approx(total, rel=1e-12)

    counts = {"sharded": np.zeros(len(items)), "local": np.zeros(len(items))}
    position = {k: j for j, k in enumerate(items)}
    for _ in range(10):
        for name, sample in (("sharded", replay.sample), ("local", local.sample)):
            batch = sample(400)
            rows = batch.Rn.astype(int)
            assert set(rows.tolist()) <= set(items)  # never a transition that lost frames
            np.testing.assert_array_equal(batch.S, np.stack([by_tr[k].S[0] for k in rows]))
            np.testing.assert_array_equal(
                batch.S_next, np.stack([by_tr[k].S_next[0] for k in rows])
            )
            np.add.at(counts[name], [position[k] for k in rows], 1)
            w = np.array([P[k] ** -BETA for k in rows])  # (N P)^-beta, normalised per batch
            np.testing.assert_allclose(batch.W, w / w.max(), rtol=1e-5)
    exact = np.array([P[k] for k in items]) * counts["sharded"].sum()
    assert stats.chisquare(counts["sharded"], exact).pvalue > 1e-4
    table = np.stack([counts["sharded"], counts["local"]])
    assert stats.chi2_contingency(table).pvalue > 1e-4
