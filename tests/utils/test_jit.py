"""Tests of utils.jit: jax.jit semantics, metadata, and pickling (also across processes)."""

import copy
import functools
import inspect
import pickle
import subprocess
import sys
import textwrap

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils


def affine(x, w, b=0.0, *, power=1):
    """Compute (w * x + b) ** power."""
    return (w * x + b) ** power


def test_metadata_is_kept():
    f = utils.jit(affine)
    assert f.__name__ == "affine"
    assert f.__qualname__ == "affine"
    assert f.__doc__ == "Compute (w * x + b) ** power."
    assert f.__module__ == affine.__module__
    assert f.__wrapped__ is affine
    assert f.__signature__ == inspect.signature(affine)
    assert inspect.signature(f) == inspect.signature(affine)
    assert "affine" in repr(f)


def test_results_equal_jax_jit_and_static_args():
    x = jnp.arange(4.0)
    expected = jax.jit(affine, static_argnames="power")(x, 2.0, 1.0, power=2)
    f = utils.jit(affine, static_argnames="power")
    np.testing.assert_array_equal(f(x, 2.0, 1.0, power=2), expected)
    g = utils.jit(lambda n, x: jnp.ones(n) * x, static_argnums=0)  # shape from a static arg
    assert g(3, 2.0).shape == (3,)
    with pytest.raises(TypeError):  # a traced arg cannot set a shape: proves 0 is needed static
        utils.jit(lambda n, x: jnp.ones(n) * x)(3, 2.0)


def test_second_call_does_not_retrace():
    traces = []

    def f(x, y):
        traces.append(1)
        return x * y

    g = utils.jit(f)
    g(jnp.ones(3), 2.0)
    g(jnp.zeros(3), 5.0)
    assert len(traces) == 1
    g(jnp.zeros(4), 5.0)  # new shape: one more trace
    assert len(traces) == 2


def test_static_argnames_retrace_only_on_new_values():
    traces = []

    def f(x, mode):
        traces.append(mode)
        return x + 1 if mode == "inc" else x - 1

    g = utils.jit(f, static_argnames="mode")
    assert float(g(1.0, mode="inc")) == 2.0
    assert float(g(5.0, mode="inc")) == 6.0
    assert float(g(5.0, mode="dec")) == 4.0
    assert traces == ["inc", "dec"]


def test_donate_argnums_and_argnames():
    f = utils.jit(lambda x, y: x + y, donate_argnums=0)
    x, y = jnp.ones(8), jnp.ones(8)
    out = f(x, y)
    assert x.is_deleted() and not y.is_deleted()
    np.testing.assert_array_equal(out, 2 * np.ones(8))
    g = utils.jit(lambda x, y: x * y, donate_argnames="y")
    x, y = jnp.ones(8), jnp.ones(8)
    g(x, y=y)
    assert y.is_deleted() and not x.is_deleted()


def test_forwards_jax_jit_attributes_and_binds_as_method():
    f = utils.jit(affine)
    lowered = f.lower(jnp.ones(2), 3.0)
    assert "mul" in lowered.as_text()
    shape = f.eval_shape(jnp.ones(2), 3.0)
    assert shape.shape == (2,)

    class Model:
        scale = 3.0

        @functools.partial(utils.jit, static_argnums=0)  # self is hashable: static
        def apply(self, x):
            return x * self.scale

    np.testing.assert_array_equal(Model().apply(jnp.ones(2)), [3.0, 3.0])
    assert Model.apply.__name__ == "apply"


def test_not_callable_raises():
    with pytest.raises(TypeError, match="callable"):
        utils.jit(42)


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_pickle_round_trip_in_process(dumps):
    f = utils.jit(affine, static_argnames="power")
    g = pickle.loads(dumps(f))
    assert g is not f and g.__name__ == "affine" and g.__doc__ == affine.__doc__
    np.testing.assert_array_equal(g(2.0, 3.0, power=2), f(2.0, 3.0, power=2))
    h = pickle.loads(dumps(utils.jit(lambda x: x - 1)))  # lambda: stored by value
    assert float(h(3.0)) == 2.0
    k = pickle.loads(dumps(utils.jit(lambda x, y: x + y, donate_argnums=0)))
    x = jnp.ones(4)
    k(x, x + 1)
    assert x.is_deleted()


def test_deepcopy_shares_the_compiled_function():
    f = utils.jit(affine)
    assert copy.deepcopy(f) is f and copy.copy(f) is f


SCRIPT_DUMP = textwrap.dedent(
    '''
    import pickle, sys
    import cloudpickle
    import jax.numpy as jnp
    from coax_utils import utils

    OFFSET = 10.0

    def shift(x, n):
        """Shift by a global offset, n times."""
        for _ in range(n):
            x = x + OFFSET
        return x

    @utils.jit
    def square(x):
        return x * x

    import helper_mod  # an importable module: its functions are stored by reference

    assert pickle.loads(pickle.dumps(helper_mod.cube)) is helper_mod.cube
    assert len(pickle.dumps(helper_mod.cube)) < 100

    items = {
        "shift": utils.jit(shift, static_argnums=1),
        "square": square,
        "closure": utils.jit(lambda x: shift(x, 1) * 2),
        "cube": helper_mod.cube,
        "plain": utils.jit(helper_mod.plain, static_argnums=1),
    }
    with open(sys.argv[1], "wb") as fh:
        pickle.dump(items, fh)
    with open(sys.argv[2], "wb") as fh:
        cloudpickle.dump(items, fh)
    '''
)

