"""DiskSource: a stream whose samples come from a Python callback, fetched in chunks."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from coax_utils._dataclass import pytree_dataclass
from coax_utils.sources._base import (
    CompiledNext,
    PyTree,
    canonical_dtype,
    check_fits,
    check_ordering,
    check_positive_int,
    check_restored,
    check_state,
    epoch_permutation,
    refresh_order,
    sample_indices,
    spec_of,
    zeros_like_spec,
)

__all__ = ["DiskSource", "DiskSourceState"]


@pytree_dataclass
class DiskSourceState:
    """State of a :class:`DiskSource`.

    Attributes
    ----------
    order : jax.Array
        int32 array of shape ``(length,)``: the sample indices in this epoch's order.
    position : jax.Array
        int32 scalar: how many items of the current epoch have been emitted.
    key : jax.Array
        PRNG key from which the next epoch's permutation is drawn.
    epoch : jax.Array
        int32 scalar: number of completed epochs.
    buffer : pytree of jax.Array
        The prefetched chunk: ``prefetch_size`` samples stacked along a leading axis.
    buffer_start : jax.Array
        int32 scalar: epoch position of the first sample in ``buffer``; -1 when the buffer
        holds nothing of the current epoch.
    reshuffle : jax.Array
        bool scalar: True right after an epoch ends; the next call draws the new epoch's
        permutation first.
    """

    order: jax.Array
    position: jax.Array
    key: jax.Array
    epoch: jax.Array
    buffer: PyTree
    buffer_start: jax.Array
    reshuffle: jax.Array

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state is one its source can produce."""
        check_restored(self, ("position", "epoch"), ("reshuffle",), order=True, buffer_start=True)


def _describe(spec: jax.ShapeDtypeStruct) -> str:
    return f"shape {tuple(spec.shape)} dtype {np.dtype(spec.dtype).name}"


