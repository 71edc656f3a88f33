r"""Jittable replay buffers sharded over a :class:`jax.sharding.Mesh` along one named axis.

:func:`shard_buffer` wraps a buffer of :func:`make_uniform_buffer` or
:func:`make_prioritized_buffer` so that its storage lives on the devices of one mesh axis:
each of the ``n`` devices holds a buffer of ``capacity / n`` rows (a *shard*), and the
state is the per-shard state with a leading axis of size ``n`` sharded over the mesh axis.
Every function runs the existing single-buffer functions on each shard through
``shard_map``; only what must cross devices does, with one collective each:

- ``add``: nothing crosses; each device writes its slice of a batch sharded on the axis.
- prioritized ``sample``: the per-shard total priorities are gathered (``n`` floats), the
  ``B`` uniform numbers are drawn from the same key on every device, and each draw goes to
  the shard whose range of the global cumulative priority it falls in, then down that
  shard's sum tree. The sampled rows are gathered to the devices that return them. The
  distribution, indices and importance weights are those of one buffer holding the same
  items with the same priorities.
- ``update``: the sample's indices and priorities are gathered; each device keeps those of
  its own slots; the largest priority is shared so that new items get the global maximum.
- with ``scope="shard"`` (uniform ``sample``; prioritized ``sample`` and ``update``)
  nothing crosses: each device is a buffer of its own, as under ``pmap``.

Sharded draws are served in rounds of a fixed number of rows per device (about the mean
``B / n`` plus four standard deviations); a draw pattern that sends more to one shard (very
unequal totals) takes more rounds, never another distribution.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coax_utils._checks import check_choice, check_pairs_up, checked_indices
from coax_utils._random import random_index, random_uniform
from coax_utils.replay._functional import (
    PrioritizedBuffer,
    PrioritizedSample,
    UniformBuffer,
    make_prioritized_buffer,
    make_uniform_buffer,
)
from coax_utils.replay._functional_common import (
    check_beta,
    check_state,
    check_static_int,
    checked_versions,
    gather_rows,
    slot_versions,
)
from coax_utils.utils import sum_tree_inverse_cdf, sum_tree_total

__all__ = ["MeshBuffer", "shard_buffer"]

UNIFORM_SCOPES = ("shard", "mesh")


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """``jax.shard_map`` where it exists, else ``jax.experimental.shard_map`` (jax < 0.6).

    Replication checks are off: the functions here return replicated values (the gathered
    totals, the shared maximum priority) that the checker of older versions cannot follow.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    return experimental_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def _local(block: Any) -> Any:
    """A device's block of a sharded state (leading axis of size 1) as a plain state."""
    return jax.tree_util.tree_map(lambda x: x[0], block)


def _block(state: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[None], state)


def round_rows(batch_size: int, num_shards: int) -> int:
    """Rows each device serves per round of a sharded draw of ``batch_size`` items: the
    mean share plus four standard deviations (all of them on one device)."""
    mean = batch_size / num_shards
    return min(batch_size, math.ceil(mean + 4 * math.sqrt(mean)) + 4)


def _pack(tree: Any) -> jax.Array:
    """Every leaf of ``tree`` (leading axis ``k``) as bytes, side by side: ``(k, W)`` uint8,
    so that one collective moves them all."""
    cols = []
    for x in jax.tree_util.tree_leaves(tree):
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        cols.append(jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1))
    return jnp.concatenate(cols, axis=1)


def _unpack(packed: jax.Array, template: Any) -> Any:
    """The inverse of :func:`_pack` for rows shaped like ``template`` (a pytree of
    ``jax.ShapeDtypeStruct`` with a leading axis)."""
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


