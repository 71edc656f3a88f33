"""Helpers of the checks of restored jittable states that may carry leading batch axes.

A :func:`jax.vmap` of buffers (``jax.vmap(buffer.init)``, then ``add`` under ``vmap``) gives
states whose every leaf has the same leading *batch* axes in front of the axes of one
buffer. The checks of restored states read the batch shape from a scalar counter of the
state, check every other field against it, and name the batch position of the first buffer
that breaks an invariant, so that a lying member of a batch is found.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["ARRAY_TYPES", "batch_position", "host_array", "refuse_if"]

ARRAY_TYPES = (np.ndarray, np.generic, jax.Array)


def host_array(x: Any, name: str, dtype: Any, shape: tuple | None = None) -> np.ndarray:
    """``x`` as a host array, refused (ValueError) unless it has ``dtype`` (and ``shape``)."""
    if not isinstance(x, ARRAY_TYPES):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if np.dtype(x.dtype) != np.dtype(dtype) or (shape is not None and tuple(x.shape) != shape):
        want = "" if shape is None else f" of shape {shape}"
        raise ValueError(
            f"{name} must be {np.dtype(dtype)}{want}, got {x.dtype} of shape {tuple(x.shape)}"
        )
    return np.asarray(x)


def batch_position(bad: np.ndarray, batch_ndim: int) -> str:
    """Where the first buffer with a True in ``bad`` sits in the batch, as a phrase to end
    a message with: ``""`` for a state of one buffer (``batch_ndim == 0``), else
    ``" (buffer (i, j) of the batch)"``. ``bad`` has the batch axes in front."""
    if batch_ndim == 0:
        return ""
    bad = np.asarray(bad)
    per_buffer = bad.reshape(bad.shape[:batch_ndim] + (-1,)).any(axis=-1)
    where = np.unravel_index(int(np.argmax(per_buffer)), per_buffer.shape)
    return f" (buffer {tuple(int(i) for i in where)} of the batch)"


def refuse_if(bad: Any, batch_ndim: int, message: str) -> None:
    """Raise ValueError(``message`` and the batch position of the first buffer at fault) if
    ``bad`` (batch axes in front) holds a True."""
    if np.any(bad):
        raise ValueError(message + batch_position(bad, batch_ndim))
