"""ArraySource: a stream over an in-memory pytree of arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._dataclass import pytree_dataclass
from coax_utils.sources._base import (
    CompiledNext,
    PyTree,
    canonical_dtype,
    check_fits,
    check_ordering,
    check_restored,
    check_state,
    epoch_permutation,
    refresh_order,
    sample_indices,
)

__all__ = ["ArraySource", "ArraySourceState"]


@pytree_dataclass
class ArraySourceState:
    """State of an :class:`ArraySource`.

    Attributes
    ----------
    order : jax.Array
        int32 array of shape ``(num_samples,)``: the sample indices in this epoch's order.
    position : jax.Array
        int32 scalar: how many items of the current epoch have been emitted.
    key : jax.Array
        PRNG key from which the next epoch's permutation is drawn.
    epoch : jax.Array
        int32 scalar: number of completed epochs.
    reshuffle : jax.Array
        bool scalar: True right after an epoch ends; the next call draws the new epoch's
        permutation before reading (drawing it first keeps ``next`` free of O(n) copies).
    """

    order: jax.Array
    position: jax.Array
    key: jax.Array
    epoch: jax.Array
    reshuffle: jax.Array

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state is one its source can produce."""
        check_restored(self, ("position", "epoch"), ("reshuffle",), order=True)


