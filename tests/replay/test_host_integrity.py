"""Host buffers: rejected calls change nothing, signed Adv, checkpoint states (folder saves:
test_host_folders.py)."""

import copy
import pickle

import jax
import numpy as np
import pytest

from coax_utils import utils
from coax_utils.replay import PrioritizedReplayBuffer, SimpleReplayBuffer, TransitionBatch

BUFFERS = [SimpleReplayBuffer, PrioritizedReplayBuffer]


def batch(ts, obs_dim=3):
    ts = np.atleast_1d(np.asarray(ts))
    n = len(ts)
    return TransitionBatch(
        S=np.repeat(ts[:, None], obs_dim, axis=1).astype(np.float32),
        A=ts.astype(np.int64),
        logP=np.zeros(n, np.float32),
        Rn=ts.astype(np.float32),
        In=np.full(n, 0.9, np.float32),
        S_next=np.repeat(ts[:, None] + 1, obs_dim, axis=1).astype(np.float32),
    )


def frames(ts):
    """Transitions with a large leaf (stored in an array of its own) and small packed ones."""
    ts = np.atleast_1d(np.asarray(ts))
    n = len(ts)
    obs = (ts[:, None, None] % 251).astype(np.uint8) * np.ones((1, 24, 24), np.uint8)
    return TransitionBatch(
        S=obs,
        A=ts.astype(np.int32),
        logP=np.zeros(n, np.float32),
        Rn=ts.astype(np.float32),
        In=np.ones(n, np.float32),
        S_next=obs,
    )


def _canonical(x):
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, np.ascontiguousarray(x).tobytes())
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _canonical(v)) for k, v in x.items())))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_canonical(v) for v in x))
    return ("value", type(x).__name__, repr(x))


def snapshot(buffer):
    """Every byte that defines a buffer: its state, ids, sum tree and RNG state."""
    state = dict(buffer.__checkpoint_state__())
    state["rng"] = state["rng"].bit_generator.state
    state["ids"] = buffer._ids
    if isinstance(buffer, PrioritizedReplayBuffer):
        state["tree"] = buffer._tree._arr
    return _canonical(state)


def same_samples(a, b, n=3, size=16):
    for _ in range(n):
        for x, y in zip(
            jax.tree_util.tree_leaves(a.sample(size)), jax.tree_util.tree_leaves(b.sample(size))
        ):
            np.testing.assert_array_equal(x, y)


def contents(buffer):
    return [(int(r.idx[0]), r.S.tobytes()) for r in buffer]


# -- validate, then write ------------------------------------------------------------------------


def test_huge_advantage_is_refused_before_anything_is_written():
    buffer = PrioritizedReplayBuffer(8, alpha=2.0, random_seed=0)
    buffer.add(batch([0]), Adv=np.array([1.0]))
    before = snapshot(buffer)
    with pytest.raises(ValueError, match="overflow"):
        buffer.add(batch([1]), Adv=np.array([1e200]))
    with pytest.raises(ValueError, match="overflow"):
        buffer.update(np.array([0]), np.array([1e200]))
    assert snapshot(buffer) == before and len(buffer) == 1


def test_total_overflow_is_refused_and_sampling_stays_sound():
    buffer = PrioritizedReplayBuffer(8, alpha=1.0, random_seed=0)
    buffer.add(batch([0]), Adv=np.array([1e308]))
    before = snapshot(buffer)
    with pytest.raises(ValueError, match="overflow"):
        buffer.add(batch([1]), Adv=np.array([1e308]))
    with pytest.raises(ValueError, match="overflow"):
        buffer.add(batch([1, 2]), Adv=np.array([1e308, 1e308]))
    assert snapshot(buffer) == before
    buffer.add(batch([1]), Adv=np.array([1.0]))
    buffer.update(np.array([0]), np.array([1.0]))  # replacing the large one is fine
    before = snapshot(buffer)
    with pytest.raises(ValueError, match="overflow"):
        buffer.update(np.array([0, 1]), np.array([1e308, 1e308]))
    assert snapshot(buffer) == before
    sample = buffer.sample(64)
    assert np.all(np.isfinite(sample.W)) and set(sample.idx.tolist()) == {0, 1}


