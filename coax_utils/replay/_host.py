"""Host-side (NumPy) replay buffers with preallocated ring storage."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from coax_utils._dataclass import pytree_dataclass
from coax_utils.replay._transition import TransitionBatch

__all__ = ["PrioritizedReplayBuffer", "SequenceSample", "SimpleReplayBuffer"]

_FORMAT_VERSION = 1
_LARGE_BYTES = 1 << 20  # sampled leaves of this size recycle memory and copy in threads
_MAX_THREADS = 4
_PACK_BYTES = 256  # leaves of at most this many bytes per item share one block of rows
_pool: Any = None


def _parallel_take(chunks: list) -> None:
    """``np.take`` of large leaves, split into row blocks copied by a few threads.

    One thread does not reach the memory bandwidth when gathering scattered rows (each row is
    a separate copy); ``np.take`` releases the GIL, so a few threads copy concurrently.
    """
    global _pool
    workers = min(_MAX_THREADS, os.cpu_count() or 1)
    pieces = []
    per_leaf = max(1, -(-workers // len(chunks)))
    for arr, slots, out in chunks:
        bounds = np.linspace(0, len(slots), per_leaf + 1).astype(int)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                pieces.append((arr, slots[lo:hi], out[lo:hi]))
    if workers == 1 or len(pieces) == 1:
        for arr, idx, out in pieces:
            np.take(arr, idx, axis=0, out=out, mode="clip")
        return
    if _pool is None or _pool[0] != os.getpid():  # a forked child needs its own threads
        from concurrent.futures import ThreadPoolExecutor

        _pool = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="replay-gather"))
    futures = [_pool[1].submit(np.take, arr, idx, 0, out, "clip") for arr, idx, out in pieces[1:]]
    arr, idx, out = pieces[0]
    np.take(arr, idx, axis=0, out=out, mode="clip")
    for future in futures:
        future.result()


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
        column is always True.
    indices : array of int, shape ``(batch_size, length)``
        Where each step was read: the transition ids (host buffers) or the storage slots
        (jittable buffers).
    """

    items: Any
    mask: Any
    indices: Any


def _check_batch_size(batch_size: Any, name: str = "batch_size") -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {batch_size!r}")
    if batch_size <= 0:
        raise ValueError(f"{name} must be a positive int, got {batch_size!r}")
    return int(batch_size)


