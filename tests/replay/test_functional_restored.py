"""Restored states of the jittable buffers are checked before use.

A checkpoint rebuilds :class:`UniformBufferState` and :class:`PrioritizedBufferState` field by
field; a state that no sequence of ``add`` and ``update`` calls can produce must be refused
on load (:class:`coax_utils.utils.CheckpointDamagedError`), since the buffer would otherwise
read the wrong rows without an error: with ``size=1000`` at capacity 4 every sample was the
last row, and with a tree whose node 2 said 0 while node 3 carried the total every sample was
an empty slot with weight 1.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils
from coax_utils.replay import (
    PrioritizedBufferState,
    UniformBufferState,
    make_prioritized_buffer,
    make_uniform_buffer,
)
from tests.utils.test_segment_tree_fn import _with_sums as host_sums

EXAMPLE = {"obs": jnp.zeros(2), "t": jnp.int32(0)}


def items(ts):
    ts = jnp.asarray(ts, jnp.int32)
    return {"obs": jnp.repeat(ts[:, None].astype(jnp.float32), 2, axis=1), "t": ts}


def _states(make):
    """Honest states: empty, partly filled with episode ends, full and wrapped, updated."""
    buffer = make(6)
    state = buffer.init(EXAMPLE)
    yield buffer, state
    state = buffer.add(state, items(range(4)), episode_end=jnp.array([0, 1, 0, 0]))
    yield buffer, state
    state = buffer.add(state, items(range(4, 9)), episode_end=jnp.array([0, 0, 1, 0, 1]))
    if make is make_prioritized_buffer:
        state = buffer.update(state, jnp.array([0, 2, 5]), jnp.array([3.0, 0.0, -7.0]))
    yield buffer, state
    state = buffer.add(state, items(range(9, 15)))  # once more round the ring
    yield buffer, state


def _assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_honest_states_round_trip(tmp_path, make):
    for k, (buffer, state) in enumerate(_states(make)):
        utils.dump(state, tmp_path / f"{k}.lz4")
        restored = utils.load(tmp_path / f"{k}.lz4", safe=True)
        _assert_same(state, restored)
        _assert_same(state, utils.loads(utils.dumps(state), safe=False))
        if int(state.size):
            key = jax.random.key(k)
            _assert_same(buffer.sample(state, key, 8), buffer.sample(restored, key, 8))


@pytest.mark.parametrize("make", [make_uniform_buffer, make_prioritized_buffer])
def test_honest_vmapped_states_round_trip(make):
    buffer = make(5)
    states = jax.vmap(lambda _: buffer.init(EXAMPLE))(jnp.arange(3))
    for n in (2, 4):  # the buffers wrap on the second add
        batch = jax.vmap(lambda k, n=n: items(jnp.arange(n) + 10 * k))(jnp.arange(3))
        states = jax.vmap(buffer.add)(states, batch)
        _assert_same(states, utils.loads(utils.dumps(states), safe=True))


def test_laps_that_wrapped_round_trip():
    buffer = make_prioritized_buffer(4)
    state = buffer.add(buffer.init(EXAMPLE), items(range(3)))
    assert int(state.laps) == 0
    state = buffer.add(state, items(range(3, 5)))  # the write head comes back to slot 0
    assert (int(state.pos), int(state.laps)) == (1, 1)
    state = buffer.add(state.replace(laps=jnp.int32(2**31 - 1)), items(range(5, 8)))
    assert (int(state.pos), int(state.laps)) == (0, 1)  # counted again from 1
    _assert_same(state, utils.loads(utils.dumps(state), safe=True))


def _edit(x, index, value):
    x = np.array(x)
    x[index] = value
    return jnp.asarray(x)


def _with_sums(nodes):
    return jnp.asarray(host_sums(nodes))


def _lying_uniform(state):
    """(expected message, lying state) pairs from a full, wrapped uniform or prioritized
    state of capacity 6 (pos 3) and one partly filled (pos = size = 4)."""
    full, part = state
    yield "size must lie in [0, 6]", part.replace(size=jnp.int32(1000), pos=jnp.int32(0))
    yield "size must lie in [0, 6]", part.replace(size=jnp.int32(-1))
    yield "pos must lie in [0, 6)", full.replace(pos=jnp.int32(6))
    yield "pos must lie in [0, 6)", full.replace(pos=jnp.int32(-2))
    yield "pos must equal size", part.replace(pos=jnp.int32(1))
    yield "pos must be int32", part.replace(pos=jnp.float32(4))
    yield "size must be int32", part.replace(size=jnp.asarray(np.full((1,), 4, np.int32)))
    yield "pos must be an array", part.replace(pos=4)
    yield "episode must have the batch shape", part.replace(episode=jnp.zeros((6, 1), jnp.int32))
    yield "leaf 0 of items", part.replace(items={"obs": jnp.zeros((5, 2)), "t": part.items["t"]})
    yield "leaf 1 of items must be an array", part.replace(items={**part.items, "t": [0] * 6})
    yield "episode ids of empty slots must be 0", part.replace(episode=_edit(part.episode, 5, 1))
    yield "episode ids must lie in", part.replace(episode=_edit(part.episode, 0, -1))
    yield "episode ids must lie in", part.replace(episode=_edit(part.episode, 3, 9))
    # in insertion order (slots 3, 4, 5, 0, 1, 2: ids 1, 1, 1, 2, 2, 2) ids must not go down,
    # within the slots or from the last slot to slot 0
    yield "must not decrease", full.replace(episode=_edit(full.episode, 4, 2))
    yield "must not decrease", full.replace(episode=_edit(_edit(full.episode, 0, 1), 5, 2))
    yield "episode_counter must be", full.replace(episode_counter=full.episode_counter + 2)
    empty = part.replace(pos=jnp.int32(0), size=jnp.int32(0), episode=jnp.zeros(6, jnp.int32))
    yield "episode_counter must be", empty.replace(episode_counter=jnp.int32(1))


def _lying_prioritized(state):
    full, part = state
    nodes, n = np.asarray(part.tree.nodes), part.tree.num_leaves  # 16 nodes, 8 leaves
    tree = part.tree
    lie = _edit(_edit(nodes, 2, 0.0), 3, nodes[1])  # the issue's case
    yield "node 2 holds 0.0", part.replace(tree=tree.replace(nodes=lie))
    yield "finite and >= 0", part.replace(tree=tree.replace(nodes=_with_sums(_edit(nodes, n, -1))))
    yield "finite and >= 0", part.replace(tree=tree.replace(nodes=_edit(nodes, n + 1, np.nan)))
    yield "padded leaves", part.replace(tree=tree.replace(nodes=_with_sums(_edit(nodes, 15, 1))))
    empty = _with_sums(_edit(nodes, n + 5, 1.0))  # slot 5 is empty
    yield "empty slots must have priority 0", part.replace(tree=tree.replace(nodes=empty))
    high = _with_sums(_edit(nodes, n + 1, 1e6))
    yield "exceeds max_priority", part.replace(tree=tree.replace(nodes=high))
    yield "max_priority must lie", part.replace(max_priority=jnp.float32(np.nan))
    yield "max_priority must lie", part.replace(max_priority=jnp.float32(0.5))
    yield "max_priority must lie", part.replace(max_priority=jnp.float32(np.inf))
    yield "max_priority must be float32", part.replace(max_priority=jnp.int32(2))
    eight = make_prioritized_buffer(8).init(EXAMPLE).tree
    yield "the sum tree holds 8 values", part.replace(tree=eight)
    yield "tree must be a SumTreeState", part.replace(tree=nodes)
    half = utils.sum_tree_init(6, jnp.bfloat16)
    yield "nodes must be float32", full.replace(tree=half)
    yield "laps must be 0 while the buffer is not full", part.replace(laps=jnp.int32(1))
    yield "at least 1 once it is", full.replace(laps=jnp.int32(0))
    yield "at least 1 once it is", full.replace(laps=jnp.int32(-3))
    yield "laps must be int32", full.replace(laps=jnp.float32(1))


def _full_and_part(make):
    buffer = make(6)
    part = buffer.add(buffer.init(EXAMPLE), items(range(4)), episode_end=jnp.array([0, 1, 0, 0]))
    full = buffer.add(part, items(range(4, 9)), episode_end=jnp.array([0, 1, 0, 0, 0]))
    assert (int(full.pos), int(full.size), int(part.pos), int(part.size)) == (3, 6, 4, 4)
    # slots 3, 4, 5, 0, 1, 2 (oldest first) hold episodes 1, 1, 1, 2, 2, 2
    assert np.asarray(full.episode).tolist() == [2, 2, 2, 1, 1, 1]
    assert np.asarray(part.episode).tolist() == [0, 0, 1, 1, 0, 0]
    return full, part


UNIFORM = list(_lying_uniform(_full_and_part(make_uniform_buffer)))
PRIORITIZED = list(_lying_uniform(_full_and_part(make_prioritized_buffer)))
PRIORITIZED += list(_lying_prioritized(_full_and_part(make_prioritized_buffer)))


@pytest.mark.parametrize(
    "message, state",
    UNIFORM + PRIORITIZED,
    ids=[f"uniform-{m}" for m, _ in UNIFORM] + [f"prioritized-{m}" for m, _ in PRIORITIZED],
)
def test_lying_states_are_refused_on_load(message, state):
    data = utils.dumps(state)
    with pytest.raises(utils.CheckpointDamagedError, match=re.escape(message)):
        utils.loads(data, safe=True)
    with pytest.raises(ValueError, match=re.escape(message)):
        state.__checkpoint_check__()


def test_the_issues_states_are_refused_from_files(tmp_path):
    # the two states of the issue, through files and both modes
    full, part = _full_and_part(make_prioritized_buffer)
    nodes = np.asarray(part.tree.nodes)
    lie = part.replace(tree=part.tree.replace(nodes=_edit(_edit(nodes, 2, 0.0), 3, nodes[1])))
    buffer = make_uniform_buffer(4)
    big = buffer.add(buffer.init(EXAMPLE), items(range(4))).replace(size=jnp.int32(1000))
    for k, (state, message) in enumerate(((lie, "node 2 holds 0.0"), (big, "size must lie"))):
        utils.dump(state, tmp_path / f"{k}.lz4")
        for safe in (True, False):
            with pytest.raises(utils.CheckpointDamagedError, match=message):
                utils.load(tmp_path / f"{k}.lz4", safe=safe)


def test_a_lying_state_in_a_vmapped_batch_is_refused():
    buffer = make_prioritized_buffer(5)
    states = jax.vmap(lambda _: buffer.init(EXAMPLE))(jnp.arange(3))
    states = jax.vmap(buffer.add)(states, jax.vmap(lambda k: items(jnp.arange(3)))(jnp.arange(3)))
    utils.loads(utils.dumps(states), safe=True)
    bad = states.replace(size=_edit(states.size, 1, 7))
    with pytest.raises(utils.CheckpointDamagedError, match="size must lie"):
        utils.loads(utils.dumps(bad), safe=True)
    nodes = states.tree.nodes
    bad = states.replace(tree=states.tree.replace(nodes=_with_sums(_edit(nodes, (2, 12), 0.5))))
    with pytest.raises(utils.CheckpointDamagedError, match=re.escape("slot (2, 4)")):
        utils.loads(utils.dumps(bad), safe=True)  # an empty slot of buffer 2 with a priority


def test_every_state_class_defines_the_check():
    for cls in (UniformBufferState, PrioritizedBufferState, utils.SumTreeState):
        assert callable(cls.__dict__["__checkpoint_check__"])
