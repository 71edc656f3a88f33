"""Frame storage of the host frame-stacked buffers: each frame of frame-stacked observations
stored once in a ring, found again by content (fingerprint, then the bytes)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_int
from coax_utils.replay._transition import TransitionBatch

__all__ = ["FRAME_KEYS", "FrameStacks", "frame_fingerprints", "match_window"]

_MAX_COUNT = np.iinfo(np.int64).max
_MAX_WINDOW = 8192  # the host buffers match against at most this many of the newest frames
_REJECTION_ROUNDS = 32  # redraws of transitions whose frames were overwritten, then exact
FRAME_KEYS = ("stack_size", "frame_capacity", "frame_count", "frames")


def match_window(capacity: int, stack_size: int, frame_capacity: int) -> int:
    """How many of the newest frames a new frame is matched against (host and jittable).

    A frame is referenced only where the stored copy outlives the transitions that refer to
    it: a transition added when ``frame_count`` was ``c`` refers to frames ``>= c - window``,
    so it keeps all its frames until ``frame_capacity - window`` frames more are stored, and
    transitions lose frames in the order they were added. The window is the room that
    ``frame_capacity`` leaves beyond ``capacity + capacity // 64 + 1`` frames (what the
    newest ``capacity`` transitions store, one frame per step and one per episode start, in
    episodes of 64 steps or more), at least ``2 * stack_size - 1`` (a stack and the frame
    before it) and at most ``frame_capacity - 2 * stack_size`` (a matched frame outlives the
    add that refers to it). A frame that repeats an older one beyond the window is stored
    again.
    """
    spare = frame_capacity - capacity - capacity // 64 - 1
    return min(max(2 * stack_size - 1, spare), frame_capacity - 2 * stack_size)


def _words(frames: np.ndarray) -> np.ndarray:
    """The bytes of each frame (leading axis) as an array of the widest unsigned words."""
    raw = np.ascontiguousarray(frames).reshape(len(frames), -1).view(np.uint8)
    for dtype in (np.uint64, np.uint32, np.uint16):
        if raw.shape[1] % np.dtype(dtype).itemsize == 0:
            return raw.view(dtype)
    return raw


def frame_fingerprints(frames: np.ndarray) -> np.ndarray:
    """A 64-bit fingerprint of the bytes of each frame.

    A random linear hash modulo :math:`2^{64}` of the frame's bytes (all of them), with fixed
    multipliers, so equal frames always get equal fingerprints and different frames almost
    never do. The frame-stacked buffers find repeated frames with it and then compare the
    bytes: a collision costs memory (the frame is stored again), never a wrong frame.

    Parameters
    ----------
    frames : numpy.ndarray
        Frames along the leading axis, of any shape and numeric dtype.

    Returns
    -------
    fingerprints : numpy.ndarray of uint64, shape ``(len(frames),)``
    """
    words = _words(frames)
    if words.dtype != np.uint64:
        words = words.astype(np.uint64)
    return (words * _multipliers(words.shape[1])).sum(axis=1, dtype=np.uint64)


@functools.lru_cache(maxsize=8)
def _multipliers(n: int) -> np.ndarray:
    """Fixed odd 64-bit multipliers of the fingerprint (the same in every process)."""
    return np.random.default_rng(0x5EED).integers(1, 2**63, size=n, dtype=np.uint64) | 1


class FrameStacks:
    """Frame storage shared by the frame-stacked buffers (mixed into a host buffer class).

    The host buffer stores each transition with ``S`` and ``S_next`` replaced by the ids of
    their frames (int64, shape ``(stack_size,)``); the frames live in a ring of their own,
    ``frames[id % frame_capacity]``. Frame ids count every frame stored, so a transition
    whose smallest frame id is below ``frame_count - frame_capacity`` lost a frame to the
    ring and is never returned.
    """

    _stack_size: int
    _frame_capacity: int

    def _init_frames(self, capacity: Any, stack_size: Any, frame_capacity: Any) -> None:
        capacity = check_int(capacity, "capacity", low=1)
        self._stack_size = check_int(stack_size, "stack_size", low=1)
        if frame_capacity is None:
            frame_capacity = capacity + capacity // 64 + 2 * self._stack_size
        self._frame_capacity = check_int(frame_capacity, "frame_capacity", low=1)
        if self._frame_capacity < 2 * self._stack_size:
            raise ValueError(
                f"frame_capacity must be at least 2 * stack_size = {2 * self._stack_size} (the "
                f"frames of one transition), got {frame_capacity}"
            )

    def clear(self) -> None:
        """Remove all transitions and frames (the RNG stream continues)."""
        super().clear()  # type: ignore[misc]
        self._frames: np.ndarray | None = None
        self._frame_count = 0
        self._fingerprints: np.ndarray | None = None
        self._recent: dict[int, int] = {}  # fingerprint -> id, of the newest frames
        self._positions: tuple | None = None  # see _positions_of_ids
        self._frontier = 0  # the prioritized buffer's _prune starts here
        self._scan_reach = 0  # how far back restored transitions refer (see _restore_extra)

    # -- properties ----------------------------------------------------------------------------

    @property
    def stack_size(self) -> int:
        """The number of frames per stacked observation."""
        return self._stack_size

    @property
    def frame_capacity(self) -> int:
        """The number of frames stored (older frames are overwritten)."""
        return self._frame_capacity

    @property
    def frame_count(self) -> int:
        """The number of frames stored since the last :meth:`clear` (each frame once)."""
        return self._frame_count

    @property
    def _window(self) -> int:
        capacity = self._capacity  # type: ignore[attr-defined]
        return min(match_window(capacity, self._stack_size, self._frame_capacity), _MAX_WINDOW)

    # -- adding --------------------------------------------------------------------------------

    def _check_stacks(self, transition_batch: Any) -> np.ndarray:
        """``S`` and ``S_next`` as one array of frames ``(2 * batch * k, *frame)``."""
        if not isinstance(transition_batch, TransitionBatch):
            raise TypeError(
                f"transition_batch must be a TransitionBatch, got {type(transition_batch)!r}"
            )
        k = self._stack_size
        stacks = []
        for name in ("S", "S_next"):
            x = getattr(transition_batch, name)
            if x is None or isinstance(x, (dict, list, tuple)):
                raise TypeError(
                    f"transition_batch.{name} must be an array of stacked frames, got "
                    f"{type(x).__name__}"
                )
            x = np.asarray(x)
            if x.dtype.kind not in "biuf":
                raise TypeError(f"transition_batch.{name} must hold numbers, got dtype {x.dtype}")
            if x.ndim < 2 or x.shape[1] != k:
                raise ValueError(
                    f"transition_batch.{name} must have shape (batch_size, stack_size={k}, "
                    f"*frame_shape), got {x.shape}"
                )
            stacks.append(x)
        S, S_next = stacks
        if S.shape != S_next.shape or S.dtype != S_next.dtype:
            raise ValueError(
                f"transition_batch.S and S_next must have the same shape and dtype, got "
                f"{S.dtype}{list(S.shape)} and {S_next.dtype}{list(S_next.shape)}"
            )
        if 0 in S.shape[2:]:
            raise ValueError(f"frames must not be empty, got frames of shape {S.shape[2:]}")
        if self._frames is not None:
            if S.shape[2:] != self._frames.shape[1:] or S.dtype != self._frames.dtype:
                raise ValueError(
                    f"the frames of transition_batch are {S.dtype}{list(S.shape[2:])}; the "
                    f"buffer holds frames {self._frames.dtype}{list(self._frames.shape[1:])}"
                )
            if not self._frames.flags.writeable:
                raise ValueError("the buffer is read-only (loaded with mmap_mode='r')")
        n = len(S)
        if self._frame_count + 2 * n * k > _MAX_COUNT:
            raise ValueError("the frame ids would overflow int64")
        return np.concatenate([S, S_next], axis=1).reshape((2 * n * k,) + S.shape[2:])

    def _plan(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Frame ids for ``frames``: repeated ones share an id, known ones keep theirs.

        Returns ``(ids, new, fingerprints)``: ``new`` indexes the frames to store, in the order
        of their ids. Matches by fingerprint are confirmed byte for byte; should a collision
        ever occur, every frame of the batch is stored anew (correct, only larger).
        """
        fps = frame_fingerprints(frames)
        ids = np.empty(len(frames), np.int64)
        new: list[int] = []
        seen: dict[int, int] = {}  # fingerprint -> first position in this batch
        same_batch: list[tuple[int, int]] = []
        stored: list[int] = []
        next_id = self._frame_count
        recent = self._recent
        for m, h in enumerate(fps.tolist()):
            j = seen.get(h)
            if j is not None:
                ids[m] = ids[j]
                same_batch.append((m, j))
                continue
            fid = recent.get(h)
            if fid is not None:
                ids[m] = fid
                stored.append(m)
                continue
            seen[h] = m
            ids[m] = next_id
            next_id += 1
            new.append(m)
        words = _words(frames)
        ok = True
        if same_batch:
            a, b = np.array(same_batch).T
            ok = bool(np.array_equal(words[a], words[b]))
        if ok and stored and self._frames is not None:
            slots = ids[stored] % self._frame_capacity
            ok = bool(np.array_equal(words[stored], _words(self._frames[slots])))
        if not ok:
            ids = self._frame_count + np.arange(len(frames), dtype=np.int64)
            new = list(range(len(frames)))
        return ids, np.array(new, np.int64), fps

    def _new_ring(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """An empty ring for frames like ``frames``, and its fingerprints."""
        cap = self._frame_capacity
        return np.empty((cap,) + frames.shape[1:], frames.dtype), np.zeros(cap, np.uint64)

    def _store_frames(self, frames: np.ndarray, fps: np.ndarray) -> None:
        """Append ``frames`` to the ring (ids ``frame_count, ...``) and to the recent ones."""
        cap, window = self._frame_capacity, self._window
        first = self._frame_count
        keep = slice(max(0, len(frames) - cap), None)
        ids = first + np.arange(len(frames), dtype=np.int64)[keep]
        slots = ids % cap
        if len(slots) and slots[-1] >= slots[0]:  # no wrap: a contiguous block
            slots = slice(int(slots[0]), int(slots[-1]) + 1)
        self._frames[slots] = frames[keep]
        recent, old_fps = self._recent, self._fingerprints
        for fid, h in zip(range(first, first + len(frames)), fps.tolist()):
            gone = fid - window
            if gone >= 0:
                g = int(old_fps[gone % cap])
                if recent.get(g) == gone:
                    del recent[g]
            if window > 0:
                recent[h] = fid
            old_fps[fid % cap] = h
        self._frame_count = first + len(frames)

    def add(
        self, transition_batch: TransitionBatch, Adv: Any = None, *, episode_end: Any = None
    ) -> None:
        """Add a batch of transitions whose ``S`` and ``S_next`` are frame stacks.

        Each frame is stored once: the frames of ``S`` and ``S_next`` that the buffer already
        holds among its newest frames (equal bytes) are referenced, not copied.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions; ``S`` and ``S_next`` are arrays of shape
            ``(batch_size, stack_size, *frame_shape)`` (the observations of
            :class:`gymnasium.wrappers.FrameStackObservation`, stacked along axis 1).
        Adv : array of shape ``(batch_size,)``, optional
            Advantages (prioritized buffer; ignored by the uniform one).
        episode_end : bool or array of bool, optional
            Marks rows that end their episode (see :meth:`SimpleReplayBuffer.add`).

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a :class:`TransitionBatch`, or ``S`` or ``S_next``
            is not an array of numbers.
        ValueError
            If ``S`` or ``S_next`` is not ``(batch_size, stack_size, *frame_shape)``, their
            frames are empty or differ in shape or dtype from the stored ones, the frame ids
            would overflow int64, or the rest of the batch does not fit (see
            :meth:`SimpleReplayBuffer.add`). Every check runs before the first write, and
            the first add allocates the frame ring before it: frames, transitions,
            priorities and the RNG are unchanged.
        """
        frames = self._check_stacks(transition_batch)
        n, k = len(transition_batch.S), self._stack_size
        ids, new, fps = self._plan(frames)
        pairs = ids.reshape(n, 2, k)
        refs = transition_batch.replace(S=pairs[:, 0], S_next=pairs[:, 1])
        # the first add allocates the ring before anything is written (a frame_capacity too
        # large for memory then changes nothing)
        ring = self._new_ring(frames) if self._frames is None else None
        self._add(refs, Adv, episode_end)  # type: ignore[attr-defined]
        if ring is not None:
            self._frames, self._fingerprints = ring
        self._store_frames(frames[new], fps[new])
        self._prune()

    def _prune(self) -> None:
        """Called after each add (the prioritized buffer drops what lost frames)."""

    # -- sampling ------------------------------------------------------------------------------

    def _positions_of_ids(self) -> tuple[int, int, int, int]:
        """Where the frame ids of ``S`` and ``S_next`` are: leaves of the storage, then of a
        sample (which has ``idx`` inserted)."""
        treedef = self._treedef  # type: ignore[attr-defined]
        if self._positions is None or self._positions[0] is not treedef:
            skeleton = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
            out_treedef = self._out_treedef  # type: ignore[attr-defined]
            sample = out_treedef.unflatten(list(range(out_treedef.num_leaves)))
            self._positions = (treedef, skeleton.S, skeleton.S_next, sample.S, sample.S_next)
        return self._positions[1:]

    def _id_range(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The smallest and the largest frame id of the transitions in ``slots``."""
        s, s_next, _, _ = self._positions_of_ids()
        a = self._storage[s][slots]  # type: ignore[attr-defined]
        b = self._storage[s_next][slots]  # type: ignore[attr-defined]
        return np.minimum(a.min(axis=1), b.min(axis=1)), np.maximum(a.max(axis=1), b.max(axis=1))

    def _live(self, slots: np.ndarray) -> np.ndarray:
        """Whether the transitions in ``slots`` still have all their frames."""
        return self._id_range(slots)[0] >= self._frame_count - self._frame_capacity

    def _redraw_dead(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` with those that lost frames redrawn uniformly, in place (exact: after a few
        rounds, drawn among those that have their frames)."""
        for _ in range(_REJECTION_ROUNDS):
            dead = np.flatnonzero(~self._live(slots))
            if not len(dead):
                return slots
            slots[dead] = self._draw(len(dead))
        live = np.flatnonzero(self._live(np.arange(len(self))))
        if not len(live):
            raise ValueError(
                "no transition in the buffer has all its frames: frame_capacity "
                f"{self._frame_capacity} is too small for these transitions"
            )
        return live[(self._rng.random(len(slots)) * len(live)).astype(np.int64)]

    def _sample_live(self, batch_size: int, weighted: bool) -> TransitionBatch:
        """``batch_size`` transitions drawn by ``_draw`` among those that have all their
        frames, stacks rebuilt; ``weighted``: ``W`` times the importance weights."""
        slots = self._draw(batch_size)
        # the frame ids come with the rest of the transitions, in one pass over their rows
        leaves = super()._gather_leaves(slots)  # type: ignore[misc]
        ids = self._frame_ids(leaves)
        if ids.min() < self._frame_count - self._frame_capacity:  # some lost frames
            slots = self._redraw_dead(slots)
            leaves = super()._gather_leaves(slots)  # type: ignore[misc]
            ids = self._frame_ids(leaves)
        if weighted:
            self._scale_weights(leaves, self._importance_weights(slots))  # type: ignore[attr-defined]
        self._put_stacks(leaves, ids)
        return self._out_treedef.unflatten(leaves)  # type: ignore[attr-defined]

    def _gather_leaves(
        self, slots: np.ndarray, W: np.ndarray | None = None, out: list | None = None
    ) -> list:
        leaves = super()._gather_leaves(slots, W, out)  # type: ignore[misc]
        self._put_stacks(leaves, self._frame_ids(leaves))
        return leaves

    def _frame_ids(self, leaves: list) -> np.ndarray:
        """The frame ids of ``S`` then of ``S_next`` among a sample's ``leaves``, one array
        of shape ``(2 * n, stack_size)``."""
        _, _, s, s_next = self._positions_of_ids()
        return np.concatenate((leaves[s], leaves[s_next]))

    def _put_stacks(self, leaves: list, ids: np.ndarray) -> None:
        """Put the frame stacks of ``S`` and ``S_next`` in place of their ids in ``leaves``.

        ``ids`` comes from :meth:`_frame_ids` (and is overwritten). One gather copies every
        frame of both.
        """
        frames = self._frames
        n, frame_shape = len(ids) // 2, frames.shape[1:]  # type: ignore[union-attr]
        np.remainder(ids, self._frame_capacity, out=ids)
        stacks = np.empty(ids.shape + frame_shape, frames.dtype)  # type: ignore[union-attr]
        np.take(
            frames, ids.reshape(-1), axis=0, out=stacks.reshape((-1,) + frame_shape), mode="clip"
        )
        _, _, s, s_next = self._positions_of_ids()
        leaves[s], leaves[s_next] = stacks[:n], stacks[n:]

    def __iter__(self) -> Iterator[TransitionBatch]:
        """Iterate over the stored transitions that have all their frames, oldest first."""
        for slot in self._filled_in_order():  # type: ignore[attr-defined]
            if self._live(np.array([slot]))[0]:
                yield self._gather(np.array([slot]))

    def _window_starts(self, batch_size: int, positions: int) -> np.ndarray:
        """Window starts as in the base buffer, redrawing those whose first step lost frames."""
        oldest = self._oldest_slot()  # type: ignore[attr-defined]
        draw = super()._window_starts  # type: ignore[misc]
        starts = draw(batch_size, positions)
        for _ in range(_REJECTION_ROUNDS):
            dead = np.flatnonzero(~self._live((oldest + starts) % self._capacity))
            if not len(dead):
                return starts
            starts[dead] = draw(len(dead), positions)
        candidates = np.arange(positions)
        live = candidates[self._live((oldest + candidates) % self._capacity)]
        if not len(live):
            raise ValueError(
                "no window starts at a transition that has all its frames: frame_capacity "
                f"{self._frame_capacity} is too small for these transitions"
            )
        return self._rng.choice(live, size=batch_size)  # type: ignore[attr-defined]

    def _window_mask(self, slots: np.ndarray) -> np.ndarray:
        """The base mask, also ending each window before a step that lost frames."""
        mask = super()._window_mask(slots)  # type: ignore[misc]
        mask &= self._live(slots.reshape(-1)).reshape(slots.shape)
        return np.logical_and.accumulate(mask, axis=1)

    # -- checkpoints ---------------------------------------------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        state = super()._extra_state()  # type: ignore[misc]
        state.update(
            stack_size=self._stack_size,
            frame_capacity=self._frame_capacity,
            frame_count=self._frame_count,
            frames=self._frames,
        )
        return state

    def _restore_extra(self, state: dict[str, Any]) -> None:
        name = type(self).__name__
        try:
            stack_size = check_int(state["stack_size"], "stack_size", low=1)
            frame_capacity = check_int(state["frame_capacity"], "frame_capacity", low=1)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name} state: {e}") from None
        if frame_capacity < 2 * stack_size:
            raise ValueError(f"{name} state: frame_capacity must be at least 2 * stack_size")
        count = check_int(state["frame_count"], f"{name} state: frame_count", 0, _MAX_COUNT)
        self._stack_size, self._frame_capacity = stack_size, frame_capacity
        frames = state["frames"]
        if self._storage is None:  # type: ignore[attr-defined]
            if frames is not None or count:
                raise ValueError(f"{name} state: frames without stored transitions")
            super()._restore_extra(state)  # type: ignore[misc]
            return
        if not (
            isinstance(frames, np.ndarray)
            and frames.ndim >= 1
            and frames.shape[0] == frame_capacity
            and frames.dtype.kind in "biuf"
            and frames.flags.c_contiguous
            and frames.nbytes >= frame_capacity  # rows of no bytes would be sized by a number
        ):
            raise ValueError(
                f"{name} state: frames must be a C-contiguous array of numbers with "
                f"frame_capacity={frame_capacity} non-empty rows, got {frames!r:.80}"
            )
        skeleton = jax.tree_util.tree_unflatten(
            self._treedef,
            list(range(self._treedef.num_leaves)),  # type: ignore[attr-defined]
        )
        if not (isinstance(skeleton.S, int) and isinstance(skeleton.S_next, int)):
            raise ValueError(f"{name} state: S and S_next must each be one leaf of frame ids")
        n = len(self)  # type: ignore[arg-type]
        for field in ("S", "S_next"):
            ids = self._storage[getattr(skeleton, field)]  # type: ignore[attr-defined]
            if ids.dtype != np.int64 or ids.shape[1:] != (stack_size,):
                raise ValueError(
                    f"{name} state: {field} must be stored as int64 frame ids of shape "
                    f"(capacity, {stack_size}), got {ids.dtype}{list(ids.shape)}"
                )
            filled = ids[:n]
            if filled.size and (filled.min() < 0 or filled.max() >= count):
                raise ValueError(
                    f"{name} state: the frame ids of {field} must lie in [0, frame_count={count})"
                )
        self._frames, self._frame_count = frames, count  # (the prioritized priorities use them)
        super()._restore_extra(state)  # type: ignore[misc]
        # how far back the restored transitions refer (a transition stores frames below its
        # first frame_count + 2 k), so that _prune finds every one that loses frames later
        lo, hi = self._id_range(self._filled_in_order())  # type: ignore[attr-defined]
        born = np.maximum.accumulate(hi - 2 * stack_size + 1)
        self._scan_reach = int((born - lo).max()) if len(lo) else 0
        self._frontier = self._count - n  # type: ignore[attr-defined]
        self._fingerprints = np.zeros(frame_capacity, np.uint64)
        self._recent = {}
        first = max(0, count - min(self._window, frame_capacity))
        for lo in range(first, count, 1024):  # rebuilt from the frames themselves, in chunks
            fids = np.arange(lo, min(lo + 1024, count))
            fps = frame_fingerprints(frames[fids % frame_capacity])
            self._fingerprints[fids % frame_capacity] = fps
            self._recent.update(zip(fps.tolist(), fids.tolist()))
