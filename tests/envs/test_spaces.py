"""JAX spaces: jittable sample/contains, and exact conversion to and from gymnasium."""

import warnings
from collections import OrderedDict

import chex
import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coax_utils import envs
from coax_utils.envs import to_gymnasium_space, to_jax_space
from tests.envs._envs import DISCRETE_TAKES_DTYPE, gym_discrete_dtype

gs = gymnasium.spaces


def _assert_same_gym_space(a, b):
    """Exact equality of two gymnasium spaces (gymnasium's __eq__ allows float round-off)."""
    assert type(a) is type(b)
    if isinstance(a, gs.Box):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a.low, b.low)
        np.testing.assert_array_equal(a.high, b.high)
        assert a.low.dtype == b.low.dtype and a.high.dtype == b.high.dtype
    elif isinstance(a, gs.Discrete):
        assert (a.n, a.start, a.dtype) == (b.n, b.start, b.dtype)
    elif isinstance(a, gs.MultiDiscrete):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.nvec, b.nvec)
        np.testing.assert_array_equal(a.start, b.start)
    elif isinstance(a, gs.MultiBinary):
        assert a.n == b.n and a.shape == b.shape
    elif isinstance(a, gs.Tuple):
        assert len(a.spaces) == len(b.spaces)
        for x, y in zip(a.spaces, b.spaces):
            _assert_same_gym_space(x, y)
    elif isinstance(a, gs.Dict):
        assert list(a.spaces) == list(b.spaces)  # same keys in the same order
        for k in a.spaces:
            _assert_same_gym_space(a.spaces[k], b.spaces[k])
    else:  # pragma: no cover - the test only builds the kinds above
        raise AssertionError(f"unexpected space {a!r}")


SPACES = {
    "box_bounded": gs.Box(low=-1.5, high=2.0, shape=(3,), dtype=np.float32),
    "box_mixed": gs.Box(
        low=np.array([-np.inf, 0.0, -1.0, -np.inf], np.float32),
        high=np.array([np.inf, np.inf, 1.0 / 3.0, 7.0], np.float32),
    ),
    "box_float64": gs.Box(low=-1e300, high=1e300, shape=(2, 2), dtype=np.float64),
    "box_float16": gs.Box(low=0.1, high=0.3, shape=(5,), dtype=np.float16),
    "box_uint8_image": gs.Box(low=0, high=255, shape=(4, 5, 3), dtype=np.uint8),
    "box_int64": gs.Box(low=np.array([-3, 0]), high=np.array([3, 10]), dtype=np.int64),
    "discrete": gs.Discrete(5),
    "discrete_start": gs.Discrete(3, start=-2),
    # built when used: gymnasium's Discrete takes a dtype from 1.2.2 on
    "discrete_int32": lambda: gs.Discrete(3, start=-2, dtype=np.int32),
    "multidiscrete": gs.MultiDiscrete([[2, 3], [4, 1]], start=[[0, 1], [-2, 5]]),
    "multidiscrete_int32": gs.MultiDiscrete([7, 2], dtype=np.int32),
    "multibinary": gs.MultiBinary(6),
    "multibinary_2d": gs.MultiBinary([2, 3]),
    "tuple": gs.Tuple([gs.Discrete(2), gs.Box(0.0, 1.0, (2,), np.float32)]),
    "dict_unsorted": gs.Dict(
        OrderedDict(
            [
                ("zeta", gs.Discrete(4)),
                ("alpha", gs.Box(-1.0, 1.0, (1,), np.float32)),
            ]
        )
    ),
    "nested": gs.Dict(
        {
            "image": gs.Box(0, 255, (3, 3, 1), np.uint8),
            "inner": gs.Tuple(
                [gs.MultiBinary(3), gs.Dict({"b": gs.Discrete(2), "a": gs.MultiDiscrete([3])})]
            ),
        }
    ),
}


NAMES = [
    pytest.param(name, marks=pytest.mark.requires(gymnasium="1.2.2")) if callable(s) else name
    for name, s in sorted(SPACES.items())
]


def space_of(name):
    space = SPACES[name]
    return space() if callable(space) else space


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_exact(name):
    space = space_of(name)
    jspace = to_jax_space(space)
    assert isinstance(jspace, envs.Space)
    back = to_gymnasium_space(jspace)
    _assert_same_gym_space(back, space)
    # and the other way round
    assert to_jax_space(back) == jspace
    assert hash(to_jax_space(back)) == hash(jspace)  # hashable: usable as a static argument


