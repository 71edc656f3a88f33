r"""Jittable sequence replay buffers: the twins of the host sequence buffers.

Same windowing rule (:mod:`._seq_common`), same storage layout (whole windows, the core
state at their first step), same R2D2 priorities, as pure functions over pytree states.
Checks of restored states: :mod:`._seq_functional_checks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from coax_utils._checks import check_choice, check_float, checked_indices
from coax_utils._dataclass import pytree_dataclass
from coax_utils._random import random_index, random_uniform
from coax_utils._rows import RowLayout
from coax_utils.replay._functional_common import (
    VERSION_MAX,
    check_beta,
    checked_versions,
    compiled,
    slot_versions,
)
from coax_utils.replay._seq_common import (
    END_TERMINATED,
    END_TRUNCATED,
    SequenceReplaySample,
    check_config,
    check_eta,
)
from coax_utils.replay._seq_functional_checks import check_restored_sequence_state
from coax_utils.replay._seq_layout import META_LAYOUT, decoded_windows, window_layout
from coax_utils.utils import (
    SUM_TREE_STRATEGIES,
    SumTreeState,
    sum_tree_init,
    sum_tree_inverse_cdf,
    sum_tree_set,
)

__all__ = [
    "PrioritizedSequenceBuffer",
    "PrioritizedSequenceBufferState",
    "SequenceBuffer",
    "SequenceBufferState",
    "make_prioritized_sequence_buffer",
    "make_sequence_buffer",
]


@pytree_dataclass
class SequenceBufferState:
    """State of a :func:`make_sequence_buffer` buffer (a pytree).

    Attributes
    ----------
    windows : uint32 Array, shape ``(capacity, width)``
        The stored windows, a row of words per slot, so that a sample reads each window
        with one gather: the number of valid steps (0 in empty slots), how the episode
        ended at the last valid step (0 not there, 1 terminated, 2 truncated), whether the
        window starts its episode, its ``length`` steps (those past the valid ones hold the
        last valid one, the padding samples return) and the core state at its first step,
        each leaf in whole words. The properties ``seq_len`` (int32), ``seq_end`` (int8),
        ``seq_first`` (bool), ``steps`` (leaves ``(capacity, length, ...)``) and ``core``
        (leaves ``(capacity, ...)``) decode them for all slots.
    pending, pending_core : pytree
        Every chain's current window: leaves ``(num_envs, length, ...)``.
    chain_n : int32 Array, shape ``(num_envs,)``
        The steps in each chain's current window (negative: steps to skip, for
        ``period > length``).
    chain_first : bool Array, shape ``(num_envs,)``
        Whether each chain's current window starts its episode.
    chain_start : int32 Array, shape ``(num_envs,)``
        Where each chain's current window starts in its row of ``pending`` (a ring of
        ``length`` steps: step ``t`` of the window lies at ``(chain_start + t) % length``).
    pos, size, laps : int32 Array
        The write head, the number of stored windows and the laps of the write head (the
        slot versions follow, as in :class:`PrioritizedBufferState`).

    A restored state is checked before use (``__checkpoint_check__``; the invariants are
    listed in ``coax_utils/replay/_seq_functional_checks.py``).
    """

    windows: jax.Array
    pending: Any
    pending_core: Any
    chain_n: jax.Array
    chain_first: jax.Array
    chain_start: jax.Array
    pos: jax.Array
    size: jax.Array
    laps: jax.Array

    steps = property(lambda self: decoded_windows(self)["steps"], doc="The stored steps, decoded.")
    core = property(
        lambda self: decoded_windows(self)["core"], doc="The stored core states, decoded."
    )
    seq_len = property(lambda self: decoded_windows(self)["seq_len"], doc="Valid steps per slot.")
    seq_end = property(lambda self: decoded_windows(self)["seq_end"], doc="End kind per slot.")
    seq_first = property(lambda self: decoded_windows(self)["seq_first"], doc="First window flags.")

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state keeps the buffer's invariants."""
        check_restored_sequence_state(self, prioritized=False)


