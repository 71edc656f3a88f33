"""Tests of docstring, merge_dicts, enable_logging, pretty_repr/print and reload_recursive."""

import dataclasses
import importlib
import logging
import sys
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from coax_utils import utils
from coax_utils._dataclass import pytree_dataclass

# -- docstring, merge_dicts ---------------------------------------------------------------


def test_docstring_copies_doc_and_returns_same_object():
    def f():
        """The doc."""

    def g():
        return 1

    h = utils.docstring(f)(g)
    assert h is g and g.__doc__ == "The doc." and g() == 1


def test_merge_dicts():
    a, b = {"x": 1}, {"y": 2}
    merged = utils.merge_dicts(a, b, {})
    assert merged == {"x": 1, "y": 2} and merged is not a
    assert a == {"x": 1} and b == {"y": 2}
    assert utils.merge_dicts() == {}
    with pytest.warns(UserWarning, match=r"overlapping keys: \('x',\)"):
        assert utils.merge_dicts(a, {"x": 5}) == {"x": 5}  # later dict wins
    with pytest.raises(TypeError, match="argument 1 of merge_dicts must be a mapping"):
        utils.merge_dicts(a, [("z", 1)])


# -- enable_logging ------------------------------------------------------------------------


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def _ours(root):
    return [h for h in root.handlers if getattr(h, "_coax_utils_enable_logging", None)]


def test_enable_logging_file_output_and_idempotence(tmp_path, restore_root_logger):
    root = restore_root_logger
    path = tmp_path / "logs" / "run.log"
    utils.enable_logging(
        "learner", level=logging.WARNING, output_filepath=str(path), output_level=logging.DEBUG
    )
    assert root.level == logging.DEBUG
    log = logging.getLogger("coax_utils.test")
    log.debug("first %d", 1)
    utils.enable_logging(
        "learner", level=logging.WARNING, output_filepath=path, output_level=logging.INFO
    )  # same file again: no duplicate handler
    assert len(_ours(root)) == 2
    log.debug("hidden")
    log.info("second")
    for h in _ours(root):
        h.flush()
    lines = path.read_text().splitlines()
    assert lines == [
        "[learner|coax_utils.test|DEBUG] first 1",
        "[learner|coax_utils.test|INFO] second",
    ]
    stream = next(
        h
        for h in _ours(root)
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    )
    assert stream.level == logging.WARNING


def test_enable_logging_default_format(restore_root_logger):
    root = restore_root_logger
    utils.enable_logging()
    (stream,) = _ours(root)
    assert stream.level == logging.INFO and root.level == logging.INFO
    record = logging.LogRecord("x.y", logging.INFO, __file__, 1, "hello", None, None)
    assert stream.format(record) == "[x.y|INFO] hello"


def test_enable_logging_rejected_call_changes_nothing(tmp_path, restore_root_logger):
    # a bad level or an unusable file used to raise only after the stream handler had been
    # added or reconfigured (an unknown level left a NOTSET handler on the root logger)
    root = restore_root_logger
    utils.enable_logging("first", level=logging.WARNING)
    (stream,) = _ours(root)

    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hi", None, None)

    def snapshot():
        return list(root.handlers), root.level, stream.level, stream.format(record)

    before = snapshot()
    for kwargs, error in (
        (dict(level="LOUD"), ValueError),
        (dict(level=None), TypeError),
        (dict(level=True), TypeError),
        (dict(output_filepath=tmp_path / "a.log", output_level="NOPE"), ValueError),
        (dict(level="DEBUG", output_filepath=tmp_path / "b.log", output_level=10), None),
        (dict(output_filepath=tmp_path), IsADirectoryError),
    ):
        if error is None:  # a level name and a number together are fine
            utils.enable_logging("second", **kwargs)
            assert root.level == logging.DEBUG and stream.level == logging.DEBUG
            for h in _ours(root):
                if h is not stream:
                    root.removeHandler(h)
                    h.close()
            utils.enable_logging("first", level=logging.WARNING)
            root.setLevel(before[1])
            assert snapshot() == before
            continue
        with pytest.raises(error):
            utils.enable_logging("second", **kwargs)
        assert snapshot() == before
    assert not (tmp_path / "a.log").exists()


