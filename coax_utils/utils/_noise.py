r"""Ornstein-Uhlenbeck exploration noise: a seeded host object and a pure jittable form."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_int, is_int
from coax_utils._dataclass import pytree_dataclass

__all__ = [
    "OUNoiseState",
    "OrnsteinUhlenbeckNoise",
    "ou_noise_init",
    "ou_noise_reset",
    "ou_noise_step",
]


_MAX_SEED = 2**128 - 1  # largest random_seed (larger ones would not restore from a checkpoint)


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _concrete(x: Any) -> bool:
    return x is not None and not _is_traced(x)


def _as_float_array(name: str, x: Any) -> np.ndarray:
    """``x`` as a float64 array; non-numeric values are refused with a TypeError."""
    arr = np.asarray(x)
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) and not np.issubdtype(arr.dtype, np.complexfloating)
    ):
        raise TypeError(f"{name} must be a real number or array, got {x!r}")
    return arr.astype(np.float64)


def _check_params(
    mu: Any, sigma: Any, theta: Any, min_value: Any, max_value: Any
) -> tuple[int, ...]:
    """Validate the concrete parameters (traced ones: their shapes only).

    Returns the broadcast shape of the parameters.
    """
    params = (mu, sigma, theta, min_value, max_value)
    shapes = [np.shape(x) for x in params if x is not None]  # tracers: .shape
    for name, x, low in (("mu", mu, None), ("sigma", sigma, 0.0), ("theta", theta, 0.0)):
        if not _concrete(x):
            continue
        arr = _as_float_array(name, x)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} must be finite, got {x!r}")
        if low is not None and np.any(arr < low):
            raise ValueError(f"{name} must be finite and non-negative, got {x!r}")
    bounds = {}
    for name, x in (("min_value", min_value), ("max_value", max_value)):
        if not _concrete(x):
            continue
        arr = _as_float_array(name, x)
        if np.any(np.isnan(arr)):
            raise ValueError(f"{name} must not be NaN, got {x!r}")
        bounds[name] = arr
    if len(bounds) == 2 and np.any(bounds["min_value"] > bounds["max_value"]):
        raise ValueError(
            f"min_value must not exceed max_value, got {min_value!r} > {max_value!r}"
        )
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(
            "mu, sigma, theta, min_value and max_value must broadcast with each other, got "
            f"shapes {shapes}"
        ) from None


def _in_dtype(name: str, x: Any, dtype: Any, bound: bool = False) -> np.ndarray:
    r"""The concrete parameter ``x`` cast to the (floating) action dtype.

    A clipping bound beyond the dtype's range becomes :math:`\pm\infty` (it bounds
    nothing); ``mu``, ``sigma`` and ``theta`` must fit, since they would turn into infinite
    noise and NaN actions: ValueError.
    """
    arr = np.asarray(x, np.float64)
    largest = float(jnp.finfo(dtype).max)
    beyond = np.abs(arr) > largest
    if np.any(beyond):
        if not bound:
            raise ValueError(
                f"{name} = {x!r} does not fit the action dtype {jnp.dtype(dtype).name} "
                f"(largest magnitude {largest:g})"
            )
        arr = np.where(beyond, np.copysign(np.inf, arr), arr)
    return arr.astype(dtype)


def _value_key(x: Any) -> Any:
    """What identifies the value of a parameter: type, dtype, shape and bytes (NaN-safe)."""
    if x is None or _is_traced(x):
        return (type(x), id(x))
    arr = np.asarray(x)
    return (type(x), arr.dtype.str, arr.shape, arr.tobytes())


def _check_action_shape(action_shape: tuple[int, ...], param_shape: tuple[int, ...]) -> None:
    """The parameters must broadcast to the action's shape without changing it."""
    try:
        ok = np.broadcast_shapes(action_shape, param_shape) == tuple(action_shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"the noise parameters (mu, sigma, theta, min_value, max_value) have the broadcast "
            f"shape {param_shape}, which does not fit an action of shape {tuple(action_shape)}"
        )


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
        Seed of the random state, for reproducible results: an int in
        :math:`[0, 2^{128})`.

    Raises
    ------
    ValueError
        If ``mu`` is not finite, ``sigma`` or ``theta`` is negative or not finite,
        ``min_value`` or ``max_value`` is NaN, ``min_value > max_value``, the parameters
        do not broadcast with each other, or ``random_seed`` lies outside
        :math:`[0, 2^{128})`.
    TypeError
        If a parameter is not a real number or array, or ``random_seed`` is not an int.

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
        self._param_shape = _check_params(mu, sigma, theta, min_value, max_value)
        if random_seed is not None:  # the range a checkpoint of this object can restore
            check_int(random_seed, "random_seed", low=0, high=_MAX_SEED)
        self.mu = mu
        self.sigma = sigma
        self.theta = theta
        self.min_value = min_value
        self.max_value = max_value
        self._random_seed = random_seed
        self._rng = np.random.default_rng(random_seed)
        self._checked: tuple | None = None  # see _checked_params
        self.reset()

    @property
    def random_seed(self) -> int | None:
        """The seed given to the constructor.

        Read-only: setting it would not reseed the random stream. Make a new object to start
        a new stream."""
        return self._random_seed

    @random_seed.setter
    def random_seed(self, value: Any) -> None:
        raise AttributeError(
            "random_seed is fixed at construction (setting it would not reseed the random "
            "stream); make a new OrnsteinUhlenbeckNoise(..., random_seed=...) instead"
        )

    def __checkpoint_state__(self) -> dict[str, Any]:
        """The state as plain data (parameters, random generator, running noise)."""
        return {
            "mu": self.mu,
            "sigma": self.sigma,
            "theta": self.theta,
            "min_value": self.min_value,
            "max_value": self.max_value,
            "random_seed": self.random_seed,
            "rng": self._rng,
            "noise": self._noise,
        }

    @classmethod
    def __checkpoint_restore__(cls, state: dict[str, Any]) -> OrnsteinUhlenbeckNoise:
        """Rebuild from :meth:`__checkpoint_state__`, checking every field first.

        Raises
        ------
        ValueError
            For missing or extra keys, invalid parameters, or a running noise whose dtype
            is not floating, whose shape does not fit the parameters, or whose values are
            not finite.
        TypeError
            For a field of the wrong type.
        """
        if not isinstance(state, dict):
            raise TypeError(f"OrnsteinUhlenbeckNoise state must be a dict, got {type(state)}")
        keys = {"mu", "sigma", "theta", "min_value", "max_value", "random_seed", "rng", "noise"}
        if set(state) != keys:
            raise ValueError(
                f"OrnsteinUhlenbeckNoise state needs the keys {sorted(keys)}, got "
                f"{sorted(map(str, state))}"
            )
        for name in ("mu", "sigma", "theta"):
            if state[name] is None:
                raise ValueError(f"OrnsteinUhlenbeckNoise state: {name} must not be None")
        rng = state["rng"]
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"OrnsteinUhlenbeckNoise state: rng must be a Generator, got {rng!r}")
        noise = state["noise"]
        if noise is not None:
            if not isinstance(noise, np.ndarray) or not np.issubdtype(noise.dtype, np.floating):
                raise TypeError(
                    f"OrnsteinUhlenbeckNoise state: noise must be None or a float ndarray, "
                    f"got {noise!r}"
                )
            if not np.all(np.isfinite(noise)):
                raise ValueError("OrnsteinUhlenbeckNoise state: noise must be finite")
        seed = state["random_seed"]  # seeds the constructor's generator, replaced below
        if is_int(seed) and not 0 <= seed <= _MAX_SEED:  # other types: the constructor says
            raise ValueError(
                "OrnsteinUhlenbeckNoise state: random_seed must lie in [0, 2**128)"
            )
        params = [state[k] for k in ("mu", "sigma", "theta", "min_value", "max_value")]
        shapes = [np.shape(x) for x in params if x is not None]
        try:
            size = int(np.prod(np.broadcast_shapes(*shapes)))
        except ValueError:
            size = 0  # the constructor says why
        if size > max(int(np.prod(shape)) for shape in shapes):
            raise ValueError(
                "OrnsteinUhlenbeckNoise state: the parameters broadcast to a shape larger than "
                "each of them"
            )
        obj = cls(
            mu=state["mu"],
            sigma=state["sigma"],
            theta=state["theta"],
            min_value=state["min_value"],
            max_value=state["max_value"],
            random_seed=state["random_seed"],
        )
        if noise is not None:
            _check_action_shape(noise.shape, obj._param_shape)
        obj._rng = rng
        obj._noise = noise
        return obj

    def __reduce__(self) -> tuple:
        return (type(self).__checkpoint_restore__, (self.__checkpoint_state__(),))

    def reset(self) -> None:
        r"""Reset the Ornstein-Uhlenbeck process: the next call starts again from
        :math:`X_0 = \mu`. The random stream continues (it is not reseeded)."""
        self._noise: np.ndarray | None = None

    def _checked_params(self, dtype: np.dtype) -> tuple[tuple[int, ...], Any, Any]:
        """Check the parameters for actions of ``dtype``; their broadcast shape and the
        clipping bounds in ``dtype`` (None for no bound).

        The parameters are public attributes, so they may have been set (or changed in
        place) since the constructor checked them. The checks are redone whenever their
        values differ from the last ones checked (a cheap comparison of their bytes).
        """
        params = (self.mu, self.sigma, self.theta, self.min_value, self.max_value)
        key = (dtype.str, *(_value_key(x) for x in params))
        if self._checked is None or self._checked[0] != key:
            param_shape = _check_params(*params)
            for name in ("mu", "sigma", "theta"):
                _in_dtype(name, getattr(self, name), dtype)
            low, high = (
                None if x is None else _in_dtype(name, x, dtype, bound=True)
                for name, x in (("min_value", self.min_value), ("max_value", self.max_value))
            )
            self._checked = (key, param_shape, low, high)
            self._param_shape = param_shape
        return self._checked[1:]

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
            If the shape of ``a`` differs from the previous call's without a :meth:`reset`,
            the parameters do not broadcast to it, ``mu``, ``sigma`` or ``theta`` does not
            fit its dtype (e.g. ``mu=1e5`` for float16 actions; bounds beyond the dtype's
            range simply bound nothing), or a parameter set after construction
            (e.g. ``noise.sigma = ...``) breaks a rule of the constructor. Nothing changes
            then (the running noise and the random stream stay as they were).
        TypeError
            If ``a`` is not a real number or array.
        """
        a = np.asarray(a)
        if a.dtype == object or not (
            np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_
        ) or np.issubdtype(a.dtype, np.complexfloating):
            raise TypeError(f"the action must be a real number or array, got {a!r}")
        if not np.issubdtype(a.dtype, np.floating):
            a = a.astype(np.float64)
        param_shape, low, high = self._checked_params(a.dtype)
        _check_action_shape(a.shape, param_shape)
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
        if low is not None or high is not None:
            out = np.clip(out, low, high)
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
        If ``mu`` is not finite, ``sigma`` or ``theta`` is negative or not finite,
        ``min_value`` or ``max_value`` is NaN, ``min_value > max_value`` (checked when the
        values are concrete), a concrete ``mu``, ``sigma`` or ``theta`` does not fit the
        action's dtype (bounds beyond its range become infinite), or a parameter does not
        broadcast to the action's shape (checked always: shapes are static).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> state = ou_noise_init(jnp.zeros(2), sigma=0.2, min_value=-1.0, max_value=1.0)
    >>> step = jax.jit(ou_noise_step)
    >>> a, state = step(jax.random.key(0), jnp.zeros(2), state)
    >>> a.shape, bool(jnp.all(jnp.abs(a) <= 1.0))
    ((2,), True)
    """
    shape = np.shape(action)  # np.shape: also lists, tracers and ShapeDtypeStructs
    _check_action_shape(shape, _check_params(mu, sigma, theta, min_value, max_value))
    dtype = getattr(action, "dtype", None)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(jnp.float32)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.dtype(jnp.float32)

    def arr(name: str, x: Any, default: float) -> jax.Array:
        if x is None or _is_traced(x):
            return jnp.asarray(default if x is None else x, dtype)
        return jnp.asarray(_in_dtype(name, x, dtype, bound=name.endswith("_value")))

    mu = arr("mu", mu, 0.0)
    return OUNoiseState(
        noise=jnp.broadcast_to(mu, shape).astype(dtype),
        mu=mu,
        sigma=arr("sigma", sigma, 1.0),
        theta=arr("theta", theta, 0.15),
        min_value=arr("min_value", min_value, -jnp.inf),
        max_value=arr("max_value", max_value, jnp.inf),
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
        The state holding :math:`X_t` (in the dtype of the noise, also when parameters of
        another dtype were put into the state with ``replace``).

    Raises
    ------
    ValueError
        While tracing, if ``action`` does not have the shape of ``noise_state.noise``
        (no broadcasting), or a parameter of the state does not broadcast to it.
    """
    s = noise_state
    shape = tuple(s.noise.shape)
    if np.shape(action) != shape:
        raise ValueError(
            f"action of shape {np.shape(action)} does not match the noise state's "
            f"shape {shape}; make the state with ou_noise_init for actions of that shape"
        )
    for name in ("mu", "sigma", "theta", "min_value", "max_value"):
        _check_action_shape(shape, np.shape(getattr(s, name)))
    dtype = s.noise.dtype  # kept, whatever dtypes parameters put into the state have
    eps = jax.random.normal(key, s.noise.shape, dtype)
    noise = (s.noise + s.theta * (s.mu - s.noise) + s.sigma * eps).astype(dtype)
    noisy = jnp.clip(jnp.asarray(action, dtype) + noise, s.min_value, s.max_value)
    return noisy.astype(dtype), s.replace(noise=noise)


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
