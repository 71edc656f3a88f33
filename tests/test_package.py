"""Package-level checks: version, lazy optional imports, public __all__ hygiene."""

import importlib
import subprocess
import sys

import pytest

import coax_utils

PUBLIC_MODULES = [
    "coax_utils.utils",
    "coax_utils.sources",
    "coax_utils.replay",
    "coax_utils.envs",
    "coax_utils.distributed",
]


def test_version_is_a_string():
    assert isinstance(coax_utils.__version__, str)
    assert coax_utils.__version__.count(".") >= 2


def test_import_does_not_pull_heavy_or_optional_packages():
    code = (
        "import sys, coax_utils\n"
        "heavy = [m for m in ('ray', 'dm_control', 'mujoco', 'pygame', 'numba', 'cpprb',"
        " 'flashbax', 'tqdm') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported at import time: {out.stdout.strip()}"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_sorted_unique_and_resolvable(name):
    module = importlib.import_module(name)
    names = list(module.__all__)
    assert names == sorted(names), f"{name}.__all__ is not sorted"
    assert len(names) == len(set(names))
    for attr in names:
        obj = getattr(module, attr)
        assert obj is not None
        if callable(obj):
            assert obj.__doc__, f"{name}.{attr} has no docstring"
