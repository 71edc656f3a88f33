"""Compiled inner loops of the host-side segment trees (imported lazily: needs numba).

All kernels work on the 1-indexed heap layout of :mod:`coax_utils.utils._segment_tree`:
``arr[1]`` is the root, node ``k`` has children ``2k`` and ``2k + 1``, and value ``i`` sits at
``arr[num_leaves + i]``. ``op`` selects the reducer: 0 sum, 1 minimum, 2 maximum.
"""

from __future__ import annotations

import numba
import numpy as np

OP_SUM = 0
OP_MIN = 1
OP_MAX = 2

# error codes returned by ``set_values`` (validation happens before anything is written)
OK = 0
BAD_INDEX = 1
BAD_VALUE = 2
BAD_TOTAL = 3  # the root would not be finite (sum trees): the write was undone exactly


@numba.njit(cache=True, inline="always")
def _reduce(op, a, b):
    if op == OP_SUM:
        return a + b
    if op == OP_MIN:
        return a if a <= b else b
    return a if a >= b else b


@numba.njit(cache=True)
def _fix_ancestors(arr, num_leaves, op, idx):
    # Walk up from every written leaf, recomputing each parent from its two children. A walk
    # may stop at a node whose value does not change: its ancestors already agree with it.
    # Walks run one after the other, so every change of a node is followed by a recompute of
    # its parent; the end state is the same as recomputing every ancestor.
    for p in range(idx.shape[0]):
        node = (num_leaves + idx[p]) >> 1
        while node >= 1:
            new = _reduce(op, arr[2 * node], arr[2 * node + 1])
            if new == arr[node]:
                break
            arr[node] = new
            node >>= 1


@numba.njit(cache=True)
def set_values(arr, num_leaves, capacity, op, nonneg_finite, idx, values):
    """Validate, then write ``values`` at ``idx`` (last write wins) and fix the ancestors.

    Returns ``(code, position)``: ``code`` is OK, BAD_INDEX, BAD_VALUE or BAD_TOTAL and
    ``position`` the first offending entry; on an error the tree is as it was. Indices and
    values are checked before anything is written. With ``nonneg_finite`` (sum trees) the
    root must also stay finite, which only the write itself tells: a root that overflows is
    undone by writing the old leaves back (last first, so the original value of a duplicated
    index wins) and recomputing the same ancestors, which gives back the exact bits, since
    every parent is the reduction of its children. ``idx`` is normalized in place (negative
    indices count from the end).
    """
    k = idx.shape[0]
    for p in range(k):
        i = idx[p]
        if i < 0:
            i += capacity
        if i < 0 or i >= capacity:
            return BAD_INDEX, p
        idx[p] = i
        v = values[p]
        if v != v:  # NaN
            return BAD_VALUE, p
        if nonneg_finite and not (0.0 <= v < np.inf):
            return BAD_VALUE, p
    old = np.empty(k if nonneg_finite else 0)
    for p in range(k):
        if nonneg_finite:
            old[p] = arr[num_leaves + idx[p]]
        arr[num_leaves + idx[p]] = values[p]
    _fix_ancestors(arr, num_leaves, op, idx)
    if nonneg_finite and not arr[1] < np.inf:
        for p in range(k - 1, -1, -1):
            arr[num_leaves + idx[p]] = old[p]
        _fix_ancestors(arr, num_leaves, op, idx)
        return BAD_TOTAL, 0
    return OK, 0


@numba.njit(cache=True)
def inverse_cdf(arr, num_leaves, u, out):
    """Sum-tree descent for every ``u`` (flat, in [0, 1]); writes leaf indices into ``out``.

    The descent runs level by level over the whole batch, so the memory loads of different
    samples are independent and overlap. It only enters children with a positive sum, so it
    never ends on a zero-valued or padded leaf when the root is positive.
    """
    n = u.shape[0]
    total = arr[1]
    target = np.empty(n)
    for s in range(n):
        target[s] = u[s] * total
        out[s] = 1
    level_size = 1
    while level_size < num_leaves:
        for s in range(n):
            # branch-free step: random comparisons would defeat the branch predictor
            child = 2 * out[s]
            left = arr[child]
            t = target[s]
            go_right = (t >= left) & (arr[child + 1] > 0.0)
            out[s] = child + go_right
            target[s] = t - left * go_right
        level_size *= 2
    for s in range(n):
        out[s] -= num_leaves


@numba.njit(cache=True)
def partial_reduce(arr, num_leaves, op, init_value, start, stop, out):
    """Reduce ``values[start[s]:stop[s]]`` for every ``s`` into ``out`` (ranges pre-checked)."""
    for s in range(start.shape[0]):
        lo = start[s] + num_leaves
        hi = stop[s] + num_leaves
        acc = init_value
        while lo < hi:
            if lo & 1:
                acc = _reduce(op, acc, arr[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                acc = _reduce(op, acc, arr[hi])
            lo >>= 1
            hi >>= 1
        out[s] = acc
