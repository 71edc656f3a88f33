"""One stale-index rule for both prioritized twins: an update for an overwritten slot is ignored.

The host :class:`PrioritizedReplayBuffer` returns transition ids and ignores an update for an
id whose slot was overwritten since it was sampled; the jittable buffer returns the storage
slots with their versions (their write counts) and ignores an update whose version is no
longer the slot's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.replay import PrioritizedReplayBuffer, TransitionBatch, make_prioritized_buffer
from tests._compiles import compiles_again

EPS = 1e-4


def host_batch(ts):
    return TransitionBatch.concatenate(
        *(
            TransitionBatch.from_single(
                s=np.float32(t), a=0, logp=0.0, r=0.0, done=False, gamma=0.9
            )
            for t in ts
        )
    )


def jit_items(ts):
    return {"t": jnp.asarray(ts, jnp.float32)}


class Twins:
    """The same stream into both buffers; handles of sampled items, by item."""

    def __init__(self, capacity, alpha=1.0):
        self.host = PrioritizedReplayBuffer(capacity, alpha=alpha, epsilon=EPS, random_seed=0)
        self.buffer = make_prioritized_buffer(capacity, alpha=alpha, epsilon=EPS)
        self.state = self.buffer.init({"t": jnp.float32(0)})
        self.capacity = capacity

    def add(self, ts):
        self.host.add(host_batch(ts))
        self.state = self.buffer.add(self.state, jit_items(ts))

    def handles(self):
        """Each held item's host id and jittable (slot, version), from samples of both."""
        host = self.host.sample(512)
        ids = {int(t): int(i) for t, i in zip(np.asarray(host.S), host.idx)}
        s = self.buffer.sample(self.state, jax.random.key(len(ids)), 512)
        slots = {
            int(t): (int(i), int(v))
            for t, i, v in zip(np.asarray(s.items["t"]), s.indices, s.versions)
        }
        assert set(ids) == set(slots)  # every held item was drawn from both
        return ids, slots

    def update(self, handles, adv, versions=True):
        ids, slots = handles
        ts = sorted(adv)
        self.host.update(np.array([ids[t] for t in ts]), np.array([adv[t] for t in ts]))
        indices = jnp.array([slots[t][0] for t in ts])
        vs = jnp.array([slots[t][1] for t in ts]) if versions else None
        self.state = self.buffer.update(
            self.state, indices, jnp.array([adv[t] for t in ts], jnp.float32), vs
        )

    def priorities(self):
        """Priorities of the held items, by item, in both buffers."""
        ids, slots = self.handles()
        host = dict(zip(sorted(ids), self.host.priorities(np.array([ids[t] for t in sorted(ids)]))))
        leaves = np.asarray(self.state.tree.nodes)[self.state.tree.num_leaves :]
        return host, {t: float(leaves[slot]) for t, (slot, _) in slots.items()}


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_twins_fed_the_same_stream_end_with_the_same_priorities(alpha):
    twins = Twins(4, alpha)
    twins.add([0, 1, 2, 3])
    twins.update(twins.handles(), {0: 2.0, 1: 3.0, 2: 4.0, 3: 5.0})  # all fresh: all set
    sampled = twins.handles()
    twins.add([4, 5])  # items 0 and 1 are overwritten between the sample and its update
    twins.update(sampled, {0: 10.0, 1: 20.0, 2: 30.0, 3: 40.0})
    host, jit = twins.priorities()
    assert sorted(host) == sorted(jit) == [2, 3, 4, 5]
    expected = {2: 30.0, 3: 40.0, 4: 5.0, 5: 5.0}  # 4 and 5 kept the max priority of their add
    for t, adv in expected.items():
        p = (adv + EPS) ** alpha
        assert host[t] == pytest.approx(p, rel=1e-6) and jit[t] == pytest.approx(p, rel=1e-6)
    # the ignored updates did not raise the maximum priority either: a new item gets 40
    twins.add([6])
    host, jit = twins.priorities()
    p = (40.0 + EPS) ** alpha
    assert host[6] == pytest.approx(p, rel=1e-6) and jit[6] == pytest.approx(p, rel=1e-6)


def test_without_versions_the_slots_current_item_gets_the_priority():
    twins = Twins(4)
    twins.add([0, 1, 2, 3])
    sampled = twins.handles()
    twins.add([4])  # item 0 is overwritten by item 4
    twins.update(sampled, {0: 9.0}, versions=False)
    host, jit = twins.priorities()
    assert host[4] == pytest.approx(1 + EPS)  # the host ignored the stale id
    assert jit[4] == pytest.approx(9 + EPS)  # without versions the jittable one cannot know


