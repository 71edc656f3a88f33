r"""A pure functional sum tree: a state pytree and jittable ``init/set/reduce/sample``.

The tree is a 1-indexed binary heap stored in one flat array ``nodes`` of length ``2 * L``,
where ``L`` is the smallest power of two ``>= capacity``. Node ``1`` is the root, node ``k``
has children ``2k`` and ``2k + 1`` and the leaves (the values) sit at ``L, ..., L + capacity -
1``. Leaves past ``capacity`` are padding and stay zero; ``nodes[0]`` is unused.

Parents are always recomputed from their children (never updated by adding deltas), so the
root equals the sum of the leaves up to the rounding of one pairwise summation, however many
updates were made.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import (
    check_choice,
    check_int,
    check_pairs_up,
    checked_indices,
    is_int,
)
from coax_utils._dataclass import pytree_dataclass, static_field
from coax_utils._random import random_uniform
from coax_utils.utils._arrays import as_host_or_jax

__all__ = [
    "SUM_TREE_STRATEGIES",
    "SumTreeState",
    "sum_tree_init",
    "sum_tree_inverse_cdf",
    "sum_tree_reduce",
    "sum_tree_sample",
    "sum_tree_set",
    "sum_tree_total",
    "sum_tree_values",
]


#: The write strategies of :func:`sum_tree_set` (see there).
SUM_TREE_STRATEGIES = ("auto", "sequential", "vectorized")

# trees this large read their levels near the root from their first _TOP_BYTES (see
# sum_tree_inverse_cdf): XLA's CPU backend reads arrays of _SPLIT_BYTES or more on two threads
_SPLIT_BYTES = 512 << 10
_TOP_BYTES = 128 << 10


@pytree_dataclass
class SumTreeState:
    r"""State of a functional sum tree (a pytree; make one with :func:`sum_tree_init`).

    Attributes
    ----------
    nodes : Array
        Flat 1-indexed heap of shape ``(2 * num_leaves,)``: ``nodes[1]`` is the total,
        ``nodes[num_leaves + i]`` is value ``i``. ``nodes[0]`` and padded leaves are zero.
    capacity : int
        Number of values (static metadata, a Python int).
    """

    nodes: jax.Array
    capacity: int = static_field()

    @property
    def num_leaves(self) -> int:
        """Number of leaves of the heap: the smallest power of two ``>= capacity``."""
        return self.nodes.shape[-1] // 2

    @property
    def height(self) -> int:
        """Number of levels below the root (``log2(num_leaves)``)."""
        return self.num_leaves.bit_length() - 1

    @property
    def max_value(self) -> float:
        """The largest value a leaf may hold (``finfo(dtype).max / (2 * num_leaves)``), so
        that no partial sum overflows; :func:`sum_tree_set` clips larger values to it."""
        return float(jnp.finfo(self.nodes.dtype).max) / (2 * self.num_leaves)

    def __checkpoint_check__(self) -> None:
        r"""Raise ValueError unless this state (e.g. one restored from a checkpoint) is a
        consistent tree.

        Checked, on a host copy of ``nodes`` (with any leading batch axes of a
        :func:`jax.vmap` of trees), vectorised: ``capacity`` is an int ``>= 1`` and
        ``nodes`` a floating point array of ``2 * num_leaves`` nodes; every node is finite
        and ``>= 0``; ``nodes[0]`` and the padded leaves are zero; every value is at most
        :attr:`max_value`; every parent equals the sum of its two children within
        :math:`\varepsilon` of the dtype times the total (plus the smallest normal number,
        for hardware that flushes subnormal sums to zero), and no parent is positive above
        two zero children (sampling would then reach a zero-valued or empty slot). A tree
        whose node 2 says 0 while node 3 carries the total is refused; honest trees are
        exact (every parent is recomputed from its children).
        """
        _check_tree(self.nodes, self.capacity)


def _num_leaves(capacity: int) -> int:
    return 1 << (capacity - 1).bit_length()


def _check_tree(nodes: Any, capacity: Any) -> None:
    """The checks of :meth:`SumTreeState.__checkpoint_check__` (ValueError)."""
    if not is_int(capacity) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    if not isinstance(nodes, (np.ndarray, jax.Array)):
        raise ValueError(f"nodes must be an array, got {type(nodes).__name__}")
    if not jnp.issubdtype(nodes.dtype, jnp.floating) or nodes.ndim < 1:
        raise ValueError(f"nodes must be a floating point array, got {nodes.dtype} {nodes.shape}")
    n = _num_leaves(int(capacity))
    if nodes.shape[-1] != 2 * n:
        raise ValueError(
            f"a tree of capacity {capacity} has {2 * n} nodes, got shape {tuple(nodes.shape)}"
        )
    info = jnp.finfo(nodes.dtype)
    x = np.asarray(nodes)
    if x.dtype.itemsize < 4:  # float16 / bfloat16: exact in float32, and NumPy is fast there
        x = x.astype(np.float32)
    # min / max propagate NaN, which then fails both comparisons
    if x.size and not (np.min(x) >= 0 and np.max(x) <= float(info.max)):
        raise ValueError("every node must be finite and >= 0 (no negative, NaN or inf values)")
    if np.any(x[..., 0] != 0) or np.any(x[..., n + capacity :] != 0):
        raise ValueError("node 0 and the padded leaves past capacity must be zero")
    bound = np.asarray(float(info.max) / (2 * n), nodes.dtype).astype(x.dtype)
    if np.max(x[..., n:]) > bound:
        raise ValueError(f"a value exceeds max_value {float(bound)}")
    # each parent is recomputed from its children in the tree's dtype, so honest trees are
    # exact; the tolerance covers other summation hardware (subnormals flushed to zero)
    parents, sums = x[..., 1:n], x[..., 2::2] + x[..., 3::2]
    tol = x.dtype.type(info.eps) * x[..., 1:2] + x.dtype.type(info.tiny)
    bad = (np.abs(parents - sums) > tol) | ((parents > 0) & (sums == 0))
    if np.any(bad):
        k = np.unravel_index(int(np.argmax(bad)), bad.shape)
        node = k[-1] + 1
        raise ValueError(
            f"node {node} holds {float(x[k[:-1] + (node,)])} but its children {2 * node} and "
            f"{2 * node + 1} sum to {float(sums[k])}: every node must be the sum of its "
            "children"
        )


def sum_tree_init(capacity: int, dtype: Any = jnp.float32) -> SumTreeState:
    r"""Create a sum tree holding ``capacity`` values, all zero.

    Parameters
    ----------
    capacity : int
        Number of values, any integer ``>= 1`` (not only powers of two).
    dtype : dtype, optional
        Floating point dtype of the values and partial sums (default ``float32``).

    Returns
    -------
    SumTreeState
        The initial state.

    Raises
    ------
    ValueError
        If ``capacity < 1``.
    TypeError
        If ``capacity`` is not an integer or ``dtype`` is not a floating point dtype.

    Examples
    --------
    >>> state = sum_tree_init(5)
    >>> state.capacity, state.nodes.shape
    (5, (16,))
    >>> state = sum_tree_set(state, jnp.array([0, 4]), jnp.array([1.0, 3.0]))
    >>> print(float(sum_tree_total(state)))
    4.0
    """
    capacity = check_int(capacity, "capacity", low=1)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating point dtype, got {dtype}")
    return SumTreeState(nodes=jnp.zeros(2 * _num_leaves(capacity), dtype), capacity=capacity)


def _bits(x: jax.Array) -> jax.Array:
    """The nodes as the loops that read or write a few of them at a time move them:
    bfloat16 as its bits (uint16), other dtypes as they are. XLA's CPU backend has no
    bfloat16 arithmetic and ran each read or write of a few bfloat16 nodes as a conversion
    of the whole tree to float32 and back (3 ms per written item at 2**17 leaves). A view
    of the bits costs a copy of the tree, so the other dtypes, which move in place, keep
    their own."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _floats(x: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of :func:`_bits`: the nodes ``x`` in the tree's ``dtype``."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _last_write_mask(indices: jax.Array) -> jax.Array:
    """Boolean mask over ``indices`` (1-d) that is True where no later entry has the same index."""
    k = indices.shape[0]
    if k <= 1:
        return jnp.ones((k,), bool)
    order = jnp.argsort(indices, stable=True)
    sorted_idx = indices[order]
    # in a stable sort, the last entry of each run of equal indices is the last write
    last_in_run = jnp.concatenate([sorted_idx[1:] != sorted_idx[:-1], jnp.ones((1,), bool)])
    return jnp.zeros((k,), bool).at[order].set(last_in_run)