class ArraySource(CompiledNext):
    """Stream the samples of an in-memory pytree of arrays, one per ``next`` call.

    Every leaf of ``data`` has the same leading (sample) axis of length ``n``. An epoch
    emits each of the ``n`` samples exactly once: in index order with
    ``ordering="sequential"``, or in a fresh random permutation each epoch with
    ``ordering="shuffle"`` (drawn from the state's key). The mask of every item is a
    scalar ``True``.

    Parameters
    ----------
    data : pytree of array-like
        Leaves with a common leading axis of positive length.
    ordering : {"shuffle", "sequential"}
        Visiting order within an epoch.

    Raises
    ------
    ValueError
        If ``data`` has no leaves, a leaf is a scalar, the leading axes differ, there are
        zero samples, ``ordering`` is unknown, or a NumPy leaf holds 64-bit values that the
        32-bit dtype JAX uses without ``jax_enable_x64`` cannot hold (integers beyond its
        range, finite floats beyond float32's range); nothing is silently wrapped.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from coax_utils.sources import ArraySource
    >>> source = ArraySource({"x": jnp.arange(3) * 10}, ordering="sequential")
    >>> state = source.init_state(jax.random.key(0))
    >>> for _ in range(4):
    ...     value, mask, state = source.next(state)
    ...     print(int(value["x"]), bool(mask), int(state.epoch))
    0 True 0
    10 True 0
    20 True 1
    0 True 1
    """

    def __init__(self, data: PyTree, ordering: str = "shuffle") -> None:
        self._ordering = check_ordering(ordering)
        leaves, treedef = jax.tree_util.tree_flatten(data)
        if not leaves:
            raise ValueError("data must contain at least one array, got an empty pytree")
        shapes = [np.shape(leaf) for leaf in leaves]
        if any(len(shape) == 0 for shape in shapes):
            raise ValueError(
                f"every leaf of data needs a leading sample axis, got leaf shapes {shapes}"
            )
        lengths = {shape[0] for shape in shapes}
        if len(lengths) != 1:
            raise ValueError(
                f"all leaves of data must share the leading axis, got leaf shapes {shapes}"
            )
        (num_samples,) = lengths
        if num_samples == 0:
            raise ValueError("data has zero samples (leading axis of length 0)")
        self._num_samples = int(num_samples)
        arrays = []
        for i, x in enumerate(leaves):
            if not isinstance(x, jax.Array):
                x = np.asarray(x)
                check_fits(x, canonical_dtype(x.dtype), f"leaf {i} of data")
            arrays.append(jnp.asarray(x))
        self._data = jax.tree_util.tree_unflatten(treedef, arrays)
        self._spec = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), self._data
        )

    @property
    def steps_per_epoch(self) -> int:
        """Number of items per epoch (the number of samples)."""
        return self._num_samples

    @property
    def num_samples(self) -> int:
        """Number of samples (length of the leading axis)."""
        return self._num_samples

    @property
    def ordering(self) -> str:
        """``"shuffle"`` or ``"sequential"``."""
        return self._ordering

    @property
    def data(self) -> PyTree:
        """The data, as a pytree of :class:`jax.Array`."""
        return self._data

    def element_spec(self) -> PyTree:
        """Pytree of :class:`jax.ShapeDtypeStruct` of one sample (leading axis removed)."""
        return self._spec

    def _order(self, key: jax.Array) -> jax.Array:
        return epoch_permutation(key, self._num_samples, self._ordering == "shuffle")

    def init_state(self, key: jax.Array) -> ArraySourceState:
        """Return the state at the start of epoch 0.

        Parameters
        ----------
        key : jax.Array
            PRNG key (typed or raw) seeding the epoch permutations.

        Returns
        -------
        ArraySourceState
        """
        key, order_key = jax.random.split(key)
        return ArraySourceState(
            order=self._order(order_key),
            position=jnp.zeros([], jnp.int32),
            key=key,
            epoch=jnp.zeros([], jnp.int32),
            reshuffle=jnp.zeros([], jnp.bool_),
        )

    def _refresh(self, state: ArraySourceState) -> ArraySourceState:
        """Draw the epoch's permutation if the previous epoch just ended."""
        check_state(state, ArraySourceState, self._num_samples, self)
        order, key = refresh_order(
            state.key, state.order, state.reshuffle, self._ordering == "shuffle"
        )
        return state.replace(order=order, key=key)

    @staticmethod
    def _advance(state: ArraySourceState, position: jax.Array, epoch_ends: jax.Array):
        """State after moving to ``position``; at the end of the epoch, start the next."""
        return state.replace(
            position=jnp.where(epoch_ends, 0, position).astype(jnp.int32),
            epoch=state.epoch + epoch_ends.astype(jnp.int32),
            reshuffle=epoch_ends,
        )

    def next(self, state: ArraySourceState) -> tuple[PyTree, jax.Array, ArraySourceState]:
        """Return ``(sample, mask, new_state)``; ``mask`` is a scalar ``True``.

        Parameters
        ----------
        state : ArraySourceState

        Returns
        -------
        tuple
            The sample (a pytree like ``data`` without the leading axis), the mask and the
            advanced state.

        Raises
        ------
        TypeError
            If ``state`` is not an :class:`ArraySourceState`.
        ValueError
            If ``state`` belongs to a source with another number of samples (at trace time).
        """
        return self._compiled_next(state)

    def _next(self, state: ArraySourceState) -> tuple[PyTree, jax.Array, ArraySourceState]:
        state = self._refresh(state)
        index = sample_indices(state.order, state.position, self._ordering == "shuffle")
        sample = jax.tree_util.tree_map(
            lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), self._data
        )
        position = state.position + 1
        new_state = self._advance(state, position, position >= self._num_samples)
        return sample, jnp.ones([], jnp.bool_), new_state

    def _next_batch(
        self, state: ArraySourceState, batch_size: int, drop_last: bool
    ) -> tuple[PyTree, jax.Array, ArraySourceState]:
        """Fast path of :class:`BatchedSource`: the next ``batch_size`` items in one gather.

        Rows past the end of the epoch are zeros with a False mask; the epoch ends with
        this batch when the following batch would start at or past the end (or, with
        ``drop_last``, would not be full).
        """
        n = self._num_samples
        state = self._refresh(state)
        positions = state.position + jnp.arange(batch_size, dtype=jnp.int32)
        valid = positions < n
        safe = jnp.minimum(positions, n - 1)
        # Out-of-range indices make ``take`` fill padding rows with zeros.
        shuffle = self._ordering == "shuffle"
        indices = jnp.where(valid, sample_indices(state.order, safe, shuffle), n)
        batch = jax.tree_util.tree_map(
            lambda x: jnp.take(x, indices, axis=0, mode="fill", fill_value=0), self._data
        )
        position = state.position + batch_size
        epoch_ends = position + batch_size > n if drop_last else position >= n
        return batch, valid, self._advance(state, position, epoch_ends)

    def __repr__(self) -> str:
        return (
            f"ArraySource(num_samples={self._num_samples}, ordering={self._ordering!r}, "
            f"element_spec={self._spec})"
        )
