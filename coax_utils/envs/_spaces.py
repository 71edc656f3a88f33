"""JAX counterparts of the gymnasium spaces (conversion: :mod:`coax_utils.envs._convert`)."""

from __future__ import annotations

import abc
import collections.abc
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_int
from coax_utils.envs._dtypes import (
    as_array,
    canonical_dtype,
    check_int_array,
    check_representable,
    false_array,
)

__all__ = [
    "Box",
    "Dict",
    "Discrete",
    "MultiBinary",
    "MultiDiscrete",
    "Space",
    "Tuple",
]


class Space(abc.ABC):
    """Base class of the JAX spaces.

    A space describes a set of values with a fixed structure, ``shape`` and ``dtype``. Its
    :meth:`sample` and :meth:`contains` are pure functions of JAX arrays, so they can be
    jitted, vmapped and used inside :func:`jax.lax.scan`.
    """

    shape: Any
    dtype: Any

    @abc.abstractmethod
    def sample(self, key: jax.Array) -> Any:
        """Draw a random element of the space with the PRNG key ``key``."""

    @abc.abstractmethod
    def contains(self, x: Any) -> jax.Array:
        """Whether ``x`` is an element of the space, as a boolean JAX scalar."""

    @abc.abstractmethod
    def shape_dtype(self) -> Any:
        """The element structure as a pytree of :class:`jax.ShapeDtypeStruct`.

        The dtypes are the ones JAX uses (64-bit dtypes become 32-bit ones unless
        ``jax_enable_x64`` is set), which is what :meth:`sample` returns.
        """

    def __contains__(self, x: Any) -> bool:
        return bool(self.contains(x))

    @abc.abstractmethod
    def _key(self) -> tuple:
        """A hashable description of the space: equal spaces have equal keys."""

    def _key_with_type(self) -> tuple:
        return (type(self).__name__, self._key())

    def __eq__(self, other: object) -> bool:
        """Exact equality: same kind, shape, dtype and bounds (bit for bit)."""
        return isinstance(other, Space) and self._key_with_type() == other._key_with_type()

    def __hash__(self) -> int:
        return hash(self._key_with_type())


