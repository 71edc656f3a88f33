"""The data tree of a checkpoint: encoding an object into JSON plus byte buffers, and back.

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

Nothing read is trusted: every node is checked (tags, lengths, types, dtype against an
allow-list, shape against the buffer's size, nesting depth), and registered types are rebuilt
without calling any constructor a file can choose (NamedTuples through ``tuple.__new__``,
dataclasses field by field, stateful objects through their own checked
``__checkpoint_restore__``).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from coax_utils._numpy_random import (
    BIT_GENERATORS,
    bit_generator_from_state,
    random_state_from_state,
)
from coax_utils.utils._checkpoint.errors import CheckpointNotReadableError

__all__ = [
    "Decoder",
    "Encoder",
    "jax_array",
    "register_checkpoint_type",
    "segments_to_read",
]

MAX_DEPTH = 100  # nesting deeper than this goes to the pickle section (and is refused on load)
SMALL = 64 << 10  # buffers smaller than this share one segment
FIRST_BUFFER_SEGMENT = 2  # segment 0: structure, 1: pickle section, 2: shared small buffers


# -- dtypes -----------------------------------------------------------------------------------

_NUMPY_CODES = "?bBhHiIlLqQefdgFDG"
_NUMPY_DTYPES = {np.dtype(c).newbyteorder(o).str for c in _NUMPY_CODES for o in "<>"} | {
    np.dtype(c).str for c in _NUMPY_CODES
}
_ML_DTYPES = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16 float8_e3m4 float8_e4m3 float8_e4m3b11fnuz float8_e4m3fn float8_e4m3fnuz "
        "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn float6_e2m3fn float6_e3m2fn "
        "int2 int4 uint2 uint4"
    ).split()
    if hasattr(ml_dtypes, name)
}
_ML_NAMES = {dt: name for name, dt in _ML_DTYPES.items()}
_TEXT_DTYPE = re.compile(r"[<>|][SU][1-9][0-9]{0,8}\Z")  # S0 and U0 hold nothing


def dtype_descriptor(dt: np.dtype) -> str | None:
    """The descriptor a checkpoint stores for ``dt``, or None if it is not plain data."""
    if dt in _ML_NAMES:
        return _ML_NAMES[dt]
    s = dt.str
    if s in _NUMPY_DTYPES or (_TEXT_DTYPE.match(s) and dt.fields is None):
        return s
    return None


def dtype_from_descriptor(desc: Any) -> np.dtype:
    """The dtype of an allowed descriptor; ValueError for anything else."""
    if type(desc) is str:
        if desc in _NUMPY_DTYPES or _TEXT_DTYPE.match(desc):
            return np.dtype(desc)
        if desc in _ML_DTYPES:
            return _ML_DTYPES[desc]
    raise ValueError(f"dtype {desc!r} is not an allowed plain-data dtype")


def _check_int(x: Any, lo: int, hi: int, what: str) -> None:
    if type(x) is not int or not lo <= x < hi:
        raise ValueError(f"{what} must be an int in [{lo}, {hi}), got {x!r}")


# -- the registry of types ---------------------------------------------------------------------

_lock = threading.RLock()
_by_name: dict[str, type] = {}
_name_of: dict[type, str] = {}
_builtins_loaded = False
# Modules whose classes are registered on first use; a file never chooses what is imported.
_PUBLIC_MODULES = (
    "optax",
    "optax.contrib",
    "optax.schedules",
    "optax.transforms",
    "optax.tree_utils",
    "haiku",
    "haiku.data_structures",
    "haiku.mixed_precision",
)
# Checks run on registered NamedTuples and dataclasses once rebuilt (see ``check`` below).
_checks: dict[type, Callable[[Any], None]] = {}


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def _is_stateful(cls: type) -> bool:
    return callable(getattr(cls, "__checkpoint_state__", None)) and callable(
        getattr(cls, "__checkpoint_restore__", None)
    )


def _add(cls: type, name: str) -> None:
    known = _by_name.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"checkpoint type name {name!r} is already registered for {known!r}")
    _by_name[name] = cls
    _name_of.setdefault(cls, name)


def register_checkpoint_type(
    cls: type, name: str | None = None, check: Callable[[Any], None] | None = None
) -> type:
    """Let checkpoints hold instances of ``cls`` as data (readable with ``safe=True``).

    ``cls`` must be a NamedTuple, a dataclass, or a class with the stateful-object protocol:
    a method ``__checkpoint_state__(self) -> dict`` returning plain data, and a classmethod
    ``__checkpoint_restore__(cls, state) -> instance`` that checks every invariant of
    ``state`` and raises ValueError when one does not hold. NamedTuples are rebuilt with
    ``tuple.__new__`` and dataclasses field by field, without running their ``__init__``.
    Register a class before dumping and before loading; the name is what the file stores.
    The classes of optax, haiku and coax_utils are registered already (each subpackage of
    coax_utils registers its own when it is imported).

    Parameters
    ----------
    cls : type
        The class to register.
    name : str, optional
        The name stored in files (default: ``module.qualname``).
    check : callable, optional
        For a NamedTuple or a dataclass: ``check(obj)`` is called on every instance a load
        rebuilds, before anything else sees it, and raises ValueError (or TypeError) for one
        whose fields break an invariant of the type; the load then fails with
        :class:`CheckpointDamagedError`. By default the class's own method
        ``__checkpoint_check__(self)``, where it defines one, is that check. Stateful classes
        check in their ``__checkpoint_restore__`` instead.

    Returns
    -------
    cls : type
        The class itself, so that this function works as a decorator.

    Raises
    ------
    TypeError
        If ``cls`` is none of the three kinds.
    ValueError
        If ``name`` is registered for another class.
    """
    if not isinstance(cls, type) or not (
        _is_namedtuple(cls) or dataclasses.is_dataclass(cls) or _is_stateful(cls)
    ):
        raise TypeError(
            f"{cls!r} is not a NamedTuple, a dataclass or a class with __checkpoint_state__ "
            "and __checkpoint_restore__"
        )
    if name is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
    if type(name) is not str or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if check is not None and (not callable(check) or _is_stateful(cls)):
        raise TypeError("check must be a callable, and is for NamedTuples and dataclasses only")
    _load_builtins()
    with _lock:
        _add(cls, name)
        if check is not None:
            _checks[cls] = check
    return cls


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _lock:
        if _builtins_loaded:
            return
        for name in _PUBLIC_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 (installed but broken: its types stay unknown)
                continue
        public = [sys.modules[m] for m in _PUBLIC_MODULES if m in sys.modules]
        found = []
        for mod_name, module in list(sys.modules.items()):
            if mod_name.split(".")[0] not in ("optax", "haiku"):
                continue
            for obj in list(vars(module).values()):
                if isinstance(obj, type) and _is_namedtuple(obj) and obj.__module__ == mod_name:
                    found.append(obj)
        for cls in sorted(set(found), key=lambda c: (c.__module__, c.__qualname__)):
            for module in public:  # the public name first, so files survive refactorings
                if vars(module).get(cls.__qualname__) is cls:
                    _add(cls, f"{module.__name__}.{cls.__qualname__}")
            _add(cls, f"{cls.__module__}.{cls.__qualname__}")
        _builtins_loaded = True


# -- encoding ----------------------------------------------------------------------------------


class _Scoped:
    """The states of stateful objects and numpy RNGs are written and read whole: no
    reference ("@") leads into or out of them, so no two restored objects share one."""

    in_state = 0  # how many states the node being encoded or decoded lies in
    node: Callable[[Any, int], Any]  # the subclass's encoding or decoding of one node

    def _state(self, state: Any, depth: int) -> Any:
        self.in_state += 1
        try:
            return self.node(state, depth)
        finally:
            self.in_state -= 1


class Encoder(_Scoped):
    """Turn an object into (structure, buffers, objects to pickle)."""

    def __init__(self) -> None:
        _load_builtins()
        self.segments: list[list[memoryview]] = [[], [], []]
        self.pack_size = 0
        self.buffers: list[list[int]] = []
        self.pickled: list[Any] = []
        self.descriptions: list[str] = []
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # memoized objects stay alive, so their ids stay unique
        self.active: set[int] = set()
        self.path: list[str] = []

    def encode(self, obj: Any) -> dict:
        root = self.node(obj, 0)
        return {"root": root, "buffers": self.buffers, "pickled": self.descriptions}

    def add_buffer(self, raw: memoryview) -> int:
        """Store the bytes ``raw`` (kept, not copied) as a buffer; return its number."""
        n = raw.nbytes
        if n < SMALL:
            ref = [FIRST_BUFFER_SEGMENT, self.pack_size, n]
            self.segments[FIRST_BUFFER_SEGMENT].append(raw)
            self.pack_size += n
        else:
            self.segments.append([raw])
            ref = [len(self.segments) - 1, 0, n]
        self.buffers.append(ref)
        return len(self.buffers) - 1

    def _define(self, obj: Any) -> int:
        mid = len(self.keep)
        if not self.in_state:  # a state is written whole: no references into or out of it
            self.memo[id(obj)] = mid
        self.keep.append(obj)
        return mid

    def _pickle(self, obj: Any) -> list:
        i = len(self.pickled)
        self.pickled.append(obj)
        t = type(obj)
        where = "".join(self.path) or "(top level)"
        self.descriptions.append(f"{t.__module__}.{t.__qualname__} at {where}")
        self.memo[id(obj)] = -1 - i
        self.keep.append(obj)
        return ["p", i]

    def _array(self, arr: np.ndarray) -> tuple[str, list[int], str, int] | None:
        desc = dtype_descriptor(arr.dtype)
        if desc is None:
            return None
        if arr.flags.c_contiguous:
            data, order = arr, "C"
        elif arr.flags.f_contiguous:
            data, order = arr.T, "F"
        else:
            data, order = np.ascontiguousarray(arr), "C"
        raw = memoryview(data.reshape(-1).view(np.uint8)) if arr.nbytes else memoryview(b"")
        return desc, list(arr.shape), order, self.add_buffer(raw)

    def node(self, x: Any, depth: int) -> Any:
        t = type(x)
        if x is None or t is bool or t is str or t is float:
            return x
        if t is int:
            return x if -(1 << 63) <= x < (1 << 64) else ["I", hex(x)]
        if t is complex:
            return ["c", x.real, x.imag]
        key = id(x)
        mid = self.memo.get(key)
        if mid is not None and mid < 0:
            return ["p", -1 - mid]
        if mid is not None and not self.in_state:
            return ["@", mid]
        if key in self.active or depth >= MAX_DEPTH:
            return self._pickle(x)  # a cycle through an immutable object, or too deep
        self.active.add(key)
        try:
            out = self._node(x, t, depth + 1)
        finally:
            self.active.discard(key)
        return self._pickle(x) if out is None else out

    def _items(self, items: Any, depth: int) -> list:
        return [self.node(v, depth) for v in items]

    def _pairs(self, pairs: Any, depth: int) -> list:
        out = []
        for k, v in pairs:
            self.path.append(f"[{k!r}]")
            try:
                out.append([self.node(k, depth), self.node(v, depth)])
            finally:
                self.path.pop()
        return out

    def _node(self, x: Any, t: type, depth: int) -> Any:
        if t is bytes or t is bytearray:
            return ["y" if t is bytes else "Y", self.add_buffer(memoryview(x).cast("B"))]
        if t is list or t is set or t is frozenset or t is tuple:
            tag = {list: "l", set: "S", frozenset: "F", tuple: "t"}[t]
            if t is tuple:  # defined once built: a tuple cannot contain itself directly
                items = self._items(x, depth)
                return [tag, self._define(x), items]
            mid = self._define(x)
            return [tag, mid, self._items(x, depth)]
        if t is dict or t is collections.OrderedDict:
            mid = self._define(x)
            return ["d" if t is dict else "O", mid, self._pairs(x.items(), depth)]
        if t is np.ndarray:
            parts = self._array(x)
            return None if parts is None else ["a", self._define(x), *parts]
        if isinstance(x, np.generic) and t.__module__ in ("numpy", "ml_dtypes"):
            desc = dtype_descriptor(x.dtype)
            if desc is None:
                return None
            return ["s", desc, np.asarray(x).tobytes().hex()]
        if isinstance(x, np.dtype):
            desc = dtype_descriptor(x)
            return None if desc is None else ["D", desc]
        if t is type and issubclass(x, np.generic) and x.__module__ in ("numpy", "ml_dtypes"):
            desc = dtype_descriptor(np.dtype(x))
            return None if desc is None or np.dtype(x).type is not x else ["T", desc]
        if isinstance(x, jax.Array):
            return self._jax(x, depth)
        if t is np.random.Generator:
            bg = x.bit_generator
            name = type(bg).__name__
            if BIT_GENERATORS.get(name, (None,))[0] is not type(bg):
                return None
            return ["g", self._define(x), name, self._state(bg.state, depth)]
        if t is np.random.RandomState:
            return ["r", self._define(x), self._state(x.get_state(legacy=False), depth)]
        name = _name_of.get(t)
        if name is None:
            return None
        if _is_namedtuple(t):
            pairs = self._pairs(zip(t._fields, x), depth)
            return ["n", self._define(x), name, pairs]
        if dataclasses.is_dataclass(t) and not _is_stateful(t):
            fields = [(f.name, getattr(x, f.name)) for f in dataclasses.fields(t)]
            pairs = self._pairs(fields, depth)
            return ["n", self._define(x), name, pairs]
        state = x.__checkpoint_state__()
        if type(state) is not dict:
            raise TypeError(f"{t.__qualname__}.__checkpoint_state__ must return a dict")
        return ["o", self._define(x), name, self._state(state, depth)]

    def _jax(self, x: jax.Array, depth: int) -> Any:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            data = self.node(jax.random.key_data(x), depth)
            return ["k", self._define(x), impl, data]
        arr = np.asarray(x)
        parts = self._array(arr)
        if parts is None:
            return None
        desc, shape, _, b = parts
        return ["j", self._define(x), desc, shape, bool(x.weak_type), b]


# -- decoding ----------------------------------------------------------------------------------


def segments_to_read(structure: Any, segment_sizes: list[int]) -> list[int]:
    """Check the buffer table of a structure; return the segments its buffers use.

    Small buffers lie one after the other in the shared segment, in the order of the table;
    every other buffer is a whole segment of its own, used by no other buffer (so a
    restored array owns its memory). With each buffer used by one node only (checked by
    :class:`Decoder`), what a file restores is no larger than its decompressed segments.
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


