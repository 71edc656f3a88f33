"""The state of the host replay buffers as plain data (``__checkpoint_state__``) and its
checked restore (``__checkpoint_restore__``), shared by ``utils.dump`` and replay folders."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_int, check_state_keys, checked_dtype, is_int
from coax_utils._numpy_random import bit_generator_from_state
from coax_utils.replay._ring import MAX_COUNT, RingStorage
from coax_utils.replay._transition import TransitionBatch

__all__ = ["RingState", "check_state_array", "generator_from_record", "split_state"]


def check_state_array(state: dict, key: str, owner: str, dtype: Any, shape: tuple) -> np.ndarray:
    value = state[key]
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{owner} state: {key} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype or value.shape != shape:
        raise ValueError(
            f"{owner} state: {key} must be {np.dtype(dtype)}{list(shape)}, got "
            f"{value.dtype}{list(value.shape)}"
        )
    return value


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


def split_state(state: dict[str, Any]) -> tuple[dict, list[tuple[str, Any, np.ndarray]], dict]:
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


def generator_from_record(record: Any, where: str) -> np.random.Generator:
    if not isinstance(record, dict) or set(record) != {"name", "state"}:
        raise ValueError(f"{where}: a generator record needs the keys 'name' and 'state'")
    try:
        return np.random.Generator(bit_generator_from_state(record["name"], record["state"]))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{where}: invalid generator: {e}") from None


class RingState(RingStorage):
    """The ring storage with checkpoints: its state as plain data and the checked restore."""

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
        capacity = check_int(state["capacity"], f"{name} state: capacity", 1, MAX_COUNT)
        count = check_int(state["count"], f"{name} state: count", 0, MAX_COUNT)
        counter = check_int(state["episode_counter"], f"{name} state: episode_counter", 0, count)
        episode = check_state_array(state, "episode", name, np.int64, (capacity,))
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
        arrays = [arr for _, _, arr in split_state(state)[1]]
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
        nbytes = dtype.itemsize * math.prod(int(d) for d in shape)  # Python ints: no wrap
        try:
            offset = check_int(offset, f"{name} state: the offset of leaf {i}", low=0)
        except TypeError as e:
            raise ValueError(str(e)) from None
        if offset % dtype.itemsize:
            raise ValueError(f"{name} state: leaf {i} has an unaligned offset {offset}")
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
