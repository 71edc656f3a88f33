"""Host replay buffers that store each frame of frame-stacked observations once."""

from __future__ import annotations

import numpy as np

from coax_utils.replay._frames_store import FRAME_KEYS, FrameStacks, frame_fingerprints
from coax_utils.replay._host import PrioritizedReplayBuffer, SimpleReplayBuffer
from coax_utils.replay._transition import TransitionBatch

__all__ = ["FrameStackReplayBuffer", "PrioritizedFrameStackReplayBuffer", "frame_fingerprints"]


class FrameStackReplayBuffer(FrameStacks, SimpleReplayBuffer):
    r"""A uniform replay buffer for frame-stacked observations that stores each frame once.

    Made for the observations of :class:`gymnasium.wrappers.FrameStackObservation` (e.g.
    Atari: 4 frames of 84x84 uint8): consecutive stacks share all frames but one, so storing
    ``S`` and ``S_next`` whole keeps each frame :math:`2k` times. This buffer keeps each
    distinct frame once in a ring of ``frame_capacity`` frames and each transition as
    references to its frames; :meth:`sample` rebuilds ``S`` and ``S_next`` byte for byte as
    they were added, so training sees exactly what acting saw (including the repeated
    first frame that ``FrameStackObservation`` pads episode starts with). A stream of
    episodes of :math:`T` steps stores :math:`T+1` frames per episode, with :class:`NStep`
    and with the transitions of several environments interleaved (e.g.
    :class:`RecordTransitions` over a vector env): repeated frames are found by content (a
    fingerprint, then the bytes), not by position, among the newest ``window`` frames.

    A frame is referenced only where the stored copy outlives the transitions that refer to
    it: ``window`` is the room ``frame_capacity`` leaves beyond ``capacity + capacity // 64 +
    1`` frames, at least ``2 * stack_size - 1`` (at most ``frame_capacity - 2 * stack_size``
    and 8192), and a frame that repeats an older one (a static screen, a serve in Pong) is
    stored again. So transitions lose frames in the order they were added: every transition
    added less than ``frame_capacity - window`` frames ago holds all its frames. Frames are
    overwritten oldest first; a transition that lost one is never sampled (nor iterated
    over), though it counts in ``len()`` until its slot is reused. The default
    ``frame_capacity`` (``capacity + capacity // 64 + 2 * stack_size``) holds every
    transition's frames for episodes of 64 steps or more (one environment, ``NStep`` with
    ``n <= stack_size``). With :math:`N` environments interleaved, pass ``frame_capacity =
    capacity + capacity // 64 + 1 + N * (stack_size + n)``: a stack's oldest frame was
    stored up to :math:`N (k + n)` frames before, and a larger window reaches it.

    Other fields, ``idx``, ``W``, ``episode_end``, saving and checkpoints work as in
    :class:`SimpleReplayBuffer`; :meth:`sample_sequences` too, each window ending before a
    step that lost frames.

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    stack_size : int
        The number of frames per observation :math:`k` (``FrameStackObservation``'s
        ``stack_size``).
    frame_capacity : int, optional
        The number of frames stored, at least ``2 * stack_size`` (see above).
    random_seed : int, optional
        Seed of the buffer's random number generator.

    Examples
    --------
    >>> import numpy as np
    >>> frames = np.arange(6, dtype=np.uint8)[:, None, None] * np.ones((1, 2, 2), np.uint8)
    >>> buffer = FrameStackReplayBuffer(capacity=10, stack_size=3, random_seed=0)
    >>> stacks = [frames[[0, 0, 0]], frames[[0, 0, 1]], frames[[0, 1, 2]], frames[[1, 2, 3]]]
    >>> for s, s_next in zip(stacks, stacks[1:]):
    ...     tr = TransitionBatch.from_single(
    ...         s=s, a=0, logp=0.0, r=1.0, done=False, gamma=0.9, s_next=s_next
    ...     )
    ...     buffer.add(tr)
    >>> len(buffer), buffer.frame_count
    (3, 4)
    >>> batch = buffer.sample(batch_size=2)
    >>> batch.S.shape, batch.S_next.shape
    ((2, 3, 2, 2), (2, 3, 2, 2))
    """

    _STATE_KEYS = SimpleReplayBuffer._STATE_KEYS + FRAME_KEYS

    def __init__(
        self,
        capacity: int,
        stack_size: int,
        frame_capacity: int | None = None,
        random_seed: int | None = None,
    ) -> None:
        self._init_frames(capacity, stack_size, frame_capacity)
        super().__init__(capacity, random_seed)

    def _draw(self, n: int) -> np.ndarray:
        return (self._rng.random(n) * len(self)).astype(np.int64)

    def sample(self, batch_size: int = 32) -> TransitionBatch:  # type: ignore[override]
        """Sample a batch of transitions uniformly (with replacement) among those whose
        frames are all stored.

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions.

        Returns
        -------
        transitions : TransitionBatch
            ``S`` and ``S_next`` of shape ``(batch_size, stack_size, *frame_shape)``, ``idx``
            the transition ids and ``W`` the stored weights.

        Raises
        ------
        ValueError
            If the buffer is empty, ``batch_size`` is not positive, or no transition has all
            its frames.
        """
        return self._sample_live(self._check_nonempty(batch_size), weighted=False)

    def __repr__(self) -> str:
        return (
            f"FrameStackReplayBuffer(capacity={self._capacity}, stack_size={self._stack_size}, "
            f"len={len(self)}, frame_count={self._frame_count})"
        )


