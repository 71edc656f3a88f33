"""Numpy random generators rebuilt from states read from disk, every field checked first.

numpy's own setters trust a state's numbers; a state out of range has made a generator read
past its buffers or return zeros forever. These functions refuse such states with a
ValueError and build the generator only from a state that seeding could have produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["BIT_GENERATORS", "bit_generator_from_state", "random_state_from_state"]


def _check_keys(d: Any, keys: set[str], what: str) -> dict:
    if type(d) is not dict or set(d) != keys:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{what} must be a dict with keys {sorted(keys)}, got {got}")
    return d


def _check_int(x: Any, lo: int, hi: int, what: str) -> None:
    if type(x) is not int or not lo <= x < hi:
        raise ValueError(f"{what} must be an int in [{lo}, {hi}), got {x!r}")


def _check_words(x: Any, dtype: Any, shape: tuple, what: str) -> None:
    if type(x) is not np.ndarray or x.dtype != dtype or x.shape != shape:
        raise ValueError(f"{what} must be a {np.dtype(dtype)} array of shape {shape}")


def _check_cached(state: dict, name: str) -> None:
    _check_int(state["has_uint32"], 0, 2, f"{name} has_uint32")
    _check_int(state["uinteger"], 0, 1 << 32, f"{name} uinteger")


def _check_pcg(state: dict, name: str) -> None:
    _check_keys(state, {"bit_generator", "state", "has_uint32", "uinteger"}, f"{name} state")
    inner = _check_keys(state["state"], {"state", "inc"}, f"{name} state['state']")
    _check_int(inner["state"], 0, 1 << 128, f"{name} state")
    _check_int(inner["inc"], 0, 1 << 128, f"{name} increment")
    if inner["inc"] % 2 != 1:
        raise ValueError(f"{name} increment must be odd")
    _check_cached(state, name)


def _check_mt(state: dict, name: str) -> None:
    _check_keys(state, {"bit_generator", "state"}, f"{name} state")
    inner = _check_keys(state["state"], {"key", "pos"}, f"{name} state['state']")
    _check_words(inner["key"], np.uint32, (624,), f"{name} key")
    _check_int(inner["pos"], 0, 625, f"{name} position")
    if not np.any(inner["key"]):  # no seeding gives it; the generator would return 0 forever
        raise ValueError(f"{name} key is all zeros")


def _check_philox(state: dict, name: str) -> None:
    keys = {"bit_generator", "state", "buffer", "buffer_pos", "has_uint32", "uinteger"}
    _check_keys(state, keys, f"{name} state")
    inner = _check_keys(state["state"], {"counter", "key"}, f"{name} state['state']")
    _check_words(inner["counter"], np.uint64, (4,), f"{name} counter")
    _check_words(inner["key"], np.uint64, (2,), f"{name} key")
    _check_words(state["buffer"], np.uint64, (4,), f"{name} buffer")
    _check_int(state["buffer_pos"], 0, 5, f"{name} buffer position")
    _check_cached(state, name)


def _check_sfc(state: dict, name: str) -> None:
    _check_keys(state, {"bit_generator", "state", "has_uint32", "uinteger"}, f"{name} state")
    inner = _check_keys(state["state"], {"state"}, f"{name} state['state']")
    _check_words(inner["state"], np.uint64, (4,), f"{name} words")
    _check_cached(state, name)


BIT_GENERATORS: dict[str, tuple[type, Callable[[dict, str], None]]] = {
    "PCG64": (np.random.PCG64, _check_pcg),
    "PCG64DXSM": (np.random.PCG64DXSM, _check_pcg),
    "MT19937": (np.random.MT19937, _check_mt),
    "Philox": (np.random.Philox, _check_philox),
    "SFC64": (np.random.SFC64, _check_sfc),
}


def bit_generator_from_state(name: Any, state: Any) -> np.random.BitGenerator:
    """A numpy bit generator ``name`` set to ``state``, checked first (every field in range);
    ValueError for anything else. For states read from disk."""
    if type(name) is not str or name not in BIT_GENERATORS:
        raise ValueError(f"bit generator {name!r} is not one of {sorted(BIT_GENERATORS)}")
    cls, check = BIT_GENERATORS[name]
    if type(state) is not dict or state.get("bit_generator") != name:
        raise ValueError(f"{name} state does not name its bit generator")
    check(state, name)
    bit_generator = cls(0)
    bit_generator.state = state
    return bit_generator


def random_state_from_state(state: Any) -> np.random.RandomState:
    """A numpy RandomState set to ``state`` (as ``get_state(legacy=False)`` gives it),
    checked first; ValueError for anything else."""
    keys = {"bit_generator", "state", "has_gauss", "gauss"}
    _check_keys(state, keys, "RandomState state")
    mt = {"bit_generator": state["bit_generator"], "state": state["state"]}
    if state["bit_generator"] != "MT19937":
        raise ValueError("RandomState state must use MT19937")
    _check_mt(mt, "MT19937")
    _check_int(state["has_gauss"], 0, 2, "RandomState has_gauss")
    # the cached second value of the polar method: finite, and below 13 in size (its
    # radius term is at most sqrt(-2 ln 2**-106)); a NaN would be the next normal draw
    if type(state["gauss"]) is not float or not abs(state["gauss"]) < 64:
        raise ValueError(
            f"RandomState gauss must be a finite float of a normal draw, got {state['gauss']!r}"
        )
    rs = np.random.RandomState(0)
    rs.set_state(state)
    return rs