def _serve(
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
    width = _pack(jax.tree_util.tree_map(jnp.zeros_like, template)).shape[1]
    served_rows = jnp.arange(rows, dtype=jnp.int32)

    def one_round(r: jax.Array, carry: tuple) -> tuple:
        out, low = carry
        first = r * rows
        slot = jnp.where((owner == me) & (rank >= first), rank - first, rows)
        req = jnp.zeros((rows,), request.dtype).at[slot].set(request, mode="drop")
        served = jax.lax.all_gather(_pack(resolve(req)), axis)  # (n, rows, width)
        here = (out_rank >= first) & (out_rank < first + rows)
        got = served[out_owner, jnp.clip(out_rank - first, 0, rows - 1)]
        out = jnp.where(here[:, None], got, out)
        score = _unpack(served.reshape(n * rows, width), template)[1].reshape(n, rows)
        valid = served_rows[None, :] < (counts - first)[:, None]
        return out, jnp.minimum(low, jnp.min(jnp.where(valid, score, jnp.inf)))

    start = (jnp.zeros((share, width), jnp.uint8), jnp.float32(jnp.inf))
    out, low = jax.lax.fori_loop(0, rounds, one_round, start)
    return _unpack(out, template)[0], low


@dataclasses.dataclass(frozen=True)
class MeshBuffer:
    """A jittable replay buffer sharded over the devices of one mesh axis.

    Made by :func:`shard_buffer`; see there. ``init``, ``add``, ``sample``,
    ``can_sample``, ``update`` (prioritized only) and ``put`` take and return whole sharded
    states; ``shard_add``, ``shard_sample``, ``shard_update`` and ``shard_can_sample`` are
    their per-device halves, for use inside a caller's own ``shard_map`` over ``mesh``.
    """

    init: Callable[[Any], Any]
    add: Callable[..., Any]
    sample: Callable[..., Any]
    can_sample: Callable[[Any, int], jax.Array]
    update: Callable[..., Any] | None
    put: Callable[[Any], Any]
    shard_add: Callable[..., Any]
    shard_sample: Callable[..., Any]
    shard_update: Callable[..., Any] | None
    shard_can_sample: Callable[[Any, int], jax.Array]
    shard: UniformBuffer | PrioritizedBuffer
    mesh: Mesh
    axis_name: str
    num_shards: int
    capacity: int

    @property
    def state_sharding(self) -> NamedSharding:
        """The sharding of every leaf of the state (leading axis over ``axis_name``)."""
        return NamedSharding(self.mesh, PartitionSpec(self.axis_name))

    @property
    def batch_sharding(self) -> NamedSharding:
        """The sharding of batches given to ``add`` (leading axis over ``axis_name``)."""
        return NamedSharding(self.mesh, PartitionSpec(self.axis_name))

    @property
    def replicated(self) -> NamedSharding:
        """The sharding of keys (and anything else the same on every device)."""
        return NamedSharding(self.mesh, PartitionSpec())


def shard_buffer(
    buffer: UniformBuffer | PrioritizedBuffer, mesh: Mesh, axis_name: str
) -> MeshBuffer:
    r"""Shard a jittable buffer's capacity over the devices of the mesh axis ``axis_name``.

    ``buffer`` is made by :func:`make_uniform_buffer` or :func:`make_prioritized_buffer`
    with the *total* capacity; each of the ``n`` devices of the axis holds a buffer of
    ``capacity / n`` rows made with the same arguments. The state is that buffer's state
    with a leading axis of size ``n`` (``items`` leaves of shape
    ``(n, capacity / n, ...)``, ``size`` of shape ``(n,)``, ...), sharded over the axis and
    replicated over the mesh's other axes; it checkpoints with
    :func:`coax_utils.utils.dump` like any state and comes back onto the mesh with ``put``.
    The returned :class:`MeshBuffer` holds, all jitted and donation-friendly
    (``jax.jit(buffer.add, donate_argnums=0)``):

    - ``init(example_item) -> state``: empty shards, created on their devices.
    - ``add(state, items, episode_end=None) -> state``: ``items`` has a leading batch axis
      of ``B`` rows, sharded like ``batch_sharding``; device ``d`` writes its ``B / n`` rows
      into its own shard (nothing crosses devices).
    - uniform ``sample(state, key, batch_size, scope="shard") -> items``: ``batch_size``
      rows, sharded on the axis. With ``scope="shard"`` (the data-parallel pattern) each
      device draws its ``batch_size / n`` rows from its own shard (keys folded with the
      device's position on the axis); with ``scope="mesh"`` every row is drawn uniformly
      from the whole buffer.
    - prioritized ``sample(state, key, batch_size, beta=None, scope="mesh") ->
      PrioritizedSample``, sharded on the axis, ``indices`` global
      (``shard * capacity / n + slot``). With ``scope="mesh"`` (default) the draw is
      over the whole buffer, exactly as one buffer of the total capacity holding the same
      items with the same priorities draws it: the importance weights
      :math:`(N P(i))^{-\beta} / \max_j (N P(j))^{-\beta}` use the global size
      :math:`N`, probabilities :math:`P(i) = p_i / \sum_j p_j` and batch. With
      ``scope="shard"`` each device draws its ``batch_size / n`` rows from its own shard
      :math:`s` by the shard's priorities (keys folded with the device's position), as
      flashbax under ``pmap`` does, and nothing crosses devices: the weights are
      :math:`(N_s P_s(i))^{-\beta} / \max_j (N_s P_s(j))^{-\beta}` with the shard's size
      :math:`N_s`, its probabilities :math:`P_s(i) = p_i / \sum_{j \in s} p_j` and the
      maximum over the device's own rows (the single buffer's sample, on the shard).
      The default differs from the uniform sample's: with balanced adds, a uniform draw
      per shard keeps every item's probability :math:`1 / N`, a prioritized one does not.
    - prioritized ``update(state, indices, priorities, versions=None, scope="mesh") ->
      state``: the arguments of a sample (sharded like it); the rules of the single
      buffer's ``update`` hold (stale versions, NaN and out-of-range entries ignored, the
      last of duplicate indices wins). With ``scope="mesh"`` each priority reaches the
      device that owns its index and new items get the largest priority set anywhere;
      with ``scope="shard"`` (for the indices of a ``scope="shard"`` sample) each device
      keeps the entries of its block that index its own shard, ignores the others, and
      keeps its own largest priority: nothing crosses devices.
    - ``can_sample(state, batch_size) -> bool Array``: whether the buffer holds
      ``batch_size`` items (and, for ``scope="shard"`` sampling, every shard one).
    - ``put(state) -> state``: a state (e.g. from :func:`coax_utils.utils.load`) checked
      and placed onto the mesh with the state's sharding.

    ``key`` must be the same on every device (e.g. placed with ``replicated``). The
    ``shard_*`` functions are the per-device halves, for use inside a ``shard_map`` over
    ``mesh`` with the state's block (leading axis of size 1) and per-device batch sizes:
    ``shard_sample(block, key, batch_size)`` returns this device's ``batch_size`` rows of a
    draw of ``n * batch_size``; ``scope`` is a keyword of ``shard_sample``,
    ``shard_update`` and ``shard_can_sample`` as above.

    Parameters
    ----------
    buffer : UniformBuffer or PrioritizedBuffer
        The buffer to shard, with the total capacity.
    mesh : jax.sharding.Mesh
        The devices.
    axis_name : str
        The mesh axis the capacity (and batches) are sharded over.

    Returns
    -------
    buffer : MeshBuffer

    Raises
    ------
    TypeError
        If ``buffer`` is not a uniform or prioritized jittable buffer, or ``mesh`` not a
        :class:`~jax.sharding.Mesh`.
    ValueError
        If ``axis_name`` is not an axis of ``mesh`` or the capacity is not divisible by
        the number of its devices.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(jax.devices()[:1], ("data",))
    >>> buffer = shard_buffer(make_prioritized_buffer(capacity=8), mesh, "data")
    >>> state = buffer.init(jnp.zeros(2))
    >>> state = buffer.add(state, jnp.ones((4, 2)))
    >>> sample = buffer.sample(state, jax.random.key(0), 4)
    >>> state.size.shape, sample.items.shape
    ((1,), (4, 2))
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    n = int(mesh.shape[axis_name])
    capacity = buffer.capacity
    if capacity % n:
        raise ValueError(
            f"capacity {capacity} is not divisible by the {n} devices of mesh axis {axis_name!r}"
        )
    rows = capacity // n
    if isinstance(buffer, PrioritizedBuffer):
        shard = make_prioritized_buffer(
            rows, buffer.alpha, buffer.beta, buffer.epsilon, buffer.tree_strategy
        )
    elif isinstance(buffer, UniformBuffer):
        shard = make_uniform_buffer(rows)
    else:
        raise TypeError(
            "shard_buffer takes a buffer of make_uniform_buffer or make_prioritized_buffer, got "
            f"{type(buffer).__name__}"
        )
    return _build(shard, mesh, axis_name, n, capacity)


def _split(batch: int, n: int, name: str) -> int:
    """The per-device share of a batch of ``batch`` rows (ValueError unless divisible)."""
    batch = check_static_int(batch, name)
    if batch % n:
        raise ValueError(f"{name} {batch} is not divisible by the {n} devices of the mesh axis")
    return batch // n


def _build(shard: Any, mesh: Mesh, axis: str, n: int, capacity: int) -> MeshBuffer:
    rows = capacity // n
    spec, rep = PartitionSpec(axis), PartitionSpec()
    prioritized = isinstance(shard, PrioritizedBuffer)

    def mapped(f: Callable, in_specs: tuple, out_specs: Any) -> Callable:
        return shard_map(f, mesh, in_specs, out_specs)

    # -- per-device halves ---------------------------------------------------------------

    def shard_add(block: Any, items: Any, episode_end: Any = None) -> Any:
        return _block(shard.add(_local(block), items, episode_end))

    def shard_can_sample(block: Any, batch_size: int, scope: str = "mesh") -> jax.Array:
        size = _local(block).size
        total = jax.lax.psum(size, axis)
        ok = total >= jnp.maximum(batch_size * n, 1)
        if scope == "shard":
            ok = ok & (jax.lax.pmin(size, axis) >= 1)
        return ok

    def shard_sample_uniform(
        block: Any, key: jax.Array, batch_size: int, scope: str = "shard"
    ) -> Any:
        check_choice(scope, "scope", UNIFORM_SCOPES)
        state = _local(block)
        check_state(state, rows)
        batch_size = check_static_int(batch_size, "batch_size")
        if scope == "shard":
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))
            return gather_rows(state.items, random_index(key, (batch_size,), state.size))
        sizes = jax.lax.all_gather(state.size, axis)
        ends = jnp.cumsum(sizes)
        draw = random_index(key, (batch_size * n,), ends[-1])
        owner = jnp.minimum(jnp.searchsorted(ends, draw, side="right"), n - 1)
        owner = owner.astype(jnp.int32)
        local = draw - (ends[owner] - sizes[owner])

        def resolve(slots: jax.Array) -> tuple:
            return gather_rows(state.items, slots), jnp.zeros(slots.shape, jnp.float32)

        return _serve(owner, local, resolve, axis, n, round_rows(batch_size * n, n))[0]

    def shard_sample_prioritized(
        block: Any, key: jax.Array, batch_size: int, beta: Any = None, scope: str = "mesh"
    ) -> PrioritizedSample:
        check_choice(scope, "scope", UNIFORM_SCOPES)
        state = _local(block)
        check_state(state, rows)
        batch_size = check_static_int(batch_size, "batch_size")
        if beta is None:
            beta_ = jnp.float32(shard.beta)
        else:
            beta_ = jnp.nan_to_num(jnp.maximum(jnp.asarray(beta, jnp.float32), 0), nan=0.0)
        me = jax.lax.axis_index(axis)
        u = random_uniform(key, batch_size * n)  # the same on every device

        def resolve(u: jax.Array) -> tuple:
            slots, value = sum_tree_inverse_cdf(state.tree, u, return_values=True)
            row = dict(
                items=gather_rows(state.items, slots),
                index=slots + me * rows,
                value=value,
                version=slot_versions(state, slots),
            )
            return row, value

        if scope == "shard":  # this device's share of the uniforms, down its own tree
            got, value = resolve(jax.lax.dynamic_slice_in_dim(u, me * batch_size, batch_size))
            low = jnp.min(value)
        else:
            totals = jax.lax.all_gather(sum_tree_total(state.tree), axis)
            ends = jnp.cumsum(totals)
            target = u * ends[-1]
            last = jnp.max(jnp.where(totals > 0, jnp.arange(n), 0))
            owner = jnp.minimum(jnp.searchsorted(ends, target, side="right"), last)
            owner = owner.astype(jnp.int32)
            mass = totals[owner]
            u = jnp.where(
                mass > 0, (target - (ends[owner] - mass)) / jnp.where(mass > 0, mass, 1), 0
            )
            got, low = _serve(owner, u, resolve, axis, n, round_rows(batch_size * n, n))
        # (N P)^-beta / max (N P)^-beta == (p / min p)^-beta over the batch (the whole one, or
        # with scope="shard" the device's rows: N_s and the shard's total cancel likewise)
        ratio = jnp.where(low > 0, got["value"] / jnp.where(low > 0, low, 1), 1)
        weights = jnp.where(ratio > 1, jnp.power(ratio, -beta_), 1.0)
        return PrioritizedSample(got["items"], got["index"], weights, got["version"])

    def shard_update(
        block: Any,
        indices: jax.Array,
        priorities: jax.Array,
        versions: Any = None,
        scope: str = "mesh",
    ) -> Any:
        check_choice(scope, "scope", UNIFORM_SCOPES)
        state = _local(block)
        check_pairs_up(priorities, indices, "priorities")
        indices = checked_indices(indices, capacity)[0]
        if scope == "shard":  # this device's entries of its own slots; nothing crosses
            me = jax.lax.axis_index(axis)
            local = jnp.where(indices // rows == me, indices - me * rows, -1)
            return _block(shard.update(state, local, priorities, versions))
        count = indices.shape[0]
        p = jnp.asarray(priorities, jnp.float32).reshape(-1)
        p = jnp.broadcast_to(p, (count,)) if p.shape[0] == 1 else p
        words = [indices, jax.lax.bitcast_convert_type(p, jnp.int32)]
        if versions is not None:
            words.append(checked_versions(versions, indices))
        # one all-gather of every device's indices, priorities (and versions)
        words = jax.lax.all_gather(jnp.stack(words), axis, axis=1, tiled=True)
        me = jax.lax.axis_index(axis)
        mine = (words[0] >= 0) & (words[0] // rows == me)
        words = words.at[0].add(-me * rows)  # slots of this shard
        rank = jnp.cumsum(mine, dtype=jnp.int32) - 1  # among this shard's entries
        per_round = round_rows(count * n, n)
        fill = jnp.array([-1, 0, -1][: words.shape[0]], jnp.int32)[:, None]

        def one_round(r: jax.Array, state: Any) -> Any:
            # this shard's entries, in their order (the last of duplicates wins): one scatter
            slot = jnp.where(mine & (rank >= r * per_round), rank - r * per_round, per_round)
            taken = jnp.broadcast_to(fill, (fill.shape[0], per_round))
            taken = taken.at[:, slot].set(words, mode="drop")
            p = jax.lax.bitcast_convert_type(taken[1], jnp.float32)
            return shard.update(state, taken[0], p, None if versions is None else taken[2])

        rounds = (rank[-1] + per_round) // per_round
        new = jax.lax.fori_loop(0, rounds, one_round, state)
        return _block(new.replace(max_priority=jax.lax.pmax(new.max_priority, axis)))

    # -- whole sharded states --------------------------------------------------------------

    def stacked(example: Any) -> Any:
        state = shard.init(example)
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), state)

    compiled_init = jax.jit(stacked, out_shardings=NamedSharding(mesh, spec))

    def init(example_item: Any) -> Any:
        return compiled_init(example_item)

    def add(state: Any, items: Any, episode_end: Any = None) -> Any:
        for x in jax.tree_util.tree_leaves(items):
            _split(jnp.shape(x)[0] if jnp.ndim(x) else 0, n, "the batch size of items")
        if episode_end is None:
            return mapped(shard_add, (spec, spec), spec)(state, items)
        end = jnp.broadcast_to(
            jnp.asarray(episode_end), jnp.shape(jax.tree_util.tree_leaves(items)[0])[:1]
        )
        return mapped(shard_add, (spec, spec, spec), spec)(state, items, end)

    def can_sample(state: Any, batch_size: int, scope: str = "mesh") -> jax.Array:
        ok = jnp.sum(state.size) >= jnp.maximum(batch_size, 1)
        return ok & (jnp.min(state.size) >= 1) if scope == "shard" else ok

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def sample_uniform(state: Any, key: jax.Array, batch_size: int, scope: str = "shard") -> Any:
        check_choice(scope, "scope", UNIFORM_SCOPES)
        share = _split(batch_size, n, "batch_size")
        f = functools.partial(shard_sample_uniform, batch_size=share, scope=scope)
        return mapped(f, (spec, rep), spec)(state, key)

    def sample_prioritized(
        state: Any, key: jax.Array, batch_size: int, beta: Any = None, scope: str = "mesh"
    ) -> PrioritizedSample:
        check_beta(beta)
        check_choice(scope, "scope", UNIFORM_SCOPES)
        return compiled_sample(state, key, _split(batch_size, n, "batch_size"), scope, beta)

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def compiled_sample(state: Any, key: jax.Array, share: int, scope: str, beta: Any) -> Any:
        def f(block: Any, key: jax.Array, beta: Any) -> PrioritizedSample:
            return shard_sample_prioritized(block, key, share, beta, scope)

        return mapped(f, (spec, rep, rep), spec)(state, key, beta)

    def update(
        state: Any, indices: Any, priorities: Any, versions: Any = None, scope: str = "mesh"
    ) -> Any:
        check_choice(scope, "scope", UNIFORM_SCOPES)
        # host input is checked in its own dtype; device arrays inside the jitted function
        if not isinstance(indices, (jax.Array, jax.core.Tracer)):
            indices = checked_indices(indices, capacity)[0]
        if versions is not None and not isinstance(versions, (jax.Array, jax.core.Tracer)):
            versions = checked_versions(versions, indices)
        check_pairs_up(priorities, indices, "priorities")
        _split(int(np.prod(np.shape(indices))), n, "the number of indices")
        return compiled_update(state, indices, priorities, versions, scope)

    def flat(indices: Any, priorities: Any) -> tuple[Any, Any]:
        indices = jnp.reshape(indices, (-1,))
        p = jnp.reshape(jnp.asarray(priorities, jnp.float32), (-1,))
        return indices, jnp.broadcast_to(p, indices.shape)

    @functools.partial(jax.jit, static_argnums=4)
    def compiled_update(
        state: Any, indices: Any, priorities: Any, versions: Any, scope: str
    ) -> Any:
        def f(block: Any, indices: Any, priorities: Any, versions: Any) -> Any:
            return shard_update(block, indices, priorities, versions, scope)

        if versions is not None:
            versions = jnp.reshape(versions, (-1,))
        return mapped(f, (spec,) * 4, spec)(state, *flat(indices, priorities), versions)

    def put(state: Any) -> Any:
        shards = np.shape(getattr(state, "size", None))
        if shards != (n,):
            raise ValueError(
                f"the state holds {shards[0] if shards else 'no'} shards (size has shape "
                f"{shards}), the mesh axis {axis!r} has {n} devices: a sharded state is "
                "restored onto a mesh of the same size"
            )
        expected = jax.eval_shape(stacked, _example(state))
        shapes = jax.tree_util.tree_map(lambda x: (np.shape(x), np.dtype(x.dtype)), state)
        wanted = jax.tree_util.tree_map(lambda x: (x.shape, np.dtype(x.dtype)), expected)
        if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(expected) or (
            jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
            != jax.tree_util.tree_leaves(wanted, is_leaf=lambda x: isinstance(x, tuple))
        ):
            raise ValueError(
                f"the state does not fit this buffer: expected a {type(expected).__name__} "
                f"of {n} shards of {rows} rows"
            )
        state.__checkpoint_check__()
        return jax.device_put(state, NamedSharding(mesh, spec))

    return MeshBuffer(
        init=init,
        add=jax.jit(add),
        sample=sample_prioritized if prioritized else sample_uniform,
        can_sample=can_sample,
        update=update if prioritized else None,
        put=put,
        shard_add=shard_add,
        shard_sample=shard_sample_prioritized if prioritized else shard_sample_uniform,
        shard_update=shard_update if prioritized else None,
        shard_can_sample=shard_can_sample,
        shard=shard,
        mesh=mesh,
        axis_name=axis,
        num_shards=n,
        capacity=capacity,
    )


def _example(state: Any) -> Any:
    """An example item (shape and dtype) of a stacked state's items, for structure checks."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x)[2:], x.dtype), state.items
    )