def test_enable_logging_name_with_percent_signs(restore_root_logger):
    # the name went into the %-style format string as it was: "50%" made every record fail
    # to format (logging printed "--- Logging error ---" instead of the message)
    utils.enable_logging("run 50%(x)")
    (stream,) = _ours(restore_root_logger)
    record = logging.LogRecord("x.y", logging.INFO, __file__, 1, "hello", None, None)
    assert stream.format(record) == "[run 50%(x)|x.y|INFO] hello"


# -- pretty_repr / pretty_print --------------------------------------------------------------


class Point(NamedTuple):
    x: int
    y: list


@pytree_dataclass
class State:
    count: object
    name: str = "s"


def test_pretty_repr_structures():
    obj = {"p": Point(1, [2, 3]), "empty": (), "none": None}
    expected = (
        "{\n  'p': Point(\n    x=1,\n    y=[\n      2,\n      3]),\n  'empty': (),\n  'none': None}"
    )
    assert utils.pretty_repr(obj) == expected
    assert (
        utils.pretty_repr(5) == "5"
        and utils.pretty_repr([]) == "[]"
        and utils.pretty_repr({}) == "{}"
    )


def test_pretty_repr_arrays_and_dataclasses():
    text = utils.pretty_repr(State(count=jnp.array([1, 5, 3], dtype=jnp.int32)))
    assert text == (
        "State(\n  count=array(shape=(3,), dtype=int32, min=1, median=3, max=5),\n  name='s')"
    )
    assert utils.pretty_repr(np.zeros((0, 2))) == "array(shape=(0, 2), dtype=float64)"
    assert dataclasses.is_dataclass(State)


def test_pretty_repr_handles_cycles():
    a = [1]
    a.append(a)
    assert utils.pretty_repr(a) == "[\n  1,\n  ...]"


def test_pretty_print(capsys):
    utils.pretty_print({"a": (1,)})
    assert capsys.readouterr().out == "{\n  'a': (\n    1)}\n"


# -- reload_recursive ---------------------------------------------------------------------


@pytest.fixture
def temp_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = tmp_path / "reloadpkg_x"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from reloadpkg_x import base, sub\nfrom reloadpkg_x.base import VALUE\n",
        "base.py": "VALUE = 1\n",
        "sub/__init__.py": "from reloadpkg_x.sub import leaf\n",
        "sub/leaf.py": (
            "import reloadpkg_x\nfrom reloadpkg_x.base import VALUE\nDOUBLE = 2 * VALUE\n"
        ),
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    importlib.invalidate_caches()
    yield pkg
    for name in [m for m in sys.modules if m.split(".")[0] == "reloadpkg_x"]:
        del sys.modules[name]


def test_reload_recursive_reloads_dependencies_first(temp_package):
    import reloadpkg_x

    assert reloadpkg_x.VALUE == 1 and reloadpkg_x.sub.leaf.DOUBLE == 2
    (temp_package / "base.py").write_text("VALUE = 100\n")
    importlib.invalidate_caches()
    # leaf imports the package itself (a cycle), and depends on base: base must come first
    module = utils.reload_recursive("reloadpkg_x")
    assert module is reloadpkg_x
    assert reloadpkg_x.base.VALUE == 100
    assert reloadpkg_x.VALUE == 100
    assert reloadpkg_x.sub.leaf.DOUBLE == 200
    (temp_package / "base.py").write_text("VALUE = 7\n")
    utils.reload_recursive(reloadpkg_x)  # a module object works too
    assert reloadpkg_x.sub.leaf.DOUBLE == 14


def test_reload_recursive_type_error():
    with pytest.raises(TypeError, match="module must be a module or a str; got: int"):
        utils.reload_recursive(3)