@pytree_dataclass
class PrioritizedSequenceBufferState:
    """State of a :func:`make_prioritized_sequence_buffer` buffer (a pytree).

    The fields of :class:`SequenceBufferState`, plus ``tree`` (the priorities
    :math:`p_i`, 0 in empty slots) and ``max_mix`` (float32: the largest TD-error mixture
    set so far, 1 initially, given to new windows).
    """

    windows: jax.Array
    pending: Any
    pending_core: Any
    chain_n: jax.Array
    chain_first: jax.Array
    chain_start: jax.Array
    pos: jax.Array
    size: jax.Array
    laps: jax.Array
    tree: SumTreeState
    max_mix: jax.Array

    steps, core = SequenceBufferState.steps, SequenceBufferState.core
    seq_len, seq_end = SequenceBufferState.seq_len, SequenceBufferState.seq_end
    seq_first = SequenceBufferState.seq_first

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state keeps the buffer's invariants."""
        check_restored_sequence_state(self, prioritized=True)


@dataclasses.dataclass(frozen=True)
class SequenceBuffer:
    """A jittable sequence replay buffer (see :func:`make_sequence_buffer`)."""

    init: Callable[..., SequenceBufferState]
    add: Callable[..., SequenceBufferState]
    reset_chains: Callable[..., SequenceBufferState]
    sample: Callable[..., SequenceReplaySample]
    can_sample: Callable[..., jax.Array]
    gather: Callable[..., SequenceReplaySample]
    capacity: int
    length: int
    period: int
    burn_in: int
    num_envs: int


@dataclasses.dataclass(frozen=True)
class PrioritizedSequenceBuffer:
    """A jittable prioritized sequence buffer (see :func:`make_prioritized_sequence_buffer`)."""

    init: Callable[..., PrioritizedSequenceBufferState]
    add: Callable[..., PrioritizedSequenceBufferState]
    reset_chains: Callable[..., PrioritizedSequenceBufferState]
    sample: Callable[..., SequenceReplaySample]
    can_sample: Callable[..., jax.Array]
    gather: Callable[..., SequenceReplaySample]
    update: Callable[..., PrioritizedSequenceBufferState]
    capacity: int
    length: int
    period: int
    burn_in: int
    num_envs: int
    alpha: float
    beta: float
    epsilon: float
    eta: float
    tree_strategy: str


def _check_tree(tree: Any, example: Any, rows: tuple, skip: int, what: str) -> None:
    """Trace-time check that ``tree``'s leaves are ``example``'s with their ``skip`` leading
    axes replaced by ``rows``."""
    if jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(example):
        raise ValueError(
            f"{what} differ in structure from the buffer's: expected "
            f"{jax.tree_util.tree_structure(example)}, got {jax.tree_util.tree_structure(tree)}"
        )
    for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(example)):
        want = rows + s.shape[skip:]
        if jnp.shape(x) != want or jnp.result_type(x) != s.dtype:
            raise ValueError(
                f"{what} need leaves of shape {want} and dtype {s.dtype}, got shape "
                f"{jnp.shape(x)} and dtype {jnp.result_type(x)}"
            )


def _flags(x: Any, name: str, num_envs: int, default: bool) -> jax.Array:
    if x is None:
        return jnp.full((num_envs,), default)
    x = jnp.asarray(x)
    if jnp.shape(x) not in ((), (num_envs,)):
        raise ValueError(f"{name} must have shape ({num_envs},), got {jnp.shape(x)}")
    return jnp.broadcast_to(x != 0, (num_envs,))