def test_alpha_and_epsilon_that_overflow_are_refused():
    buffer = PrioritizedReplayBuffer(8, alpha=1.0, random_seed=0)
    buffer.add(batch([0, 1]), Adv=np.array([1e200, 1.0]))
    before = snapshot(buffer)
    with pytest.raises(ValueError, match="overflow"):
        buffer.alpha = 2.0
    with pytest.raises(ValueError, match="overflow"):
        buffer.epsilon = 1e308
    assert buffer.alpha == 1.0 and buffer.epsilon == 1e-4
    assert snapshot(buffer) == before


@pytest.mark.parametrize(
    "idx, error",
    [
        (np.array([2**64 - 1], np.uint64), ValueError),
        (np.array([2**63], np.uint64), ValueError),
        ([2**64 - 1], ValueError),
        ([2**70], ValueError),
        (np.array([-1]), ValueError),
        (np.array([1.0]), TypeError),
        (np.array(["1"]), TypeError),
        (["1"], TypeError),
        (np.array([[0]]), ValueError),
    ],
)
def test_ids_never_wrap(idx, error):
    buffer = PrioritizedReplayBuffer(4, random_seed=0)
    buffer.add(batch([0, 1]), Adv=np.array([1.0, 1.0]))  # slots 2 and 3 never written
    before = snapshot(buffer)
    with pytest.raises(error):
        buffer.update(idx, np.full(np.shape(idx), 100.0))
    assert snapshot(buffer) == before
    assert set(buffer.sample(200).idx.tolist()) <= {0, 1}


def test_ids_that_fit_but_were_evicted_or_never_issued_are_ignored():
    buffer = PrioritizedReplayBuffer(2, random_seed=0)
    buffer.add(batch([0, 1, 2]), Adv=np.ones(3))  # id 0 evicted
    before = snapshot(buffer)
    buffer.update(np.array([0, 7, 2**62], np.uint64), np.array([50.0, 50.0, 50.0]))
    assert snapshot(buffer) == before
    buffer.update([2], [-50.0])
    assert buffer._abs_adv[0] == 50.0  # id 2 sits in slot 0


def test_strings_and_other_non_numbers_are_refused():
    buffer = PrioritizedReplayBuffer(4, random_seed=0)
    buffer.add(batch([0]), Adv=np.array([1.0]))
    before = snapshot(buffer)
    with pytest.raises(TypeError):
        buffer.add(batch([1]), Adv=np.array(["1.0"]))
    with pytest.raises(TypeError):
        buffer.update(np.array([0]), ["1.0"])
    with pytest.raises(TypeError):
        buffer.add(batch([1]).replace(S=np.array([["a", "b", "c"]], object)))
    with pytest.raises(ValueError, match="W"):
        buffer.add(batch([1]).replace(W=np.ones(1, np.int32)))
    for w in (np.nan, np.inf, -1.0):  # sampled weights would be NaN, infinite or negative
        with pytest.raises(ValueError, match="W must be finite"):
            buffer.add(batch([1]).replace(W=np.array([w], np.float32)))
    assert snapshot(buffer) == before


def test_signed_advantages_use_their_magnitude():
    signed = PrioritizedReplayBuffer(8, alpha=0.7, epsilon=1e-3, random_seed=3)
    magnitude = PrioritizedReplayBuffer(8, alpha=0.7, epsilon=1e-3, random_seed=3)
    adv = np.array([-2.0, 0.5, -0.25, 3.0])
    signed.add(batch(np.arange(4)), Adv=adv)
    magnitude.add(batch(np.arange(4)), Adv=np.abs(adv))
    np.testing.assert_array_equal(signed._tree.values, magnitude._tree.values)
    np.testing.assert_allclose(signed._tree.values[:4], (np.abs(adv) + 1e-3) ** 0.7)
    signed.update(np.array([0, 3]), np.array([-1.0, -4.0]))
    magnitude.update(np.array([0, 3]), np.array([1.0, 4.0]))
    same_samples(signed, magnitude)
    signed.add(batch([4]))  # default: the largest |Adv| so far
    assert signed._abs_adv[4] == 4.0


def test_rejected_first_add_allocates_nothing():
    buffer = PrioritizedReplayBuffer(4, random_seed=0)
    with pytest.raises(ValueError):
        buffer.add(batch([0]), Adv=np.array([np.inf]))
    assert buffer._storage is None and len(buffer) == 0
    buffer.add(batch([0], obs_dim=5))  # any structure is still welcome
    assert list(buffer)[0].S.shape == (1, 5)


