"""Decoding the data tree of a checkpoint: what ``load(..., safe=True)`` trusts.

The structure is JSON. Plain values are JSON values (``null``, booleans, integers, floats,
strings); everything else is a list whose first item is a tag:

=========================  ======================================================
``["I", hex]``             an int too large for a JSON integer
``["c", re, im]``          complex
``["y", b]`` ``["Y", b]``  bytes, bytearray (buffer ``b``)
``["l", id, items]``       list (also ``"t"`` tuple, ``"S"`` set, ``"F"`` frozenset)
``["d", id, pairs]``       dict (also ``"O"`` OrderedDict), ``pairs`` = [[key, value], ...]
``["a", id, dt, shape, order, b]``  numpy array of dtype ``dt`` (buffer ``b``)
``["s", dt, hex]``         numpy scalar
``["D", dt]``              numpy dtype (``"T"``: its scalar type, e.g. ``np.float32``)
``["j", id, dt, shape, weak, b]``   jax array (placed on the default device)
``["k", id, impl, data]``  typed PRNG key array (``data`` a ``"j"`` node)
``["g", id, name, state]`` numpy Generator over bit generator ``name``
``["r", id, state]``       numpy RandomState
``["n", id, name, pairs]`` registered NamedTuple or dataclass ``name``, [[field, value], ...]
``["o", id, name, state]`` registered stateful object, rebuilt by its checked constructor
``["@", id]``              the object defined earlier under ``id`` (shared references)
``["p", i]``               the ``i``-th object of the pickle section
=========================  ======================================================

What an auditor of ``safe=True`` needs to hold, and all that it needs:

1. Nothing read is trusted, and nothing in the file chooses code: every node is checked (tag,
   field count and types, dtype against an allow-list, shape against its buffer's size);
   registered types are looked up by name in the registry, never imported, and rebuilt
   without running a constructor the file picks (``tuple.__new__`` for NamedTuples, field
   by field for dataclasses), then checked (``__checkpoint_check__``); stateful objects and
   numpy RNGs come back through their own checked constructors only.
2. Memory follows the file: each buffer is used by one node only (``segments_to_read`` and
   ``_buffer``), so what a load restores is no larger than its decompressed segments.
3. Work follows the file: the tree is a DAG. A reference may only point at an object
   already finished (a cycle, or a reference forward, is damage), and counts as a copy of
   what it refers to: the nodes so counted stay within ``reference_budget`` of the
   structure's size, and their nesting within ``MAX_DEPTH``, so no hash, comparison or
   repr of the result takes more than the file warrants. Keys of dicts and sets may not
   share hashes in bulk. Jax arrays, each of which takes a fixed time to create, stay within
   ``jax_array_budget`` of the file's size; weak ones are rebuilt without compiling.
4. States (of stateful objects and RNGs) are read whole: no reference leads into or out of
   them, so no two restored objects share one.

A failed check raises ValueError (the caller reports a damaged file); an intact file that
this process cannot read (a type not registered, 64-bit jax arrays while x64 is off) raises
:class:`CheckpointNotReadableError`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._numpy_random import bit_generator_from_state, random_state_from_state
from coax_utils.utils._checkpoint.encoder import DEFINING
from coax_utils.utils._checkpoint.errors import CheckpointNotReadableError
from coax_utils.utils._checkpoint.registry import (
    FIRST_BUFFER_SEGMENT,
    MAX_DEPTH,
    Scoped,
    check_of,
    class_named,
    dtype_from_descriptor,
    is_namedtuple,
    is_stateful,
    jax_array_budget,
    reference_budget,
)

__all__ = ["Decoder", "jax_array", "segments_to_read"]

_KEY_SHAPES = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}
_CONTAINERS = {"l": list, "S": set, "F": frozenset, "t": tuple}
_MAX_SHARED_HASH = 64


def segments_to_read(structure: Any, segment_sizes: list[int]) -> list[int]:
    """Check the buffer table of a structure; return the segments its buffers use.

    Small buffers lie one after the other in the shared segment, in the order of the table;
    every other buffer is a whole segment of its own, used by no other buffer (so a
    restored array owns its memory).
    """
    buffers = structure.get("buffers") if type(structure) is dict else None
    if type(buffers) is not list:
        raise ValueError("the structure has no buffer table")
    big: set[int] = set()
    packed = 0  # where the next small buffer starts
    for ref in buffers:
        if type(ref) is not list or len(ref) != 3 or any(type(v) is not int for v in ref):
            raise ValueError(f"buffer entry {ref!r} is malformed")
        seg, off, n = ref
        if not FIRST_BUFFER_SEGMENT <= seg < len(segment_sizes) or off < 0 or n < 0:
            raise ValueError(f"buffer entry {ref!r} points outside the segments")
        if seg == FIRST_BUFFER_SEGMENT:
            if off != packed:
                raise ValueError(f"buffer entry {ref!r} does not follow the one before it")
            packed += n
            if packed > segment_sizes[seg]:
                raise ValueError(f"buffer entry {ref!r} runs past the shared segment")
        elif off != 0 or n != segment_sizes[seg] or seg in big:
            raise ValueError(f"buffer entry {ref!r} is not a whole segment of its own")
        else:
            big.add(seg)
    return [FIRST_BUFFER_SEGMENT, *sorted(big)]


def _check_hashes(keys: list) -> None:
    """Refuse keys of a dict or set many of which share a hash: inserting n of them takes
    n**2 steps (ints that differ by multiples of 2**61 - 1 all hash alike, for one)."""
    if len(keys) > _MAX_SHARED_HASH:
        counts = collections.Counter(map(hash, keys))
        if max(counts.values()) > _MAX_SHARED_HASH:
            raise ValueError(f"more than {_MAX_SHARED_HASH} keys of a dict or set share a hash")


@functools.cache
def _weak_rebuild() -> tuple[Any, dict]:
    rebuild, (_, _, _, flags) = jax.device_put(0.0).__reduce__()  # a weak scalar's
    return rebuild, flags


def jax_array(arr: np.ndarray, weak: bool) -> jax.Array:
    """A jax array on the default device holding ``arr``, weakly typed if ``weak``.

    The weak type is set the way unpickling a jax array sets it: ``__reduce__`` of a weak
    array gives the function pickle calls and the type flags it passes; called with the
    reduction of ``arr``, it puts the data on the device as it is. Nothing is compiled,
    whatever the shape (eager ops would compile once per shape). Only the dtypes of Python
    scalars here (float32, int32, complex64 with x64 off) are weak; others stay strong.
    """
    if weak and arr.dtype.kind in "fic":
        python_type = {"f": np.float64, "i": np.int64, "c": np.complex128}[arr.dtype.kind]
        if jax.dtypes.canonicalize_dtype(python_type) == arr.dtype:
            rebuild, flags = _weak_rebuild()
            return rebuild(*arr.__reduce__(), flags)
    return jax.device_put(arr)


class Decoder(Scoped):
    """Rebuild an object from a structure checked node by node.

    Parameters
    ----------
    structure : dict
        The parsed JSON structure.
    structure_bytes : int
        Its size in the file, which bounds what its references may stand for.
    segments : dict
        The decoded byte segments (``uint8`` arrays) the buffers refer to.
    pickled : list or None
        The objects of the pickle section (None: refuse ``"p"`` nodes).
    file_bytes : int
        The size of the whole file, which bounds how many jax arrays it may hold.
    """

    def __init__(
        self,
        structure: Any,
        structure_bytes: int,
        segments: dict,
        pickled: list | None,
        file_bytes: int,
    ) -> None:
        keys = {"root", "buffers", "pickled"}
        if type(structure) is not dict or not keys <= set(structure) <= {*keys, "pickle_buffers"}:
            raise ValueError("the structure is not a checkpoint tree")
        self.structure = structure
        self.segments = segments
        self.pickled = pickled
        self.buffers = structure["buffers"]
        self.used: set[int] = set()  # buffers taken: each by one node only
        self.memo: dict[int, tuple[Any, int, int]] = {}  # id -> (object, nodes, height)
        self.ids: set[int] = set()  # ids defined so far (inside states too)
        self.budget = reference_budget(structure_bytes)
        self.spent = 0  # nodes, each reference counted as the nodes of what it refers to
        self.reach = 0  # the deepest level reached, references counted as copies
        self.file_bytes = file_bytes
        self.jax_arrays = 0

    def decode(self) -> Any:
        return self.node(self.structure["root"], 0)

    def _spend(self, nodes: int) -> None:
        self.spent += nodes
        if self.spent > self.budget:
            raise ValueError(
                f"the data, counting each reference as a copy, has more than {self.budget} "
                "nodes, more than a file of this size holds"
            )

    def pickle_buffers(self) -> list[np.ndarray]:
        """The out-of-band buffers of the pickle section, in order (each used once)."""
        refs = self.structure.get("pickle_buffers", [])
        if type(refs) is not list:
            raise ValueError("the pickle buffers are not a list of buffer numbers")
        return [self._buffer(b) for b in refs]

    def _buffer(self, b: Any, nbytes: int | None = None) -> np.ndarray:
        if type(b) is not int or not 0 <= b < len(self.buffers):
            raise ValueError(f"buffer {b!r} does not exist")
        seg, off, n = self.buffers[b]
        if nbytes is not None and n != nbytes:
            raise ValueError(f"buffer {b} holds {n} bytes, its node needs {nbytes}")
        if b in self.used:
            raise ValueError(f"buffer {b} is used twice")
        self.used.add(b)
        if seg == FIRST_BUFFER_SEGMENT:
            return self.segments[seg][off : off + n].copy()
        return self.segments.pop(seg)  # its array becomes the only owner of the segment

    def _ndarray(self, desc: Any, shape: Any, order: Any, b: Any) -> np.ndarray:
        dt = dtype_from_descriptor(desc)
        if type(shape) is not list or len(shape) > 64:
            raise ValueError(f"shape {shape!r} is not a list of at most 64 sizes")
        if any(type(d) is not int or not 0 <= d < 1 << 62 for d in shape):
            raise ValueError(f"array dimensions {shape!r} are not ints in [0, 2**62)")
        if order not in ("C", "F"):
            raise ValueError(f"array order {order!r} is not 'C' or 'F'")
        count = 1
        for d in shape:
            count *= d
        flat = self._buffer(b, count * dt.itemsize)
        arr = flat.view(dt) if dt.itemsize else np.empty(count, dt)
        return arr.reshape(shape) if order == "C" else arr.reshape(shape[::-1]).T

    def node(self, x: Any, depth: int) -> Any:
        self.spent += 1  # plain values count too: hashing a tuple of n ints takes n steps
        if self.spent > self.budget:
            self._spend(0)
        t = type(x)
        if x is None or t is bool or t is str or t is float or t is int:
            return x
        if t is not list or not x or type(x[0]) is not str:
            raise ValueError(f"malformed node of type {t.__name__}")
        if depth > MAX_DEPTH:
            raise ValueError(f"data nested deeper than {MAX_DEPTH} levels")
        tag, args = x[0], x[1:]
        if tag == "@":
            return self._reference(args, depth)
        spent, outer, self.reach = self.spent, self.reach, depth
        try:
            obj = self._node(tag, args, depth + 1)
        except (TypeError, KeyError, IndexError, OverflowError, AttributeError) as e:
            raise ValueError(
                f"malformed {tag!r} node ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        if tag in DEFINING:
            mid = args[0]
            if type(mid) is not int or mid in self.ids:
                raise ValueError(f"object id {mid!r} is not a new integer id")
            self.ids.add(mid)
            if not self.in_state:  # no reference may reach into a state
                self.memo[mid] = (obj, self.spent - spent + 1, self.reach - depth)
        self.reach = max(outer, self.reach)
        return obj

    def _reference(self, args: list, depth: int) -> Any:
        if self.in_state:
            raise ValueError("a reference inside the state of a stateful object or RNG")
        mid = args[0] if len(args) == 1 else None
        if type(mid) is not int or mid not in self.memo:
            raise ValueError(
                f"reference to {mid!r}, which is not an object defined and finished before it "
                "(a reference forward, or a cycle)"
            )
        obj, nodes, height = self.memo[mid]
        self._spend(nodes)
        if depth + height > MAX_DEPTH:
            raise ValueError(f"data nested deeper than {MAX_DEPTH} levels (through references)")
        self.reach = max(self.reach, depth + height)
        return obj

    def _args(self, tag: str, args: list, n: int) -> list:
        if len(args) != n:
            raise ValueError(f"{tag!r} node has {len(args)} fields, expected {n}")
        return args

    def _pairs(self, pairs: Any, depth: int) -> list:
        if type(pairs) is not list:
            raise ValueError("pairs are not a list")
        out = []
        for pair in pairs:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("a key/value pair is malformed")
            out.append((self.node(pair[0], depth), self.node(pair[1], depth)))
        _check_hashes([k for k, _ in out])
        return out

    def _node(self, tag: str, args: list, depth: int) -> Any:
        if tag == "I":
            (h,) = self._args(tag, args, 1)
            if type(h) is not str or len(h) > 1 << 20:
                raise ValueError("big int is not a hex string")
            return int(h, 16)
        if tag == "c":
            re_, im = self._args(tag, args, 2)
            if type(re_) not in (int, float) or type(im) not in (int, float):
                raise ValueError("complex parts are not numbers")
            return complex(re_, im)
        if tag in ("y", "Y"):
            (b,) = self._args(tag, args, 1)
            data = self._buffer(b)
            return data.tobytes() if tag == "y" else bytearray(data)
        if tag in _CONTAINERS:
            _, items = self._args(tag, args, 2)
            if type(items) is not list:
                raise ValueError(f"{tag!r} items are not a list")
            values = [self.node(v, depth) for v in items]
            if tag in ("S", "F"):
                _check_hashes(values)
            return _CONTAINERS[tag](values)
        if tag in ("d", "O"):
            _, pairs = self._args(tag, args, 2)
            return (dict if tag == "d" else collections.OrderedDict)(self._pairs(pairs, depth))
        if tag == "a":
            return self._ndarray(*self._args(tag, args, 5)[1:])
        if tag == "s":
            desc, h = self._args(tag, args, 2)
            dt = dtype_from_descriptor(desc)
            if type(h) is not str or len(h) != 2 * dt.itemsize:
                raise ValueError("scalar bytes do not match the dtype's size")
            return np.frombuffer(bytes.fromhex(h), dt)[0] if dt.itemsize else dt.type()
        if tag in ("D", "T"):
            (desc,) = self._args(tag, args, 1)
            dt = dtype_from_descriptor(desc)
            return dt if tag == "D" else dt.type
        if tag == "j":
            _, desc, shape, weak, b = self._args(tag, args, 5)
            self.jax_arrays += 1
            if self.jax_arrays > jax_array_budget(self.file_bytes):
                raise ValueError(
                    f"more than {jax_array_budget(self.file_bytes)} jax arrays, more than a "
                    f"file of {self.file_bytes} bytes holds (each takes a fixed time to create)"
                )
            arr = self._ndarray(desc, shape, "C", b)
            if type(weak) is not bool:
                raise ValueError("weak type flag is not a bool")
            if jax.dtypes.canonicalize_dtype(arr.dtype) != arr.dtype:
                raise CheckpointNotReadableError(
                    f"it holds a jax array of dtype {arr.dtype}, which cannot be restored while "
                    "jax_enable_x64 is off (it would change its values); enable it and load again"
                )
            return jax_array(arr, weak)
        if tag == "k":
            _, impl, data = self._args(tag, args, 3)
            if type(impl) is not str or impl not in _KEY_SHAPES:
                raise ValueError(f"PRNG implementation {impl!r} is not one of {list(_KEY_SHAPES)}")
            data = self.node(data, depth)
            key_shape = _KEY_SHAPES[impl]
            if not isinstance(data, jax.Array) or data.dtype != jnp.uint32:
                raise ValueError("PRNG key data is not a uint32 jax array")
            if data.shape[-len(key_shape) :] != key_shape:
                raise ValueError(f"{impl} key data must end with shape {key_shape}")
            return jax.random.wrap_key_data(data, impl=impl)
        if tag == "g":
            _, name, state = self._args(tag, args, 3)
            return np.random.Generator(bit_generator_from_state(name, self._state(state, depth)))
        if tag == "r":
            _, state = self._args(tag, args, 2)
            return random_state_from_state(self._state(state, depth))
        if tag == "n":
            return self._record(*self._args(tag, args, 3)[1:], depth)
        if tag == "o":
            return self._object(*self._args(tag, args, 3)[1:], depth)
        if tag == "p":
            (i,) = self._args(tag, args, 1)
            if self.pickled is None or type(i) is not int or not 0 <= i < len(self.pickled):
                raise ValueError(f"pickled object {i!r} does not exist")
            return self.pickled[i]
        raise ValueError(f"unknown node tag {tag!r}")

    def _registered(self, name: Any) -> type:
        cls = class_named(name)
        if cls is None:
            raise CheckpointNotReadableError(
                f"type {name!r} is not registered (register it with "
                "coax_utils.utils.register_checkpoint_type before loading)"
            )
        return cls

    def _record(self, name: Any, pairs: Any, depth: int) -> Any:
        cls = self._registered(name)
        values = dict(self._pairs(pairs, depth))
        if is_namedtuple(cls):
            fields = cls._fields
        elif dataclasses.is_dataclass(cls) and not is_stateful(cls):
            fields = tuple(f.name for f in dataclasses.fields(cls))
        else:
            raise ValueError(f"type {name!r} is not a NamedTuple or dataclass")
        if len(values) != len(pairs):
            raise ValueError(f"{name} is given a field twice")
        if set(values) != set(fields):  # a file of another version of the class
            raise CheckpointNotReadableError(
                f"{name} has fields {list(fields)} here, the file gives "
                f"{str(list(values))[:200]}: it was written with another version of {name}; "
                "load it with that version and save its data again"
            )
        if is_namedtuple(cls):
            obj = tuple.__new__(cls, [values[f] for f in fields])
        else:
            obj = object.__new__(cls)
            for f in fields:
                object.__setattr__(obj, f, values[f])
        check = check_of(cls)
        if check is not None:
            try:
                check(obj)
            except (ValueError, TypeError) as e:
                raise ValueError(f"invalid {name}: {e}") from None
        return obj

    def _object(self, name: Any, state: Any, depth: int) -> Any:
        cls = self._registered(name)
        if not is_stateful(cls):
            raise ValueError(f"type {name!r} is not a stateful checkpoint type")
        state = self._state(state, depth)
        if type(state) is not dict:
            raise ValueError(f"the state of {name} is not a dict")
        try:
            return cls.__checkpoint_restore__(state)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {name} state: {e}") from None