def sum_tree_set(
    state: SumTreeState, indices: jax.Array, values: jax.Array, strategy: str = "auto"
) -> SumTreeState:
    r"""Set ``values[indices] = values`` and recompute the affected partial sums.

    Parameters
    ----------
    state : SumTreeState
        The tree (may be donated by the caller, e.g. ``jax.jit(sum_tree_set,
        donate_argnums=0)``).
    indices : int Array, shape ``(k,)``
        Positions in ``[0, capacity)``. Duplicates are allowed: the last write wins.
        Out-of-range indices (``-1``, ``2**32 + 1``, ...) are ignored: nothing is written
        for them, whatever their integer dtype. A non-integer dtype (e.g. float) raises a
        TypeError while tracing.
    values : float Array, shape ``(k,)`` or scalar
        New non-negative values: one for all indices, or one per index in the layout of
        ``indices`` (axes of size 1 aside, so ``(k, 1)`` works for ``(k,)``). Any other
        shape raises ValueError (shapes are static, so under jit too), also where the sizes
        agree: ``(3, 2)`` values for ``(2, 3)`` indices used to be paired after flattening
        both. This function is traced, so it cannot raise on the numbers themselves;
        instead a NaN, infinite or negative value is ignored like an out-of-range index
        (nothing is written for it), and a finite value above
        :attr:`SumTreeState.max_value` is clipped to that bound, so the total and every
        partial sum stay finite. Values are checked in their own dtype (NumPy values and
        Python numbers in float64), so a finite value that only the tree's dtype cannot
        hold (``1e39`` into a float32 tree) is clipped too.
    strategy : {"auto", "sequential", "vectorized"}, optional
        How the writes run (static; both strategies give identical trees):

        - ``"sequential"``: one write after the other in a compiled loop (a leaf, then its
          ancestors, a few scalar operations per level). Tight in-place code on a CPU.
        - ``"vectorized"``: all writes of one level at once (a scatter per level with a
          last-write-wins mask): ``height + 1`` parallel steps instead of ``k * height``
          sequential ones, for GPUs and TPUs.
        - ``"auto"`` (default): sequential where the computation runs on a CPU, vectorized
          elsewhere. The choice is made by :func:`jax.lax.platform_dependent` when the
          computation is compiled for its device (the device of ``state`` and the other
          arguments, or the one ``jax.jit`` was told to use), not from the default backend
          at trace time; the compiled code holds only the chosen strategy.

    Returns
    -------
    SumTreeState
        The updated tree. Every ancestor of a written leaf is recomputed as the sum of its two
        children, so no error accumulates over many updates.

    Raises
    ------
    TypeError
        If ``indices`` is not an integer array or ``strategy`` is not a str.
    ValueError
        If ``strategy`` is not one of :data:`SUM_TREE_STRATEGIES`, or the shape of
        ``values`` does not pair up with that of ``indices``.

    Notes
    -----
    Inside :func:`jax.jit` the indices' range is checked in the dtype the traced array has.
    ``jax.jit`` itself converts NumPy arguments first: without ``jax_enable_x64`` it turns
    an int64 array into int32 at the call boundary (``2**32 + 1`` becomes ``1``) before
    this function sees it, so pass 64-bit indices to an eager call, or enable x64. The
    same goes for values: a float64 ``1e39`` passed through ``jax.jit`` arrives as float32
    ``inf`` and is ignored, where an eager call clips it to ``max_value``.

    Examples
    --------
    >>> state = sum_tree_init(3)
    >>> state = sum_tree_set(state, jnp.array([1, 1]), jnp.array([5.0, 2.0]))
    >>> sum_tree_values(state).tolist()
    [0.0, 2.0, 0.0]
    >>> vectorized = sum_tree_set(sum_tree_init(3), jnp.array([1, 1]), jnp.array([5.0, 2.0]),
    ...                           strategy="vectorized")
    >>> bool(jnp.array_equal(vectorized.nodes, state.nodes))
    True
    """
    strategy = check_choice(strategy, "strategy", SUM_TREE_STRATEGIES)
    values = as_host_or_jax(values)
    check_pairs_up(values, indices, "values")
    indices, valid = checked_indices(indices, state.capacity)
    # checked in their own dtype (NumPy values in float64): a finite value that overflows
    # only in the tree's dtype (float64 1e39 into float32) is clipped below, not ignored
    xp = np if isinstance(values, np.ndarray) and values.dtype.kind in "biuf" else jnp
    if xp is np:
        values = values.astype(np.float64)
    values = xp.broadcast_to(values.reshape(-1), indices.shape)
    valid = valid & xp.isfinite(values) & (values >= 0)
    # clipped before the cast (no overflow in NumPy's cast; negative values are ignored
    # anyway) and after it (JAX's cast to a narrower float gives inf)
    values = jnp.asarray(xp.clip(values, 0, state.max_value), state.nodes.dtype)
    values = jnp.minimum(values, state.max_value)
    args = (state, indices, values, valid)
    if strategy == "sequential":
        nodes = _set_sequential(*args)
    elif strategy == "vectorized":
        nodes = _set_vectorized(*args)
    else:
        nodes = jax.lax.platform_dependent(*args, cpu=_set_sequential, default=_set_vectorized)
    return state.replace(nodes=nodes)


