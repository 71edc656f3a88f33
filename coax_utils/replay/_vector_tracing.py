"""Vector tracers: one n-step or Monte Carlo chain per sub-env of a vector env, in NumPy.

A vector tracer takes one whole vector-env step per :meth:`add` (arrays with a leading
sub-env axis) and keeps every sub-env's steps in preallocated ring buffers, so adding and
popping cost a fixed number of NumPy operations over the sub-env axis, not a Python loop per
sub-env. The rows it pops equal those of one :class:`NStep` (or :class:`MonteCarlo`) per
sub-env fed the same steps.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_int
from coax_utils.replay._tracing import EpisodeDoneError, InsufficientCacheError
from coax_utils.replay._transition import TransitionBatch

__all__ = ["VectorMonteCarlo", "VectorNStep"]

_MAX_N = 1 << 20
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _gamma(gamma: Any) -> float:
    if isinstance(gamma, (bool, str)) or np.ndim(gamma) != 0:
        raise TypeError(f"gamma must be a float in [0, 1], got {gamma!r}")
    if np.asarray(gamma).dtype.kind not in "iuf":
        raise TypeError(f"gamma must be a float in [0, 1], got {gamma!r}")
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma!r}")
    return float(gamma)


def _shape_error(name: str, what: str, num_envs: int, shape: tuple) -> ValueError:
    return ValueError(
        f"{name} must be one {what} or one per sub-env (shape ({num_envs},)), got shape {shape}"
    )


def _numbers(x: Any, name: str, num_envs: int, dtype: Any) -> np.ndarray:
    """``x`` (one number, or one per sub-env) as finite ``dtype`` numbers of shape (num_envs,)."""
    if type(x) is float and math.isfinite(x) and abs(x) < _FLOAT32_MAX:  # a default
        return np.full(num_envs, x, dtype)
    arr = np.asarray(x)
    if arr.dtype.kind in "OSUcMm":
        raise TypeError(f"{name} must hold real numbers, got {x!r:.80}")
    if arr.shape != (num_envs,):
        if arr.ndim != 0:
            raise _shape_error(name, "number", num_envs, arr.shape)
        arr = np.full(num_envs, arr)
    if arr.dtype == dtype:
        out = arr
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(dtype)
    if not np.isfinite(out).all():
        bad = ~np.isfinite(out)
        raise ValueError(
            f"{name} must be finite (as a {np.dtype(dtype).name}); sub-envs "
            f"{np.flatnonzero(bad).tolist()} got {arr[bad].tolist()}"
        )
    return out


def _flags(x: Any, name: str, num_envs: int) -> np.ndarray:
    """``x`` (one flag or one per sub-env; bools, or numbers that are 0 or 1) as bools."""
    arr = np.asarray(x)
    if arr.dtype.kind != "b":
        if arr.dtype.kind not in "iuf" or not ((arr == 0) | (arr == 1)).all():
            raise TypeError(f"{name} must hold bools (or numbers that are 0 or 1), got {x!r:.80}")
        arr = arr.astype(bool)
    if arr.shape != (num_envs,):
        if arr.ndim != 0:
            raise _shape_error(name, "flag", num_envs, arr.shape)
        arr = np.full(num_envs, arr)
    return arr


def _leaves(tree: Any, name: str, num_envs: int) -> tuple[list[np.ndarray], Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for x in leaves:
        x = np.asarray(x)
        if x.shape[:1] != (num_envs,):
            raise ValueError(
                f"every leaf of {name} needs a leading sub-env axis of {num_envs}, got shape "
                f"{x.shape}"
            )
        out.append(x)
    return out, treedef


class _VectorTracer(abc.ABC):
    """The ring buffers and episode flags shared by the vector tracers."""

    gamma: float
    num_envs: int

    def __init__(self, gamma: float, num_envs: int) -> None:
        self.gamma = _gamma(gamma)
        self.num_envs = check_int(num_envs, "num_envs", low=1)
        self._all = np.arange(self.num_envs)
        self.reset()

    def reset(self, mask: Any = None) -> None:
        """Empty the tracer and forget the current episodes: of every sub-env, or only of the
        sub-envs where the bool array ``mask`` (shape ``(num_envs,)``) is True."""
        E = self.num_envs
        if mask is None:
            self._cap = self._initial_capacity()
            self._s: list[np.ndarray] | None = None  # set by the first add
            self._count = np.zeros(E, np.int64)
            self._start = np.zeros(E, np.int64)
            self._terminated = np.zeros(E, bool)
            self._truncated = np.zeros(E, bool)
            return
        mask = _flags(mask, "mask", E)
        self._count[mask] = 0
        self._start[mask] = 0
        self._terminated[mask] = False
        self._truncated[mask] = False

    def _initial_capacity(self) -> int:
        return 64

    @property
    def counts(self) -> np.ndarray:
        """The number of steps held per sub-env (a copy)."""
        return self._count.copy()

    def __len__(self) -> int:
        """The number of steps held, all sub-envs together."""
        return int(self._count.sum())

    @abc.abstractmethod
    def _available(self) -> np.ndarray:
        """Per sub-env, whether a transition can be popped."""

    def __bool__(self) -> bool:
        return bool(self._available().any())

    def _allocate(self, s: list, a: list) -> None:
        E, cap = self.num_envs, self._cap
        self._s = [np.zeros((E, cap) + x.shape[1:], x.dtype) for x in s]
        self._a = [np.zeros((E, cap) + x.shape[1:], x.dtype) for x in a]
        self._r = np.zeros((E, cap), np.float64)
        self._logp = np.zeros((E, cap), np.float32)
        self._w = np.zeros((E, cap), np.float32)
        self._final_s = [np.zeros((E,) + x.shape[1:], x.dtype) for x in s]
        self._final_a = [np.zeros((E,) + x.shape[1:], x.dtype) for x in a]
        self._final_logp = np.zeros(E, np.float32)

    def _check_like(self, leaves: list, stored: list, treedef: Any, own: Any, name: str) -> None:
        if treedef != own:
            raise ValueError(f"{name} has the structure {treedef}, the tracer holds {own}")
        for x, b in zip(leaves, stored):
            if x.shape[1:] != b.shape[2:]:
                raise ValueError(
                    f"{name} has a leaf of per-sub-env shape {x.shape[1:]}, the tracer holds "
                    f"{b.shape[2:]}"
                )
            if x.dtype != b.dtype:
                raise TypeError(f"{name} has a leaf of dtype {x.dtype}, the tracer holds {b.dtype}")

    def _grow(self) -> None:
        """Double the ring capacity, unrolling every sub-env's steps to start at slot 0."""
        E, cap = self.num_envs, self._cap
        order = (self._start[:, None] + np.arange(cap)[None]) % cap
        rows = np.arange(E)[:, None]

        def grown(b: np.ndarray) -> np.ndarray:
            new = np.zeros((E, 2 * cap) + b.shape[2:], b.dtype)
            new[:, :cap] = b[rows, order]
            return new

        self._s = [grown(b) for b in self._s]
        self._a = [grown(b) for b in self._a]
        self._r, self._logp, self._w = grown(self._r), grown(self._logp), grown(self._w)
        self._start[:] = 0
        self._cap = 2 * cap

    def add(
        self,
        s: Any,
        a: Any,
        r: Any,
        done: Any,
        logp: Any = 0.0,
        w: Any = 1.0,
        *,
        truncated: Any = False,
        s_next: Any = None,
        active: Any = None,
    ) -> None:
        r"""Add one step of every sub-env (a whole vector-env step).

        Parameters
        ----------
        s : pytree of arrays
            The states :math:`S_t`, each leaf with a leading axis of ``num_envs``.
        a : pytree of arrays
            The actions :math:`A_t`, likewise.
        r : array
            The rewards, shape ``(num_envs,)``.
        done : array of bool
            Whether each sub-env's episode *terminated* after this step.
        logp, w : float or array, optional
            Log-propensities and sample weights (one number for all, or one per sub-env).
        truncated : bool or array of bool, optional
            Whether each sub-env's episode was *truncated* (termination wins if both).
        s_next : pytree of arrays, optional
            The observations that follow this step (at an episode end the *final* one, not
            the first of the next episode). Required when a sub-env is truncated: it is the
            state to bootstrap from.
        active : array of bool, optional
            The sub-envs that took a real step (default all). A sub-env that only reset (the
            step after an episode end under gymnasium's next-step autoreset) is left out.

        Every array is copied into the tracer's own buffers. An active sub-env whose episode
        ended starts a new one, once its transitions were popped.

        Raises
        ------
        EpisodeDoneError
            If an active sub-env's episode ended and the tracer still holds its transitions.
        TypeError, ValueError
            For arrays of the wrong kind or shape, non-finite rewards, log-propensities or
            weights, a structure or dtype other than that of the steps held, or a truncation
            without ``s_next``. A rejected step changes nothing.
        """
        E = self.num_envs
        all_active = active is None
        if not all_active:
            active = _flags(active, "active", E)
            all_active = bool(active.all())
        r = _numbers(r, "r", E, np.float64)
        logp = _numbers(logp, "logp", E, np.float32)
        w = _numbers(w, "w", E, np.float32)
        done = _flags(done, "done", E)
        truncated = _flags(truncated, "truncated", E) & ~done
        if not all_active:
            done, truncated = done & active, truncated & active
        ended = self._terminated | self._truncated
        bad = ended & (self._count > 0)
        if not all_active:
            bad &= active
        if bad.any():
            raise EpisodeDoneError(
                f"the episodes of sub-envs {np.flatnonzero(bad).tolist()} already ended; pop() "
                "their remaining transitions before adding steps of new episodes"
            )
        s_leaves, s_def = _leaves(s, "s", E)
        a_leaves, a_def = _leaves(a, "a", E)
        if self._s is not None:
            self._check_like(s_leaves, self._s, s_def, self._s_def, "s")
            self._check_like(a_leaves, self._a, a_def, self._a_def, "a")
        trunc_rows = np.flatnonzero(truncated)
        if trunc_rows.size:
            if s_next is None:
                raise ValueError(
                    f"sub-envs {trunc_rows.tolist()} were truncated: pass s_next, the state to "
                    "bootstrap from"
                )
            next_leaves, next_def = _leaves(s_next, "s_next", E)
            if next_def != s_def or any(
                x.shape[1:] != y.shape[1:] for x, y in zip(next_leaves, s_leaves)
            ):
                raise ValueError("s_next must have the structure and shapes of s")
        # every check passed: from here on nothing raises
        if self._s is None:
            self._allocate(s_leaves, a_leaves)
            self._s_def, self._a_def = s_def, a_def
        if ended.any():  # active sub-envs whose ended episode was popped start a new one
            restart = ended if all_active else ended & active
            self._terminated[restart] = False
            self._truncated[restart] = False
            self._start[restart] = 0
        if all_active:
            rows = self._all
            values = [*s_leaves, *a_leaves, r, logp, w]
            if self._count.max() >= self._cap:
                self._grow()
            pos = (self._start + self._count) % self._cap
            self._count += 1
        else:
            rows = np.flatnonzero(active)
            if rows.size == 0:
                return
            values = [x[rows] for x in (*s_leaves, *a_leaves, r, logp, w)]
            if self._count[rows].max() >= self._cap:
                self._grow()
            pos = (self._start[rows] + self._count[rows]) % self._cap
            self._count[rows] += 1
        for b, x in zip([*self._s, *self._a, self._r, self._logp, self._w], values):
            b[rows, pos] = x
        self._terminated |= done
        self._truncated |= truncated
        if trunc_rows.size:
            # the action at S_next was never taken; the last action is a placeholder
            for b, x in zip(self._final_s, next_leaves):
                b[trunc_rows] = x[trunc_rows]
            for b, x in zip(self._final_a, a_leaves):
                b[trunc_rows] = x[trunc_rows]
            self._final_logp[trunc_rows] = logp[trunc_rows]

    def _rows(self, avail: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For ``avail`` rows per sub-env: the sub-env and step offset of every row."""
        env = np.repeat(np.arange(self.num_envs), avail)
        offset = np.arange(env.size) - np.repeat(np.cumsum(avail) - avail, avail)
        return env, offset

    def _gather(self, bufs: list[np.ndarray], env: np.ndarray, pos: np.ndarray) -> list:
        return [b[env, pos] for b in bufs]

    def _batch(
        self,
        env: np.ndarray,
        pos: np.ndarray,
        returns: np.ndarray,
        factor: np.ndarray,
        next_pos: np.ndarray,
        final: np.ndarray | None,
    ) -> TransitionBatch:
        """The popped rows: the step of sub-env ``env`` at slot ``pos`` with its return and
        bootstrap factor; ``S_next``, ``A_next`` and ``logP_next`` from slot ``next_pos``
        (``pos`` itself for the placeholders after a termination), or from the final
        observation where the bool mask ``final`` is True (after a truncation)."""
        with np.errstate(over="ignore"):
            rn = returns.astype(np.float32)
        if not np.isfinite(rn).all():
            raise ValueError(
                f"a discounted return overflows float32 (sub-envs "
                f"{np.unique(env[~np.isfinite(rn)]).tolist()}); nothing was popped"
            )
        S_next = self._gather(self._s, env, next_pos)
        A_next = self._gather(self._a, env, next_pos)
        logp_next = self._logp[env, next_pos]
        if final is not None and final.any():
            e = env[final]
            for out, b in zip(S_next, self._final_s):
                out[final] = b[e]
            for out, b in zip(A_next, self._final_a):
                out[final] = b[e]
            logp_next[final] = self._final_logp[e]
        return TransitionBatch(
            S=self._s_def.unflatten(self._gather(self._s, env, pos)),
            A=self._a_def.unflatten(self._gather(self._a, env, pos)),
            logP=self._logp[env, pos],
            Rn=rn,
            In=factor.astype(np.float32),
            S_next=self._s_def.unflatten(S_next),
            A_next=self._a_def.unflatten(A_next),
            logP_next=logp_next,
            W=self._w[env, pos],
        )

    @abc.abstractmethod
    def pop(self, return_envs: bool = False) -> Any:
        """Pop every available transition."""

    def flush(self) -> TransitionBatch:
        """Pop every available transition (the same as :meth:`pop`)."""
        return self.pop()


class VectorNStep(_VectorTracer):
    r"""An :class:`NStep` tracer for a vector env: one chain per sub-env, fed a whole
    vector-env step per :meth:`add`.

    ``NStep(n, gamma, num_envs=k)`` returns one. Each :meth:`pop` returns every transition
    that is complete, of all sub-envs at once, ordered by sub-env and then by time: exactly
    the rows that one ``NStep(n, gamma)`` per sub-env, fed the same steps and emptied, would
    give, in that order. The tracer is truthy while it can pop.

    Unlike :class:`NStep`, a truncation needs ``s_next`` (see :meth:`add`), log-propensities
    and weights must be finite as float32 already when added, and ``record_extra_info`` is
    not offered.

    Parameters
    ----------
    n : int
        The number of steps over which to bootstrap (``1 <= n <= 2**20``).
    gamma : float
        The discount factor in :math:`[0, 1]`.
    num_envs : int
        The number of sub-envs (>= 1).

    Examples
    --------
    >>> import numpy as np
    >>> tracer = VectorNStep(n=2, gamma=0.5, num_envs=2)  # or NStep(n=2, gamma=0.5, num_envs=2)
    >>> for t in range(3):
    ...     tracer.add(s=np.array([t, 10 + t]), a=np.zeros(2, int), r=np.ones(2),
    ...                done=np.array([t == 2, False]))
    >>> batch = tracer.pop()
    >>> batch.S.tolist(), batch.Rn.tolist(), batch.In.tolist()
    ([0, 1, 2, 10], [1.5, 1.5, 1.0, 1.5], [0.25, 0.0, 0.0, 0.25])
    """

    def __init__(self, n: int, gamma: float, num_envs: int) -> None:
        self.n = check_int(n, "n", low=1, high=_MAX_N)
        self._gammas = np.power(_gamma(gamma), np.arange(self.n + 1))
        self._offsets = np.arange(self.n)
        super().__init__(gamma, num_envs)

    def _initial_capacity(self) -> int:
        return self.n + 1

    def _sum(self, terms: np.ndarray) -> np.ndarray:
        """Row sums of ``terms`` (rows, at most n) in NStep's order of summation: bit for
        bit."""
        out = np.zeros(len(terms))
        for m in range(terms.shape[1]):
            out = out + terms[:, m]
        return out

    def _available(self) -> np.ndarray:
        ended = self._terminated | self._truncated
        return np.where(ended, self._count, np.maximum(self._count - self.n, 0))

    def pop(self, return_envs: bool = False) -> Any:
        """Pop every complete transition of every sub-env.

        Parameters
        ----------
        return_envs : bool, optional
            Also return the sub-env of every row.

        Returns
        -------
        transitions : TransitionBatch
            The rows, ordered by sub-env and then by time (see the class docstring).
        envs : array of int
            With ``return_envs``: the sub-env of each row.

        Raises
        ------
        InsufficientCacheError
            If no sub-env has a complete transition.
        ValueError
            If a return overflows the float32 it is stored as; nothing is popped.
        """
        cap, n = self._cap, self.n
        if not (self._terminated.any() or self._truncated.any() or self._count.max() > n + 1):
            # the common case: no episode ended, at most one complete window per sub-env
            env = np.flatnonzero(self._count > n)
            if env.size == 0:
                raise InsufficientCacheError(
                    f"no sub-env holds more than n={n} steps or an ended episode yet"
                )
            start = self._start[env]
            window = self._r[env[:, None], (start[:, None] + self._offsets) % cap]
            returns = self._sum(window * self._gammas[:n])
            factor = np.full(env.size, self._gammas[n])
            batch = self._batch(env, start, returns, factor, (start + n) % cap, None)
            self._start[env] = (start + 1) % cap
            self._count[env] -= 1
            return (batch, env) if return_envs else batch
        avail = self._available()
        if not avail.any():
            raise InsufficientCacheError(
                f"no sub-env holds more than n={n} steps or an ended episode yet"
            )
        env, j = self._rows(avail)
        first, c0 = self._start[env] + j, self._count[env]
        k = np.minimum(n, c0 - j)
        steps = self._offsets[: int(k.max())]  # the longest window popped
        window = self._r[env[:, None], (first[:, None] + steps) % cap]
        terms = window * self._gammas[: steps.size]
        returns = self._sum(np.where(steps < k[:, None], terms, 0.0))
        full = c0 - j - 1 >= n
        trunc = self._truncated[env]
        factor = np.where(full, self._gammas[n], np.where(trunc, self._gammas[k], 0))
        pos = first % cap
        next_pos = np.where(full, (first + n) % cap, pos)
        batch = self._batch(env, pos, returns, factor, next_pos, trunc & ~full)
        self._start = (self._start + avail) % cap
        self._count -= avail
        return (batch, env) if return_envs else batch


class VectorMonteCarlo(_VectorTracer):
    r"""A :class:`MonteCarlo` tracer for a vector env: one chain per sub-env, fed a whole
    vector-env step per :meth:`add`.

    ``MonteCarlo(gamma, num_envs=k)`` returns one. Each :meth:`pop` returns the transitions
    of every sub-env whose episode ended, ordered by sub-env and then by time (oldest step
    first, unlike :class:`MonteCarlo`, which pops last step first): the rows of one
    ``MonteCarlo(gamma)`` per sub-env, flushed, each sub-env's in reverse. A truncation needs
    ``s_next`` (see :meth:`VectorNStep.add`).

    Parameters
    ----------
    gamma : float
        The discount factor in :math:`[0, 1]`.
    num_envs : int
        The number of sub-envs (>= 1).
    """

    def _available(self) -> np.ndarray:
        return np.where(self._terminated | self._truncated, self._count, 0)

    def pop(self, return_envs: bool = False) -> Any:
        """Pop the transitions of every sub-env whose episode ended, with their returns
        (and, with ``return_envs``, the sub-env of each row, as :meth:`VectorNStep.pop`).

        Raises
        ------
        InsufficientCacheError
            If no sub-env's episode has ended with steps held.
        ValueError
            If a return overflows the float32 it is stored as; nothing is popped.
        """
        avail = self._available()
        if not avail.any():
            raise InsufficientCacheError(
                "MonteCarlo can pop only after an episode ended (done or truncated)"
            )
        env, t = self._rows(avail)
        cap = self._cap
        start = self._start[env]
        first = np.cumsum(avail) - avail  # each sub-env's first row
        returns = np.zeros(env.size)
        factor = np.zeros(env.size)
        envs = np.flatnonzero(avail)
        g = np.zeros(envs.size)
        for m in range(int(avail.max())):  # steps from the end, as MonteCarlo pops them
            live = m < avail[envs]
            e = envs[live]
            row = first[e] + avail[e] - 1 - m
            g[live] = self._r[e, (self._start[e] + avail[e] - 1 - m) % cap] + self.gamma * g[live]
            returns[row] = g[live]
            factor[row] = np.where(self._truncated[e], self.gamma ** (m + 1), 0.0)
        pos = (start + t) % cap
        batch = self._batch(env, pos, returns, factor, pos, self._truncated[env])
        self._start = (self._start + avail) % cap
        self._count -= avail
        return (batch, env) if return_envs else batch
