"""Small host-side helpers: docstrings, logging, dict merging, pretty printing, reloading."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "docstring",
    "enable_logging",
    "merge_dicts",
    "pretty_print",
    "pretty_repr",
    "reload_recursive",
]

F = TypeVar("F")


def docstring(obj: Any) -> Callable[[F], F]:
    r'''A decorator that sets ``__doc__`` of the decorated object to ``obj.__doc__``.

    Parameters
    ----------
    obj : object
        The object whose docstring is copied onto the decorated object.

    Returns
    -------
    decorator : callable
        Sets ``func.__doc__ = obj.__doc__`` and returns ``func`` itself.

    Examples
    --------
    >>> def f(x):
    ...     """Some docstring"""
    ...     return x * x
    >>> @docstring(f)
    ... def g(x):
    ...     return 13 - x
    >>> g.__doc__
    'Some docstring'
    '''

    def decorator(func: F) -> F:
        func.__doc__ = obj.__doc__
        return func

    return decorator


# Marks handlers added by enable_logging, so repeated calls update instead of duplicating them.
_HANDLER_TAG = "_coax_utils_enable_logging"


def enable_logging(
    name: str | None = None,
    level: int | str = logging.INFO,
    output_filepath: str | os.PathLike[str] | None = None,
    output_level: int | str | None = None,
) -> None:
    r"""Enable logging output on the root logger.

    Adds a :class:`logging.StreamHandler` (stderr) with the format
    ``[name|logger|LEVEL] message`` (``[logger|LEVEL] message`` without ``name``) to the root
    logger and sets the root level, similar to
    ``logging.basicConfig(level=logging.INFO)``. Unlike :func:`logging.basicConfig` it also
    works when the root logger already has handlers (e.g. under pytest), and calling it again
    updates the handlers it added instead of adding duplicates.

    Parameters
    ----------
    name : str, optional
        Name of the process that is logging, put at the start of every line.
    level : int or str, optional
        Logging level of the stream handler (a number or a level name such as ``"DEBUG"``).
        Default: ``logging.INFO`` (20); use ``logging.DEBUG`` for more output.
    output_filepath : str or path, optional
        If given, a :class:`logging.FileHandler` appending to this file (folders are created)
        is added to the root logger as well.
    output_level : int or str, optional
        Logging level of the file handler. Default: ``level``.

    Raises
    ------
    TypeError
        If a level is neither an int nor a str.
    ValueError
        If a level name is unknown to :mod:`logging`.
    OSError
        If the log file cannot be opened. A call that raises changes no logger or handler.

    Examples
    --------
    .. code-block:: python

        enable_logging("learner", output_filepath="runs/learner.log")
        logging.getLogger("train").info("step 100")  # [learner|train|INFO] step 100
    """
    fmt = (
        "[%(name)s|%(levelname)s] %(message)s"
        if name is None
        else (f"[{str(name).replace('%', '%%')}|%(name)s|%(levelname)s] %(message)s")
    )
    formatter = logging.Formatter(fmt)
    # everything that can fail happens before the root logger is touched
    level = _level("level", level)
    file_level = level if output_level is None else _level("output_level", output_level)
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, _HANDLER_TAG, None)]
    handler, new_handler = None, False
    if output_filepath is not None:
        path = os.path.abspath(os.fspath(output_filepath))
        handler = next((h for h in ours if getattr(h, _HANDLER_TAG) == ("file", path)), None)
        if handler is None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            handler, new_handler = logging.FileHandler(path), True
            setattr(handler, _HANDLER_TAG, ("file", path))

    stream = next((h for h in ours if getattr(h, _HANDLER_TAG) == "stream"), None)
    if stream is None:
        stream = logging.StreamHandler()
        setattr(stream, _HANDLER_TAG, "stream")
        root.addHandler(stream)
    stream.setLevel(level)
    stream.setFormatter(formatter)
    if handler is not None:
        if new_handler:
            root.addHandler(handler)
        handler.setLevel(file_level)
        handler.setFormatter(formatter)
    root.setLevel(min(level, file_level) if handler is not None else level)


def _level(name: str, level: Any) -> int:
    """A logging level (an int or a registered level name such as ``"DEBUG"``) as an int."""
    if isinstance(level, str):
        number = logging.getLevelName(level)  # the number for a registered name
        if not isinstance(number, int):
            raise ValueError(f"{name} must be a logging level, got the unknown name {level!r}")
        return number
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"{name} must be an int or a level name, got {level!r}")
    return level


def merge_dicts(*dicts: Mapping[Any, Any]) -> dict[Any, Any]:
    r"""Merge several dicts into a single new dict.

    Duplicate keys are not resolved: a later dict overrides an earlier one, and a
    :class:`UserWarning` names the overlapping keys.

    Parameters
    ----------
    *dicts : Mapping
        The dicts to merge (left unchanged).

    Returns
    -------
    merged : dict
        A single new dict.

    Raises
    ------
    TypeError
        If an argument is not a mapping.

    Examples
    --------
    >>> merge_dicts({"a": 1}, {"b": 2}, {"c": 3})
    {'a': 1, 'b': 2, 'c': 3}
    """
    merged: dict[Any, Any] = {}
    for i, d in enumerate(dicts):
        if not isinstance(d, Mapping):
            raise TypeError(
                f"argument {i} of merge_dicts must be a mapping, got {type(d).__name__}"
            )
        overlap = [k for k in d if k in merged]
        if overlap:
            warnings.warn(f"merge_dicts found overlapping keys: {tuple(overlap)}", stacklevel=2)
        merged.update(d)
    return merged


_INDENT = "  "


def _array_repr(o: Any) -> str:
    summary = ""
    try:
        if np.size(o) > 0 and np.issubdtype(np.dtype(o.dtype), np.number):
            a = np.asarray(o)
            summary = f", min={np.min(a):.3g}, median={np.median(a):.3g}, max={np.max(a):.3g}"
    except Exception:  # tracers and exotic arrays: shape and dtype only
        summary = ""
    return f"array(shape={tuple(o.shape)}, dtype={o.dtype}{summary})"


def _is_array(o: Any) -> bool:
    if isinstance(o, np.ndarray):
        return True
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(o, jax.Array)


def _pretty(o: Any, d: int, seen: set[int]) -> str:
    if _is_array(o):
        return _array_repr(o)
    items: list[tuple[str, Any]] | None = None
    if isinstance(o, tuple) and hasattr(o, "_asdict"):  # namedtuple
        opening, closing, items = f"{type(o).__name__}(", ")", list(o._asdict().items())
        items = [(f"{k}=", v) for k, v in items]
    elif dataclasses.is_dataclass(o) and not isinstance(o, type):
        fields = [f.name for f in dataclasses.fields(o)]
        opening, closing = f"{type(o).__name__}(", ")"
        items = [(f"{k}=", getattr(o, k)) for k in fields]
    elif isinstance(o, Mapping):
        opening, closing = "{", "}"
        items = [(f"{k!r}: ", v) for k, v in o.items()]
    elif isinstance(o, tuple):
        opening, closing = "(", ")"
        items = [("", v) for v in o]
    elif isinstance(o, list):
        opening, closing = "[", "]"
        items = [("", v) for v in o]
    if items is None:
        return repr(o)
    if not items:
        return f"{opening}{closing}"
    if id(o) in seen:
        return "..."
    seen = seen | {id(o)}
    pad = "\n" + _INDENT * (d + 1)
    body = ("," + pad).join(f"{k}{_pretty(v, d + 1, seen)}" for k, v in items)
    return f"{opening}{pad}{body}{closing}"


def pretty_repr(o: Any, d: int = 0) -> str:
    r"""A readable multi-line :func:`repr` of nested containers and arrays.

    Dicts (any mapping), lists, tuples, namedtuples and dataclasses (such as the package's
    state dataclasses) are expanded one item per line, indented by depth; arrays are summarized
    as ``array(shape=..., dtype=..., min=..., median=..., max=...)`` instead of printing their
    values; everything else uses :func:`repr`. Self-references print as ``...``.

    Parameters
    ----------
    o : object
        Any object.
    d : int, optional
        The depth of the recursion, which sets the indentation; keep it 0.

    Returns
    -------
    pretty_repr : str
        A formatted string representation of ``o``.

    Examples
    --------
    >>> import numpy as np
    >>> print(pretty_repr({"w": np.array([1.0, 2.0, 3.0]), "tags": ("a", 1)}))
    {
      'w': array(shape=(3,), dtype=float64, min=1, median=2, max=3),
      'tags': (
        'a',
        1)}
    """
    return _pretty(o, d, set())


def pretty_print(obj: Any) -> None:
    r"""Print :func:`pretty_repr(obj) <pretty_repr>`.

    Parameters
    ----------
    obj : object
        Any object.

    Examples
    --------
    >>> pretty_print([1, {"a": None}])
    [
      1,
      {
        'a': None}]
    """
    print(pretty_repr(obj))


def _is_reloadable(module: ModuleType) -> bool:
    # Built-in and extension modules cannot be re-executed meaningfully; only Python sources.
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    return isinstance(origin, str) and origin.endswith(".py")


def _is_part_of(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _reload(
    module: ModuleType,
    root_name: str,
    reload_all: bool,
    visiting: set[str],
    reloaded: set[str],
    logger: logging.Logger,
) -> None:
    name = module.__name__
    visiting.add(name)
    for attr_name in dir(module):
        attr = getattr(module, attr_name, None)
        if not isinstance(attr, ModuleType):
            continue
        sub = attr.__name__
        if sub in visiting or sub in reloaded or not _is_reloadable(attr):
            continue
        if reload_all or _is_part_of(sub, root_name):
            _reload(attr, root_name, reload_all, visiting, reloaded, logger)
    logger.debug("reloading module: %s", name)
    importlib.reload(module)
    reloaded.add(name)


def reload_recursive(module: ModuleType | str, reload_external_modules: bool = False) -> ModuleType:
    r"""Recursively reload a module, its dependencies first.

    The modules referenced as attributes of ``module`` are reloaded (depth first) before
    ``module`` itself, so that ``from .sub import x`` in a parent picks up the reloaded
    ``sub``. By default only submodules of ``module`` (names ``module.*``) are followed;
    built-in and extension modules are never reloaded, and import cycles are handled (each
    module is reloaded once).

    Parameters
    ----------
    module : ModuleType or str
        The module (or its dotted name) to reload.
    reload_external_modules : bool, optional
        Whether to follow and reload every referenced Python module, including external ones
        that aren't submodules of ``module``.

    Returns
    -------
    module : ModuleType
        The reloaded module.

    Raises
    ------
    TypeError
        If ``module`` is neither a module nor a str.

    Examples
    --------
    >>> import colorsys
    >>> reload_recursive("colorsys") is colorsys
    True
    """
    if isinstance(module, str):
        module = importlib.import_module(module)
    elif not isinstance(module, ModuleType):
        raise TypeError(f"module must be a module or a str; got: {type(module).__name__}")
    logger = logging.getLogger("coax_utils.utils.reload_recursive")
    _reload(module, module.__name__, reload_external_modules, set(), set(), logger)
    return module