@pytest.mark.parametrize("name", NAMES)
def test_samples_are_members_under_jit_and_vmap(name):
    space = space_of(name)
    jspace = to_jax_space(space)

    traces = []

    @jax.jit
    def sample_and_check(key):
        traces.append(1)
        x = jspace.sample(key)
        return x, jspace.contains(x)

    keys = jax.random.split(jax.random.key(0), 8)
    for key in keys:
        x, ok = sample_and_check(key)
        assert bool(ok)
        chex.assert_trees_all_equal_shapes_and_dtypes(x, jspace.shape_dtype())
        host = jax.tree_util.tree_map(np.asarray, x)
        if isinstance(space, gs.Tuple):
            host = tuple(host)
        assert space.contains(_to_gym_value(host, space)), (name, host)
    assert len(traces) == 1  # a second call does not retrace

    xs, oks = jax.vmap(sample_and_check)(keys)
    assert bool(jnp.all(oks))


def _to_gym_value(x, space):
    """Cast a sample to the gymnasium dtype (JAX samples use 32-bit types without x64)."""
    if isinstance(space, gs.Tuple):
        return tuple(_to_gym_value(xi, s) for xi, s in zip(x, space.spaces))
    if isinstance(space, gs.Dict):
        return {k: _to_gym_value(x[k], s) for k, s in space.spaces.items()}
    return np.asarray(x).astype(space.dtype)


def test_box_sampling_follows_the_bounds():
    space = to_jax_space(SPACES["box_mixed"])
    xs = np.asarray(jax.vmap(space.sample)(jax.random.split(jax.random.key(1), 4000)))
    # unbounded: standard normal; low only: low + exponential; both: uniform
    assert abs(xs[:, 0].mean()) < 0.1 and 0.9 < xs[:, 0].std() < 1.1
    assert xs[:, 1].min() >= 0.0 and 0.9 < xs[:, 1].mean() < 1.1
    assert xs[:, 2].min() >= -1.0 and xs[:, 2].max() <= np.float32(1.0 / 3.0)
    assert abs(xs[:, 2].mean() - (-1.0 + 1.0 / 3.0) / 2) < 0.05
    assert xs[:, 3].max() <= 7.0 and 5.9 < xs[:, 3].mean() < 6.1
    ints = np.asarray(
        jax.vmap(to_jax_space(SPACES["box_int64"]).sample)(
            jax.random.split(jax.random.key(2), 2000)
        )
    )
    assert set(np.unique(ints[:, 0])) == set(range(-3, 4))  # both bounds are reachable
    assert set(np.unique(ints[:, 1])) == set(range(0, 11))


def test_discrete_sampling_covers_exactly_the_range():
    space = to_jax_space(SPACES["discrete_start"])
    xs = np.asarray(jax.vmap(space.sample)(jax.random.split(jax.random.key(3), 500)))
    assert set(xs.tolist()) == {-2, -1, 0}
    md = to_jax_space(SPACES["multidiscrete"])
    ys = np.asarray(jax.vmap(md.sample)(jax.random.split(jax.random.key(4), 500)))
    assert set(np.unique(ys[:, 1, 1]).tolist()) == {5}  # nvec 1 with start 5
    assert set(np.unique(ys[:, 1, 0]).tolist()) == {-2, -1, 0, 1}


@pytest.mark.parametrize(
    "space, bad",
    [
        (envs.Box(0.0, 1.0, (2,)), np.array([0.5, 1.5], np.float32)),  # out of bounds
        (envs.Box(0.0, 1.0, (2,)), np.array([0.5, np.nan], np.float32)),  # nan
        (envs.Box(0.0, 1.0, (2,)), np.zeros(3, np.float32)),  # wrong shape
        (envs.Box(0, 5, (2,), np.int32), np.array([1.0, 2.0], np.float32)),  # float in int box
        (envs.Discrete(3, start=1), 0),
        (envs.Discrete(3, start=1), 4),
        (envs.Discrete(3), 1.0),  # not an integer
        (envs.Discrete(3), np.array([1])),  # not a scalar
        (envs.MultiDiscrete([2, 3]), np.array([1, 3])),
        (envs.MultiBinary(3), np.array([0, 2, 1])),
        (envs.Tuple([envs.Discrete(2)]), (0, 1)),  # wrong length
        (envs.Dict({"a": envs.Discrete(2)}), {"b": 0}),  # wrong keys
        (envs.Dict({"a": envs.Discrete(2)}), "a"),
    ],
)
def test_contains_rejects(space, bad):
    assert not bool(space.contains(bad))
    assert bad not in space


WIDE = 2**32 + 1  # wraps around to 1 in 32 bits


