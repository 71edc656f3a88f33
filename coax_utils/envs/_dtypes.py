"""Dtypes of the JAX spaces: what JAX uses for a dtype, and what it can hold unchanged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "as_array",
    "canonical_dtype",
    "check_int_array",
    "check_representable",
    "false_array",
    "jax_can_hold",
]


def canonical_dtype(dtype: Any) -> np.dtype:
    """The dtype JAX uses for ``dtype`` under the current x64 setting."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def check_int_array(name: str, value: Any) -> np.ndarray:
    """``value`` as an integer array; booleans and floats are refused with a TypeError."""
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {value!r} (dtype {arr.dtype})")
    return arr


def check_representable(what: str, low: Any, high: Any, dtype: np.dtype) -> None:
    """Refuse integer values in ``[low, high]`` that the dtype JAX uses cannot hold.

    Without ``jax_enable_x64`` JAX computes with 32-bit integers: a 64-bit space whose
    values go beyond that range would be sampled wrongly, so it is refused.
    """
    cdt = canonical_dtype(dtype)
    info = np.iinfo(cdt)
    lo, hi = int(np.min(low)), int(np.max(high))
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"{what} has values in [{lo}, {hi}], beyond the range of {cdt.name}, the dtype JAX "
            f"uses for {np.dtype(dtype).name} here; enable jax_enable_x64 to use it"
        )


def false_array() -> jax.Array:
    """A JAX False (what ``contains`` returns for a non-member)."""
    return jnp.asarray(False)


def jax_can_hold(x: np.ndarray) -> bool:
    """Whether JAX can hold the host array ``x`` unchanged: False for integers beyond the
    range of the dtype JAX uses (32 bits without x64, where ``2**32 + 1`` would become 1)."""
    if not np.issubdtype(x.dtype, np.integer) or not x.size:
        return True
    info = np.iinfo(canonical_dtype(x.dtype))
    return bool(x.min() >= info.min and x.max() <= info.max)


def as_array(x: Any) -> jax.Array | None:
    """``x`` as a JAX array, or None when it is not array-like (a str, a dict, ...) or holds
    integers that the dtype JAX uses cannot hold (see :func:`jax_can_hold`)."""
    if isinstance(x, (str, bytes, Mapping)) or x is None:
        return None
    if not isinstance(x, jax.Array):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError, OverflowError):
            return None
        if not jax_can_hold(x):
            return None
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError, OverflowError):
        return None