def _make(capacity, length, period, burn_in, num_envs, prioritized, hyper=None):  # noqa: ANN001, ANN202
    """The functions shared by both factories; ``hyper`` = (alpha, beta, eps, eta, strategy)."""
    C, L, P, B, E = check_config(length, period, burn_in, num_envs, capacity, 2**31 - 1)
    if prioritized:
        alpha, default_beta, epsilon, eta, strategy = hyper

    def init(example_step: Any, example_core_state: Any = None) -> Any:
        def alloc(rows: tuple) -> Callable:
            return lambda x: jnp.zeros(rows + jnp.shape(x), jnp.result_type(x))

        pending = jax.tree_util.tree_map(alloc((E, L)), example_step)
        pending_core = jax.tree_util.tree_map(alloc((E, L)), example_core_state)
        width = window_layout(pending, pending_core).width
        fields = dict(
            windows=jnp.zeros((C, width), jnp.uint32),
            pending=pending,
            pending_core=pending_core,
            chain_n=jnp.zeros((E,), jnp.int32),
            chain_first=jnp.ones((E,), jnp.bool_),
            chain_start=jnp.zeros((E,), jnp.int32),
            pos=jnp.zeros([], jnp.int32),
            size=jnp.zeros([], jnp.int32),
            laps=jnp.zeros([], jnp.int32),
        )
        if not jax.tree_util.tree_leaves(pending):
            raise ValueError("example_step must hold at least one array")
        if not prioritized:
            return SequenceBufferState(**fields)
        tree = sum_tree_init(C, jnp.float32)
        return PrioritizedSequenceBufferState(**fields, tree=tree, max_mix=jnp.float32(1))

    def check_state(state: Any) -> RowLayout:
        """Trace-time check that ``state`` fits this buffer; its windows' layout."""
        for name, x in (
            ("pending steps", state.pending),
            ("pending core states", state.pending_core),
        ):
            for leaf in jax.tree_util.tree_leaves(x):
                if jnp.shape(leaf)[:2] != (E, L):
                    raise ValueError(
                        f"{name} need leaves of shape ({E}, {L}, ...), got {jnp.shape(leaf)}"
                    )
        layout = window_layout(state.pending, state.pending_core)
        if jnp.shape(state.windows) != (C, layout.width) or jnp.shape(state.chain_n) != (E,):
            raise ValueError(
                "the state does not fit this buffer (a state of a buffer made with other "
                f"arguments?): windows {jnp.shape(state.windows)}, chain_n "
                f"{jnp.shape(state.chain_n)}, expected ({C}, {layout.width}) and ({E},)"
            )
        return layout

    def add(
        state: Any,
        steps: Any,
        core_state: Any = None,
        terminated: Any = None,
        truncated: Any = None,
        active: Any = None,
    ) -> Any:
        check_state(state)
        _check_tree(steps, state.pending, (E,), 2, "steps")
        _check_tree(core_state, state.pending_core, (E,), 2, "core_state")
        term = _flags(terminated, "terminated", E, False)
        trunc = _flags(truncated, "truncated", E, False)
        act = _flags(active, "active", E, True)
        return compiled_add(state, steps, core_state, term, trunc, act)

    def add_traced(state: Any, steps: Any, core: Any, term: Any, trunc: Any, act: Any) -> Any:
        envs = jnp.arange(E)
        n, start = state.chain_n, state.chain_start
        at = jnp.where(act & (n >= 0), (start + n) % L, L)  # L: out of range, dropped

        def put(p: jax.Array, x: jax.Array) -> jax.Array:
            return p.at[envs, at].set(x, mode="drop")

        pending = jax.tree_util.tree_map(put, state.pending, steps)
        pending_core = jax.tree_util.tree_map(put, state.pending_core, core)
        n = n + act
        full = act & (n == L)
        ended = act & (term | trunc)
        write = full | (ended & (n > 0))
        k = jnp.cumsum(write, dtype=jnp.int32) - 1
        num = jnp.sum(write, dtype=jnp.int32)
        slots = jnp.where(write, (state.pos + k) % C, C)  # C: dropped
        ends = jnp.where(ended, jnp.where(term, END_TERMINATED, END_TRUNCATED), 0)

        def store(s: jax.Array, x: jax.Array) -> jax.Array:
            return s.at[slots].set(x, mode="drop", unique_indices=True)

        def store_windows(new: Any) -> Any:
            # the ring in order, the steps past the valid ones padded with the last valid one
            valid = jnp.where(full, L, jnp.maximum(n, 1))
            t = jnp.minimum(jnp.arange(L, dtype=jnp.int32), valid[:, None] - 1)
            order = (start[:, None] + t) % L

            def window(p: jax.Array) -> jax.Array:
                return jnp.take_along_axis(p, order.reshape(order.shape + (1,) * (p.ndim - 2)), 1)

            meta = {"seq_len": jnp.where(full, L, n), "seq_end": ends, "seq_first": new.chain_first}
            body = {
                "steps": jax.tree_util.tree_map(window, pending),
                "core": jax.tree_util.tree_map(lambda p: p[envs, start], pending_core),
            }
            rows = window_layout(pending, pending_core).pack((meta, body))
            new = new.replace(windows=store(new.windows, rows))
            if prioritized:
                p = jnp.minimum(jnp.power(new.max_mix + epsilon, alpha), new.tree.max_value)
                tree = sum_tree_set(new.tree, jnp.where(write, slots, -1), p, strategy)
                new = new.replace(tree=tree)
            return new

        # most steps write no window: skip the scatters of windows, metadata and priorities
        new = jax.lax.cond(num > 0, store_windows, lambda x: x, state)
        new = new.replace(
            pos=(state.pos + num) % C,
            size=jnp.minimum(state.size + num, C),
            laps=jnp.where(state.pos + num >= C, state.laps % VERSION_MAX + 1, state.laps),
        )
        # after a full window the next one starts P steps later: no step moves in the ring
        n = jnp.where(full, L - P, n)
        start = jnp.where(full, (start + P) % L, start)
        first = state.chain_first & ~full
        return new.replace(
            pending=pending,
            pending_core=pending_core,
            chain_n=jnp.where(ended, 0, n).astype(jnp.int32),
            chain_first=first | ended,
            chain_start=jnp.where(ended, 0, start).astype(jnp.int32),
        )

    def reset_chains(state: Any, mask: Any = None) -> Any:
        mask = _flags(mask, "mask", E, True)
        return state.replace(
            chain_n=jnp.where(mask, 0, state.chain_n).astype(jnp.int32),
            chain_first=state.chain_first | mask,
            chain_start=jnp.where(mask, 0, state.chain_start).astype(jnp.int32),
        )

    def gather(state: Any, slots: jax.Array, weights: Any = None, versions: Any = None) -> Any:
        if weights is None:
            weights = jnp.ones(jnp.shape(slots), jnp.float32)
        layout = window_layout(state.pending, state.pending_core)
        # one gather of whole rows (see coax_utils/_rows.py)
        meta, body = layout.unpack(state.windows.at[slots].get(mode="promise_in_bounds"))
        items, core, lengths = body["steps"], body["core"], meta["seq_len"]
        end, first = meta["seq_end"], meta["seq_first"]
        t = jnp.arange(L, dtype=jnp.int32)
        mask = t < lengths[:, None]
        last = t == lengths[:, None] - 1
        return SequenceReplaySample(
            items=items,
            core_state=core,
            mask=mask,
            loss_mask=mask & ((t >= B) | first[:, None]),
            terminated=last & (end[:, None] == END_TERMINATED),
            truncated=last & (end[:, None] == END_TRUNCATED),
            indices=slots,
            weights=weights,
            versions=versions,
        )

    def sample_uniform(state: Any, key: jax.Array, batch_size: int) -> SequenceReplaySample:
        check_state(state)
        slots = random_index(key, (batch_size,), state.size)
        return gather(state, slots, jnp.ones((batch_size,), jnp.float32), None)

    def sample_prioritized(
        state: Any, key: jax.Array, batch_size: int, beta: Any = None
    ) -> SequenceReplaySample:
        check_state(state)
        if beta is None:
            beta_ = jnp.float32(default_beta)
        else:
            beta_ = jnp.nan_to_num(jnp.maximum(jnp.asarray(beta, jnp.float32), 0), nan=0.0)
        u = random_uniform(key, batch_size)
        slots, value = sum_tree_inverse_cdf(state.tree, u, return_values=True)
        low = jnp.min(value)
        ratio = jnp.where(low > 0, value / jnp.where(low > 0, low, 1), 1)
        weights = jnp.where(ratio > 1, jnp.power(ratio, -beta_), 1.0).astype(jnp.float32)
        return gather(state, slots, weights, slot_versions(state, slots))

    def update_traced(state: Any, indices: Any, valid: Any, td: Any, versions: Any, mask: Any):  # noqa: ANN202
        slots = jnp.where(valid, indices, 0)
        t = jnp.arange(L)
        check_state(state)
        columns = state.windows[:, : META_LAYOUT.width]  # the metadata words alone
        meta = META_LAYOUT.unpack(columns.at[slots].get(mode="promise_in_bounds"))
        lengths, first = meta["seq_len"][:, None], meta["seq_first"][:, None]
        counted = mask & (t < lengths) & ((t >= B) | first)
        a = jnp.where(counted, jnp.abs(td), 0.0)
        mean = a.sum(axis=1) / jnp.maximum(counted.sum(axis=1), 1)
        mix = eta * a.max(axis=1, initial=0.0) + (1 - eta) * mean
        p = jnp.minimum(jnp.power(mix + epsilon, alpha), state.tree.max_value)
        valid = valid & (indices < state.size) & jnp.all(jnp.isfinite(td), axis=1)
        if versions is not None:
            valid = valid & (slot_versions(state, slots) == versions)
        tree = sum_tree_set(state.tree, jnp.where(valid, indices, -1), p, strategy)
        top = jnp.max(jnp.where(valid, mix, 0.0), initial=0.0)
        return state.replace(tree=tree, max_mix=jnp.maximum(state.max_mix, top))

    def update(
        state: Any, indices: Any, td_errors: Any, versions: Any = None, mask: Any = None
    ) -> Any:
        indices_, valid = checked_indices(indices, C)
        k = indices_.shape[0]
        td = jnp.asarray(td_errors)
        if jnp.shape(td) != (k, L) or not jnp.issubdtype(td.dtype, jnp.number):
            raise ValueError(
                f"td_errors must be numbers of shape ({k}, {L}) (one per step of each "
                f"window), got {td.dtype} of shape {jnp.shape(td)}"
            )
        m = jnp.ones((k, L), jnp.bool_) if mask is None else jnp.asarray(mask)
        if jnp.shape(m) != (k, L) or m.dtype != jnp.bool_:
            raise ValueError(f"mask must be bools of shape ({k}, {L}), got {m.dtype}{m.shape}")
        if versions is not None:
            versions = checked_versions(versions, indices)
        return compiled_update(state, indices_, valid, td.astype(jnp.float32), versions, m)

    def can_sample(state: Any, batch_size: int) -> jax.Array:
        return state.size >= jnp.maximum(batch_size, 1)

    compiled_add = compiled(add_traced)
    config = (C, L, P, B, E)
    if not prioritized:
        return SequenceBuffer(
            init, add, reset_chains, compiled(sample_uniform, (2,)), can_sample, gather, *config
        )
    compiled_update = compiled(update_traced)
    compiled_sample = compiled(sample_prioritized, (2,))

    def sample(state: Any, key: jax.Array, batch_size: int, beta: Any = None) -> Any:
        check_beta(beta)
        return compiled_sample(state, key, batch_size, beta)

    return PrioritizedSequenceBuffer(
        init, add, reset_chains, sample, can_sample, gather, update, *config, *hyper
    )


