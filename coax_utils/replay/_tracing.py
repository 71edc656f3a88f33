"""Reward tracers: turn a stream of single steps into (n-step) :class:`TransitionBatch` rows."""

from __future__ import annotations

import abc
from collections import deque
from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_finite_number, check_flag, check_int, check_state_keys
from coax_utils.replay._transition import TransitionBatch

__all__ = ["EpisodeDoneError", "InsufficientCacheError", "MonteCarlo", "NStep"]

_MAX_N = 1 << 20  # far beyond any n-step return in use; bounds what a restored n allocates


class EpisodeDoneError(ValueError):
    """Raised when a tracer receives a step after its episode ended, before being emptied."""


class InsufficientCacheError(IndexError):
    """Raised when popping or flushing a tracer that has no complete transition yet."""


def _snapshot(x: Any) -> Any:
    """``x`` with its NumPy arrays copied (JAX arrays are immutable, other leaves kept)."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if x is None or type(x) in (int, float, bool):
        return x
    return jax.tree_util.tree_map(lambda v: v.copy() if isinstance(v, np.ndarray) else v, x)


def _check_return(value: float) -> None:
    """A return must be finite as the float32 it is stored as."""
    with np.errstate(over="ignore"):
        finite = np.isfinite(np.float32(value))
    if not finite:
        raise ValueError(f"the discounted return {value!r} overflows float32; nothing was popped")


def _check_gamma(gamma: Any) -> float:
    if isinstance(gamma, (bool, str)) or np.ndim(gamma) != 0:
        raise TypeError(f"gamma must be a float in [0, 1], got {gamma!r}")
    if np.asarray(gamma).dtype.kind not in "iuf":
        raise TypeError(f"gamma must be a float in [0, 1], got {gamma!r}")
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma!r}")
    return float(gamma)


def _nstep_args(n: int, gamma: float, record_extra_info: bool = False) -> tuple:
    return n, gamma, record_extra_info


class _BaseTracer(abc.ABC):
    """Shared bookkeeping of the tracers: episode end, truncation and the final state."""

    gamma: float
    _STATE_KEYS: tuple[str, ...] = ("gamma", "steps", "terminated", "truncated", "final")

    def __checkpoint_state__(self) -> dict[str, Any]:
        """The tracer as plain data: its settings, the cached ``steps`` (each a tuple
        ``(s, a, r, logp, w)`` as given to :meth:`add`), the ``terminated`` and
        ``truncated`` flags and ``final`` (the ``(s_next, a_next, logp_next)`` to bootstrap
        from after a truncation, else None)."""
        state = {
            "gamma": self.gamma,
            "steps": [tuple(step) for step in self._steps],
            "terminated": self._terminated,
            "truncated": self._truncated,
            "final": self._final,
        }
        state.update(self._extra_state())
        return {key: state[key] for key in self._STATE_KEYS}

    @classmethod
    def __checkpoint_restore__(cls, state: dict[str, Any]) -> Any:
        """Rebuild a tracer from :meth:`__checkpoint_state__`, checking every field: the
        settings, each step's finite ``r``, ``logp`` and ``w``, and that ``final`` is given
        exactly after a truncation. Raises ValueError or TypeError naming what is wrong."""
        name = cls.__name__
        state = check_state_keys(state, cls._STATE_KEYS, name)
        obj = cls.__new__(cls)
        try:
            obj.gamma = _check_gamma(state["gamma"])
            obj._restore_extra(state)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name} state: {e}") from None
        steps, final = state["steps"], state["final"]
        terminated, truncated = state["terminated"], state["truncated"]
        if not isinstance(steps, list):
            raise TypeError(f"{name} state: steps must be a list, got {type(steps).__name__}")
        for i, step in enumerate(steps):
            if not (isinstance(step, (tuple, list)) and len(step) == 5):
                raise ValueError(f"{name} state: steps[{i}] must be (s, a, r, logp, w)")
            for field, value in zip(("r", "logp", "w"), step[2:]):
                try:
                    check_finite_number(value, field)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"{name} state: steps[{i}]: {e}") from None
        if not (isinstance(terminated, bool) and isinstance(truncated, bool)):
            raise TypeError(f"{name} state: terminated and truncated must be bools")
        if terminated and truncated:
            raise ValueError(f"{name} state: an episode cannot be terminated and truncated")
        if truncated != (final is not None):
            raise ValueError(f"{name} state: final must be given exactly after a truncation")
        if final is not None and not (isinstance(final, (tuple, list)) and len(final) == 3):
            raise ValueError(f"{name} state: final must be (s_next, a_next, logp_next)")
        if final is not None:
            try:
                check_finite_number(final[2], "logp_next")
            except (TypeError, ValueError) as e:
                raise type(e)(f"{name} state: final: {e}") from None
        obj.reset()
        obj._steps = deque(tuple(step) for step in steps)
        obj._terminated, obj._truncated = terminated, truncated
        obj._final = None if final is None else tuple(final)
        obj._restore_progress(state)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).__checkpoint_restore__, (self.__checkpoint_state__(),))

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _restore_extra(self, state: dict[str, Any]) -> None:
        """Check and set the settings of a subclass (before ``reset``)."""
        return None

    def _restore_progress(self, state: dict[str, Any]) -> None:
        """Check and set what a subclass tracks while popping (after ``reset``)."""
        return None

    def reset(self) -> None:
        """Empty the tracer and forget the current episode."""
        self._steps: deque = deque()  # (s, a, r, logp, w)
        self._terminated = False
        self._truncated = False
        self._final: tuple | None = None  # (s_next, a_next, logp_next) to bootstrap from

    @property
    def _ended(self) -> bool:
        return self._terminated or self._truncated

    def __len__(self) -> int:
        return len(self._steps)

    def add(
        self,
        s: Any,
        a: Any,
        r: float,
        done: bool,
        logp: float = 0.0,
        w: float = 1.0,
        *,
        truncated: bool = False,
        s_next: Any = None,
    ) -> None:
        r"""Add one time step to the tracer.

        Parameters
        ----------
        s : state observation
            The state :math:`S_t`.
        a : action
            The action :math:`A_t`.
        r : float
            The reward :math:`R_t`.
        done : bool
            Whether the episode *terminated* after this step (:math:`S_{t+1}` is terminal:
            no bootstrapping).
        logp : float, optional
            The log-propensity :math:`\log\pi(A_t|S_t)`.
        w : float, optional
            A sample weight.
        truncated : bool, optional
            Whether the episode was *truncated* after this step (e.g. a time limit). This ends
            the trace but, unlike ``done``, keeps bootstrapping from the state that follows.
            If both flags are set, termination wins.
        s_next : state observation, optional
            The observation :math:`S_{t+1}` that follows this step. Only used when the
            episode is truncated, as the state to bootstrap from. Without it, the tracer
            bootstraps from the state of the last step instead: that step's own transition
            is dropped (it would have no reward left to accumulate) and the preceding
            transitions use one step less.

        The NumPy arrays in ``s``, ``a`` and ``s_next`` are copied, so an env that updates
        its observation array in place (a vector env with ``copy=False``) does not change
        the steps held.

        Raises
        ------
        EpisodeDoneError
            If the episode already ended and the tracer still holds transitions of it (pop or
            flush them first).
        TypeError
            If ``r``, ``logp`` or ``w`` is not a real number (a string, say), or ``done`` or
            ``truncated`` is not a bool (or a number that is 0 or 1).
        ValueError
            If ``r``, ``logp`` or ``w`` is not a single finite number, or ``done`` or
            ``truncated`` is an array of more than one value. A rejected step changes
            nothing.
        """
        if self._ended and len(self):
            raise EpisodeDoneError(
                "the episode already ended; pop() or flush() its remaining transitions before "
                "adding steps of a new episode"
            )
        for name, value in (("r", r), ("logp", logp), ("w", w)):
            check_finite_number(value, name)
        done, truncated = check_flag(done, "done"), check_flag(truncated, "truncated")
        s, a, s_next = _snapshot(s), _snapshot(a), _snapshot(s_next)
        if self._ended:  # previous episode fully consumed: start a new one
            self.reset()
        self._steps.append((s, a, r, logp, w))
        self._terminated = done
        self._truncated = truncated and not done
        if self._truncated:
            if s_next is not None:
                # the action at S_next was never taken; the last action is a placeholder
                self._final = (s_next, a, logp)
            else:
                s_last, a_last, _, logp_last, _ = self._steps.pop()
                self._final = (s_last, a_last, logp_last)

    def flush(self) -> TransitionBatch:
        """Pop all available transitions at once.

        Returns
        -------
        transitions : TransitionBatch
            The popped transitions concatenated along the batch axis, in time order.

        Raises
        ------
        InsufficientCacheError
            If no transition is available (see :meth:`pop`).
        """
        if not self:
            raise InsufficientCacheError(
                "the tracer holds no complete transition yet: add more steps (or end the "
                "episode) before flushing"
            )
        batches = []
        while self:
            batches.append(self.pop())
        return TransitionBatch.concatenate(*batches)

    @abc.abstractmethod
    def pop(self) -> TransitionBatch:
        """Pop the oldest complete transition as a batch of size 1."""


class NStep(_BaseTracer):
    r"""A short-term cache for :math:`n`-step bootstrapping.

    Each popped transition carries the :math:`n`-step partial return and the bootstrap factor

    .. math::

        R^{(n)}_t\ =\ \sum_{j=0}^{k-1}\gamma^jR_{t+j}\,,\qquad
        I^{(n)}_t\ =\ \left\{\begin{matrix}
            0 & \text{if the episode terminated within the window} \\
            \gamma^k & \text{otherwise}
        \end{matrix}\right.

    where :math:`k\le n` is the number of rewards actually accumulated (:math:`k<n` only at the
    end of a truncated episode, where the window is cut short and ``S_next`` is the state that
    followed the last step). After termination ``S_next``, ``A_next`` and ``logP_next`` are
    placeholders (copies of ``S``, ``A``, ``logP``), as in coax.

    The tracer is truthy while it can pop a transition: it holds more than :math:`n` steps, or
    the episode ended and steps remain.

    Parameters
    ----------
    n : int
        The number of steps over which to bootstrap (``1 <= n <= 2**20``).
    gamma : float
        The discount factor in :math:`[0, 1]`.
    record_extra_info : bool, optional
        Store the :math:`n+1` states, actions, rewards, dones, log-propensities and weights of
        each window in the ``extra_info`` field (tuples of length :math:`n+1`, in coax's
        layout; entries past the end of the episode repeat the last step, with done True).
    num_envs : int, optional
        Given, the constructor returns a :class:`VectorNStep` instead: one chain per sub-env
        of a vector env, fed a whole vector-env step per ``add`` (arrays with a leading
        sub-env axis), in NumPy over the sub-env axis.

    Examples
    --------
    >>> tracer = NStep(n=2, gamma=0.5)
    >>> for t in range(4):
    ...     tracer.add(s=t, a=0, r=1.0, done=(t == 3))
    >>> batch = tracer.flush()
    >>> batch.Rn.tolist(), batch.In.tolist()
    ([1.5, 1.5, 1.5, 1.0], [0.25, 0.25, 0.0, 0.0])
    >>> batch.S_next.tolist()[:2]
    [2, 3]
    """

    _STATE_KEYS = ("n", "record_extra_info") + _BaseTracer._STATE_KEYS

    def __new__(cls, *args: Any, num_envs: int | None = None, **kwargs: Any) -> Any:
        if num_envs is None:
            return super().__new__(cls)
        from coax_utils.replay._vector_tracing import VectorNStep

        n, gamma, record_extra_info = _nstep_args(*args, **kwargs)
        if record_extra_info:
            raise ValueError("record_extra_info is not offered with num_envs (VectorNStep)")
        return VectorNStep(n, gamma, num_envs)

    def __init__(
        self, n: int, gamma: float, record_extra_info: bool = False, num_envs: None = None
    ) -> None:
        self.gamma = _check_gamma(gamma)
        self._set_n(n, bool(record_extra_info))
        self.reset()

    def _set_n(self, n: Any, record_extra_info: bool) -> None:
        self.n = check_int(n, "n", low=1, high=_MAX_N)
        self.record_extra_info = record_extra_info
        self._gammas = np.power(self.gamma, np.arange(self.n + 1))

    def _extra_state(self) -> dict[str, Any]:
        return {"n": self.n, "record_extra_info": self.record_extra_info}

    def _restore_extra(self, state: dict[str, Any]) -> None:
        if not isinstance(state["record_extra_info"], bool):
            raise TypeError("record_extra_info must be a bool")
        self._set_n(state["n"], state["record_extra_info"])

    def __bool__(self) -> bool:
        return len(self) > 0 and (self._ended or len(self) > self.n)

    def pop(self) -> TransitionBatch:
        """Pop the oldest complete transition.

        Returns
        -------
        transition : TransitionBatch
            A batch of size 1.

        Raises
        ------
        InsufficientCacheError
            If the tracer holds no complete transition (see the truthiness rule above).
        ValueError
            If the return overflows the float32 it is stored as; nothing is popped.
        """
        if not self:
            raise InsufficientCacheError(
                f"the tracer needs more than n={self.n} steps, or the end of the episode, "
                f"before it can pop (it holds {len(self)})"
            )
        extra_info = self._extra_info() if self.record_extra_info else None
        k = min(self.n, len(self._steps))
        rn = sum(float(self._gammas[j]) * float(self._steps[j][2]) for j in range(k))
        _check_return(rn)
        s, a, _, logp, w = self._steps.popleft()
        if len(self._steps) >= self.n:
            s_next, a_next, _, logp_next, _ = self._steps[self.n - 1]
            factor = self._gammas[self.n]
        elif self._truncated:
            s_next, a_next, logp_next = self._final
            factor = self._gammas[k]
        else:  # terminated: no bootstrapping, placeholders for the *_next fields
            s_next, a_next, logp_next = s, a, logp
            factor = 0.0
        return TransitionBatch.from_single(
            s=s,
            a=a,
            logp=logp,
            r=rn,
            done=False,
            gamma=float(factor),
            s_next=s_next,
            a_next=a_next,
            logp_next=logp_next,
            w=w,
            extra_info=extra_info,
        )

    def _extra_info(self) -> dict:
        names = ("states", "actions", "rewards", "dones", "log_props", "weights")
        out: dict[str, list] = {name: [] for name in names}
        last = len(self._steps) - 1
        for j in range(self.n + 1):
            i = min(j, last)
            s, a, r, logp, w = self._steps[i]
            done = j >= last and self._ended
            for name, value in zip(names, (s, a, r, done, logp, w)):
                out[name].append(value)
        return {name: tuple(values) for name, values in out.items()}


class MonteCarlo(_BaseTracer):
    r"""A short-term cache for episodic Monte Carlo returns.

    Transitions become available once the episode ends; they are popped last step first, each
    with the discounted return to the end of the episode,

    .. math::

        G_t\ =\ \sum_{j=0}^{T-t-1}\gamma^jR_{t+j}\,.

    After termination ``In = 0`` (no bootstrapping; ``S_next`` etc. are placeholders). After a
    truncation the return is completed by bootstrapping: ``In`` is :math:`\gamma^{T-t}` and
    ``S_next`` is the state that followed the last step (see :meth:`add`).

    Parameters
    ----------
    gamma : float
        The discount factor in :math:`[0, 1]`.
    num_envs : int, optional
        Given, the constructor returns a :class:`VectorMonteCarlo` instead: one chain per
        sub-env of a vector env, fed a whole vector-env step per ``add``.

    Examples
    --------
    >>> tracer = MonteCarlo(gamma=0.5)
    >>> for t in range(3):
    ...     tracer.add(s=t, a=0, r=1.0, done=(t == 2))
    >>> batch = tracer.flush()
    >>> batch.S.tolist(), batch.Rn.tolist(), batch.In.tolist()
    ([2, 1, 0], [1.0, 1.5, 1.75], [0.0, 0.0, 0.0])
    """

    _STATE_KEYS = _BaseTracer._STATE_KEYS + ("g", "k")

    def __new__(cls, *args: Any, num_envs: int | None = None, **kwargs: Any) -> Any:
        if num_envs is None:
            return super().__new__(cls)
        from coax_utils.replay._vector_tracing import VectorMonteCarlo

        return VectorMonteCarlo(*args, num_envs=num_envs, **kwargs)

    def __init__(self, gamma: float, num_envs: None = None) -> None:
        self.gamma = _check_gamma(gamma)
        self.reset()

    def _extra_state(self) -> dict[str, Any]:
        return {"g": self._g, "k": self._k}

    def _restore_progress(self, state: dict[str, Any]) -> None:
        g, k = state["g"], state["k"]
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not np.isfinite(g):
            raise ValueError(f"MonteCarlo state: g must be a finite float, got {g!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"MonteCarlo state: k must be an int >= 0, got {k!r}")
        if not self._ended and (k or g):
            raise ValueError("MonteCarlo state: g and k must be 0 before the episode ends")
        self._g, self._k = float(g), k

    def reset(self) -> None:
        """Empty the tracer and forget the current episode."""
        super().reset()
        self._g = 0.0
        self._k = 0

    def __bool__(self) -> bool:
        return len(self) > 0 and self._ended

    def pop(self) -> TransitionBatch:
        """Pop the latest step of the ended episode, with its return.

        Returns
        -------
        transition : TransitionBatch
            A batch of size 1.

        Raises
        ------
        InsufficientCacheError
            If the tracer is empty or the episode has not ended yet.
        ValueError
            If the return overflows the float32 it is stored as; nothing is popped.
        """
        if not self:
            raise InsufficientCacheError(
                "MonteCarlo can pop only after the episode ended (done or truncated) and "
                f"while steps remain (it holds {len(self)})"
            )
        s, a, r, logp, w = self._steps[-1]
        g = float(r) + self.gamma * self._g
        _check_return(g)
        self._steps.pop()
        self._g = g
        self._k += 1
        if self._truncated:
            s_next, a_next, logp_next = self._final
            factor = self.gamma**self._k
        else:
            s_next, a_next, logp_next = s, a, logp
            factor = 0.0
        return TransitionBatch.from_single(
            s=s,
            a=a,
            logp=logp,
            r=self._g,
            done=False,
            gamma=float(factor),
            s_next=s_next,
            a_next=a_next,
            logp_next=logp_next,
            w=w,
        )