SCRIPT_LOAD = textwrap.dedent(
    """
    import pickle, sys
    import cloudpickle

    for path in sys.argv[1:]:
        with open(path, "rb") as fh:
            items = pickle.load(fh)
        shift, square, closure = items["shift"], items["square"], items["closure"]
        print(path[-3:], shift.__name__, shift.__doc__, float(shift(1.0, 2)),
              square.__name__, float(square(3.0)), float(closure(1.0)),
              float(items["cube"](2.0)), float(items["plain"](2.0, 3)))
    """
)


def test_pickle_functions_defined_in_main_across_processes(tmp_path):
    dump_script = tmp_path / "dump.py"
    load_script = tmp_path / "load.py"
    dump_script.write_text(SCRIPT_DUMP)
    (tmp_path / "helper_mod.py").write_text(
        "from coax_utils import utils\n\n"
        "@utils.jit\ndef cube(x):\n    return x ** 3\n\n"
        "def plain(x, n):\n    return x * n\n"
    )
    load_script.write_text(SCRIPT_LOAD)
    p1, p2 = tmp_path / "plain.pkl", tmp_path / "cloud.pkl"
    subprocess.run([sys.executable, str(dump_script), str(p1), str(p2)], check=True, cwd=tmp_path)
    # A fresh process whose __main__ does not define the functions.
    out = subprocess.run(
        [sys.executable, str(load_script), str(p1), str(p2)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    lines = out.stdout.strip().splitlines()
    expected = "shift Shift by a global offset, n times. 21.0 square 9.0 22.0 8.0 6.0"
    assert lines == [f"pkl {expected}", f"pkl {expected}"], out.stdout + out.stderr


def test_pickle_keeps_the_options_the_function_was_made_with():
    # the option sequences were stored as given: a list changed after the call changed what
    # the unpickled function treated as static (and a generator could not be pickled)
    nums, names = [1], ["power"]
    f = utils.jit(affine, static_argnums=nums, static_argnames=names)
    nums.append(0)
    names.append("b")
    for dumps in (pickle.dumps, cloudpickle.dumps):
        g = pickle.loads(dumps(f))
        x = jnp.arange(3.0)
        np.testing.assert_array_equal(g(x, 2.0, b=x, power=2), f(x, 2.0, b=x, power=2))
    gen = utils.jit(affine, static_argnums=(i for i in [1]))
    g = pickle.loads(pickle.dumps(gen))
    assert float(g(jnp.float32(1.0), 3.0)) == 3.0


def zeros_plus(x, n):
    return jnp.zeros(n) + x


def test_static_and_donated_arguments_by_position_or_keyword_as_jax_jit():
    # unused options were passed to jax.jit as () instead of being left out, which stops
    # jax.jit from matching argnums to argnames: a static_argnums argument given by keyword
    # was traced (TypeError for a shape), a donated one was not donated, and functions
    # without a signature (builtins) could not be jitted at all
    for f in (
        utils.jit(zeros_plus, static_argnums=1),
        utils.jit(zeros_plus, static_argnames="n"),
    ):
        for g in (f, pickle.loads(pickle.dumps(f))):
            np.testing.assert_array_equal(g(1.0, n=3), np.ones(3))
            np.testing.assert_array_equal(g(1.0, 2), np.ones(2))
    d = utils.jit(lambda x, y: x + y, donate_argnums=1)
    for g in (d, pickle.loads(pickle.dumps(d))):
        y = jnp.ones(3)
        g(jnp.ones(3), y=y)
        assert y.is_deleted()
    assert utils.jit(max, static_argnums=(0, 1))(1.0, 2.0) == 2.0  # a builtin: no signature


def test_repr_of_a_function_without_signature():
    # repr raised ValueError (no signature found for builtin), e.g. in a debugger or a log
    f = utils.jit(max, static_argnums=(0, 1))
    assert repr(f) == "JittedFunc(max(...))"
    with pytest.raises(ValueError):  # as for the builtin itself
        inspect.signature(f)


def test_numpy_integer_and_none_options():
    # a NumPy integer as static_argnums made jit() fail with numpy's "truth value of an
    # empty array is ambiguous" (the option was compared with an empty tuple)
    for opt in (np.int64(1), np.array([1]), [np.int32(1)]):
        f = utils.jit(zeros_plus, static_argnums=opt)
        for g in (f, pickle.loads(pickle.dumps(f))):
            np.testing.assert_array_equal(g(1.0, 2), np.ones(2))
    f = utils.jit(affine, static_argnums=None, static_argnames=None)  # jax.jit's defaults
    assert float(pickle.loads(pickle.dumps(f))(2.0, 3.0)) == 6.0
    with pytest.raises(TypeError):
        utils.jit(zeros_plus, static_argnums=1.5)
