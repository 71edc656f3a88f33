"""The jittable frame-stacked buffers against the host ones on the same stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils
from coax_utils.replay import (
    FrameStackReplayBuffer,
    NStep,
    PrioritizedFrameStackReplayBuffer,
    TransitionBatch,
    make_frame_stack_buffer,
    make_prioritized_buffer,
    make_prioritized_frame_stack_buffer,
)
from coax_utils.utils import sum_tree_values
from tests._compiles import compiles_again
from tests.replay.test_frames import K, Tee, image_cartpole, run


def frame_modulus(F):
    """The documented modulus of frame ids and frame_count."""
    return F * (2**30 // F)


def near_the_wrap(state, frames_left, transitions_left=None, capacity=None):
    """An empty state whose counters are about to wrap around (as after ~2**30 frames);
    ``transitions_left`` a multiple of ``capacity`` (the slot of a transition is its number
    modulo the capacity)."""
    F = state.frames.shape[0]
    fields = dict(frame_count=jnp.int32(frame_modulus(F) - frames_left))
    if transitions_left is not None:
        count = capacity * (2**30 // capacity) - transitions_left
        fields.update(added=jnp.int32(count), frontier=jnp.int32(count))
    return state.replace(**fields)


@pytest.mark.parametrize("wrap", [False, True], ids=["fresh", "counters-wrap"])
def test_jittable_matches_host_on_the_same_stream(wrap):
    F = 36  # transitions keep their frames for F - window = 29 frames: the oldest lose them
    host = FrameStackReplayBuffer(capacity=40, stack_size=K, frame_capacity=F, random_seed=0)
    tee = Tee(host)
    buf = make_frame_stack_buffer(capacity=40, stack_size=K, frame_capacity=F)
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
                start.append(int(state.frame_count))
                if wrap:  # the frame counter wraps around during the run
                    state = near_the_wrap(state, frames_left=50)
                    start[0] = int(state.frame_count)
            state = add(state, batch)

    start = []
    run(image_cartpole(max_steps=6), Both(), NStep(n=2, gamma=0.9), 90)
    stored = (int(state.frame_count) - start[0]) % frame_modulus(F)
    assert not wrap or int(state.frame_count) < start[0]  # it did wrap
    # each frame about once (a direct-mapped table may miss a repeat: stored again)
    assert host.frame_count <= stored <= host.frame_count + 4
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


# -- the prioritized jittable buffer ---------------------------------------------------------


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def lost_by_full_scan(state, F):
    """Slots whose transition lost a frame, found by scanning every stored transition: one
    of its frames is more than F frames older than the newest (ids count modulo a number)."""
    items, size = state.transitions.items, int(state.transitions.size)
    ids = np.concatenate([np.asarray(items.S), np.asarray(items.S_next)], axis=1)
    age = (int(state.frame_count) - ids.astype(np.int64)) % frame_modulus(F)
    return set(np.flatnonzero(age[:size].max(axis=1) > F).tolist())


class Numbered:
    """Feeds the host buffer (through Tee, with its plain-buffer oracle) and the jittable
    buffer the same stream; ``Rn`` is replaced by each transition's position in the stream."""

    def __init__(self, host, buf, after_add=None, wrap=False):
        self.tee, self.buf, self.after_add, self.wrap = Tee(host), buf, after_add, wrap
        self.add_fn = jax.jit(buf.add, donate_argnums=0)
        self.state, self.seen, self.start = None, [], 0

    def add(self, batch):
        n = batch.batch_size
        batch = batch.replace(Rn=np.arange(len(self.seen), len(self.seen) + n) * 1.0)
        self.seen.extend(batch.to_singles())
        self.tee.add(batch)
        if self.state is None:
            self.state = self.buf.init(jax.tree_util.tree_map(lambda x: x[0], batch))
            if self.wrap:  # the frame and transition counters wrap around during the run
                self.state = near_the_wrap(self.state, 20, 30, self.buf.capacity)
            self.start = int(self.state.frame_count)
        self.state = self.add_fn(self.state, batch)
        if self.after_add is not None:
            self.after_add(self)