class _RingStorage:
    """Shared machinery of the host buffers: storage, ids, episodes, RNG, persistence."""

    def __init__(self, capacity: int, random_seed: int | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be a positive int, got {capacity!r}")
        if capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self._capacity = int(capacity)
        self._random_seed = random_seed
        self._rng = np.random.default_rng(random_seed)
        self.clear()

    # -- basic properties ------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The maximum number of transitions held (older ones are overwritten)."""
        return self._capacity

    def __len__(self) -> int:
        return min(self._count, self._capacity)

    def __bool__(self) -> bool:
        return self._count > 0

    def clear(self) -> None:
        """Remove all transitions (the storage is released; the RNG stream continues)."""
        self._storage: list[np.ndarray] | None = None
        self._block: np.ndarray | None = None
        self._packed: list = []
        self._recycle: dict[int, np.ndarray] = {}
        self._treedef = None
        self._out_treedef = None
        self._idx_pos = 0
        self._w_pos = 0
        self._count = 0
        self._ids = np.full(self._capacity, -1, np.int64)
        self._episode = np.zeros(self._capacity, np.int64)
        self._episode_counter = 0

    # -- storage ---------------------------------------------------------------------------

    def _flatten(self, transition_batch: Any) -> tuple[list[np.ndarray], Any, int]:
        """Validate a batch against the storage (nothing is mutated); return leaves."""
        if not isinstance(transition_batch, TransitionBatch):
            raise TypeError(
                f"transition_batch must be a TransitionBatch, got {type(transition_batch)!r}"
            )
        try:
            batch_size = transition_batch.batch_size
        except (IndexError, TypeError):
            raise ValueError(
                f"transition_batch.Rn must have a leading batch axis, got {transition_batch.Rn!r}"
            ) from None
        W = transition_batch.W
        if W is None:
            W = np.ones(batch_size, np.float32)
        stored = transition_batch.replace(idx=None, W=W)
        leaves, treedef = jax.tree_util.tree_flatten(stored)
        leaves = [np.asarray(x) for x in leaves]
        for x in leaves:
            if x.ndim == 0 or x.shape[0] != batch_size:
                raise ValueError(
                    f"every field of the TransitionBatch needs the leading batch axis of size "
                    f"{batch_size}, got a leaf of shape {x.shape}"
                )
        if self._storage is not None:
            if treedef != self._treedef:
                raise ValueError(
                    "transition_batch differs in structure from the transitions in the buffer: "
                    f"expected {self._treedef}, got {treedef}"
                )
            for i, (x, arr) in enumerate(zip(leaves, self._storage)):
                if x.shape[1:] != arr.shape[1:] or x.dtype != arr.dtype:
                    raise ValueError(
                        f"leaf {i} of transition_batch has per-item shape {x.shape[1:]} and "
                        f"dtype {x.dtype}; the buffer holds shape {arr.shape[1:]} and dtype "
                        f"{arr.dtype}"
                    )
        return leaves, treedef, batch_size

    def _allocate(self, leaves: list[Any], treedef: Any) -> None:
        """Preallocate storage for leaves shaped like ``leaves`` (arrays with a batch axis).

        Small leaves (a few scalars each, e.g. rewards, actions, small observations) share one
        block of rows, each leaf being a view of its columns: a sample then reads each row
        with a single ``np.take`` instead of one per leaf. Larger leaves get arrays of their
        own.
        """
        shapes = [(x.shape[1:], np.dtype(x.dtype)) for x in leaves]
        small = [
            i
            for i, (shape, dtype) in enumerate(shapes)
            if dtype.itemsize * int(np.prod(shape)) <= _PACK_BYTES and dtype.kind in "biuf"
        ]
        if len(small) < 2:
            small = []
        small.sort(key=lambda i: -shapes[i][1].itemsize)  # aligned offsets
        offsets, row = {}, 0
        for i in small:
            shape, dtype = shapes[i]
            row = -(-row // dtype.itemsize) * dtype.itemsize
            offsets[i] = row
            row += dtype.itemsize * int(np.prod(shape))
        row = -(-row // 8) * 8
        self._block = np.zeros((self._capacity, row), np.uint8) if small else None
        self._packed = []  # (leaf, offset, nbytes, dtype, shape)
        storage = []
        for i, (shape, dtype) in enumerate(shapes):
            if i in offsets:
                nbytes = dtype.itemsize * int(np.prod(shape))
                view = self._block[:, offsets[i] : offsets[i] + nbytes].view(dtype)
                storage.append(view.reshape((self._capacity,) + shape))
                self._packed.append((i, offsets[i], nbytes, dtype, shape))
            else:
                storage.append(np.empty((self._capacity,) + shape, dtype))
        self._storage = storage
        self._set_treedef(treedef)

    def _set_treedef(self, treedef: Any) -> None:
        self._treedef = treedef
        # output structure: the stored structure plus an ``idx`` leaf
        skeleton = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
        nfields_before = [skeleton.S, skeleton.A, skeleton.logP, skeleton.Rn, skeleton.In]
        nfields_before += [skeleton.S_next, skeleton.A_next, skeleton.logP_next]
        n_before = len(jax.tree_util.tree_leaves(nfields_before))
        self._w_pos = n_before
        self._idx_pos = n_before + 1
        out = skeleton.replace(idx=-1)
        self._out_treedef = jax.tree_util.tree_structure(out)

    def _check_episode_end(self, episode_end: Any, batch_size: int) -> np.ndarray | None:
        if episode_end is None:
            return None
        ends = np.asarray(episode_end)
        if ends.ndim == 0:
            ends = np.broadcast_to(ends, (batch_size,))
        if ends.shape != (batch_size,) or ends.dtype.kind not in "bi":
            raise ValueError(
                f"episode_end must be a bool array of shape ({batch_size},), got "
                f"{ends.dtype}{list(ends.shape)}"
            )
        return ends.astype(bool)

    def _write(self, leaves: list[np.ndarray], treedef: Any, batch_size: int, ends: Any) -> Any:
        """Write validated leaves into the ring; return the slots written."""
        if self._storage is None:
            self._allocate(leaves, treedef)
        elif not all(arr.flags.writeable for arr in self._storage):
            raise ValueError("the buffer is read-only (loaded with mmap_mode='r')")
        ids = self._count + np.arange(batch_size, dtype=np.int64)
        episode = np.full(batch_size, self._episode_counter, np.int64)
        if ends is not None and batch_size:
            episode[1:] += np.cumsum(ends[:-1])
        keep = slice(max(0, batch_size - self._capacity), None)  # only the newest rows fit
        ids, episode = ids[keep], episode[keep]
        slots = ids % self._capacity
        start = int(slots[0]) if len(slots) else 0
        stop = start + len(slots)
        if stop <= self._capacity:  # one contiguous block
            for arr, x in zip(self._storage, leaves):
                arr[start:stop] = x[keep]
            self._ids[start:stop] = ids
            self._episode[start:stop] = episode
        else:
            for arr, x in zip(self._storage, leaves):
                arr[slots] = x[keep]
            self._ids[slots] = ids
            self._episode[slots] = episode
        self._count += batch_size
        if ends is not None:
            self._episode_counter += int(ends.sum())
        return slots, ids

    def _output(self, i: int, arr: np.ndarray, n: int) -> np.ndarray:
        """An array for ``n`` rows of leaf ``i``: fresh, or recycled when unreferenced.

        Filling fresh memory costs page faults that can double the time of a large gather
        (e.g. a batch of Atari frames). The last output of each large leaf is kept; when the
        caller no longer holds any reference to it (nor to a view of it), the next sample
        writes into it instead of allocating. A batch that is still referenced is never
        overwritten.
        """
        out = self._recycle.get(i)
        # references: the dict, the local name and getrefcount's argument
        if out is not None and out.shape[0] == n and sys.getrefcount(out) == 3:
            return out
        out = np.empty((n,) + arr.shape[1:], arr.dtype)
        self._recycle[i] = out
        return out

    def _gather(self, slots: np.ndarray, W: np.ndarray | None = None) -> TransitionBatch:
        n = len(slots)
        leaves: list = [None] * len(self._storage)
        chunks = []  # large leaves: (storage, slots, out) pieces, copied by several threads
        packed = set()
        if self._block is not None:
            rows = np.take(self._block, slots, axis=0, mode="clip")
            for i, offset, nbytes, dtype, shape in self._packed:
                view = rows[:, offset : offset + nbytes].view(dtype)
                leaves[i] = view.reshape((n,) + shape)
                packed.add(i)
        for i, arr in enumerate(self._storage):
            if i in packed:
                continue
            if arr[:1].nbytes * n < _LARGE_BYTES:
                leaves[i] = np.take(arr, slots, axis=0, mode="clip")
            else:
                leaves[i] = out = self._output(i, arr, n)
                chunks.append((arr, slots, out))
        if chunks:
            _parallel_take(chunks)
        if W is not None:
            leaves[self._w_pos] = leaves[self._w_pos] * W.astype(leaves[self._w_pos].dtype)
        leaves.insert(self._idx_pos, np.take(self._ids, slots, mode="clip"))
        return self._out_treedef.unflatten(leaves)

    def _check_nonempty(self, batch_size: Any) -> int:
        batch_size = _check_batch_size(batch_size)
        if not self._count:
            raise ValueError("cannot sample from an empty replay buffer: add transitions first")
        return batch_size

    def _oldest_slot(self) -> int:
        return self._count % self._capacity if self._count > self._capacity else 0

    def __iter__(self) -> Iterator[TransitionBatch]:
        """Iterate over the stored transitions, oldest first, as batches of size 1."""
        oldest, n = self._oldest_slot(), len(self)
        for j in range(n):
            yield self._gather(np.array([(oldest + j) % self._capacity]))

    def sample_sequences(self, batch_size: int, length: int) -> SequenceSample:
        """Sample contiguous windows of ``length`` consecutive transitions.

        Window starts are drawn uniformly among the positions that leave room for ``length``
        stored transitions (in insertion order). Windows never cross an episode boundary:
        boundaries are the rows added with ``episode_end=True`` (see :meth:`add`); the steps
        of a window after the end of its first episode are masked and padded with a copy of
        the last valid step (see :class:`SequenceSample`). This *mask* choice (rather than
        resampling until a window fits) keeps the cost fixed and also samples episode ends
        that are shorter than ``length``.

        Episodes must be added contiguously: transitions of several environments added
        interleaved into one buffer do not form windows.

        Parameters
        ----------
        batch_size : int
            The number of windows.
        length : int
            The window length :math:`L`.

        Returns
        -------
        sample : SequenceSample
            ``items`` is a :class:`TransitionBatch` whose leaves have shape
            ``(batch_size, length, ...)``; ``indices`` equals ``items.idx``.

        Raises
        ------
        ValueError
            If ``batch_size`` or ``length`` is not positive, or the buffer holds fewer than
            ``length`` transitions.
        """
        batch_size = self._check_nonempty(batch_size)
        length = _check_batch_size(length, "length")
        n = len(self)
        if n < length:
            raise ValueError(f"the buffer holds {n} transitions, fewer than length={length}")
        starts = self._rng.integers(0, n - length + 1, size=batch_size)
        logical = starts[:, None] + np.arange(length)
        slots = (self._oldest_slot() + logical) % self._capacity
        episode = self._episode[slots]
        mask = episode == episode[:, :1]
        last = mask.sum(axis=1, keepdims=True) - 1
        slots = np.take_along_axis(slots, np.minimum(np.arange(length), last), axis=1)
        batch = self._gather(slots.reshape(-1))
        items = jax.tree_util.tree_map(
            lambda x: x.reshape((batch_size, length) + x.shape[1:]), batch
        )
        return SequenceSample(items=items, mask=mask, indices=items.idx)

    # -- persistence -----------------------------------------------------------------------

    def _extra_state(self) -> dict:
        return {}

    def _set_extra_state(self, state: dict) -> None:
        pass

    def __getstate__(self) -> dict:
        n = len(self)
        skip = ("_storage", "_rng", "_recycle", "_block", "_packed")
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        state["_rng_state"] = self._rng.bit_generator.state
        state["_rng_class"] = type(self._rng.bit_generator).__name__
        # only the filled slots are stored (slots [0, n) are filled while not yet full)
        state["_storage"] = None if self._storage is None else [a[:n] for a in self._storage]
        for key in ("_treedef", "_out_treedef"):
            state.pop(key)
        state["_skeleton"] = (
            None
            if self._treedef is None
            else jax.tree_util.tree_unflatten(self._treedef, [0] * self._treedef.num_leaves)
        )
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        rng_state, rng_class = state.pop("_rng_state"), state.pop("_rng_class")
        skeleton, stored = state.pop("_skeleton"), state.pop("_storage")
        self.__dict__.update(state)
        bit_generator = getattr(np.random, rng_class)()
        bit_generator.state = rng_state
        self._rng = np.random.Generator(bit_generator)
        self._storage = None
        self._block, self._packed = None, []
        self._recycle = {}
        self._treedef = self._out_treedef = None
        if stored is not None:
            self._allocate(stored, jax.tree_util.tree_structure(skeleton))
            for arr, a in zip(self._storage, stored):
                arr[: len(a)] = a

    def save(self, path: str | os.PathLike) -> None:
        """Save the buffer to a directory of ``.npy`` files, without a pickle copy of the data.

        Each storage leaf is written to its own ``leaf_<i>.npy`` file (streamed from the
        in-memory array); the small remainder (counters, ids, episodes, priorities, the RNG
        state and the structure of the transitions) goes to ``meta.lz4`` through
        :func:`coax_utils.utils.dump`. This is the format for large buffers (e.g. millions of
        Atari frames): :meth:`load` can memory-map the leaves instead of reading them, and
        nothing is ever held twice in memory. For small buffers, ``utils.dump(buffer, path)``
        is simpler and equivalent.

        Parameters
        ----------
        path : str or os.PathLike
            The directory (created if needed; files of an earlier save are overwritten).
        """
        from coax_utils.utils import dump

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        state = self.__getstate__()
        stored = state.pop("_storage")
        state["_leaf_files"] = 0 if stored is None else len(stored)
        state["_format_version"] = _FORMAT_VERSION
        state["_class"] = type(self).__name__
        if self._storage is not None:
            for i, arr in enumerate(self._storage):
                out = np.lib.format.open_memmap(
                    os.path.join(path, f"leaf_{i}.npy"),
                    mode="w+",
                    dtype=arr.dtype,
                    shape=arr.shape,
                )
                out[:] = arr
                out.flush()
                del out
        dump(state, os.path.join(path, "meta.lz4"))

    @classmethod
    def load(cls, path: str | os.PathLike, mmap_mode: str | None = "c") -> Any:
        """Load a buffer written by :meth:`save`.

        Parameters
        ----------
        path : str or os.PathLike
            The directory given to :meth:`save`.
        mmap_mode : {"c", "r+", "r", None}, optional
            How the storage files are opened (see :func:`numpy.load`). The default ``"c"``
            memory-maps them copy-on-write: pages are read lazily from disk and new
            transitions stay in memory, leaving the files unchanged. ``"r+"`` writes new
            transitions through to the files, ``"r"`` gives a read-only buffer that can be
            sampled but not added to, and ``None`` reads everything into memory.

        Returns
        -------
        buffer
            A buffer of the saved class, continuing the saved RNG stream.

        Raises
        ------
        ValueError
            If the directory does not hold a buffer of this class.
        """
        from coax_utils.utils import load

        if mmap_mode not in ("c", "r+", "r", None):
            raise ValueError(f"mmap_mode must be 'c', 'r+', 'r' or None, got {mmap_mode!r}")
        path = os.fspath(path)
        state = load(os.path.join(path, "meta.lz4"), safe=True)
        if not isinstance(state, dict) or state.get("_class") != cls.__name__:
            found = state.get("_class") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{path!r} does not hold a saved {cls.__name__} (found {found!r})")
        if state.pop("_format_version") != _FORMAT_VERSION:
            raise ValueError(f"{path!r} was saved in an unsupported format version")
        state.pop("_class")
        n_files = state.pop("_leaf_files")
        state["_storage"] = None
        obj = cls.__new__(cls)
        obj.__setstate__(state)
        if n_files:
            obj._storage = [
                np.load(os.path.join(path, f"leaf_{i}.npy"), mmap_mode=mmap_mode)
                for i in range(n_files)
            ]
            obj._set_treedef(jax.tree_util.tree_structure(state["_skeleton"]))
        return obj


class SimpleReplayBuffer(_RingStorage):
    r"""A ring buffer for experience replay, with uniform sampling.

    Transitions are kept in NumPy arrays preallocated on the first :meth:`add` (small leaves
    of the :class:`TransitionBatch` share one block of rows; larger ones have an array each);
    when the buffer is full the oldest transitions are overwritten. Every added transition
    gets an id (0, 1, 2, ... in insertion order), returned in the ``idx`` field of sampled
    batches.

    Unlike coax (which samples without replacement through Python's global ``random``), the
    buffer samples *with* replacement from its own seeded :class:`numpy.random.Generator`, so
    ``batch_size`` may exceed ``len(buffer)`` and global random state is never touched.

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    random_seed : int, optional
        Seed of the buffer's random number generator, for reproducible samples.

    Examples
    --------
    >>> import numpy as np
    >>> buffer = SimpleReplayBuffer(capacity=3, random_seed=0)
    >>> for t in range(5):
    ...     tr = TransitionBatch.from_single(s=t, a=0, logp=0.0, r=1.0, done=False, gamma=0.9)
    ...     buffer.add(tr)
    >>> len(buffer), sorted(int(tr.S[0]) for tr in buffer)
    (3, [2, 3, 4])
    >>> batch = buffer.sample(batch_size=8)
    >>> batch.batch_size, bool(np.all(batch.S == batch.idx))
    (8, True)
    """

    def add(
        self, transition_batch: TransitionBatch, Adv: Any = None, *, episode_end: Any = None
    ) -> None:
        """Add a batch of transitions.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions (any batch size; only the newest ``capacity`` rows are kept if it
            is larger than the buffer).
        Adv : array, optional
            Accepted for interface compatibility with :class:`PrioritizedReplayBuffer` and
            ignored.
        episode_end : bool or array of bool, optional
            Marks rows that are the last transition of their episode. Only
            :meth:`sample_sequences` uses it; without it the rows continue the current
            episode.

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a :class:`TransitionBatch`.
        ValueError
            If its structure, per-item shapes or dtypes differ from the stored transitions, or
            its fields disagree on the batch size. The buffer is unchanged.
        """
        leaves, treedef, batch_size = self._flatten(transition_batch)
        ends = self._check_episode_end(episode_end, batch_size)
        self._write(leaves, treedef, batch_size, ends)

    def sample(self, batch_size: int = 32) -> TransitionBatch:
        """Sample a batch of transitions uniformly (with replacement).

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions.

        Returns
        -------
        transitions : TransitionBatch
            Fresh arrays (not views of the storage), with ``idx`` set to the transition ids
            and ``W`` to the stored sample weights.

        Raises
        ------
        ValueError
            If the buffer is empty or ``batch_size`` is not positive.
        """
        batch_size = self._check_nonempty(batch_size)
        # floor(u * n) with 53-bit uniform u: uniform up to a bias of n / 2**53
        slots = (self._rng.random(batch_size) * len(self)).astype(np.int64)
        return self._gather(slots)

    def __repr__(self) -> str:
        return f"SimpleReplayBuffer(capacity={self._capacity}, len={len(self)})"


class PrioritizedReplayBuffer(_RingStorage):
    r"""A ring buffer for experience replay, with proportional prioritized sampling.

    Transitions are sampled with probability

    .. math::

        P(i)\ =\ \frac{p_i}{\sum_j p_j}\,,\qquad
        p_i\ =\ \left(|\mathcal{A}_i| + \epsilon\right)^\alpha

    where :math:`\mathcal{A}_i` are the advantages (typically TD errors) given to :meth:`add`
    or :meth:`update`. Sampled batches carry importance weights that undo the bias, normalised
    so that the largest weight in the batch is 1 (section 3.4 of
    https://arxiv.org/abs/1511.05952):

    .. math::

        w_i\ =\ \frac{\left(N\,P(i)\right)^{-\beta}}{\max_j \left(N\,P(j)\right)^{-\beta}}

    with :math:`N` the number of stored transitions; ``W`` of the sampled batch is the stored
    weight times :math:`w_i`. :math:`\alpha=0` gives uniform sampling. The priorities live in
    a :class:`coax_utils.utils.SumTree`; storage is as in :class:`SimpleReplayBuffer`.

    The buffer keeps :math:`|\mathcal{A}_i|` per slot, so changing ``alpha`` or ``epsilon``
    re-weights every stored transition (``beta`` only affects the weights). A transition added
    without advantages gets the largest :math:`|\mathcal{A}|` seen so far (1 before any was
    given).

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    alpha : float, optional
        The priority exponent :math:`\alpha\ge0`.
    beta : float, optional
        The importance-weight exponent :math:`\beta\ge0` (typically annealed towards 1).
    epsilon : float, optional
        The regulator :math:`\epsilon>0` that keeps every priority positive.
    random_seed : int, optional
        Seed of the buffer's random number generator.

    Examples
    --------
    >>> import numpy as np
    >>> buffer = PrioritizedReplayBuffer(capacity=10, random_seed=0)
    >>> batch = TransitionBatch.from_single(s=0, a=0, logp=0.0, r=1.0, done=False, gamma=0.9)
    >>> buffer.add(TransitionBatch.concatenate(batch, batch), Adv=np.array([0.0, 3.0]))
    >>> sample = buffer.sample(batch_size=4)
    >>> sample.idx.shape, float(sample.W.max())
    ((4,), 1.0)
    >>> buffer.update(sample.idx, np.zeros(4))
    """

    def __init__(
        self,
        capacity: int,
        alpha: float = 1.0,
        beta: float = 1.0,
        epsilon: float = 1e-4,
        random_seed: int | None = None,
    ) -> None:
        self._alpha = self._check_exponent("alpha", alpha)
        self._beta = self._check_exponent("beta", beta)
        self._epsilon = self._check_epsilon(epsilon)
        super().__init__(capacity, random_seed)

    # -- hyperparameters -------------------------------------------------------------------

    @staticmethod
    def _check_exponent(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"{name} must be a non-negative float, got {value!r}")
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a non-negative float, got {value!r}")
        return float(value)

    @staticmethod
    def _check_epsilon(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"epsilon must be a positive float, got {value!r}")
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"epsilon must be a positive float, got {value!r}")
        return float(value)

    @property
    def alpha(self) -> float:
        """The priority exponent :math:`\\alpha` (settable; re-weights stored transitions)."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = self._check_exponent("alpha", value)
        self._refresh_priorities()

    @property
    def beta(self) -> float:
        """The importance-weight exponent :math:`\\beta` (settable, e.g. from a schedule)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = self._check_exponent("beta", value)

    @property
    def epsilon(self) -> float:
        """The regulator :math:`\\epsilon` (settable; re-weights stored transitions)."""
        return self._epsilon

    @epsilon.setter
    def epsilon(self, value: float) -> None:
        self._epsilon = self._check_epsilon(value)
        self._refresh_priorities()

    def _priority(self, abs_adv: np.ndarray) -> np.ndarray:
        return np.power(abs_adv + self._epsilon, self._alpha)

    def _refresh_priorities(self) -> None:
        n = len(self)
        if n:
            slots = np.arange(n)
            self._tree.set_values(slots, self._priority(self._abs_adv[slots]))

    # -- core ------------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove all transitions and priorities (the RNG stream continues)."""
        from coax_utils.utils._segment_tree import SumTree

        super().clear()
        self._tree = SumTree(self._capacity)
        self._abs_adv = np.zeros(self._capacity, np.float64)
        self._max_abs_adv: float | None = None

    @staticmethod
    def _check_adv(Adv: Any, shape: tuple, what: str) -> np.ndarray:
        adv = np.asarray(Adv)
        if adv.dtype.kind not in "biuf":
            raise TypeError(f"Adv must be a numeric array, got dtype {adv.dtype}")
        adv = adv.astype(np.float64)
        if adv.shape != shape:
            raise ValueError(f"Adv must have shape {shape} (one per {what}), got {adv.shape}")
        if not np.all(np.isfinite(adv)):
            raise ValueError(f"Adv must be finite (no NaN or inf), got {Adv!r}")
        if np.any(adv < 0):
            raise ValueError(
                f"Adv must be non-negative (pass magnitudes, e.g. np.abs(td_error)), got {Adv!r}"
            )
        return adv

    def add(
        self, transition_batch: TransitionBatch, Adv: Any = None, *, episode_end: Any = None
    ) -> None:
        """Add a batch of transitions with their advantages.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions.
        Adv : array of shape ``(batch_size,)``, optional
            Non-negative advantages (e.g. absolute TD errors) that set the priorities.
            Without it, the transitions get the largest :math:`|\\mathcal{A}|` seen so far.
        episode_end : bool or array of bool, optional
            Marks rows that end their episode (see :meth:`SimpleReplayBuffer.add`).

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a :class:`TransitionBatch`.
        ValueError
            If the batch does not match the stored transitions, or ``Adv`` has the wrong
            shape or holds NaN or infinite values. The buffer is unchanged.
        """
        leaves, treedef, batch_size = self._flatten(transition_batch)
        ends = self._check_episode_end(episode_end, batch_size)
        if Adv is None:
            default = 1.0 if self._max_abs_adv is None else self._max_abs_adv
            abs_adv = np.full(batch_size, default)
        else:
            abs_adv = self._check_adv(Adv, (batch_size,), "transition")
        slots, _ = self._write(leaves, treedef, batch_size, ends)
        abs_adv = abs_adv[batch_size - len(slots) :]
        self._abs_adv[slots] = abs_adv
        self._tree.set_values(slots, self._priority(abs_adv))
        if Adv is not None and batch_size:
            self._max_abs_adv = max(self._max_abs_adv or 0.0, float(abs_adv.max()))

    def sample(self, batch_size: int = 32) -> TransitionBatch:
        """Sample a batch of transitions in proportion to their priorities.

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions (drawn with replacement).

        Returns
        -------
        transitions : TransitionBatch
            With ``idx`` (pass it to :meth:`update`) and ``W`` (stored weights times the
            normalised importance weights).

        Raises
        ------
        ValueError
            If the buffer is empty or ``batch_size`` is not positive.
        """
        batch_size = self._check_nonempty(batch_size)
        u = self._rng.random(batch_size)
        slots = np.asarray(self._tree.inverse_cdf(u), dtype=np.int64)
        prob = self._tree.values[slots] / self._tree.root_value
        W = np.power(len(self) * prob, -self._beta)
        W /= W.max()
        return self._gather(slots, W)

    def update(self, idx: Any, Adv: Any) -> None:
        """Update the priorities of transitions sampled earlier.

        Ids of transitions that were overwritten since they were sampled are ignored (their
        slot now holds another transition). With duplicate ids, the last value wins.

        Parameters
        ----------
        idx : array of int, shape ``(k,)``
            Transition ids, the ``idx`` of a sampled batch.
        Adv : array, shape ``(k,)``
            The new non-negative advantages (e.g. absolute TD errors).

        Raises
        ------
        ValueError
            If the shapes differ, ids are negative or not integers, or ``Adv`` holds negative,
            NaN or infinite values. Nothing is changed.
        """
        idx = np.asarray(idx)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ValueError(f"idx must be a 1-d array of ints, got {idx.dtype}{list(idx.shape)}")
        abs_adv = self._check_adv(Adv, idx.shape, "idx")
        if idx.size and idx.min() < 0:
            raise ValueError(f"idx must be non-negative transition ids, got {idx.min()}")
        idx = idx.astype(np.int64)
        slots = idx % self._capacity
        live = self._ids[slots] == idx
        slots, abs_adv = slots[live], abs_adv[live]
        if slots.size:
            # last write wins for duplicates: keep the last occurrence of each slot
            rev_unique = np.unique(slots[::-1], return_index=True)[1]
            keep = len(slots) - 1 - rev_unique
            slots, abs_adv = slots[keep], abs_adv[keep]
            self._abs_adv[slots] = abs_adv
            self._tree.set_values(slots, self._priority(abs_adv))
            self._max_abs_adv = max(self._max_abs_adv or 0.0, float(abs_adv.max()))

    # -- persistence -----------------------------------------------------------------------

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_tree")  # rebuilt from _abs_adv on load
        return state

    def __setstate__(self, state: dict) -> None:
        from coax_utils.utils._segment_tree import SumTree

        super().__setstate__(state)
        self._tree = SumTree(self._capacity)
        self._refresh_priorities()

    def __repr__(self) -> str:
        return (
            f"PrioritizedReplayBuffer(capacity={self._capacity}, len={len(self)}, "
            f"alpha={self._alpha}, beta={self._beta}, epsilon={self._epsilon})"
        )
