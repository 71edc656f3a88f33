r"""Schedules: a stepwise linear function usable on Python numbers and traced JAX scalars."""

from __future__ import annotations

import bisect
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["StepwiseLinearFunction"]


def _finite(x: numbers.Real) -> bool:
    """Whether ``x`` is a finite number that a float can hold (Python ints of any size)."""
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond the float range
        return False


class StepwiseLinearFunction:
    r"""Stepwise linear function: linear between the given steps, flat outside them.

    .. math::

        f(t) = \begin{cases}
            v_1 & t \le t_1 \\
            v_i + (t - t_i)\,\frac{v_{i+1} - v_i}{t_{i+1} - t_i} & t_i \le t \le t_{i+1} \\
            v_n & t \ge t_n
        \end{cases}

    Calling it on a Python or NumPy number returns a Python float; on a NumPy array, a NumPy
    array; on a JAX array or a traced value, a JAX array. So it works as an optax schedule
    (``optax.adam(learning_rate=StepwiseLinearFunction(...))``) inside jitted code.

    Parameters
    ----------
    *steps : pairs (number, float)
        Each step ``(timestep, value)`` fixes the output at ``timestep`` to ``value``. The
        timesteps must be strictly increasing. A single step gives a constant function.
        NumPy scalars are stored as Python ints and floats (see the ``steps`` attribute).

    Raises
    ------
    ValueError
        If no steps are given, the timesteps are not strictly increasing, or a timestep or
        value is not finite (an int beyond the float range counts as not finite).
    TypeError
        If a step is not a pair of real numbers.

    Examples
    --------
    An exploration schedule of a DQN agent, with ``T`` a global step counter:

    >>> epsilon = StepwiseLinearFunction((0, 1.0), (1000000, 0.1), (2000000, 0.01))
    >>> epsilon(-5), epsilon(0), epsilon(500000), epsilon(1000000), epsilon(10**9)
    (1.0, 1.0, 0.55, 0.1, 0.01)

    The same object inside jit, e.g. as a learning-rate schedule:

    >>> import jax, jax.numpy as jnp
    >>> print(jax.jit(epsilon)(jnp.int32(1500000)).round(4))
    0.055
    """

    def __init__(self, *steps: tuple[Any, Any]):
        if not steps:
            raise ValueError("StepwiseLinearFunction needs at least one (timestep, value) step")
        ts, vs = [], []
        for step in steps:
            if not (isinstance(step, (tuple, list)) and len(step) == 2):
                raise TypeError(f"each step must be a (timestep, value) pair, got {step!r}")
            t, v = step
            for name, x in (("timestep", t), ("value", v)):
                if isinstance(x, bool) or not isinstance(x, numbers.Real):
                    raise TypeError(f"{name} must be a real number, got {x!r} in step {step!r}")
                if not _finite(x):
                    raise ValueError(
                        f"{name} must be finite (and within the float range), got {x!r} in "
                        f"step {step!r}"
                    )
            # Python numbers from here on: NumPy scalars would bring their own arithmetic
            # (int64 wraparound, float32 rounding) into the interpolation
            ts.append(int(t) if isinstance(t, numbers.Integral) else float(t))
            vs.append(float(v))
        for t1, t2 in zip(ts, ts[1:]):
            if not t1 < t2:
                raise ValueError(
                    f"timesteps must be strictly increasing, got {t1!r} followed by {t2!r} in "
                    f"steps {steps!r}"
                )
        self._steps = tuple((t, v) for t, v in zip(ts, vs))
        self._ts = ts
        self._vs = vs
        self._ts_arr = np.asarray(ts, np.float64)
        self._vs_arr = np.asarray(vs, np.float64)

    @property
    def steps(self) -> tuple[tuple[int | float, float], ...]:
        """The ``(timestep, value)`` steps (read-only: make a new function for new steps)."""
        return self._steps

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.steps}"

    def __checkpoint_state__(self) -> dict[str, Any]:
        """The steps as plain data: ``{"steps": [[timestep, value], ...]}``."""
        return {"steps": [[t, v] for t, v in self.steps]}

    @classmethod
    def __checkpoint_restore__(cls, state: dict[str, Any]) -> StepwiseLinearFunction:
        """Rebuild from :meth:`__checkpoint_state__`; the steps are checked as by the
        constructor (ValueError/TypeError naming what is wrong)."""
        if not isinstance(state, dict):
            raise TypeError(f"StepwiseLinearFunction state must be a dict, got {type(state)}")
        if set(state) != {"steps"}:
            raise ValueError(
                f"StepwiseLinearFunction state needs exactly the key 'steps', got {sorted(state)}"
            )
        steps = state["steps"]
        if not isinstance(steps, (list, tuple)):
            raise TypeError(f"StepwiseLinearFunction state: steps must be a list, got {steps!r}")
        return cls(*[tuple(step) if isinstance(step, list) else step for step in steps])

    def __reduce__(self) -> tuple:
        return (type(self).__checkpoint_restore__, (self.__checkpoint_state__(),))

    def _scalar(self, t: numbers.Real) -> float:
        ts, vs = self._ts, self._vs
        if t != t:
            raise ValueError(f"timestep must not be NaN, got {t!r}")
        if t <= ts[0]:
            return vs[0]
        if t >= ts[-1]:
            return vs[-1]
        i = bisect.bisect_right(ts, t)  # ts[i - 1] <= t < ts[i]
        t0, t1, v0, v1 = ts[i - 1], ts[i], vs[i - 1], vs[i]
        # t - t0 is exact for ints (Python ints do not overflow)
        return v0 + float(t - t0) * (v1 - v0) / (t1 - t0)

    def _integer(self, xp: Any, t: Any) -> Any:
        """The schedule at integer steps ``t`` (NumPy or JAX arrays), exact in the step.

        The segment is found by comparing ``t`` with the breakpoints in ``t``'s own integer
        dtype (``t >= ts_i`` iff ``t >= ceil(ts_i)``), and the offset into the segment is
        ``t - floor(ts_left)`` computed in the unsigned dtype of the same width, which is
        exact whenever ``t`` lies past ``floor(ts_left)``. Only that offset, at most the
        segment's length, is turned into a float.
        """
        dtype = np.dtype(t.dtype)
        info = np.iinfo(dtype)
        udtype = np.dtype(f"uint{8 * dtype.itemsize}")
        ftype = xp.result_type(float) if xp is jnp else np.float64
        ts = self._ts
        # segment index: the number of breakpoints <= t (0 .. len(ts))
        index = xp.zeros(t.shape, np.int32)
        for tb in ts:
            c = math.ceil(tb)
            if c <= info.min:
                above = xp.ones(t.shape, bool)
            elif c > info.max:
                above = xp.zeros(t.shape, bool)
            else:
                above = t >= xp.asarray(c, dtype)
            index = index + above.astype(np.int32)
        # per segment k (between ts[k-1] and ts[k], k = 1 .. len(ts) - 1): reference point
        # r = floor(ts[k-1]) clipped to the dtype's range, offset of ts[k-1] from r, slope
        refs, offsets, slopes, starts = [0], [0.0], [0.0], [self._vs[0]]
        for k in range(1, len(ts)):
            r = min(max(math.floor(ts[k - 1]), info.min), info.max)
            refs.append(r)
            offsets.append(float(ts[k - 1] - r))
            slopes.append((self._vs[k] - self._vs[k - 1]) / (ts[k] - ts[k - 1]))
            starts.append(self._vs[k - 1])
        refs.append(0)
        offsets.append(0.0)
        slopes.append(0.0)
        starts.append(self._vs[-1])
        # each reference point as the unsigned integer of the same bits (two's complement)
        bits = 8 * dtype.itemsize
        ref = xp.asarray(np.array([r % (1 << bits) for r in refs], udtype))[index]
        delta = (t.astype(udtype) - ref).astype(ftype)  # wraps mod 2**bits: exact t - r
        delta = delta - xp.asarray(np.array(offsets), ftype)[index]
        out = xp.asarray(np.array(starts), ftype)[index] + delta * xp.asarray(
            np.array(slopes), ftype
        )[index]
        # keep the value inside its segment's range despite float rounding
        ends = np.array([*self._vs, self._vs[-1]])
        lo, hi = np.minimum(starts, ends), np.maximum(starts, ends)
        return xp.clip(out, xp.asarray(lo, ftype)[index], xp.asarray(hi, ftype)[index])

    def __call__(self, timestep: Any) -> Any:
        r"""The value of the schedule at ``timestep``.

        Integer steps (Python ints, NumPy or JAX integer arrays of any width, traced values
        included) are exact: the step is compared with the breakpoints and subtracted from
        them in integers, so a step near :math:`10^9` in int32 is not rounded to float32.

        Parameters
        ----------
        timestep : int, float, ndarray or jax.Array
            The step counter (traced values are fine).

        Returns
        -------
        float, ndarray or jax.Array
            A float for a Python/NumPy scalar, a float64 array for a NumPy array, a floating
            JAX array (float32 unless x64 is enabled) for JAX input.

        Raises
        ------
        ValueError
            If a Python or NumPy ``timestep`` is NaN. (A float JAX array cannot be checked
            inside jit: there a NaN step gives a NaN value.)
        TypeError
            If ``timestep`` is not a real number or array.
        """
        if isinstance(timestep, (jax.Array, jax.core.Tracer)):
            t = jnp.asarray(timestep)
            if jnp.issubdtype(t.dtype, jnp.integer):
                return self._integer(jnp, t)
            if not jnp.issubdtype(t.dtype, jnp.floating):
                raise TypeError(f"timestep must be a real number or array, got {timestep!r}")
            dtype = jnp.result_type(float)
            t = t.astype(dtype)
            return jnp.interp(t, jnp.asarray(self._ts_arr, dtype), jnp.asarray(self._vs_arr, dtype))
        if isinstance(timestep, numbers.Real) and not isinstance(timestep, (bool, np.bool_)):
            if isinstance(timestep, np.integer):
                timestep = int(timestep)
            return self._scalar(timestep)
        t = np.asarray(timestep)
        if np.issubdtype(t.dtype, np.integer):
            return self._integer(np, t)
        if not np.issubdtype(t.dtype, np.floating):
            raise TypeError(f"timestep must be a real number or array, got {timestep!r}")
        if np.any(np.isnan(t)):
            raise ValueError(f"timestep must not be NaN, got {timestep!r}")
        return np.interp(t.astype(np.float64), self._ts_arr, self._vs_arr)
