"""The state of the host sequence replay buffers as plain data (``__checkpoint_state__``) and
its checked restore (``__checkpoint_restore__``), for ``utils.dump`` and ``CheckpointManager``."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_float, check_int, check_state_keys
from coax_utils.replay._seq_common import check_config, check_eta

__all__ = ["SequenceState"]

_MAX_COUNT = np.iinfo(np.int64).max


def _array(state: dict, key: str, owner: str, dtype: Any, shape: tuple) -> np.ndarray:
    x = state[key]
    if not isinstance(x, np.ndarray) or x.dtype != dtype or x.shape != shape:
        got = f"{x.dtype}{list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{owner} state: {key} must be {np.dtype(dtype)}{list(shape)}, got {got}")
    return x if x.flags.writeable else x.copy()


def _structure(template: Any, key: str, owner: str) -> Any:
    """The treedef of a structure template (a pytree whose leaves are all the int 0)."""
    leaves, treedef = jax.tree_util.tree_flatten(template)
    if any(type(x) is not int or x != 0 for x in leaves):
        raise ValueError(f"{owner} state: {key} must be a pytree whose leaves are all 0")
    return treedef


def _arrays(arrays: Any, key: str, owner: str, rows: tuple, count: int) -> list[np.ndarray]:
    """``arrays``: a list of ``count`` numeric arrays with ``rows`` in front."""
    if not isinstance(arrays, list) or len(arrays) != count:
        raise ValueError(f"{owner} state: {key} must be a list of {count} arrays")
    out = []
    for k, x in enumerate(arrays):
        if not isinstance(x, np.ndarray) or x.dtype.kind not in "biuf":
            raise ValueError(f"{owner} state: {key}[{k}] must be a numeric numpy array")
        if x.shape[: len(rows)] != rows:
            raise ValueError(
                f"{owner} state: {key}[{k}] must have the rows {rows} in front, got shape {x.shape}"
            )
        out.append(x if x.flags.writeable else x.copy())
    return out


def _same_items(a: list, b: list, skip_a: int, skip_b: int, what: str, owner: str) -> None:
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape[skip_a:] != y.shape[skip_b:]:
            raise ValueError(f"{owner} state: {what} disagree in per-step shapes or dtypes")


class SequenceState:
    """Checkpoints of the host sequence buffers: the state as plain data, checked restore."""

    _capacity: int
    _length: int
    _period: int
    _burn_in: int
    _num_envs: int

    _STATE_KEYS: tuple[str, ...] = (
        "capacity",
        "length",
        "period",
        "burn_in",
        "num_envs",
        "count",
        "rng",
        "step_structure",
        "core_structure",
        "steps",
        "core",
        "pending",
        "pending_core",
        "chain_n",
        "chain_first",
        "seq_len",
        "seq_end",
        "seq_first",
    )
    _PRIORITY_KEYS = ("alpha", "beta", "epsilon", "eta", "abs_mix", "max_abs_mix")

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        prioritized = hasattr(cls, "update")
        return cls._STATE_KEYS + (cls._PRIORITY_KEYS if prioritized else ())

    def __checkpoint_state__(self) -> dict[str, Any]:
        """The buffer as plain data: the configuration, the window counter, the RNG, the
        structures of the steps and core states (``step_structure``, ``core_structure``:
        the pytrees with every leaf 0), the stored windows (``steps`` and ``core``, lists of
        the leaves' arrays with ``capacity`` rows),
        their valid lengths, end kinds (0 none, 1 terminated, 2 truncated) and episode-start
        flags, every chain's current window (``pending``, ``pending_core``, its step count
        ``chain_n`` and ``chain_first``), and for the prioritized buffer the
        hyperparameters and each window's TD-error mixture. Arrays are the buffer's own."""
        started = self._steps is not None

        def template(treedef: Any) -> Any:  # the structure, every leaf 0
            return treedef.unflatten([0] * treedef.num_leaves) if started else None

        state = {
            "capacity": self._capacity,
            "length": self._length,
            "period": self._period,
            "burn_in": self._burn_in,
            "num_envs": self._num_envs,
            "count": self._count,
            "rng": self._rng,
            "step_structure": template(self._step_def),
            "core_structure": template(self._core_def),
            "steps": list(self._steps) if started else None,
            "core": list(self._core) if started else None,
            "pending": list(self._pending) if started else None,
            "pending_core": list(self._pending_core) if started else None,
            "chain_n": self._n,
            "chain_first": self._first,
            "seq_len": self._seq_len,
            "seq_end": self._seq_end,
            "seq_first": self._seq_first,
        }
        if hasattr(self, "update"):
            state.update(
                alpha=self._alpha,
                beta=self._beta,
                epsilon=self._epsilon,
                eta=self._eta,
                abs_mix=self._abs_mix,
                max_abs_mix=self._max_abs_mix,
            )
        return state

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).__checkpoint_restore__, (self.__checkpoint_state__(),))

    @classmethod
    def __checkpoint_restore__(cls, state: dict[str, Any]) -> Any:
        """Rebuild a buffer from :meth:`__checkpoint_state__`, trusting nothing in it.

        Checked: every key, type, dtype and shape; the configuration (as the constructor
        checks it); ``count`` and the ring filled from slot 0; each stored window's valid
        length in ``[1, length]`` (shorter only at an episode end), end kind and flags (0 in
        empty slots); the chains' step counts and flags against the windowing rule; that
        stored and pending steps and core states share structure, shapes and dtypes; and
        for the prioritized buffer the hyperparameters and mixtures (finite, >= 0, at most
        the largest seen, 0 in empty slots). Raises ValueError or TypeError naming what is
        wrong; nothing is built.
        """
        name = cls.__name__
        state = check_state_keys(state, cls._keys(), name)
        obj = cls.__new__(cls)
        try:
            config = check_config(
                state["length"],
                state["period"],
                state["burn_in"],
                state["num_envs"],
                state["capacity"],
                2**31 - 1,
            )
            count = check_int(state["count"], "count", 0, _MAX_COUNT)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name} state: {e}") from None
        C, L, P, B, E = config
        obj._capacity, obj._length, obj._period, obj._burn_in, obj._num_envs = config
        if state["period"] is None:
            raise ValueError(f"{name} state: period must be an int")
        rng = state["rng"]
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"{name} state: rng must be a numpy Generator, got {rng!r}")
        obj._rng = rng
        if hasattr(obj, "update"):
            obj._restore_hyper(state)
        obj.clear()
        obj._count = count
        filled = min(count, C)
        slots = np.arange(C, dtype=np.int64)
        obj._ids = np.where(slots < count, slots + C * ((count - 1 - slots) // C), -1)
        seq_len = _array(state, "seq_len", name, np.int32, (C,))
        seq_end = _array(state, "seq_end", name, np.int8, (C,))
        seq_first = _array(state, "seq_first", name, np.bool_, (C,))
        full = slots < filled
        if (
            np.any(full & ((seq_len < 1) | (seq_len > L)))
            or np.any(~full & ((seq_len != 0) | (seq_end != 0) | seq_first))
            or np.any((seq_end < 0) | (seq_end > 2))
            or np.any(full & (seq_len < L) & (seq_end == 0))
        ):
            raise ValueError(
                f"{name} state: stored windows must have 1 to {L} valid steps (fewer than {L} "
                "only at an episode end), end kinds 0, 1 or 2, and empty slots all 0"
            )
        obj._seq_len, obj._seq_end, obj._seq_first = seq_len, seq_end, seq_first
        n = _array(state, "chain_n", name, np.int64, (E,))
        first = _array(state, "chain_first", name, np.bool_, (E,))
        # a chain at its episode's first window holds 0..L-1 steps; after a full window it
        # holds L - P (negative: steps to skip) up to L - 1
        low = np.where(first, 0, min(L - P, 0))
        if np.any((n < low) | (n >= L) | (~first & (n < L - P))):
            raise ValueError(
                f"{name} state: chain_n must lie in [0, {L}) for a chain at its episode's "
                f"first window and in [{L - P}, {L}) after it, got {n.tolist()}"
            )
        obj._n, obj._first = n, first
        obj._restore_storage(state, count)
        if hasattr(obj, "update"):
            obj._restore_priorities(state)
        arrays = [*(obj._steps or []), *(obj._core or []), *(obj._pending or [])]
        arrays += [*(obj._pending_core or []), seq_len, seq_end, seq_first]
        arrays += [n, first] + ([obj._abs_mix] if hasattr(obj, "update") else [])
        for k, a in enumerate(arrays):
            if any(np.may_share_memory(a, b) for b in arrays[k + 1 :]):
                raise ValueError(f"{name} state: two arrays of the state share memory")
        return obj

    def _restore_storage(self, state: dict[str, Any], count: int) -> None:
        name = type(self).__name__
        C, L, E = self._capacity, self._length, self._num_envs
        keys = ("step_structure", "core_structure", "steps", "core", "pending", "pending_core")
        if state["steps"] is None:
            if count or any(state[k] is not None for k in keys) or np.any(self._n):
                raise ValueError(f"{name} state: windows or chains without stored steps")
            if not all(self._first):
                raise ValueError(f"{name} state: chains in an episode without stored steps")
            return
        step_def = _structure(state["step_structure"], "step_structure", name)
        core_def = _structure(state["core_structure"], "core_structure", name)
        steps = _arrays(state["steps"], "steps", name, (C, L), step_def.num_leaves)
        pending = _arrays(state["pending"], "pending", name, (E, L), step_def.num_leaves)
        core = _arrays(state["core"], "core", name, (C,), core_def.num_leaves)
        pending_core = _arrays(state["pending_core"], "pending_core", name, (E, L), len(core))
        if not steps:
            raise ValueError(f"{name} state: the steps need at least one array")
        _same_items(steps, pending, 2, 2, "steps and pending", name)
        _same_items(core, pending_core, 1, 2, "core and pending_core", name)
        self._steps, self._pending, self._step_def = steps, pending, step_def
        self._core, self._pending_core, self._core_def = core, pending_core, core_def

    def _restore_hyper(self, state: dict[str, Any]) -> None:
        name = type(self).__name__
        try:
            self._alpha = check_float(state["alpha"], "alpha", low=0)
            self._beta = check_float(state["beta"], "beta", low=0)
            self._epsilon = check_float(state["epsilon"], "epsilon", low=0, low_open=True)
            self._eta = check_eta(state["eta"])
            top = check_float(state["max_abs_mix"], "max_abs_mix", low=1)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name} state: {e}") from None
        self._max_abs_top = top

    def _restore_priorities(self, state: dict[str, Any]) -> None:
        name = type(self).__name__
        C = self._capacity
        mix = _array(state, "abs_mix", name, np.float64, (C,))
        top = bound = self._max_abs_top
        n = len(self)
        filled = mix[:n]
        if not (np.all(np.isfinite(filled)) and np.all(filled >= 0) and np.all(filled <= bound)):
            raise ValueError(
                f"{name} state: abs_mix of stored windows must be finite, >= 0 and at most "
                f"max_abs_mix = {bound}"
            )
        if np.any(mix[n:] != 0):
            raise ValueError(f"{name} state: abs_mix must be 0 in empty slots")
        self._abs_mix, self._max_abs_mix = mix, top
        del self._max_abs_top
        if n:
            self._tree.set_values(np.arange(n), self._priority(filled))
