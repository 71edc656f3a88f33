"""Transition batches whose contents say who wrote them (writer id and sequence number), and
a way to kill an actor for good."""

import time

import numpy as np

from coax_utils.replay import TransitionBatch

GAMMA = 0.9


def make_batch(writer: int, start: int, size: int) -> TransitionBatch:
    """Rows ``start .. start + size - 1`` of writer ``writer``: ``S[:, 0] = writer``,
    ``S[:, 1] = seq`` and ``A = seq``."""
    seq = np.arange(start, start + size)
    S = np.stack([np.full(size, writer), seq], axis=1).astype(np.float32)
    return TransitionBatch(
        S=S,
        A=seq.astype(np.int32),
        logP=np.zeros(size, np.float32),
        Rn=seq.astype(np.float32),
        In=np.full(size, GAMMA, np.float32),
        S_next=S + 1,
    )


def keys(S) -> list[tuple[int, int]]:
    """The (writer, seq) pairs of a batch of states."""
    return [(int(w), int(s)) for w, s in np.asarray(S)]


def kill_and_wait(ray, actor, probe) -> None:
    """``ray.kill(actor)``, then wait until ``probe()`` (a call on the actor) says it is gone:
    ``ray.kill`` returns before the actor is."""
    ray.kill(actor)
    tic = time.monotonic()
    while True:
        try:
            ray.get(probe(), timeout=20)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() - tic < 15.0
