"""The :class:`Source` protocol and small helpers shared by the sources."""

from __future__ import annotations

import operator
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

__all__ = ["Source"]


@runtime_checkable
class Source(Protocol):
    """A JIT-friendly data stream: a pure state machine with fixed-length epochs.

    A source holds configuration only; everything that changes lives in its state, a frozen
    pytree dataclass with an ``epoch`` counter and a ``replace(**changes)`` method. ``next``
    is a pure function of the state, so it runs under :func:`jax.jit` and inside
    :func:`jax.lax.scan`:

    .. code-block:: python

        state = source.init_state(key)
        value, mask, state = source.next(state)

    ``mask`` is a boolean array (a scalar for a single item, one entry per row for a batch)
    that is False where ``value`` holds padding rather than data.

    Attributes
    ----------
    steps_per_epoch : int
        Number of ``next`` calls in one epoch.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from coax_utils.sources import ArraySource, Source
    >>> isinstance(ArraySource(jnp.arange(3)), Source)
    True
    """

    steps_per_epoch: int

    def init_state(self, key: jax.Array) -> Any:
        """Return the state at the start of epoch 0 (``key`` seeds any randomness)."""
        ...

    def next(self, state: Any) -> tuple[PyTree, jax.Array, Any]:
        """Return ``(value, mask, new_state)``: the next item and the advanced state."""
        ...

    def element_spec(self) -> PyTree:
        """Pytree of :class:`jax.ShapeDtypeStruct` describing one emitted ``value``."""
        ...


class CompiledNext:
    """Base of the sources: :meth:`_compiled_next` runs ``self._next`` compiled once.

    Called eagerly, a traced :func:`jax.lax.cond` is compiled anew on every call; one
    :func:`jax.jit` per source avoids that (inside a caller's ``jit`` it is inlined). The
    compiled function is made on first use and left out of pickles.
    """

    def _compiled_next(self, state: Any) -> tuple[PyTree, jax.Array, Any]:
        compiled = self.__dict__.get("_jit_next")
        if compiled is None:
            compiled = self._jit_next = jax.jit(self._next)  # type: ignore[attr-defined]
        return compiled(state)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_jit_next", None)
        return state


MAX_COUNT = int(np.iinfo(np.int32).max)


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise if it is not an integer in ``[1, MAX_COUNT]``.

    Positions, steps and epochs live in int32 state fields, so larger counts are refused
    here, before anything is allocated for them.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{name} must be a positive integer, got {number}")
    if number > MAX_COUNT:
        raise ValueError(
            f"{name} must be at most {MAX_COUNT} (sources count in int32), got {number}"
        )
    return number


ORDERINGS = ("shuffle", "sequential")


def check_ordering(ordering: Any) -> str:
    """Return ``ordering`` if it is one of :data:`ORDERINGS`, else raise ValueError."""
    if not isinstance(ordering, str) or ordering not in ORDERINGS:
        raise ValueError(f"ordering must be 'shuffle' or 'sequential', got {ordering!r}")
    return ordering