@pytest.mark.parametrize(
    "space, bad",
    [
        (gs.Discrete(5), np.int64(WIDE)),
        (gs.Discrete(5), WIDE),
        (gs.Discrete(5), np.uint64(2**64 - 1)),
        (gs.MultiDiscrete([5, 5]), np.array([WIDE, 1])),
        (gs.Box(0, 5, (2,), np.int64), np.array([WIDE, 1])),
        (gs.Box(0, 5, (2,), np.int64), [WIDE, 1]),
        (gs.Box(0, 5, (), np.int64), np.int64(WIDE)),
        (gs.MultiBinary(2), np.array([2**32, 2**32])),
    ],
)
def test_contains_rejects_64_bit_values_that_wrap_in_32_bits(space, bad):
    # without jax_enable_x64 the value was cast to 32 bits first: 2**32 + 1 became 1, an
    # element of the space (or a Python int raised OverflowError)
    with warnings.catch_warnings():  # gymnasium's Box warns that it casts a list or scalar
        warnings.simplefilter("ignore")
        assert not space.contains(bad)  # gymnasium's answer
    assert not bool(to_jax_space(space).contains(bad))


def test_an_int32_box_does_not_contain_a_wide_int64_scalar():
    # gymnasium's Box casts a NumPy scalar to its dtype first and says yes here
    assert not bool(envs.Box(0, 5, (), np.int32).contains(np.int64(WIDE)))


def test_contains_is_jittable_and_accepts_members():
    space = envs.Dict({"x": envs.Box(-1.0, 1.0, (2,)), "n": envs.Discrete(3)})
    check = jax.jit(space.contains)
    assert bool(check({"x": jnp.array([0.0, 1.0]), "n": jnp.int32(2)}))
    assert not bool(check({"x": jnp.array([0.0, 1.1]), "n": jnp.int32(2)}))
    assert bool(envs.Box(0.0, 1.0, (2,)).contains([0.25, 1.0]))  # lists are cast like gymnasium


@pytest.mark.parametrize(
    "space",
    [
        gs.Text(5),
        gs.Graph(node_space=gs.Box(0.0, 1.0, (2,)), edge_space=None),
        gs.Sequence(gs.Discrete(2)),
        gs.Tuple([gs.Discrete(2), gs.Text(3)]),
    ],
)
def test_unsupported_spaces_raise_type_error_naming_the_space(space):
    name = "Text" if isinstance(space, gs.Tuple) else type(space).__name__
    with pytest.raises(TypeError, match=name):
        to_jax_space(space)


def test_to_gymnasium_space_rejects_unknown_objects():
    with pytest.raises(TypeError, match="object"):
        to_gymnasium_space(object())


def test_gymnax_style_spaces_are_converted():
    class GxDiscrete:
        def __init__(self, n):
            self.num_categories = n
            self.dtype = jnp.int32

    class GxBox:
        def __init__(self, low, high, shape, dtype):
            self.low, self.high, self.shape, self.dtype = low, high, shape, dtype

    class GxDict:
        def __init__(self, spaces):
            self.spaces = spaces

    space = to_gymnasium_space(
        GxDict({"a": GxDiscrete(4), "b": GxBox(0.0, 2.0, (3,), jnp.float32)})
    )
    assert isinstance(space, gs.Dict) and list(space.spaces) == ["a", "b"]
    a = space["a"]
    assert isinstance(a, gs.Discrete)
    assert (a.n, a.start, a.dtype) == (4, 0, gym_discrete_dtype(np.int32))
    _assert_same_gym_space(space["b"], gs.Box(0.0, 2.0, (3,), np.float32))


def test_discrete_dtype_is_kept_where_gymnasium_can_hold_it():
    # from gymnasium 1.2.2 on a Discrete space has a dtype; before, it is always int64 and
    # only the elements are kept (what cannot be an int64 is refused)
    space = to_gymnasium_space(envs.Discrete(4, start=-1, dtype=np.int8))
    assert isinstance(space, gs.Discrete)
    assert (space.n, space.start, space.dtype) == (4, -1, gym_discrete_dtype(np.int8))
    assert to_jax_space(space) == envs.Discrete(4, start=-1, dtype=space.dtype)
    wide = envs.Discrete(2, start=2**63, dtype=np.uint64)
    if DISCRETE_TAKES_DTYPE:
        assert to_gymnasium_space(wide).start == 2**63
    else:
        with pytest.raises(ValueError, match="beyond int64.*1.2.2"):
            to_gymnasium_space(wide)


def test_bad_construction_raises():
    with pytest.raises(ValueError, match="low <= high"):
        envs.Box(1.0, 0.0, (2,))
    with pytest.raises(ValueError, match="positive"):
        envs.Discrete(0)
    with pytest.raises(ValueError, match="positive"):
        envs.MultiDiscrete([2, 0])
    with pytest.raises(TypeError, match="integer"):
        envs.Discrete(3, dtype=np.float32)


