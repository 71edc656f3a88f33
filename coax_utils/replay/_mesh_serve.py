"""Routing of the mesh-sharded buffers (:mod:`coax_utils.replay._mesh`): rows packed into
words (:class:`coax_utils._rows.RowLayout`), one all-gather per round, whatever the kind of
buffer.

``serve`` resolves draws on the shards that own them (samples); ``route`` hands entries to
the shards that own their indices (updates). Both run inside ``shard_map``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from coax_utils._rows import RowLayout

__all__ = ["block", "local", "round_rows", "route", "serve", "shard_map"]


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


def _layout(rows: Any) -> RowLayout:
    """The layout of one row of ``rows`` (a pytree of arrays or ``jax.ShapeDtypeStruct``
    with a leading axis), as words, so that one collective moves all its leaves."""
    return RowLayout.of(
        jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), rows)
    )


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
    layout = _layout(jax.eval_shape(resolve, request[:rows]))
    served_rows = jnp.arange(rows, dtype=jnp.int32)

    def one_round(r: jax.Array, carry: tuple) -> tuple:
        out, low = carry
        first = r * rows
        slot = jnp.where((owner == me) & (rank >= first), rank - first, rows)
        req = jnp.zeros((rows,), request.dtype).at[slot].set(request, mode="drop")
        served = jax.lax.all_gather(layout.pack(resolve(req)), axis)  # (n, rows, width)
        here = (out_rank >= first) & (out_rank < first + rows)
        got = served[out_owner, jnp.clip(out_rank - first, 0, rows - 1)]
        out = jnp.where(here[:, None], got, out)
        score = layout.unpack(served)[1]  # (n, rows)
        valid = served_rows[None, :] < (counts - first)[:, None]
        return out, jnp.minimum(low, jnp.min(jnp.where(valid, score, jnp.inf)))

    start = (jnp.zeros((share, layout.width), jnp.uint32), jnp.float32(jnp.inf))
    out, low = jax.lax.fori_loop(0, rounds, one_round, start)
    return layout.unpack(out)[0], low


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
    layout = _layout(entries)
    words = jax.lax.all_gather(layout.pack(entries), axis, axis=0, tiled=True)  # (n * k, W)
    every = layout.unpack(words)
    me = jax.lax.axis_index(axis)
    where = index(every)
    mine = (where >= 0) & (where // rows == me)
    rank = jnp.cumsum(mine, dtype=jnp.int32) - 1  # among this shard's entries
    per_round = round_rows(count * n, n)

    def one_round(r: jax.Array, state: Any) -> Any:
        # this shard's entries, in their order (the last of duplicates wins): one scatter
        at = jnp.where(mine & (rank >= r * per_round), rank - r * per_round, per_round)
        taken = jnp.zeros((per_round, layout.width), jnp.uint32).at[at].set(words, mode="drop")
        slots = jnp.full((per_round,), -1, jnp.int32).at[at].set(where - me * rows, mode="drop")
        return apply(state, layout.unpack(taken), slots)

    rounds = (rank[-1] + per_round) // per_round
    return jax.lax.fori_loop(0, rounds, one_round, state)
