"""What the mesh-sharded buffers (:mod:`coax_utils.replay._mesh`) need of each kind of
jittable buffer: the buffer of one shard, its rows at given slots, and how its arguments
and state are laid out. The mesh logic itself is one implementation for every kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_pairs_up
from coax_utils.replay._frames_functional import (
    FrameStackBuffer,
    PrioritizedFrameStackBuffer,
    make_frame_stack_buffer,
    make_prioritized_frame_stack_buffer,
)
from coax_utils.replay._frames_ring import FrameRing
from coax_utils.replay._functional import (
    PrioritizedBuffer,
    PrioritizedSample,
    UniformBuffer,
    make_prioritized_buffer,
    make_uniform_buffer,
)
from coax_utils.replay._functional_common import gather_rows
from coax_utils.replay._seq_functional import (
    PrioritizedSequenceBuffer,
    SequenceBuffer,
    make_prioritized_sequence_buffer,
    make_sequence_buffer,
)

__all__ = ["Kind", "kind_of"]

KINDS = (
    "make_uniform_buffer, make_prioritized_buffer, make_frame_stack_buffer, "
    "make_prioritized_frame_stack_buffer, make_sequence_buffer or "
    "make_prioritized_sequence_buffer"
)


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of buffer, as the mesh code sees it.

    ``shard`` is the buffer of one shard (same factory, ``capacity / n``, for sequences
    ``num_envs / n``); ``add_args`` binds the arguments of ``add`` after the state (the
    single buffer's signature) to a tuple, whose positions ``flags`` may be a scalar for
    all rows; ``rows_per_add`` is the rows ``add`` takes (None: any). ``inner(state)`` has
    ``size``, ``pos``, ``laps`` and, prioritized, ``tree``; ``gather(state, slots,
    versions)`` is the sample of local ``slots`` (weights 1), with ``indices`` when
    ``indexed``; ``example(state, lead)`` the arguments of ``shard.init`` that make a state
    shaped like ``state`` without its ``lead`` leading axes; ``lost(state, slots)``, where
    not None, the slots a uniform sample redraws. Prioritized: ``update_args`` binds the
    arguments of ``update`` to ``(indices, values, versions, scope)``, ``values(values,
    indices)`` checks them against the indices and flattens them to one row per index,
    ``update(state, slots, values, versions)`` is the shard's update and
    ``set_top(state, fn)`` applies ``fn`` to the largest priority given to new rows.
    """

    shard: Any
    prioritized: bool
    add_args: Callable[..., tuple]
    flags: tuple[int, ...]
    rows_per_add: int | None
    inner: Callable[[Any], Any]
    gather: Callable[[Any, jax.Array, Any], Any]
    example: Callable[[Any, int], tuple]
    indexed: bool
    lost: Callable[[Any, jax.Array], jax.Array] | None = None
    update_args: Callable[..., tuple] | None = None
    values: Callable[[tuple, Any], tuple] | None = None
    update: Callable[..., Any] | None = None
    set_top: Callable[[Any, Callable], Any] | None = None


