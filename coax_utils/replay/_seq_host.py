r"""Host-side (NumPy) sequence replay buffers for recurrent agents.

Each sub-env of a vector env feeds its own chain; the chains cut the stream of steps into
windows (the rule is in :mod:`._seq_common`), which are stored whole in preallocated ring
storage together with the recurrent core state at their first step. Checkpoints:
:mod:`._seq_host_state`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_float
from coax_utils.replay._folders import load_folder, save_folder
from coax_utils.replay._ring import check_ids
from coax_utils.replay._seq_common import (
    END_TERMINATED,
    END_TRUNCATED,
    SequenceReplaySample,
    check_config,
    check_eta,
    loss_mask_np,
    mix_priorities_np,
)
from coax_utils.replay._seq_host_state import SequenceState
from coax_utils.utils import SumTree

__all__ = ["PrioritizedSequenceReplayBuffer", "SequenceReplayBuffer"]

_CAPACITY_MAX = 2**31 - 1


def _leaves(tree: Any, what: str, num_envs: int) -> tuple[list[np.ndarray], Any]:
    """The leaves of ``tree`` as arrays with a leading axis of ``num_envs`` (checked)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for x in leaves:
        x = np.asarray(x)
        if x.dtype.kind in "OVSUM":
            raise TypeError(f"{what} must hold arrays of numbers, got dtype {x.dtype}")
        if x.ndim == 0 or x.shape[0] != num_envs:
            raise ValueError(
                f"every leaf of {what} needs a leading axis of size num_envs={num_envs} (one "
                f"entry per sub-env), got shape {x.shape}"
            )
        out.append(x)
    return out, treedef


def _flags(x: Any, name: str, num_envs: int, default: bool) -> np.ndarray:
    if x is None:
        return np.full(num_envs, default)
    arr = np.asarray(x)
    if arr.dtype.kind not in "biu":
        raise TypeError(f"{name} must be bools, got dtype {arr.dtype}")
    if arr.ndim == 0:
        arr = np.broadcast_to(arr, (num_envs,))
    if arr.shape != (num_envs,):
        raise ValueError(f"{name} must have shape ({num_envs},) (one per sub-env), got {arr.shape}")
    return arr.astype(bool)


