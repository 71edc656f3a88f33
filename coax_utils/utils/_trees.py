"""Pytree helpers: batching, stacking, raveling, unvectorizing, param sync and diagnostics."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import is_int

__all__ = [
    "batch_to_single",
    "get_grads_diagnostics",
    "get_magnitude_quantiles",
    "single_to_batch",
    "stack_trees",
    "sync_shared_params",
    "tree_ravel",
    "unstack_trees",
    "unvectorize",
]


def _path_str(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _leaf_columns(trees: Sequence[Any], context: str, item: str) -> tuple[Any, list[list[Any]]]:
    """Line up the leaves of trees of one structure and one set of leaf shapes.

    Returns the common treedef and, for each leaf position, the list of that leaf across the
    trees. Errors start with ``context`` and call the trees ``f"{item} {i}"``.
    """
    leaves0, treedef = jax.tree_util.tree_flatten_with_path(trees[0])
    flat = [[leaf for _, leaf in leaves0]]
    for i, tree in enumerate(trees[1:], start=1):
        leaves, other = jax.tree_util.tree_flatten(tree)
        if other != treedef:
            raise ValueError(
                f"{context}: {item} {i} has structure {other}, expected the structure of "
                f"{item} 0: {treedef}"
            )
        flat.append(leaves)
    columns = []
    for j, (path, _) in enumerate(leaves0):
        column = [leaves[j] for leaves in flat]
        if len({np.shape(x) for x in column}) > 1:
            raise ValueError(
                f"{context}: leaf {_path_str(path)} has different shapes across the inputs: "
                f"{[np.shape(x) for x in column]}"
            )
        columns.append(column)
    return treedef, columns


def batch_to_single(pytree: Any, index: int = 0) -> Any:
    r"""Extract a single instance from a pytree of array batches: ``leaf[index]`` on every leaf.

    Jittable; ``index`` may be a traced integer. When ``index`` is a Python int it is checked
    against the batch size of every leaf (JAX would silently clamp an out-of-range index).
    ``index`` must be one integer: a bool, ``None``, a slice, a tuple or an index array is
    refused (``True`` would index as a new axis and return the whole batch, the others a
    sub-batch, not a single instance).

    Parameters
    ----------
    pytree : pytree with ndarray leaves
        A pytree representing a batch (every leaf has a leading batch axis).
    index : int, optional
        Which instance to extract: a Python or NumPy int or a 0-d integer array (traced ones
        included). Default: 0.

    Returns
    -------
    pytree_single : pytree with ndarray leaves
        The same structure, each leaf without its leading axis.

    Raises
    ------
    TypeError
        If ``index`` is not one integer (see above).
    ValueError
        If a leaf is 0-d (has no batch axis).
    IndexError
        If a Python-int ``index`` is out of range for a leaf.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> batch = {"s": jnp.arange(6).reshape(3, 2), "r": jnp.array([0.5, 1.0, 1.5])}
    >>> batch_to_single(batch, 1)
    {'r': Array(1., dtype=float32), 's': Array([2, 3], dtype=int32)}
    """
    int_array = np.ndim(index) == 0 and jnp.issubdtype(getattr(index, "dtype", bool), jnp.integer)
    if not (is_int(index) or int_array):
        raise TypeError(f"index must be one int or a 0-d integer array, got {index!r}")

    def take(path, leaf):
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise ValueError(f"leaf {_path_str(path)} is 0-d; expected a leading batch axis")
        if not isinstance(index, (int, np.integer)):
            return jnp.asarray(leaf)[index]  # a traced or array index: index with JAX
        if not -shape[0] <= index < shape[0]:
            raise IndexError(
                f"index {index} is out of range for leaf {_path_str(path)} with batch size "
                f"{shape[0]}"
            )
        return leaf[index]

    return jax.tree_util.tree_map_with_path(take, pytree)


def single_to_batch(pytree: Any) -> Any:
    r"""Turn a single instance into a batch of size 1: ``jnp.expand_dims(leaf, 0)`` on every leaf.

    The inverse of ``batch_to_single(batch, 0)`` for batches of size 1. Jittable.

    Parameters
    ----------
    pytree : pytree with ndarray leaves
        A pytree representing e.g. a single state observation.

    Returns
    -------
    pytree_batch : pytree with jax.Array leaves
        A pytree representing a batch with ``batch_size=1``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> single_to_batch((jnp.zeros(3), 1.0))[0].shape
    (1, 3)
    """
    return jax.tree_util.tree_map(lambda leaf: jnp.expand_dims(leaf, axis=0), pytree)


def stack_trees(*trees: Any) -> Any:
    r"""Apply :func:`jnp.stack <jax.numpy.stack>` to the leaves of several pytrees.

    The trees must share one structure and matching leaf shapes; leaf ``i`` of the result is
    ``jnp.stack([tree[i] for tree in trees])``, with the new axis first. This is how parameters
    of several models are prepared for a :func:`jax.vmap` over models. :func:`unstack_trees`
    is the inverse. Jittable.

    Note that coax's implementation transposed its arguments first (it expected one sequence
    per model part, e.g. ``stack_trees(params_list, state_list)``); the equivalent call here is
    ``stack_trees(*zip(params_list, state_list))``, which returns the tuple
    ``(stacked_params, stacked_state)``.

    Parameters
    ----------
    *trees : pytrees with ndarray leaves
        One or more pytrees with the same structure.

    Returns
    -------
    pytree : pytree with jax.Array leaves
        A pytree of the common structure whose leaves have a new leading axis of size
        ``len(trees)``.

    Raises
    ------
    ValueError
        If no trees are given, the structures differ, or leaf shapes differ.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> stacked = stack_trees({"w": jnp.zeros(2)}, {"w": jnp.ones(2)})
    >>> stacked["w"].shape
    (2, 2)
    """
    if not trees:
        raise ValueError("stack_trees needs at least one pytree")
    treedef, columns = _leaf_columns(trees, "stack_trees", "tree")
    stacked = [jnp.stack(column) for column in columns]
    return jax.tree_util.tree_unflatten(treedef, stacked)


def unstack_trees(pytree: Any) -> tuple[Any, ...]:
    r"""Split a pytree along the leading axis of its leaves: the inverse of :func:`stack_trees`.

    ``stack_trees(*unstack_trees(t))`` equals ``t`` and ``unstack_trees(stack_trees(*ts))``
    equals ``ts`` (with leaves as JAX arrays). Jittable.

    Parameters
    ----------
    pytree : pytree with ndarray leaves
        Every leaf has the same leading axis size ``n``.

    Returns
    -------
    trees : tuple of n pytrees
        ``trees[i]`` holds ``leaf[i]`` for every leaf.

    Raises
    ------
    ValueError
        If the pytree has no leaves, a leaf is 0-d, or the leading axis sizes differ.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> a, b = unstack_trees({"w": jnp.array([[1, 2], [3, 4]])})
    >>> b
    {'w': Array([3, 4], dtype=int32)}
    """
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(pytree)
    if not leaves_with_path:
        raise ValueError("unstack_trees needs a pytree with at least one leaf")
    sizes = []
    for path, leaf in leaves_with_path:
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise ValueError(f"leaf {_path_str(path)} is 0-d; expected a leading axis to unstack")
        sizes.append(shape[0])
    if len(set(sizes)) > 1:
        detail = {_path_str(p): s for (p, _), s in zip(leaves_with_path, sizes)}
        raise ValueError(f"unstack_trees: leading axis sizes differ across leaves: {detail}")
    leaves = [jnp.asarray(leaf) for _, leaf in leaves_with_path]
    return tuple(
        jax.tree_util.tree_unflatten(treedef, [leaf[i] for leaf in leaves]) for i in range(sizes[0])
    )


def tree_ravel(pytree: Any) -> jax.Array:
    r"""Flatten and concatenate all leaves into a single 1-d array.

    Leaves are raveled in C order and concatenated in pytree-leaf order (the order of
    :func:`jax.tree_util.tree_leaves`); mixed dtypes are promoted as by
    :func:`jax.numpy.concatenate`. A pytree without leaves gives an empty float array.
    Jittable.

    Parameters
    ----------
    pytree : a pytree with ndarray leaves
        Typically model parameters or gradients.

    Returns
    -------
    arr : jax.Array with ndim=1
        A single flat array of size ``sum(leaf.size for leaf in leaves)``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> tree_ravel({"a": jnp.array([[1.0, 2.0]]), "b": jnp.array(3.0)})
    Array([1., 2., 3.], dtype=float32)
    """
    leaves = jax.tree_util.tree_leaves(pytree)
    if not leaves:
        return jnp.zeros((0,), dtype=jnp.result_type(float))
    # every leaf cast once, straight to the common dtype: a NumPy int64 leaf taken to int32
    # first (JAX's default) would wrap before becoming float
    dtype = jnp.result_type(*leaves)
    return jnp.concatenate([jnp.ravel(jnp.asarray(leaf, dtype)) for leaf in leaves])


def _check_axes(axes: Any, name: str) -> None:
    def ok(a: Any) -> bool:
        return a is None or (isinstance(a, (int, np.integer)) and not isinstance(a, bool))

    if ok(axes):
        return
    if isinstance(axes, (tuple, list)) and all(ok(a) for a in axes):
        return
    raise TypeError(f"{name} must be None, an int, or a tuple of ints/None; got {name}={axes!r}")


def unvectorize(f: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0) -> Callable[..., Any]:
    r"""Apply a batched function to a single instance: the inverse of what :func:`jax.vmap` does.

    Every positional input gets a batch axis of size 1 inserted at its ``in_axes`` entry
    (``None``: passed unchanged), ``f`` is called, and the batch axis is squeezed out of the
    outputs at ``out_axes`` (``None``: returned unchanged). Keyword arguments are passed
    through unchanged. Pytree inputs and outputs are handled leaf by leaf.

    Parameters
    ----------
    f : callable
        A batched function.
    in_axes : int, None or tuple of ints/None, optional
        Batch axes of the positional inputs of ``f``; an int or ``None`` applies to all inputs.
        Default: 0.
    out_axes : int, None or tuple of ints/None, optional
        Batch axes to drop from the outputs. If ``f`` returns a tuple, an int or ``None``
        applies to every element and a tuple must have one entry per element; otherwise it
        must be an int or ``None``. Default: 0.

    Returns
    -------
    f_single : callable
        The unvectorized version of ``f``.

    Raises
    ------
    TypeError
        Immediately, if ``in_axes``/``out_axes`` are not ints, ``None`` or tuples of those; at
        call time, if ``f`` returns a single output and ``out_axes`` is a tuple.
    ValueError
        At call time, if the number of ``in_axes`` does not match the number of positional
        inputs, or the number of ``out_axes`` does not match the number of outputs.

    Examples
    --------
    Haiku modules are batch-oriented; :func:`unvectorize` makes them act on one instance:

    >>> import jax, jax.numpy as jnp, haiku as hk
    >>> def f(x_batch):
    ...     return hk.Linear(11)(x_batch)
    >>> init, f_batch = hk.transform(f)
    >>> params = init(jax.random.PRNGKey(1), jnp.zeros((3, 5)))
    >>> f_single = unvectorize(f_batch, in_axes=(None, None, 0), out_axes=0)
    >>> f_single(params, None, jnp.zeros(5)).shape
    (11,)

    Or unvectorize before the transform:

    >>> init, f_single = hk.transform(unvectorize(f))
    >>> params = init(jax.random.PRNGKey(1), jnp.zeros(5))
    >>> f_single(params, None, jnp.zeros(5)).shape
    (11,)
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    _check_axes(in_axes, "in_axes")
    _check_axes(out_axes, "out_axes")

    def expand(x: Any, axis: int | None) -> Any:
        if axis is None:
            return x
        return jax.tree_util.tree_map(functools.partial(jnp.expand_dims, axis=axis), x)

    def squeeze(x: Any, axis: int | None) -> Any:
        if axis is None:
            return x
        return jax.tree_util.tree_map(functools.partial(jnp.squeeze, axis=axis), x)

    @functools.wraps(f)
    def f_single(*args: Any, **kwargs: Any) -> Any:
        in_axes_ = (in_axes,) * len(args) if not isinstance(in_axes, (tuple, list)) else in_axes
        if len(args) != len(in_axes_):
            raise ValueError(
                "number of in_axes must match the number of function inputs; got "
                f"in_axes={in_axes!r} for {len(args)} positional input(s)"
            )
        out = f(*(expand(x, a) for x, a in zip(args, in_axes_)), **kwargs)
        if isinstance(out, tuple):
            out_axes_ = out_axes
            if not isinstance(out_axes_, (tuple, list)):
                out_axes_ = (out_axes_,) * len(out)
            if len(out) != len(out_axes_):
                raise ValueError(
                    "number of out_axes must match the number of function outputs; got "
                    f"out_axes={out_axes!r} for {len(out)} output(s)"
                )
            return tuple(squeeze(x, a) for x, a in zip(out, out_axes_))
        if isinstance(out_axes, (tuple, list)):
            raise TypeError(
                f"out_axes must be an int for functions with a single output; got: "
                f"out_axes={out_axes!r}"
            )
        return squeeze(out, out_axes)

    return f_single