def test_an_update_after_the_slot_came_round_again_is_ignored():
    buffer = make_prioritized_buffer(3)
    state = buffer.add(buffer.init(jnp.zeros(1)), jnp.zeros((3, 1)))
    s = buffer.sample(state, jax.random.key(0), 8)
    for _ in range(4):  # every slot rewritten four times: versions 1 -> 5
        state = buffer.add(state, jnp.ones((3, 1)))
    assert np.asarray(buffer.sample(state, jax.random.key(0), 8).versions).tolist() == [5] * 8
    new = buffer.update(state, s.indices, jnp.full(8, 7.0), s.versions)
    np.testing.assert_array_equal(new.tree.nodes, state.tree.nodes)
    fresh = buffer.sample(state, jax.random.key(1), 8)
    new = buffer.update(state, fresh.indices, jnp.full(8, 7.0), fresh.versions)
    assert not np.array_equal(new.tree.nodes, state.tree.nodes)


def test_versions_under_jit_and_vmap_without_retracing():
    buffer = make_prioritized_buffer(4)
    traces = {"update": 0}

    def update(state, indices, priorities, versions):
        traces["update"] += 1
        return buffer.update(state, indices, priorities, versions)

    update = jax.jit(update, donate_argnums=0)
    add = jax.jit(buffer.add)
    sample = jax.jit(buffer.sample, static_argnums=2)
    state = add(buffer.init(jnp.zeros(1)), jnp.zeros((4, 1)))
    for step in range(3):
        s = sample(state, jax.random.key(step), 2)
        state = add(state, jnp.ones((1, 1)))
        state = update(state, s.indices, jnp.full(2, 3.0), s.versions)
    assert traces["update"] == 1

    @jax.jit
    @jax.vmap
    def run(key):
        st = buffer.add(buffer.init(jnp.zeros(1)), jnp.zeros((4, 1)))
        s = buffer.sample(st, key, 2)
        st = buffer.add(st, jnp.ones((1, 1)))  # overwrites slot 0
        return s, buffer.update(st, s.indices, jnp.full(2, 3.0), s.versions)

    s, states = run(jax.random.split(jax.random.key(0), 16))
    leaves = np.asarray(states.tree.nodes)[:, 4:8]
    for k in range(16):
        for slot in range(4):
            updated = slot in np.asarray(s.indices[k]).tolist() and slot != 0
            assert leaves[k, slot] == pytest.approx(3 + EPS if updated else 1.0)


def test_eager_updates_with_versions_compile_once():
    buffer = make_prioritized_buffer(8)
    state = buffer.add(buffer.init(jnp.zeros(1)), jnp.zeros((8, 1)))
    s = buffer.sample(state, jax.random.key(0), 4)
    calls = [
        lambda i: buffer.update(state, s.indices, jnp.full(4, float(i)), s.versions),
        lambda i: buffer.update(state, np.array([i, i + 1]), np.ones(2), np.array([1, 1])),
    ]
    assert compiles_again(calls) == 0


def test_versions_are_checked_like_indices():
    buffer = make_prioritized_buffer(8)
    state = buffer.add(buffer.init(jnp.zeros(1)), jnp.zeros((4, 1)))
    idx, p = np.array([0, 1]), np.array([5.0, 5.0])
    with pytest.raises(TypeError, match="versions must be integers"):
        buffer.update(state, idx, p, np.array([1.0, 1.0]))
    with pytest.raises(TypeError, match="versions must be integers"):
        jax.jit(buffer.update)(state, idx, p, jnp.array([True, True]))
    with pytest.raises(ValueError, match="versions"):
        buffer.update(state, idx, p, np.array([1, 1, 1]))
    # a 64-bit version never wraps onto a valid one (2**32 + 1 is not version 1)
    out = buffer.update(state, idx, p, np.array([2**32 + 1, -(2**32) + 1], np.int64))
    np.testing.assert_array_equal(out.tree.nodes, state.tree.nodes)
    # unsigned and narrow integers compare by value
    for dtype in (np.uint32, np.int8, np.uint64):
        out = buffer.update(state, idx, p, np.array([1, 2], dtype))
        values = np.asarray(out.tree.nodes)[8:10]
        assert values[0] == pytest.approx(5 + 1e-4) and values[1] == 1.0


def test_the_versions_are_the_write_counts_of_the_slots():
    # derived from the laps of the write head and its position, they must equal a count of
    # the writes of each slot, batch after batch, also across the wrap of the laps
    capacity = 5
    buffer = make_prioritized_buffer(capacity)
    state = buffer.init(jnp.zeros(1))
    writes = np.zeros(capacity, np.int64)
    rng = np.random.default_rng(0)
    pos = 0
    for step in range(40):
        if step == 20:  # as if the head had come back to slot 0 2**31 - 2 more times
            assert writes.min() >= 1  # full
            laps = (int(state.laps) - 1 + 2**31 - 2) % (2**31 - 1) + 1
            state = state.replace(laps=jnp.int32(laps))
            writes += 2**31 - 2
        n = int(rng.integers(1, capacity + 1))
        state = buffer.add(state, jnp.zeros((n, 1)))
        writes[(pos + np.arange(n)) % capacity] += 1
        pos = (pos + n) % capacity
        s = buffer.sample(state, jax.random.key(step), 64)
        expected = (writes[np.asarray(s.indices)] - 1) % (2**31 - 1) + 1
        np.testing.assert_array_equal(np.asarray(s.versions), expected)
        state.__checkpoint_check__()