@pytest.mark.parametrize("wrap", [False, True], ids=["fresh", "counters-wrap"])
def test_prioritized_jittable_matches_host_and_never_samples_lost_transitions(wrap):
    F = 24
    host = PrioritizedFrameStackReplayBuffer(
        capacity=30, stack_size=K, frame_capacity=F, alpha=0.7, random_seed=0
    )
    buf = make_prioritized_frame_stack_buffer(30, stack_size=K, alpha=0.7, frame_capacity=F)
    sample = jax.jit(buf.sample, static_argnums=2)
    update = jax.jit(buf.update, donate_argnums=0)
    rng = np.random.default_rng(0)
    lost_counts = []

    def check(both):
        state = both.state
        values = np.asarray(sum_tree_values(state.transitions.tree))
        lost = lost_by_full_scan(state, F)
        size = int(state.transitions.size)
        # priority 0 exactly for the transitions that lost frames (the bounded search of add
        # finds what a scan of the whole buffer finds)
        assert set(np.flatnonzero(values[:size] == 0).tolist()) == lost
        lost_counts.append(len(lost))
        # each frame about once (a direct-mapped table may miss a repeat: stored again)
        stored = (int(state.frame_count) - both.start) % frame_modulus(F)
        assert host.frame_count <= stored <= host.frame_count + 4
        host_live = {int(tr.Rn[0]): tr for tr in host}
        drawn = sample(state, jax.random.PRNGKey(len(both.seen)), 48)
        assert set(np.asarray(drawn.indices).tolist()).isdisjoint(lost)
        for row in range(48):
            t = int(drawn.items.Rn[row])
            for name in ("S", "S_next"):  # n steps ahead for S_next
                got = getattr(drawn.items, name)[row]
                np.testing.assert_array_equal(got, getattr(both.seen[t], name)[0])
                if t in host_live:
                    np.testing.assert_array_equal(got, getattr(host_live[t], name)[0])
        assert float(drawn.weights.max()) == 1.0 and float(drawn.weights.min()) > 0
        priorities = rng.normal(size=48)
        if lost:  # an update of a transition that lost frames is ignored
            drawn_idx = np.r_[np.asarray(drawn.indices)[:-1], min(lost)]
        else:
            drawn_idx = np.asarray(drawn.indices)
        both.state = update(state, drawn_idx, priorities)
        values = np.asarray(sum_tree_values(both.state.transitions.tree))
        assert all(values[s] == 0 for s in lost)

    both = Numbered(host, buf, after_add=check, wrap=wrap)
    run(image_cartpole(max_steps=5), both, NStep(n=2, gamma=0.9), 70)
    assert max(lost_counts) > 0  # the ring did overwrite frames of stored transitions
    assert len(both.seen) > 30  # and the transition ring wrapped around
    if wrap:  # and so did both counters
        assert int(both.state.frame_count) < both.start
        assert int(both.state.added) == len(both.seen) - 30
        assert int(both.state.frontier) <= int(both.state.added)


@pytest.fixture(scope="module")
def prioritized_filled():
    """A prioritized jittable buffer of 60 transitions that all hold their frames."""
    host = PrioritizedFrameStackReplayBuffer(capacity=60, stack_size=K, random_seed=0)
    buf = make_prioritized_frame_stack_buffer(60, stack_size=K, alpha=0.6, beta=0.5)
    both = Numbered(host, buf)
    run(image_cartpole(max_steps=10), both, NStep(n=3, gamma=0.9), 75)
    assert int(both.state.transitions.size) == 60
    assert not lost_by_full_scan(both.state, buf.frame_capacity)
    return buf, both.state, both.seen