def make_sequence_buffer(
    capacity: int, length: int, period: int | None = None, burn_in: int = 0, num_envs: int = 1
) -> SequenceBuffer:
    r"""Make a jittable sequence replay buffer with uniform sampling.

    The twin of :class:`~coax_utils.replay.SequenceReplayBuffer`: the same windows (one
    chain per sub-env, ``length`` steps every ``period`` steps, never across an episode
    boundary), the core state at each window's first step, the same samples
    (:class:`~coax_utils.replay.SequenceReplaySample`, with storage slots as ``indices``).
    The returned :class:`SequenceBuffer` holds pure functions:

    - ``init(example_step, example_core_state=None) -> state``: storage for steps and core
      states shaped like the examples (no sub-env axis).
    - ``add(state, steps, core_state=None, terminated=None, truncated=None, active=None)``:
      one step per sub-env (leading axis ``num_envs``), as the host buffer's ``add``.
    - ``reset_chains(state, mask=None)``: start new episodes in the chains of ``mask``.
    - ``sample(state, key, batch_size)``: ``batch_size`` (static) windows, uniformly.
    - ``can_sample(state, batch_size)``: whether a window was written.
    - ``gather(state, slots, weights=None, versions=None)``: the sample of the windows
      stored in ``slots`` (int32, in range; jittable, not compiled): what ``sample`` returns
      for the slots it drew, for samplers of one's own (e.g. over a mesh).

    All are jittable; ``add`` and ``sample`` come compiled. Structure, shape and dtype
    mismatches raise ValueError while tracing (before anything is written).

    Raises
    ------
    TypeError, ValueError
        For arguments the host buffer refuses (``period < 1``, ``burn_in >= length``, ...).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> buffer = make_sequence_buffer(capacity=16, length=4, period=2, num_envs=2)
    >>> state = buffer.init({"obs": jnp.zeros(3)}, jnp.zeros(8))
    >>> for t in range(5):
    ...     state = buffer.add(state, {"obs": jnp.full((2, 3), t, jnp.float32)}, jnp.zeros((2, 8)))
    >>> int(state.size)  # the windows at steps 0..3 of both sub-envs
    2
    >>> sample = buffer.sample(state, jax.random.key(0), 5)
    >>> sample.items["obs"].shape, sample.core_state.shape
    ((5, 4, 3), (5, 8))
    """
    return _make(capacity, length, period, burn_in, num_envs, prioritized=False)


