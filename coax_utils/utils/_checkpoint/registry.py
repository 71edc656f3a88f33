"""What the data tree of a checkpoint may hold: the plain-data dtypes, the registry of
NamedTuples, dataclasses and stateful classes, and the limits a reader enforces (which the
writer applies too, so that what ``dump`` writes, ``load`` reads)."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "FIRST_BUFFER_SEGMENT",
    "MAX_DEPTH",
    "Scoped",
    "check_of",
    "class_named",
    "dtype_descriptor",
    "dtype_from_descriptor",
    "is_namedtuple",
    "is_stateful",
    "jax_array_budget",
    "load_builtins",
    "name_of",
    "reference_budget",
    "register_checkpoint_type",
]

# Nodes (list nodes: containers, arrays, records) nest at most this deep, references
# counted as the copies they stand for; deeper data goes to the pickle section on dump.
MAX_DEPTH = 100
FIRST_BUFFER_SEGMENT = 2  # segment 0: structure, 1: pickle section, 2: shared small buffers


def reference_budget(structure_bytes: int) -> int:
    """How many nodes a structure of ``structure_bytes`` bytes may stand for, each reference
    counted as a copy of what it refers to: 16 per byte, and 1M at least. Far more than
    honest sharing needs, far less than a forged tree of references doubling at each level,
    so that no hash, repr or comparison of a loaded object takes more than the file warrants.
    The writer counts one byte per node, a lower bound of what the reader counts."""
    return 16 * structure_bytes + (1 << 20)


def jax_array_budget(file_bytes: int) -> int:
    """How many jax arrays a file of ``file_bytes`` bytes may hold as data: 1024, and one
    more per KiB. Each takes a fixed time to create on the device (0.1 to 0.2 ms of CPU,
    however small; a zero-size one needs no bytes in the file), so a file under 1 MB
    restores at most 2000 of them. Arrays of 1 KiB or more never reach it; the writer puts
    the jax arrays past it in the pickle section."""
    return 1024 + file_bytes // 1024


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


# -- the registry of types ---------------------------------------------------------------------

_lock = threading.RLock()
_by_name: dict[str, type] = {}
_name_of: dict[type, str] = {}
_checks: dict[type, Callable[[Any], None]] = {}
_builtins_loaded = False
# Modules whose classes are registered on first use; a file never chooses what is imported.
_PUBLIC_MODULES = (
    "optax optax.contrib optax.schedules optax.transforms optax.tree_utils "
    "haiku haiku.data_structures haiku.mixed_precision"
).split()


def is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def is_stateful(cls: type) -> bool:
    return callable(getattr(cls, "__checkpoint_state__", None)) and callable(
        getattr(cls, "__checkpoint_restore__", None)
    )


def class_named(name: Any) -> type | None:
    """The class registered under ``name`` (None if there is none)."""
    load_builtins()
    return _by_name.get(name) if type(name) is str else None


def name_of(cls: type) -> str | None:
    """The name ``cls`` is registered under (None if it is not registered)."""
    load_builtins()
    return _name_of.get(cls)


def check_of(cls: type) -> Callable[[Any], None] | None:
    """The check run on every restored instance of a registered record class, if any."""
    return _checks.get(cls) or getattr(cls, "__checkpoint_check__", None)


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
        is_namedtuple(cls) or dataclasses.is_dataclass(cls) or is_stateful(cls)
    ):
        raise TypeError(
            f"{cls!r} is not a NamedTuple, a dataclass or a class with __checkpoint_state__ "
            "and __checkpoint_restore__"
        )
    if name is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
    if type(name) is not str or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if check is not None and (not callable(check) or is_stateful(cls)):
        raise TypeError("check must be a callable, and is for NamedTuples and dataclasses only")
    load_builtins()
    with _lock:
        _add(cls, name)
        if check is not None:
            _checks[cls] = check
    return cls


def load_builtins() -> None:
    """Register the NamedTuples of optax and haiku (once; under their public names first)."""
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
        found = set()
        for mod_name, module in list(sys.modules.items()):
            if mod_name.split(".")[0] in ("optax", "haiku"):
                found.update(
                    obj
                    for obj in list(vars(module).values())
                    if isinstance(obj, type) and is_namedtuple(obj) and obj.__module__ == mod_name
                )
        for cls in sorted(found, key=lambda c: (c.__module__, c.__qualname__)):
            for module in public:  # the public name first, so files survive refactorings
                if vars(module).get(cls.__qualname__) is cls:
                    _add(cls, f"{module.__name__}.{cls.__qualname__}")
            _add(cls, f"{cls.__module__}.{cls.__qualname__}")
        _builtins_loaded = True


class Scoped:
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