def test_prioritized_sampling_follows_the_priorities(prioritized_filled):
    buf, state, seen = prioritized_filled
    delta = np.random.default_rng(1).exponential(size=60)
    state = jax.jit(buf.update)(state, np.arange(60), delta)
    p = (np.abs(delta) + buf.epsilon) ** buf.alpha
    n = 30_000
    drawn = jax.jit(buf.sample, static_argnums=2)(state, jax.random.PRNGKey(7), n)
    counts = np.bincount(np.asarray(drawn.indices), minlength=60)

    def chi2(prob):
        return float(np.sum((counts - n * prob) ** 2 / (n * prob)))

    bound = 59 + 6 * np.sqrt(2 * 59)  # 6 standard deviations above the mean of chi2(59)
    assert chi2(p / p.sum()) < bound
    assert chi2(np.full(60, 1 / 60)) > bound  # the test tells priorities from uniform
    # the importance weights are the dense prioritized buffer's on the same priorities
    dense = make_prioritized_buffer(60, alpha=0.6, beta=0.5)
    dstate = dense.init(np.float32(0))
    dstate = dense.update(dense.add(dstate, np.zeros(60, np.float32)), np.arange(60), delta)
    for beta in (None, 0.9):
        key = jax.random.PRNGKey(3)
        ours, theirs = buf.sample(state, key, 64, beta), dense.sample(dstate, key, 64, beta)
        np.testing.assert_array_equal(ours.indices, theirs.indices)
        np.testing.assert_array_equal(ours.weights, theirs.weights)
    rows = drawn.items.Rn[:100].astype(int)
    for row, t in enumerate(np.asarray(rows)):
        np.testing.assert_array_equal(drawn.items.S[row], seen[t].S[0])
        np.testing.assert_array_equal(drawn.items.S_next[row], seen[t].S_next[0])


def test_prioritized_dump_load_round_trip(prioritized_filled, tmp_path):
    buf, state, seen = prioritized_filled
    utils.dump(state, tmp_path / "state.lz4")
    loaded = utils.load(tmp_path / "state.lz4", safe=True)
    assert type(loaded) is type(state) and leaves_equal(loaded, state)
    key = jax.random.PRNGKey(5)
    assert leaves_equal(buf.sample(loaded, key, 16), buf.sample(state, key, 16))
    nxt = seen[-1].replace(idx=None)
    assert leaves_equal(buf.add(loaded, nxt), buf.add(state, nxt))


def test_prioritized_bad_input_raises_before_any_write(prioritized_filled):
    buf, state, seen = prioritized_filled
    keep = jax.tree_util.tree_map(np.array, state)
    add = jax.jit(buf.add, donate_argnums=0)
    tr = seen[0].replace(idx=None)
    bad = [
        tr.replace(S=tr.S[:, :, :5], S_next=tr.S_next[:, :, :5]),  # another frame shape
        tr.replace(S=tr.S.astype(np.float32), S_next=tr.S_next.astype(np.float32)),
        tr.replace(S=tr.S[:, :3], S_next=tr.S_next[:, :3]),  # another stack size
        tr.replace(A=np.zeros((1, 2))),  # the rest of the transition
    ]
    for batch in bad:
        with pytest.raises(ValueError):
            add(state, batch)
        assert leaves_equal(state, keep)  # the donated state was not consumed
    with pytest.raises(TypeError):
        buf.update(state, np.array([0.5]), np.ones(1))
    counter = []

    def traced_add(state, batch):
        counter.append(1)
        return buf.add(state, batch)

    add = jax.jit(traced_add)
    add(add(state, tr), seen[1].replace(idx=None))
    assert len(counter) == 1  # a second call does not retrace


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(stack_size=0),
        dict(stack_size=2.0),
        dict(stack_size=4, frame_capacity=7),
        dict(stack_size=4, window=-1),
        dict(stack_size=4, capacity=0),
        dict(stack_size=4, capacity=1.5),
    ],
)
def test_factory_checks_as_the_uniform_twin(kwargs):
    kwargs = {"capacity": 10, **kwargs}
    with pytest.raises((TypeError, ValueError)) as uniform:
        make_frame_stack_buffer(**kwargs)
    with pytest.raises(uniform.type):
        make_prioritized_frame_stack_buffer(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(alpha=-1.0), dict(beta="x"), dict(epsilon=0.0), dict(tree_strategy="gpu")]
)
def test_factory_checks_as_the_dense_twin(kwargs):
    with pytest.raises((TypeError, ValueError)) as dense:
        make_prioritized_buffer(10, **kwargs)
    with pytest.raises(dense.type):
        make_prioritized_frame_stack_buffer(10, stack_size=K, **kwargs)


