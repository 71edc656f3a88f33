r"""What the host and jittable sequence replay buffers share: the sample type, the argument
checks and the rule that cuts each sub-env's stream of steps into windows.

The windowing rule (both twins implement it; the tests enumerate it independently):

- every sub-env of a vector env has its own *chain*; an episode is the steps of one chain
  from its first step (the first step added, or the one after an episode end) to the step
  marked ``terminated`` or ``truncated``;
- windows start at the steps :math:`s = 0, P, 2P, \dots` of an episode (``P`` the period);
  the window at :math:`s` holds the steps :math:`s, \dots, \min(s + L, T) - 1` of an episode
  of :math:`T` steps (``L`` the length);
- the window at :math:`s = 0` is always written; the one at :math:`s = kP`, :math:`k\ge1`,
  when :math:`s < T` and the window before it does not reach the end of the episode
  (:math:`s - P + L < T`), so that every step lies in a window (for ``P <= L``) and no
  window lies inside another one;
- a window is written as soon as it is complete: after its :math:`L`-th step, or at the end
  of its episode (then shorter than :math:`L`, its tail masked).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coax_utils._checks import check_float, check_int
from coax_utils._dataclass import pytree_dataclass

__all__ = [
    "END_NONE",
    "END_TERMINATED",
    "END_TRUNCATED",
    "SequenceReplaySample",
    "check_config",
    "loss_mask_np",
]

END_NONE, END_TERMINATED, END_TRUNCATED = 0, 1, 2


@pytree_dataclass
class SequenceReplaySample:
    r"""A batch of sequences (windows of an episode) with their recurrent core states.

    Attributes
    ----------
    items : pytree
        The steps, each leaf of shape ``(batch_size, length, ...)``. Steps past the end of
        the episode are padded with a copy of the window's last valid step.
    core_state : pytree
        The recurrent core state stored with each sequence (the one given with its first
        step), each leaf of shape ``(batch_size, ...)``.
    mask : bool array, shape ``(batch_size, length)``
        True for the steps that belong to the episode (the first ``n`` steps of a window of
        ``n`` valid steps).
    loss_mask : bool array, shape ``(batch_size, length)``
        The steps a learner computes its loss on: ``mask`` without the ``burn_in`` first
        steps, except in a window that starts its episode, whose stored core state is the
        episode's initial state (exact, nothing to burn in): there ``loss_mask == mask``.
    terminated, truncated : bool arrays, shape ``(batch_size, length)``
        True at the last valid step of a window whose episode ended there by termination
        (no bootstrapping) or by truncation (bootstrap from the next observation).
    indices : int array, shape ``(batch_size,)``
        Where the sequences are stored: pass them to ``update``. Sequence ids (host buffers,
        int64, never reused) or storage slots (jittable buffers, int32).
    weights : float32 array, shape ``(batch_size,)``
        Importance weights :math:`(N P(i))^{-\beta}` normalised to a batch maximum of 1
        (all 1 for uniform sampling).
    versions : int32 array, shape ``(batch_size,)``, or None
        Jittable buffers: the write counts of the sampled slots, for ``update`` (an update
        of a slot written since is ignored). None for the host buffers, whose ids are never
        reused.
    """

    items: Any
    core_state: Any
    mask: Any
    loss_mask: Any
    terminated: Any
    truncated: Any
    indices: Any
    weights: Any
    versions: Any = None


def check_config(
    length: Any, period: Any, burn_in: Any, num_envs: Any, capacity: Any, capacity_high: int
) -> tuple[int, int, int, int, int]:
    """The checked ``(capacity, length, period, burn_in, num_envs)`` of a sequence buffer.

    TypeError for a non-int, ValueError for ``length < 1``, ``period < 1`` (None means
    ``length``), ``burn_in`` outside ``[0, length)``, ``num_envs < 1`` or a capacity below
    ``num_envs`` (one add may write a window per sub-env).
    """
    capacity = check_int(capacity, "capacity", low=1, high=capacity_high)
    length = check_int(length, "length", low=1)
    period = length if period is None else check_int(period, "period", low=1)
    burn_in = check_int(burn_in, "burn_in", low=0)
    if burn_in >= length:
        raise ValueError(f"burn_in must be < length={length}, got {burn_in}")
    num_envs = check_int(num_envs, "num_envs", low=1)
    if capacity < num_envs:
        raise ValueError(f"capacity must be >= num_envs={num_envs}, got {capacity}")
    return capacity, length, period, burn_in, num_envs


def check_eta(eta: Any) -> float:
    return check_float(eta, "eta", low=0, high=1)


def loss_mask_np(lengths: np.ndarray, first: np.ndarray, length: int, burn_in: int) -> np.ndarray:
    """The ``loss_mask`` of windows with ``lengths`` valid steps (see the sample type)."""
    t = np.arange(length)
    mask = t < np.asarray(lengths)[..., None]
    return mask & ((t >= burn_in) | np.asarray(first, bool)[..., None])


def mix_priorities_np(td: np.ndarray, counted: np.ndarray, eta: float) -> np.ndarray:
    """R2D2's ``eta * max|td| + (1 - eta) * mean|td|`` over the ``counted`` steps of each row
    (0 for a row with none counted)."""
    a = np.where(counted, np.abs(td), 0.0)
    n = counted.sum(axis=-1)
    mean = a.sum(axis=-1) / np.maximum(n, 1)
    return eta * a.max(axis=-1, initial=0.0) + (1 - eta) * mean
