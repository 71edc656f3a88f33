"""The ring storage of the host replay buffers: preallocated arrays (small leaves packed into
one block of rows), transition ids, episode numbers, adding and gathering."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_int, is_int
from coax_utils.replay._sequence import SequenceSample
from coax_utils.replay._transition import TransitionBatch

__all__ = ["MAX_COUNT", "RingStorage", "check_ids"]

# sampled leaves of this size are copied by several threads (below it, handing a piece to a
# second thread cost more than it saved: 1.1 MB leaves of frames 24 % slower, 1.8 MB even)
_LARGE_BYTES = 2 << 20
MAX_COUNT = np.iinfo(np.int64).max  # ids are int64 and never wrap
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


def check_ids(idx: Any) -> np.ndarray:
    """Transition ids as a 1-d int64 array; refuses what does not fit instead of wrapping."""
    if isinstance(idx, (list, tuple)):
        if not all(is_int(i) for i in idx):
            raise TypeError(f"idx must be ints, got {idx!r:.100}")
        bad = [i for i in idx if not 0 <= int(i) <= MAX_COUNT]
        if bad:
            raise ValueError(f"idx must be transition ids in [0, 2**63), got {bad[0]}")
        return np.array([int(i) for i in idx], dtype=np.int64)
    arr = np.asarray(idx)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"idx must be an array of ints, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"idx must be a 1-d array, got shape {arr.shape}")
    # compared in the array's own dtype: uint64 2**64 - 1 must not wrap to -1
    bad = arr > MAX_COUNT if arr.dtype.kind == "u" else arr < 0
    if bad.any():
        raise ValueError(f"idx must be transition ids in [0, 2**63), got {arr[np.argmax(bad)]}")
    return arr.astype(np.int64)


class RingStorage:
    """Shared machinery of the host buffers: preallocated storage, ids, episodes, the RNG,
    adding, gathering samples and windows (checkpoints: :mod:`._host_state`)."""

    def __init__(self, capacity: int, random_seed: int | None = None) -> None:
        self._capacity = check_int(capacity, "capacity", low=1)
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
        self._records: np.ndarray | None = None
        self._fields: list[tuple[int, str]] = []  # (leaf, field of _records), packed leaves
        self._unpacked: list[int] = []  # leaves with arrays of their own
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
            rn = jax.tree_util.tree_structure(transition_batch.Rn)
            if rn.num_leaves != 1 or not jax.tree_util.treedef_is_leaf(rn):
                raise TypeError  # None or a container: the batch size comes from one array
            batch_size = transition_batch.batch_size
        except (IndexError, TypeError):
            raise ValueError(
                f"transition_batch.Rn must have a leading batch axis, got {transition_batch.Rn!r}"
            ) from None
        W = transition_batch.W
        if W is None:
            W = np.ones(batch_size, np.float32)
        W = np.asarray(W)
        if W.shape != (batch_size,) or W.dtype.kind != "f":
            raise ValueError(
                f"transition_batch.W must be a float array of shape ({batch_size},), got "
                f"{W.dtype}{list(W.shape)}"
            )
        if not np.all(np.isfinite(W) & (W >= 0)):
            raise ValueError(f"transition_batch.W must be finite and >= 0, got {W!r:.80}")
        stored = transition_batch.replace(idx=None, W=W)
        leaves, treedef = jax.tree_util.tree_flatten(stored)
        leaves = [np.asarray(x) for x in leaves]
        for x in leaves:
            if x.ndim == 0 or x.shape[0] != batch_size:
                raise ValueError(
                    f"every field of the TransitionBatch needs the leading batch axis of size "
                    f"{batch_size}, got a leaf of shape {x.shape}"
                )
            if x.dtype.kind in "OV":
                raise TypeError(f"the buffer stores arrays of numbers, got dtype {x.dtype}")
        if self._storage is not None:
            if treedef != self._treedef:
                raise ValueError(
                    "transition_batch differs in structure from the transitions in the buffer: "
                    f"expected {self._treedef}, got {treedef}"
                )
            for i, (x, arr) in enumerate(zip(leaves, self._storage)):
                if x.shape[1:] != arr.shape[1:] or x.dtype != arr.dtype:
                    path = jax.tree_util.tree_leaves_with_path(stored)[i][0]
                    raise ValueError(
                        f"transition_batch{jax.tree_util.keystr(path)} has per-item shape "
                        f"{x.shape[1:]} and dtype {x.dtype}; the buffer holds shape "
                        f"{arr.shape[1:]} and dtype {arr.dtype}"
                    )
            if not all(arr.flags.writeable for arr in self._storage):
                raise ValueError("the buffer is read-only (loaded with mmap_mode='r')")
        if self._count + batch_size > MAX_COUNT:
            raise ValueError("the transition ids would overflow int64")
        return leaves, treedef, batch_size

    def _new_storage(self, leaves: list[Any]) -> tuple[np.ndarray | None, list]:
        """Preallocate storage for leaves shaped like ``leaves`` (arrays with a batch axis).

        Small leaves (a few scalars each, e.g. rewards, actions, small observations) share one
        block of rows, each leaf being a view of its columns: a sample then reads each row
        with a single ``np.take`` instead of one per leaf. Larger leaves get arrays of their
        own. Returns ``(block, leaves)`` in the form of the checkpoint state: each leaf is an
        array or a ``{"offset", "dtype", "shape"}`` record of its columns in the block.
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
        block = np.zeros((self._capacity, row), np.uint8) if small else None
        specs: list[Any] = []
        for i, (shape, dtype) in enumerate(shapes):
            if i in offsets:
                specs.append({"offset": offsets[i], "dtype": dtype.str, "shape": list(shape)})
            else:
                specs.append(np.empty((self._capacity,) + shape, dtype))
        return block, specs

    def _adopt_storage(self, block: np.ndarray | None, specs: list, treedef: Any) -> None:
        """Make ``block`` and ``specs`` (see :meth:`_new_storage`) the storage, no copy."""
        storage, packed = [], []
        for i, spec in enumerate(specs):
            if isinstance(spec, np.ndarray):
                storage.append(spec)
                continue
            dtype, shape, offset = np.dtype(spec["dtype"]), tuple(spec["shape"]), spec["offset"]
            nbytes = dtype.itemsize * int(np.prod(shape))
            view = block[:, offset : offset + nbytes].view(dtype)
            storage.append(view.reshape((self._capacity,) + shape))
            packed.append((i, offset, nbytes, dtype, shape))
        self._block, self._packed, self._storage = block, packed, storage
        # the block's rows as records with one field per packed leaf: a sample takes the rows
        # and reads each leaf as a field
        self._records = None
        self._fields = [(i, str(i)) for i, *_ in packed]
        self._unpacked = [i for i, spec in enumerate(specs) if isinstance(spec, np.ndarray)]
        if packed:
            self._records = block.view(
                np.dtype(
                    {
                        "names": [name for _, name in self._fields],
                        "formats": [(dtype, shape) for *_, dtype, shape in packed],
                        "offsets": [offset for _, offset, *_ in packed],
                        "itemsize": block.shape[1],
                    }
                )
            )[:, 0]
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

    def _add(self, transition_batch: Any, Adv: Any, episode_end: Any) -> None:
        """Validate everything, then write: a rejected call changes nothing."""
        leaves, treedef, batch_size = self._flatten(transition_batch)
        ends = self._check_episode_end(episode_end, batch_size)
        priorities = self._check_new_priorities(Adv, batch_size)
        keep = slice(max(0, batch_size - self._capacity), None)  # only the newest rows fit
        ids = (self._count + np.arange(batch_size, dtype=np.int64))[keep]
        episode = np.full(batch_size, self._episode_counter, np.int64)
        if ends is not None and batch_size:
            episode[1:] += np.cumsum(ends[:-1])
        slots = ids % self._capacity
        new = self._new_storage(leaves) if self._storage is None else None
        self._set_new_priorities(slots, priorities, keep)  # the last check (tree total)
        if new is not None:
            self._adopt_storage(*new, treedef)
        start = int(slots[0]) if len(slots) else 0
        stop = start + len(slots)
        if stop <= self._capacity:  # one contiguous block
            slots = slice(start, stop)
        for arr, x in zip(self._storage, leaves):
            arr[slots] = x[keep]
        self._ids[slots] = ids
        self._episode[slots] = episode[keep]
        self._count += batch_size
        if ends is not None:
            self._episode_counter += int(ends.sum())

    def _check_new_priorities(self, Adv: Any, batch_size: int) -> Any:
        """Validate the priorities of a batch to add (prioritized buffers)."""
        return None

    def _set_new_priorities(self, slots: np.ndarray, priorities: Any, keep: slice) -> None:
        """Write the priorities of added rows; raises (changing nothing) if refused."""

    def _check_out(self, out: Any, batch_size: int) -> list[np.ndarray] | None:
        """The arrays of ``out`` (see ``sample``) if they can take a sample; else raise."""
        if out is None:
            return None
        if not isinstance(out, TransitionBatch):
            raise TypeError(f"out must be a TransitionBatch, got {type(out).__name__}")
        if self._storage is None:
            raise ValueError("cannot sample from an empty replay buffer: add transitions first")
        leaves, treedef = jax.tree_util.tree_flatten(out)
        if treedef != self._out_treedef:
            raise ValueError(
                f"out must have the structure of a sample of this buffer: expected "
                f"{self._out_treedef}, got {treedef}"
            )
        expected = list(self._storage)
        expected.insert(self._idx_pos, self._ids)
        for i, (x, arr) in enumerate(zip(leaves, expected)):
            if not (
                isinstance(x, np.ndarray)
                and x.shape == (batch_size,) + arr.shape[1:]
                and x.dtype == arr.dtype
                and x.flags.writeable
            ):
                raise ValueError(
                    f"leaf {i} of out must be a writable array "
                    f"{arr.dtype}{[batch_size, *arr.shape[1:]]}, got {x!r:.80}"
                )
        # the buffer's memory: the block (holding the packed leaves) and the other arrays
        owners = [self._storage[i] for i in self._unpacked] + [self._ids, self._episode]
        if self._block is not None:
            owners.append(self._block)
        for k, x in enumerate(leaves):
            for other in owners:
                if np.may_share_memory(x, other):
                    raise ValueError(f"leaf {k} of out shares memory with the buffer")
            # the small leaves of a sample are disjoint fields of one array of records
            for other in leaves[k + 1 :]:
                if np.shares_memory(x, other):
                    raise ValueError(f"leaf {k} of out shares memory with another leaf of out")
        return leaves

    def _gather(
        self, slots: np.ndarray, W: np.ndarray | None = None, out: list | None = None
    ) -> TransitionBatch:
        """The transitions in ``slots``: fresh arrays, or written into the leaves ``out``."""
        return self._out_treedef.unflatten(self._gather_leaves(slots, W, out))

    def _gather_leaves(
        self, slots: np.ndarray, W: np.ndarray | None = None, out: list | None = None
    ) -> list:
        """The leaves of ``_gather`` (in the order of a sample's tree), not yet unflattened."""
        n = len(slots)
        targets = list(out) if out is not None else None
        if targets is not None:
            idx_out = targets.pop(self._idx_pos)
        leaves: list = [None] * len(self._storage)
        chunks = []  # large leaves: (storage, slots, out) pieces, copied by several threads
        if self._records is not None:
            rows = np.take(self._records, slots, mode="clip")
            for i, name in self._fields:
                if targets is None:
                    leaves[i] = rows[name]
                else:
                    leaves[i] = targets[i]
                    np.copyto(leaves[i], rows[name])
        fresh = self._unpacked
        if targets is None and fresh:
            # One allocation for all leaves: freed and reused as a whole, it does not page
            # fault again on the next sample (separate arrays each would, for large frames).
            sizes = [-(-self._storage[i][:1].nbytes * n // 64) * 64 for i in fresh]
            block = np.empty(sum(sizes), np.uint8)
            offset = 0
            for i, size in zip(fresh, sizes):
                arr = self._storage[i]
                nbytes = arr[:1].nbytes * n
                view = block[offset : offset + nbytes].view(arr.dtype)
                leaves[i] = view.reshape((n,) + arr.shape[1:])
                offset += size
        for i in fresh:
            arr = self._storage[i]
            if targets is not None:
                leaves[i] = targets[i]
            if arr[:1].nbytes * n < _LARGE_BYTES:
                np.take(arr, slots, axis=0, out=leaves[i], mode="clip")
            else:
                chunks.append((arr, slots, leaves[i]))
        if chunks:
            _parallel_take(chunks)
        if W is not None:
            self._scale_weights(leaves, W)
        if targets is None:
            idx_out = np.empty(n, np.int64)
        np.take(self._ids, slots, out=idx_out, mode="clip")
        leaves.insert(self._idx_pos, idx_out)
        return leaves

    def _scale_weights(self, leaves: list, W: np.ndarray) -> None:
        """Multiply the stored weights among a sample's ``leaves`` by ``W``, in place."""
        w = leaves[self._w_pos]
        np.multiply(w, W.astype(w.dtype), out=w)

    def _check_nonempty(self, batch_size: Any) -> int:
        batch_size = check_int(batch_size, "batch_size", low=1)
        if not self._count:
            raise ValueError("cannot sample from an empty replay buffer: add transitions first")
        return batch_size

    def _oldest_slot(self) -> int:
        return self._count % self._capacity if self._count > self._capacity else 0

    def _filled_in_order(self) -> np.ndarray:
        """The filled slots, oldest first."""
        return (self._oldest_slot() + np.arange(len(self))) % self._capacity

    def __iter__(self) -> Iterator[TransitionBatch]:
        """Iterate over the stored transitions, oldest first, as batches of size 1."""
        for slot in self._filled_in_order():
            yield self._gather(np.array([slot]))

    def _window_starts(self, batch_size: int, positions: int) -> np.ndarray:
        """Logical positions (0 = oldest) where ``batch_size`` windows start."""
        return self._rng.integers(0, positions, size=batch_size)

    def _window_mask(self, slots: np.ndarray) -> np.ndarray:
        """Which steps of each window (rows of ``slots``) belong to its first episode."""
        episode = self._episode[slots]
        return episode == episode[:, :1]

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
        length = check_int(length, "length", low=1)
        n = len(self)
        if n < length:
            raise ValueError(f"the buffer holds {n} transitions, fewer than length={length}")
        starts = self._window_starts(batch_size, n - length + 1)
        logical = starts[:, None] + np.arange(length)
        slots = (self._oldest_slot() + logical) % self._capacity
        mask = self._window_mask(slots)
        last = mask.sum(axis=1, keepdims=True) - 1
        slots = np.take_along_axis(slots, np.minimum(np.arange(length), last), axis=1)
        batch = self._gather(slots.reshape(-1))
        items = jax.tree_util.tree_map(
            lambda x: x.reshape((batch_size, length) + x.shape[1:]), batch
        )
        return SequenceSample(items=items, mask=mask, indices=items.idx)