# -- explicit output arrays ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", BUFFERS)
def test_sample_into_out(cls):
    buffer = cls(64, random_seed=0)
    buffer.add(frames(np.arange(64)))
    first = buffer.sample(16)
    arrays = [id(x) for x in jax.tree_util.tree_leaves(first)]
    again = buffer.sample(16, out=first)
    assert [id(x) for x in jax.tree_util.tree_leaves(again)] == arrays
    np.testing.assert_array_equal(again.S[:, 3, 3], (again.idx % 251).astype(np.uint8))
    np.testing.assert_array_equal(again.A, again.idx)
    np.testing.assert_array_equal(again.Rn, again.idx.astype(np.float32))
    stored = jax.tree_util.tree_unflatten(buffer._treedef, buffer._storage)
    assert np.shares_memory(stored.Rn, buffer._block)
    bad = [
        buffer.sample(8),  # another batch size
        again.replace(S=again.S.astype(np.int16)),
        again.replace(S=buffer._storage[0][:16]),  # the storage itself
        again.replace(Rn=stored.Rn[:16]),  # a column of the block of small leaves
        again.replace(Rn=buffer._ids[:16].view(np.float32)[::2]),  # the ids
        again.replace(S_next=again.S),  # two leaves in one array
        again.replace(A_next=again.A),
    ]
    before = snapshot(buffer)
    for out in bad:
        with pytest.raises(ValueError):
            buffer.sample(16, out=out)
    with pytest.raises(TypeError):
        buffer.sample(16, out={"S": 1})
    assert snapshot(buffer) == before  # nothing drawn from the random stream


def test_samples_are_never_reused_behind_the_callers_back():
    buffer = SimpleReplayBuffer(64, random_seed=0)
    buffer.add(frames(np.arange(64)))
    held = [buffer.sample(128) for _ in range(4)]
    kept = [h.S.copy() for h in held]
    for _ in range(4):
        buffer.sample(128)
    for h, k in zip(held, kept):
        np.testing.assert_array_equal(h.S, k)


# -- checkpoint protocol ------------------------------------------------------------------------


def filled(cls, n=13, capacity=10):
    buffer = cls(capacity, random_seed=5)
    buffer.add(frames(np.arange(n)), episode_end=np.arange(n) % 4 == 3)
    if cls is PrioritizedReplayBuffer:
        buffer.update(np.arange(n), np.linspace(-2, 2, n))
    buffer.sample(3)
    return buffer


def fresh(state):
    """The state as the checkpoint loader hands it over: fresh, owned arrays."""
    return copy.deepcopy(state)


@pytest.mark.parametrize("cls", BUFFERS)
def test_checkpoint_round_trip_adopts_the_arrays(cls):
    buffer = filled(cls)
    state = fresh(buffer.__checkpoint_state__())
    restored = cls.__checkpoint_restore__(state)
    assert snapshot(restored) == snapshot(buffer)
    assert restored._block is state["block"]
    large = [x for x in state["leaves"] if isinstance(x, np.ndarray)]
    assert large and all(any(s is x for s in restored._storage) for x in large)
    same_samples(buffer, restored)
    assert contents(restored) == contents(buffer)
    for clone in (pickle.loads(pickle.dumps(buffer)), copy.deepcopy(buffer)):
        assert snapshot(clone) == snapshot(buffer)
    empty = cls(4, random_seed=1)
    assert snapshot(cls.__checkpoint_restore__(fresh(empty.__checkpoint_state__()))) == snapshot(
        empty
    )


