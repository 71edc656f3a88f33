r"""Jittable replay buffers sharded over a :class:`jax.sharding.Mesh` along one named axis.

:func:`shard_buffer` wraps a jittable buffer (uniform, prioritized, frame-stacked or
sequence) so that its storage lives on the devices of one mesh axis: each of the ``n``
devices holds a buffer of ``capacity / n`` rows (a *shard*) made by the same factory, and
the state is the per-shard state with a leading axis of size ``n`` sharded over the mesh
axis. Every function runs the existing single-buffer functions on each shard through
``shard_map``; only what must cross devices does, with one collective each:

- ``add``: nothing crosses; each device writes its slice of a batch sharded on the axis
  (for sequence buffers, the steps of its ``num_envs / n`` sub-envs).
- prioritized ``sample``: the per-shard total priorities are gathered (``n`` floats), the
  ``B`` uniform numbers are drawn from the same key on every device, and each draw goes to
  the shard whose range of the global cumulative priority it falls in, then down that
  shard's sum tree. The sampled rows are gathered to the devices that return them. The
  distribution, indices and importance weights are those of one buffer holding the same
  items with the same priorities.
- ``update``: the sample's indices and priorities (for sequences TD errors and masks) are
  gathered; each device keeps those of its own slots; the largest priority is shared so
  that new items get the global maximum.
- with ``scope="shard"`` (uniform ``sample``; prioritized ``sample`` and ``update``)
  nothing crosses: each device is a buffer of its own, as under ``pmap``.

Sharded draws are served in rounds of a fixed number of rows per device (about the mean
``B / n`` plus four standard deviations); a draw pattern that sends more to one shard (very
unequal totals) takes more rounds, never another distribution. The kinds differ only in
what :mod:`._mesh_kinds` says of them; the routing is in :mod:`._mesh_serve`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coax_utils._checks import check_choice, checked_indices
from coax_utils._random import random_index, random_uniform
from coax_utils.replay._frames_functional import REJECTION_ROUNDS
from coax_utils.replay._functional_common import (
    check_beta,
    check_static_int,
    checked_versions,
    slot_versions,
)
from coax_utils.replay._mesh_kinds import Kind, kind_of
from coax_utils.replay._mesh_serve import block, local, round_rows, route, serve, shard_map
from coax_utils.utils import sum_tree_inverse_cdf, sum_tree_total

__all__ = ["MeshBuffer", "shard_buffer"]

UNIFORM_SCOPES = ("shard", "mesh")


@dataclasses.dataclass(frozen=True)
class MeshBuffer:
    """A jittable replay buffer sharded over the devices of one mesh axis.

    Made by :func:`shard_buffer`; see there. ``init``, ``add``, ``sample``,
    ``can_sample``, ``update`` (prioritized only), ``reset_chains`` (sequence buffers only)
    and ``put`` take and return whole sharded states; ``shard_add``, ``shard_sample``,
    ``shard_update``, ``shard_can_sample`` and ``shard_reset_chains`` are their per-device
    halves, for use inside a caller's own ``shard_map`` over ``mesh``.
    """

    init: Callable[..., Any]
    add: Callable[..., Any]
    sample: Callable[..., Any]
    can_sample: Callable[..., jax.Array]
    update: Callable[..., Any] | None
    put: Callable[[Any], Any]
    shard_add: Callable[..., Any]
    shard_sample: Callable[..., Any]
    shard_update: Callable[..., Any] | None
    shard_can_sample: Callable[..., jax.Array]
    shard: Any
    mesh: Mesh
    axis_name: str
    num_shards: int
    capacity: int
    reset_chains: Callable[..., Any] | None = None
    shard_reset_chains: Callable[..., Any] | None = None

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


def shard_buffer(buffer: Any, mesh: Mesh, axis_name: str) -> MeshBuffer:
    r"""Shard a jittable buffer's capacity over the devices of the mesh axis ``axis_name``.

    ``buffer`` is made by :func:`make_uniform_buffer`, :func:`make_prioritized_buffer`,
    :func:`make_frame_stack_buffer`, :func:`make_prioritized_frame_stack_buffer`,
    :func:`make_sequence_buffer` or :func:`make_prioritized_sequence_buffer` with the
    *total* capacity (and, for sequences, the total ``num_envs``); each of the ``n``
    devices of the axis holds a buffer of ``capacity / n`` rows made by the same factory
    with the same other arguments, except that a sequence shard has ``num_envs / n``
    sub-envs (device ``d`` owns sub-envs ``d * num_envs / n`` to ``(d + 1) * num_envs / n
    - 1``) and a frame-stack shard stores ``frame_capacity / n`` frames (rounded up; with
    the default ``frame_capacity``, the default for ``capacity / n``). The state is that
    buffer's state with a leading axis of size ``n`` (``items`` leaves of shape
    ``(n, capacity / n, ...)``, ``size`` of shape ``(n,)``, ...), sharded over the axis and
    replicated over the mesh's other axes; it checkpoints with
    :func:`coax_utils.utils.dump` like any state and comes back onto the mesh with ``put``.
    The returned :class:`MeshBuffer` holds, all jitted and donation-friendly
    (``jax.jit(buffer.add, donate_argnums=0)``):

    - ``init(...) -> state``: empty shards, created on their devices (the arguments of
      the single buffer's ``init``).
    - ``add(state, ...) -> state``: the arguments of the single buffer's ``add`` (items,
      a :class:`TransitionBatch`, or one step per sub-env with its core state and flags),
      with a leading batch axis of ``B`` rows sharded like ``batch_sharding`` (``B`` a
      multiple of ``n``; ``num_envs`` for sequences); device ``d`` writes its ``B / n``
      rows into its own shard (nothing crosses devices). Per-row flags (``episode_end``;
      ``terminated``, ``truncated``, ``active``) may be scalars.
    - ``reset_chains(state, mask=None) -> state`` (sequence buffers): as the single
      buffer's, ``mask`` of shape ``(num_envs,)`` sharded like ``batch_sharding``.
    - uniform ``sample(state, key, batch_size, scope="shard")``: ``batch_size`` rows (the
      single buffer's sample type), sharded on the axis. With ``scope="shard"`` (the
      data-parallel pattern) each device draws its ``batch_size / n`` rows from its own
      shard with its own sample (keys folded with the device's position on the axis); with
      ``scope="mesh"`` every row is drawn uniformly from the whole buffer. A frame stack
      whose frames were overwritten is redrawn as by the single buffer (over the whole
      buffer with ``scope="mesh"``: each round of redraws shares the ``B`` flags with one
      collective; a row still drawing such transitions after 32 rounds gets the newest
      transition of the shard its last draw fell in). A sequence sample's ``indices`` are
      global (``shard * capacity / n + slot``).
    - prioritized ``sample(state, key, batch_size, beta=None, scope="mesh")``: a
      :class:`PrioritizedSample` (frame stacks too) or a :class:`SequenceReplaySample`,
      sharded on the axis, ``indices`` global. With ``scope="mesh"`` (default) the draw is
      over the whole buffer, exactly as one buffer of the total capacity holding the same
      items with the same priorities draws it: the importance weights
      :math:`(N P(i))^{-\beta} / \max_j (N P(j))^{-\beta}` use the global size
      :math:`N`, probabilities :math:`P(i) = p_i / \sum_j p_j` and batch. With
      ``scope="shard"`` each device draws its ``batch_size / n`` rows from its own shard
      :math:`s` with the shard's sample (keys folded with the device's position), as
      flashbax under ``pmap`` does, and nothing crosses devices: the weights are
      :math:`(N_s P_s(i))^{-\beta} / \max_j (N_s P_s(j))^{-\beta}` with the shard's size
      :math:`N_s`, its probabilities :math:`P_s(i) = p_i / \sum_{j \in s} p_j` and the
      maximum over the device's own rows. The default differs from the uniform sample's:
      with balanced adds, a uniform draw per shard keeps every item's probability
      :math:`1 / N`, a prioritized one does not.
    - prioritized ``update(state, indices, priorities, versions=None, scope="mesh")``, for
      sequences ``update(state, indices, td_errors, versions=None, mask=None,
      scope="mesh")`` (TD errors of shape ``(k, length)``; R2D2's mixture is computed by
      the shard that owns the window): the arguments of a sample (sharded like it); the
      rules of the single buffer's ``update`` hold (stale versions, NaN and out-of-range
      entries ignored, the last of duplicate indices wins). With ``scope="mesh"`` each
      entry reaches the device that owns its index and new items get the largest
      priority set anywhere; with ``scope="shard"`` (for the indices of a
      ``scope="shard"`` sample) each device keeps the entries of its block that index its
      own shard, ignores the others, and keeps its own largest priority: nothing crosses.
    - ``can_sample(state, batch_size, scope="mesh") -> bool Array``: whether the buffer
      holds ``batch_size`` items that can be sampled (and, for ``scope="shard"``
      sampling, every shard one).
    - ``put(state) -> state``: a state (e.g. from :func:`coax_utils.utils.load`) checked
      and placed onto the mesh with the state's sharding.

    ``key`` must be the same on every device (e.g. placed with ``replicated``). The
    ``shard_*`` functions are the per-device halves, for use inside a ``shard_map`` over
    ``mesh`` with the state's block (leading axis of size 1) and per-device batch sizes
    (``shard_add`` and ``shard_reset_chains`` take the device's rows, e.g. its sub-envs):
    ``shard_sample(block, key, batch_size)`` returns this device's ``batch_size`` rows of a
    draw of ``n * batch_size``; ``scope`` is a keyword of ``shard_sample``,
    ``shard_update`` and ``shard_can_sample`` as above.

    Parameters
    ----------
    buffer : a jittable buffer
        The buffer to shard, with the total capacity (and ``num_envs``).
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
        If ``buffer`` is not one of the jittable buffers above, or ``mesh`` not a
        :class:`~jax.sharding.Mesh`.
    ValueError
        If ``axis_name`` is not an axis of ``mesh``, or the capacity (a sequence buffer's
        ``num_envs``) is not divisible by the number of its devices.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh
    >>> from coax_utils.replay import make_prioritized_buffer
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
    return _build(kind_of(buffer, n, axis_name), mesh, axis_name, n, buffer.capacity)


def _split(batch: int, n: int, name: str) -> int:
    """The per-device share of a batch of ``batch`` rows (ValueError unless divisible)."""
    batch = check_static_int(batch, name)
    if batch % n:
        raise ValueError(f"{name} {batch} is not divisible by the {n} devices of the mesh axis")
    return batch // n


def _traced(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer))