def _set_sequential(
    state: SumTreeState, indices: jax.Array, values: jax.Array, valid: jax.Array
) -> jax.Array:
    """One write at a time: set the leaf, then recompute its ancestors bottom-up.

    An ignored entry writes a zero to node 0, which the tree does not use, and its walk up
    stays at node 0, which keeps its zero: no read of the tree before the write (that made
    XLA copy the whole tree for every entry) and no pass over the tree afterwards (a final
    reset of node 0 cost more than the writes of a small batch on a CPU). Reads and writes
    are scalar dynamic slices, which XLA's CPU backend compiles to in-place loads and
    stores; the levels are unrolled, so each entry is one straight run of code. bfloat16
    nodes move as their bits (see :func:`_bits`); sums are computed in the tree's dtype.
    """

    dtype = state.nodes.dtype

    def one(bits: jax.Array, item: tuple) -> tuple:
        node, v = item
        bits = jax.lax.dynamic_update_slice(bits, _bits(v[None]), (node,))
        for _ in range(state.height):
            node = node // 2
            children = _floats(jax.lax.dynamic_slice(bits, (2 * node,), (2,)), dtype)
            total = jnp.where(node > 0, children[0] + children[1], 0)
            bits = jax.lax.dynamic_update_slice(bits, _bits(total[None]), (node,))
        return bits, None

    leaves = jnp.where(valid, indices + state.num_leaves, 0)
    bits, _ = jax.lax.scan(one, _bits(state.nodes), (leaves, jnp.where(valid, values, 0)))
    return _floats(bits, dtype)