_KEY_SHAPES = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}
_DEFINING = frozenset("ltSFdOajkgrno")  # tags whose second field is the object's id
_MAX_SHARED_HASH = 64


def _check_hashes(keys: list) -> None:
    """Refuse keys of a dict or set many of which share a hash: inserting n of them takes
    n**2 steps (ints that differ by multiples of 2**61 - 1 all hash alike, for one)."""
    if len(keys) > _MAX_SHARED_HASH:
        counts = collections.Counter(map(hash, keys))
        if max(counts.values()) > _MAX_SHARED_HASH:
            raise ValueError(f"more than {_MAX_SHARED_HASH} keys of a dict or set share a hash")


_CONTAINER_TAGS = {"l": list, "S": set, "F": frozenset, "t": tuple}


def jax_array(arr: np.ndarray, weak: bool) -> jax.Array:
    """A jax array on the default device holding ``arr``, weakly typed if ``weak``.

    The weak type is set the way unpickling a jax array sets it: ``__reduce__`` of a weak
    array of the same dtype (a Python scalar put on the device) gives the function pickle
    calls and the type flags it passes; called with the reduction of ``arr``, it puts the
    data on the device as it is. Nothing is compiled, whatever the shape (eager ops would
    compile once per shape). Dtypes that have no weak form stay strong.
    """
    scalar = {"f": 0.0, "i": 0, "c": 0j}.get(arr.dtype.kind) if weak else None
    if scalar is not None:
        template = jax.device_put(scalar)  # weak, in the dtype of Python scalars here
        if template.dtype == arr.dtype:
            rebuild, (_, _, _, flags) = template.__reduce__()
            return rebuild(*arr.__reduce__(), flags)
    return jax.device_put(arr)