def _uniform_draws(
    kind: Kind, state: Any, key: jax.Array, total: int, axis: str, n: int
) -> tuple[jax.Array, jax.Array]:
    """The shards and local slots of ``total`` uniform draws over the whole buffer (the same
    on every device). Where ``kind.lost`` says a drawn transition lost frames, it is drawn
    again as by the single buffer's sample, each round's flags shared with one ``psum``;
    slot -1 where draws still fail after the last round."""
    sizes = jax.lax.all_gather(kind.inner(state).size, axis)
    ends = jnp.cumsum(sizes)

    def locate(where: jax.Array) -> tuple:
        owner = jnp.minimum(jnp.searchsorted(ends, where, side="right"), n - 1)
        owner = owner.astype(jnp.int32)
        return owner, where - (ends[owner] - sizes[owner])

    where = random_index(key, (total,), ends[-1])
    if kind.lost is None:
        return locate(where)
    me = jax.lax.axis_index(axis)

    def dead(where: jax.Array) -> jax.Array:
        owner, slots = locate(where)
        mine = owner == me
        lost = mine & kind.lost(state, jnp.where(mine, slots, 0))
        return jax.lax.psum(lost.astype(jnp.int32), axis) > 0

    def again(carry: tuple) -> jax.Array:
        i, _, failed = carry
        return (i < REJECTION_ROUNDS) & jnp.any(failed)

    def redraw(carry: tuple) -> tuple:
        i, where, failed = carry
        new = random_index(jax.random.fold_in(key, i + 1), (total,), ends[-1])
        where = jnp.where(failed, new, where)
        return i + 1, where, dead(where)

    _, where, failed = jax.lax.while_loop(again, redraw, (jnp.int32(0), where, dead(where)))
    owner, slots = locate(where)
    return owner, jnp.where(failed, -1, slots)


