"""A picklable :func:`jax.jit`."""

from __future__ import annotations

import functools
import inspect
import numbers
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["JittedFunc", "jit"]


def _lookup(obj: Any) -> Any:
    """The object found at ``obj.__module__`` + ``obj.__qualname__`` (outside ``__main__``)."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return None
    if module_name == "__main__" or "<" in qualname:
        return None
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def _rebuild(func_or_payload: Any, by_value: bool, options: dict[str, Any]) -> JittedFunc:
    if by_value:
        import cloudpickle

        func_or_payload = cloudpickle.loads(func_or_payload)
    return JittedFunc(func_or_payload, **options)


def _as_tuple(option: Any, single: type) -> Any:
    """A jit option as a tuple (a single int or str becomes a 1-tuple); None, or anything
    else that is not iterable, as it is (jax.jit's default, or for jax.jit to refuse)."""
    if isinstance(option, single):
        return (option,)
    try:
        return tuple(option)
    except TypeError:
        return option if option is None else (option,)


class JittedFunc(functools.partial):
    """A :func:`jax.jit`-compiled function that can be pickled; made by :func:`jit`.

    Calls go straight to the underlying ``jax.jit`` object (``functools.partial`` forwards them
    in C, so no Python frame is added). Pickling stores the original function and the jit
    options, and unpickling compiles again (lazily, on first call). Attributes of the
    underlying jitted function (``lower``, ``trace``, ``eval_shape``, ``clear_cache``) are
    available on this object.
    """

    def __new__(
        cls,
        func: Callable[..., Any],
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnames: str | Sequence[str] = (),
    ) -> JittedFunc:
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}")
        # frozen as tuples: the pickled options must be the ones jax.jit was given, even if
        # the caller's list changes later (and a generator is read only once). Empty ones
        # are left out, as jax.jit matches argnums to argnames only for options not given.
        options = {
            "static_argnums": _as_tuple(static_argnums, numbers.Integral),
            "donate_argnums": _as_tuple(donate_argnums, numbers.Integral),
            "static_argnames": _as_tuple(static_argnames, str),
            "donate_argnames": _as_tuple(donate_argnames, str),
        }
        options = {k: v for k, v in options.items() if v is not None and v != ()}
        self = super().__new__(cls, jax.jit(func, **options))
        self._fun = func
        self._options = options
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            try:
                setattr(self, attr, getattr(func, attr))
            except AttributeError:
                pass
        self.__wrapped__ = func
        return self

    @property
    def __signature__(self) -> inspect.Signature:  # type: ignore[override]
        return inspect.signature(self._fun)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # Bind like a plain function when used as a method decorator.
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: forward to the jax.jit object.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.func, name)

    def __repr__(self) -> str:
        name = getattr(self._fun, "__qualname__", type(self._fun).__name__)
        try:
            signature = str(self.__signature__)
        except (ValueError, TypeError):  # e.g. builtins: inspect finds no signature
            signature = "(...)"
        return f"JittedFunc({name}{signature})"

    def __reduce__(self) -> tuple[Any, ...]:
        if _lookup(self) is self:
            # A module-level ``@jit``-decorated function: store it by reference.
            return self.__qualname__
        func = self._fun
        if isinstance(func, types.FunctionType) and _lookup(func) is func:
            return _rebuild, (func, False, dict(self._options))
        # Functions defined in __main__, lambdas, closures, partials, ...: store by value, so
        # that plain pickle works across processes too.
        import cloudpickle

        return _rebuild, (cloudpickle.dumps(func), True, dict(self._options))

    def __copy__(self) -> JittedFunc:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> JittedFunc:
        return self


def jit(
    func: Callable[..., Any],
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
    *,
    static_argnames: str | Sequence[str] = (),
    donate_argnames: str | Sequence[str] = (),
) -> JittedFunc:
    r"""An alternative to :func:`jax.jit` that returns a picklable JIT-compiled function.

    :func:`jax.jit` objects cannot be pickled (the compilation depends on device and backend),
    which gets in the way of checkpointing agents and of sending them to other processes.
    :func:`jit` returns a :class:`JittedFunc` that behaves like the ``jax.jit`` object (it
    forwards calls to it without an extra Python frame, so a cached call costs the same) and
    pickles as "this function plus these jit options", with the default device and backend.

    Pickling works with :mod:`pickle` and ``cloudpickle``. Functions importable by module and
    name are stored by reference; all others (functions defined in ``__main__``, lambdas,
    closures, partials, callable objects) are stored by value with ``cloudpickle``, so they
    can be loaded in another process. The result keeps ``__name__``, ``__qualname__``,
    ``__doc__``, ``__module__``, ``__wrapped__`` and ``__signature__`` of ``func``, binds as a
    method when used as a decorator inside a class, and exposes ``lower``, ``trace``,
    ``eval_shape`` and ``clear_cache`` of the underlying ``jax.jit`` object.

    See :func:`jax.jit` for the meaning of the options. As there, an argument made static
    (or donated) by position is also static (donated) when passed by keyword, and the other
    way round.

    Parameters
    ----------
    func : callable
        Function to be JIT compiled.
    static_argnums : int or tuple of ints, optional
        Positional arguments treated as static (compile-time constants; must be hashable).
    donate_argnums : int or tuple of ints, optional
        Positional arguments whose buffers may be donated (reused for outputs).
    static_argnames : str or tuple of str, optional
        Keyword arguments treated as static.
    donate_argnames : str or tuple of str, optional
        Keyword arguments whose buffers may be donated.

    Returns
    -------
    jitted_func : JittedFunc
        A picklable JIT-compiled function.

    Raises
    ------
    TypeError
        If ``func`` is not callable.

    Examples
    --------
    >>> import pickle
    >>> import jax.numpy as jnp
    >>> def scale(x, factor):
    ...     "Multiply by a static factor."
    ...     return x * factor
    >>> f = jit(scale, static_argnames="factor")
    >>> f(jnp.arange(3), factor=2)
    Array([0, 2, 4], dtype=int32)
    >>> g = pickle.loads(pickle.dumps(f))
    >>> g(jnp.arange(3), factor=3), g.__name__, g.__doc__
    (Array([0, 3, 6], dtype=int32), 'scale', 'Multiply by a static factor.')
    """
    return JittedFunc(
        func,
        static_argnums=static_argnums,
        donate_argnums=donate_argnums,
        static_argnames=static_argnames,
        donate_argnames=donate_argnames,
    )
