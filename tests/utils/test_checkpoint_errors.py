"""The two families of load errors: a damaged or forged file (CheckpointDamagedError) and an
intact file that this process cannot read as it is set up (CheckpointNotReadableError), each
with honest files written by another process and with crafted ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib
from typing import NamedTuple

import pytest

from coax_utils import utils


def run(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (with ``env`` added); return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_families_are_value_errors_and_exported():
    assert issubclass(utils.CheckpointDamagedError, ValueError)
    assert issubclass(utils.CheckpointNotReadableError, ValueError)
    assert issubclass(utils.UnsafeCheckpointError, utils.CheckpointNotReadableError)
    assert not issubclass(utils.CheckpointDamagedError, utils.CheckpointNotReadableError)


def test_a_type_registered_by_the_writer_only_is_not_readable_until_registered(tmp_path):
    path = tmp_path / "point.ckpt"
    run(
        f"""
        from typing import NamedTuple
        from coax_utils import utils

        class Point(NamedTuple):
            x: int
            y: float

        utils.register_checkpoint_type(Point, "tests.errors.Point")
        utils.dump({{"step": 4, "p": Point(1, 2.5)}}, {str(path)!r})
        """
    )
    for safe in (True, False):
        with pytest.raises(utils.CheckpointNotReadableError, match="not registered") as e:
            utils.load(path, safe=safe)
        message = str(e.value)
        assert "point.ckpt' is intact but cannot be read here" in message
        assert "tests.errors.Point" in message and "register_checkpoint_type" in message
        assert not isinstance(e.value, utils.CheckpointDamagedError)

    class Point(NamedTuple):
        x: int
        y: float

    utils.register_checkpoint_type(Point, "tests.errors.Point")  # the fix: register, load again
    assert utils.load(path, safe=True) == {"step": 4, "p": Point(1, 2.5)}


def test_a_64_bit_jax_array_is_not_readable_while_x64_is_off(tmp_path):
    path = tmp_path / "x64.ckpt"
    run(
        f"""
        import jax.numpy as jnp
        from coax_utils import utils
        utils.dump({{"w": jnp.arange(3, dtype=jnp.float64) / 3}}, {str(path)!r})
        """,
        JAX_ENABLE_X64="1",
    )
    for safe in (True, False):
        with pytest.raises(utils.CheckpointNotReadableError, match="jax_enable_x64") as e:
            utils.load(path, safe=safe)
        assert "x64.ckpt' is intact but cannot be read here" in str(e.value)
    out = run(  # with the flag on again, it loads
        f"""
        from coax_utils import utils
        w = utils.load({str(path)!r}, safe=True)["w"]
        print(w.dtype, w.tolist() == [0.0, 1 / 3, 2 / 3])
        """,
        JAX_ENABLE_X64="1",
    )
    assert out.split() == ["float64", "True"]


def test_a_newer_format_is_not_readable_and_a_flipped_version_is_damaged():
    s = bytearray(utils.dumps({"a": 1}))
    version_at = 8
    newer = bytearray(s)
    newer[version_at] = 3
    with pytest.raises(utils.CheckpointDamagedError, match="header checksum"):
        utils.loads(bytes(newer))  # the version field alone changed: a bit flip

    meta_len = int.from_bytes(s[12:16], "little")
    end = 16 + meta_len
    newer[end : end + 4] = zlib.crc32(bytes(newer[:end])).to_bytes(4, "little")
    with pytest.raises(utils.CheckpointNotReadableError, match="upgrade coax_utils") as e:
        utils.loads(bytes(newer))
    assert "the given data is intact but cannot be read here" in str(e.value)


def test_a_pickle_section_under_safe_mode_is_not_readable_here():
    s = utils.dumps({"f": len})
    with pytest.raises(utils.UnsafeCheckpointError, match="safe=False only if you trust") as e:
        utils.loads(s, safe=True)
    assert isinstance(e.value, utils.CheckpointNotReadableError)
    assert "intact but cannot be read here" in str(e.value)
    assert utils.loads(s)["f"] is len


def test_a_pickle_section_naming_a_missing_module_is_not_readable(tmp_path, monkeypatch):
    (tmp_path / "ckpt_errors_helper_mod.py").write_text(
        "class Thing:\n    def __init__(self):\n        self.n = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import ckpt_errors_helper_mod

    s = utils.dumps({"thing": ckpt_errors_helper_mod.Thing()})
    monkeypatch.delitem(sys.modules, "ckpt_errors_helper_mod")
    (tmp_path / "ckpt_errors_helper_mod.py").unlink()
    with pytest.raises(utils.CheckpointNotReadableError, match="ckpt_errors_helper_mod"):
        utils.loads(s)


class Interval(NamedTuple):
    lo: float
    hi: float

    def __checkpoint_check__(self) -> None:
        if not self.lo <= self.hi:
            raise ValueError(f"lo {self.lo} is above hi {self.hi}")


utils.register_checkpoint_type(Interval, "tests.errors.Interval")


class Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def __checkpoint_state__(self) -> dict:
        return {"n": self.n}

    @classmethod
    def __checkpoint_restore__(cls, state: dict) -> Counter:
        if type(state.get("n")) is not int or state["n"] < 0:
            raise ValueError(f"count {state.get('n')!r} is not a natural number")
        return cls(state["n"])


utils.register_checkpoint_type(Counter, "tests.errors.Counter")


def test_restored_objects_that_break_an_invariant_are_damaged(tmp_path):
    assert utils.loads(utils.dumps(Interval(1.0, 2.0)), safe=True) == Interval(1.0, 2.0)
    for bad, message in [(Interval(2.0, 1.0), "lo 2.0 is above hi 1.0"), (Counter(-1), "count")]:
        path = tmp_path / "bad.ckpt"
        utils.dump({"x": bad}, path)  # dump checks nothing: the file is what a forger writes
        for safe in (True, False):
            with pytest.raises(utils.CheckpointDamagedError, match=message) as e:
                utils.load(path, safe=safe)
            assert "bad.ckpt' is damaged or forged" in str(e.value)
            assert "restore an older checkpoint" in str(e.value)


def test_legacy_files_that_do_not_decode_are_damaged():
    import lz4.frame

    legacy = lz4.frame.compress(b"\x80\x05not a pickle at all")
    with pytest.raises(utils.CheckpointDamagedError, match="pickle is damaged"):
        utils.loads(legacy)
    with pytest.raises(utils.CheckpointDamagedError, match="truncated"):
        utils.loads(lz4.frame.compress(b"x" * 1000)[:-6])


def test_a_haiku_that_fails_to_import_leaves_the_other_types_registered():
    out = run(
        """
        import sys

        class Broken:  # haiku is installed, but importing it fails (not with ImportError)
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "haiku":
                    raise RuntimeError("this haiku is broken")

        sys.meta_path.insert(0, Broken())
        import numpy as np
        import optax
        from coax_utils import utils

        state = optax.adam(1e-3).init({"w": np.ones(3, np.float32)})
        print(type(utils.loads(utils.dumps(state), safe=True)[0]).__name__)
        """
    )
    assert out.split() == ["ScaleByAdamState"]
