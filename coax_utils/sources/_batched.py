"""BatchedSource: stack consecutive items of another source into fixed-size batches."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._dataclass import pytree_dataclass, static_field
from coax_utils.sources._array import ArraySource
from coax_utils.sources._base import (
    CompiledNext,
    PyTree,
    Source,
    check_positive_int,
    check_restored,
    zeros_like_spec,
)

__all__ = ["BatchedSource", "BatchedSourceState"]


@pytree_dataclass
class BatchedSourceState:
    """State of a :class:`BatchedSource`.

    Attributes
    ----------
    inner : pytree
        The wrapped source's state.
    step : jax.Array
        int32 scalar: batches emitted in the current epoch.
    epoch : jax.Array
        int32 scalar: number of completed epochs.
    batch_size : int
        Static: the ``batch_size`` of the source the state belongs to.
    drop_last : bool
        Static: the ``drop_last`` of the source the state belongs to. A source refuses the
        state of one that cuts its epochs into other batches (``step`` would not match).
    """

    inner: Any
    step: jax.Array
    epoch: jax.Array
    batch_size: int = static_field()
    drop_last: bool = static_field()

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state is one its source can produce."""
        check_restored(self, ("step", "epoch"))


def _stack_into(buffer: PyTree, value: PyTree, row: jax.Array) -> PyTree:
    return jax.tree_util.tree_map(
        lambda b, v: jax.lax.dynamic_update_index_in_dim(b, jnp.asarray(v, b.dtype), row, 0),
        buffer,
        value,
    )