def _set_vectorized(
    state: SumTreeState, indices: jax.Array, values: jax.Array, valid: jax.Array
) -> jax.Array:
    """All writes of one level at once: a leaf scatter, then one scatter per level."""
    n = state.num_leaves
    # the last write of each index wins, among the valid writes only
    valid = valid & _last_write_mask(jnp.where(valid, indices, -1 - jnp.arange(indices.size)))
    # invalid or overwritten entries are sent out of bounds and dropped by the scatter
    leaf = jnp.where(valid, indices + n, 2 * n)
    nodes = state.nodes.at[leaf].set(values, mode="drop")
    node = jnp.where(valid, indices + n, 0)
    for _ in range(state.height):
        node = node // 2
        # several entries may share a parent: they all write the same (recomputed) value
        nodes = nodes.at[node].set(nodes[2 * node] + nodes[2 * node + 1], mode="drop")
    # node 0 collected the invalid entries; keep it at zero
    return nodes.at[0].set(0)


def sum_tree_values(state: SumTreeState) -> jax.Array:
    r"""The stored values, shape ``(capacity,)``.

    Examples
    --------
    >>> sum_tree_values(sum_tree_init(2)).tolist()
    [0.0, 0.0]
    """
    n = state.num_leaves
    return state.nodes[..., n : n + state.capacity]


def sum_tree_total(state: SumTreeState) -> jax.Array:
    r"""The sum of all values (the root of the tree), a scalar.

    Examples
    --------
    >>> state = sum_tree_set(sum_tree_init(4), jnp.arange(4), jnp.ones(4))
    >>> print(float(sum_tree_total(state)))
    4.0
    """
    return state.nodes[..., 1]


