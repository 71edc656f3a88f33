"""Host-side (NumPy) replay buffers with preallocated ring storage."""

from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from coax_utils import utils
from coax_utils._checks import check_float, check_int, check_state_keys, checked_dtype, is_int
from coax_utils._files import open_regular_file
from coax_utils._numpy_random import bit_generator_from_state
from coax_utils.replay._sequence import SequenceSample
from coax_utils.replay._transition import TransitionBatch
from coax_utils.utils import SumTree

__all__ = ["PrioritizedReplayBuffer", "SimpleReplayBuffer"]

# sampled leaves of this size are copied by several threads (below it, handing a piece to a
# second thread cost more than it saved: 1.1 MB leaves of frames 24 % slower, 1.8 MB even)
_LARGE_BYTES = 2 << 20
_MAX_COUNT = np.iinfo(np.int64).max  # ids are int64 and never wrap
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


def _check_batch_size(batch_size: Any, name: str = "batch_size") -> int:
    return check_int(batch_size, name, low=1)


def _check_int(state: dict, key: str, owner: str, lo: int, hi: int) -> int:
    value = state[key]
    if not is_int(value):
        raise TypeError(f"{owner} state: {key} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{owner} state: {key} must lie in [{lo}, {hi}], got {value}")
    return int(value)


def _check_array(state: dict, key: str, owner: str, dtype: Any, shape: tuple) -> np.ndarray:
    value = state[key]
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{owner} state: {key} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype or value.shape != shape:
        raise ValueError(
            f"{owner} state: {key} must be {np.dtype(dtype)}{list(shape)}, got "
            f"{value.dtype}{list(value.shape)}"
        )
    return value


def _check_ids(idx: Any) -> np.ndarray:
    """Transition ids as a 1-d int64 array; refuses what does not fit instead of wrapping."""
    if isinstance(idx, (list, tuple)):
        if not all(is_int(i) for i in idx):
            raise TypeError(f"idx must be ints, got {idx!r:.100}")
        bad = [i for i in idx if not 0 <= int(i) <= _MAX_COUNT]
        if bad:
            raise ValueError(f"idx must be transition ids in [0, 2**63), got {bad[0]}")
        return np.array([int(i) for i in idx], dtype=np.int64)
    arr = np.asarray(idx)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"idx must be an array of ints, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"idx must be a 1-d array, got shape {arr.shape}")
    # compared in the array's own dtype: uint64 2**64 - 1 must not wrap to -1
    bad = arr > _MAX_COUNT if arr.dtype.kind == "u" else arr < 0
    if bad.any():
        raise ValueError(f"idx must be transition ids in [0, 2**63), got {arr[np.argmax(bad)]}")
    return arr.astype(np.int64)


