"""The sample type of sequence sampling, shared by the host and the jittable buffers."""

from __future__ import annotations

from typing import Any

from coax_utils._dataclass import pytree_dataclass

__all__ = ["SequenceSample"]


@pytree_dataclass
class SequenceSample:
    """A batch of contiguous windows sampled from a replay buffer.

    Windows never cross an episode boundary: steps after the end of the episode in which a
    window starts are *masked* (``mask`` False) and hold a copy of the window's last valid
    step (repeat-last padding), so every row is made of data of one episode only.

    Parameters
    ----------
    items : pytree
        The sampled windows, each leaf with shape ``(batch_size, length, ...)`` (for the host
        buffers a :class:`TransitionBatch`, with ``idx`` and ``W`` of shape
        ``(batch_size, length)``).
    mask : array of bool, shape ``(batch_size, length)``
        True where the step belongs to the episode of the window's first step. The first
        column is True, except from a jittable buffer holding no items, whose rows are all
        False (the host buffers refuse to sample with fewer than ``length`` transitions).
    indices : array of int, shape ``(batch_size, length)``
        Where each step was read: the transition ids (host buffers) or the storage slots
        (jittable buffers).
    """

    items: Any
    mask: Any
    indices: Any