def make_prioritized_sequence_buffer(
    capacity: int,
    length: int,
    period: int | None = None,
    burn_in: int = 0,
    num_envs: int = 1,
    alpha: float = 0.9,
    beta: float = 0.6,
    epsilon: float = 1e-4,
    eta: float = 0.9,
    tree_strategy: str = "auto",
) -> PrioritizedSequenceBuffer:
    r"""Make a jittable sequence replay buffer with R2D2's prioritized sampling.

    The twin of :class:`~coax_utils.replay.PrioritizedSequenceReplayBuffer` (same
    priorities :math:`(\eta\max_t|\delta_t| + (1-\eta)\,\overline{|\delta_t|} +
    \epsilon)^\alpha` over each window's ``loss_mask``, same importance weights). The
    functions of :func:`make_sequence_buffer`, with

    - ``sample(state, key, batch_size, beta=None)``: windows by priority, with ``weights``
      and the slots' ``versions``;
    - ``update(state, indices, td_errors, versions=None, mask=None)``: new priorities from
      TD errors of shape ``(k, length)`` (another shape raises ValueError). Pass the
      sample's ``versions``: an update of a slot written since is ignored. Rows with a NaN
      or infinite TD error, and indices out of range or of empty slots, are ignored (a
      jitted function cannot raise on values).

    ``tree_strategy`` is that of :func:`make_prioritized_buffer`.
    """
    alpha = check_float(alpha, "alpha", low=0)
    beta = check_float(beta, "beta", low=0)
    epsilon = check_float(epsilon, "epsilon", low=0, low_open=True)
    eta = check_eta(eta)
    strategy = check_choice(tree_strategy, "tree_strategy", SUM_TREE_STRATEGIES)
    hyper = (alpha, beta, epsilon, eta, strategy)
    return _make(capacity, length, period, burn_in, num_envs, True, hyper)