def sync_shared_params(
    *params: Mapping[str, Any], weights: Sequence[float] | None = None
) -> tuple[dict[str, Any], ...]:
    r"""Synchronize the modules that several Haiku param dicts share by averaging them.

    A module (top-level key of :class:`haiku.Params`) that appears in *all* given param dicts is
    replaced everywhere by the weighted average

    .. math::

        \bar\theta_\text{module} = \frac{\sum_i w_i\,\theta^{(i)}_\text{module}}{\sum_i w_i}

    Modules missing from at least one dict are left untouched (the very same arrays are
    returned). Typical use: an actor and a critic that share a torso module, each updated by
    its own optimizer, are brought back in sync after every update. Jittable (``weights`` must
    be concrete numbers).

    Parameters
    ----------
    *params : hk.Params
        Two or more param dicts (``{module_name: {param_name: array}}``). With fewer than two,
        they are returned unchanged.
    weights : sequence of non-negative floats, optional
        Relative weights of the dicts (one per dict, positive sum). Default: equal weights.

    Returns
    -------
    params : tuple of dict
        New param dicts (plain dicts, same order) with synchronized shared modules. Every
        param keeps the dtype it had in its own dict (e.g. a bfloat16 actor and a float32
        critic): the average is computed in the promoted dtype and cast back per dict.

    Raises
    ------
    TypeError
        If an argument is not a mapping.
    ValueError
        If ``weights`` has the wrong length, contains negative or non-finite numbers, or sums
        to zero; or if a shared module has different param names or shapes in different dicts.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> p1 = {"torso": {"w": jnp.array([0.0, 2.0])}, "pi": {"w": jnp.ones(1)}}
    >>> p2 = {"torso": {"w": jnp.array([4.0, 2.0])}, "v": {"w": jnp.zeros(1)}}
    >>> q1, q2 = sync_shared_params(p1, p2, weights=[3, 1])
    >>> q1["torso"]["w"], q2["torso"]["w"]
    (Array([1., 2.], dtype=float32), Array([1., 2.], dtype=float32))
    >>> q1["pi"] is p1["pi"] and q2["v"] is p2["v"]  # not shared: untouched
    True
    """
    for i, p in enumerate(params):
        if not isinstance(p, Mapping):
            raise TypeError(f"params[{i}] must be a mapping (hk.Params), got {type(p).__name__}")
    if weights is None:
        weights = [1.0] * len(params)
    else:
        weights = [float(w) for w in weights]
        if len(weights) != len(params):
            raise ValueError(
                f"len(weights) = {len(weights)} does not match the number of param dicts "
                f"provided, which is {len(params)}"
            )
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"weights must be finite, non-negative and have a positive sum; got {weights}"
            )
    if len(params) < 2:
        return tuple(params)

    total = sum(weights)
    rel = [w / total for w in weights]
    shared = [k for k in params[0] if all(k in p for p in params[1:])]

    averaged = {}  # module name -> (treedef, averaged leaves in the promoted dtype)
    for k in shared:
        modules = [p[k] for p in params]
        treedef, columns = _leaf_columns(modules, f"shared module {k!r}", "params")
        averaged[k] = treedef, [sum(w * jnp.asarray(x) for w, x in zip(rel, c)) for c in columns]

    def synced(k: str, module: Any) -> Any:
        treedef, leaves = averaged[k]
        own = jax.tree_util.tree_leaves(module)  # each dict keeps the dtypes of its params
        return jax.tree_util.tree_unflatten(
            treedef, [a.astype(jnp.result_type(x)) for a, x in zip(leaves, own)]
        )

    return tuple({k: synced(k, v) if k in averaged else v for k, v in p.items()} for p in params)