class PrioritizedFrameStackReplayBuffer(FrameStacks, PrioritizedReplayBuffer):
    r"""A prioritized replay buffer for frame-stacked observations that stores each frame once.

    Priorities, importance weights, :meth:`update` and the hyperparameters are those of
    :class:`PrioritizedReplayBuffer`; frames are stored as in
    :class:`FrameStackReplayBuffer`. Each add gives priority 0 to every transition that lost
    a frame to the ring (checking only those added early enough to have lost one), so it is
    never sampled, :attr:`total_priority` is that of the transitions that can be sampled, and
    the importance weights are theirs; :meth:`update` ignores the ids of transitions that
    lost frames (as those of overwritten ones). Whatever rebuilds the priorities from the
    advantages (``alpha``, ``epsilon``, ``load``, ``utils.load``) keeps those zeros: which
    transitions lost frames follows from the frame ids and ``frame_count``, so a restored
    buffer continues the original's sample stream exactly.

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    stack_size : int
        The number of frames per observation.
    alpha, beta, epsilon : float, optional
        See :class:`PrioritizedReplayBuffer`.
    frame_capacity : int, optional
        The number of frames stored (see :class:`FrameStackReplayBuffer`).
    random_seed : int, optional
        Seed of the buffer's random number generator.
    """

    _STATE_KEYS = PrioritizedReplayBuffer._STATE_KEYS + FRAME_KEYS

    def __init__(
        self,
        capacity: int,
        stack_size: int,
        alpha: float = 1.0,
        beta: float = 1.0,
        epsilon: float = 1e-4,
        frame_capacity: int | None = None,
        random_seed: int | None = None,
    ) -> None:
        self._init_frames(capacity, stack_size, frame_capacity)
        super().__init__(capacity, alpha, beta, epsilon, random_seed)

    def _draw(self, n: int) -> np.ndarray:
        if not self._tree.root_value > 0:  # (priorities that underflow: a large alpha)
            raise ValueError(
                "every transition that has all its frames has priority 0: nothing to sample"
            )
        u = self._rng.random(n)
        return np.asarray(self._tree.inverse_cdf(u), dtype=np.int64)

    def _redraw_dead(self, slots: np.ndarray) -> np.ndarray:
        # every transition that lost frames has priority 0 (see _prune), so none is drawn
        raise RuntimeError("a transition that lost frames was drawn: its priority was not 0")

    def _prune(self) -> None:
        """Priority 0 for every transition that lost frames to the ring (after each add).

        Transitions are checked oldest first from the frontier, the oldest that may still
        hold all its frames, up to the first whose newest frame id shows that it and every
        later one hold theirs: a transition added when ``frame_count`` was ``c`` refers to
        frames ``>= c - window`` and stores frames ``< c + 2 k`` (``window``: see
        ``match_window`` in ``_frames_store.py``, or how far back restored transitions
        refer). With the default ``frame_capacity`` and episodes of 64 steps or more, one
        transition is checked.
        """
        floor = self._frame_count - self._frame_capacity  # frames below were overwritten
        safe = floor + max(self._window, self._scan_reach) + 2 * self._stack_size - 1
        start, step, moving = max(self._frontier, self._count - len(self)), 4, True
        _, s_next, _, _ = self._positions_of_ids()
        if start < self._count and self._storage[s_next][start % self._capacity, -1] >= safe:
            return  # (the common case: the first transition shows that all hold their frames)
        while start < self._count:
            slots = np.arange(start, min(start + step, self._count)) % self._capacity
            lo, hi = self._id_range(slots)
            stop = hi >= safe
            end = int(np.argmax(stop)) if stop.any() else len(slots)
            dead = lo[:end] < floor
            if dead.any():
                self._tree.set_values(slots[:end][dead], 0.0)
            if moving:  # the frontier passes the transitions that lost frames
                lead = end if dead.all() else int(np.argmin(dead))
                self._frontier, moving = start + lead, lead == end
            if end < len(slots):
                return
            start, step = start + len(slots), 2 * step

    def _refresh_priorities(self, alpha: float, epsilon: float) -> None:
        # (alpha, epsilon and restores): transitions that lost frames keep priority 0
        super()._refresh_priorities(alpha, epsilon)
        if len(self):
            slots = np.arange(len(self))
            self._tree.set_values(slots[~self._live(slots)], 0.0)

    def _updatable(self, slots: np.ndarray, idx: np.ndarray) -> np.ndarray:
        # the ids still held whose transitions have all their frames: an update never gives
        # a transition that lost frames a priority again (nor raises the default priority)
        held = super()._updatable(slots, idx)
        held[held] = self._live(slots[held])
        return held

    def sample(self, batch_size: int = 32) -> TransitionBatch:  # type: ignore[override]
        """Sample a batch of transitions in proportion to their priorities, among those whose
        frames are all stored.

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions (drawn with replacement).

        Returns
        -------
        transitions : TransitionBatch
            Frame stacks as in :meth:`FrameStackReplayBuffer.sample`, ``idx`` for
            :meth:`update` and ``W`` (stored weights times normalised importance weights).

        Raises
        ------
        ValueError
            If the buffer is empty, ``batch_size`` is not positive, or no transition has all
            its frames, or all of those have priority 0 (priorities that underflow).
        """
        return self._sample_live(self._check_nonempty(batch_size), weighted=True)

    def __repr__(self) -> str:
        return (
            f"PrioritizedFrameStackReplayBuffer(capacity={self._capacity}, "
            f"stack_size={self._stack_size}, len={len(self)}, alpha={self._alpha}, "
            f"beta={self._beta}, epsilon={self._epsilon})"
        )
