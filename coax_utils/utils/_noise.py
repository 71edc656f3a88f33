r"""Ornstein-Uhlenbeck exploration noise: a seeded host object and a pure jittable form."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._dataclass import pytree_dataclass

__all__ = [
    "OUNoiseState",
    "OrnsteinUhlenbeckNoise",
    "ou_noise_init",
    "ou_noise_reset",
    "ou_noise_step",
]


def _check_params(sigma: Any, theta: Any, min_value: Any, max_value: Any) -> None:
    """Validate concrete parameters (traced ones are left alone)."""
    checks = {"sigma": sigma, "theta": theta}
    for name, x in checks.items():
        if isinstance(x, jax.core.Tracer):
            continue
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x) & (x >= 0)):
            raise ValueError(f"{name} must be finite and non-negative, got {x}")
    if min_value is None or max_value is None:
        return
    if isinstance(min_value, jax.core.Tracer) or isinstance(max_value, jax.core.Tracer):
        return
    lo, hi = np.asarray(min_value, np.float64), np.asarray(max_value, np.float64)
    if np.any(lo > hi):
        raise ValueError(f"min_value must not exceed max_value, got {lo} > {hi}")


class OrnsteinUhlenbeckNoise:
    r"""Add Ornstein-Uhlenbeck noise to continuous actions.

    .. math::

        A_t\ \mapsto\ \widetilde{A}_t = \text{clip}(A_t + X_t,\ a_\text{min},\ a_\text{max})

    As a side effect, the Ornstein-Uhlenbeck noise :math:`X_t` is updated with every call:

    .. math::

        X_t\ =\ X_{t-1} - \theta\,\left(X_{t-1} - \mu\right) + \sigma\,\varepsilon

    where :math:`\varepsilon\sim\mathcal{N}(0,\mathbb{I})` is white noise and :math:`X_0 = \mu`.
    For :math:`0 < \theta < 2` the process is mean-reverting with stationary variance
    :math:`\sigma^2 / (\theta\,(2 - \theta))`. Temporally correlated noise explores well in
    physical environments that have momentum (as in DDPG).

    This is the seeded, stateful host-side object; inside jitted code use the pure
    counterpart :func:`ou_noise_init` / :func:`ou_noise_step`.

    Parameters
    ----------
    mu : float or ndarray, optional
        The mean :math:`\mu` towards which the process reverts; broadcastable with the actions.
    sigma : non-negative float or ndarray, optional
        The spread :math:`\sigma` of the noise; broadcastable with the actions.
    theta : non-negative float or ndarray, optional
        The (element-wise) dissipation rate :math:`\theta`; broadcastable with the actions.
    min_value : float or ndarray, optional
        Lower bound for clipping the output action (no clipping if None).
    max_value : float or ndarray, optional
        Upper bound for clipping the output action (no clipping if None).
    random_seed : int, optional
        Seed of the random state, for reproducible results.

    Raises
    ------
    ValueError
        If ``sigma`` or ``theta`` is negative or not finite, or ``min_value > max_value``.

    Examples
    --------
    >>> import numpy as np
    >>> noise = OrnsteinUhlenbeckNoise(sigma=0.5, min_value=-1.0, max_value=1.0, random_seed=7)
    >>> a = noise(np.zeros(3, dtype=np.float32))
    >>> a.shape, a.dtype, bool(np.all(np.abs(a) <= 1.0))
    ((3,), dtype('float32'), True)
    >>> noise.reset()  # start a new episode: X_0 = mu again
    """

    def __init__(
        self,
        mu: Any = 0.0,
        sigma: Any = 1.0,
        theta: Any = 0.15,
        min_value: Any = None,
        max_value: Any = None,
        random_seed: int | None = None,
    ):
        _check_params(sigma, theta, min_value, max_value)
        self.mu = mu
        self.sigma = sigma
        self.theta = theta
        self.min_value = min_value
        self.max_value = max_value
        self.random_seed = random_seed
        self._rng = np.random.default_rng(random_seed)
        self.reset()

    def reset(self) -> None:
        r"""Reset the Ornstein-Uhlenbeck process: the next call starts again from
        :math:`X_0 = \mu`. The random stream continues (it is not reseeded)."""
        self._noise: np.ndarray | None = None

    def __call__(self, a: Any) -> np.ndarray:
        r"""Add Ornstein-Uhlenbeck noise to a continuous action.

        Parameters
        ----------
        a : array_like
            A single action :math:`A_t` (any shape, floating point).

        Returns
        -------
        ndarray
            The noisy action :math:`\widetilde{A}_t`, same shape and dtype as ``a``
            (float64 for integer input).

        Raises
        ------
        ValueError
            If the shape of ``a`` differs from the previous call's without a :meth:`reset`.
        """
        a = np.asarray(a)
        if not np.issubdtype(a.dtype, np.floating):
            a = a.astype(np.float64)
        if self._noise is None:
            self._noise = np.broadcast_to(np.asarray(self.mu, a.dtype), a.shape).copy()
        elif self._noise.shape != a.shape:
            raise ValueError(
                f"action shape {a.shape} differs from the shape {self._noise.shape} of the "
                "running noise; call reset() when the action shape changes"
            )
        eps = self._rng.standard_normal(a.shape).astype(a.dtype)
        noise = self._noise + self.theta * (self.mu - self._noise) + self.sigma * eps
        self._noise = np.asarray(noise, a.dtype)
        out = a + self._noise
        if self.min_value is not None or self.max_value is not None:
            out = np.clip(out, self.min_value, self.max_value)
        return np.asarray(out, a.dtype)


@pytree_dataclass
class OUNoiseState:
    r"""State of the pure Ornstein-Uhlenbeck process (a pytree; see :func:`ou_noise_init`).

    Attributes
    ----------
    noise : Array
        The current noise :math:`X_t`, shape of the actions.
    mu, sigma, theta : Array
        Process parameters, broadcastable with ``noise``.
    min_value, max_value : Array
        Clipping bounds of the output action (:math:`\mp\infty` for none).
    """

    noise: jax.Array
    mu: jax.Array
    sigma: jax.Array
    theta: jax.Array
    min_value: jax.Array
    max_value: jax.Array


def ou_noise_init(
    action: Any,
    mu: Any = 0.0,
    sigma: Any = 1.0,
    theta: Any = 0.15,
    min_value: Any = None,
    max_value: Any = None,
) -> OUNoiseState:
    r"""Initial state of a pure Ornstein-Uhlenbeck process for actions like ``action``.

    The pure counterpart of :class:`OrnsteinUhlenbeckNoise`: same parameters and update
    rule, with the randomness passed explicitly as a ``jax.random`` key to
    :func:`ou_noise_step`.

    Parameters
    ----------
    action : Array or ShapeDtypeStruct
        An example action; only its shape and (floating point) dtype are used.
    mu, sigma, theta, min_value, max_value
        As in :class:`OrnsteinUhlenbeckNoise` (broadcastable with the action).

    Returns
    -------
    OUNoiseState
        The state with :math:`X_0 = \mu`.

    Raises
    ------
    ValueError
        If ``sigma`` or ``theta`` is negative or not finite, or ``min_value > max_value``
        (checked when the values are concrete).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> state = ou_noise_init(jnp.zeros(2), sigma=0.2, min_value=-1.0, max_value=1.0)
    >>> step = jax.jit(ou_noise_step)
    >>> a, state = step(jax.random.key(0), jnp.zeros(2), state)
    >>> a.shape, bool(jnp.all(jnp.abs(a) <= 1.0))
    ((2,), True)
    """
    _check_params(sigma, theta, min_value, max_value)
    shape = jnp.shape(action)
    dtype = getattr(action, "dtype", None)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(jnp.float32)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.dtype(jnp.float32)

    def arr(x: Any, default: float) -> jax.Array:
        return jnp.asarray(default if x is None else x, dtype)

    mu = arr(mu, 0.0)
    return OUNoiseState(
        noise=jnp.broadcast_to(mu, shape).astype(dtype),
        mu=mu,
        sigma=arr(sigma, 1.0),
        theta=arr(theta, 0.15),
        min_value=arr(min_value, -jnp.inf),
        max_value=arr(max_value, jnp.inf),
    )


def ou_noise_step(
    key: jax.Array, action: jax.Array, noise_state: OUNoiseState
) -> tuple[jax.Array, OUNoiseState]:
    r"""Advance the Ornstein-Uhlenbeck process one step and add it to ``action``.

    .. math::

        X_t = X_{t-1} - \theta\,(X_{t-1} - \mu) + \sigma\,\varepsilon,\qquad
        \widetilde{A}_t = \text{clip}(A_t + X_t,\ a_\text{min},\ a_\text{max})

    Pure and jittable (and vmappable over keys, actions and states).

    Parameters
    ----------
    key : jax.Array
        A ``jax.random`` key for the white noise :math:`\varepsilon`.
    action : Array
        The action :math:`A_t`, shape of ``noise_state.noise``.
    noise_state : OUNoiseState
        The current state.

    Returns
    -------
    noisy_action : Array
        :math:`\widetilde{A}_t`, the dtype of the noise.
    noise_state : OUNoiseState
        The state holding :math:`X_t`.
    """
    s = noise_state
    eps = jax.random.normal(key, s.noise.shape, s.noise.dtype)
    noise = s.noise + s.theta * (s.mu - s.noise) + s.sigma * eps
    noisy = jnp.clip(jnp.asarray(action, s.noise.dtype) + noise, s.min_value, s.max_value)
    return noisy, s.replace(noise=noise)


def ou_noise_reset(noise_state: OUNoiseState) -> OUNoiseState:
    r"""Reset the process to :math:`X_0 = \mu` (e.g. at the start of an episode).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> state = ou_noise_init(jnp.zeros(3), mu=0.5)
    >>> _, state = ou_noise_step(jax.random.key(0), jnp.zeros(3), state)
    >>> ou_noise_reset(state).noise.tolist()
    [0.5, 0.5, 0.5]
    """
    s = noise_state
    return s.replace(noise=jnp.broadcast_to(s.mu, s.noise.shape).astype(s.noise.dtype))
