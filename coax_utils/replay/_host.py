"""Host-side (NumPy) replay buffers with preallocated ring storage.

The buffers are built in layers, one module each: the ring storage (:mod:`._ring`), its
checkpoint state (:mod:`._host_state`), replay folders (:mod:`._folders`) and, here, the two
buffer classes with their sampling rules.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from coax_utils._checks import check_float
from coax_utils.replay._folders import load_folder, save_folder
from coax_utils.replay._host_state import RingState, check_state_array
from coax_utils.replay._ring import check_ids
from coax_utils.replay._transition import TransitionBatch
from coax_utils.utils import SumTree

__all__ = ["PrioritizedReplayBuffer", "SimpleReplayBuffer"]


class _HostBuffer(RingState):
    """The ring storage with checkpoints and replay folders: the base of both buffers."""

    def save(self, path: str | os.PathLike) -> None:
        """Save the buffer to a folder of ``.npy`` files, atomically.

        Each storage array of :meth:`__checkpoint_state__` goes to its own ``leaf_<i>.npy``
        file (streamed from memory, no copy); the rest of the state (counters, episodes,
        priorities, the RNG state, the structure of the transitions) goes to ``meta.lz4``
        through :func:`coax_utils.utils.dump`, with the size and a checksum of every leaf
        (computed while the leaf is written). This is the format for large buffers (e.g.
        millions of Atari frames); for small ones, ``utils.dump(buffer, path)`` is simpler.

        The save is atomic and crash-safe: the files are written to a new folder beside
        ``path`` (same parent), flushed to disk (files and folder), then swapped in with two
        renames; the old folder is removed last. A process killed at any moment leaves a
        ``path`` that :meth:`load` reads as the complete old or the complete new buffer, and
        a later save removes what it left. The whole save holds a lock on ``path`` (the file
        ``.<name>.lock`` beside it): a concurrent save into the same folder, from this or
        another process, waits for it. Saving into the folder a buffer was loaded from keeps
        every transition, also when it was loaded memory-mapped (the old files are removed,
        never truncated).

        Parameters
        ----------
        path : str or os.PathLike
            The folder. Its parent is created if needed; an existing ``path`` must be a
            folder written by :meth:`save` (or empty), which is replaced.

        Raises
        ------
        ValueError
            If ``path`` exists and is not such a folder (nothing is written).
        TypeError
            If the transitions cannot be described as plain data (see
            :meth:`__checkpoint_state__`).
        """
        save_folder(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, mmap_mode: str | None = None) -> Any:
        """Load a buffer written by :meth:`save`.

        Nothing read is trusted. Before any array is read, every leaf file is opened and
        checked against the metadata: a regular file (not a link or a FIFO), its size in
        bytes, its bytes really on disk (a sparse file is refused, so a folder of a few KiB
        cannot make the load allocate gigabytes), its ``.npy`` header. Each leaf is then
        read once and must match its checksum, and the whole state is checked by
        :meth:`__checkpoint_restore__`. A save into ``path`` that runs meanwhile makes the
        load start again on the new folder.

        Parameters
        ----------
        path : str or os.PathLike
            The folder given to :meth:`save`.
        mmap_mode : {None, "c", "r"}, optional
            The default ``None`` reads the storage into memory: the buffer then depends on
            no file (the folder may change or go away afterwards). ``"c"`` memory-maps the
            leaf files copy-on-write (new transitions stay in memory, the files are never
            written) and ``"r"`` read-only (a buffer that can be sampled, not added to). The
            checksums are verified at load in every mode (reading each file once), but a
            mapped buffer keeps reading the files: **a change to a leaf file after the load
            (by another program; saves never change files in place) changes the stored
            transitions silently, and a truncated leaf kills the process with SIGBUS on the
            next sample.** Map only folders that nothing else writes to. Writing through to
            the files (numpy's ``"r+"``) is refused: it would change the saved storage
            without its metadata; call :meth:`save` to persist new transitions.

        Returns
        -------
        buffer
            A buffer of the saved class, continuing the saved RNG stream.

        Raises
        ------
        FileNotFoundError
            If ``path`` does not exist.
        ValueError
            If the folder is incomplete, does not hold a buffer of this class, holds a file
            that is not a regular file, a leaf that fails its size or checksum, or anything
            inconsistent; the message names the folder and the file.
        """
        return load_folder(cls, path, mmap_mode)


class SimpleReplayBuffer(_HostBuffer):
    r"""A ring buffer for experience replay, with uniform sampling.

    Transitions are kept in NumPy arrays preallocated on the first :meth:`add` (small leaves
    of the :class:`TransitionBatch` share one block of rows; larger ones have an array each);
    when the buffer is full the oldest transitions are overwritten. Every added transition
    gets an id (0, 1, 2, ... in insertion order), returned in the ``idx`` field of sampled
    batches.

    Unlike coax (which samples without replacement through Python's global ``random``), the
    buffer samples *with* replacement from its own seeded :class:`numpy.random.Generator`, so
    ``batch_size`` may exceed ``len(buffer)`` and global random state is never touched.

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    random_seed : int, optional
        Seed of the buffer's random number generator, for reproducible samples.

    Examples
    --------
    >>> import numpy as np
    >>> buffer = SimpleReplayBuffer(capacity=3, random_seed=0)
    >>> for t in range(5):
    ...     tr = TransitionBatch.from_single(s=t, a=0, logp=0.0, r=1.0, done=False, gamma=0.9)
    ...     buffer.add(tr)
    >>> len(buffer), sorted(int(tr.S[0]) for tr in buffer)
    (3, [2, 3, 4])
    >>> batch = buffer.sample(batch_size=8)
    >>> batch.batch_size, bool(np.all(batch.S == batch.idx))
    (8, True)
    """

    def add(
        self, transition_batch: TransitionBatch, Adv: Any = None, *, episode_end: Any = None
    ) -> None:
        """Add a batch of transitions.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions (any batch size; only the newest ``capacity`` rows are kept if it
            is larger than the buffer).
        Adv : array, optional
            Accepted for interface compatibility with :class:`PrioritizedReplayBuffer` and
            ignored.
        episode_end : bool or array of bool, optional
            Marks rows that are the last transition of their episode. Only
            :meth:`sample_sequences` uses it; without it the rows continue the current
            episode.

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a :class:`TransitionBatch`.
        ValueError
            If its structure, per-item shapes or dtypes differ from the stored transitions, its
            fields disagree on the batch size, or ``W`` is not one finite float >= 0 per
            transition. The buffer is unchanged.
        """
        self._add(transition_batch, None, episode_end)

    def sample(
        self, batch_size: int = 32, *, out: TransitionBatch | None = None
    ) -> TransitionBatch:
        """Sample a batch of transitions uniformly (with replacement).

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions.
        out : TransitionBatch, optional
            An earlier sample of the same size from this buffer whose arrays the new sample
            is written into (and which is returned): large batches (e.g. Atari frames) then
            skip the page faults of fresh memory. Only pass a batch that nothing else uses
            any more.

        Returns
        -------
        transitions : TransitionBatch
            Fresh arrays (not views of the storage) or those of ``out``, with ``idx`` set to
            the transition ids and ``W`` to the stored sample weights.

        Raises
        ------
        TypeError
            If ``out`` is not a :class:`TransitionBatch`.
        ValueError
            If the buffer is empty, ``batch_size`` is not positive, or ``out`` does not have
            the structure, shapes and dtypes of such a sample in writable arrays of its own.
            Nothing is drawn from the random stream.
        """
        batch_size = self._check_nonempty(batch_size)
        targets = self._check_out(out, batch_size)
        # floor(u * n) with 53-bit uniform u: uniform up to a bias of n / 2**53
        slots = (self._rng.random(batch_size) * len(self)).astype(np.int64)
        return self._gather(slots, out=targets)

    def __repr__(self) -> str:
        return f"SimpleReplayBuffer(capacity={self._capacity}, len={len(self)})"


class PrioritizedReplayBuffer(_HostBuffer):
    r"""A ring buffer for experience replay, with proportional prioritized sampling.

    Transitions are sampled with probability

    .. math::

        P(i)\ =\ \frac{p_i}{\sum_j p_j}\,,\qquad
        p_i\ =\ \left(|\mathcal{A}_i| + \epsilon\right)^\alpha

    where :math:`\mathcal{A}_i` are the advantages (typically TD errors) given to :meth:`add`
    or :meth:`update`. Sampled batches carry importance weights that undo the bias, normalised
    so that the largest weight in the batch is 1 (section 3.4 of
    https://arxiv.org/abs/1511.05952):

    .. math::

        w_i\ =\ \frac{\left(N\,P(i)\right)^{-\beta}}{\max_j \left(N\,P(j)\right)^{-\beta}}

    with :math:`N` the number of stored transitions; ``W`` of the sampled batch is the stored
    weight times :math:`w_i`. :math:`\alpha=0` gives uniform sampling. The priorities live in
    a :class:`coax_utils.utils.SumTree`; storage is as in :class:`SimpleReplayBuffer`.

    The buffer keeps :math:`|\mathcal{A}_i|` per slot, so changing ``alpha`` or ``epsilon``
    re-weights every stored transition (``beta`` only affects the weights). A transition added
    without advantages gets the largest :math:`|\mathcal{A}|` seen so far (1 before any was
    given).

    Parameters
    ----------
    capacity : int
        The maximum number of transitions.
    alpha : float, optional
        The priority exponent :math:`\alpha\ge0`.
    beta : float, optional
        The importance-weight exponent :math:`\beta\ge0` (typically annealed towards 1).
    epsilon : float, optional
        The regulator :math:`\epsilon>0` that keeps every priority positive.
    random_seed : int, optional
        Seed of the buffer's random number generator.

    Examples
    --------
    >>> import numpy as np
    >>> buffer = PrioritizedReplayBuffer(capacity=10, random_seed=0)
    >>> batch = TransitionBatch.from_single(s=0, a=0, logp=0.0, r=1.0, done=False, gamma=0.9)
    >>> buffer.add(TransitionBatch.concatenate(batch, batch), Adv=np.array([0.0, 3.0]))
    >>> sample = buffer.sample(batch_size=4)
    >>> sample.idx.shape, float(sample.W.max())
    ((4,), 1.0)
    >>> buffer.update(sample.idx, np.zeros(4))
    """

    def __init__(
        self,
        capacity: int,
        alpha: float = 1.0,
        beta: float = 1.0,
        epsilon: float = 1e-4,
        random_seed: int | None = None,
    ) -> None:
        self._alpha = self._check_exponent("alpha", alpha)
        self._beta = self._check_exponent("beta", beta)
        self._epsilon = self._check_epsilon(epsilon)
        super().__init__(capacity, random_seed)

    # -- hyperparameters -------------------------------------------------------------------

    @staticmethod
    def _check_exponent(name: str, value: Any) -> float:
        return check_float(value, name, low=0)

    @staticmethod
    def _check_epsilon(value: Any) -> float:
        return check_float(value, "epsilon", low=0, low_open=True)

    @property
    def alpha(self) -> float:
        """The priority exponent :math:`\\alpha` (settable; re-weights stored transitions).

        A value that makes a stored priority or their total overflow is refused
        (ValueError) and nothing changes."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        alpha = self._check_exponent("alpha", value)
        self._refresh_priorities(alpha, self._epsilon)
        self._alpha = alpha

    @property
    def beta(self) -> float:
        """The importance-weight exponent :math:`\\beta` (settable, e.g. from a schedule)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = self._check_exponent("beta", value)

    @property
    def epsilon(self) -> float:
        """The regulator :math:`\\epsilon` (settable; re-weights stored transitions, refused
        like :attr:`alpha` when a priority would overflow)."""
        return self._epsilon

    @epsilon.setter
    def epsilon(self, value: float) -> None:
        epsilon = self._check_epsilon(value)
        self._refresh_priorities(self._alpha, epsilon)
        self._epsilon = epsilon

    def _priority(self, abs_adv: np.ndarray, alpha: float, epsilon: float) -> np.ndarray:
        """``(|Adv| + epsilon) ** alpha``, checked finite (ValueError naming the value)."""
        with np.errstate(over="ignore"):
            p = np.power(abs_adv + epsilon, alpha)
        bad = ~np.isfinite(p)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(
                f"the priority (|Adv| + epsilon) ** alpha of |Adv| = {abs_adv[k]} overflows "
                f"(alpha={alpha}, epsilon={epsilon}); nothing was changed"
            )
        return p

    def _refresh_priorities(self, alpha: float, epsilon: float) -> None:
        slots = np.arange(len(self))
        self._tree.set_values(slots, self._priority(self._abs_adv[slots], alpha, epsilon))

    # -- core ------------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove all transitions and priorities (the RNG stream continues)."""
        super().clear()
        self._tree = SumTree(self._capacity)
        self._abs_adv = np.zeros(self._capacity, np.float64)
        self._max_abs_adv: float | None = None

    @staticmethod
    def _check_adv(Adv: Any, shape: tuple, what: str) -> np.ndarray:
        """``|Adv|`` as float64 of the given shape, all finite."""
        adv = np.asarray(Adv)
        if adv.dtype.kind not in "biuf":
            raise TypeError(f"Adv must be a numeric array, got dtype {adv.dtype}")
        if adv.shape != shape:
            raise ValueError(f"Adv must have shape {shape} (one per {what}), got {adv.shape}")
        adv = np.abs(adv.astype(np.float64))
        if not np.all(np.isfinite(adv)):
            raise ValueError(f"Adv must be finite (no NaN or inf), got {Adv!r}")
        return adv

    def _check_new_priorities(self, Adv: Any, batch_size: int) -> Any:
        if Adv is None:
            default = 1.0 if self._max_abs_adv is None else self._max_abs_adv
            abs_adv = np.full(batch_size, default)
        else:
            abs_adv = self._check_adv(Adv, (batch_size,), "transition")
        return abs_adv, self._priority(abs_adv, self._alpha, self._epsilon), Adv is not None

    def _set_new_priorities(self, slots: np.ndarray, priorities: Any, keep: slice) -> None:
        abs_adv, p, given = priorities
        abs_adv, p = abs_adv[keep], p[keep]
        self._tree.set_values(slots, p)  # refuses a total that overflows, changing nothing
        self._abs_adv[slots] = abs_adv
        if given and len(abs_adv):
            self._max_abs_adv = max(self._max_abs_adv or 0.0, float(abs_adv.max()))

    def add(
        self, transition_batch: TransitionBatch, Adv: Any = None, *, episode_end: Any = None
    ) -> None:
        """Add a batch of transitions with their advantages.

        Parameters
        ----------
        transition_batch : TransitionBatch
            The transitions.
        Adv : array of shape ``(batch_size,)``, optional
            Advantages (e.g. TD errors), of either sign: the priorities use
            :math:`|\\mathcal{A}|`, as in coax. Without it, the transitions get the largest
            :math:`|\\mathcal{A}|` seen so far.
        episode_end : bool or array of bool, optional
            Marks rows that end their episode (see :meth:`SimpleReplayBuffer.add`).

        Raises
        ------
        TypeError
            If ``transition_batch`` is not a :class:`TransitionBatch` or ``Adv`` is not
            numeric.
        ValueError
            If the batch does not match the stored transitions, ``Adv`` has the wrong shape
            or holds NaN or infinite values, or a priority or the total of the priorities
            would overflow. Every check runs before the first write: the buffer (storage,
            priorities, ids, RNG) is unchanged.
        """
        self._add(transition_batch, Adv, episode_end)

    def sample(
        self, batch_size: int = 32, *, out: TransitionBatch | None = None
    ) -> TransitionBatch:
        """Sample a batch of transitions in proportion to their priorities.

        Parameters
        ----------
        batch_size : int, optional
            The number of transitions (drawn with replacement).
        out : TransitionBatch, optional
            An earlier sample to write into, as in :meth:`SimpleReplayBuffer.sample`.

        Returns
        -------
        transitions : TransitionBatch
            With ``idx`` (pass it to :meth:`update`) and ``W`` (stored weights times the
            normalised importance weights).

        Raises
        ------
        TypeError, ValueError
            If the buffer is empty, ``batch_size`` is not positive or ``out`` does not fit
            (see :meth:`SimpleReplayBuffer.sample`); nothing is drawn.
        """
        batch_size = self._check_nonempty(batch_size)
        targets = self._check_out(out, batch_size)
        u = self._rng.random(batch_size)
        slots = np.asarray(self._tree.inverse_cdf(u), dtype=np.int64)
        return self._gather(slots, self._importance_weights(slots), targets)

    def _importance_weights(self, slots: np.ndarray) -> np.ndarray:
        """The importance weights of ``slots``, normalised by their largest."""
        prob = self._tree.values[slots] / self._tree.root_value
        W = np.power(len(self) * prob, -self._beta)
        W /= W.max()
        return W

    @property
    def total_priority(self) -> float:
        """The sum of the priorities of the stored transitions (0 when empty)."""
        return float(self._tree.root_value) if self._count else 0.0

    def priorities(self, idx: Any) -> np.ndarray:
        """The current priorities :math:`(|\\mathcal{A}| + \\epsilon)^\\alpha` of stored
        transitions.

        Parameters
        ----------
        idx : array of int, shape ``(k,)``
            Transition ids, the ``idx`` of a sampled batch.

        Returns
        -------
        priorities : float64 array, shape ``(k,)``

        Raises
        ------
        TypeError
            If ``idx`` is not integers.
        ValueError
            If an id is not held by the buffer (never issued, or overwritten since).
        """
        idx = check_ids(idx)
        slots = idx % self._capacity
        held = self._ids[slots] == idx
        if not held.all():
            raise ValueError(f"ids {idx[~held][:5].tolist()} are not held by the buffer")
        return np.asarray(self._tree.values[slots], np.float64)

    def update(self, idx: Any, Adv: Any) -> None:
        """Update the priorities of transitions sampled earlier.

        Ids of transitions that were overwritten since they were sampled are ignored (their
        slot now holds another transition), and so are ids the buffer has not issued yet, as
        in coax. With duplicate ids, the last value wins.

        Parameters
        ----------
        idx : array of int, shape ``(k,)``
            Transition ids, the ``idx`` of a sampled batch.
        Adv : array, shape ``(k,)``
            The new advantages (e.g. TD errors), of either sign: the priorities use
            :math:`|\\mathcal{A}|`.

        Raises
        ------
        TypeError
            If ``idx`` is not integers or ``Adv`` not numbers.
        ValueError
            If the shapes differ, an id is negative or beyond int64 (ids never wrap), ``Adv``
            holds NaN or infinite values, or a priority or their total would overflow.
            Nothing is changed.
        """
        idx = check_ids(idx)
        abs_adv = self._check_adv(Adv, idx.shape, "idx")
        p = self._priority(abs_adv, self._alpha, self._epsilon)
        slots = idx % self._capacity
        live = self._updatable(slots, idx)
        slots, abs_adv, p = slots[live], abs_adv[live], p[live]
        if slots.size:
            # last write wins for duplicates: keep the last occurrence of each slot
            rev_unique = np.unique(slots[::-1], return_index=True)[1]
            keep = len(slots) - 1 - rev_unique
            slots, abs_adv, p = slots[keep], abs_adv[keep], p[keep]
            self._tree.set_values(slots, p)  # refuses a total that overflows
            self._abs_adv[slots] = abs_adv
            self._max_abs_adv = max(self._max_abs_adv or 0.0, float(abs_adv.max()))

    def _updatable(self, slots: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Which ids ``idx`` (held in ``slots`` if anywhere) :meth:`update` sets."""
        return self._ids[slots] == idx

    # -- checkpoints -----------------------------------------------------------------------

    _STATE_KEYS = _HostBuffer._STATE_KEYS + (
        "alpha",
        "beta",
        "epsilon",
        "abs_adv",
        "max_abs_adv",
    )

    def _extra_state(self) -> dict[str, Any]:
        # the sum tree is rebuilt from abs_adv on restore, so it always agrees with it
        return {
            "alpha": self._alpha,
            "beta": self._beta,
            "epsilon": self._epsilon,
            "abs_adv": self._abs_adv,
            "max_abs_adv": self._max_abs_adv,
        }

    def _restore_extra(self, state: dict[str, Any]) -> None:
        name = type(self).__name__
        try:
            self._alpha = self._check_exponent("alpha", state["alpha"])
            self._beta = self._check_exponent("beta", state["beta"])
            self._epsilon = self._check_epsilon(state["epsilon"])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name} state: {e}") from None
        abs_adv = check_state_array(state, "abs_adv", name, np.float64, (self._capacity,))
        top = state["max_abs_adv"]
        if top is not None:
            try:
                top = check_float(top, "max_abs_adv (None or a float)", low=0)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name} state: {e}") from None
        n = len(self)
        bound = max(1.0 if top is None else top, 1.0)  # rows added without Adv get max(1, top)
        filled = abs_adv[:n]
        if not (np.all(np.isfinite(filled)) and np.all(filled >= 0) and np.all(filled <= bound)):
            raise ValueError(
                f"{name} state: abs_adv of stored transitions must be finite, >= 0 and at most "
                f"max(max_abs_adv, 1) = {bound}"
            )
        if np.any(abs_adv[n:] != 0):
            raise ValueError(f"{name} state: abs_adv must be 0 in empty slots")
        self._abs_adv, self._max_abs_adv = abs_adv, None if top is None else float(top)
        self._refresh_priorities(self._alpha, self._epsilon)

    def __repr__(self) -> str:
        return (
            f"PrioritizedReplayBuffer(capacity={self._capacity}, len={len(self)}, "
            f"alpha={self._alpha}, beta={self._beta}, epsilon={self._epsilon})"
        )
