"""Encoding an object into the data tree of a checkpoint: JSON plus byte buffers, and a list
of objects for the pickle section. See :mod:`.decoder` for the nodes.

What the tree holds is a DAG whose reader's limits hold: an object met again once encoded is
a reference (``["@", id]``); an object met again while it is still being encoded (a cycle),
nesting deeper than ``MAX_DEPTH``, or a reference that would take the nodes the references
stand for past the reader's budget cannot be data, and then the whole object goes to the
pickle section (which keeps every identity; ``safe=True`` refuses it and says why). Objects
that are not plain data (functions, foreign classes) go to the pickle section one by one.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
from typing import Any

import cloudpickle
import jax
import numpy as np

from coax_utils._numpy_random import BIT_GENERATORS
from coax_utils.utils._checkpoint.registry import (
    FIRST_BUFFER_SEGMENT,
    MAX_DEPTH,
    Scoped,
    dtype_descriptor,
    is_namedtuple,
    is_stateful,
    load_builtins,
    name_of,
    reference_budget,
)

__all__ = ["DEFINING", "Encoder", "SMALL"]

SMALL = 64 << 10  # buffers smaller than this share one segment
DEFINING = frozenset("ltSFdOajkgrno")  # tags of nodes whose second field is the object's id
_CONTAINER_TAGS = {list: "l", set: "S", frozenset: "F", tuple: "t"}


class _NotData(Exception):
    """The object cannot be held as data (the message says why)."""


class Encoder(Scoped):
    """Turn an object into (structure, buffers, objects to pickle); jax arrays past the first
    ``max_jax_arrays`` go to the pickle section."""

    def __init__(self, max_jax_arrays: int | None = None) -> None:
        load_builtins()
        self.max_jax_arrays = max_jax_arrays
        self.jax_arrays = 0
        self.segments: list[list[memoryview]] = [[], [], []]
        self.pack_size = 0
        self.buffers: list[list[int]] = []
        self.pickled: list[Any] = []
        self.descriptions: list[str] = []
        self.memo: dict[int, Any] = {}  # id -> ["p", i], or (id in the file, nodes, height)
        self.keep: list[Any] = []  # memoized objects stay alive, so their ids stay unique
        self.active: set[int] = set()  # objects being encoded
        self.path: list[str] = []
        # as the reader counts them: nodes written, nodes they stand for (references counted
        # as copies), and the deepest level reached, references included
        self.written = self.spent = self.reach = 0

    def encode(self, obj: Any) -> dict:
        try:
            root = self.node(obj, 0)
        except _NotData as e:
            self.__init__(self.max_jax_arrays)  # start over: the whole object is pickled
            root = self._pickle(obj, f" as a whole, for {e}")
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

    def pickle_section(self) -> tuple[bytes, list[int]]:
        """The pickle section of the objects to pickle, and the buffers it refers to.

        Large contiguous buffers (the memory of numpy arrays held by the pickled objects) go
        out of band (pickle protocol 5): each becomes a buffer of the data tree, compressed
        in chunks like the arrays of the tree, so neither the dump nor the load copies it.
        """
        out_of_band: list[int] = []

        def in_band(buffer: pickle.PickleBuffer) -> bool:
            try:
                raw = buffer.raw()
            except BufferError:  # not contiguous: the pickle holds a copy
                return True
            if raw.nbytes < SMALL:
                return True
            out_of_band.append(self.add_buffer(raw))
            return False

        stream = cloudpickle.dumps(self.pickled, protocol=5, buffer_callback=in_band)
        return stream, out_of_band

    def _where(self) -> str:
        return "".join(self.path) or "(top level)"

    def _define(self, obj: Any) -> int:
        self.keep.append(obj)
        return len(self.keep) - 1

    def _pickle(self, obj: Any, why: str = "") -> list:
        t = type(obj)
        self.descriptions.append(f"{t.__module__}.{t.__qualname__} at {self._where()}{why}")
        self.pickled.append(obj)
        self.keep.append(obj)
        node = self.memo[id(obj)] = ["p", len(self.pickled) - 1]
        return node

    def node(self, x: Any, depth: int) -> Any:
        self.written += 1
        self.spent += 1
        t = type(x)
        if x is None or t is bool or t is str or t is float:
            return x
        if t is int:
            return x if -(1 << 63) <= x < (1 << 64) else ["I", hex(x)]
        if t is complex:
            return ["c", x.real, x.imag]
        if depth > MAX_DEPTH:
            raise _NotData(f"nesting deeper than {MAX_DEPTH} levels at {self._where()}")
        key = id(x)
        known = self.memo.get(key)
        if type(known) is list:  # pickled
            self.reach = max(self.reach, depth)
            return known
        if known is not None and not self.in_state:  # a state is written whole
            return self._reference(*known, depth)
        if key in self.active:
            raise _NotData(f"a cycle through the {t.__qualname__} at {self._where()}")
        written, spent, outer, self.reach = self.written, self.spent, self.reach, depth
        self.active.add(key)
        try:
            out = self._node(x, t, depth + 1)
        finally:
            self.active.discard(key)
        if out is None or type(out) is str:  # not plain data (str: why)
            self.written, self.spent, self.reach = written, spent, outer
            return self._pickle(x, out or "")
        if out[0] in DEFINING and not self.in_state:
            self.memo[key] = (out[1], self.spent - spent + 1, self.reach - depth)
        self.reach = max(outer, self.reach)
        return out

    def _reference(self, mid: int, nodes: int, height: int, depth: int) -> list:
        if depth + height > MAX_DEPTH:
            raise _NotData(f"nesting deeper than {MAX_DEPTH} levels at {self._where()}")
        if self.spent + nodes > reference_budget(self.written):
            raise _NotData(
                f"references that a reader would count as more than {self.spent + nodes} "
                f"nodes, past its budget, at {self._where()}"
            )
        self.spent += nodes
        self.reach = max(self.reach, depth + height)
        return ["@", mid]

    def _pairs(self, pairs: Any, depth: int) -> list:
        out = []
        for k, v in pairs:
            self.path.append(f"[{k!r}]")
            try:
                out.append([self.node(k, depth), self.node(v, depth)])
            finally:
                self.path.pop()
        return out

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

    def _node(self, x: Any, t: type, depth: int) -> Any:
        if t is bytes or t is bytearray:
            return ["y" if t is bytes else "Y", self.add_buffer(memoryview(x).cast("B"))]
        if t in _CONTAINER_TAGS:
            items = [self.node(v, depth) for v in x]
            return [_CONTAINER_TAGS[t], self._define(x), items]
        if t is dict or t is collections.OrderedDict:
            pairs = self._pairs(x.items(), depth)
            return ["d" if t is dict else "O", self._define(x), pairs]
        if t is np.ndarray:
            parts = self._array(x)
            return None if parts is None else ["a", self._define(x), *parts]
        if isinstance(x, np.generic) and t.__module__ in ("numpy", "ml_dtypes"):
            desc = dtype_descriptor(x.dtype)
            return None if desc is None else ["s", desc, np.asarray(x).tobytes().hex()]
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
        name = name_of(t)
        if name is None:
            return None
        if is_namedtuple(t):
            return ["n", self._define(x), name, self._pairs(zip(t._fields, x), depth)]
        if dataclasses.is_dataclass(t) and not is_stateful(t):
            fields = [(f.name, getattr(x, f.name)) for f in dataclasses.fields(t)]
            return ["n", self._define(x), name, self._pairs(fields, depth)]
        state = x.__checkpoint_state__()
        if type(state) is not dict:
            raise TypeError(f"{t.__qualname__}.__checkpoint_state__ must return a dict")
        return ["o", self._define(x), name, self._state(state, depth)]

    def _jax(self, x: jax.Array, depth: int) -> Any:
        if self.max_jax_arrays is not None and self.jax_arrays >= self.max_jax_arrays:
            return f", past the {self.max_jax_arrays} jax arrays a file of this size may hold"
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = self.node(jax.random.key_data(x), depth)
            return ["k", self._define(x), str(jax.random.key_impl(x)), data]
        parts = self._array(np.asarray(x))
        if parts is None:
            return None
        desc, shape, _, b = parts
        self.jax_arrays += 1
        return ["j", self._define(x), desc, shape, bool(x.weak_type), b]