_QUANTILE_NAMES = ("min", "p25", "p50", "p75", "max")


def get_magnitude_quantiles(pytree: Any, key_prefix: str = "") -> dict[str, jax.Array]:
    r"""Quantiles of the magnitudes of all components of a pytree.

    The leaves are raveled and concatenated (:func:`tree_ravel`), the element-wise absolute
    values taken, and the 0, 25, 50, 75 and 100 percent quantiles computed on that one flat
    array. A high-level diagnostic for params or gradients. Jittable.

    Parameters
    ----------
    pytree : a pytree with ndarray leaves
        Typically model params or gradients with respect to them; at least one element.
    key_prefix : str, optional
        A prefix for the keys of the output dict.

    Returns
    -------
    magnitude_quantiles : dict
        Keys ``key_prefix + k`` for ``k`` in ``['min', 'p25', 'p50', 'p75', 'max']``; values
        are non-negative scalar arrays.

    Raises
    ------
    ValueError
        If the pytree has no elements.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> q = get_magnitude_quantiles({"a": jnp.array([-4.0, 1.0]), "b": jnp.array([2.0])}, "w/")
    >>> {k: float(v) for k, v in q.items()}
    {'w/min': 1.0, 'w/p25': 1.5, 'w/p50': 2.0, 'w/p75': 3.0, 'w/max': 4.0}
    """
    flat = tree_ravel(pytree)
    if flat.size == 0:
        raise ValueError("get_magnitude_quantiles needs a pytree with at least one element")
    if not jnp.issubdtype(flat.dtype, jnp.inexact):  # complex magnitudes come from abs
        flat = flat.astype(jnp.result_type(float))
    flat = jnp.abs(flat)  # after the cast: abs of int8 -128 (int32 -2**31) is itself
    values = jnp.quantile(flat, jnp.array([0.0, 0.25, 0.5, 0.75, 1.0], dtype=flat.dtype))
    return {f"{key_prefix}{name}": values[i] for i, name in enumerate(_QUANTILE_NAMES)}


