"""Restored jittable frame-stacked states are checked: honest ones come back exact, lying
ones (counters, ids, shapes, priorities of transitions that lost frames) are refused by
utils.load(safe=True) before anything reads them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils
from coax_utils.replay import (
    make_frame_stack_buffer,
    make_prioritized_frame_stack_buffer,
)
from coax_utils.utils import CheckpointDamagedError, sum_tree_set, sum_tree_values
from tests.replay.test_frames_checkpoints import stream

K = 2


def filled(factory, steps=45, **kwargs):
    """A state of capacity 30 and frame_capacity 20 fed episodes of 3 steps: the oldest
    transitions lost frames."""
    buf = factory(30, stack_size=K, frame_capacity=20, **kwargs)
    trs = stream(steps, 3)
    state = buf.init(jax.tree_util.tree_map(lambda x: x[0], trs[0]))
    for tr in trs:
        state = buf.add(state, tr)
    return buf, state


@pytest.fixture(scope="module")
def uniform():
    return filled(make_frame_stack_buffer)


@pytest.fixture(scope="module")
def prioritized():
    return filled(make_prioritized_frame_stack_buffer, alpha=0.7)


def round_trip(state):
    return utils.loads(utils.dumps(state), safe=True)


def refused(state, match):
    with pytest.raises(CheckpointDamagedError, match=match):
        round_trip(state)


def test_honest_states_come_back_exact(uniform, prioritized):
    for buf, state in (uniform, prioritized):
        back = round_trip(state)
        assert type(back) is type(state)
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(back)):
            np.testing.assert_array_equal(a, b)
        x, y = (
            buf.sample(state, jax.random.PRNGKey(1), 16),
            buf.sample(back, jax.random.PRNGKey(1), 16),
        )
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
            np.testing.assert_array_equal(a, b)
    # also with a batch axis (a vmap of buffers)
    _, state = uniform
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    round_trip(stacked)


def items_with(state, **fields):
    return state.replace(
        transitions=state.transitions.replace(items=state.transitions.items.replace(**fields))
    )


@pytest.mark.parametrize("which", ["uniform", "prioritized"])
def test_lying_frame_fields_are_refused(which, request):
    _, state = request.getfixturevalue(which)
    S = state.transitions.items.S
    refused(state.replace(frame_count=jnp.int32(3)), "not stored yet")
    refused(state.replace(frame_count=jnp.int32(-1)), "frame_count")
    refused(items_with(state, S=S.at[0, 0].set(-7)), r"\[0, ")
    refused(items_with(state, S=S[:, :1]), "same number")
    refused(items_with(state, S=np.asarray(S, np.int64)), "int32")
    refused(state.replace(frames=state.frames[:3]), "rows")
    refused(state.replace(table_id=state.table_id.at[5].set(2**30 - 1)), "table")
    refused(state.replace(table_id=state.table_id[:4096]), "power of two")
    refused(state.replace(table_hash=state.table_hash.astype(jnp.int32)), "table_hash")


def test_transitions_of_another_kind_are_refused(uniform, prioritized):
    (_, u), (_, p) = uniform, prioritized
    refused(u.replace(transitions=p.transitions), "UniformBufferState")
    refused(p.replace(transitions=u.transitions), "PrioritizedBufferState")


def lost_slots(buf, state):
    items, size = state.transitions.items, int(state.transitions.size)
    ids = np.concatenate([np.asarray(items.S), np.asarray(items.S_next)], axis=1).astype(np.int64)
    F = buf.frame_capacity
    age = (int(state.frame_count) - ids) % (F * (2**30 // F))
    return np.flatnonzero(age[:size].max(axis=1) > F)


def test_lying_prioritized_fields_are_refused(prioritized):
    buf, state = prioritized
    lost = lost_slots(buf, state)
    assert len(lost)  # the case the last lies are about
    tree = state.transitions.tree
    # a transition that lost frames given a priority again (a consistent tree)
    revived = sum_tree_set(tree, jnp.asarray(lost[:1]), jnp.ones(1))
    refused(state.replace(transitions=state.transitions.replace(tree=revived)), "lost frames")
    # the frontier claims every stored transition was checked, yet live ones are older
    refused(state.replace(frontier=state.added), "frontier")
    refused(state.replace(window=jnp.int32(buf.frame_capacity)), "window")
    refused(state.replace(added=state.added + 1), "added")
    refused(state.replace(birth=state.birth[::-1]), "birth")
    refused(state.replace(birth=state.birth.at[int(state.transitions.pos) - 1].set(0)), "birth")
    assert float(np.asarray(sum_tree_values(tree))[lost].max()) == 0.0


def test_an_update_of_a_slot_written_since_the_sample_is_ignored():
    # the stale-index rule of the prioritized twins, through the frame-stacked buffer: the
    # sample's versions go with its indices
    buf = make_prioritized_frame_stack_buffer(8, stack_size=K, frame_capacity=40)
    trs = stream(20, 100)
    state = buf.init(jax.tree_util.tree_map(lambda x: x[0], trs[0]))
    for tr in trs[:8]:
        state = buf.add(state, tr)
    drawn = buf.sample(state, jax.random.PRNGKey(0), 64)
    slots = np.unique(np.asarray(drawn.indices))
    versions = np.asarray(drawn.versions)[np.unique(np.asarray(drawn.indices), True)[1]]
    for tr in trs[8:11]:  # overwrites slots 0, 1, 2
        state = buf.add(state, tr)
    before = np.asarray(sum_tree_values(state.transitions.tree))
    state = buf.update(state, jnp.asarray(slots), jnp.full(len(slots), 5.0), versions)
    after = np.asarray(sum_tree_values(state.transitions.tree))
    written = slots < 3
    assert written.any() and (~written).any()
    np.testing.assert_array_equal(after[slots[written]], before[slots[written]])
    np.testing.assert_allclose(after[slots[~written]], (5.0 + 1e-4) ** 1.0, rtol=1e-6)


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_vmapped_batch_of_buffers_round_trips_and_continues(prioritized):
    """Three buffers under jax.vmap, fed different streams, come back from a safe load
    exactly and go on identically; a batch with one lying member is refused, naming it."""
    kwargs = dict(alpha=0.7) if prioritized else {}
    make = make_prioritized_frame_stack_buffer if prioritized else make_frame_stack_buffer
    buf = make(12, stack_size=K, frame_capacity=10, **kwargs)
    members = [stream(16, 3, seed=i, first=100 * i) for i in range(3)]
    trs = [jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *m) for m in zip(*members)]
    example = jax.tree_util.tree_map(lambda x: x[0], members[0][0])
    state = jax.vmap(lambda _: buf.init(example))(jnp.arange(3))
    add = jax.jit(jax.vmap(buf.add))
    for tr in trs[:10]:
        state = add(state, tr)
    back = round_trip(state)
    assert type(back) is type(state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, state)
    for tr in trs[10:]:
        state, back = add(state, tr), add(back, tr)
    sample = jax.jit(jax.vmap(lambda s, k: buf.sample(s, k, 8)))
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    jax.tree_util.tree_map(np.testing.assert_array_equal, sample(back, keys), sample(state, keys))
    refused(state.replace(frame_count=state.frame_count.at[1].set(-1)), r"buffer \(1,\) of the")
    if prioritized:
        refused(state.replace(window=state.window.at[2].set(-1)), r"buffer \(2,\) of the batch")
