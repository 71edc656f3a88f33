"""The jittable frame-stacked buffer against the host one on the same stream."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from coax_utils.replay import FrameStackReplayBuffer, NStep, make_frame_stack_buffer
from tests.replay.test_frames import K, Tee, image_cartpole, run


def test_jittable_matches_host_on_the_same_stream():
    host = FrameStackReplayBuffer(capacity=40, stack_size=K, frame_capacity=44, random_seed=0)
    tee = Tee(host)
    buf = make_frame_stack_buffer(capacity=40, stack_size=K, frame_capacity=44)
    add = jax.jit(buf.add)
    sample = jax.jit(buf.sample, static_argnums=2)
    state = None
    seen = []

    class Both:
        def add(self, batch):
            nonlocal state
            # Rn identifies each transition: its position in the stream
            batch = batch.replace(Rn=np.arange(len(seen), len(seen) + batch.batch_size) * 1.0)
            seen.extend(batch.to_singles())
            tee.add(batch)
            if state is None:
                state = buf.init(jax.tree_util.tree_map(lambda x: x[0], batch))
            state = add(state, batch)

    run(image_cartpole(max_steps=6), Both(), NStep(n=2, gamma=0.9), 90)
    # each frame about once (a direct-mapped table may miss a repeat: stored again)
    assert host.frame_count <= int(state.frame_count) <= host.frame_count + 4
    live = {int(tr.Rn[0]) for tr in host}
    for i in range(5):
        batch = sample(state, jax.random.PRNGKey(i), 64)
        for row in range(64):
            t = int(batch.Rn[row])
            assert t in live  # never a transition that lost frames
            np.testing.assert_array_equal(batch.S[row], seen[t].S[0])
            np.testing.assert_array_equal(batch.S_next[row], seen[t].S_next[0])
    assert len(live) < len(host)  # the ring did overwrite frames of stored transitions
    with pytest.raises(ValueError, match="frames"):
        add(state, seen[0].replace(S=seen[0].S[:, :, :5], S_next=seen[0].S_next[:, :, :5]))
    with pytest.raises(ValueError, match="stack_size"):
        make_frame_stack_buffer(10, stack_size=0)