class Decoder(_Scoped):
    """Rebuild an object from a structure checked node by node.

    Parameters
    ----------
    segments : dict
        The decoded byte segments (``uint8`` arrays) the buffers refer to.
    pickled : list or None
        The objects of the pickle section (None: refuse ``"p"`` nodes).
    """

    def __init__(self, structure: Any, segments: dict, pickled: list | None, budget: int) -> None:
        _load_builtins()
        keys = {"root", "buffers", "pickled"}
        if type(structure) is not dict or not keys <= set(structure) <= {*keys, "pickle_buffers"}:
            raise ValueError("the structure is not a checkpoint tree")
        self.structure = structure
        self.segments = segments
        self.pickled = pickled
        self.memo: dict[int, Any] = {}
        self.buffers = structure["buffers"]
        self.used: set[int] = set()  # buffers taken: each by one node only
        # References ("@") are checked as if each copied what it refers to: the nodes so
        # counted stay within ``budget`` and their nesting within MAX_DEPTH, so that no
        # hash, repr or comparison of the result can take more than the file warrants.
        self.budget = budget
        self.spent = 0
        self.extent: dict[int, tuple[int, int]] = {}  # object id -> (nodes, height)
        self.reach = 0  # the deepest level reached in the node being decoded
        # objects referred to before they were finished (cycles, or tricks that look like
        # them): by the node being decoded, and by each finished object (id -> ids)
        self.open: set[int] | None = None
        self.unfinished: dict[int, set[int]] = {}

    def decode(self) -> Any:
        return self.node(self.structure["root"], 0)

    def _define(self, mid: Any, obj: Any) -> Any:
        if type(mid) is not int or mid in self.memo:
            raise ValueError(f"object id {mid!r} is not a new integer id")
        if not self.in_state:  # no reference may reach into a state
            self.memo[mid] = obj
        return obj

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

    def _shape(self, shape: Any) -> tuple[int, ...]:
        if type(shape) is not list or len(shape) > 64:
            raise ValueError(f"shape {shape!r} is not a list of at most 64 sizes")
        for d in shape:
            _check_int(d, 0, 1 << 62, "array dimension")
        return tuple(shape)

    def _ndarray(self, desc: Any, shape: Any, order: Any, b: Any) -> np.ndarray:
        dt = dtype_from_descriptor(desc)
        shape = self._shape(shape)
        if order not in ("C", "F"):
            raise ValueError(f"array order {order!r} is not 'C' or 'F'")
        count = 1
        for d in shape:
            count *= d
        flat = self._buffer(b, count * dt.itemsize)
        arr = flat.view(dt) if dt.itemsize else np.empty(count, dt)
        return arr.reshape(shape) if order == "C" else arr.reshape(shape[::-1]).T

    def _jax(self, desc: Any, shape: Any, weak: Any, b: Any) -> jax.Array:
        arr = self._ndarray(desc, shape, "C", b)
        if type(weak) is not bool:
            raise ValueError("weak type flag is not a bool")
        if jax.dtypes.canonicalize_dtype(arr.dtype) != arr.dtype:
            raise CheckpointNotReadableError(
                f"a jax array of dtype {arr.dtype} cannot be restored while jax_enable_x64 is "
                "off (it would change its values); enable it to load this checkpoint"
            )
        return jax_array(arr, weak)

    def node(self, x: Any, depth: int) -> Any:
        t = type(x)
        if x is None or t is bool or t is str or t is float or t is int:
            self.spent += 1  # plain values count too: hashing a tuple of n ints takes n steps
            if self.spent > self.budget:
                self._spend(0)
            return x
        if t is not list or not x or type(x[0]) is not str:
            raise ValueError(f"malformed node of type {t.__name__}")
        if depth >= MAX_DEPTH + 2:
            raise ValueError(f"data nested deeper than {MAX_DEPTH} levels")
        self._spend(1)
        start, outer, outer_open = self.spent, self.reach, self.open
        self.reach, self.open = depth, None
        try:
            obj = self._node(x[0], x[1:], depth + 1)
        except (TypeError, KeyError, IndexError, OverflowError, AttributeError) as e:
            raise ValueError(
                f"malformed {x[0]!r} node ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        mid = x[1] if len(x) > 1 and x[0] in _DEFINING else None
        still_open = None
        if self.open:  # unfinished objects this node refers to, and that stay unfinished
            still_open = {m for m in self.open if m != mid and m not in self.extent}
        if type(mid) is int and mid in self.memo and mid not in self.extent:
            self.extent[mid] = (1 + self.spent - start, self.reach - depth)
            if still_open:
                self.unfinished[mid] = still_open
        self.reach = max(outer, self.reach)
        self.open = outer_open
        if still_open:
            self.open = (self.open or set()) | still_open
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
        return out

    def _node(self, tag: str, args: list, depth: int) -> Any:
        if tag == "@":
            (mid,) = self._args(tag, args, 1)
            if self.in_state:
                raise ValueError("a reference inside the state of a stateful object or RNG")
            if type(mid) is not int or mid not in self.memo:
                raise ValueError(f"reference to undefined object {mid!r}")
            nodes, height = self.extent.get(mid, (1, 0))
            # what it reaches through objects unfinished when it was built (or now): their
            # size when referred to, for they have grown since
            reached = self.unfinished.get(mid, set()) | ({mid} if mid not in self.extent else set())
            if reached:
                self.open = (self.open or set()) | reached
                for m in reached:
                    more = self.extent.get(m, (1, 0))
                    nodes, height = nodes + more[0], height + more[1]
            self._spend(nodes)
            self.reach = max(self.reach, depth + height)
            if self.reach >= MAX_DEPTH + 2:
                raise ValueError(f"data nested deeper than {MAX_DEPTH} levels (through references)")
            return self.memo[mid]
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
            n = self.buffers[b][2] if type(b) is int and 0 <= b < len(self.buffers) else -1
            data = self._buffer(b, n)
            return data.tobytes() if tag == "y" else bytearray(data)
        if tag in _CONTAINER_TAGS:
            mid, items = self._args(tag, args, 2)
            if type(items) is not list:
                raise ValueError(f"{tag!r} items are not a list")
            if tag == "l":
                out = self._define(mid, [])
                out.extend(self.node(v, depth) for v in items)
                return out
            values = [self.node(v, depth) for v in items]
            if tag in ("S", "F"):
                _check_hashes(values)
            return self._define(mid, _CONTAINER_TAGS[tag](values))
        if tag in ("d", "O"):
            mid, pairs = self._args(tag, args, 2)
            d = self._define(mid, {} if tag == "d" else collections.OrderedDict())
            pairs = self._pairs(pairs, depth)
            _check_hashes([k for k, _ in pairs])
            for k, v in pairs:
                d[k] = v
            return d
        if tag == "a":
            mid, desc, shape, order, b = self._args(tag, args, 5)
            return self._define(mid, self._ndarray(desc, shape, order, b))
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
            mid, desc, shape, weak, b = self._args(tag, args, 5)
            return self._define(mid, self._jax(desc, shape, weak, b))
        if tag == "k":
            mid, impl, data = self._args(tag, args, 3)
            if type(impl) is not str or impl not in _KEY_SHAPES:
                raise ValueError(f"PRNG implementation {impl!r} is not one of {list(_KEY_SHAPES)}")
            data = self.node(data, depth)
            key_shape = _KEY_SHAPES[impl]
            if not isinstance(data, jax.Array) or data.dtype != jnp.uint32:
                raise ValueError("PRNG key data is not a uint32 jax array")
            if data.shape[-len(key_shape) :] != key_shape:
                raise ValueError(f"{impl} key data must end with shape {key_shape}")
            return self._define(mid, jax.random.wrap_key_data(data, impl=impl))
        if tag == "g":
            mid, name, state = self._args(tag, args, 3)
            bg = bit_generator_from_state(name, self._state(state, depth))
            return self._define(mid, np.random.Generator(bg))
        if tag == "r":
            mid, state = self._args(tag, args, 2)
            return self._define(mid, random_state_from_state(self._state(state, depth)))
        if tag == "n":
            return self._record(*self._args(tag, args, 3), depth)
        if tag == "o":
            return self._object(*self._args(tag, args, 3), depth)
        if tag == "p":
            (i,) = self._args(tag, args, 1)
            if self.pickled is None or type(i) is not int or not 0 <= i < len(self.pickled):
                raise ValueError(f"pickled object {i!r} does not exist")
            return self.pickled[i]
        raise ValueError(f"unknown node tag {tag!r}")

    def _registered(self, name: Any) -> type:
        cls = _by_name.get(name) if type(name) is str else None
        if cls is None:
            raise CheckpointNotReadableError(
                f"type {name!r} is not registered (register it with "
                "coax_utils.utils.register_checkpoint_type before loading)"
            )
        return cls

    def _record(self, mid: Any, name: Any, pairs: Any, depth: int) -> Any:
        cls = self._registered(name)
        pairs = self._pairs(pairs, depth)
        _check_hashes([k for k, _ in pairs])
        values = dict(pairs)
        if _is_namedtuple(cls):
            fields = cls._fields
        elif dataclasses.is_dataclass(cls) and not _is_stateful(cls):
            fields = tuple(f.name for f in dataclasses.fields(cls))
        else:
            raise ValueError(f"type {name!r} is not a NamedTuple or dataclass")
        if set(values) != set(fields) or len(values) != len(pairs):
            raise ValueError(
                f"{name} has fields {list(fields)}, the file gives {str(list(values))[:200]}"
            )
        if _is_namedtuple(cls):
            obj = tuple.__new__(cls, [values[f] for f in fields])
        else:
            obj = object.__new__(cls)
            for f in fields:
                object.__setattr__(obj, f, values[f])
        check = _checks.get(cls) or getattr(cls, "__checkpoint_check__", None)
        if check is not None:
            try:
                check(obj)
            except (ValueError, TypeError) as e:
                raise ValueError(f"invalid {name}: {e}") from None
        return self._define(mid, obj)

    def _object(self, mid: Any, name: Any, state: Any, depth: int) -> Any:
        cls = self._registered(name)
        if not _is_stateful(cls):
            raise ValueError(f"type {name!r} is not a stateful checkpoint type")
        state = self._state(state, depth)
        if type(state) is not dict:
            raise ValueError(f"the state of {name} is not a dict")
        try:
            obj = cls.__checkpoint_restore__(state)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {name} state: {e}") from None
        return self._define(mid, obj)