def canonical_dtype(dtype: Any) -> np.dtype:
    """The dtype JAX actually uses for ``dtype`` (int64 -> int32 without x64, ...)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def check_fits(array: np.ndarray, dtype: Any, what: str) -> None:
    """Raise ValueError if casting ``array`` to ``dtype`` would change a value's magnitude.

    Without ``jax_enable_x64`` JAX stores 64-bit data in 32 bits; integers beyond that range
    would wrap around and floats beyond it would become infinite. (Float rounding to the
    narrower precision is what JAX does everywhere, and is allowed.)
    """
    dtype = np.dtype(dtype)
    if array.size == 0 or array.dtype == dtype or array.dtype == np.bool_:
        return
    if np.issubdtype(dtype, np.integer):
        if not np.issubdtype(array.dtype, np.integer):
            return
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise ValueError(
                f"{what} holds the {array.dtype} value {bad}, which does not fit in "
                f"{dtype.name}, the dtype JAX uses for it (enable jax_enable_x64 to keep "
                "64-bit values, or convert the data)"
            )
    elif np.issubdtype(dtype, np.floating) and np.issubdtype(array.dtype, np.floating):
        finite = np.abs(array[np.isfinite(array)])
        if finite.size and finite.max() > np.finfo(dtype).max:
            raise ValueError(
                f"{what} holds the {array.dtype} value {finite.max()}, beyond the range of "
                f"{dtype.name}, the dtype JAX uses for it (enable jax_enable_x64 to keep "
                "64-bit values, or convert the data)"
            )


def check_state(state: Any, cls: type, order_length: int, owner: Any) -> None:
    """Refuse a state that is not a ``cls`` or whose ``order`` has the wrong length.

    Shapes are static, so this runs while tracing; it catches a state of another source.
    """
    if not isinstance(state, cls):
        raise TypeError(f"{owner!r}.next needs a {cls.__name__}, got {type(state).__name__}")
    shape = tuple(np.shape(state.order))
    if shape != (order_length,):
        raise ValueError(
            f"{owner!r}.next got the state of another source: its order has shape {shape}, "
            f"but this source has {order_length} samples"
        )


def check_restored(
    state: Any,
    counters: tuple[str, ...],
    flags: tuple[str, ...] = (),
    order: bool = False,
    buffer_start: bool = False,
) -> None:
    """Refuse (ValueError) a restored source state that no run of its source produces.

    A checkpoint rebuilds a state field by field; a damaged or hostile file could hold an
    ``order`` that repeats samples, or positions that make ``next`` read the wrong rows
    without a sign (reads in compiled code are clamped, not checked). Checked here, on host
    copies: the ``counters`` (and ``buffer_start``) are int32 scalars, the counters at least
    0; the ``flags`` are bool scalars; ``order`` is a permutation of ``range(len(order))``
    and ``position`` lies in it; ``buffer_start`` is -1 (nothing held) or at most
    ``position``.
    """
    kind = type(state).__name__

    def scalar(name: str, dtype: Any) -> np.ndarray:
        x = getattr(state, name)
        if (
            not isinstance(x, (np.ndarray, np.generic, jax.Array))
            or np.dtype(x.dtype) != np.dtype(dtype)
            or np.shape(x) != ()
        ):
            got = f"{x.dtype} of shape {np.shape(x)}" if hasattr(x, "dtype") else type(x).__name__
            want = f"a scalar of dtype {np.dtype(dtype)}"
            raise ValueError(f"{kind}.{name} must be {want}, got {got}")
        return np.asarray(x)

    values = {name: int(scalar(name, np.int32)) for name in counters}
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{kind}.{name} is {value}, below 0")
    for name in flags:
        scalar(name, np.bool_)
    if order:
        x = state.order
        if not isinstance(x, (np.ndarray, jax.Array)) or x.dtype != np.int32 or x.ndim != 1:
            raise ValueError(f"{kind}.order must be a 1-d int32 array")
        x = np.asarray(x)
        if not np.array_equal(np.sort(x), np.arange(len(x))):
            raise ValueError(f"{kind}.order is not a permutation of range({len(x)})")
        if values["position"] >= len(x):
            raise ValueError(f"{kind}.position {values['position']} lies beyond the epoch")
    if buffer_start:
        start = int(scalar("buffer_start", np.int32))
        if not -1 <= start <= values["position"]:
            raise ValueError(
                f"{kind}.buffer_start is {start}: neither -1 nor within the epoch's first "
                f"{values['position'] + 1} positions"
            )


def spec_of(tree: PyTree) -> PyTree:
    """Pytree of :class:`jax.ShapeDtypeStruct` of the leaves of ``tree`` (dtypes canonical)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), canonical_dtype(np.result_type(x))), tree
    )


def zeros_like_spec(spec: PyTree, leading: tuple[int, ...] = ()) -> PyTree:
    """Zeros of the shapes/dtypes of ``spec``, with extra ``leading`` axes."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(leading + tuple(s.shape), s.dtype), spec)


def epoch_permutation(key: jax.Array, size: int, shuffle: bool) -> jax.Array:
    """The int32 visiting order of one epoch: a random permutation or ``arange``."""
    if shuffle:
        return jax.random.permutation(key, size).astype(jnp.int32)
    return jnp.arange(size, dtype=jnp.int32)


def sample_indices(order: jax.Array, positions: jax.Array, shuffle: bool) -> jax.Array:
    """The sample indices at epoch ``positions`` (in bounds): ``order[positions]`` when
    shuffling, the positions themselves otherwise.

    A sequential source does not read ``order``: a state saved by a shuffling source of the
    same length still gives index order, not its saved permutation in every epoch.
    """
    return order[positions] if shuffle else positions


def refresh_order(
    key: jax.Array, order: jax.Array, reshuffle: jax.Array, shuffle: bool
) -> tuple[jax.Array, jax.Array]:
    """``(order, key)`` to read from now: a fresh permutation when ``reshuffle`` is set.

    Call this before anything reads ``order``, with ``reshuffle`` a state flag set by the
    previous step. Structured otherwise (the conditional after a read of ``order``, or its
    predicate computed from the position), XLA:CPU was measured to copy ``order`` on every
    step, O(n) per item. Sequential orders never change.
    """
    if not shuffle:
        return order, key

    def fresh(key: jax.Array, order: jax.Array) -> tuple[jax.Array, jax.Array]:
        key, order_key = jax.random.split(key)
        return epoch_permutation(order_key, order.shape[0], True), key

    return jax.lax.cond(reshuffle, fresh, lambda key, order: (order, key), key, order)
