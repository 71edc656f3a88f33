"""The :class:`TransitionBatch` pytree: a batch of (possibly n-step) transitions."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_finite_number, check_flag
from coax_utils._dataclass import pytree_dataclass

__all__ = ["TransitionBatch"]

_INT64 = np.iinfo(np.int64)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@pytree_dataclass
class TransitionBatch:
    r"""A batch of transitions, with coax's field names.

    A single transition (one row) is :math:`(S_t, A_t, \log\pi(A_t|S_t), R^{(n)}_t,
    I^{(n)}_t, S_{t+n}, A_{t+n}, \log\pi(A_{t+n}|S_{t+n}))`, where the n-step return and
    bootstrap factor are

    .. math::

        R^{(n)}_t\ =\ \sum_{k=0}^{n-1}\gamma^kR_{t+k}\,, \qquad
        I^{(n)}_t\ =\ \left\{\begin{matrix}
            0           & \text{if } S_{t+n} \text{ is terminal} \\
            \gamma^n    & \text{otherwise}
        \end{matrix}\right.

    so that a bootstrapped target reads :math:`G^{(n)}_t = R^{(n)}_t + I^{(n)}_t\,
    v(S_{t+n})`.

    Every field is a pytree of arrays with a leading batch axis (or None). The class is a
    frozen dataclass registered as a pytree, so :mod:`jax.tree_util`, :func:`jax.jit` and
    :func:`jax.vmap` work on it; use :meth:`replace` to change fields.

    Parameters
    ----------
    S : pytree of arrays
        The states :math:`S_t`.
    A : pytree of arrays
        The actions :math:`A_t`.
    logP : array
        The log-propensities :math:`\log\pi(A_t|S_t)`.
    Rn : array
        The n-step discounted returns :math:`R^{(n)}_t`.
    In : array
        The bootstrap factors :math:`I^{(n)}_t` (0 after termination).
    S_next : pytree of arrays
        The next states :math:`S_{t+n}`.
    A_next : pytree of arrays, optional
        The next actions :math:`A_{t+n}` (for SARSA-style targets).
    logP_next : array, optional
        The next log-propensities.
    W : array, optional
        Sample weights, e.g. importance weights from prioritized replay.
    idx : array, optional
        Indices into the replay buffer the rows were sampled from.
    extra_info : dict, optional
        Extra per-row information (e.g. the raw rewards and dones of an n-step trace).
    """

    S: Any
    A: Any
    logP: Any
    Rn: Any
    In: Any
    S_next: Any
    A_next: Any = None
    logP_next: Any = None
    W: Any = None
    idx: Any = None
    extra_info: Any = None

    @property
    def batch_size(self) -> int:
        """The number of transitions in the batch (the length of the leading axis).

        Raises ValueError, naming the field, if a leaf of any field has another leading axis
        than ``Rn`` (its rows would not line up); :func:`len`, indexing, :meth:`to_singles`
        and :meth:`concatenate` check this too.
        """
        return self._check_rows()

    def _check_rows(self, leaves: list | None = None) -> int:
        """The batch size, after checking that every leaf (``leaves``: those of ``self``,
        if already flattened) has that leading axis."""
        shape = getattr(self.Rn, "shape", ())
        if len(shape) == 0:
            raise ValueError(
                f"Rn must be an array with a leading batch axis, got {self.Rn!r:.80} (inside "
                f"jax.vmap over the batch, each row has none)"
            )
        n = int(shape[0])
        if leaves is None:
            leaves = jax.tree_util.tree_leaves(self)
        if all(getattr(x, "shape", ())[:1] == (n,) for x in leaves):
            return n
        for path, x in jax.tree_util.tree_leaves_with_path(self):  # name the first bad one
            if np.shape(x)[:1] != (n,):
                raise ValueError(
                    f"every field of a TransitionBatch needs the leading batch axis of Rn "
                    f"({n} rows); {jax.tree_util.keystr(path)} has shape {np.shape(x)}"
                )
        return n

    def __len__(self) -> int:
        return self.batch_size

    def copy(self, deep: bool = False) -> TransitionBatch:
        """Create a copy of the batch, as coax's ``copy``.

        Parameters
        ----------
        deep : bool, optional
            Whether to copy the arrays too. A shallow copy (the default) is a new batch whose
            fields refer to the same arrays.

        Returns
        -------
        TransitionBatch
            The copy.
        """
        return copy.deepcopy(self) if deep else copy.copy(self)

    def __eq__(self, other: object) -> bool:
        """Field-by-field comparison with :func:`numpy.allclose`, for any batch size.

        Two batches are equal when they are of the same type and structure (the same fields
        set, the same containers) and every pair of arrays has the same shape and is
        :func:`numpy.allclose` (NaNs are unequal, as in coax). Pairs of integer or bool
        arrays (ids, discrete actions) are compared exactly: a relative tolerance would
        take ``idx`` 1000000 and 1000001 for equal.
        """
        if type(self) is not type(other):
            return NotImplemented
        leaves, treedef = jax.tree_util.tree_flatten(self)
        other_leaves, other_treedef = jax.tree_util.tree_flatten(other)
        if treedef != other_treedef:
            return False
        for a, b in zip(leaves, other_leaves):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape:
                return False
            kinds = a.dtype.kind + b.dtype.kind
            if set(kinds) <= set("biufc") and set(kinds) & set("fc"):
                if not np.allclose(a, b):
                    return False
            elif not np.array_equal(a, b):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable arrays: not hashable

    @classmethod
    def from_single(
        cls,
        s: Any,
        a: Any,
        logp: float,
        r: float,
        done: bool,
        gamma: float,
        s_next: Any = None,
        a_next: Any = None,
        logp_next: float | None = None,
        w: float = 1.0,
        idx: int | None = None,
        extra_info: Any = None,
    ) -> TransitionBatch:
        """Build a batch of size 1 from a single 1-step transition.

        Parameters
        ----------
        s, a : state and action
        logp : float
            Log-propensity of ``a``.
        r : float
            The reward.
        done : bool
            Whether ``s_next`` is terminal (then ``In = 0``, else ``In = gamma``).
        gamma : float
            The discount factor.
        s_next, a_next, logp_next : optional
            The next state, action and log-propensity. ``s_next`` defaults to ``s``.
        w : float
            The sample weight.
        idx : int, optional
            A buffer index.
        extra_info : dict, optional
            Extra information, stored with a batch axis added.

        Every array is copied: the batch shares no memory with the arguments, so an
        observation array that is later updated in place does not change it.

        ``logp``, ``r``, ``gamma``, ``w`` and ``logp_next`` must each be one real number
        (a Python, NumPy or JAX scalar or a 0-d array) that is finite as the float32 it is
        stored as, ``done`` a bool (or a number that is 0 or 1) and ``idx`` an int.

        Raises
        ------
        TypeError
            If one of them is of another type (a string, a float ``idx``).
        ValueError
            If one of them is an array of another shape (e.g. already with a batch axis,
            which would make a field of shape ``(1, 1)``), is not finite, or ``gamma`` lies
            outside ``[0, 1]``.
        """

        def number(x: Any, name: str) -> Any:
            if x is None:
                return None
            check_finite_number(x, name)
            v = float(x)
            if abs(v) > _FLOAT32_MAX:  # rounds to the largest float32 or overflows
                with np.errstate(over="ignore"):
                    if not np.isfinite(np.float32(v)):
                        raise ValueError(f"{name} must be finite as a float32, got {x!r}")
            return np.float32(v)

        values = {name: number(x, name) for name, x in (("logp", logp), ("r", r), ("w", w))}
        logp_next = number(logp_next, "logp_next")
        gamma = number(gamma, "gamma")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must lie in [0, 1], got {gamma!r}")
        done = check_flag(done, "done")
        if idx is not None:
            i = np.asarray(idx)
            if i.ndim != 0:
                raise ValueError(f"idx must be a single int, got an array of shape {i.shape}")
            if i.dtype.kind not in "iu" or not _INT64.min <= int(i) <= _INT64.max:
                raise TypeError(f"idx must be an int that fits int64, got {idx!r:.80}")
            idx = np.asarray(i, np.int64)

        def batch(x: Any, dtype: Any = None) -> Any:
            if x is None:
                return None
            return jax.tree_util.tree_map(lambda v: np.expand_dims(np.array(v, dtype), 0), x)

        return cls(
            S=batch(s),
            A=batch(a),
            logP=batch(values["logp"]),
            Rn=batch(values["r"]),
            In=batch(0.0 if done else gamma, np.float32),
            S_next=batch(s if s_next is None else s_next),
            A_next=batch(a_next),
            logP_next=batch(logp_next),
            W=batch(values["w"]),
            idx=batch(idx),
            extra_info=batch(extra_info),
        )

    def to_singles(self) -> Iterator[TransitionBatch]:
        """Split the batch into batches of size 1 (a generator)."""
        for i in range(self.batch_size):
            yield jax.tree_util.tree_map(lambda x, i=i: x[i : i + 1], self)

    def __getitem__(self, index: Any) -> TransitionBatch:
        """Select rows with an int, a slice, or a one-dimensional index array or row mask.

        An int (a Python or NumPy int, or a 0-d integer array, JAX's included) selects one
        row and keeps the batch axis; it must lie in ``[-batch_size, batch_size)``, else
        IndexError. A traced index (inside :func:`jax.jit` or :func:`jax.vmap`) selects the
        same rows as an eager one, with JAX's indexing rules: it cannot be range-checked, and
        an out-of-range one is clamped. Booleans, None and tuples raise TypeError (they would
        not select rows); an index array of more than one dimension raises IndexError.
        """
        if index is None or isinstance(index, (bool, np.bool_, tuple)):
            raise TypeError(
                f"a TransitionBatch index selects rows: an int, a slice or a 1-d index array "
                f"or row mask, got {index!r:.80}"
            )
        n = self.batch_size
        if isinstance(index, jax.core.Tracer):
            if np.ndim(index) > 1:
                raise IndexError(f"the index array must be one-dimensional, got {index.shape}")
            rows = jnp.reshape(index, (1,)) if np.ndim(index) == 0 else index
            return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[rows], self)
        if not isinstance(index, slice) and index is not Ellipsis:
            index = np.asarray(index)
            if index.ndim > 1:
                raise IndexError(f"the index array must be one-dimensional, got {index.shape}")
            if index.ndim == 0:
                if index.dtype.kind not in "iu":
                    raise TypeError(f"a TransitionBatch index must be an int, got {index!r:.80}")
                i = int(index)
                if not -n <= i < n:
                    raise IndexError(f"index {i} is out of range for a batch of size {n}")
                index = slice(i % n, i % n + 1)
        return jax.tree_util.tree_map(lambda x: x[index], self)

    @classmethod
    def concatenate(cls, *batches: TransitionBatch) -> TransitionBatch:
        """Concatenate batches along the batch axis.

        The batches must have the same structure (the same fields set, the same containers)
        and, leaf by leaf, the same per-row shape (else ValueError naming the field). Leaves
        of different dtypes are promoted as :func:`numpy.concatenate` does, unless that
        changes a value (TypeError naming the field): ``uint64`` with ``int64``, or large
        ``int64`` values with floats, would become ``float64`` and be rounded. Under
        :func:`jax.jit` (traced leaves) the values are unknown, so the dtypes must be equal.
        """
        if not batches:
            raise ValueError("concatenate needs at least one TransitionBatch")
        for b in batches:
            if not isinstance(b, TransitionBatch):
                raise TypeError(
                    f"concatenate takes TransitionBatch objects, got {type(b).__name__}"
                )
        flat = [jax.tree_util.tree_flatten(b) for b in batches]
        for b, (leaves, _) in zip(batches, flat):
            b._check_rows(leaves)
        structures = {treedef for _, treedef in flat}
        if len(structures) != 1:
            k = next(k for k, (_, treedef) in enumerate(flat) if treedef != flat[0][1])
            for f in dataclasses.fields(cls):
                x, y = getattr(batches[0], f.name), getattr(batches[k], f.name)
                sx, sy = (jax.tree_util.tree_structure(v) for v in (x, y))
                if sx != sy:
                    raise ValueError(
                        f"cannot concatenate TransitionBatch objects whose fields differ in "
                        f"structure: {f.name} is {'None' if x is None else sx} in batch 0 and "
                        f"{'None' if y is None else sy} in batch {k}"
                    )
            raise ValueError(f"cannot concatenate a {type(batches[k]).__name__} (batch {k})")
        if len(batches) == 1:
            return batches[0]
        columns = list(zip(*(leaves for leaves, _ in flat)))
        traced = any(isinstance(x, jax.core.Tracer) for xs in columns for x in xs)

        def field(i: int) -> str:  # the name of leaf i, for errors
            return jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(batches[0])[i][0])

        def join(i: int, xs: tuple) -> Any:
            if traced:
                dtypes = [np.dtype(x.dtype) for x in xs]
                if len(set(dtypes)) > 1:
                    raise TypeError(f"cannot concatenate traced {field(i)} of dtypes {dtypes}")
                shapes = sorted({np.shape(x)[1:] for x in xs})
                if len(shapes) > 1:
                    raise ValueError(f"cannot concatenate {field(i)} with per-row shapes {shapes}")
                return jnp.concatenate(xs, axis=0)
            xs = [np.asarray(x) for x in xs]
            try:
                out = np.concatenate(xs, axis=0)
            except ValueError:
                shapes = sorted({x.shape[1:] for x in xs})
                what = f"{field(i)} with per-row shapes {shapes}"
                raise ValueError(f"cannot concatenate {what}") from None
            for x in xs:
                if x.dtype == out.dtype:
                    continue
                with np.errstate(invalid="ignore", over="ignore"):
                    back = x.astype(out.dtype).astype(x.dtype)
                if not np.array_equal(back, x, equal_nan=x.dtype.kind in "fc"):
                    kinds = sorted({str(x.dtype) for x in xs})
                    raise TypeError(
                        f"cannot concatenate {field(i)}: the dtypes {kinds} promote to "
                        f"{out.dtype}, which changes values; cast them to one dtype first"
                    )
            return out

        return structures.pop().unflatten([join(i, xs) for i, xs in enumerate(columns)])

    def __repr__(self) -> str:
        def describe(x: Any) -> str:
            if x is None:
                return "None"
            return repr(jax.tree_util.tree_map(describe_leaf, x))

        def describe_leaf(v: Any) -> str:
            if hasattr(v, "dtype") and hasattr(v, "shape"):
                return f"{np.dtype(v.dtype)}{list(v.shape)}"
            return type(v).__name__  # e.g. a Python number left by a tree_map

        parts = ", ".join(
            f"{f.name}={describe(getattr(self, f.name))}" for f in dataclasses.fields(self)
        )
        return f"TransitionBatch({parts})"
