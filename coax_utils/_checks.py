"""Argument checks shared by every subpackage: one rule for the whole package.

A value of the wrong *type* raises :class:`TypeError`; a value of the right type but outside
what is allowed raises :class:`ValueError`. Messages name the argument and the bad value.
Booleans are never accepted as numbers (``True`` is an ``int`` to Python, but passing it as a
capacity or a seed is a mistake).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "check_choice",
    "check_finite_number",
    "check_flag",
    "check_float",
    "check_int",
    "check_seed",
    "check_state_keys",
    "checked_dtype",
    "checked_indices",
    "is_int",
]


def is_int(x: Any) -> bool:
    """Whether ``x`` is a Python or NumPy integer (booleans excluded)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _range_text(low: Any, high: Any, low_open: bool = False) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"<= {high}")
    return " and ".join(parts)


def check_int(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high]`` (either bound may be None).

    Raises TypeError if ``value`` is not an integer (bools and floats included), ValueError if
    it lies outside the bounds.
    """
    if not is_int(value):
        what = f"an int {_range_text(low, high)}".rstrip()
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {_range_text(low, high)}, got {value!r}")
    return int(value)


def check_float(
    value: Any,
    name: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """``value`` as a finite Python float in ``[low, high]`` (``(low, high]`` with ``low_open``).

    Raises TypeError if ``value`` is not a real number (bools, strings and arrays included),
    ValueError if it is NaN, infinite or outside the bounds.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    bad = not np.isfinite(v)
    bad = bad or (low is not None and (v <= low if low_open else v < low))
    bad = bad or (high is not None and v > high)
    if bad:
        what = f"a finite number {_range_text(low, high, low_open)}".rstrip()
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return v


def _real(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array of bools or real numbers (bfloat16 and the other ml_dtypes
    types, whose NumPy kind is "V", as float32 or int32), or None if it holds none."""
    import jax.numpy as jnp

    arr = np.asarray(value)
    if arr.dtype.kind in "biuf":
        return arr
    if jnp.issubdtype(arr.dtype, jnp.floating):
        return arr.astype(np.float32)
    if jnp.issubdtype(arr.dtype, jnp.integer):
        return arr.astype(np.int32)
    return None


def check_finite_number(value: Any, name: str) -> None:
    """``value`` must be one finite real number: a Python, NumPy or JAX scalar or a 0-d
    array (TypeError for a string or another non-number, ValueError for an array of another
    shape, NaN or an infinity)."""
    arr = _real(value)
    if arr is None:
        raise TypeError(f"{name} must be a real number, got {value!r:.80}")
    if arr.ndim != 0:
        raise ValueError(f"{name} must be a single number, got an array of shape {arr.shape}")
    if not np.isfinite(arr):
        raise ValueError(f"{name} must be finite, got {value!r}")


def check_flag(value: Any, name: str) -> bool:
    """``value`` as a bool: a bool, or a single number that is 0 or 1 (not a string)."""
    arr = _real(value)
    if arr is not None and arr.ndim != 0:
        raise ValueError(f"{name} must be a single bool, got an array of shape {arr.shape}")
    if arr is None or arr not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r:.80}")
    return bool(arr)


def check_seed(value: Any, name: str = "random_seed") -> int | None:
    """``value`` as a non-negative int, or None (TypeError/ValueError otherwise)."""
    if value is None:
        return None
    return check_int(value, name, low=0)


_PLAIN_DTYPE = re.compile(r"[<>|=]?[biufcV][1-9][0-9]?\Z")  # no zero-size V0


def checked_dtype(desc: Any, name: str) -> np.dtype:
    """The dtype a descriptor read from disk names, if it is a plain one: bool, integers,
    floats, complex or raw bytes (e.g. ``"<f4"``, ``"|u1"``, ``"<V2"``); ValueError for
    anything else. Other strings never reach numpy's parser, which has crashed on some."""
    if type(desc) is not str or not _PLAIN_DTYPE.match(desc):
        raise ValueError(f"{name} {desc!r:.40} is not the descriptor of a plain dtype")
    try:
        return np.dtype(desc)
    except TypeError:
        raise ValueError(f"{name} {desc!r} is not the descriptor of a plain dtype") from None


def check_choice(value: Any, name: str, choices: Iterable[str]) -> str:
    """``value`` if it is one of the strings ``choices``.

    Raises TypeError if ``value`` is not a str, ValueError if it is another string.
    """
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def checked_indices(indices: Any, limit: int) -> tuple[Any, Any]:
    """``indices`` (flattened) as int32 positions and a mask of those in ``[0, limit)``.

    For jittable code: the dtype is known while tracing, so anything but integers (floats,
    bools) raises a TypeError there. The range is checked in the indices' own dtype (NumPy
    input on the host, before any conversion), so an index such as ``2**32 + 1`` never wraps
    around to a valid slot: it is masked out and its int32 position is -1.
    """
    import jax
    import jax.numpy as jnp

    x = indices if isinstance(indices, (jax.Array, jax.core.Tracer)) else np.asarray(indices)
    if not (jnp.issubdtype(x.dtype, jnp.integer) and x.dtype != jnp.bool_):
        raise TypeError(f"indices must be integers, got dtype {x.dtype}: {indices!r}")
    if isinstance(x, np.ndarray):
        x = x.reshape(-1)
        valid = (x >= 0) & (x < limit)
        return jnp.asarray(np.where(valid, x, -1).astype(np.int32)), jnp.asarray(valid)
    x = x.reshape(-1)
    valid = (x >= 0) & (x < limit)
    return jnp.where(valid, x, -1).astype(jnp.int32), valid


def check_state_keys(state: Any, keys: tuple[str, ...], owner: str) -> dict[str, Any]:
    """``state`` as a dict with exactly ``keys``, for ``__checkpoint_restore__`` methods.

    Raises TypeError if it is not a dict and ValueError naming missing or unexpected keys.
    """
    if not isinstance(state, dict):
        raise TypeError(f"the state of a {owner} must be a dict, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    extra = [k for k in state if k not in keys]
    if missing or extra:
        raise ValueError(
            f"the state of a {owner} needs exactly the keys {list(keys)}; missing {missing}, "
            f"unexpected {extra}"
        )
    return state


def check_pairs_up(values: Any, indices: Any, name: str) -> None:
    """Refuse ``values`` whose shape does not pair up with that of ``indices`` (ValueError).

    They pair up when there is one value for all indices, or one per index in the same
    layout, axes of size 1 aside (``(k, 1)`` for ``(k,)``). Flattening both would pair
    ``(3, 2)`` values with ``(2, 3)`` indices silently. Shapes are static: this works on
    traced arrays too.
    """
    value_shape, index_shape = np.shape(values), np.shape(indices)
    if int(np.prod(value_shape)) == 1:
        return
    if [d for d in value_shape if d != 1] != [d for d in index_shape if d != 1]:
        raise ValueError(
            f"{name} must be a scalar or have the shape of the indices {index_shape} (up to "
            f"axes of size 1), got shape {value_shape}"
        )