class Box(Space):
    r"""A (possibly unbounded) box :math:`[\text{low}, \text{high}]` in :math:`\mathbb{R}^n`.

    Same constructor as :class:`gymnasium.spaces.Box`: ``low`` and ``high`` are scalars or
    arrays broadcast to ``shape``. Bounds may be infinite for float dtypes; integer boxes
    need finite bounds.

    :meth:`sample` draws uniformly where both bounds are finite, from a shifted exponential
    where only one is, and from a standard normal where neither is (gymnasium's rule);
    integer boxes sample uniformly from :math:`\{\text{low},\dots,\text{high}\}`.

    Parameters
    ----------
    low, high : float or array
        The bounds. Float bounds may not be subnormal numbers of ``dtype`` (ValueError):
        XLA flushes subnormals to zero on a CPU, so a sample could fall outside them.
    shape : tuple of int, optional
        The shape; inferred from ``low``/``high`` when omitted.
    dtype : numpy dtype, optional
        The element dtype (float32 by default).

    Examples
    --------
    >>> import jax
    >>> box = Box(low=-1.0, high=1.0, shape=(3,))
    >>> x = jax.jit(box.sample)(jax.random.key(0))
    >>> x.shape, x.dtype, bool(box.contains(x))
    ((3,), dtype('float32'), True)
    """

    def __init__(
        self, low: Any, high: Any, shape: Sequence[int] | None = None, dtype: Any = np.float32
    ) -> None:
        self.dtype = np.dtype(dtype)
        if not (
            np.issubdtype(self.dtype, np.floating)
            or np.issubdtype(self.dtype, np.integer)
            or self.dtype == np.bool_
        ):
            raise TypeError(f"Box dtype must be a float, integer or bool dtype, got {self.dtype}")
        if shape is None:
            shape = np.broadcast_shapes(np.shape(low), np.shape(high))
        self.shape = tuple(int(d) for d in shape)
        for name, bound in (("low", low), ("high", high)):
            arr = np.asarray(bound)
            if arr.dtype == object or not (
                np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
            ):
                raise TypeError(f"Box {name} must be numbers, got {bound!r}")
            if np.any(np.isnan(arr)):
                raise ValueError(f"Box {name} must not be NaN, got {name}={bound!r}")
            if not np.issubdtype(self.dtype, np.floating) and arr.size:
                info = np.iinfo(self.dtype) if self.dtype != np.bool_ else np.iinfo(np.uint8)
                top = 1 if self.dtype == np.bool_ else info.max
                if np.min(arr) < info.min or np.max(arr) > top:
                    raise ValueError(
                        f"Box {name}={bound!r} is out of the range [{info.min}, {top}] of "
                        f"dtype {self.dtype}"
                    )
        try:
            self.low = np.array(np.broadcast_to(low, self.shape), dtype=self.dtype)
            self.high = np.array(np.broadcast_to(high, self.shape), dtype=self.dtype)
        except ValueError as e:
            raise ValueError(
                f"Box bounds of shapes {np.shape(low)} and {np.shape(high)} do not broadcast "
                f"to shape {self.shape}"
            ) from e
        if np.any(self.low > self.high):
            raise ValueError(f"Box needs low <= high everywhere, got low={low!r}, high={high!r}")
        if np.issubdtype(self.dtype, np.floating):
            tiny = jnp.finfo(self.dtype).tiny
            for name, arr in (("low", self.low), ("high", self.high)):
                subnormal = (arr != 0) & (np.abs(arr) < tiny)
                if np.any(subnormal):
                    raise ValueError(
                        f"Box {name} holds a subnormal number ({arr[subnormal].flat[0]!r}): "
                        "XLA flushes subnormals to zero on a CPU, so samples and contains() "
                        "would not respect it; use 0 or a normal number"
                    )
        self.low.setflags(write=False)
        self.high.setflags(write=False)

    def sample(self, key: jax.Array) -> jax.Array:
        """Draw a random element of the box (see the class docstring for the distribution)."""
        cdt = canonical_dtype(self.dtype)
        if not np.issubdtype(self.dtype, np.floating):
            if self.dtype != np.bool_ and self.low.size:
                check_representable(repr(self), self.low, self.high, self.dtype)
            wide = canonical_dtype(np.int64)
            info = np.iinfo(wide)
            low = np.clip(self.low.astype(np.float64), info.min, info.max - 1).astype(wide)
            high = np.clip(self.high.astype(np.float64) + 1, info.min + 1, info.max).astype(wide)
            x = jax.random.randint(key, self.shape, low, high, dtype=wide)
            return jnp.clip(x, low, high - 1).astype(cdt)
        ftype = cdt if np.dtype(cdt).itemsize >= 4 else np.dtype(np.float32)
        # bounds beyond the range of the sampling dtype count as infinite
        big = np.finfo(ftype).max
        below = np.abs(self.low.astype(np.float64)) <= big
        above = np.abs(self.high.astype(np.float64)) <= big
        low = np.where(below, self.low, 0).astype(ftype)
        high = np.where(above, self.high, 0).astype(ftype)
        k_u, k_e, k_n = jax.random.split(key, 3)
        u = jax.random.uniform(k_u, self.shape, ftype)
        e = jax.random.exponential(k_e, self.shape, ftype)
        n = jax.random.normal(k_n, self.shape, ftype)
        x = jnp.where(
            below & above,
            (1 - u) * low + u * high,
            jnp.where(below, low + e, jnp.where(above, high - e, n)),
        )
        x = jnp.clip(x, jnp.where(below, low, -jnp.inf), jnp.where(above, high, jnp.inf))
        x = x.astype(cdt)
        # rounding to a narrower dtype may step over a bound: clip again in the final dtype
        low_c, high_c = self._bounds(cdt)
        return jnp.clip(x, low_c, high_c)

    def _bounds(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """The bounds in ``dtype``: float bounds beyond its range become infinite, integer
        bounds are clipped to its range (no value beyond it can be given in ``dtype``)."""
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            return (
                np.clip(self.low, info.min, info.max).astype(dtype),
                np.clip(self.high, info.min, info.max).astype(dtype),
            )
        with np.errstate(over="ignore"):
            return self.low.astype(dtype), self.high.astype(dtype)

    def contains(self, x: Any) -> jax.Array:
        """Whether ``x`` has the box's shape, a castable dtype, and lies within the bounds.

        Like gymnasium, arrays must have a dtype that casts safely to the box's dtype, while
        Python scalars and lists are first converted to it. Integers that the dtype JAX uses
        cannot hold (beyond 32 bits without ``jax_enable_x64``) are not contained.
        """
        cdt = canonical_dtype(self.dtype)
        if not isinstance(x, (np.ndarray, np.generic, jax.Array)):
            try:
                x = np.asarray(x, self.dtype)
            except (TypeError, ValueError, OverflowError):
                return false_array()
        x = as_array(x)
        if x is None or x.shape != self.shape or not np.can_cast(x.dtype, cdt):
            return false_array()
        low, high = self._bounds(cdt)
        return jnp.all((x >= low) & (x <= high))

    def shape_dtype(self) -> jax.ShapeDtypeStruct:
        """The element shape and (JAX) dtype."""
        return jax.ShapeDtypeStruct(self.shape, canonical_dtype(self.dtype))

    def _key(self) -> tuple:
        return (self.shape, self.dtype.str, self.low.tobytes(), self.high.tobytes())

    def __repr__(self) -> str:
        lo, hi = self.low, self.high
        if lo.size and np.all(lo == lo.flat[0]) and np.all(hi == hi.flat[0]):
            lo, hi = lo.flat[0], hi.flat[0]
        return f"Box({lo}, {hi}, {self.shape}, {self.dtype})"


class Discrete(Space):
    r"""The integers :math:`\{\text{start}, \dots, \text{start} + n - 1\}`.

    Parameters
    ----------
    n : int
        The number of elements (positive).
    start : int, optional
        The smallest element.
    dtype : numpy integer dtype, optional
        The element dtype (int64 like gymnasium; JAX uses int32 unless x64 is enabled).

    Examples
    --------
    >>> import jax
    >>> space = Discrete(3, start=1)
    >>> int(space.sample(jax.random.key(0))) in {1, 2, 3}
    True
    >>> bool(space.contains(0)), bool(space.contains(3))
    (False, True)
    """

    def __init__(self, n: int, start: int = 0, dtype: Any = np.int64) -> None:
        n, start = check_int(n, "Discrete n"), check_int(start, "Discrete start")
        if n <= 0:
            raise ValueError(f"Discrete needs a positive integer n, got {n!r}")
        self.dtype = np.dtype(dtype)
        if not np.issubdtype(self.dtype, np.integer):
            raise TypeError(f"Discrete dtype must be an integer dtype, got {self.dtype}")
        info = np.iinfo(self.dtype)
        if start < info.min or start + n - 1 > info.max:
            raise ValueError(
                f"Discrete({n}, start={start}) has values beyond the range of {self.dtype}"
            )
        self.n = n
        self.start = start
        self.shape = ()

    def sample(self, key: jax.Array) -> jax.Array:
        """Draw an element uniformly at random.

        Raises
        ------
        ValueError
            If the values do not fit in the dtype JAX uses (32-bit without x64).
        """
        check_representable(repr(self), self.start, self.start + self.n - 1, self.dtype)
        cdt = canonical_dtype(self.dtype)
        return (self.start + jax.random.randint(key, (), 0, self.n, dtype=cdt)).astype(cdt)

    def contains(self, x: Any) -> jax.Array:
        """Whether ``x`` is an integer scalar in range."""
        x = as_array(x)
        if x is None or x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
            return false_array()
        return (x >= self.start) & (x < self.start + self.n)

    def shape_dtype(self) -> jax.ShapeDtypeStruct:
        """The element shape ``()`` and (JAX) dtype."""
        return jax.ShapeDtypeStruct((), canonical_dtype(self.dtype))

    def _key(self) -> tuple:
        return (self.n, self.start, self.dtype.str)

    def __repr__(self) -> str:
        start = f", start={self.start}" if self.start else ""
        return f"Discrete({self.n}{start})"


class MultiDiscrete(Space):
    r"""An array of independent discrete variables, entry ``i`` in
    :math:`\{\text{start}_i, \dots, \text{start}_i + \text{nvec}_i - 1\}`.

    Parameters
    ----------
    nvec : array of int
        The number of values of each entry (positive); its shape is the space's shape.
    dtype : numpy integer dtype, optional
        The element dtype.
    start : array of int, optional
        The smallest value of each entry (zeros by default).

    Examples
    --------
    >>> import jax
    >>> space = MultiDiscrete([2, 5])
    >>> x = space.sample(jax.random.key(1))
    >>> x.shape, bool(space.contains(x))
    ((2,), True)
    """

    def __init__(self, nvec: Any, dtype: Any = np.int64, start: Any = None) -> None:
        self.dtype = np.dtype(dtype)
        if not np.issubdtype(self.dtype, np.integer):
            raise TypeError(f"MultiDiscrete dtype must be an integer dtype, got {self.dtype}")
        nvec_in = check_int_array("MultiDiscrete nvec", nvec)
        if nvec_in.size == 0 or np.any(nvec_in <= 0):
            raise ValueError(f"MultiDiscrete needs positive entries in nvec, got {nvec!r}")
        start_in = check_int_array(
            "MultiDiscrete start", np.zeros_like(nvec_in) if start is None else start
        )
        info = np.iinfo(self.dtype)
        lo = start_in.astype(object)
        hi = lo + nvec_in.astype(object) - 1
        if np.min(lo) < info.min or np.max(hi) > info.max:
            raise ValueError(
                f"MultiDiscrete(nvec={nvec!r}, start={start!r}) has values beyond the range "
                f"of {self.dtype}"
            )
        self.nvec = np.array(nvec_in, dtype=self.dtype, copy=True)
        self.start = np.array(np.broadcast_to(start_in, self.nvec.shape), dtype=self.dtype)
        self.shape = self.nvec.shape
        self.nvec.setflags(write=False)
        self.start.setflags(write=False)

    def sample(self, key: jax.Array) -> jax.Array:
        """Draw each entry uniformly at random.

        Raises
        ------
        ValueError
            If the values do not fit in the dtype JAX uses (32-bit without x64).
        """
        top = self.start.astype(object) + self.nvec.astype(object) - 1
        check_representable(repr(self), self.start, top, self.dtype)
        cdt = canonical_dtype(self.dtype)
        nvec = self.nvec.astype(cdt)
        start = self.start.astype(cdt)
        return start + jax.random.randint(key, self.shape, 0, nvec, dtype=cdt)

    def contains(self, x: Any) -> jax.Array:
        """Whether ``x`` is an integer array of the right shape with every entry in range."""
        x = as_array(x)
        if x is None or x.shape != self.shape or not jnp.issubdtype(x.dtype, jnp.integer):
            return false_array()
        return jnp.all((x >= self.start) & (x < self.start + self.nvec))

    def shape_dtype(self) -> jax.ShapeDtypeStruct:
        """The element shape and (JAX) dtype."""
        return jax.ShapeDtypeStruct(self.shape, canonical_dtype(self.dtype))

    def _key(self) -> tuple:
        return (self.shape, self.dtype.str, self.nvec.tobytes(), self.start.tobytes())

    def __repr__(self) -> str:
        return f"MultiDiscrete({self.nvec.tolist()})"


class MultiBinary(Space):
    """Arrays of zeros and ones (int8).

    Parameters
    ----------
    n : int or tuple of int
        The number of entries, or the shape of the array.

    Examples
    --------
    >>> import jax
    >>> space = MultiBinary(4)
    >>> x = space.sample(jax.random.key(0))
    >>> x.shape, x.dtype, bool(space.contains(x))
    ((4,), dtype('int8'), True)
    """

    def __init__(self, n: int | Sequence[int]) -> None:
        if isinstance(n, (int, np.integer, bool, np.bool_)):
            self.n: int | tuple[int, ...] = check_int(n, "MultiBinary n")
            self.shape = (self.n,)
        else:
            self.n = tuple(check_int(d, "MultiBinary n") for d in n)
            self.shape = self.n
        if any(d <= 0 for d in self.shape):
            raise ValueError(f"MultiBinary needs positive sizes, got {n!r}")
        self.dtype = np.dtype(np.int8)

    def sample(self, key: jax.Array) -> jax.Array:
        """Draw each entry as a fair coin flip."""
        return jax.random.bernoulli(key, 0.5, self.shape).astype(jnp.int8)

    def contains(self, x: Any) -> jax.Array:
        """Whether ``x`` has the right shape and only zeros and ones."""
        x = as_array(x)
        if x is None or x.shape != self.shape:
            return false_array()
        return jnp.all((x == 0) | (x == 1))

    def shape_dtype(self) -> jax.ShapeDtypeStruct:
        """The element shape and dtype (int8)."""
        return jax.ShapeDtypeStruct(self.shape, jnp.int8)

    def _key(self) -> tuple:
        return (self.n,)

    def __repr__(self) -> str:
        return f"MultiBinary({self.n})"


class Tuple(Space):
    """A tuple of spaces; elements are tuples.

    ``shape`` and ``dtype`` are tuples of the subspaces' shapes and dtypes.

    Parameters
    ----------
    spaces : sequence of Space
        The subspaces.

    Examples
    --------
    >>> import jax
    >>> space = Tuple([Discrete(2), Box(0.0, 1.0, (2,))])
    >>> a, b = space.sample(jax.random.key(0))
    >>> b.shape, bool(space.contains((a, b)))
    ((2,), True)
    """

    def __init__(self, spaces: Sequence[Space]) -> None:
        self.spaces = tuple(spaces)
        for s in self.spaces:
            if not isinstance(s, Space):
                raise TypeError(f"Tuple expects JAX spaces, got {s!r}")
        self.shape = tuple(s.shape for s in self.spaces)
        self.dtype = tuple(s.dtype for s in self.spaces)

    def sample(self, key: jax.Array) -> tuple:
        """Sample every subspace with its own subkey."""
        keys = jax.random.split(key, len(self.spaces))
        return tuple(s.sample(k) for s, k in zip(self.spaces, keys))

    def contains(self, x: Any) -> jax.Array:
        """Whether ``x`` is a tuple (or list) of matching length with every item contained."""
        if not isinstance(x, (tuple, list)) or len(x) != len(self.spaces):
            return false_array()
        out = jnp.asarray(True)
        for s, xi in zip(self.spaces, x):
            out = out & s.contains(xi)
        return out

    def shape_dtype(self) -> tuple:
        """A tuple of the subspaces' shape-dtype structures."""
        return tuple(s.shape_dtype() for s in self.spaces)

    def __getitem__(self, index: int) -> Space:
        return self.spaces[index]

    def __len__(self) -> int:
        return len(self.spaces)

    def _key(self) -> tuple:
        return tuple(sp._key_with_type() for sp in self.spaces)

    def __repr__(self) -> str:
        return f"Tuple({', '.join(map(repr, self.spaces))})"


class Dict(Space):
    """A dictionary of spaces; elements are dicts with the same keys (order kept).

    ``shape`` and ``dtype`` are dicts of the subspaces' shapes and dtypes.

    Parameters
    ----------
    spaces : mapping of str to Space
        The subspaces, in the order given.

    Examples
    --------
    >>> import jax
    >>> space = Dict({"pos": Box(-1.0, 1.0, (2,)), "id": Discrete(4)})
    >>> x = space.sample(jax.random.key(0))
    >>> sorted(x), bool(space.contains(x))
    (['id', 'pos'], True)
    """

    def __init__(self, spaces: Mapping[str, Space]) -> None:
        self.spaces = dict(spaces)
        for k, s in self.spaces.items():
            if not isinstance(s, Space):
                raise TypeError(f"Dict expects JAX spaces, got {s!r} for key {k!r}")
        self.shape = {k: s.shape for k, s in self.spaces.items()}
        self.dtype = {k: s.dtype for k, s in self.spaces.items()}

    def sample(self, key: jax.Array) -> dict:
        """Sample every subspace with its own subkey."""
        keys = jax.random.split(key, len(self.spaces))
        return {k: s.sample(kk) for (k, s), kk in zip(self.spaces.items(), keys)}

    def contains(self, x: Any) -> jax.Array:
        """Whether ``x`` is a mapping with exactly these keys and every value contained."""
        if not isinstance(x, Mapping) or set(x) != set(self.spaces):
            return false_array()
        out = jnp.asarray(True)
        for k, s in self.spaces.items():
            out = out & s.contains(x[k])
        return out

    def shape_dtype(self) -> dict:
        """A dict of the subspaces' shape-dtype structures."""
        return {k: s.shape_dtype() for k, s in self.spaces.items()}

    def __getitem__(self, key: str) -> Space:
        return self.spaces[key]

    def __len__(self) -> int:
        return len(self.spaces)

    def keys(self) -> collections.abc.KeysView:
        """The keys, in order."""
        return self.spaces.keys()

    def _key(self) -> tuple:
        return tuple((k, sp._key_with_type()) for k, sp in self.spaces.items())

    def __repr__(self) -> str:
        items = ", ".join(f"{k!r}: {s!r}" for k, s in self.spaces.items())
        return f"Dict({{{items}}})"
