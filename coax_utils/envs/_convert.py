"""Exact conversion between gymnasium spaces and the JAX spaces."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping
from typing import Any

import gymnasium
import numpy as np

from coax_utils._checks import check_int
from coax_utils.envs._dtypes import check_representable
from coax_utils.envs._spaces import (
    Box,
    Dict,
    Discrete,
    MultiBinary,
    MultiDiscrete,
    Space,
    Tuple,
)

__all__ = ["check_jax_can_hold", "to_gymnasium_space", "to_jax_space"]


def check_jax_can_hold(space: Space, what: str) -> None:
    """Refuse a space with integer values that the dtype JAX uses cannot hold.

    Without ``jax_enable_x64`` a 64-bit value becomes 32 bits, so such a value would wrap
    around (an observation of ``2**33 + 7`` would arrive as ``7``).

    Raises
    ------
    ValueError
        Naming ``what`` and the range that does not fit.
    """
    if isinstance(space, (Tuple, Dict)):
        subspaces = space.spaces.values() if isinstance(space, Dict) else space.spaces
        for sub in subspaces:
            check_jax_can_hold(sub, what)
    elif isinstance(space, Box):
        if np.issubdtype(space.dtype, np.integer) and space.low.size:
            check_representable(f"{what} {space!r}", space.low, space.high, space.dtype)
    elif isinstance(space, Discrete):
        top = space.start + space.n - 1
        check_representable(f"{what} {space!r}", space.start, top, space.dtype)
    elif isinstance(space, MultiDiscrete):
        top = space.start.astype(object) + space.nvec.astype(object) - 1
        check_representable(f"{what} {space!r}", space.start, top, space.dtype)


_SUPPORTED = "Box, Discrete, MultiDiscrete, MultiBinary, Tuple, Dict"

# gymnasium's Discrete takes a dtype from 1.2.2 on; before, its elements are always int64
_DISCRETE_TAKES_DTYPE = "dtype" in inspect.signature(gymnasium.spaces.Discrete).parameters


def _gymnasium_discrete(n: int, start: int, dtype: np.dtype) -> gymnasium.spaces.Discrete:
    """``gymnasium.spaces.Discrete(n, start=start, dtype=dtype)``; int64 before gymnasium 1.2.2.

    Its Discrete spaces hold int64 elements only there, so the space keeps every value and
    only the dtype differs; values beyond int64 are refused with a ValueError.
    """
    if _DISCRETE_TAKES_DTYPE:
        return gymnasium.spaces.Discrete(n, start=start, dtype=dtype)
    info = np.iinfo(np.int64)
    if start < info.min or start + n - 1 > info.max:
        raise ValueError(
            f"Discrete({n}, start={start}) of dtype {np.dtype(dtype)} has values beyond int64, "
            f"the only dtype of gymnasium {gymnasium.__version__}'s Discrete spaces "
            "(gymnasium 1.2.2 and newer take a dtype)"
        )
    return gymnasium.spaces.Discrete(n, start=start)


def to_jax_space(space: gymnasium.Space) -> Space:
    """Convert a gymnasium space to the equivalent JAX space.

    Bounds, dtypes, ``start`` offsets and nesting are kept exactly, so
    ``to_gymnasium_space(to_jax_space(s))`` equals ``s``.

    Parameters
    ----------
    space : gymnasium.Space
        A Box, Discrete, MultiDiscrete, MultiBinary, Tuple or Dict space (nested freely).

    Returns
    -------
    Space
        The JAX space.

    Raises
    ------
    TypeError
        For spaces without a fixed-shape array form (Text, Graph, Sequence, OneOf, ...) or
        objects that are not gymnasium spaces.

    Examples
    --------
    >>> import gymnasium
    >>> to_jax_space(gymnasium.spaces.Discrete(3, start=-1))
    Discrete(3, start=-1)
    """
    s = gymnasium.spaces
    if isinstance(space, s.Box):
        return Box(space.low, space.high, space.shape, space.dtype)
    if isinstance(space, s.Discrete):
        return Discrete(int(space.n), int(space.start), space.dtype)
    if isinstance(space, s.MultiDiscrete):
        return MultiDiscrete(space.nvec, space.dtype, space.start)
    if isinstance(space, s.MultiBinary):
        return MultiBinary(space.n)
    if isinstance(space, s.Tuple):
        return Tuple([to_jax_space(sp) for sp in space.spaces])
    if isinstance(space, s.Dict):
        return Dict({k: to_jax_space(sp) for k, sp in space.spaces.items()})
    if isinstance(space, Space):
        return space
    name = type(space).__name__
    raise TypeError(
        f"cannot convert the {name} space {space!r} to a JAX space: it has no fixed-shape "
        f"array form; supported spaces are {_SUPPORTED}"
    )


def to_gymnasium_space(space: Any) -> gymnasium.Space:
    """Convert a JAX space (or a gymnax-style space) to the equivalent gymnasium space.

    Besides this module's spaces, duck-typed gymnax spaces are understood: objects with
    ``n`` or, as in older gymnax releases, ``num_categories`` and no bounds (Discrete),
    with ``low``, ``high``, ``shape`` and ``dtype`` (Box), and with a tuple or dict
    ``spaces`` attribute (Tuple, Dict). A gymnasium space is returned
    as it is. Gymnasium's Discrete spaces take a dtype from gymnasium 1.2.2 on; with an
    older gymnasium a Discrete space becomes an int64 one, with the same elements.

    Parameters
    ----------
    space : Space
        The space to convert.

    Returns
    -------
    gymnasium.Space
        The gymnasium space.

    Raises
    ------
    TypeError
        When ``space`` is not a space of a supported kind.

    Examples
    --------
    >>> to_gymnasium_space(Box(0.0, 1.0, (2,)))
    Box(0.0, 1.0, (2,), float32)
    """
    s = gymnasium.spaces
    if isinstance(space, gymnasium.Space):
        return space
    if isinstance(space, Box):
        return s.Box(space.low, space.high, space.shape, space.dtype)
    if isinstance(space, Discrete):
        return _gymnasium_discrete(space.n, space.start, space.dtype)
    if isinstance(space, MultiDiscrete):
        return s.MultiDiscrete(space.nvec, dtype=space.dtype, start=space.start)
    if isinstance(space, MultiBinary):
        return s.MultiBinary(space.n)
    if isinstance(space, Tuple):
        return s.Tuple([to_gymnasium_space(sp) for sp in space.spaces])
    if isinstance(space, Dict):
        return s.Dict([(k, to_gymnasium_space(sp)) for k, sp in space.spaces.items()])
    # duck-typed gymnax spaces: Discrete has ``n`` (gymnax >= 0.0.6) or ``num_categories``
    # (older releases), and no bounds
    if not hasattr(space, "low") and (hasattr(space, "n") or hasattr(space, "num_categories")):
        n = getattr(space, "n", None)
        n = getattr(space, "num_categories", None) if n is None else n
        n = check_int(operator.index(n), "the number of categories")
        return _gymnasium_discrete(n, 0, np.dtype(getattr(space, "dtype", np.int64)))
    if all(hasattr(space, a) for a in ("low", "high", "shape", "dtype")):
        dtype, shape = np.dtype(space.dtype), tuple(space.shape)
        low = np.broadcast_to(np.asarray(space.low, dtype), shape)
        high = np.broadcast_to(np.asarray(space.high, dtype), shape)
        return s.Box(low, high, shape, dtype)
    sub = getattr(space, "spaces", None)
    if isinstance(sub, Mapping):
        return s.Dict([(k, to_gymnasium_space(sp)) for k, sp in sub.items()])
    if isinstance(sub, (tuple, list)):
        return s.Tuple([to_gymnasium_space(sp) for sp in sub])
    raise TypeError(
        f"cannot convert {type(space).__name__} {space!r} to a gymnasium space; supported "
        f"spaces are {_SUPPORTED} (JAX or gymnax-style)"
    )
