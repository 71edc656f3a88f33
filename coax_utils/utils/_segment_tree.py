r"""Host-side segment trees (NumPy storage, numba kernels for the built-in reducers).

Layout: a 1-indexed binary heap in one float64 array ``_arr`` of length ``2 * L``, where
``L = 2 ** (height - 1)`` is the smallest power of two ``>= capacity``. Level ``l`` (0 is the
root) starts at node ``2 ** l``; value ``i`` sits at node ``L + i``. Leaves past ``capacity``
hold the reducer's unit element, so they never change a reduction; ``_arr[0]`` is unused.

The hot loops (``set_values``, the sum-tree descent, ``partial_reduce``) of the sum, min and
max reducers run in numba kernels only: numba is a required dependency, imported on first use
(not at ``import coax_utils``). A plain :class:`SegmentTree` with any other reducer (a Python
callable the kernels cannot run) uses vectorized NumPy code, tested against the same oracles
through such reducers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from coax_utils._checks import check_seed, check_state_keys, is_int

__all__ = ["MaxTree", "MinTree", "SegmentTree", "SumTree"]

# numba kernels, loaded on first use
_KERNELS: Any = None

_OPS = {
    np.add: 0,
    operator.add: 0,
    np.minimum: 1,
    min: 1,
    np.maximum: 2,
    max: 2,
}


def _kernels() -> Any:
    """The numba kernel module (imported on first use: compiling and loading take time)."""
    global _KERNELS
    if _KERNELS is None:
        from coax_utils.utils import _segment_tree_numba

        _KERNELS = _segment_tree_numba
    return _KERNELS


def _numeric_array(x: Any, name: str) -> np.ndarray:
    """``x`` as a float64 array; TypeError for anything that is not numbers (e.g. strings)."""
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be numbers, got {x!r}") from e
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be numbers, got {x!r} (dtype {arr.dtype})")
    return arr.astype(np.float64)


_Tree = TypeVar("_Tree", bound="SegmentTree")

# reducers a checkpoint names by string (numpy ufuncs of two arguments, found by name)
_REDUCER_NAMES = {operator.add: "add", min: "minimum", max: "maximum"}


class SegmentTree:
    r"""A segment tree that supports batched updates and batched partial-range reductions.

    Both :meth:`set_values` and :meth:`partial_reduce` take :math:`\mathcal{O}(\log N)` time per
    entry, with :math:`N` the capacity. Any capacity works; internally the leaves are padded
    to the next power of two with ``init_value``. Values are stored as float64.

    Parameters
    ----------
    capacity : int
        Number of values to accommodate, ``>= 1``.
    reducer : callable
        The associative reducer ``(float, float) -> float``, applied element-wise to arrays
        (e.g. :data:`numpy.add`, :data:`numpy.minimum`). :data:`numpy.add`,
        :data:`numpy.minimum`, :data:`numpy.maximum` (and :func:`operator.add`, :func:`min`,
        :func:`max`) use compiled kernels.
    init_value : float
        The unit element of ``reducer``: 0 for addition, 1 for multiplication,
        :math:`-\infty` for maximum, :math:`\infty` for minimum. All values start at it.

    Raises
    ------
    TypeError
        If ``capacity`` is not an int or ``reducer`` is not callable.
    ValueError
        If ``capacity < 1``.

    Warning
    -------
    :attr:`values` and ``tree[level]`` / ``tree[level, index]`` return read-only views of
    the underlying storage (no copy); use :meth:`set_values` to change values.

    Examples
    --------
    >>> import numpy as np
    >>> tree = SegmentTree(5, reducer=np.multiply, init_value=1.0)
    >>> tree.set_values(..., [1.0, 2.0, 3.0, 4.0, 5.0])
    >>> print(tree.root_value)
    120.0
    >>> print(tree.partial_reduce(1, 4))
    24.0
    >>> tree.partial_reduce(np.array([0, 2]), np.array([2, 5])).tolist()
    [2.0, 60.0]
    """

    def __init__(self, capacity: int, reducer: Callable[[Any, Any], Any], init_value: float):
        if not is_int(capacity):
            raise TypeError(f"capacity must be an int, got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not callable(reducer):
            raise TypeError(f"reducer must be callable, got {reducer!r}")
        self._setup(int(capacity), reducer, float(init_value), None)

    def _setup(
        self, capacity: int, reducer: Callable, init_value: float, arr: np.ndarray | None
    ) -> None:
        self.capacity = capacity
        self.reducer = reducer
        self.init_value = init_value
        self._height = (self.capacity - 1).bit_length() + 1
        self._num_leaves = 1 << (self._height - 1)
        if arr is None:
            arr = np.full(2 * self._num_leaves, self.init_value, dtype=np.float64)
        self._arr = arr
        self._op = _OPS.get(reducer, -1)
        # element-wise form of the reducer for the NumPy code (builtin min/max are not)
        self._ufunc = (np.add, np.minimum, np.maximum)[self._op] if self._op >= 0 else reducer
        self._nonneg_finite = False

    # -- checkpoints -------------------------------------------------------------------------

    def __checkpoint_state__(self) -> dict[str, Any]:
        """The tree as plain data: ``capacity``, ``nodes`` (the whole heap, a view of the
        storage) and, for a plain :class:`SegmentTree`, ``reducer`` (the name of a NumPy
        ufunc, or the callable itself for other reducers, which only a trusted checkpoint can
        hold) and ``init_value``; for a :class:`SumTree` also ``rng`` (its sampling
        :class:`numpy.random.Generator`) and ``random_seed``."""
        reducer = self.reducer
        if isinstance(reducer, np.ufunc):
            reducer = reducer.__name__
        elif reducer in _REDUCER_NAMES:
            reducer = _REDUCER_NAMES[reducer]
        seed = getattr(self, "_random_seed", None)
        state = {
            "capacity": self.capacity,
            "reducer": reducer,
            "init_value": self.init_value,
            "nodes": self._arr,
            "rng": getattr(self, "_rng", None),
            "random_seed": int(seed) if is_int(seed) else None,
        }
        return {key: state[key] for key in self._STATE_KEYS}

    @classmethod
    def __checkpoint_restore__(cls: type[_Tree], state: dict[str, Any]) -> _Tree:
        """Rebuild a tree from :meth:`__checkpoint_state__`, checking every invariant.

        ``nodes`` is adopted as the storage when it is a writable, C-contiguous float64
        array. Raises ValueError (TypeError for a wrong type) naming what is wrong: the
        capacity, the length of ``nodes``, values that the tree refuses, padding that is not
        the unit element, or a parent that is not the reduction of its children.
        """
        state = check_state_keys(state, cls._STATE_KEYS, cls.__name__)
        tree = cls.__new__(cls)
        reducer, init_value = cls._restore_reducer(state)
        capacity = state["capacity"]
        if not is_int(capacity):
            raise TypeError(f"{cls.__name__} state: capacity must be an int, got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"{cls.__name__} state: capacity must be >= 1, got {capacity}")
        nodes = state["nodes"]
        if not isinstance(nodes, np.ndarray) or nodes.dtype != np.float64:
            raise TypeError(f"{cls.__name__} state: nodes must be a float64 array, got {nodes!r}")
        if not (nodes.flags.writeable and nodes.flags.c_contiguous):
            nodes = np.array(nodes, order="C")
        tree._setup(int(capacity), reducer, init_value, nodes)
        tree._restore_extra(state)
        tree._check_nodes()
        return tree

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).__checkpoint_restore__, (self.__checkpoint_state__(),))

    _STATE_KEYS: tuple[str, ...] = ("capacity", "reducer", "init_value", "nodes")
    # the reducer and unit of the subclasses, whose states do not name them
    _FIXED: tuple[Callable, float] | None = None

    @classmethod
    def _restore_reducer(cls, state: dict[str, Any]) -> tuple[Callable, float]:
        if cls._FIXED is not None:
            return cls._FIXED
        reducer, init_value = state["reducer"], state["init_value"]
        if isinstance(reducer, str):
            ufunc = vars(np).get(reducer)  # not getattr: that would import submodules
            if not (isinstance(ufunc, np.ufunc) and ufunc.nin == 2 and ufunc.nout == 1):
                raise ValueError(
                    f"{cls.__name__} state: reducer {reducer!r} is not a NumPy ufunc of two "
                    "arguments"
                )
            reducer = ufunc
        elif not callable(reducer):
            raise TypeError(f"{cls.__name__} state: reducer must be a str, got {reducer!r}")
        if isinstance(init_value, bool) or not isinstance(init_value, (int, float)):
            raise TypeError(f"{cls.__name__} state: init_value must be a float, got {init_value!r}")
        return reducer, float(init_value)

    def _restore_extra(self, state: dict[str, Any]) -> None:
        """Restore what a subclass adds to the state (nothing here)."""

    def _check_nodes(self) -> None:
        """Check the heap of a restored tree: size, values, padding and every parent."""
        arr, n_leaves, name = self._arr, self._num_leaves, type(self).__name__
        if arr.shape != (2 * n_leaves,):
            raise ValueError(
                f"{name} state: nodes must have shape ({2 * n_leaves},) for capacity "
                f"{self.capacity}, got {arr.shape}"
            )
        values = arr[n_leaves : n_leaves + self.capacity]
        bad = np.isnan(values)
        if self._nonneg_finite:
            bad |= ~np.isfinite(values) | (values < 0)
        if bad.any():
            raise ValueError(f"{name} state: {self._value_error(values, int(np.argmax(bad)))}")
        unused = np.concatenate([arr[:1], arr[n_leaves + self.capacity :]])
        if not np.array_equal(unused, np.full_like(unused, self.init_value), equal_nan=True):
            raise ValueError(f"{name} state: unused nodes must hold init_value {self.init_value}")
        with np.errstate(over="ignore", invalid="ignore"):
            parents = np.asarray(self._ufunc(arr[2 : 2 * n_leaves : 2], arr[3 : 2 * n_leaves : 2]))
        wrong = parents != arr[1:n_leaves]
        if wrong.any():
            k = int(np.argmax(wrong)) + 1
            raise ValueError(
                f"{name} state: node {k} holds {arr[k]}, not the reduction {parents[k - 1]} of "
                "its children"
            )
        if self._nonneg_finite and not np.isfinite(arr[1]):
            raise ValueError(f"{name} state: the total of the values is not finite")

    # -- properties and lookups --------------------------------------------------------------

    @property
    def height(self) -> int:
        r"""The height of the tree, :math:`h = \lceil\log_2(\text{capacity})\rceil + 1`."""
        return self._height

    @property
    def root_value(self) -> float:
        """The reduction over all values, ``functools.reduce(reducer, values, init_value)``."""
        return self._arr[1]

    @property
    def values(self) -> np.ndarray:
        """The values stored at the leaves, shape ``(capacity,)`` (a read-only view)."""
        return self[self._height - 1]

    def __len__(self) -> int:
        return self.capacity

    def __getitem__(self, lookup: Any) -> Any:
        """``tree[level]``: the nodes of one level (read-only view); ``tree[level, index]``."""
        if isinstance(lookup, tuple) and len(lookup) == 1:
            (lookup,) = lookup
        if isinstance(lookup, tuple) and len(lookup) == 2:
            level, index = lookup
            return self[level][index]
        if not is_int(lookup):
            raise IndexError(
                "tree lookup must be tree[level] or tree[level, index] with an int level, "
                f"got {lookup!r}"
            )
        level = int(lookup)
        if not -self._height <= level < self._height:
            raise IndexError(f"level {level} is out of range for a tree of height {self._height}")
        level %= self._height
        # nodes of this level that cover at least one real value
        size = ((self.capacity - 1) >> (self._height - 1 - level)) + 1
        view = self._arr[(1 << level) : (1 << level) + size]
        view.flags.writeable = False
        return view

    def __repr__(self) -> str:
        levels = "".join(f"\n  level={lvl} : {self[lvl]!r}" for lvl in range(self._height))
        return f"{type(self).__name__}({levels})"

    # -- updates -----------------------------------------------------------------------------

    def _check_idx_values(self, idx: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
        """Turn (idx, values) into a fresh int64 index array and a float64 value array."""
        if not isinstance(idx, np.ndarray) and not is_int(idx) and hasattr(idx, "__array__"):
            idx = np.asarray(idx)  # e.g. a jax.Array
        if idx is None or idx is Ellipsis:
            idx = np.arange(self.capacity, dtype=np.int64)
        elif is_int(idx) or (isinstance(idx, list) and all(is_int(i) for i in idx)):
            ints = [int(i) for i in np.atleast_1d(np.asarray(idx, dtype=object))]
            for p, i in enumerate(ints):  # Python ints of any size: check before converting
                if not -self.capacity <= i < self.capacity:
                    raise self._index_error(ints, p)
            idx = np.array(ints, dtype=np.int64)
        elif isinstance(idx, np.ndarray) and idx.ndim <= 1 and np.issubdtype(idx.dtype, np.integer):
            idx = idx.reshape(-1)
            if idx.dtype.kind == "u":
                # compare in the array's own dtype: uint64 2**64 - 1 must not wrap to -1 (the
                # writers range-check the signed indices they are given)
                bad = idx >= self.capacity
                if bad.any():
                    raise self._index_error(idx, int(np.argmax(bad)))
            idx = idx.astype(np.int64)  # always a copy: kernels normalize in place
        else:
            raise IndexError(
                f"idx must be an int, a list of ints, a 1-d integer array, ... or None; got {idx!r}"
            )
        values = _numeric_array(values, "values")
        if values.ndim == 0:
            values = np.full(idx.shape, values, dtype=np.float64)
        elif values.shape != idx.shape:
            raise ValueError(
                f"values must be a scalar or have shape {idx.shape} to match idx, "
                f"got shape {values.shape}"
            )
        return idx, values

    def _value_error(self, values: np.ndarray, position: int) -> ValueError:
        v = values[position]
        what = "finite, non-negative" if self._nonneg_finite else "non-NaN"
        return ValueError(f"values must be {what} numbers; got values[{position}] = {v}")

    def _index_error(self, idx: Any, position: int) -> IndexError:
        return IndexError(
            f"idx[{position}] = {idx[position]} is out of range for capacity {self.capacity}"
        )

    def set_values(self, idx: Any, values: Any) -> None:
        r"""Set or update values.

        Invalid input raises before anything is written, so a rejected call leaves the tree
        unchanged. With duplicate indices the last write wins.

        Parameters
        ----------
        idx : int, list of ints, 1-d int array, ``...`` or None
            Indices of the values to set, in ``[-capacity, capacity)`` (negative indices
            count from the end). ``...`` or None selects all values.
        values : float or 1-d array of floats
            The new values: a scalar (for every index) or one per index.

        Raises
        ------
        IndexError
            If ``idx`` has a wrong type or an entry is out of range.
        TypeError
            If ``values`` are not numbers (e.g. strings).
        ValueError
            If the number of values does not match ``idx``, or a value is NaN (for
            :class:`SumTree` also negative or infinite, or the total would overflow to
            infinity).
        """
        idx, values = self._check_idx_values(idx, values)
        if self._op >= 0:
            kernels = _kernels()
            code, pos = kernels.set_values(
                self._arr,
                self._num_leaves,
                self.capacity,
                self._op,
                self._nonneg_finite,
                idx,
                values,
            )
            if code == kernels.BAD_INDEX:
                raise self._index_error(idx, pos)
            if code == kernels.BAD_VALUE:
                raise self._value_error(values, pos)
            if code == kernels.BAD_TOTAL:
                raise self._total_error()
            return
        self._set_values_numpy(idx, values)

    def _total_error(self) -> ValueError:
        return ValueError(
            f"the values would make the total of the {type(self).__name__} overflow to "
            "infinity; nothing was written"
        )

    def _set_values_numpy(self, idx: np.ndarray, values: np.ndarray) -> None:
        bad = (idx < -self.capacity) | (idx >= self.capacity)
        if bad.any():
            raise self._index_error(idx, int(np.argmax(bad)))
        bad = np.isnan(values)
        if self._nonneg_finite:
            bad |= ~np.isfinite(values) | (values < 0)
        if bad.any():
            raise self._value_error(values, int(np.argmax(bad)))
        idx = idx % self.capacity
        # last write wins: keep the last occurrence of every index
        uniq, first_in_reversed = np.unique(idx[::-1], return_index=True)
        old = self._arr[self._num_leaves + uniq]
        self._write_leaves(uniq, values[::-1][first_in_reversed])
        if self._nonneg_finite and not np.isfinite(self._arr[1]):
            # undone exactly: every parent is recomputed from the restored children
            self._write_leaves(uniq, old)
            raise self._total_error()

    def _write_leaves(self, uniq: np.ndarray, values: np.ndarray) -> None:
        self._arr[self._num_leaves + uniq] = values
        nodes = uniq + self._num_leaves
        with np.errstate(over="ignore"):  # an overflowing total is checked (and undone) after
            for _ in range(self._height - 1):
                nodes = np.unique(nodes >> 1)
                self._arr[nodes] = self._ufunc(self._arr[2 * nodes], self._arr[2 * nodes + 1])

    # -- reductions --------------------------------------------------------------------------

    def partial_reduce(self, start: Any = 0, stop: Any = None) -> Any:
        r"""Reduce values over ranges: ``functools.reduce(reducer, values[start:stop],
        init_value)``, batched and in :math:`\mathcal{O}(\log N)` per range.

        Parameters
        ----------
        start : int or 1-d array of ints, optional
            Lower bounds (inclusive); negative values count from the end.
        stop : int or 1-d array of ints, optional
            Upper bounds (exclusive); negative values count from the end. Defaults to
            ``capacity``.

        Returns
        -------
        float or 1-d array of floats
            A float if both ``start`` and ``stop`` are ints, else one result per range.

        Raises
        ------
        TypeError
            If ``start`` or ``stop`` is not an int or a 1-d integer array.
        ValueError
            If ``start`` and ``stop`` are arrays of different shapes.
        IndexError
            If a range is empty, reversed or out of bounds.
        """
        scalar = np.ndim(start) == 0 and (stop is None or np.ndim(stop) == 0)
        start_arr = self._check_bound("start", start)
        stop_arr = (
            np.full_like(start_arr, self.capacity)
            if stop is None
            else self._check_bound("stop", stop)
        )
        if start_arr.shape != stop_arr.shape:
            if start_arr.size == 1:
                start_arr = np.full_like(stop_arr, start_arr[0])
            elif stop_arr.size == 1:
                stop_arr = np.full_like(start_arr, stop_arr[0])
            else:
                raise ValueError(
                    f"start and stop must have equal shapes, got {start_arr.shape} and "
                    f"{stop_arr.shape}"
                )
        cap = self.capacity
        lo = np.where(start_arr < 0, start_arr + cap, start_arr)
        hi = np.where(stop_arr < 0, stop_arr + cap, stop_arr)
        bad = (lo < 0) | (hi > cap) | (lo >= hi)
        if bad.any():
            p = int(np.argmax(bad))
            raise IndexError(
                f"range [{start_arr[p]}:{stop_arr[p]}] is empty, reversed or out of bounds "
                f"for capacity {cap}"
            )
        if self._op >= 0:
            out = np.empty(lo.shape, np.float64)
            _kernels().partial_reduce(
                self._arr, self._num_leaves, self._op, self.init_value, lo, hi, out
            )
        else:
            out = self._partial_reduce_numpy(lo, hi)
        return out[0] if scalar else out

    def _check_bound(self, name: str, x: Any) -> np.ndarray:
        if is_int(x) or (isinstance(x, list) and all(is_int(i) for i in x)):
            ints = [int(i) for i in (x if isinstance(x, list) else [x])]
            for i in ints:  # Python ints of any size: check before converting to int64
                if not -self.capacity <= i <= self.capacity:
                    raise IndexError(f"{name} = {i} is out of bounds for capacity {self.capacity}")
            return np.array(ints, dtype=np.int64)
        if not isinstance(x, np.ndarray) and hasattr(x, "__array__"):  # e.g. a jax.Array
            x = np.asarray(x)
            if x.ndim == 0 and np.issubdtype(x.dtype, np.integer):
                x = x.reshape(1)
        if isinstance(x, np.ndarray) and x.ndim == 1 and np.issubdtype(x.dtype, np.integer):
            # compare unsigned bounds in their own dtype: uint64 2**64 - 1 must not wrap to -1
            if x.dtype.kind == "u" and (x > self.capacity).any():
                p = int(np.argmax(x > self.capacity))
                raise IndexError(
                    f"{name}[{p}] = {x[p]} is out of bounds for capacity {self.capacity}"
                )
            return x.astype(np.int64)
        raise TypeError(f"{name} must be an int or a 1-d integer array, got {x!r}")

    def _partial_reduce_numpy(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        arr = self._arr
        lo = lo + self._num_leaves
        hi = hi + self._num_leaves
        acc = np.full(lo.shape, self.init_value)
        for _ in range(self._height):
            take = (lo < hi) & (lo % 2 == 1)
            acc = np.where(take, self._ufunc(acc, arr.take(lo, mode="clip")), acc)
            lo = lo + take
            take = (lo < hi) & (hi % 2 == 1)
            hi = hi - take
            acc = np.where(take, self._ufunc(acc, arr.take(hi, mode="clip")), acc)
            lo, hi = lo >> 1, hi >> 1
        return acc


class SumTree(SegmentTree):
    r"""A sum tree: batched updates and batched sampling proportional to the values.

    Updates and sampling take :math:`\mathcal{O}(\log N)` time per entry and the memory
    footprint is :math:`\mathcal{O}(N)`, with :math:`N` the capacity (any capacity works).
    Values must be finite and non-negative; anything else raises ``ValueError`` before the
    tree is touched. Parents are recomputed from their children on every update, so
    :attr:`root_value` stays equal to ``values.sum()`` (up to float64 rounding) over any
    number of updates.

    Parameters
    ----------
    capacity : int
        Number of values to accommodate, ``>= 1``.
    random_seed : int, optional
        Seed of the random number generator used by :meth:`sample` (settable later through
        the :attr:`random_seed` attribute). A bool raises ``TypeError`` (NumPy would take
        ``True`` as seed 1).

    Examples
    --------
    >>> import numpy as np
    >>> tree = SumTree(capacity=6, random_seed=13)
    >>> tree.set_values(..., [1.0, 0.0, 3.0, 0.0, 0.0, 4.0])
    >>> print(tree.root_value)
    8.0
    >>> tree.inverse_cdf(np.array([0.0, 0.124, 0.125, 0.5, 1.0])).tolist()
    [0, 0, 2, 5, 5]
    >>> idx = tree.sample(1000)
    >>> sorted(set(idx.tolist()))
    [0, 2, 5]
    >>> tree.set_values(idx, 1.0)  # a prioritized-replay step: sample, then update
    """

    def __init__(self, capacity: int, random_seed: int | None = None):
        super().__init__(capacity=capacity, reducer=np.add, init_value=0.0)
        self.random_seed = random_seed

    def _setup(self, capacity: int, reducer: Callable, init_value: float, arr: Any) -> None:
        super()._setup(capacity, reducer, init_value, arr)
        self._nonneg_finite = True

    # the checkpoint state also holds the sampling Generator ``rng`` and ``random_seed`` (an
    # int or None; other seed objects are recorded as None)
    _STATE_KEYS = ("capacity", "nodes", "rng", "random_seed")
    _FIXED = (np.add, 0.0)

    def _restore_extra(self, state: dict[str, Any]) -> None:
        rng, seed = state["rng"], state["random_seed"]
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"SumTree state: rng must be a numpy Generator, got {rng!r}")
        self._rng, self._random_seed = rng, check_seed(seed, "SumTree state: random_seed")

    @property
    def random_seed(self) -> int | None:
        """The seed of the sampling RNG; setting it restarts the random stream."""
        return self._random_seed

    @random_seed.setter
    def random_seed(self, new_random_seed: int | None) -> None:
        if isinstance(new_random_seed, (bool, np.bool_)):  # a flag passed by mistake
            raise TypeError(f"random_seed must be an int or None, got {new_random_seed!r}")
        self._rng = np.random.default_rng(new_random_seed)
        self._random_seed = new_random_seed

    def sample(self, n: int) -> np.ndarray:
        r"""Sample indices with probabilities proportional to the values.

        Parameters
        ----------
        n : int
            The number of samples, ``>= 1``.

        Returns
        -------
        ndarray of int64, shape ``(n,)``
            The sampled indices; never one whose value is zero.

        Raises
        ------
        TypeError
            If ``n`` is not an int.
        ValueError
            If ``n < 1`` or all values are zero.
        """
        if not is_int(n):
            raise TypeError(f"n must be an int, got {n!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not self._arr[1] > 0:
            raise ValueError("cannot sample from a SumTree whose values are all zero")
        return self._descend(self._rng.random(n))

    def inverse_cdf(self, u: Any) -> Any:
        r"""Inverse CDF of the categorical distribution :math:`p_i = v_i / \sum_j v_j`.

        Returns the index :math:`i` with
        :math:`\sum_{j<i} v_j \le u \sum_j v_j < \sum_{j\le i} v_j`. Unlike a plain descent it
        never returns a zero-valued or padded slot, not even for :math:`u = 1` or under
        rounding: it only enters subtrees with a positive sum. This is the machinery of
        :meth:`sample`.

        Parameters
        ----------
        u : float or array of floats
            Numbers :math:`u\in[0, 1]`, typically drawn from :math:`\text{Unif}([0, 1])`.

        Returns
        -------
        int or ndarray of int64
            An int for a scalar ``u``, else an array of the shape of ``u``.

        Raises
        ------
        TypeError
            If ``u`` is not numeric (e.g. a string).
        ValueError
            If an entry of ``u`` lies outside :math:`[0, 1]` (or is NaN), or all values are
            zero.
        """
        u_arr = _numeric_array(u, "u")
        if not np.all((u_arr >= 0) & (u_arr <= 1)):
            raise ValueError(f"all entries of u must lie in [0, 1], got {u!r}")
        if not self._arr[1] > 0:
            raise ValueError("inverse_cdf needs a positive total, but all values are zero")
        out = self._descend(u_arr.reshape(-1)).reshape(u_arr.shape)
        return int(out) if u_arr.ndim == 0 else out

    def _descend(self, u: np.ndarray) -> np.ndarray:
        out = np.empty(u.shape[0], np.int64)
        _kernels().inverse_cdf(self._arr, self._num_leaves, u, out)
        return out


class MinTree(SegmentTree):
    r"""A min tree: a :class:`SegmentTree` whose reducer is :data:`numpy.minimum`.

    Values start at :math:`+\infty`; NaN values raise ``ValueError``.

    Parameters
    ----------
    capacity : int
        Number of values to accommodate, ``>= 1``.

    Examples
    --------
    >>> tree = MinTree(4)
    >>> tree.set_values([0, 2], [3.0, -1.0])
    >>> print(tree.root_value, tree.partial_reduce(0, 2), tree.partial_reduce(3, 4))
    -1.0 3.0 inf
    """

    def __init__(self, capacity: int):
        super().__init__(capacity=capacity, reducer=np.minimum, init_value=float("inf"))

    _STATE_KEYS = ("capacity", "nodes")
    _FIXED = (np.minimum, float("inf"))


class MaxTree(SegmentTree):
    r"""A max tree: a :class:`SegmentTree` whose reducer is :data:`numpy.maximum`.

    Values start at :math:`-\infty`; NaN values raise ``ValueError``.

    Parameters
    ----------
    capacity : int
        Number of values to accommodate, ``>= 1``.

    Examples
    --------
    >>> tree = MaxTree(4)
    >>> tree.set_values([0, 2], [3.0, -1.0])
    >>> print(tree.root_value, tree.partial_reduce(1, 4), tree.partial_reduce(3, 4))
    3.0 -1.0 -inf
    """

    def __init__(self, capacity: int):
        super().__init__(capacity=capacity, reducer=np.maximum, init_value=-float("inf"))

    _STATE_KEYS = ("capacity", "nodes")
    _FIXED = (np.maximum, -float("inf"))