class BatchedSource(CompiledNext):
    r"""Stack ``batch_size`` consecutive items of a source into one batch.

    One epoch of the batched source covers one epoch of the wrapped source, whose
    :math:`n` = ``source.steps_per_epoch`` items are cut into batches in order:

    .. math::

        \text{steps\_per\_epoch} =
        \begin{cases}
            \lceil n / B \rceil & \text{(default)} \\
            \lfloor n / B \rfloor & \text{with } \texttt{drop\_last}
        \end{cases}

    By default the last batch of an epoch is padded: rows past the end of the epoch hold
    zeros and their mask is False. With ``drop_last=True`` the incomplete tail is skipped
    (the wrapped source still steps through it, so that its epochs stay aligned). The mask
    of a batch stacks the items' masks (shape ``(B,)`` for items with scalar masks, and
    ``(B, B_inner)`` when wrapping another :class:`BatchedSource`). Any source can be
    wrapped, including another :class:`BatchedSource`.

    Parameters
    ----------
    source : Source
        The wrapped source.
    batch_size : int
        Rows per batch, :math:`B`.
    drop_last : bool
        Skip the incomplete last batch of each epoch instead of padding it.

    Raises
    ------
    ValueError
        If ``batch_size`` is not positive or exceeds ``2**31 - 1``, or ``drop_last`` would
        drop every batch (:math:`n < B`). :meth:`next` raises it (while tracing) when the
        wrapped source emits items whose structure, shapes or dtypes differ from its
        ``element_spec()``, instead of casting them into the batch.
    TypeError
        If ``source`` does not implement the :class:`Source` protocol, or ``drop_last`` is
        not a bool.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from coax_utils.sources import ArraySource, BatchedSource
    >>> source = BatchedSource(ArraySource(jnp.arange(1, 6), ordering="sequential"), 2)
    >>> source.steps_per_epoch
    3
    >>> state = source.init_state(jax.random.key(0))
    >>> for _ in range(4):
    ...     batch, mask, state = source.next(state)
    ...     print(batch.tolist(), mask.tolist(), int(state.epoch))
    [1, 2] [True, True] 0
    [3, 4] [True, True] 0
    [5, 0] [True, False] 1
    [1, 2] [True, True] 1
    """

    def __init__(self, source: Source, batch_size: int, drop_last: bool = False) -> None:
        if not isinstance(source, Source):
            raise TypeError(
                "source must implement the Source protocol (steps_per_epoch, init_state, "
                f"next, element_spec), got {source!r}"
            )
        self._batch_size = check_positive_int("batch_size", batch_size)
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last must be a bool, got {drop_last!r}")
        self._drop_last = bool(drop_last)
        self._source = source
        # an ArraySource gathers a whole batch at once, unless a subclass changed its next
        self._gather = isinstance(source, ArraySource) and type(source).next is ArraySource.next
        n = check_positive_int("source.steps_per_epoch", source.steps_per_epoch)
        self._inner_steps = n
        if self._drop_last:
            if n < self._batch_size:
                raise ValueError(
                    f"drop_last=True with batch_size={self._batch_size} would drop every "
                    f"batch: the source has only {n} items per epoch"
                )
            self._steps = n // self._batch_size
        else:
            self._steps = math.ceil(n / self._batch_size)
        self._item_spec = source.element_spec()
        self._spec = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct((self._batch_size, *s.shape), s.dtype),
            self._item_spec,
        )

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``ceil(n / batch_size)``, or ``floor`` with ``drop_last``."""
        return self._steps

    @property
    def batch_size(self) -> int:
        """Rows per batch."""
        return self._batch_size

    @property
    def drop_last(self) -> bool:
        """Whether the incomplete last batch of an epoch is skipped."""
        return self._drop_last

    @property
    def source(self) -> Source:
        """The wrapped source."""
        return self._source

    def element_spec(self) -> PyTree:
        """The wrapped source's spec with a leading axis of length ``batch_size``."""
        return self._spec

    def init_state(self, key: jax.Array) -> BatchedSourceState:
        """Return the state at the start of epoch 0.

        Parameters
        ----------
        key : jax.Array
            PRNG key, passed to the wrapped source's ``init_state``.

        Returns
        -------
        BatchedSourceState
        """
        return BatchedSourceState(
            inner=self._source.init_state(key),
            step=jnp.zeros([], jnp.int32),
            epoch=jnp.zeros([], jnp.int32),
            batch_size=self._batch_size,
            drop_last=self._drop_last,
        )

    def next(self, state: BatchedSourceState) -> tuple[PyTree, jax.Array, BatchedSourceState]:
        """Return ``(batch, mask, new_state)``.

        Parameters
        ----------
        state : BatchedSourceState

        Returns
        -------
        tuple
            The batch (leading axis ``batch_size``), its mask (False on padding rows) and
            the advanced state.

        Raises
        ------
        TypeError
            If ``state`` is not a :class:`BatchedSourceState`.
        ValueError
            If ``state`` belongs to a source with another ``batch_size`` or ``drop_last``.
        """
        if not isinstance(state, BatchedSourceState):
            raise TypeError(f"{self!r}.next needs a BatchedSourceState, got {type(state).__name__}")
        if (state.batch_size, state.drop_last) != (self._batch_size, self._drop_last):
            raise ValueError(
                f"{self!r}.next got the state of another BatchedSource (batch_size="
                f"{state.batch_size}, drop_last={state.drop_last}): its step counts other batches"
            )
        return self._compiled_next(state)

    def _next(self, state: BatchedSourceState) -> tuple[PyTree, jax.Array, BatchedSourceState]:
        if self._gather:
            batch, mask, inner = self._source._next_batch(
                state.inner, self._batch_size, self._drop_last
            )
        else:
            batch, mask, inner = self._collect(state)
        last = state.step + 1 >= self._steps
        new_state = state.replace(
            inner=inner,
            step=jnp.where(last, 0, state.step + 1).astype(jnp.int32),
            epoch=state.epoch + last.astype(jnp.int32),
        )
        return batch, mask, new_state

    def _collect(self, state: BatchedSourceState) -> tuple[PyTree, jax.Array, Any]:
        """Generic path: call the wrapped source's ``next`` once per row."""
        source, size, n = self._source, self._batch_size, self._inner_steps
        value_spec, mask_shape, _ = jax.eval_shape(source.next, state.inner)
        got = jax.tree_util.tree_map(lambda s: (tuple(s.shape), np.dtype(s.dtype)), value_spec)
        expected = jax.tree_util.tree_map(
            lambda s: (tuple(s.shape), np.dtype(s.dtype)), self._item_spec
        )
        if got != expected:
            # stacking them into rows of the spec would cast or only partly fill the rows
            raise ValueError(
                f"{source!r}.next emits items {got}, but its element_spec() says {expected}"
            )
        buffer = zeros_like_spec(self._item_spec, (size,))
        masks = jnp.zeros((size, *mask_shape.shape), jnp.bool_)
        # Items left in the epoch; only the last batch of an epoch can come up short.
        count = jnp.minimum(size, n - state.step * size)
        needs_padding = not self._drop_last and n % size != 0

        def take(carry: tuple[Any, PyTree, jax.Array], row: jax.Array):
            inner, buffer, masks = carry
            value, mask, inner = source.next(inner)
            buffer = _stack_into(buffer, value, row)
            masks = _stack_into(masks, mask, row)
            return (inner, buffer, masks), None

        def body(carry: tuple[Any, PyTree, jax.Array], row: jax.Array):
            if not needs_padding:
                return take(carry, row)
            return jax.lax.cond(row < count, take, lambda c, r: (c, None), carry, row)

        rows = jnp.arange(size, dtype=jnp.int32)
        (inner, buffer, masks), _ = jax.lax.scan(body, (state.inner, buffer, masks), rows)

        remainder = n - self._steps * size
        if self._drop_last and remainder:
            # Step through the tail the last batch of the epoch leaves out.
            def drain(inner: Any) -> Any:
                def skip(inner: Any, _: None) -> tuple[Any, None]:
                    return source.next(inner)[2], None

                return jax.lax.scan(skip, inner, None, length=remainder)[0]

            last = state.step + 1 >= self._steps
            inner = jax.lax.cond(last, drain, lambda s: s, inner)
        return buffer, masks, inner

    def __repr__(self) -> str:
        return (
            f"BatchedSource({self._source!r}, batch_size={self._batch_size}, "
            f"drop_last={self._drop_last})"
        )