def _trim(tree: Any, lead: int) -> Any:
    """Shapes and dtypes of ``tree``'s leaves without their ``lead`` leading axes."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[lead:], x.dtype), tree)


def _count(indices: Any) -> int:
    return int(np.prod(np.shape(indices), dtype=np.int64))


def _items_args(items: Any, episode_end: Any = None) -> tuple:
    return items, episode_end


def _transitions_args(transition_batch: Any) -> tuple:
    return (transition_batch,)


def _steps_args(
    steps: Any,
    core_state: Any = None,
    terminated: Any = None,
    truncated: Any = None,
    active: Any = None,
) -> tuple:
    return steps, core_state, terminated, truncated, active


def _priority_args(
    indices: Any, priorities: Any, versions: Any = None, scope: str = "mesh"
) -> tuple:
    return indices, (priorities,), versions, scope


def _td_args(
    indices: Any, td_errors: Any, versions: Any = None, mask: Any = None, scope: str = "mesh"
) -> tuple:
    return indices, (td_errors, mask), versions, scope


def _priorities(values: tuple, indices: Any) -> tuple:
    (p,) = values
    check_pairs_up(p, indices, "priorities")
    p = jnp.reshape(jnp.asarray(p, jnp.float32), (-1,))
    return (jnp.broadcast_to(p, (_count(indices),)),)


def _max_priority(state: Any, fn: Callable) -> Any:
    return state.replace(max_priority=fn(state.max_priority))


def kind_of(buffer: Any, n: int, axis: str) -> Kind:
    """The :class:`Kind` of ``buffer`` sharded over ``n`` devices (of the axis ``axis``).

    Raises TypeError for another object, ValueError for a buffer that cannot be split so
    (the capacity, or a sequence buffer's ``num_envs``, not divisible by ``n``).
    """
    if isinstance(buffer, (UniformBuffer, PrioritizedBuffer)):
        make = _plain
    elif isinstance(buffer, (FrameStackBuffer, PrioritizedFrameStackBuffer)):
        make = _frames
    elif isinstance(buffer, (SequenceBuffer, PrioritizedSequenceBuffer)):
        make = _sequences
    else:
        raise TypeError(f"shard_buffer takes a buffer of {KINDS}, got {type(buffer).__name__}")
    for name in ("capacity", "num_envs"):
        value = getattr(buffer, name, n)
        if value % n:
            raise ValueError(
                f"{name} {value} is not divisible by the {n} devices of mesh axis {axis!r}"
            )
    return make(buffer, n)


def _plain(buffer: UniformBuffer | PrioritizedBuffer, n: int) -> Kind:
    rows = buffer.capacity // n

    def example(state: Any, lead: int) -> tuple:
        return (_trim(state.items, lead + 1),)

    common = dict(add_args=_items_args, flags=(1,), rows_per_add=None, example=example)
    if not isinstance(buffer, PrioritizedBuffer):
        return Kind(
            shard=make_uniform_buffer(rows),
            prioritized=False,
            inner=lambda state: state,
            gather=lambda state, slots, versions: gather_rows(state.items, slots),
            indexed=False,
            **common,
        )
    shard = make_prioritized_buffer(
        rows, buffer.alpha, buffer.beta, buffer.epsilon, buffer.tree_strategy
    )

    def gather(state: Any, slots: jax.Array, versions: Any) -> PrioritizedSample:
        weights = jnp.ones(slots.shape, jnp.float32)
        return PrioritizedSample(gather_rows(state.items, slots), slots, weights, versions)

    return Kind(
        shard=shard,
        prioritized=True,
        inner=lambda state: state,
        gather=gather,
        indexed=True,
        update_args=_priority_args,
        values=_priorities,
        update=lambda state, slots, values, versions: shard.update(
            state, slots, values[0], versions
        ),
        set_top=_max_priority,
        **common,
    )


def _frames(buffer: FrameStackBuffer | PrioritizedFrameStackBuffer, n: int) -> Kind:
    C, k, F = buffer.capacity, buffer.stack_size, buffer.frame_capacity
    rows = C // n
    # each shard stores the frames of its own transitions: its share of frame_capacity, or
    # with the default frame_capacity the default for its capacity
    frames = None if F == C + C // 64 + 2 * k else -(-F // n)
    if frames is not None and frames < 2 * k:
        raise ValueError(
            f"frame_capacity {F} leaves {frames} frames to each of {n} devices, fewer than "
            f"2 * stack_size = {2 * k}"
        )

    def example(state: Any, lead: int) -> tuple:
        items, stored = state.transitions.items, state.frames
        shape = (np.shape(items.S)[-1],) + np.shape(stored)[lead + 1 :]
        stack = jax.ShapeDtypeStruct(shape, stored.dtype)
        return (_trim(items, lead + 1).replace(S=stack, S_next=stack),)

    common = dict(
        add_args=_transitions_args,
        flags=(),
        rows_per_add=None,
        inner=lambda state: state.transitions,
        example=example,
    )
    if not isinstance(buffer, PrioritizedFrameStackBuffer):
        shard = make_frame_stack_buffer(rows, k, frames, buffer.window)
        ring = FrameRing.make(rows, k, shard.frame_capacity, shard.window)
        return Kind(
            shard=shard,
            prioritized=False,
            gather=lambda state, slots, versions: shard.gather(state, slots),
            indexed=False,
            lost=lambda state, slots: ring.lost(state.transitions.items, state.frame_count, slots),
            **common,
        )
    shard = make_prioritized_frame_stack_buffer(
        rows,
        k,
        buffer.alpha,
        buffer.beta,
        buffer.epsilon,
        frames,
        buffer.window,
        buffer.tree_strategy,
    )
    return Kind(
        shard=shard,
        prioritized=True,
        gather=lambda state, slots, versions: shard.gather(state, slots, None, versions),
        indexed=True,
        update_args=_priority_args,
        values=_priorities,
        update=lambda state, slots, values, versions: shard.update(
            state, slots, values[0], versions
        ),
        set_top=lambda state, fn: state.replace(transitions=_max_priority(state.transitions, fn)),
        **common,
    )


def _sequences(buffer: SequenceBuffer | PrioritizedSequenceBuffer, n: int) -> Kind:
    E, L = buffer.num_envs, buffer.length
    config = (buffer.capacity // n, L, buffer.period, buffer.burn_in, E // n)

    def example(state: Any, lead: int) -> tuple:
        # from the chains' windows (leaves (num_envs, length, ...)): whatever the layout
        # of the stored ones
        return _trim(state.pending, lead + 2), _trim(state.pending_core, lead + 2)

    common = dict(
        add_args=_steps_args,
        flags=(2, 3, 4),
        rows_per_add=E,
        inner=lambda state: state,
        example=example,
        indexed=True,
    )
    if not isinstance(buffer, PrioritizedSequenceBuffer):
        shard = make_sequence_buffer(*config)
        return Kind(
            shard=shard,
            prioritized=False,
            gather=lambda state, slots, versions: shard.gather(state, slots),
            **common,
        )
    shard = make_prioritized_sequence_buffer(
        *config, buffer.alpha, buffer.beta, buffer.epsilon, buffer.eta, buffer.tree_strategy
    )

    def values(values: tuple, indices: Any) -> tuple:
        td, mask = values
        shape = (_count(indices), L)
        if np.shape(td) != shape or not jnp.issubdtype(jnp.result_type(td), jnp.number):
            raise ValueError(
                f"td_errors must be numbers of shape {shape} (one per step of each window), "
                f"got {jnp.result_type(td)} of shape {np.shape(td)}"
            )
        if mask is None:
            mask = jnp.ones(shape, jnp.bool_)
        elif np.shape(mask) != shape or jnp.result_type(mask) != jnp.bool_:
            raise ValueError(
                f"mask must be bools of shape {shape}, got {jnp.result_type(mask)} of shape "
                f"{np.shape(mask)}"
            )
        return jnp.asarray(td, jnp.float32), jnp.asarray(mask)

    return Kind(
        shard=shard,
        prioritized=True,
        gather=lambda state, slots, versions: shard.gather(state, slots, None, versions),
        update_args=_td_args,
        values=values,
        update=lambda state, slots, values, versions: shard.update(
            state, slots, values[0], versions, values[1]
        ),
        set_top=lambda state, fn: state.replace(max_mix=fn(state.max_mix)),
        **common,
    )