def _build(kind: Kind, mesh: Mesh, axis: str, n: int, capacity: int) -> MeshBuffer:
    rows = capacity // n
    shard = kind.shard
    spec, rep = PartitionSpec(axis), PartitionSpec()

    def mapped(f: Callable, in_specs: tuple, out_specs: Any) -> Callable:
        return shard_map(f, mesh, in_specs, out_specs)

    def fits(state: Any, lead: int) -> None:
        """Raise ValueError unless ``state`` (``lead`` leading shard axes) is this buffer's."""
        try:
            expected = jax.eval_shape(shard.init, *kind.example(state, lead))
        except (AttributeError, IndexError, TypeError, ValueError):
            expected = None
        want = (n,) * lead
        ok = expected is not None and (
            jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(expected)
        )
        if ok:
            for x, e in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(expected)):
                ok &= np.shape(x) == want + tuple(e.shape) and np.dtype(x.dtype) == e.dtype
        if not ok:
            raise ValueError(
                f"the state does not fit this buffer: expected a {type(shard).__name__}'s "
                f"state of {rows} rows" + (f" for each of {n} shards" if lead else "")
            )

    def samplable(inner: Any) -> jax.Array:
        """The items of a shard that can be sampled (none when its priorities are all 0)."""
        if kind.prioritized:
            return jnp.where(sum_tree_total(inner.tree) > 0, inner.size, 0)
        return inner.size

    def globalize(sample: Any, me: jax.Array) -> Any:
        return sample.replace(indices=sample.indices + me * rows) if kind.indexed else sample

    # -- per-device halves ---------------------------------------------------------------

    def shard_add(block_: Any, *args: Any, **kwargs: Any) -> Any:
        return block(shard.add(local(block_), *kind.add_args(*args, **kwargs)))

    def shard_can_sample(block_: Any, batch_size: int, scope: str = "mesh") -> jax.Array:
        count = samplable(kind.inner(local(block_)))
        ok = jax.lax.psum(count, axis) >= jnp.maximum(batch_size * n, 1)
        if scope == "shard":
            ok = ok & (jax.lax.pmin(count, axis) >= 1)
        return ok

    def draw(block_: Any, key: jax.Array, batch_size: int, beta: Any, scope: str) -> Any:
        check_choice(scope, "scope", UNIFORM_SCOPES)
        state = local(block_)
        fits(state, 0)
        batch_size = check_static_int(batch_size, "batch_size")
        me = jax.lax.axis_index(axis)
        if scope == "shard":  # the shard's own sample
            key = jax.random.fold_in(key, me)
            more = (beta,) if kind.prioritized else ()
            return globalize(shard.sample(state, key, batch_size, *more), me)
        inner = kind.inner(state)
        total = batch_size * n
        per_round = round_rows(total, n)
        if not kind.prioritized:
            owner, slots = _uniform_draws(kind, state, key, total, axis, n)

            def resolve(slots: jax.Array) -> tuple:
                # -1: draws that kept failing get the shard's newest, as in one buffer
                slots = jnp.where(slots < 0, (inner.pos - 1) % rows, slots)
                return globalize(kind.gather(state, slots, None), me), jnp.zeros(slots.shape)

            return serve(owner, slots, resolve, axis, n, per_round)[0]
        if beta is None:
            beta_ = jnp.float32(shard.beta)
        else:
            beta_ = jnp.nan_to_num(jnp.maximum(jnp.asarray(beta, jnp.float32), 0), nan=0.0)
        u = random_uniform(key, total)  # the same on every device
        totals = jax.lax.all_gather(sum_tree_total(inner.tree), axis)
        ends = jnp.cumsum(totals)
        target = u * ends[-1]
        last = jnp.max(jnp.where(totals > 0, jnp.arange(n), 0))
        owner = jnp.minimum(jnp.searchsorted(ends, target, side="right"), last)
        owner = owner.astype(jnp.int32)
        mass = totals[owner]
        u = jnp.where(mass > 0, (target - (ends[owner] - mass)) / jnp.where(mass > 0, mass, 1), 0)

        def resolve_p(u: jax.Array) -> tuple:
            slots, value = sum_tree_inverse_cdf(inner.tree, u, return_values=True)
            row = globalize(kind.gather(state, slots, slot_versions(inner, slots)), me)
            return (row, value), value

        (got, value), low = serve(owner, u, resolve_p, axis, n, per_round)
        # (N P)^-beta / max (N P)^-beta == (p / min p)^-beta over the whole batch
        ratio = jnp.where(low > 0, value / jnp.where(low > 0, low, 1), 1)
        weights = jnp.where(ratio > 1, jnp.power(ratio, -beta_), 1.0)
        return got.replace(weights=weights.astype(jnp.float32))

    def shard_sample_uniform(
        block_: Any, key: jax.Array, batch_size: int, scope: str = "shard"
    ) -> Any:
        return draw(block_, key, batch_size, None, scope)

    def shard_sample_prioritized(
        block_: Any, key: jax.Array, batch_size: int, beta: Any = None, scope: str = "mesh"
    ) -> Any:
        return draw(block_, key, batch_size, beta, scope)

    def update_block(block_: Any, indices: Any, values: tuple, versions: Any, scope: str) -> Any:
        """The update of flat ``indices`` (int32, -1 for none) with per-entry ``values``."""
        state = local(block_)
        fits(state, 0)
        me = jax.lax.axis_index(axis)
        if scope == "shard":  # this device's entries of its own slots; nothing crosses
            slots = jnp.where(indices // rows == me, indices - me * rows, -1)
            return block(kind.update(state, slots, values, versions))

        def apply(state: Any, entries: dict, slots: jax.Array) -> Any:
            return kind.update(state, slots, entries["values"], entries["versions"])

        entries = dict(index=indices, values=values, versions=versions)
        new = route(entries, lambda e: e["index"], apply, state, axis, n, rows)
        return block(kind.set_top(new, lambda top: jax.lax.pmax(top, axis)))

    def shard_update(block_: Any, *args: Any, **kwargs: Any) -> Any:
        indices, values, versions, scope = kind.update_args(*args, **kwargs)
        check_choice(scope, "scope", UNIFORM_SCOPES)
        values = kind.values(values, indices)
        flat = checked_indices(indices, capacity)[0]
        if versions is not None:
            versions = checked_versions(versions, indices)
        return update_block(block_, flat, values, versions, scope)

    # -- whole sharded states --------------------------------------------------------------

    def stacked(*example: Any, **named: Any) -> Any:
        state = shard.init(*example, **named)
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), state)

    init = jax.jit(stacked, out_shardings=NamedSharding(mesh, spec))

    def add(state: Any, *args: Any, **kwargs: Any) -> Any:
        args = list(kind.add_args(*args, **kwargs))
        leaves = jax.tree_util.tree_leaves(args[0])
        batch = jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else 0
        for i in kind.flags:  # per-row flags may be scalars
            if args[i] is not None:
                args[i] = jnp.broadcast_to(jnp.asarray(args[i]), (batch,))
        for x in jax.tree_util.tree_leaves(args):
            _split(jnp.shape(x)[0] if jnp.ndim(x) else 0, n, "the batch size of the rows added")
        if kind.rows_per_add is not None and batch != kind.rows_per_add:
            raise ValueError(
                f"add takes one row per sub-env: a leading axis of num_envs="
                f"{kind.rows_per_add}, got {batch}"
            )
        given = [i for i, x in enumerate(args) if x is not None]

        def f(block_: Any, *xs: Any) -> Any:
            full = [None] * len(args)
            for i, x in zip(given, xs):
                full[i] = x
            return shard_add(block_, *full)

        return mapped(f, (spec,) * (1 + len(given)), spec)(state, *[args[i] for i in given])

    def shard_reset_chains(block_: Any, mask: Any = None) -> Any:
        return block(shard.reset_chains(local(block_), mask))

    def reset_chains(state: Any, mask: Any = None) -> Any:
        if mask is None:
            return mapped(shard_reset_chains, (spec,), spec)(state)
        mask = jnp.broadcast_to(jnp.asarray(mask), (kind.rows_per_add,))
        return mapped(shard_reset_chains, (spec, spec), spec)(state, mask)

    def can_sample(state: Any, batch_size: int, scope: str = "mesh") -> jax.Array:
        count = jax.vmap(samplable)(kind.inner(state))
        ok = jnp.sum(count) >= jnp.maximum(batch_size, 1)
        return ok & (jnp.min(count) >= 1) if scope == "shard" else ok

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def compiled_sample(state: Any, key: jax.Array, share: int, scope: str, beta: Any) -> Any:
        def f(block_: Any, key: jax.Array, beta: Any) -> Any:
            return draw(block_, key, share, beta, scope)

        return mapped(f, (spec, rep, rep), spec)(state, key, beta)

    def sample_uniform(state: Any, key: jax.Array, batch_size: int, scope: str = "shard") -> Any:
        check_choice(scope, "scope", UNIFORM_SCOPES)
        return compiled_sample(state, key, _split(batch_size, n, "batch_size"), scope, None)

    def sample_prioritized(
        state: Any, key: jax.Array, batch_size: int, beta: Any = None, scope: str = "mesh"
    ) -> Any:
        check_beta(beta)
        check_choice(scope, "scope", UNIFORM_SCOPES)
        return compiled_sample(state, key, _split(batch_size, n, "batch_size"), scope, beta)

    def update(state: Any, *args: Any, **kwargs: Any) -> Any:
        indices, values, versions, scope = kind.update_args(*args, **kwargs)
        check_choice(scope, "scope", UNIFORM_SCOPES)
        shape = np.shape(indices)
        # host input is checked in its own dtype; device arrays inside the jitted function
        if not _traced(indices):
            indices = checked_indices(indices, capacity)[0]
        if versions is not None and not _traced(versions):
            versions = checked_versions(versions, indices)
        _split(int(np.prod(shape, dtype=np.int64)), n, "the number of indices")
        return compiled_update(state, indices, values, versions, scope, shape)

    @functools.partial(jax.jit, static_argnums=(4, 5))
    def compiled_update(
        state: Any, indices: Any, values: Any, versions: Any, scope: str, shape: tuple
    ) -> Any:
        values = kind.values(values, jax.ShapeDtypeStruct(shape, jnp.int32))
        indices = checked_indices(jnp.reshape(indices, (-1,)), capacity)[0]
        if versions is not None:
            versions = jnp.reshape(versions, (-1,))

        def f(block_: Any, indices: Any, values: Any, versions: Any = None) -> Any:
            return update_block(block_, indices, values, versions, scope)

        args = (indices, values) + (() if versions is None else (versions,))
        return mapped(f, (spec,) * (1 + len(args)), spec)(state, *args)

    def put(state: Any) -> Any:
        try:
            shards = np.shape(kind.inner(state).size)
        except AttributeError:
            shards = ()
        if shards != (n,):
            raise ValueError(
                f"the state holds {shards[0] if shards else 'no'} shards (size has shape "
                f"{shards}), the mesh axis {axis!r} has {n} devices: a sharded state is "
                "restored onto a mesh of the same size"
            )
        fits(state, 1)
        state.__checkpoint_check__()
        return jax.device_put(state, NamedSharding(mesh, spec))

    prioritized, chains = kind.prioritized, hasattr(shard, "reset_chains")
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
        reset_chains=jax.jit(reset_chains) if chains else None,
        shard_reset_chains=shard_reset_chains if chains else None,
    )
