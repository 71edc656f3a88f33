"""The one pytree-dataclass idiom used across the package.

States of jittable code are frozen dataclasses registered with
:func:`jax.tree_util.register_dataclass`. Fields whose metadata holds ``static=True`` are
treated as static (part of the tree structure); all other fields are pytree children.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

T = TypeVar("T")

__all__ = ["pytree_dataclass", "static_field"]


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is static metadata (hashable, not a pytree leaf)."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["static"] = True
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self: T, **changes: Any) -> T:
    """Return a copy with the given fields replaced (unknown names raise TypeError)."""
    return dataclasses.replace(self, **changes)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass registered as a pytree, with a ``replace`` method.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> @pytree_dataclass
    ... class CounterState:
    ...     count: jnp.ndarray
    ...     name: str = static_field(default="c")
    >>> s = CounterState(jnp.zeros([], jnp.int32))
    >>> jax.tree_util.tree_leaves(s.replace(count=s.count + 1))
    [Array(1, dtype=int32)]
    """
    if "replace" not in cls.__dict__:
        cls.replace = _replace  # type: ignore[attr-defined]
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