def _clipped_bound(x: Any, capacity: int, name: str) -> jax.Array:
    """A range bound clipped to ``[0, capacity]`` in its own dtype, then as int32.

    Clipping first means a bound such as ``2**32 + 1`` (int64) or ``2**32 - 1`` (uint32) is
    read as ``capacity``, not wrapped around to 1 or -1 by the conversion to int32.
    """
    if is_int(x):
        return jnp.asarray(min(max(int(x), 0), capacity), jnp.int32)
    x = as_host_or_jax(x)
    if not (jnp.issubdtype(x.dtype, jnp.integer) and x.dtype != jnp.bool_):
        raise TypeError(f"{name} must be integers, got dtype {x.dtype}: {x!r}")
    xp = np if isinstance(x, np.ndarray) else jnp
    info = xp.iinfo(x.dtype)
    if info.min < 0:
        x = xp.maximum(x, xp.zeros((), x.dtype))
    if info.max > capacity:
        x = xp.minimum(x, xp.asarray(capacity, x.dtype))
    return jnp.asarray(x.astype(xp.int32))


def sum_tree_reduce(state: SumTreeState, start: Any, stop: Any) -> jax.Array:
    r"""The sum of ``values[start:stop]``, in :math:`\mathcal{O}(\log N)`.

    Parameters
    ----------
    state : SumTreeState
        The tree.
    start, stop : int or int Array
        Range bounds, scalars or arrays of equal shape (broadcast against each other), with
        ``0 <= start <= stop <= capacity`` (not checked: this function is traced; bounds are
        clipped to ``[0, capacity]`` in their own integer dtype, so ``2**32 + 1`` reads as
        ``capacity``, and an empty range sums to zero).

    Returns
    -------
    Array
        The partial sums, shape ``broadcast(start, stop).shape``.

    Raises
    ------
    TypeError
        If ``start`` or ``stop`` is not an integer (floats and bools included).

    Examples
    --------
    >>> state = sum_tree_set(sum_tree_init(5), jnp.arange(5), jnp.arange(5.0))
    >>> sum_tree_reduce(state, jnp.array([0, 1, 2]), jnp.array([5, 3, 2])).tolist()
    [10.0, 3.0, 0.0]
    """
    start = _clipped_bound(start, state.capacity, "start")
    stop = _clipped_bound(stop, state.capacity, "stop")
    start, stop = jnp.broadcast_arrays(start, stop)
    n = state.num_leaves
    lo = start + n  # half-open node range [lo, hi) at the current level
    hi = jnp.maximum(stop, start) + n
    total = jnp.zeros(lo.shape, state.nodes.dtype)
    for _ in range(state.height + 1):
        take_lo = (lo < hi) & (lo % 2 == 1)
        total = total + jnp.where(take_lo, state.nodes[lo], 0)
        lo = jnp.where(take_lo, lo + 1, lo)
        take_hi = (lo < hi) & (hi % 2 == 1)
        hi = jnp.where(take_hi, hi - 1, hi)
        total = total + jnp.where(take_hi, state.nodes[hi], 0)
        lo, hi = lo // 2, hi // 2
    return total


