"""MinariSource against datasets made with Minari's DataCollector on real envs."""

import collections
import warnings

import gymnasium
import jax
import jax.numpy as jnp
import minari
import numpy as np
import pytest
from minari.data_collector import EpisodeBuffer

from coax_utils.sources import MinariSource, MinariSourceState, Source
from coax_utils.sources._minari import permuted
from tests.minari_data import DictObservation, collect


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINARI_DATASETS_PATH", str(tmp_path_factory.mktemp("minari")))
        yield


@pytest.fixture(scope="module")
def cartpole(root):
    env = gymnasium.make("CartPole-v1", max_episode_steps=12)
    return collect(env, "local/cartpole/random-v0", episodes=8)


def key_of(obs, action):
    return tuple(np.asarray(obs).round(6).tolist()) + (int(action),)


def run(source, state, calls):
    out = []
    for _ in range(calls):
        value, mask, state = source.next(state)  # compiled once per source
        out.append(jax.tree_util.tree_map(np.asarray, (value, mask)))
    return out, state


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(ordering="sequential"),
        dict(chunk_steps=20),
        dict(chunk_steps=20, ordering="sequential"),
        dict(chunk_steps=1000, prefetch=1),  # one chunk, read through the host callback
    ],
)
def test_every_epoch_visits_every_transition_once(cartpole, options):
    dataset, steps = cartpole
    source = MinariSource(dataset, batch_size=7, prefetch=options.pop("prefetch", 3), **options)
    assert isinstance(source, Source)
    n = len(steps)
    assert source.num_transitions == n and source.steps_per_epoch == -(-n // 7)
    expected = collections.Counter(key_of(s["obs"], s["action"]) for s in steps)
    state = source.init_state(jax.random.key(1))
    orders = []
    for epoch in range(2):
        out, state = run(source, state, source.steps_per_epoch)
        assert int(state.epoch) == epoch + 1
        seen = collections.Counter()
        for value, mask in out:
            assert mask.shape == (7,)
            for obs, action in zip(value["observation"][mask], value["action"][mask]):
                seen[key_of(obs, action)] += 1
        assert seen == expected  # every transition once, nothing else
        last, last_mask = out[-1]
        assert last_mask.sum() == n - 7 * (source.steps_per_epoch - 1)  # padding masked
        for leaf, spec in zip(jax.tree.leaves(last), jax.tree.leaves(source.element_spec())):
            assert leaf.shape == spec.shape and leaf.dtype == spec.dtype
            assert not leaf[~last_mask].any()  # padding rows hold zeros
        orders.append(np.concatenate([v["reward"] * 0 + v["observation"][:, 0] for v, _ in out]))
    if source._ordering == "shuffle":
        assert not np.array_equal(orders[0], orders[1])  # a new order every epoch
        again, _ = run(source, source.init_state(jax.random.key(1)), source.steps_per_epoch)
        first = np.concatenate([v["observation"][:, 0] for v, _ in again])
        np.testing.assert_array_equal(first, orders[0])  # the key decides the order


def test_values_are_the_env_steps_in_order(cartpole):
    dataset, steps = cartpole
    source = MinariSource(dataset, batch_size=5, ordering="sequential")
    out, _ = run(source, source.init_state(jax.random.key(0)), source.steps_per_epoch)
    value = {k: np.concatenate([v[k] for v, _ in out])[: len(steps)] for k in out[0][0]}
    np.testing.assert_array_equal(value["observation"], np.stack([s["obs"] for s in steps]))
    np.testing.assert_array_equal(value["next_observation"], [s["next_obs"] for s in steps])
    np.testing.assert_array_equal(value["action"], [s["action"] for s in steps])
    assert value["action"].dtype == np.int32 and value["reward"].dtype == np.float32
    np.testing.assert_array_equal(value["reward"], [s["reward"] for s in steps])
    np.testing.assert_array_equal(value["terminated"], [s["terminated"] for s in steps])
    np.testing.assert_array_equal(value["truncated"], [s["truncated"] for s in steps])
    assert value["terminated"].any() and value["truncated"].any()
    spec = source.element_spec()
    assert spec["observation"].shape == (5, 4) and spec["terminated"].dtype == np.bool_


@pytest.mark.parametrize("chunk_steps", [None, 25])
def test_windows_follow_the_sequence_mask_rule(cartpole, chunk_steps):
    dataset, steps = cartpole
    source = MinariSource(
        dataset, batch_size=6, ordering="sequential", window=4, chunk_steps=chunk_steps
    )
    out, _ = run(source, source.init_state(jax.random.key(0)), source.steps_per_epoch)
    episode = np.array([s["episode"] for s in steps])
    start = 0
    for value, mask in out:
        assert value["observation"].shape == (6, 4, 4) and mask.shape == (6, 4)
        for row in range(6):
            t = start + row
            if t >= len(steps):
                assert not mask[row].any()  # padding row, all zeros
                assert not any(leaf[row].any() for leaf in jax.tree.leaves(value))
                continue
            end = np.flatnonzero(episode == episode[t])[-1]
            want = np.minimum(np.arange(t, t + 4), end)  # repeat-last padding
            np.testing.assert_array_equal(mask[row], np.arange(t, t + 4) <= end)
            np.testing.assert_array_equal(
                value["observation"][row], np.stack([steps[i]["obs"] for i in want])
            )
        start += 6


def test_an_epoch_runs_inside_a_jitted_scan_without_retracing(cartpole):
    dataset, steps = cartpole
    source = MinariSource(dataset, batch_size=8, prefetch=4)
    traces = []

    @jax.jit
    def epoch(state):
        traces.append(1)

        def body(total, _):
            total, state = total
            value, mask, state = source.next(state)
            return (total + jnp.sum(jnp.where(mask, value["reward"], 0.0)), state), None

        (total, state), _ = jax.lax.scan(body, (jnp.zeros([]), state), None, source.steps_per_epoch)
        return total, state

    state = source.init_state(jax.random.key(0))
    for _ in range(2):
        total, state = epoch(state)
        assert float(total) == sum(s["reward"] for s in steps)
    assert len(traces) == 1 and int(state.epoch) == 2
    assert isinstance(state, MinariSourceState)


def test_windows_are_shuffled_by_the_key(cartpole):
    dataset, steps = cartpole
    source = MinariSource(dataset, batch_size=6, window=3)
    sequential = MinariSource(dataset, batch_size=len(steps), window=3, ordering="sequential")
    every, every_mask, _ = sequential.next(sequential.init_state(jax.random.key(0)))
    by_start = {
        key_of(o[0], a[0]): (o, m)
        for o, a, m in zip(
            np.asarray(every["observation"]), np.asarray(every["action"]), np.asarray(every_mask)
        )
    }
    orders = []
    for key in (3, 3, 4):
        out, _ = run(source, source.init_state(jax.random.key(key)), source.steps_per_epoch)
        starts = []
        for value, mask in out:
            for obs, action, m in zip(value["observation"], value["action"], mask):
                if not m[0]:  # padding row
                    assert not m.any()
                    continue
                want_obs, want_mask = by_start[key_of(obs[0], action[0])]
                np.testing.assert_array_equal(obs, want_obs)  # the window of its start
                np.testing.assert_array_equal(m, want_mask)
                starts.append(key_of(obs[0], action[0]))
        assert sorted(starts) == sorted(by_start)  # every start once
        orders.append(starts)
    assert orders[0] == orders[1] and orders[0] != orders[2]  # the key decides the order


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_the_epoch_permutation_is_a_well_mixed_bijection(n):
    draw = jax.jit(permuted, static_argnums=2)
    positions = jnp.arange(n, dtype=jnp.int32)
    first = np.asarray(draw(jax.random.key(0), positions, n))
    assert first.dtype == np.int32 and sorted(first.tolist()) == list(range(n))
    again = np.asarray(draw(jax.random.key(0), positions, n))
    other = np.asarray(draw(jax.random.key(1), positions, n))
    np.testing.assert_array_equal(first, again)  # a function of the key
    if n >= 64:
        assert not np.array_equal(first, other)
        # a uniform permutation moves an item n / 3 on average, and keeps no trend
        assert abs(np.abs(first - np.arange(n)).mean() / n - 1 / 3) < 0.05
        assert abs(np.corrcoef(first, np.arange(n))[0, 1]) < 0.2
        assert abs(np.corrcoef(first, other)[0, 1]) < 0.2


def test_default_prefetch_holds_at_most_4_mib(cartpole):
    dataset, _ = cartpole
    small = MinariSource(dataset, batch_size=8)
    held = small.init_state(jax.random.key(0)).buffer.shape[0]
    assert held == min(64, small.steps_per_epoch)  # capped at 64 batches (and at an epoch)
    for batch_size, window in ((4096, None), (512, 5)):
        source = MinariSource(dataset, batch_size=batch_size, window=window)
        buffer = source.init_state(jax.random.key(0)).buffer
        assert buffer.nbytes <= 4 * 2**20
        assert buffer.shape[0] == source.steps_per_epoch or (
            4 * 2**20 < (buffer.shape[0] + 1) * buffer[0].nbytes
        )
    with pytest.raises(ValueError, match="prefetch"):
        MinariSource(dataset, batch_size=8, prefetch=0)
    # never more than an epoch's batches (a huge prefetch allocates nothing more)
    huge = MinariSource(dataset, batch_size=8, prefetch=2**30)
    assert huge.init_state(jax.random.key(0)).buffer.shape[0] == huge.steps_per_epoch


def test_in_memory_data_never_leave_the_compiled_loop(cartpole):
    dataset, _ = cartpole
    in_memory = MinariSource(dataset, batch_size=8)
    chunked = MinariSource(dataset, batch_size=8, chunk_steps=30, prefetch=4)
    for source, callbacks in ((in_memory, 0), (chunked, 1)):
        state = source.init_state(jax.random.key(0))
        text = str(jax.make_jaxpr(source.next)(state))
        assert text.count("io_callback") == callbacks
    with pytest.raises(ValueError, match="another source"):
        in_memory.next(chunked.init_state(jax.random.key(0)))


def test_dict_observations_and_box_actions(root):
    dataset, steps = collect(
        DictObservation(gymnasium.make("CartPole-v1", max_episode_steps=6)),
        "local/cartpole-dict/random-v0",
        2,
    )
    source = MinariSource(dataset, batch_size=4, ordering="sequential")
    value, mask, _ = source.next(source.init_state(jax.random.key(0)))
    assert set(value["observation"]) == {"position", "velocity"}
    np.testing.assert_array_equal(
        value["next_observation"]["velocity"], [s["next_obs"]["velocity"] for s in steps[:4]]
    )
    assert bool(jnp.all(mask))
    dataset, steps = collect(
        gymnasium.make("Pendulum-v1", max_episode_steps=5), "local/pendulum/random-v0", 2
    )
    source = MinariSource(dataset, batch_size=10, ordering="sequential", max_transitions=7)
    value, mask, _ = source.next(source.init_state(jax.random.key(0)))
    assert source.num_transitions == 7 and mask.tolist() == [True] * 7 + [False] * 3
    np.testing.assert_array_equal(value["action"][:7], np.stack([s["action"] for s in steps[:7]]))
    assert value["truncated"][6]  # the cut episode ends truncated


def test_bad_input_is_refused(cartpole, root):
    dataset, _ = cartpole
    with pytest.raises(ValueError, match="batch_size"):
        MinariSource(dataset, 0)
    with pytest.raises(ValueError, match="ordering"):
        MinariSource(dataset, 4, ordering="random")
    space = gymnasium.spaces.Box(-1, 1, (2,), np.float32)
    episodes = [
        EpisodeBuffer(
            id=0,
            observations=np.zeros((3, 2), np.float32),
            actions=np.zeros(3, np.int64),
            rewards=np.ones(3),
            terminations=np.array([False, True, False]),
            truncations=np.zeros(3, bool),
        )
    ]
    with warnings.catch_warnings():  # Minari advises an env (for evaluation): none here
        warnings.simplefilter("ignore", UserWarning)
        bad = minari.create_dataset_from_buffers(
            "local/bad/data-v0",
            episodes,
            observation_space=space,
            action_space=gymnasium.spaces.Discrete(2),
        )
    with pytest.raises(ValueError, match="episode 0: observations has shape"):
        MinariSource(bad, 2)