@settings(max_examples=20, deadline=None)
@given(
    low=st.floats(-1e6, 1e6, width=32),
    width=st.floats(0.0, 1e6, width=32),
    shape=st.sampled_from([(), (2,), (2, 3)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_box_samples_lie_in_the_gymnasium_box(low, width, shape, seed):
    high = np.float32(low) + np.float32(width)
    tiny = np.finfo(np.float32).tiny
    assume(all(b == 0 or abs(b) >= tiny for b in (np.float32(low), high)))  # refused below
    gym_box = gs.Box(low=np.float32(low), high=high, shape=tuple(shape), dtype=np.float32)
    jbox = to_jax_space(gym_box)
    x = np.asarray(jbox.sample(jax.random.key(seed)))
    assert gym_box.contains(x)
    assert bool(jbox.contains(x))


def test_equality_is_exact_and_static_arguments_work():
    above_one = np.nextafter(np.float32(1), np.float32(2))  # float32 under numpy 1 and 2
    assert envs.Box(0.0, 1.0, (2,)) != envs.Box(0.0, above_one, (2,))
    assert envs.Box(0.0, 1.0, (2,)) != envs.Box(0.0, 1.0, (2,), np.float64)
    assert envs.Discrete(3) != envs.Discrete(3, start=1)
    assert envs.Dict({"a": envs.Discrete(2), "b": envs.Discrete(3)}) != envs.Dict(
        {"b": envs.Discrete(3), "a": envs.Discrete(2)}
    )  # key order is part of the space
    sample = jax.jit(lambda space, key: space.sample(key), static_argnums=0)
    x = sample(envs.MultiDiscrete([3, 4]), jax.random.key(0))
    assert x.shape == (2,)


# -- bad input is refused, never silently changed ------------------------------------------


def test_box_with_a_subnormal_bound_is_refused():
    # XLA flushes subnormals to zero on a CPU: a box [1e-45, 1e-45] sampled 0.0, outside it
    tiny = np.finfo(np.float32).tiny
    for low, high in ((1e-45, 1e-45), (0.0, tiny / 2), (-tiny / 4, 1.0)):
        with pytest.raises(ValueError, match="subnormal"):
            envs.Box(low, high, (), np.float32)
        with pytest.raises(ValueError, match="subnormal"):
            to_jax_space(gs.Box(np.float32(low), np.float32(high), (), np.float32))
    box = envs.Box(0.0, tiny, (), np.float32)  # zero and the smallest normal number are fine
    assert bool(box.contains(box.sample(jax.random.key(0))))
    assert envs.Box(1e-45, 1.0, (), np.float64).low == 1e-45  # normal in float64


def test_box_with_a_nan_bound_is_refused():
    with pytest.raises(ValueError, match="nan"):
        envs.Box(np.nan, 1.0)


def test_box_bound_beyond_its_dtype_is_refused():
    with pytest.raises(ValueError, match="300"):
        envs.Box(0, 300, (2,), np.uint8)


@pytest.mark.requires(jax="0.8")  # jax.enable_x64
def test_int64_box_to_2_pow_40_accepts_its_own_samples():
    with jax.enable_x64(True):
        box = envs.Box(0, 2**40, (5,), np.int64)
        x = box.sample(jax.random.key(0))
        assert bool(box.contains(x)) and int(x.max()) > 2**31
    box = envs.Box(0, 2**40, (5,), np.int64)
    assert bool(box.contains(np.array([0, 1, 2**31 - 1, 7, 9], np.int32)))
    with pytest.raises(ValueError, match="jax_enable_x64"):  # x64 off: cannot sample it
        box.sample(jax.random.key(0))


@pytest.mark.requires(jax="0.8")  # jax.enable_x64
def test_multidiscrete_with_a_large_start_samples_correctly_or_refuses():
    space = envs.MultiDiscrete([3], start=[2**40])
    with jax.enable_x64(True):
        x = np.asarray(space.sample(jax.random.key(0)))
        assert 2**40 <= int(x[0]) < 2**40 + 3
    with pytest.raises(ValueError, match="1099511627776"):
        space.sample(jax.random.key(0))


@pytest.mark.parametrize(
    "make",
    [
        lambda: envs.Discrete(True),
        lambda: envs.Discrete(3, start=1.0),
        lambda: envs.MultiBinary(True),
        lambda: envs.MultiBinary((2, True)),
        lambda: envs.MultiDiscrete([2.0, 3.0]),
        lambda: envs.MultiDiscrete([2, 3], start=[0.5, 0]),
    ],
)
def test_bools_and_floats_as_sizes_are_refused(make):
    with pytest.raises(TypeError, match="True|2.0|1.0|0.5"):
        make()