def _mutations(cls):
    def set_(key, value):
        return lambda s: s.__setitem__(key, value)

    def leaf(i, value):
        return lambda s: s["leaves"].__setitem__(i, value)

    def stored_w(value):
        def mutate(s):
            column = s["leaves"][-1]  # W, the last leaf, packed in block
            assert column["dtype"] == "<f4"
            offset = column["offset"]
            s["block"][0, offset : offset + 4] = np.array([value], np.float32).view(np.uint8)

        return mutate

    def spec(i, **changes):
        return lambda s: s["leaves"][i].update(changes)

    m = {
        "extra key": set_("bogus", 1),
        "missing key": lambda s: s.pop("count"),
        "capacity type": set_("capacity", 10.0),
        "capacity zero": set_("capacity", 0),
        "capacity mismatch": set_("capacity", 11),
        "count negative": set_("count", -1),
        "count type": set_("count", True),
        "count without storage": lambda s: s.update(structure=None, block=None, leaves=[]),
        "episode counter above count": set_("episode_counter", 99),
        "episode dtype": lambda s: s.__setitem__("episode", s["episode"].astype(np.int32)),
        "episode decreasing": lambda s: s["episode"].__setitem__(slice(None), np.arange(10)[::-1]),
        "rng type": set_("rng", 0),
        "structure keys": lambda s: s["structure"].pop("S"),
        "structure node": lambda s: s["structure"].__setitem__("S", {1: 0}),
        "structure W": lambda s: s["structure"].__setitem__("W", None),
        # the same leaves with Rn in a list: restored, every sample's batch_size failed
        "structure Rn": lambda s: s["structure"].__setitem__("Rn", [0]),
        "leaves count": lambda s: s["leaves"].pop(),
        "large leaf rows": leaf(0, np.zeros((9, 24, 24), np.uint8)),
        "large leaf object": leaf(0, np.zeros(10, object)),
        "block dtype": lambda s: s.__setitem__("block", s["block"].view(np.int8)),
        "block rows": lambda s: s.__setitem__("block", s["block"][:5]),
        "spec dtype": spec(1, dtype="O"),
        "spec dtype garbage": spec(1, dtype="not a dtype"),
        "spec offset misaligned": spec(1, offset=1),
        "spec past the row": spec(1, offset=4096),
        "spec overlap": spec(2, offset=0),
        "spec shape": spec(1, shape=[-1]),
        "spec keys": lambda s: s["leaves"][1].pop("offset"),
        "shared arrays": lambda s: s["leaves"].__setitem__(5, s["leaves"][0]),
        "stored W nan": stored_w(np.nan),
        "stored W negative": stored_w(-1.0),
    }
    if cls is PrioritizedReplayBuffer:
        m.update(
            {
                "alpha negative": set_("alpha", -1.0),
                "epsilon zero": set_("epsilon", 0.0),
                "abs_adv negative": lambda s: s["abs_adv"].__setitem__(0, -1.0),
                "abs_adv nan": lambda s: s["abs_adv"].__setitem__(0, np.nan),
                "abs_adv shape": lambda s: s.__setitem__("abs_adv", s["abs_adv"][:5]),
                "abs_adv above the max": lambda s: s["abs_adv"].__setitem__(0, 1e6),
                "max_abs_adv type": set_("max_abs_adv", "2"),
                "priority overflow": lambda s: s.update(alpha=2000.0),
            }
        )
    return m


@pytest.mark.parametrize("cls", BUFFERS)
def test_checkpoint_restore_checks_every_invariant(cls):
    buffer = filled(cls)
    state = buffer.__checkpoint_state__()
    for name, mutate in _mutations(cls).items():
        bad = fresh(state)
        mutate(bad)
        with pytest.raises((ValueError, TypeError)):
            cls.__checkpoint_restore__(bad)
            pytest.fail(f"accepted: {name}")


def test_checkpoint_state_refuses_structures_plain_data_cannot_describe():
    import collections

    Pair = collections.namedtuple("Pair", "x y")
    buffer = SimpleReplayBuffer(4)
    tb = batch([0])
    buffer.add(tb.replace(S=Pair(tb.S, tb.S), S_next=Pair(tb.S, tb.S)))
    with pytest.raises(TypeError, match="Pair"):
        buffer.__checkpoint_state__()


@pytest.mark.parametrize("cls", BUFFERS)
def test_add_refuses_returns_that_are_not_one_array(cls):
    # Rn in a tuple was taken as a batch of one (its leading axis), and samples of the
    # stored tuple then had the wrong batch size
    buffer = filled(cls)
    before = utils.dumps(buffer)
    good = batch([1, 2])
    for rn in ((good.Rn,), [good.Rn], {"r": good.Rn}, None):
        with pytest.raises(ValueError, match="Rn"):
            buffer.add(good.replace(Rn=rn))
    assert utils.dumps(buffer) == before