def _grads_summary(arr: jax.Array, key_prefix: str) -> dict[str, jax.Array]:
    out = get_magnitude_quantiles(arr, key_prefix)
    dtype = out[f"{key_prefix}max"].dtype
    # summed in float32 at least: the squares of float16 grads overflow from a norm of 256 up
    wide = jnp.promote_types(dtype, jnp.float32)
    flat = jnp.ravel(arr)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):  # a cast to real drops the imag part
        flat = jnp.abs(flat)
    out[f"{key_prefix}norm"] = jnp.linalg.norm(flat.astype(wide)).astype(dtype)
    return out


def get_grads_diagnostics(
    grads: Any, key_prefix: str = "", keep_tree_structure: bool = False
) -> Any:
    r"""Diagnostics of a pytree of gradients: magnitude quantiles and the global norm.

    As in :func:`get_magnitude_quantiles`, the leaves are flattened and concatenated and the
    quantiles of the element-wise magnitudes computed on the flat array; the L2 norm of that
    array is added under ``'norm'`` (summed in float32 at least, so half-float gradients do
    not overflow, and returned in the dtype of the quantiles). Jittable.

    Parameters
    ----------
    grads : a pytree with ndarray leaves
        Gradients of some loss with respect to model parameters.
    key_prefix : str, optional
        A prefix for the keys of the output dict(s).
    keep_tree_structure : bool, optional
        If ``True``, compute the diagnostics for each leaf separately and return a pytree of
        the structure of ``grads`` whose leaves are these dicts. If ``False`` (default), one
        dict for all leaves together.

    Returns
    -------
    grads_diagnostics : dict<str, scalar array>, or a pytree of such dicts
        Keys ``key_prefix + k`` for ``k`` in ``['min', 'p25', 'p50', 'p75', 'max', 'norm']``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> d = get_grads_diagnostics({"w": jnp.array([3.0, -4.0])}, key_prefix="g/")
    >>> float(d["g/norm"]), float(d["g/max"])
    (5.0, 4.0)
    """
    if keep_tree_structure:
        return jax.tree_util.tree_map(lambda g: _grads_summary(jnp.asarray(g), key_prefix), grads)
    return _grads_summary(tree_ravel(grads), key_prefix)
