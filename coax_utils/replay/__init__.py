"""Transitions, n-step tracing, and replay buffers (host-side and jittable)."""

from coax_utils.replay._transition import TransitionBatch

__all__ = [
    "TransitionBatch",
]
