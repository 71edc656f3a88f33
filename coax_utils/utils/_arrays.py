"""Array helpers: random tie-breaking argmax/argmin, index arrays, checks, small transforms."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_float, check_int, is_int

__all__ = [
    "argmax",
    "argmin",
    "check_array",
    "clipped_logit",
    "diff_transform",
    "diff_transform_matrix",
    "double_relu",
    "idx",
    "isscalar",
]


def as_host_or_jax(x: Any) -> Any:
    """``x`` as an array: a JAX array (a tracer included) stays one, an array-like that holds
    JAX arrays (a list of traced values under :func:`jax.jit`) becomes one, and anything else
    becomes a NumPy array in its own dtype (64-bit values stay exact when JAX runs in 32 bits).
    """
    if isinstance(x, jax.Array):
        return x
    if any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(x)):
        return jnp.asarray(x)
    return np.asarray(x)


def _normalize_axis(axis: Any, ndim: int, name: str = "axis") -> int:
    if not is_int(axis):
        raise TypeError(f"{name} must be an int or None, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise np.exceptions.AxisError(f"{name}={axis} is out of bounds for an array of ndim {ndim}")
    return int(axis) % ndim


def _candidates(xp: Any, arr: Any, axis: int, find_max: bool) -> Any:
    # Positions equal to the extreme value (NaN counts as the extreme, as in jnp.argmax/argmin),
    # with xp = numpy or jax.numpy: NumPy input is compared in its own dtype, so 64-bit values
    # are not rounded to JAX's 32-bit default dtypes first (which would invent ties).
    reduce = xp.max if find_max else xp.min
    extreme = reduce(arr, axis=axis, keepdims=True)
    if xp.issubdtype(arr.dtype, xp.inexact):
        return xp.where(xp.isnan(extreme), xp.isnan(arr), arr == extreme)
    return arr == extreme


@partial(jax.jit, static_argnames=("axis",))
def _pick_candidate(rng, candidates, axis):
    # Every candidate gets an i.i.d. uniform score and every other position scores -1, so the
    # arg-max of the scores is uniform among the candidates.
    scores = jnp.where(candidates, jax.random.uniform(rng, candidates.shape), -1.0)
    return jnp.argmax(scores, axis=axis)


@partial(jax.jit, static_argnames=("axis", "find_max"))
def _random_tie_break(rng, arr, axis, find_max):
    return _pick_candidate(rng, _candidates(jnp, arr, axis, find_max), axis)


def _tie_break(rng, arr, axis, find_max):
    arr = as_host_or_jax(arr)
    if not (arr.dtype == bool or jnp.issubdtype(arr.dtype, jnp.number)):
        raise TypeError(f"arr must hold numbers or booleans, got dtype {arr.dtype}")
    # NumPy's own dtypes are compared by NumPy; JAX arrays and NumPy arrays of the ml_dtypes
    # types (bfloat16, ...; JAX holds them exactly, NumPy's issubdtype does not know them) by JAX
    xp = np if isinstance(arr, np.ndarray) and arr.dtype.kind in "biufc" else jnp
    arr = xp.asarray(arr)
    if axis is None:
        arr = xp.ravel(arr)
        axis = 0
    else:
        axis = _normalize_axis(axis, arr.ndim)
    if arr.shape[axis] == 0:
        raise ValueError(f"cannot take the arg-extremum along an empty axis; shape={arr.shape}")
    if xp is np:
        return _pick_candidate(rng, _candidates(np, arr, axis, find_max), axis=axis)
    return _random_tie_break(rng, arr, axis=axis, find_max=find_max)


def argmax(rng: jax.Array, arr: Any, axis: int | None = -1) -> jax.Array:
    r"""Index of the maximum along an axis, breaking ties uniformly at random.

    :func:`numpy.argmax` and :func:`jax.numpy.argmax` always return the first of several tied
    maxima, which biases greedy policies towards low action indices. This version draws one of
    the tied positions uniformly at random (independently for every slice along ``axis``).
    Without ties it returns exactly what :func:`jax.numpy.argmax` returns. NaN counts as the
    maximum, as in :func:`jax.numpy.argmax`. NumPy input is compared in its own dtype, so
    ``int64``, ``uint64`` and ``float64`` values are exact even when JAX runs in 32 bits.

    Works eagerly, under :func:`jax.jit` and under :func:`jax.vmap` (``axis`` must be static).

    Parameters
    ----------
    rng : jax.Array
        A pseudo-random number generator key (``jax.random.PRNGKey`` or ``jax.random.key``).
    arr : array_like
        Input array, of any rank >= 1.
    axis : int or None, optional
        The axis along which to search; ``None`` searches the flattened array. Default: -1.

    Returns
    -------
    index_array : jax.Array of ints
        Indices into ``arr`` along ``axis``; the shape of ``arr`` with ``axis`` removed.

    Raises
    ------
    TypeError
        If ``arr`` does not hold numbers or booleans.
    numpy.exceptions.AxisError
        If ``axis`` is out of bounds (an ``IndexError`` and a ``ValueError``).
    ValueError
        If the axis is empty.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.array([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    >>> argmax(jax.random.PRNGKey(0), x)
    Array([1, 2], dtype=int32)
    >>> i = argmax(jax.random.PRNGKey(0), jnp.array([7, 7, 1, 7]))
    >>> int(i) in (0, 1, 3)
    True
    """
    return _tie_break(rng, arr, axis, find_max=True)


def argmin(rng: jax.Array, arr: Any, axis: int | None = -1) -> jax.Array:
    r"""Index of the minimum along an axis, breaking ties uniformly at random.

    The counterpart of :func:`argmax`: among positions tied for the minimum, one is drawn
    uniformly at random (independently for every slice along ``axis``). Without ties it returns
    exactly what :func:`jax.numpy.argmin` returns; NaN counts as the minimum. Works eagerly,
    under :func:`jax.jit` and under :func:`jax.vmap` (``axis`` must be static). Unlike negating
    the input, this is exact for unsigned and boolean dtypes, and NumPy input is compared in its
    own dtype (exact for 64-bit values when JAX runs in 32 bits).

    Parameters
    ----------
    rng : jax.Array
        A pseudo-random number generator key.
    arr : array_like
        Input array, of any rank >= 1.
    axis : int or None, optional
        The axis along which to search; ``None`` searches the flattened array. Default: -1.

    Returns
    -------
    index_array : jax.Array of ints
        Indices into ``arr`` along ``axis``; the shape of ``arr`` with ``axis`` removed.

    Raises
    ------
    TypeError
        If ``arr`` does not hold numbers or booleans.
    numpy.exceptions.AxisError
        If ``axis`` is out of bounds.
    ValueError
        If the axis is empty.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> argmin(jax.random.PRNGKey(0), jnp.array([[4, 2, 9], [1, 8, 3]]), axis=0)
    Array([1, 0, 1], dtype=int32)
    """
    return _tie_break(rng, arr, axis, find_max=False)


def idx(arr: Any, axis: int = 0) -> jax.Array:
    r"""Return the integer index array ``[0, 1, ..., arr.shape[axis] - 1]``.

    Accepts NumPy and JAX arrays (tracers included, so it works under :func:`jax.jit`).

    Parameters
    ----------
    arr : array
        Input array, with ``ndim >= 1``.
    axis : int, optional
        The axis along which to index. Default: 0.

    Returns
    -------
    index : jax.Array, shape ``(arr.shape[axis],)``
        An index array ``[0, 1, 2, ...]``.

    Raises
    ------
    TypeError
        If ``arr`` is not an array or is 0-d.
    numpy.exceptions.AxisError
        If ``axis`` is out of bounds.

    Examples
    --------
    >>> import numpy as np
    >>> idx(np.zeros((2, 3)), axis=1)
    Array([0, 1, 2], dtype=int32)
    """
    check_array(arr, ndim_min=1, except_np=True)
    axis = _normalize_axis(axis, arr.ndim)
    return jnp.arange(arr.shape[axis])


def isscalar(num: Any) -> bool:
    r"""Whether ``num`` is a scalar, counting single-item arrays as scalars.

    A looser definition than :func:`numpy.isscalar`: Python and NumPy numbers are scalars, and
    so is any NumPy or JAX array with exactly one element (whatever its shape, e.g. ``(1, 1)``).
    Shapes are static, so this also answers for tracers inside :func:`jax.jit`.

    Parameters
    ----------
    num : number or ndarray
        Input value.

    Returns
    -------
    isscalar : bool
        Whether the input is either a number or a single-item array.

    Examples
    --------
    >>> import numpy as np
    >>> isscalar(3.0), isscalar(np.array([[1]])), isscalar(np.zeros(2)), isscalar("a")
    (True, True, False, False)
    """
    if isinstance(num, (np.ndarray, jax.Array)):
        return int(np.prod(num.shape)) == 1
    return bool(np.isscalar(num)) and not isinstance(num, (str, bytes))


def _as_collection(value: Any) -> Sequence[Any]:
    return list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]


def check_array(
    arr: Any,
    ndim: int | Sequence[int] | None = None,
    ndim_min: int | None = None,
    ndim_max: int | None = None,
    dtype: Any = None,
    shape: Sequence[int] | None = None,
    axis_size: int | Sequence[int] | None = None,
    axis: int | None = None,
    except_np: bool = False,
) -> None:
    r"""Check common properties of an array and raise ``TypeError`` if one does not hold.

    Every check is skipped when its argument is ``None``. Tracers are JAX arrays, so this works
    under :func:`jax.jit` (all properties checked are static).

    Parameters
    ----------
    arr : jax.Array or numpy.ndarray
        The array to check.
    ndim : int or collection of ints, optional
        Allowed number(s) of dimensions.
    ndim_min, ndim_max : int, optional
        Lower and upper bounds (inclusive) on the number of dimensions.
    dtype : dtype or collection of dtypes, optional
        Allowed dtype(s). Abstract NumPy types work too (``np.floating`` accepts every float).
    shape : tuple of ints, optional
        The exact expected shape.
    axis_size : int or collection of ints, optional
        Allowed size(s) of axis ``axis`` (both must be given for this check).
    axis : int, optional
        The axis whose size is checked against ``axis_size``.
    except_np : bool, optional
        If ``False`` (default) only JAX arrays pass; if ``True`` NumPy arrays pass as well.

    Raises
    ------
    TypeError
        If one of the checks fails.
    IndexError
        If ``axis`` is out of bounds for ``arr``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> check_array(jnp.zeros((2, 3)), ndim=2, dtype=jnp.float32, axis_size=3, axis=1)
    >>> check_array(jnp.zeros(3), ndim_min=2)
    Traceback (most recent call last):
    ...
    TypeError: expected input with ndim at least 2, got ndim: 1
    """
    if not except_np and not isinstance(arr, jax.Array):
        raise TypeError(f"expected input to be a jax.Array, got type: {type(arr).__name__}")
    if not isinstance(arr, (np.ndarray, jax.Array)):
        raise TypeError(f"expected input to be an ndarray, got type: {type(arr).__name__}")
    if ndim is not None and arr.ndim not in _as_collection(ndim):
        raise TypeError(f"expected input with ndim(s) {ndim}, got ndim: {arr.ndim}")
    if ndim_min is not None and arr.ndim < ndim_min:
        raise TypeError(f"expected input with ndim at least {ndim_min}, got ndim: {arr.ndim}")
    if ndim_max is not None and arr.ndim > ndim_max:
        raise TypeError(f"expected input with ndim at most {ndim_max}, got ndim: {arr.ndim}")
    if dtype is not None and not any(jnp.issubdtype(arr.dtype, d) for d in _as_collection(dtype)):
        raise TypeError(f"expected input with dtype(s) {dtype}, got dtype: {arr.dtype}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise TypeError(f"expected input with shape {tuple(shape)}, got shape: {arr.shape}")
    if axis_size is not None and axis is not None:
        if not -arr.ndim <= axis < arr.ndim:
            raise IndexError(f"axis={axis} is out of bounds for input with shape {arr.shape}")
        if arr.shape[axis] not in _as_collection(axis_size):
            raise TypeError(
                f"expected input with size(s) {axis_size} along axis {axis}, got shape: {arr.shape}"
            )


def clipped_logit(x: Any, epsilon: float = 1e-15) -> jax.Array:
    r"""A safe logit :math:`x\mapsto\log(x/(1-x))` that never evaluates :math:`\log 0`.

    The arguments of both logarithms are clipped from below:

    .. math::

        \text{logit}_\epsilon(x)\ =\ \log(\max(\epsilon, x)) - \log(\max(\epsilon, 1 - x))

    Parameters
    ----------
    x : array_like
        Input whose entries lie on the unit interval, :math:`x_i\in [0, 1]`.
    epsilon : float, optional
        The small number with which to clip the arguments of the logarithms from below, in
        :math:`(0, 0.5]`. Where it is below the smallest normal number of ``x``'s dtype (e.g.
        the default ``1e-15`` in ``float16``) that number is used instead, so the result stays
        finite.

    Raises
    ------
    TypeError
        If ``epsilon`` is not a real number.
    ValueError
        If ``epsilon`` is not a finite number in :math:`(0, 0.5]`.

    Returns
    -------
    z : jax.Array, floating dtype, same shape as ``x``
        Logits on the real line, :math:`z_i\in\mathbb{R}` (finite for every ``x`` in [0, 1]).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> clipped_logit(jnp.array([0.5]))
    Array([0.], dtype=float32)
    >>> bool(jnp.isfinite(clipped_logit(jnp.array([0.0, 1.0]))).all())
    True
    """
    epsilon = check_float(epsilon, "epsilon", low=0.0, high=0.5, low_open=True)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    # an epsilon below the dtype's smallest normal number would round to 0 (float16: 1e-15)
    epsilon = max(epsilon, float(jnp.finfo(x.dtype).tiny))
    return jnp.log(jnp.clip(x, epsilon, 1)) - jnp.log(jnp.clip(1 - x, epsilon, 1))


def double_relu(arr: Any) -> jax.Array:
    r"""A double ReLU: the concatenation of ``-relu(-arr)`` and ``relu(arr)`` along the last axis.

    No signal is lost between layers: every input component is passed on, and half of the
    output components are zero, so the doubling of the width does not double the activation.

    Parameters
    ----------
    arr : array_like
        The input array, e.g. activations.

    Returns
    -------
    doubled_arr : jax.Array
        Shape ``arr.shape[:-1] + (2 * arr.shape[-1],)``, the dtype of ``arr`` (exact for every
        dtype: the negative half of an unsigned array is zero).

    Raises
    ------
    ValueError
        If ``arr`` is 0-d.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> x = jnp.array([[-11, -8], [17, 5], [-13, 7], [19, -3]])
    >>> double_relu(x)
    Array([[-11,  -8,   0,   0],
           [  0,   0,  17,   5],
           [-13,   0,   0,   7],
           [  0,  -3,  19,   0]], dtype=int32)
    """
    arr = jnp.asarray(arr)
    if arr.ndim < 1:
        raise ValueError(f"arr must have at least one axis, got shape {arr.shape}")
    # no -relu(-arr): negation wraps for unsigned ints and for int8 -128. As relu, NaN stays
    # NaN and the gradient at 0 is 0 (jnp.minimum/maximum would give 0.5 to each half)
    zero = jnp.zeros((), arr.dtype)
    return jnp.concatenate((jnp.where(arr >= 0, zero, arr), jnp.where(arr <= 0, zero, arr)), -1)


def diff_transform_matrix(num_frames: int, dtype: Any = "float32") -> jax.Array:
    r"""The matrix that turns stacked frames into discrete derivatives.

    For a feature vector :math:`X` of four stacked frames (shape ``[batch, height, width, 4]``)
    the matrix for ``num_frames=4`` is

    .. math::

        M_\text{diff}^{(4)}\ =\ \begin{pmatrix}
            -1 &  0 &  0 & 0 \\
             3 &  1 &  0 & 0 \\
            -3 & -2 & -1 & 0 \\
             1 &  1 &  1 & 1
        \end{pmatrix}

    and the transformed features are :math:`X_\text{diff} = X\,M_\text{diff}^{(4)}`. In general
    :math:`M_{ab} = (-1)^{n-1-a}\binom{n-1-b}{n-1-a}`, so column :math:`b` of
    :math:`X_\text{diff}` is the :math:`(n-1-b)`-th backward difference at the latest frame:
    the last column is the position :math:`x`, the one before it the velocity
    :math:`\dot{x}`, then the acceleration :math:`\ddot{x}`, etc. (in reverse order).

    Parameters
    ----------
    num_frames : positive int
        The number of stacked frames :math:`n` (in chronological order along the last axis).
    dtype : dtype, optional
        The output data type. Default: ``'float32'``.

    Returns
    -------
    M : jax.Array, shape ``(num_frames, num_frames)``
        The matrix to multiply from the right: ``X_diff = X @ M``.

    Raises
    ------
    TypeError
        If ``num_frames`` is not an int.
    ValueError
        If ``num_frames < 1``, or if ``dtype`` cannot hold the entries (an unsigned or boolean
        dtype, an int too narrow, a float that overflows).

    Examples
    --------
    >>> diff_transform_matrix(3, dtype="int32")
    Array([[ 1,  0,  0],
           [-2, -1,  0],
           [ 1,  1,  1]], dtype=int32)
    """
    n = check_int(num_frames, "num_frames", low=1)
    entries = [
        [(-1) ** (n - 1 - a) * math.comb(n - 1 - b, n - 1 - a) for b in range(n)]
        for a in range(n)
    ]
    target = jnp.zeros((), jnp.dtype(dtype)).dtype  # as JAX stores it (int64 -> int32 in x32)
    lo, hi = min(map(min, entries)), max(map(max, entries))
    # the entries are signed binomial coefficients: refuse a dtype that cannot hold them (an
    # unsigned, boolean or too narrow int would wrap, a narrow float would overflow to inf)
    if jnp.issubdtype(target, jnp.inexact):
        fits = max(-lo, hi) <= float(jnp.finfo(target).max)
    elif jnp.issubdtype(target, jnp.integer):
        fits = int(jnp.iinfo(target).min) <= lo and hi <= int(jnp.iinfo(target).max)
    else:
        fits = target == np.dtype(bool) and lo >= 0 and hi <= 1
    if not fits:
        raise ValueError(
            f"dtype {target} cannot hold the entries of the {n}x{n} difference matrix (they "
            f"range from {lo} to {hi})"
        )
    return jnp.asarray(np.array(entries, dtype=target))


def diff_transform(X: Any, dtype: Any = "float32") -> jax.Array:
    r"""Discrete differentiation of stacked frames: ``X @ diff_transform_matrix(X.shape[-1])``.

    See :func:`diff_transform_matrix` for the details. Jittable.

    Parameters
    ----------
    X : array_like
        An array whose last axis is the frame-stack axis, ``X.shape[-1] == num_frames``, frames
        in chronological order.
    dtype : dtype, optional
        The dtype of the transform matrix and of the result. Default: ``'float32'``.

    Returns
    -------
    X_transformed : jax.Array
        Same shape as ``X``; the last axis holds (in reverse order) position, velocity,
        acceleration, etc.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> diff_transform(jnp.array([1.0, 4.0, 9.0]))  # x_t = t**2 at t = 1, 2, 3
    Array([2., 5., 9.], dtype=float32)
    """
    X = as_host_or_jax(X)  # cast once, below: int64 -> int32 -> float would wrap large values
    if X.ndim < 1:
        raise ValueError(f"X must have a frame-stack axis (ndim >= 1), got shape {X.shape}")
    M = diff_transform_matrix(num_frames=X.shape[-1], dtype=dtype)
    return jnp.dot(jnp.asarray(X, dtype=M.dtype), M)