def sum_tree_inverse_cdf(
    state: SumTreeState, u: Any, return_values: bool = False
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Inverse CDF of the categorical distribution with probabilities ``values / total``.

    For each :math:`u\in[0, 1]` this returns the index :math:`i` with

    .. math::

        \sum_{j<i} v_j \ \le\ u \sum_j v_j \ <\ \sum_{j\le i} v_j

    by a descent from the root. Rounding can never lead it to a zero-valued or a padded slot:
    at every node it only enters a child with a positive sum, so ``u == 1.0`` returns the last
    non-zero slot.

    Every read of the tree (the total, then a pair of children per level) feeds the
    returned indices, so in a jitted step that samples and then updates the same (donated)
    tree, XLA orders all reads before the in-place writes and never copies the tree.

    Parameters
    ----------
    state : SumTreeState
        The tree; its total must be positive (not checked: this function is traced; an
        all-zero tree returns index 0).
    u : float or float Array
        Numbers in ``[0, 1]`` (clipped to it; NaN counts as 0), any shape.
    return_values : bool, optional
        Also return the values at the returned indices (static; default False).

    Returns
    -------
    int32 Array, or a tuple (int32 Array, Array)
        Indices, same shape as ``u``; with ``return_values`` also their values.

    Examples
    --------
    >>> state = sum_tree_set(sum_tree_init(4), jnp.arange(4), jnp.array([1.0, 0.0, 3.0, 0.0]))
    >>> sum_tree_inverse_cdf(state, jnp.array([0.0, 0.2499, 0.25, 1.0])).tolist()
    [0, 0, 2, 2]
    >>> idx, val = sum_tree_inverse_cdf(state, 0.5, return_values=True)
    >>> int(idx), float(val)
    (2, 3.0)
    """
    nodes = state.nodes
    u = jnp.clip(jnp.nan_to_num(jnp.asarray(u, nodes.dtype), nan=0.0), 0, 1)
    if state.height == 0:  # capacity 1: a single slot
        indices, value = jnp.zeros(u.shape, jnp.int32), jnp.broadcast_to(nodes[1], u.shape)
        return (indices, value) if return_values else indices

    def down_in(children: jax.Array) -> Any:
        """One level of the descent, reading pairs from ``children`` (row ``k``: the two
        children of node ``k``, read as one pair)."""

        def down(_: Any, carry: tuple) -> tuple:
            node, target, value = carry
            pair = _floats(children[node], nodes.dtype)
            left, right = pair[..., 0], pair[..., 1]
            go_right = (right > 0) & ((target >= left) | (left <= 0))
            return (
                2 * node + go_right,
                jnp.where(go_right, target - left, target),
                jnp.where(go_right, right, left),
            )

        return down

    carry = (jnp.ones(u.shape, jnp.int32), u * nodes[1], jnp.zeros(u.shape, nodes.dtype))
    # XLA's CPU backend runs a gather from an array of _SPLIT_BYTES or more as two parallel
    # tasks, and handing a read of a few pairs to another thread costs more than the read
    # (about 2 us per level). In a larger tree the levels near the root therefore read
    # from the tree's first _TOP_BYTES, a slice below that size: the descent of 32 values
    # from 2**20 leaves took 23 us instead of 46 (2**16 leaves: 10 instead of 24).
    top = _TOP_BYTES // nodes.dtype.itemsize
    upper = 0
    if nodes.shape[-1] * nodes.dtype.itemsize >= _SPLIT_BYTES:
        upper = min(state.height, top.bit_length() - 2)  # the children lie below ``top``
        carry = jax.lax.fori_loop(0, upper, down_in(_bits(nodes[:top]).reshape(-1, 2)), carry)
    pairs = _bits(nodes).reshape(-1, 2)
    node, _, value = jax.lax.fori_loop(upper, state.height, down_in(pairs), carry)
    indices = jnp.minimum(node - state.num_leaves, state.capacity - 1).astype(jnp.int32)
    return (indices, value) if return_values else indices


def sum_tree_sample(
    state: SumTreeState, key: jax.Array, n: int, stratified: bool = False
) -> jax.Array:
    r"""Sample ``n`` indices with probabilities proportional to the values.

    Parameters
    ----------
    state : SumTreeState
        The tree; its total must be positive.
    key : jax.Array
        A ``jax.random`` key.
    n : int
        Number of samples (static).
    stratified : bool, optional
        If True, split :math:`[0, 1)` into ``n`` equal strata and draw one uniform number in
        each (lower variance, as in prioritized experience replay); otherwise draw ``n``
        independent uniform numbers. Static.

    Returns
    -------
    int32 Array, shape ``(n,)``
        The sampled indices (via :func:`sum_tree_inverse_cdf`).

    Examples
    --------
    >>> state = sum_tree_set(sum_tree_init(3), jnp.arange(3), jnp.array([0.0, 1.0, 0.0]))
    >>> sum_tree_sample(state, jax.random.key(0), 4).tolist()
    [1, 1, 1, 1]
    """
    n = check_int(n, "n", low=1)
    dtype = state.nodes.dtype
    u = random_uniform(key, n, dtype)
    if stratified:
        u = (jnp.arange(n, dtype=dtype) + u) / n
    return sum_tree_inverse_cdf(state, u)
