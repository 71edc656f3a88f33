r"""Schedules: a stepwise linear function usable on Python numbers and traced JAX scalars."""

from __future__ import annotations

import bisect
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["StepwiseLinearFunction"]


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

    Raises
    ------
    ValueError
        If no steps are given, the timesteps are not strictly increasing, or a timestep or
        value is not finite.
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
                if not np.isfinite(x):
                    raise ValueError(f"{name} must be finite, got {x!r} in step {step!r}")
            ts.append(t)
            vs.append(float(v))
        for (t1, _), (t2, _) in zip(steps, steps[1:]):
            if not t1 < t2:
                raise ValueError(
                    f"timesteps must be strictly increasing, got {t1!r} followed by {t2!r} in "
                    f"steps {steps!r}"
                )
        self.steps = tuple((t, v) for t, v in zip(ts, vs))
        self._ts = ts
        self._vs = vs
        self._ts_arr = np.asarray(ts, np.float64)
        self._vs_arr = np.asarray(vs, np.float64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.steps}"

    def _scalar(self, t: float) -> float:
        ts, vs = self._ts, self._vs
        if t <= ts[0]:
            return vs[0]
        if t >= ts[-1]:
            return vs[-1]
        i = bisect.bisect_right(ts, t)  # ts[i - 1] <= t < ts[i]
        t0, t1, v0, v1 = ts[i - 1], ts[i], vs[i - 1], vs[i]
        return v0 + (t - t0) * (v1 - v0) / (t1 - t0)

    def __call__(self, timestep: Any) -> Any:
        r"""The value of the schedule at ``timestep``.

        Parameters
        ----------
        timestep : int, float, ndarray or jax.Array
            The step counter (traced values are fine).

        Returns
        -------
        float, ndarray or jax.Array
            A float for a Python/NumPy scalar, a float64 array for a NumPy array, a floating
            JAX array (float32 unless x64 is enabled) for JAX input.
        """
        if isinstance(timestep, (jax.Array, jax.core.Tracer)):
            dtype = jnp.result_type(float)
            t = jnp.asarray(timestep).astype(dtype)
            return jnp.interp(t, jnp.asarray(self._ts_arr, dtype), jnp.asarray(self._vs_arr, dtype))
        if isinstance(timestep, numbers.Real) and not isinstance(timestep, bool):
            return self._scalar(float(timestep))
        t = np.asarray(timestep)
        if not (np.issubdtype(t.dtype, np.integer) or np.issubdtype(t.dtype, np.floating)):
            raise TypeError(f"timestep must be a real number or array, got {timestep!r}")
        return np.interp(t.astype(np.float64), self._ts_arr, self._vs_arr)