def _ids_of_slots(count: int, capacity: int) -> np.ndarray:
    """The id held by every slot after ``count`` additions (-1 for a slot never written)."""
    slots = np.arange(capacity, dtype=np.int64)
    return np.where(slots < count, slots + capacity * ((count - 1 - slots) // capacity), -1)


# -- the structure of the stored transitions, as plain data -------------------------------------

_STORED_FIELDS = ("S", "A", "logP", "Rn", "In", "S_next", "A_next", "logP_next", "W", "extra_info")
_MAX_DEPTH = 64


def _encode_node(x: Any, where: str, depth: int = 0) -> Any:
    """A pytree whose leaves are all 0, as nested dicts, lists, tuples, None and 0."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where} is nested deeper than {_MAX_DEPTH} levels")
    if x is None or (type(x) is int and x == 0):
        return x
    if type(x) in (list, tuple):
        return type(x)(_encode_node(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x))
    if type(x) is dict and all(type(k) is str for k in x):
        return {k: _encode_node(v, f"{where}[{k!r}]", depth + 1) for k, v in x.items()}
    raise TypeError(
        f"{where} is a {type(x).__name__} node; a buffer checkpoint describes transitions made "
        "of arrays in dicts (str keys), lists and tuples only"
    )


def _encode_structure(treedef: Any) -> dict[str, Any]:
    skeleton = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return {name: _encode_node(getattr(skeleton, name), name) for name in _STORED_FIELDS}


def _decode_structure(structure: Any, owner: str) -> Any:
    """The treedef of stored transitions from :func:`_encode_structure` (checked)."""
    if not isinstance(structure, dict) or set(structure) != set(_STORED_FIELDS):
        raise ValueError(
            f"{owner} state: structure must be a dict with the keys {list(_STORED_FIELDS)}"
        )
    try:
        fields = {name: _encode_node(structure[name], name) for name in _STORED_FIELDS}
    except TypeError as e:
        raise ValueError(f"{owner} state: structure: {e}") from None
    for name in ("Rn", "W"):  # the batch size and the weights are read from one array each
        if fields[name] != 0:
            raise ValueError(
                f"{owner} state: structure: {name} must be one array, got {fields[name]!r}"
            )
    return jax.tree_util.tree_structure(TransitionBatch(**fields))


# -- folders of .npy files ----------------------------------------------------------------------

_FOLDER_FORMAT = 2
_META = "meta.lz4"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _leftovers(target: str) -> tuple[dict[str, str], dict[str, str]]:
    """The folders of interrupted saves into ``target``: ``(staged, replaced)`` by token."""
    parent, base = os.path.split(target)
    staged, replaced = {}, {}
    for name in os.listdir(parent):
        for prefix, found in ((f".{base}.saving-", staged), (f".{base}.old-", replaced)):
            if name.startswith(prefix):
                found[name[len(prefix) :]] = os.path.join(parent, name)
    return staged, replaced


def _interrupted_swap(target: str) -> str | None:
    """The complete new folder of a save killed between its two renames, if ``target`` is
    missing because of one (the old folder was moved away, the new one not yet moved in)."""
    if os.path.lexists(target):
        return None
    staged, replaced = _leftovers(target)
    tokens = sorted(set(staged) & set(replaced))
    return staged[tokens[-1]] if tokens else None


def _is_saved_folder(path: str) -> bool:
    names = os.listdir(path)
    return all(n == _META or re.fullmatch(r"leaf_\d+\.npy", n) for n in names)


def _read_npy(path: str, dtype: np.dtype, shape: list, mmap_mode: str | None) -> np.ndarray:
    """The array of a ``.npy`` file that must hold ``dtype`` and ``shape``, opened once.

    The file must be a regular file, not a link; its header is checked against ``dtype``
    and ``shape``, and its size against the array's bytes, before anything is allocated or
    mapped (``np.load`` would allocate whatever a forged header claims).
    """
    with open_regular_file(path, follow_links=False) as (fd, size):
        with open(fd, "rb", closefd=False) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy format version {version}")
            read = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }[version]
            got_shape, fortran, got_dtype = read(f)
            if got_dtype != dtype or list(got_shape) != shape:
                raise ValueError(
                    f"it holds {got_dtype}{list(got_shape)}, the metadata says {dtype}{shape}"
                )
            start, nbytes = f.tell(), dtype.itemsize * math.prod(shape)
            if size < start + nbytes:
                raise ValueError(f"it is shorter than the {nbytes} bytes of its array")
            order = "F" if fortran else "C"
            if mmap_mode is not None and nbytes:
                return np.memmap(f, dtype, mmap_mode, start, tuple(shape), order)
            arr = np.empty(shape, dtype, order=order)
            if nbytes and f.readinto(arr.reshape(-1, order="A").view(np.uint8)) != nbytes:
                raise ValueError(f"it is shorter than the {nbytes} bytes of its array")
            return arr


def _write_npy(path: str, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.asanyarray(arr).view(np.ndarray), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _split_state(state: dict[str, Any]) -> tuple[dict, list[tuple[str, Any, np.ndarray]], dict]:
    """Take the arrays (top-level values and items of top-level lists) and the Generators out
    of a checkpoint state; their places hold None."""
    meta: dict[str, Any] = {}
    arrays: list[tuple[str, Any, np.ndarray]] = []
    generators = {}
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            arrays.append((key, None, value))
            value = None
        elif isinstance(value, np.random.Generator):
            bit_generator = value.bit_generator
            generators[key] = {"name": type(bit_generator).__name__, "state": bit_generator.state}
            value = None
        elif isinstance(value, list):
            value = list(value)
            for i, item in enumerate(value):
                if isinstance(item, np.ndarray):
                    arrays.append((key, i, item))
                    value[i] = None
        meta[key] = value
    return meta, arrays, generators


def _generator(record: Any, where: str) -> np.random.Generator:
    if not isinstance(record, dict) or set(record) != {"name", "state"}:
        raise ValueError(f"{where}: a generator record needs the keys 'name' and 'state'")
    try:
        return np.random.Generator(bit_generator_from_state(record["name"], record["state"]))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{where}: invalid generator: {e}") from None


class _RingStorage:
    """Shared machinery of the host buffers: storage, ids, episodes, RNG, persistence."""

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
        if self._count + batch_size > _MAX_COUNT:
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
        batch_size = _check_batch_size(batch_size)
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
        length = _check_batch_size(length, "length")
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

    # -- checkpoints -----------------------------------------------------------------------

    _STATE_KEYS: tuple[str, ...] = (
        "capacity",
        "count",
        "episode",
        "episode_counter",
        "rng",
        "structure",
        "block",
        "leaves",
    )

    def __checkpoint_state__(self) -> dict[str, Any]:
        """The buffer as plain data, for checkpoints.

        Keys: ``capacity``, ``count`` (transitions added since the last :meth:`clear`; the
        ids follow from it), ``episode`` and ``episode_counter`` (episode numbers per slot,
        for :meth:`sample_sequences`), ``rng`` (the buffer's
        :class:`numpy.random.Generator`), ``structure`` (the structure of the stored
        :class:`TransitionBatch`, as nested dicts, lists and tuples whose leaves are 0; None
        before the first :meth:`add`), ``block`` (the shared rows of the small leaves, or
        None) and ``leaves`` (per stored leaf: its storage array, or the ``offset``, ``dtype``
        and ``shape`` of its columns in ``block``). Storage arrays are the buffer's own, at
        full capacity (not copies).

        Raises
        ------
        TypeError
            If the transitions hold pytree nodes other than dicts with str keys, lists and
            tuples (e.g. a NamedTuple), which plain data cannot describe.
        """
        specs: list[Any] = []
        if self._storage is not None:
            packed = {i: (offset, dtype, shape) for i, offset, _, dtype, shape in self._packed}
            for i, arr in enumerate(self._storage):
                if i in packed:
                    offset, dtype, shape = packed[i]
                    specs.append({"offset": offset, "dtype": dtype.str, "shape": list(shape)})
                else:
                    specs.append(arr)
        state = {
            "capacity": self._capacity,
            "count": self._count,
            "episode": self._episode,
            "episode_counter": self._episode_counter,
            "rng": self._rng,
            "structure": None if self._treedef is None else _encode_structure(self._treedef),
            "block": self._block,
            "leaves": specs,
        }
        state.update(self._extra_state())
        return state

    @classmethod
    def __checkpoint_restore__(cls, state: dict[str, Any]) -> Any:
        """Rebuild a buffer from :meth:`__checkpoint_state__`, trusting nothing in it.

        Every key, type, dtype and shape is checked against the capacity, and so are the
        counters, the episode numbers, the layout of the small leaves in ``block`` and (for
        the prioritized buffer) the advantages and hyperparameters. The storage arrays become
        the buffer's storage without a copy (read-only arrays give a read-only buffer).

        Raises
        ------
        ValueError, TypeError
            Naming what is wrong; nothing is built.
        """
        name = cls.__name__
        state = check_state_keys(state, cls._STATE_KEYS, name)
        obj = cls.__new__(cls)
        capacity = _check_int(state, "capacity", name, 1, _MAX_COUNT)
        count = _check_int(state, "count", name, 0, _MAX_COUNT)
        counter = _check_int(state, "episode_counter", name, 0, count)
        episode = _check_array(state, "episode", name, np.int64, (capacity,))
        rng = state["rng"]
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"{name} state: rng must be a numpy Generator, got {rng!r}")
        obj._capacity, obj._rng = capacity, rng
        obj.clear()
        obj._count, obj._episode_counter, obj._episode = count, counter, episode
        obj._ids = _ids_of_slots(count, capacity)
        in_order = episode[obj._filled_in_order()]
        if (
            np.any(in_order < 0)
            or np.any(np.diff(in_order) < 0)
            or np.any(in_order > counter)
            or np.any(episode[len(obj) :] != 0)
        ):
            raise ValueError(
                f"{name} state: episode numbers must grow from the oldest transition on, up "
                f"to episode_counter={counter}, and be 0 in empty slots"
            )
        obj._restore_storage(state)
        if count and obj._storage is None:
            raise ValueError(f"{name} state: count is {count} but the buffer holds no storage")
        obj._restore_extra(state)
        arrays = [arr for _, _, arr in _split_state(state)[1]]
        for k, a in enumerate(arrays):
            if any(np.may_share_memory(a, b) for b in arrays[k + 1 :]):
                raise ValueError(f"{name} state: two arrays of the state share memory")
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).__checkpoint_restore__, (self.__checkpoint_state__(),))

    def _restore_storage(self, state: dict[str, Any]) -> None:
        name, capacity = type(self).__name__, self._capacity
        structure, block, specs = state["structure"], state["block"], state["leaves"]
        if not isinstance(specs, list):
            raise TypeError(f"{name} state: leaves must be a list, got {type(specs).__name__}")
        if structure is None:
            if block is not None or specs:
                raise ValueError(f"{name} state: storage without a structure")
            return
        treedef = _decode_structure(structure, name)
        if len(specs) != treedef.num_leaves:
            raise ValueError(
                f"{name} state: the structure has {treedef.num_leaves} leaves, but leaves "
                f"holds {len(specs)}"
            )
        if block is not None and not (
            isinstance(block, np.ndarray)
            and block.dtype == np.uint8
            and block.ndim == 2
            and block.shape[0] == capacity
            and block.flags.c_contiguous
        ):
            raise ValueError(
                f"{name} state: block must be a C-contiguous uint8 array of shape "
                f"({capacity}, row bytes), got {block!r:.80}"
            )
        columns = []
        for i, spec in enumerate(specs):
            if isinstance(spec, np.ndarray):
                if spec.ndim == 0 or spec.shape[0] != capacity or spec.dtype.kind in "OV":
                    raise ValueError(
                        f"{name} state: leaf {i} must be an array of numbers with "
                        f"{capacity} rows, got {spec.dtype}{list(spec.shape)}"
                    )
                continue
            columns.append(self._check_column(i, spec, block))
        columns.sort()
        for (_, hi0, i0), (lo1, _, i1) in zip(columns, columns[1:]):
            if lo1 < hi0:
                raise ValueError(f"{name} state: leaves {i0} and {i1} overlap in block")
        self._adopt_storage(block, specs, treedef)
        w = self._storage[self._w_pos]
        if w.ndim != 1 or w.dtype.kind != "f":
            raise ValueError(f"{name} state: W must be stored as floats, one per transition")
        filled = w[: len(self)]  # slots fill from 0 up
        if not np.all(np.isfinite(filled) & (filled >= 0)):
            raise ValueError(f"{name} state: the stored weights W must be finite and >= 0")

    def _check_column(self, i: int, spec: Any, block: Any) -> tuple[int, int, int]:
        name = type(self).__name__
        if not isinstance(spec, dict) or set(spec) != {"offset", "dtype", "shape"}:
            raise ValueError(
                f"{name} state: leaf {i} must be an array or a dict with the keys offset, "
                f"dtype and shape, got {spec!r:.80}"
            )
        if block is None:
            raise ValueError(f"{name} state: leaf {i} lies in block, but block is None")
        offset, shape = spec["offset"], spec["shape"]
        try:
            dtype = checked_dtype(spec["dtype"], "dtype")
        except ValueError:
            dtype = None
        if dtype is None or dtype.kind not in "biuf" or dtype.itemsize == 0:
            raise ValueError(f"{name} state: leaf {i} has an invalid dtype {spec['dtype']!r}")
        if not (
            isinstance(shape, list)
            and len(shape) <= 8
            and all(is_int(d) and d >= 0 for d in shape)
        ):
            raise ValueError(f"{name} state: leaf {i} has an invalid shape {shape!r}")
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if not (is_int(offset) and offset >= 0 and offset % dtype.itemsize == 0):
            raise ValueError(f"{name} state: leaf {i} has an invalid offset {offset!r}")
        if offset + nbytes > block.shape[1]:
            raise ValueError(
                f"{name} state: leaf {i} ends at byte {offset + nbytes}, past the "
                f"{block.shape[1]} bytes of a block row"
            )
        return int(offset), int(offset) + nbytes, i

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _restore_extra(self, state: dict[str, Any]) -> None:
        pass

    # -- folders ---------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Save the buffer to a folder of ``.npy`` files, atomically.

        Each storage array of :meth:`__checkpoint_state__` goes to its own ``leaf_<i>.npy``
        file (streamed from memory, no copy); the rest of the state (counters, episodes,
        priorities, the RNG state, the structure of the transitions) goes to ``meta.lz4``
        through :func:`coax_utils.utils.dump`. :meth:`load` can memory-map the leaves instead
        of reading them: the format for large buffers (e.g. millions of Atari frames). For
        small buffers, ``utils.dump(buffer, path)`` is simpler and equivalent.

        The save is atomic and crash-safe: the files are written to a new folder beside
        ``path`` (same parent), flushed to disk (files and folder), then swapped in with two
        renames; the old folder is removed last. A process killed at any moment leaves a
        ``path`` that :meth:`load` reads as the complete old or the complete new buffer
        (between the two renames :meth:`load` finds the new folder beside ``path``), and the
        next save into ``path`` removes the leftovers. The files of the old folder are never
        truncated, so saving into the folder a buffer was loaded (and memory-mapped) from
        keeps every transition, on disk and in memory.

        Parameters
        ----------
        path : str or os.PathLike
            The folder. Its parent is created if needed; an existing ``path`` must be a
            folder written by :meth:`save` (or empty), which is replaced.

        Raises
        ------
        ValueError
            If ``path`` exists and is not such a folder (nothing is written).
        TypeError
            If the transitions cannot be described as plain data (see
            :meth:`__checkpoint_state__`).
        """
        target = os.path.abspath(os.fspath(path))
        parent, base = os.path.split(target)
        if os.path.lexists(target) and not (
            os.path.isdir(target) and not os.path.islink(target) and _is_saved_folder(target)
        ):
            raise ValueError(
                f"{target!r} exists and is not a folder written by save(); not replacing it"
            )
        meta, arrays, generators = _split_state(self.__checkpoint_state__())
        os.makedirs(parent, exist_ok=True)
        staged, replaced = _leftovers(target)
        interrupted = _interrupted_swap(target)
        if interrupted is not None:  # finish the swap of a killed save: it was complete
            os.rename(interrupted, target)
            _fsync_path(parent)
        for leftover in list(staged.values()) + list(replaced.values()):
            if leftover != interrupted:
                _remove_tree(leftover)
        token = f"{time.time_ns():020d}-{secrets.token_hex(4)}"
        staging = os.path.join(parent, f".{base}.saving-{token}")
        os.mkdir(staging)
        try:
            files = []
            for i, (key, index, arr) in enumerate(arrays):
                file = f"leaf_{i}.npy"
                _write_npy(os.path.join(staging, file), arr)
                files.append(
                    {
                        "file": file,
                        "key": key,
                        "index": index,
                        "dtype": arr.dtype.str,
                        "shape": list(arr.shape),
                    }
                )
            record = {
                "format": _FOLDER_FORMAT,
                "class": type(self).__name__,
                "state": meta,
                "files": files,
                "generators": generators,
            }
            # written last: marks a complete folder
            utils.dump(record, os.path.join(staging, _META))
            _fsync_path(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if os.path.lexists(target):
            old = os.path.join(parent, f".{base}.old-{token}")
            os.rename(target, old)
            os.rename(staging, target)
            _fsync_path(parent)
            _remove_tree(old)
        else:
            os.rename(staging, target)
        _fsync_path(parent)

    @classmethod
    def load(cls, path: str | os.PathLike, mmap_mode: str | None = "c") -> Any:
        """Load a buffer written by :meth:`save`.

        Everything read is checked: the metadata, each leaf file's dtype and shape against
        it, and the whole state through :meth:`__checkpoint_restore__`.

        Parameters
        ----------
        path : str or os.PathLike
            The folder given to :meth:`save`.
        mmap_mode : {"c", "r", None}, optional
            How the storage files are opened (see :func:`numpy.load`). The default ``"c"``
            memory-maps them copy-on-write: pages are read lazily from disk and new
            transitions stay in memory, leaving the files unchanged. ``"r"`` gives a
            read-only buffer that can be sampled but not added to, and ``None`` reads
            everything into memory (the arrays read become the storage: no second copy).
            Writing through to the files (numpy's ``"r+"``) is refused: it would change the
            saved storage without its metadata, leaving a folder that is neither the saved
            buffer nor a newer one; call :meth:`save` to persist new transitions.

        Returns
        -------
        buffer
            A buffer of the saved class, continuing the saved RNG stream.

        Raises
        ------
        FileNotFoundError
            If ``path`` does not exist.
        ValueError
            If the folder is incomplete, does not hold a buffer of this class, holds a file
            that is not a regular file (a link, a FIFO: none is read), or anything in it is
            inconsistent; the message names the folder.
        """
        if mmap_mode not in ("c", "r", None):
            hint = " (writing through to a saved folder would break it; use save)"
            raise ValueError(
                f"mmap_mode must be 'c', 'r' or None, got {mmap_mode!r}"
                + (hint if mmap_mode in ("r+", "w+") else "")
            )
        target = os.path.abspath(os.fspath(path))
        folder = _interrupted_swap(target) or target
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"no saved buffer at {target!r}")
        meta_path = os.path.join(folder, _META)

        def bad(what: str) -> ValueError:
            return ValueError(f"{folder!r} does not hold a complete saved {cls.__name__}: {what}")

        if not os.path.lexists(meta_path):
            raise bad(f"{_META} is missing (an incomplete save)")
        if os.path.islink(meta_path):  # (utils.load refuses FIFOs, folders and devices)
            raise bad(f"{_META} is a link, not a regular file")
        try:
            record = utils.load(meta_path, safe=True)
        except (ValueError, TypeError, OSError, EOFError) as e:
            raise bad(f"{_META} cannot be read ({e})") from None
        keys = ("format", "class", "state", "files", "generators")
        if not isinstance(record, dict) or set(record) != set(keys):
            raise bad(f"{_META} must hold a dict with the keys {list(keys)}")
        if record["class"] != cls.__name__:
            raise bad(f"it holds a {record['class']!r}")
        if record["format"] != _FOLDER_FORMAT:
            raise bad(f"unsupported format {record['format']!r}")
        state, files, generators = record["state"], record["files"], record["generators"]
        if not (isinstance(state, dict) and isinstance(files, list)):
            raise bad("state must be a dict and files a list")
        if not isinstance(generators, dict):
            raise bad("generators must be a dict")
        expected = {f"leaf_{i}.npy" for i in range(len(files))} | {_META}
        if set(os.listdir(folder)) != expected:
            raise bad(f"it must hold exactly {sorted(expected)}, found {os.listdir(folder)}")
        state = dict(state)
        for i, entry in enumerate(files):
            if not (isinstance(entry, dict) and entry.get("file") == f"leaf_{i}.npy"):
                raise bad(f"files[{i}] must describe leaf_{i}.npy")
            arr = cls._read_leaf(os.path.join(folder, entry["file"]), entry, mmap_mode, bad)
            key, index = entry.get("key"), entry.get("index")
            place = state.get(key) if isinstance(key, str) else "missing"
            if index is None and place is None and key in state:
                state[key] = arr
            elif is_int(index) and isinstance(place, list) and 0 <= index < len(place):
                if place[index] is not None:
                    raise bad(f"files[{i}] points at {key}[{index}], which is not empty")
                state[key] = place = list(place)
                place[index] = arr
            else:
                raise bad(f"files[{i}] points at {key!r}[{index!r}], not an empty place")
        for key, generator in generators.items():
            if key not in state or state[key] is not None:
                raise bad(f"generator {key!r} has no empty place in the state")
            try:
                state[key] = _generator(generator, key)
            except ValueError as e:
                raise bad(str(e)) from None
        try:
            return cls.__checkpoint_restore__(state)
        except (TypeError, ValueError) as e:
            raise bad(str(e)) from None

    @staticmethod
    def _read_leaf(path: str, entry: dict, mmap_mode: str | None, bad: Any) -> np.ndarray:
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if not (isinstance(dtype, str) and isinstance(shape, list)):
            raise bad(f"{entry['file']}: dtype and shape must be recorded")
        try:
            np_dtype = checked_dtype(dtype, "dtype")
            return _read_npy(path, np_dtype, shape, mmap_mode)
        except (TypeError, ValueError, OSError, EOFError) as e:
            raise bad(f"{entry['file']} cannot be read ({e})") from None


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
            If its structure, per-item shapes or dtypes differ from the stored transitions, its
            fields disagree on the batch size, or ``W`` is not one finite float >= 0 per
            transition. The buffer is unchanged.
        """
        self._add(transition_batch, None, episode_end)

    def sample(
        self, batch_size: int = 32, *, out: TransitionBatch | None = None
    ) -> TransitionBatch:
        """Sample a batch of transitions uniformly (with replacement).

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions.
        out : TransitionBatch, optional
            An earlier sample of the same size from this buffer whose arrays the new sample
            is written into (and which is returned): large batches (e.g. Atari frames) then
            skip the page faults of fresh memory. Only pass a batch that nothing else uses
            any more.

        Returns
        -------
        transitions : TransitionBatch
            Fresh arrays (not views of the storage) or those of ``out``, with ``idx`` set to
            the transition ids and ``W`` to the stored sample weights.

        Raises
        ------
        TypeError
            If ``out`` is not a :class:`TransitionBatch`.
        ValueError
            If the buffer is empty, ``batch_size`` is not positive, or ``out`` does not have
            the structure, shapes and dtypes of such a sample in writable arrays of its own.
            Nothing is drawn from the random stream.
        """
        batch_size = self._check_nonempty(batch_size)
        targets = self._check_out(out, batch_size)
        # floor(u * n) with 53-bit uniform u: uniform up to a bias of n / 2**53
        slots = (self._rng.random(batch_size) * len(self)).astype(np.int64)
        return self._gather(slots, out=targets)

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
        return check_float(value, name, low=0)

    @staticmethod
    def _check_epsilon(value: Any) -> float:
        return check_float(value, "epsilon", low=0, low_open=True)

    @property
    def alpha(self) -> float:
        """The priority exponent :math:`\\alpha` (settable; re-weights stored transitions).

        A value that makes a stored priority or their total overflow is refused
        (ValueError) and nothing changes."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        alpha = self._check_exponent("alpha", value)
        self._refresh_priorities(alpha, self._epsilon)
        self._alpha = alpha

    @property
    def beta(self) -> float:
        """The importance-weight exponent :math:`\\beta` (settable, e.g. from a schedule)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = self._check_exponent("beta", value)

    @property
    def epsilon(self) -> float:
        """The regulator :math:`\\epsilon` (settable; re-weights stored transitions, refused
        like :attr:`alpha` when a priority would overflow)."""
        return self._epsilon

    @epsilon.setter
    def epsilon(self, value: float) -> None:
        epsilon = self._check_epsilon(value)
        self._refresh_priorities(self._alpha, epsilon)
        self._epsilon = epsilon

    def _priority(self, abs_adv: np.ndarray, alpha: float, epsilon: float) -> np.ndarray:
        """``(|Adv| + epsilon) ** alpha``, checked finite (ValueError naming the value)."""
        with np.errstate(over="ignore"):
            p = np.power(abs_adv + epsilon, alpha)
        bad = ~np.isfinite(p)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(
                f"the priority (|Adv| + epsilon) ** alpha of |Adv| = {abs_adv[k]} overflows "
                f"(alpha={alpha}, epsilon={epsilon}); nothing was changed"
            )
        return p

    def _refresh_priorities(self, alpha: float, epsilon: float) -> None:
        slots = np.arange(len(self))
        self._tree.set_values(slots, self._priority(self._abs_adv[slots], alpha, epsilon))

    # -- core ------------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove all transitions and priorities (the RNG stream continues)."""
        super().clear()
        self._tree = SumTree(self._capacity)
        self._abs_adv = np.zeros(self._capacity, np.float64)
        self._max_abs_adv: float | None = None

    @staticmethod
    def _check_adv(Adv: Any, shape: tuple, what: str) -> np.ndarray:
        """``|Adv|`` as float64 of the given shape, all finite."""
        adv = np.asarray(Adv)
        if adv.dtype.kind not in "biuf":
            raise TypeError(f"Adv must be a numeric array, got dtype {adv.dtype}")
        if adv.shape != shape:
            raise ValueError(f"Adv must have shape {shape} (one per {what}), got {adv.shape}")
        adv = np.abs(adv.astype(np.float64))
        if not np.all(np.isfinite(adv)):
            raise ValueError(f"Adv must be finite (no NaN or inf), got {Adv!r}")
        return adv

    def _check_new_priorities(self, Adv: Any, batch_size: int) -> Any:
        if Adv is None:
            default = 1.0 if self._max_abs_adv is None else self._max_abs_adv
            abs_adv = np.full(batch_size, default)
        else:
            abs_adv = self._check_adv(Adv, (batch_size,), "transition")
        return abs_adv, self._priority(abs_adv, self._alpha, self._epsilon), Adv is not None

    def _set_new_priorities(self, slots: np.ndarray, priorities: Any, keep: slice) -> None:
        abs_adv, p, given = priorities
        abs_adv, p = abs_adv[keep], p[keep]
        self._tree.set_values(slots, p)  # refuses a total that overflows, changing nothing
        self._abs_adv[slots] = abs_adv
        if given and len(abs_adv):
            self._max_abs_adv = max(self._max_abs_adv or 0.0, float(abs_adv.max()))

    def add(
        self, transition_batch: TransitionBatch, Adv: Any = None, *, episode_end: Any = None
    ) -> None:
        """Add a batch of transitions with their advantages.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions.
        Adv : array of shape ``(batch_size,)``, optional
            Advantages (e.g. TD errors), of either sign: the priorities use
            :math:`|\\mathcal{A}|`, as in coax. Without it, the transitions get the largest
            :math:`|\\mathcal{A}|` seen so far.
        episode_end : bool or array of bool, optional
            Marks rows that end their episode (see :meth:`SimpleReplayBuffer.add`).

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a :class:`TransitionBatch` or ``Adv`` is not
            numeric.
        ValueError
            If the batch does not match the stored transitions, ``Adv`` has the wrong shape
            or holds NaN or infinite values, or a priority or the total of the priorities
            would overflow. Every check runs before the first write: the buffer (storage,
            priorities, ids, RNG) is unchanged.
        """
        self._add(transition_batch, Adv, episode_end)

    def sample(
        self, batch_size: int = 32, *, out: TransitionBatch | None = None
    ) -> TransitionBatch:
        """Sample a batch of transitions in proportion to their priorities.

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions (drawn with replacement).
        out : TransitionBatch, optional
            An earlier sample to write into, as in :meth:`SimpleReplayBuffer.sample`.

        Returns
        -------
        transitions : TransitionBatch
            With ``idx`` (pass it to :meth:`update`) and ``W`` (stored weights times the
            normalised importance weights).

        Raises
        ------
        TypeError, ValueError
            If the buffer is empty, ``batch_size`` is not positive or ``out`` does not fit
            (see :meth:`SimpleReplayBuffer.sample`); nothing is drawn.
        """
        batch_size = self._check_nonempty(batch_size)
        targets = self._check_out(out, batch_size)
        u = self._rng.random(batch_size)
        slots = np.asarray(self._tree.inverse_cdf(u), dtype=np.int64)
        return self._gather(slots, self._importance_weights(slots), targets)

    def _importance_weights(self, slots: np.ndarray) -> np.ndarray:
        """The importance weights of ``slots``, normalised by their largest."""
        prob = self._tree.values[slots] / self._tree.root_value
        W = np.power(len(self) * prob, -self._beta)
        W /= W.max()
        return W

    @property
    def total_priority(self) -> float:
        """The sum of the priorities of the stored transitions (0 when empty)."""
        return float(self._tree.root_value) if self._count else 0.0

    def priorities(self, idx: Any) -> np.ndarray:
        """The current priorities :math:`(|\\mathcal{A}| + \\epsilon)^\\alpha` of stored
        transitions.

        Parameters
        ----------
        idx : array of int, shape ``(k,)``
            Transition ids, the ``idx`` of a sampled batch.

        Returns
        -------
        priorities : float64 array, shape ``(k,)``

        Raises
        ------
        TypeError
            If ``idx`` is not integers.
        ValueError
            If an id is not held by the buffer (never issued, or overwritten since).
        """
        idx = _check_ids(idx)
        slots = idx % self._capacity
        held = self._ids[slots] == idx
        if not held.all():
            raise ValueError(f"ids {idx[~held][:5].tolist()} are not held by the buffer")
        return np.asarray(self._tree.values[slots], np.float64)

    def update(self, idx: Any, Adv: Any) -> None:
        """Update the priorities of transitions sampled earlier.

        Ids of transitions that were overwritten since they were sampled are ignored (their
        slot now holds another transition), and so are ids the buffer has not issued yet, as
        in coax. With duplicate ids, the last value wins.

        Parameters
        ----------
        idx : array of int, shape ``(k,)``
            Transition ids, the ``idx`` of a sampled batch.
        Adv : array, shape ``(k,)``
            The new advantages (e.g. TD errors), of either sign: the priorities use
            :math:`|\\mathcal{A}|`.

        Raises
        ------
        TypeError
            If ``idx`` is not integers or ``Adv`` not numbers.
        ValueError
            If the shapes differ, an id is negative or beyond int64 (ids never wrap), ``Adv``
            holds NaN or infinite values, or a priority or their total would overflow.
            Nothing is changed.
        """
        idx = _check_ids(idx)
        abs_adv = self._check_adv(Adv, idx.shape, "idx")
        p = self._priority(abs_adv, self._alpha, self._epsilon)
        slots = idx % self._capacity
        live = self._updatable(slots, idx)
        slots, abs_adv, p = slots[live], abs_adv[live], p[live]
        if slots.size:
            # last write wins for duplicates: keep the last occurrence of each slot
            rev_unique = np.unique(slots[::-1], return_index=True)[1]
            keep = len(slots) - 1 - rev_unique
            slots, abs_adv, p = slots[keep], abs_adv[keep], p[keep]
            self._tree.set_values(slots, p)  # refuses a total that overflows
            self._abs_adv[slots] = abs_adv
            self._max_abs_adv = max(self._max_abs_adv or 0.0, float(abs_adv.max()))

    def _updatable(self, slots: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Which ids ``idx`` (held in ``slots`` if anywhere) :meth:`update` sets."""
        return self._ids[slots] == idx

    # -- checkpoints -----------------------------------------------------------------------

    _STATE_KEYS = _RingStorage._STATE_KEYS + (
        "alpha",
        "beta",
        "epsilon",
        "abs_adv",
        "max_abs_adv",
    )

    def _extra_state(self) -> dict[str, Any]:
        # the sum tree is rebuilt from abs_adv on restore, so it always agrees with it
        return {
            "alpha": self._alpha,
            "beta": self._beta,
            "epsilon": self._epsilon,
            "abs_adv": self._abs_adv,
            "max_abs_adv": self._max_abs_adv,
        }

    def _restore_extra(self, state: dict[str, Any]) -> None:
        name = type(self).__name__
        try:
            self._alpha = self._check_exponent("alpha", state["alpha"])
            self._beta = self._check_exponent("beta", state["beta"])
            self._epsilon = self._check_epsilon(state["epsilon"])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name} state: {e}") from None
        abs_adv = _check_array(state, "abs_adv", name, np.float64, (self._capacity,))
        top = state["max_abs_adv"]
        if top is not None and not (
            isinstance(top, (float, int)) and not isinstance(top, bool) and 0 <= top < np.inf
        ):
            raise ValueError(f"{name} state: max_abs_adv must be None or a finite float >= 0")
        n = len(self)
        bound = max(1.0 if top is None else top, 1.0)  # rows added without Adv get max(1, top)
        filled = abs_adv[:n]
        if not (np.all(np.isfinite(filled)) and np.all(filled >= 0) and np.all(filled <= bound)):
            raise ValueError(
                f"{name} state: abs_adv of stored transitions must be finite, >= 0 and at most "
                f"max(max_abs_adv, 1) = {bound}"
            )
        if np.any(abs_adv[n:] != 0):
            raise ValueError(f"{name} state: abs_adv must be 0 in empty slots")
        self._abs_adv, self._max_abs_adv = abs_adv, None if top is None else float(top)
        self._refresh_priorities(self._alpha, self._epsilon)

    def __repr__(self) -> str:
        return (
            f"PrioritizedReplayBuffer(capacity={self._capacity}, len={len(self)}, "
            f"alpha={self._alpha}, beta={self._beta}, epsilon={self._epsilon})"
        )
