"""Routing of the mesh-sharded buffers (:mod:`coax_utils.replay._mesh`): rows packed into
bytes, one all-gather per round, whatever the kind of buffer.

``serve`` resolves draws on the shards that own them (samples); ``route`` hands entries to
the shards that own their indices (updates). Both run inside ``shard_map``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

__all__ = ["block", "local", "pack", "round_rows", "route", "serve", "shard_map", "unpack"]


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """``jax.shard_map`` where it exists, else ``jax.experimental.shard_map`` (jax < 0.6).

    Replication checks are off: the functions here return replicated values (the gathered
    totals, the shared maximum priority) that the checker of older versions cannot follow.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    return experimental_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def local(block: Any) -> Any:
    """A device's block of a sharded state (leading axis of size 1) as a plain state."""
    return jax.tree_util.tree_map(lambda x: x[0], block)


def block(state: Any) -> Any:
    """The inverse of :func:`local`."""
    return jax.tree_util.tree_map(lambda x: x[None], state)


def round_rows(batch_size: int, num_shards: int) -> int:
    """Rows each device serves per round of a sharded draw of ``batch_size`` items: the
    mean share plus four standard deviations (all of them on one device)."""
    mean = batch_size / num_shards
    return min(batch_size, math.ceil(mean + 4 * math.sqrt(mean)) + 4)


def pack(tree: Any) -> jax.Array:
    """Every leaf of ``tree`` (leading axis ``k``) as bytes, side by side: ``(k, W)`` uint8,
    so that one collective moves them all."""
    cols = []
    for x in jax.tree_util.tree_leaves(tree):
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        cols.append(jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1))
    return jnp.concatenate(cols, axis=1)


def unpack(packed: jax.Array, template: Any) -> Any:
    """The inverse of :func:`pack` for rows shaped like ``template`` (a pytree of arrays or
    ``jax.ShapeDtypeStruct`` with a leading axis, of any length)."""
    leaves, treedef = jax.tree_util.tree_flatten(template)
    out, start = [], 0
    k = packed.shape[0]
    for t in leaves:
        dtype = jnp.dtype(jnp.uint8 if t.dtype == jnp.bool_ else t.dtype)
        width = int(np.prod(t.shape[1:], dtype=np.int64)) * dtype.itemsize
        x = packed[:, start : start + width]
        start += width
        shape = (k,) + tuple(t.shape[1:]) + ((dtype.itemsize,) if dtype.itemsize > 1 else ())
        x = jax.lax.bitcast_convert_type(x.reshape(shape), dtype)
        out.append(x != 0 if t.dtype == jnp.bool_ else x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _ranks(owner: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """For each entry, how many earlier entries have the same owner; and the count of
    entries of each owner."""
    one_hot = owner[:, None] == jnp.arange(n, dtype=owner.dtype)
    before = jnp.cumsum(one_hot, axis=0, dtype=jnp.int32)
    rank = jnp.take_along_axis(before, jnp.clip(owner, 0, n - 1)[:, None], 1)[:, 0] - 1
    return rank, before[-1]


def serve(
    owner: jax.Array, request: jax.Array, resolve: Callable, axis: str, n: int, rows: int
) -> tuple[Any, jax.Array]:
    """Resolve ``B`` draws on the shards that own them; return this device's ``B / n``.

    ``owner`` and ``request`` (shape ``(B,)``) are the same on every device: draw ``p``
    goes to shard ``owner[p]``, which turns ``request[p]`` into a row with ``resolve`` (a
    function of ``rows`` requests returning a pair: a pytree of arrays with a leading axis
    of ``rows``, and a float32 score per row). Device ``d`` returns draws
    ``d * B / n, ..., (d + 1) * B / n - 1``, and the smallest score of all ``B`` draws.
    Each round serves up to ``rows`` draws per shard with one all-gather.
    """
    batch = owner.shape[0]
    me = jax.lax.axis_index(axis)
    rank, counts = _ranks(owner, n)
    rounds = (jnp.max(counts) + rows - 1) // rows
    share = batch // n
    out_owner = jax.lax.dynamic_slice_in_dim(owner, me * share, share)
    out_rank = jax.lax.dynamic_slice_in_dim(rank, me * share, share)
    template = jax.eval_shape(resolve, request[:rows])
    width = pack(jax.tree_util.tree_map(jnp.zeros_like, template)).shape[1]
    served_rows = jnp.arange(rows, dtype=jnp.int32)

    def one_round(r: jax.Array, carry: tuple) -> tuple:
        out, low = carry
        first = r * rows
        slot = jnp.where((owner == me) & (rank >= first), rank - first, rows)
        req = jnp.zeros((rows,), request.dtype).at[slot].set(request, mode="drop")
        served = jax.lax.all_gather(pack(resolve(req)), axis)  # (n, rows, width)
        here = (out_rank >= first) & (out_rank < first + rows)
        got = served[out_owner, jnp.clip(out_rank - first, 0, rows - 1)]
        out = jnp.where(here[:, None], got, out)
        score = unpack(served.reshape(n * rows, width), template)[1].reshape(n, rows)
        valid = served_rows[None, :] < (counts - first)[:, None]
        return out, jnp.minimum(low, jnp.min(jnp.where(valid, score, jnp.inf)))

    start = (jnp.zeros((share, width), jnp.uint8), jnp.float32(jnp.inf))
    out, low = jax.lax.fori_loop(0, rounds, one_round, start)
    return unpack(out, template)[0], low


def route(
    entries: Any, index: Callable, apply: Callable, state: Any, axis: str, n: int, rows: int
) -> Any:
    """Hand every device's ``entries`` to the shards that own them; return the new state.

    ``entries`` is this device's pytree of arrays with a leading axis of ``k`` entries;
    ``index(entries)`` their global indices (int32, -1 for none). All of them are gathered
    (one all-gather of their bytes); this device keeps those of its own ``rows`` slots, in
    order, and applies them with ``apply(state, entries, slots)`` (``slots`` local, -1 for
    padding) in rounds of a fixed number of entries, so that the last of duplicate indices
    wins as in one call.
    """
    count = jax.tree_util.tree_leaves(entries)[0].shape[0]
    words = jax.lax.all_gather(pack(entries), axis, axis=0, tiled=True)  # (n * k, W)
    every = unpack(words, entries)
    me = jax.lax.axis_index(axis)
    where = index(every)
    mine = (where >= 0) & (where // rows == me)
    rank = jnp.cumsum(mine, dtype=jnp.int32) - 1  # among this shard's entries
    per_round = round_rows(count * n, n)

    def one_round(r: jax.Array, state: Any) -> Any:
        # this shard's entries, in their order (the last of duplicates wins): one scatter
        at = jnp.where(mine & (rank >= r * per_round), rank - r * per_round, per_round)
        taken = jnp.zeros((per_round, words.shape[1]), jnp.uint8).at[at].set(words, mode="drop")
        slots = jnp.full((per_round,), -1, jnp.int32).at[at].set(where - me * rows, mode="drop")
        return apply(state, unpack(taken, entries), slots)

    rounds = (rank[-1] + per_round) // per_round
    return jax.lax.fori_loop(0, rounds, one_round, state)