def test_sizes_beyond_the_32_bit_frame_counters_are_refused():
    # ids wrap modulo about 2**30: ages stay exact only while stored transitions are younger
    for factory in (make_frame_stack_buffer, make_prioritized_frame_stack_buffer):
        with pytest.raises(ValueError, match="32-bit frame counters"):
            factory(40_000_000, stack_size=4)
        with pytest.raises(ValueError, match="frame_capacity"):
            factory(100, stack_size=4, frame_capacity=2**29)
        factory(20_000_000, stack_size=4)  # within the bound: made (nothing is allocated)


def one_transition(k=K):
    """A batch of one transition of 3x3 frames."""
    frames = np.arange((k + 1) * 9, dtype=np.uint8).reshape(k + 1, 3, 3)
    return TransitionBatch.from_single(
        s=frames[:k], a=0, logp=0.0, r=0.0, done=False, gamma=0.9, s_next=frames[1:]
    )


def example():
    return jax.tree_util.tree_map(lambda x: x[0], one_transition())


def test_the_fingerprint_table_is_sized_by_the_window_in_use():
    # a window beyond what frame_capacity leaves is cut to it: the table must not grow with
    # the requested number (window=10**9 asked for 8.6G entries)
    for factory in (make_frame_stack_buffer, make_prioritized_frame_stack_buffer):
        state = jax.eval_shape(factory(100, stack_size=K, window=10**9).init, example())
        assert state.table_id.shape == state.table_hash.shape[:1] == (8192,)
        big = factory(10_000, stack_size=K, frame_capacity=30_000, window=10**9)
        state = jax.eval_shape(big.init, example())
        window = 30_000 - 10_000 - 10_000 // 64 - 1  # the room beyond the transitions' frames
        assert 8 * window <= state.table_id.shape[0] < 16 * window


@pytest.mark.parametrize("factory", [make_frame_stack_buffer, make_prioritized_frame_stack_buffer])
def test_a_state_of_a_buffer_made_with_other_sizes_is_refused(factory):
    # frames live at row id % frame_capacity: a state read by a buffer of another
    # frame_capacity returned other frames than the ones added, without an error
    made = factory(20, stack_size=K, frame_capacity=40)
    state = made.init(example())
    state = made.add(state, one_transition())
    made.sample(state, jax.random.PRNGKey(0), 2)  # its own buffer reads it
    for other in (
        factory(20, stack_size=K, frame_capacity=50),
        factory(30, stack_size=K, frame_capacity=40),
        factory(20, stack_size=K, frame_capacity=40_000, window=4_000),  # another table
    ):
        with pytest.raises(ValueError, match="does not fit this buffer"):
            other.sample(state, jax.random.PRNGKey(0), 2)
        with pytest.raises(ValueError, match="does not fit this buffer"):
            other.add(state, one_transition())
        if hasattr(other, "update"):
            with pytest.raises(ValueError, match="does not fit this buffer"):
                other.update(state, jnp.zeros(1, jnp.int32), jnp.ones(1))


def test_bool_frames_as_the_host_buffer_stores_them():
    # MinAtar-like boolean frames: the host buffer stores them, the jittable one failed to
    # trace (its fingerprint bitcast the frames)
    rng = np.random.default_rng(0)
    frames = rng.random((12, 4, 4)) < 0.5
    batches = [
        TransitionBatch.from_single(
            s=frames[t : t + K],
            a=0,
            logp=0.0,
            r=float(t),
            done=False,
            gamma=0.9,
            s_next=frames[t + 1 : t + K + 1],
        )
        for t in range(7)
    ]
    host = FrameStackReplayBuffer(capacity=10, stack_size=K, random_seed=0)
    buf = make_frame_stack_buffer(capacity=10, stack_size=K)
    state = buf.init(jax.tree_util.tree_map(lambda x: x[0], batches[0]))
    for batch in batches:
        host.add(batch)
        state = buf.add(state, batch)
    assert int(state.frame_count) == host.frame_count == 7 + K
    drawn = buf.sample(state, jax.random.PRNGKey(0), 16)
    assert drawn.S.dtype == host.sample(1).S.dtype == np.bool_
    for row in range(16):
        t = int(drawn.Rn[row])
        np.testing.assert_array_equal(drawn.S[row], batches[t].S[0])
        np.testing.assert_array_equal(drawn.S_next[row], batches[t].S_next[0])


