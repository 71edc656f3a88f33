"""Source states restored from real files: kept when a run of the source can produce them,
refused (naming the field) when not."""

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils.sources import ArraySource, BatchedSource, DiskSource, GymnaxSource, MinariSource
from coax_utils.utils import dump, load
from tests.sources.test_minari import cartpole, root  # noqa: F401  (fixtures)

DATA = {"x": np.arange(10, dtype=np.float32)}


def advanced(source, calls, **inject):
    state = source.init_state(jax.random.key(0)).replace(**inject)
    for _ in range(calls):
        _, _, state = source.next(state)
    return source, state


def make(kind, dataset=None):
    if kind == "array":
        return advanced(ArraySource(DATA, ordering="shuffle"), 3)
    if kind == "disk":
        return advanced(DiskSource(10, lambda i: {"x": np.float32(i)}, prefetch_size=4), 3)
    if kind == "batched":
        return advanced(BatchedSource(ArraySource(DATA, ordering="shuffle"), 3), 2)
    if kind == "gymnax":
        env, params = gymnax.make("CartPole-v1")
        policy = lambda obs, n, new_episode, key: (jnp.int32(1), n + 1)  # noqa: E731
        source = GymnaxSource(env, params, policy, jnp.int32(0), steps_per_epoch=5)
        return advanced(source, 2, policy_state=jnp.int32(0))
    return advanced(MinariSource(dataset[0], 4, prefetch=2), 3)


def restored(state, tmp_path):
    path = tmp_path / "state.lz4"
    dump(state, str(path))
    # gymnax's env states are classes of its own, which only unpickling restores
    return load(str(path), safe=not hasattr(state, "env_state"))


@pytest.mark.parametrize("kind", ["array", "disk", "batched", "gymnax", "minari"])
def test_a_restored_state_continues_the_stream(kind, cartpole, tmp_path):  # noqa: F811
    source, state = make(kind, cartpole)
    back = restored(state, tmp_path)
    for _ in range(4):
        want, want_mask, state = source.next(state)
        got, got_mask, back = source.next(back)
        same = jax.tree_util.tree_map(np.array_equal, (want, want_mask), (got, got_mask))
        assert all(jax.tree_util.tree_leaves(same))


BAD = [
    ("array", lambda s: s.replace(order=s.order.at[0].set(s.order[1])), "not a permutation"),
    ("array", lambda s: s.replace(order=s.order.astype(jnp.float32)), "order must be"),
    ("array", lambda s: s.replace(position=jnp.int32(-1)), "position is -1, below 0"),
    ("array", lambda s: s.replace(position=jnp.int32(10)), "beyond the epoch"),
    (
        "array",
        lambda s: s.replace(reshuffle=jnp.int32(1)),
        "reshuffle must be a scalar of dtype bool",
    ),
    ("disk", lambda s: s.replace(buffer_start=s.position + 1), "buffer_start is"),
    ("disk", lambda s: s.replace(buffer_start=jnp.int32(-2)), "buffer_start is -2"),
    (
        "disk",
        lambda s: s.replace(epoch=jnp.zeros(2, jnp.int32)),
        "epoch must be a scalar of dtype int32",
    ),
    ("batched", lambda s: s.replace(step=jnp.int32(-3)), "step is -3"),
    ("batched", lambda s: s.replace(epoch=np.int64(0)), "epoch must be a scalar of dtype int32"),
    (
        "gymnax",
        lambda s: s.replace(new_episode=jnp.int32(1)),
        "new_episode must be a scalar of dtype bool",
    ),
    ("gymnax", lambda s: s.replace(step=jnp.int32(-1)), "step is -1"),
    ("minari", lambda s: s.replace(buffer_start=s.position + 1), "buffer_start is"),
    ("minari", lambda s: s.replace(epoch=jnp.int32(-1)), "epoch is -1"),
    ("minari", lambda s: s.replace(buffer=s.buffer.astype(jnp.float32)), "must be a uint32"),
    ("minari", lambda s: s.replace(buffer=s.buffer[0]), "axes, not 3 or 4"),
]


@pytest.mark.parametrize(("kind", "damage", "message"), BAD)
def test_a_state_no_run_produces_is_refused(kind, damage, message, cartpole, tmp_path):  # noqa: F811
    _, state = make(kind, cartpole)
    with pytest.raises(ValueError, match=message):
        restored(damage(state), tmp_path)


@pytest.mark.parametrize("kind", ["array", "disk", "batched", "gymnax", "minari"])
def test_every_state_of_a_run_passes_the_check(kind, cartpole):  # noqa: F811
    source, state = make(kind, cartpole)
    for _ in range(2 * source.steps_per_epoch + 1):  # across two epoch ends
        state.__checkpoint_check__()
        _, _, state = source.next(state)


@pytest.mark.parametrize("ordering", ["shuffle", "sequential"])
@pytest.mark.parametrize("position", [10_000, 2**30])  # 2**30 * 4 wraps around int32
def test_a_position_beyond_the_epoch_reads_padding_then_a_new_epoch(
    ordering,
    position,
    cartpole,  # noqa: F811
):
    # the state's check cannot know the epoch's length: the in-memory source masks instead
    source = MinariSource(cartpole[0], 4, ordering=ordering, prefetch=2)
    state = source.init_state(jax.random.key(0)).replace(position=jnp.int32(position))
    state.__checkpoint_check__()
    value, mask, state = source.next(state)
    assert not mask.any()
    assert not any(leaf.any() for leaf in jax.tree_util.tree_leaves(value))
    assert int(state.epoch) == 1 and int(state.position) == 0
    _, mask, _ = source.next(state)
    assert mask.all()