class DiskSource(CompiledNext):
    """Stream samples produced by a Python function ``sample_fn(i)``, for data not in memory.

    ``sample_fn(i)`` returns sample ``i`` (``0 <= i < length``) as a pytree of array-likes,
    read from disk, a database or anything else. Under :func:`jax.jit`, samples are fetched
    through :func:`jax.experimental.io_callback` in chunks: whenever the current chunk is
    used up, one callback loads the next ``prefetch_size`` samples of the epoch's order
    into a buffer, and the following ``next`` calls read from that buffer. Every index is
    fetched exactly once per epoch; the mask of every item is a scalar ``True``. Each
    sample is copied out of what ``sample_fn`` returned before ``sample_fn`` is called
    again, so a reader that fills and returns one reused array is fine.

    Parameters
    ----------
    length : int
        Number of samples.
    sample_fn : callable
        ``sample_fn(i: int) -> pytree``; every sample has the structure, shapes and dtypes
        of ``sample_spec``.
    sample_spec : pytree of jax.ShapeDtypeStruct, optional
        Description of one sample. By default it is inferred from ``sample_fn(0)``.
    ordering : {"shuffle", "sequential"}
        Visiting order within an epoch; shuffling permutes the whole data set, not only
        the prefetch chunk.
    prefetch_size : int
        Number of samples loaded per callback.

    Raises
    ------
    ValueError
        For a ``length`` or ``prefetch_size`` that is not positive or exceeds ``2**31 - 1``
        (positions are int32), an unknown ``ordering``, or an empty spec.
    TypeError
        If ``sample_fn`` is not callable, a leaf of ``sample_spec`` is not a
        :class:`jax.ShapeDtypeStruct`, or (spec inferred) a leaf of ``sample_fn(0)`` is not
        an array of numbers or bools (a string, an object or datetime array).

    Notes
    -----
    A failing callback cannot raise a Python exception through compiled code. When
    ``sample_fn(i)`` raises, or returns a sample whose structure, shape or dtype differs
    from the spec, the callback raises a :class:`ValueError` whose message names the index
    and the problem; ``next`` (compiled, whether called eagerly or under ``jit``) reaches
    the caller with it as a :class:`jax.errors.JaxRuntimeError` carrying the same message.
    Dtypes are compared after JAX's canonicalization (a float64 sample matches a float32
    spec when 64-bit mode is off); a 64-bit value that the 32-bit dtype cannot hold (an
    int64 beyond int32's range, a float64 beyond float32's) raises the same way instead of
    wrapping around. A state whose order holds an index outside ``[0, length)`` (a damaged
    checkpoint) raises the same way, before ``sample_fn`` sees that index.

    ``next`` cannot be vmapped over a batch of states (JAX runs no callback inside a
    vmapped conditional and raises ``NotImplementedError``); use one state and
    :class:`~coax_utils.sources.BatchedSource` for batches.

    Examples
    --------
    >>> import jax, numpy as np
    >>> from coax_utils.sources import DiskSource
    >>> source = DiskSource(5, lambda i: {"x": np.full(2, i)}, ordering="sequential",
    ...                     prefetch_size=2)
    >>> state = source.init_state(jax.random.key(0))
    >>> step = jax.jit(source.next)
    >>> for _ in range(5):
    ...     value, mask, state = step(state)
    ...     print(value["x"].tolist(), bool(mask))
    [0, 0] True
    [1, 1] True
    [2, 2] True
    [3, 3] True
    [4, 4] True
    >>> int(state.epoch)
    1
    """

    def __init__(
        self,
        length: int,
        sample_fn: Callable[[int], PyTree],
        sample_spec: PyTree | None = None,
        ordering: str = "shuffle",
        prefetch_size: int = 64,
    ) -> None:
        self._length = check_positive_int("length", length)
        self._prefetch_size = check_positive_int("prefetch_size", prefetch_size)
        self._ordering = check_ordering(ordering)
        if not callable(sample_fn):
            raise TypeError(f"sample_fn must be callable, got {sample_fn!r}")
        self._sample_fn = sample_fn
        if sample_spec is None:
            sample = jax.tree_util.tree_map(np.asarray, self._call(0))
            for i, array in enumerate(jax.tree_util.tree_leaves(sample)):
                if array.dtype.kind not in "biufc":
                    raise TypeError(
                        f"DiskSource: leaf {i} of sample_fn(0) has dtype {array.dtype}; "
                        "samples must be arrays of numbers or bools"
                    )
            sample_spec = spec_of(sample)
        leaves = jax.tree_util.tree_leaves(sample_spec)
        if not leaves:
            raise ValueError("the sample spec must have at least one leaf, got an empty pytree")
        for leaf in leaves:
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                raise TypeError(f"leaves of sample_spec must be jax.ShapeDtypeStruct, got {leaf!r}")
        self._spec = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(tuple(s.shape), canonical_dtype(s.dtype)), sample_spec
        )
        self._spec_leaves, self._spec_treedef = jax.tree_util.tree_flatten(self._spec)
        self._chunk_leaves = [
            jax.ShapeDtypeStruct((self._prefetch_size, *s.shape), s.dtype)
            for s in self._spec_leaves
        ]
        self._dtype_cache: dict[tuple[np.dtype, np.dtype], bool] = {}

    @property
    def steps_per_epoch(self) -> int:
        """Number of items per epoch (``length``)."""
        return self._length

    @property
    def length(self) -> int:
        """Number of samples."""
        return self._length

    @property
    def prefetch_size(self) -> int:
        """Number of samples fetched per callback."""
        return self._prefetch_size

    @property
    def ordering(self) -> str:
        """``"shuffle"`` or ``"sequential"``."""
        return self._ordering

    @property
    def sample_fn(self) -> Callable[[int], PyTree]:
        """The Python function returning sample ``i``."""
        return self._sample_fn

    def element_spec(self) -> PyTree:
        """Pytree of :class:`jax.ShapeDtypeStruct` describing one sample."""
        return self._spec

    def _call(self, index: int) -> PyTree:
        try:
            return self._sample_fn(index)
        except Exception as exc:
            raise ValueError(
                f"DiskSource: sample_fn({index}) raised {type(exc).__name__}: {exc}"
            ) from exc

    def _dtype_matches(self, dtype: np.dtype, spec: jax.ShapeDtypeStruct) -> bool:
        key = (dtype, spec.dtype)
        ok = self._dtype_cache.get(key)
        if ok is None:
            ok = self._dtype_cache[key] = canonical_dtype(dtype) == spec.dtype
        return ok

    def _checked_leaves(self, index: int, sample: PyTree) -> list[np.ndarray]:
        leaves, treedef = jax.tree_util.tree_flatten(sample)
        if treedef != self._spec_treedef:
            raise ValueError(
                f"DiskSource: sample_fn({index}) returned a pytree of structure {treedef}; "
                f"the spec expects {self._spec_treedef}"
            )
        arrays = []
        for leaf_index, (leaf, spec) in enumerate(zip(leaves, self._spec_leaves)):
            array = np.asarray(leaf)
            if array.shape != spec.shape or not self._dtype_matches(array.dtype, spec):
                got = jax.ShapeDtypeStruct(array.shape, canonical_dtype(array.dtype))
                raise ValueError(
                    f"DiskSource: sample_fn({index}) returned leaf {leaf_index} with "
                    f"{_describe(got)}; the spec expects {_describe(spec)}"
                )
            check_fits(array, spec.dtype, f"DiskSource: leaf {leaf_index} of sample_fn({index})")
            arrays.append(array)
        return arrays

    def _fetch(self, indices: np.ndarray, count: np.ndarray) -> list[np.ndarray]:
        """Host side of the prefetch: ``sample_fn(i)`` for the first ``count`` indices, stacked.

        Each sample is copied into its row before the next call, so a ``sample_fn`` that
        fills and returns the same array on every call still gives each sample once.
        """
        index_list = np.asarray(indices)[: int(np.asarray(count))].tolist()
        bad = [i for i in index_list if not 0 <= i < self._length]
        if bad:  # a damaged or foreign state: never pass sample_fn an index it may wrap
            raise ValueError(
                f"DiskSource: the state's order holds the index {bad[0]} outside "
                f"[0, {self._length}) (a damaged state, or one of another source?)"
            )
        out = [np.zeros(s.shape, s.dtype) for s in self._chunk_leaves]
        targets = list(zip(out, self._spec_leaves))
        for row, index in enumerate(index_list):
            sample = self._call(index)
            leaves, treedef = jax.tree_util.tree_flatten(sample)
            if treedef != self._spec_treedef:
                self._checked_leaves(index, sample)  # raises, naming the difference
            for (buf, spec), leaf in zip(targets, leaves):
                array = np.asarray(leaf)
                if array.shape != spec.shape or array.dtype != spec.dtype:
                    # raises unless these are 64-bit values that fit the narrower dtype
                    self._checked_leaves(index, sample)
                buf[row] = array
        return out

    def _order(self, key: jax.Array) -> jax.Array:
        return epoch_permutation(key, self._length, self._ordering == "shuffle")

    def init_state(self, key: jax.Array) -> DiskSourceState:
        """Return the state at the start of epoch 0 (nothing fetched yet).

        Parameters
        ----------
        key : jax.Array
            PRNG key (typed or raw) seeding the epoch permutations.

        Returns
        -------
        DiskSourceState
        """
        key, order_key = jax.random.split(key)
        return DiskSourceState(
            order=self._order(order_key),
            position=jnp.zeros([], jnp.int32),
            key=key,
            epoch=jnp.zeros([], jnp.int32),
            buffer=zeros_like_spec(self._spec, (self._prefetch_size,)),
            buffer_start=jnp.full([], -1, jnp.int32),
            reshuffle=jnp.zeros([], jnp.bool_),
        )

    def _refill(self, state: DiskSourceState) -> DiskSourceState:
        """Fetch the chunk of the epoch that starts at ``state.position`` into the buffer.

        A new epoch starts with an empty buffer, so its permutation is drawn here too.
        """
        order, key = refresh_order(
            state.key, state.order, state.reshuffle, self._ordering == "shuffle"
        )
        size = self._prefetch_size
        offsets = state.position + jnp.arange(size, dtype=jnp.int32)
        shuffle = self._ordering == "shuffle"
        indices = sample_indices(order, jnp.minimum(offsets, self._length - 1), shuffle)
        count = jnp.minimum(self._length - state.position, size).astype(jnp.int32)
        leaves = io_callback(self._fetch, self._chunk_leaves, indices, count)
        return state.replace(
            order=order,
            key=key,
            buffer=jax.tree_util.tree_unflatten(self._spec_treedef, leaves),
            buffer_start=state.position,
            reshuffle=jnp.zeros([], jnp.bool_),
        )

    def next(self, state: DiskSourceState) -> tuple[PyTree, jax.Array, DiskSourceState]:
        """Return ``(sample, mask, new_state)``, fetching the next chunk when needed.

        Parameters
        ----------
        state : DiskSourceState

        Returns
        -------
        tuple
            The sample, a scalar ``True`` mask and the advanced state.

        Raises
        ------
        TypeError
            If ``state`` is not a :class:`DiskSourceState`.
        ValueError
            If ``state`` belongs to another source (another length, prefetch size or
            element spec), at trace time.
        """
        return self._compiled_next(state)

    def _next(self, state: DiskSourceState) -> tuple[PyTree, jax.Array, DiskSourceState]:
        check_state(state, DiskSourceState, self._length, self)
        buffer_spec = jax.tree_util.tree_map(lambda b: (tuple(b.shape), b.dtype), state.buffer)
        expected = jax.tree_util.tree_map(
            lambda s: ((self._prefetch_size, *s.shape), s.dtype), self._spec
        )
        if buffer_spec != expected:
            raise ValueError(
                f"{self!r}.next got the state of another source: its buffer is {buffer_spec}, "
                f"this source's is {expected}"
            )
        # Nothing reads the large fields before this conditional (no copies on XLA:CPU).
        stale = jnp.logical_or(
            state.buffer_start < 0, state.position >= state.buffer_start + self._prefetch_size
        )
        state = jax.lax.cond(stale, self._refill, lambda state: state, state)
        row = state.position - state.buffer_start
        sample = jax.tree_util.tree_map(
            lambda b: jax.lax.dynamic_index_in_dim(b, row, keepdims=False), state.buffer
        )
        position = state.position + 1
        epoch_ends = position >= self._length
        new_state = state.replace(
            position=jnp.where(epoch_ends, 0, position).astype(jnp.int32),
            epoch=state.epoch + epoch_ends.astype(jnp.int32),
            buffer_start=jnp.where(epoch_ends, -1, state.buffer_start).astype(jnp.int32),
            reshuffle=jnp.logical_or(state.reshuffle, epoch_ends),
        )
        return sample, jnp.ones([], jnp.bool_), new_state

    def __repr__(self) -> str:
        return (
            f"DiskSource(length={self._length}, ordering={self._ordering!r}, "
            f"prefetch_size={self._prefetch_size}, element_spec={self._spec})"
        )