def test_a_state_used_with_a_smaller_window_still_drops_transitions_that_lost_frames():
    # transitions added with a large window may refer to frames that far back; a buffer made
    # with a small window used to assume they could not, kept such a transition's priority
    # after its frames were overwritten and sampled wrong stacks
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (1000, 4, 4), dtype=np.uint8)
    large = make_prioritized_frame_stack_buffer(300, stack_size=2, frame_capacity=400)
    small = make_prioritized_frame_stack_buffer(300, stack_size=2, frame_capacity=400, window=4)

    def transition(t, a, b, c):
        return TransitionBatch.from_single(
            s=frames[[a, b]],
            a=0,
            logp=0.0,
            r=float(t),
            done=False,
            gamma=0.9,
            s_next=frames[[b, c]],
        )

    stream = [transition(t, 2 * t, 2 * t + 1, 2 * t + 2) for t in range(200)]
    stream.append(transition(200, 310, 401, 402))  # refers to a frame 91 frames back
    stream += [transition(201 + j, 403 + 2 * j, 404 + 2 * j, 405 + 2 * j) for j in range(160)]
    example = jax.tree_util.tree_map(lambda x: x[0], stream[0])
    # the large window: what frame_capacity leaves beyond capacity + capacity // 64 + 1
    assert int(large.init(example).window) == 95 and int(small.init(example).window) == 4
    state = large.init(example)
    add_large, add_small = jax.jit(large.add), jax.jit(small.add)
    for t, batch in enumerate(stream):
        state = (add_large if t <= 200 else add_small)(state, batch)
    assert int(state.window) == 95
    slot = 200 % 300
    ids = np.asarray(state.transitions.items.S)[slot]
    assert int(state.frame_count) - ids.min() > 400  # its first frame was overwritten
    assert float(np.asarray(sum_tree_values(state.transitions.tree))[slot]) == 0.0
    for seed in range(5):
        out = small.sample(state, jax.random.PRNGKey(seed), 64)
        for row in range(64):
            t = int(out.items.Rn[row])
            assert t != 200
            np.testing.assert_array_equal(out.items.S[row], stream[t].S[0])
            np.testing.assert_array_equal(out.items.S_next[row], stream[t].S_next[0])


def test_eager_calls_compile_once(prioritized_filled):
    # called outside jit, add, sample and update traced and compiled their loops anew on
    # every call (0.1-0.2 s each)
    buf, state, seen = prioritized_filled
    uniform = make_frame_stack_buffer(capacity=60, stack_size=K)
    ustate = uniform.init(jax.tree_util.tree_map(lambda x: x[0], seen[0].replace(idx=None)))
    ustate = uniform.add(ustate, seen[0].replace(idx=None))
    calls = [
        lambda i: buf.add(state, seen[i].replace(idx=None)),
        lambda i: buf.sample(state, jax.random.PRNGKey(i), 8),
        lambda i: buf.update(state, np.array([i, i + 1]), np.array([1.0, 2.0])),
        lambda i: uniform.add(ustate, seen[i].replace(idx=None)),
        lambda i: uniform.sample(ustate, jax.random.PRNGKey(i), 8),
    ]
    assert compiles_again(calls) == 0


def test_update_refuses_priorities_that_do_not_pair_up_with_the_indices(prioritized_filled):
    buf, state, _ = prioritized_filled
    with pytest.raises(ValueError, match="priorities"):
        buf.update(state, np.arange(6).reshape(2, 3), np.ones((3, 2)))