class SequenceReplayBuffer(SequenceState):
    r"""A ring buffer of sequences (windows of episodes) for recurrent agents, sampled
    uniformly.

    Steps are added one vector-env step at a time, one per sub-env; each sub-env has its own
    chain, so the steps of interleaved sub-envs form correct windows. Windows of ``length``
    steps start every ``period`` steps of an episode (overlapping when ``period < length``,
    as R2D2's 80-step sequences with period 40) and never cross an episode boundary: the
    last window of an episode is written even when shorter than ``length``, its tail
    masked and padded with its last valid step. Precisely, the windows of an episode of
    :math:`T` steps start at :math:`s = kP < T`; the one at :math:`s = 0` is always written,
    the others when the window before does not reach the end (:math:`s - P + L < T`), so
    every step lies in a window (for :math:`P \le L`) and no window lies inside another.

    With each window the buffer stores the recurrent core state given with its first step
    (any pytree of arrays, e.g. ``hk.LSTMState``), returned with the sample so a learner
    can unroll from it, burning in the first ``burn_in`` steps: the sample's ``loss_mask``
    leaves them out (except in a window that starts its episode, whose stored state is
    exact). With ``period = length - burn_in`` the loss steps tile every episode.

    Each item is one window (``capacity`` windows are kept, the oldest overwritten); its
    steps are stored whole, so sampling costs the same whatever the buffer holds.

    Parameters
    ----------
    capacity : int
        The number of windows held.
    length : int
        The window length :math:`L` (``burn_in`` included).
    period : int, optional
        The number of steps :math:`P` between the starts of two windows (default ``length``).
    burn_in : int, optional
        The steps at the start of a window that only warm up the core state, in
        ``[0, length)``.
    num_envs : int, optional
        The number of sub-envs (chains); every :meth:`add` gives one step of each.
    random_seed : int, optional
        Seed of the buffer's :class:`numpy.random.Generator`.

    Examples
    --------
    >>> import numpy as np
    >>> buffer = SequenceReplayBuffer(capacity=8, length=4, period=2, num_envs=2, random_seed=0)
    >>> for t in range(6):  # sub-env 0's episode ends (terminates) after 5 steps
    ...     buffer.add({"t": np.array([t, 100 + t])}, core_state=np.array([t, t]),
    ...                terminated=np.array([t == 4, False]))
    >>> len(buffer)  # sub-env 0: windows at 0, 2 (4 valid steps: 2..4); sub-env 1: 0, 2
    4
    >>> batch = buffer.sample(16)
    >>> batch.items["t"].shape, batch.mask.shape, batch.core_state.shape
    ((16, 4), (16, 4), (16,))
    """

    def __init__(
        self,
        capacity: int,
        length: int,
        period: int | None = None,
        burn_in: int = 0,
        num_envs: int = 1,
        random_seed: int | None = None,
    ) -> None:
        config = check_config(length, period, burn_in, num_envs, capacity, _CAPACITY_MAX)
        self._capacity, self._length, self._period, self._burn_in, self._num_envs = config
        self._rng = np.random.default_rng(random_seed)
        self.clear()

    # -- properties ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The maximum number of windows held."""
        return self._capacity

    @property
    def length(self) -> int:
        """The window length (``burn_in`` included)."""
        return self._length

    @property
    def period(self) -> int:
        """The number of steps between the starts of two windows of an episode."""
        return self._period

    @property
    def burn_in(self) -> int:
        """The number of steps at the start of a window left out of ``loss_mask``."""
        return self._burn_in

    @property
    def num_envs(self) -> int:
        """The number of sub-envs (chains)."""
        return self._num_envs

    def __len__(self) -> int:
        return min(self._count, self._capacity)

    def __bool__(self) -> bool:
        return self._count > 0

    def clear(self) -> None:
        """Remove every window and restart every chain (the RNG stream continues)."""
        self._steps: list[np.ndarray] | None = None
        self._step_def: Any = None
        self._core: list[np.ndarray] | None = None
        self._core_def: Any = None
        self._pending: list[np.ndarray] | None = None  # per leaf: (num_envs, length, ...)
        self._pending_core: list[np.ndarray] | None = None
        self._n = np.zeros(self._num_envs, np.int64)  # steps in the current window (< 0: skip)
        self._first = np.ones(self._num_envs, bool)  # the current window starts its episode
        self._count = 0
        self._ids = np.full(self._capacity, -1, np.int64)
        self._seq_len = np.zeros(self._capacity, np.int32)
        self._seq_end = np.zeros(self._capacity, np.int8)
        self._seq_first = np.zeros(self._capacity, bool)
        self._clear_priorities()

    def _clear_priorities(self) -> None:
        pass

    # -- adding ----------------------------------------------------------------------------

    def _check_step(self, steps: Any, core_state: Any) -> tuple[list, Any, list, Any]:
        E = self._num_envs
        leaves, step_def = _leaves(steps, "steps", E)
        if not leaves:
            raise ValueError("steps must hold at least one array")
        core, core_def = _leaves(core_state, "core_state", E)
        if self._steps is not None:
            for what, got, want, xs, stored in (
                ("steps", step_def, self._step_def, leaves, self._pending),
                ("core_state", core_def, self._core_def, core, self._pending_core),
            ):
                if got != want:
                    raise ValueError(
                        f"{what} differ in structure from those the buffer holds: expected "
                        f"{want}, got {got}"
                    )
                for x, s in zip(xs, stored):
                    if x.shape[1:] != s.shape[2:] or x.dtype != s.dtype:
                        raise ValueError(
                            f"{what} have a leaf of per-env shape {x.shape[1:]} and dtype "
                            f"{x.dtype}; the buffer holds shape {s.shape[2:]} and dtype "
                            f"{s.dtype}"
                        )
        return leaves, step_def, core, core_def

    def _allocate(self, leaves: list, step_def: Any, core: list, core_def: Any) -> None:
        C, L, E = self._capacity, self._length, self._num_envs
        self._steps = [np.zeros((C, L) + x.shape[1:], x.dtype) for x in leaves]
        self._pending = [np.zeros((E, L) + x.shape[1:], x.dtype) for x in leaves]
        self._core = [np.zeros((C,) + x.shape[1:], x.dtype) for x in core]
        self._pending_core = [np.zeros((E, L) + x.shape[1:], x.dtype) for x in core]
        self._step_def, self._core_def = step_def, core_def

    def add(
        self,
        steps: Any,
        core_state: Any = None,
        terminated: Any = None,
        truncated: Any = None,
        active: Any = None,
    ) -> None:
        """Add one step of every sub-env.

        Parameters
        ----------
        steps : pytree of arrays
            The steps (e.g. ``{"obs": ..., "action": ..., "reward": ...}``), every leaf with
            a leading axis of size ``num_envs``. Structure, per-env shapes and dtypes must
            stay those of the first call.
        core_state : pytree of arrays, optional
            The recurrent core state the agent held before this step (the state it acted
            from), leaves with a leading axis of size ``num_envs``; stored with the windows
            that start at this step. Its structure must stay that of the first call (None:
            no core state).
        terminated, truncated : bool array of shape ``(num_envs,)``, optional
            Whether this step ended its sub-env's episode by termination or by truncation
            (a time limit). Default: no episode ends.
        active : bool array of shape ``(num_envs,)``, optional
            Which sub-envs took a step (default all). A sub-env that only reset (the step
            after an episode end of a gymnasium vector env in ``NEXT_STEP`` autoreset mode)
            is inactive: its chain is left unchanged.

        Raises
        ------
        TypeError
            If a leaf is not numeric or a flag not bool.
        ValueError
            If a leaf lacks the leading ``num_envs`` axis, the structure, shapes or dtypes of
            ``steps`` or ``core_state`` differ from those held, or a flag array has the
            wrong shape. Every check runs before anything is written: the buffer is
            unchanged.
        """
        E, L, P = self._num_envs, self._length, self._period
        leaves, step_def, core, core_def = self._check_step(steps, core_state)
        term = _flags(terminated, "terminated", E, False)
        trunc = _flags(truncated, "truncated", E, False)
        act = _flags(active, "active", E, True)
        # every check done: write
        if self._steps is None:
            self._allocate(leaves, step_def, core, core_def)
        n = self._n
        take = np.flatnonzero(act & (n >= 0))
        for pend, x in zip(self._pending + self._pending_core, leaves + core):
            pend[take, n[take]] = x[take]
        n += act
        full = act & (n == L)
        ended = act & (term | trunc)
        # the window before a partial one ended at an earlier step: it is always needed
        partial = ended & ~full & (n > 0)
        envs = np.flatnonzero(full | partial)
        if len(envs):
            ends = np.where(term, END_TERMINATED, np.where(trunc, END_TRUNCATED, 0))
            self._write(envs, np.where(full, L, n)[envs], (ends * ended)[envs])
        if P < L and full.any():
            shift = np.flatnonzero(full)
            for pend in self._pending + self._pending_core:
                pend[shift, : L - P] = pend[shift, P:]
        n[full] = L - P
        self._first[full] = False
        n[ended] = 0
        self._first[ended] = True

    def reset_chains(self, mask: Any = None) -> None:
        """Start new episodes in the chains of ``mask`` (bool, one per sub-env; default
        all), e.g. after a reset of those sub-envs in the middle of an episode: the steps
        of their current windows that no written window holds are dropped.

        Raises
        ------
        TypeError, ValueError
            If ``mask`` is not bools of shape ``(num_envs,)``; nothing changes.
        """
        mask = _flags(mask, "mask", self._num_envs, True)
        self._n[mask] = 0
        self._first[mask] = True

    def _write(self, envs: np.ndarray, lengths: np.ndarray, ends: np.ndarray) -> None:
        """Store the current windows of the chains ``envs``."""
        k = len(envs)
        ids = self._count + np.arange(k, dtype=np.int64)
        slots = ids % self._capacity
        self._set_new_priorities(slots)
        for arr, pend in zip(self._steps, self._pending):
            arr[slots] = pend[envs]
        for arr, pend in zip(self._core, self._pending_core):
            arr[slots] = pend[envs, 0]
        self._ids[slots] = ids
        self._seq_len[slots] = lengths
        self._seq_end[slots] = ends
        self._seq_first[slots] = self._first[envs]
        self._count += k

    def _set_new_priorities(self, slots: np.ndarray) -> None:
        pass

    # -- sampling --------------------------------------------------------------------------

    def _check_batch_size(self, batch_size: Any) -> int:
        from coax_utils._checks import check_int

        batch_size = check_int(batch_size, "batch_size", low=1)
        if not self._count:
            raise ValueError("cannot sample from an empty buffer: no window was written yet")
        return batch_size

    def sample(self, batch_size: int = 32) -> SequenceReplaySample:
        """Sample ``batch_size`` windows uniformly, with replacement.

        Returns
        -------
        sample : SequenceReplaySample
            Fresh arrays; ``indices`` are the window ids, ``weights`` all 1.

        Raises
        ------
        TypeError, ValueError
            If ``batch_size`` is not a positive int or no window was written yet; nothing
            is drawn from the random stream.
        """
        batch_size = self._check_batch_size(batch_size)
        slots = (self._rng.random(batch_size) * len(self)).astype(np.int64)
        return self._gather(slots, np.ones(batch_size, np.float32))

    def _gather(self, slots: np.ndarray, weights: np.ndarray) -> SequenceReplaySample:
        L = self._length
        lengths = self._seq_len[slots]
        t = np.arange(L)
        items = [np.take(arr, slots, axis=0) for arr in self._steps]  # whole windows
        short = np.flatnonzero(lengths < L)
        if len(short):  # pad the tails with the last valid step
            src = np.minimum(t, lengths[short, None] - 1)
            for x in items:
                x[short] = x[short[:, None], src]
        core = [np.take(arr, slots, axis=0) for arr in self._core]
        end = self._seq_end[slots][:, None]
        last = t == lengths[:, None] - 1
        return SequenceReplaySample(
            items=self._step_def.unflatten(items),
            core_state=self._core_def.unflatten(core),
            mask=t < lengths[:, None],
            loss_mask=loss_mask_np(lengths, self._seq_first[slots], L, self._burn_in),
            terminated=last & (end == END_TERMINATED),
            truncated=last & (end == END_TRUNCATED),
            indices=self._ids[slots],
            weights=weights.astype(np.float32),
        )

    # -- replay folders ----------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Save the buffer to a folder, atomically, as the transition buffers' ``save``:
        every storage array (windows, core states, the chains' current windows) in a
        ``.npy`` file of its own with its checksum, the rest in ``meta.lz4``; a kill at any
        moment leaves the old or the new folder.

        Raises
        ------
        ValueError
            If ``path`` exists and is not a folder written by ``save`` (nothing is written).
        """
        save_folder(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, mmap_mode: str | None = None) -> Any:
        """Load a buffer written by :meth:`save`, checking every file and the restored state
        (as :meth:`SimpleReplayBuffer.load`; ``mmap_mode`` ``"c"`` maps the files
        copy-on-write, ``"r"`` reads them into memory here, as the buffer writes into its
        storage). The RNG stream and the chains continue."""
        return load_folder(cls, path, mmap_mode)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, length={self._length}, "
            f"period={self._period}, burn_in={self._burn_in}, num_envs={self._num_envs}, "
            f"len={len(self)})"
        )


class PrioritizedSequenceReplayBuffer(SequenceReplayBuffer):
    r"""A sequence replay buffer with R2D2's prioritized sampling.

    Windows are sampled with probability :math:`P(i) = p_i / \sum_j p_j`, with

    .. math::

        p_i\ =\ \left(\eta\,\max_t|\delta_{i,t}| + (1 - \eta)\,\overline{|\delta_{i,t}|}
            + \epsilon\right)^\alpha

    over the steps :math:`t` of the window's ``loss_mask`` (R2D2's mixture of the largest
    and the mean absolute TD error), set by :meth:`update`. A new window gets the largest
    mixture set so far, or 1 if that is larger (as the jittable twin). Samples carry the
    importance weights of the transition buffers, :math:`(N P(i))^{-\beta}` normalised to
    a batch maximum of 1.
    Windowing, storage and :meth:`~SequenceReplayBuffer.add` are those of
    :class:`SequenceReplayBuffer`.

    Parameters
    ----------
    capacity, length, period, burn_in, num_envs, random_seed
        As in :class:`SequenceReplayBuffer`.
    alpha : float, optional
        The priority exponent :math:`\alpha\ge0` (R2D2: 0.9).
    beta : float, optional
        The importance-weight exponent :math:`\beta\ge0` (R2D2: 0.6).
    epsilon : float, optional
        The regulator :math:`\epsilon>0`.
    eta : float, optional
        The weight :math:`\eta\in[0,1]` of the maximum in the mixture (R2D2: 0.9).
    """

    def __init__(
        self,
        capacity: int,
        length: int,
        period: int | None = None,
        burn_in: int = 0,
        num_envs: int = 1,
        alpha: float = 0.9,
        beta: float = 0.6,
        epsilon: float = 1e-4,
        eta: float = 0.9,
        random_seed: int | None = None,
    ) -> None:
        self._alpha = check_float(alpha, "alpha", low=0)
        self._beta = check_float(beta, "beta", low=0)
        self._epsilon = check_float(epsilon, "epsilon", low=0, low_open=True)
        self._eta = check_eta(eta)
        super().__init__(capacity, length, period, burn_in, num_envs, random_seed)

    @property
    def alpha(self) -> float:
        """The priority exponent."""
        return self._alpha

    @property
    def beta(self) -> float:
        """The importance-weight exponent (settable, e.g. from a schedule)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = check_float(value, "beta", low=0)

    @property
    def epsilon(self) -> float:
        """The regulator added to the mixture."""
        return self._epsilon

    @property
    def eta(self) -> float:
        """The weight of the maximum in R2D2's mixture."""
        return self._eta

    def _clear_priorities(self) -> None:
        self._tree = SumTree(self._capacity)
        self._abs_mix = np.zeros(self._capacity, np.float64)
        self._max_abs_mix = 1.0  # given to new windows; never lowered

    def _priority(self, mix: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            p = np.power(mix + self._epsilon, self._alpha)
        if not np.all(np.isfinite(p)):
            raise ValueError(f"a priority overflows (mixture {mix.max()}); nothing was changed")
        return p

    def _set_new_priorities(self, slots: np.ndarray) -> None:
        mix = self._max_abs_mix
        self._tree.set_values(slots, self._priority(np.full(len(slots), mix)))
        self._abs_mix[slots] = mix

    def sample(self, batch_size: int = 32) -> SequenceReplaySample:
        """Sample ``batch_size`` windows in proportion to their priorities (with replacement).

        Returns
        -------
        sample : SequenceReplaySample
            With ``indices`` (window ids, for :meth:`update`) and importance ``weights``.

        Raises
        ------
        TypeError, ValueError
            As :meth:`SequenceReplayBuffer.sample`.
        """
        batch_size = self._check_batch_size(batch_size)
        slots = np.asarray(self._tree.inverse_cdf(self._rng.random(batch_size)), np.int64)
        prob = self._tree.values[slots] / self._tree.root_value
        w = np.power(len(self) * prob, -self._beta)
        return self._gather(slots, w / w.max())

    def priorities(self, indices: Any) -> np.ndarray:
        """The current priorities of held windows (ids of a sample); ValueError for an id
        not held."""
        idx = check_ids(indices)
        slots = idx % self._capacity
        held = self._ids[slots] == idx
        if not held.all():
            raise ValueError(f"ids {idx[~held][:5].tolist()} are not held by the buffer")
        return np.asarray(self._tree.values[slots], np.float64)

    def update(self, indices: Any, td_errors: Any, mask: Any = None) -> None:
        """Set the priorities of windows sampled earlier from their per-step TD errors.

        The mixture runs over the steps of each window's ``loss_mask`` (and of ``mask`` if
        given). Ids of windows overwritten since they were sampled are ignored (the ids are
        never reused); with duplicate ids the last one wins.

        Parameters
        ----------
        indices : int array, shape ``(k,)``
            The ``indices`` of a sample.
        td_errors : float array, shape ``(k, length)``
            The TD errors per step (either sign).
        mask : bool array, shape ``(k, length)``, optional
            The steps the TD errors hold (e.g. without a window's last step, if the learner
            has no target for it).

        Raises
        ------
        TypeError
            If ``indices`` are not ints, ``td_errors`` not numbers or ``mask`` not bools.
        ValueError
            If the shapes are wrong, an id is negative, a TD error NaN or infinite, or a
            priority would overflow. Nothing is changed.
        """
        idx = check_ids(indices)
        shape = (len(idx), self._length)
        td = np.asarray(td_errors)
        if td.dtype.kind not in "biuf":
            raise TypeError(f"td_errors must be numbers, got dtype {td.dtype}")
        if td.shape != shape:
            raise ValueError(
                f"td_errors must have shape {shape} (one per step of each window), got {td.shape}"
            )
        td = td.astype(np.float64)
        if not np.all(np.isfinite(td)):
            raise ValueError("td_errors must be finite (no NaN or inf)")
        counted = np.ones(shape, bool)
        if mask is not None:
            m = np.asarray(mask)
            if m.dtype != bool:
                raise TypeError(f"mask must be bools, got dtype {m.dtype}")
            if m.shape != shape:
                raise ValueError(f"mask must have shape {shape}, got {m.shape}")
            counted = m
        slots = idx % self._capacity
        counted = counted & loss_mask_np(
            self._seq_len[slots], self._seq_first[slots], self._length, self._burn_in
        )
        mix = mix_priorities_np(td, counted, self._eta)
        p = self._priority(mix)
        live = self._ids[slots] == idx
        slots, mix, p = slots[live], mix[live], p[live]
        if not len(slots):
            return
        keep = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]
        slots, mix, p = slots[keep], mix[keep], p[keep]
        self._tree.set_values(slots, p)  # refuses a total that overflows, changing nothing
        self._abs_mix[slots] = mix
        self._max_abs_mix = max(self._max_abs_mix, float(mix.max()))
