"""Helpers around gymnasium envs and spaces: wrapper attributes, sampling, preprocessors,
episode rendering and DeepMind Control suite envs."""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from typing import Any

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_int

__all__ = [
    "check_preprocessors",
    "default_preprocessor",
    "get_env_attr",
    "has_env_attr",
    "make_dmc",
    "render_episode",
    "safe_sample",
]

_ERROR = "__ERROR__"


def _find_env_attr(env: Any, attr: str, max_depth: int) -> tuple[bool, Any]:
    if not isinstance(attr, str):
        raise TypeError(f"attr must be a str, got {attr!r}")
    e = env
    for _ in range(check_int(max_depth, "max_depth", low=1)):
        # look in the instance and its class only: gymnasium wrappers do not forward
        # attribute access, so each level is inspected explicitly
        try:
            return True, object.__getattribute__(e, attr)
        except AttributeError:
            pass
        if not hasattr(e, "env"):
            break
        e = e.env
    return False, None


def has_env_attr(env: Any, attr: str, max_depth: int = 100) -> bool:
    """Check if a potentially wrapped environment has a given attribute.

    Wrappers are traversed from the outside in through their ``env`` attribute.

    Parameters
    ----------
    env : gymnasium environment
        A potentially wrapped environment.
    attr : str
        The attribute name.
    max_depth : positive int, optional
        The maximum depth of wrappers to traverse.

    Returns
    -------
    bool
        Whether the env or one of the (at most ``max_depth``) envs it wraps has ``attr``.

    Examples
    --------
    >>> import gymnasium
    >>> env = gymnasium.make("CartPole-v1")
    >>> has_env_attr(env, "theta_threshold_radians"), has_env_attr(env, "no_such_thing")
    (True, False)
    """
    return _find_env_attr(env, attr, max_depth)[0]


def get_env_attr(env: Any, attr: str, default: Any = _ERROR, max_depth: int = 100) -> Any:
    """Get the given attribute from a potentially wrapped environment.

    Note that the wrapped envs are traversed from the outside in. Once the attribute is
    found, the search stops. This means that an inner wrapped env may carry the same
    (possibly conflicting) attribute. This situation is *not* resolved by this function.

    Parameters
    ----------
    env : gymnasium environment
        A potentially wrapped environment.
    attr : str
        The attribute name.
    default : object, optional
        What to return when no level has the attribute. Without it, a missing attribute
        raises :class:`AttributeError`.
    max_depth : positive int, optional
        The maximum depth of wrappers to traverse.

    Returns
    -------
    object
        The attribute value of the outermost env that has it.

    Raises
    ------
    AttributeError
        When the attribute is missing and no ``default`` is given.

    Examples
    --------
    >>> import gymnasium
    >>> env = gymnasium.make("CartPole-v1")
    >>> get_env_attr(env, "theta_threshold_radians") > 0
    True
    >>> get_env_attr(env, "no_such_thing", default=None) is None
    True
    """
    found, value = _find_env_attr(env, attr, max_depth)
    if found:
        return value
    if isinstance(default, str) and default == _ERROR:
        raise AttributeError(
            f"env is missing attribute {attr!r} (searched {type(env).__name__} and the envs it "
            f"wraps, up to depth {max_depth})"
        )
    return default


def _rng(seed: Any) -> np.random.Generator | np.random.RandomState:
    if isinstance(seed, (np.random.Generator, np.random.RandomState)):
        return seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"seed must be an int, a numpy random generator or None, got {seed!r}")
    return np.random.default_rng(seed)


def _uniform(rng: Any, size: Any) -> np.ndarray:
    return rng.random(size) if isinstance(rng, np.random.Generator) else rng.random_sample(size)


def _integers(rng: Any, low: Any, high: Any, size: Any = None) -> Any:
    """Integers in ``[low, high)``, for both numpy generator APIs."""
    if isinstance(rng, np.random.Generator):
        return rng.integers(low, high, size=size)
    return rng.randint(low, high, size=size)


def _sample_integer_box(space: gymnasium.spaces.Box, rng: Any) -> np.ndarray:
    r"""An element of an integer (or bool) box; no huge numbers for very wide dimensions.

    The rule of float boxes, in exact integer arithmetic: dimensions narrower than
    :math:`10^6`, or with both bounds inside :math:`\pm 10^6`, are sampled uniformly; in the
    others, a bound that keeps the samples away from zero (or lies inside :math:`\pm 10^6`)
    plus or minus a whole standard exponential, else a rounded standard normal.
    """
    shape, dtype = space.shape, space.dtype
    low, high = space.low, space.high
    low_f, high_f = low.astype(np.float64), high.astype(np.float64)
    # exact widths, sums and differences: in the unsigned type of the same size, whose
    # wraparound gives them exactly whenever the result lies in the box
    udtype = np.dtype(f"uint{8 * dtype.itemsize}")
    width = (high.astype(udtype) - low.astype(udtype)).astype(np.float64)
    below, above = _bounds_to_sample_from(low_f, high_f, width < 1e6)
    narrow = below & above
    width = np.where(narrow, width, 0.0)
    offset = np.floor(_uniform(rng, shape) * (width + 1)).astype(np.int64)
    uniform = (low.astype(udtype) + offset.astype(udtype)).astype(dtype)
    if np.all(narrow):
        return uniform
    e, n = rng.standard_exponential(shape), rng.standard_normal(shape)
    k = np.floor(e).astype(udtype)  # less than the width of a wide dimension
    from_low = (low.astype(udtype) + k).astype(dtype)
    from_high = (high.astype(udtype) - k).astype(dtype)
    n = np.where(below | above, 0.0, np.rint(n))  # used where low < -1e6 and high > 1e6
    around_zero = n.astype(np.int64).astype(dtype)
    from_above = np.where(above, from_high, around_zero)
    return np.where(below, np.where(above, uniform, from_low), from_above)


def _bounds_to_sample_from(
    low: np.ndarray, high: np.ndarray, narrow: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    r"""Which box bounds :func:`safe_sample` starts from (float64 bounds, per dimension).

    Both bounds (a uniform sample) where the box is narrow; else each finite bound that lies
    inside :math:`\pm 10^6` or keeps the box away from zero (a low bound above zero, a high
    bound below zero), so that samples stay of order one or near the box's edge."""
    below = np.isfinite(low) & ((np.abs(low) < 1e6) | (low > 0) | narrow)
    above = np.isfinite(high) & ((np.abs(high) < 1e6) | (high < 0) | narrow)
    return below, above


def _safe_sample(space: gymnasium.Space, rng: Any) -> Any:
    s = gymnasium.spaces
    if isinstance(space, s.Discrete):
        return space.dtype.type(space.start + _integers(rng, 0, int(space.n)))
    if isinstance(space, s.MultiDiscrete):
        nvec = space.nvec.astype(np.int64)
        u = _uniform(rng, space.shape)
        return (space.start + np.minimum(np.floor(u * nvec), nvec - 1)).astype(space.dtype)
    if isinstance(space, s.MultiBinary):
        return _integers(rng, 0, 2, size=space.shape).astype(space.dtype)
    if isinstance(space, s.Box):
        if np.issubdtype(space.dtype, np.integer) or space.dtype == np.bool_:
            return _sample_integer_box(space, rng)
        low = space.low.astype(np.float64)
        high = space.high.astype(np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, not narrow
            narrow = high - low < 1e6
        below, above = _bounds_to_sample_from(low, high, narrow)
        u = _uniform(rng, space.shape)
        e = rng.standard_exponential(space.shape)
        n = rng.standard_normal(space.shape)
        lo = np.where(below, low, 0.0)
        hi = np.where(above, high, 0.0)
        x = np.where(
            below & above,
            lo + u * (hi - lo),
            np.where(below, lo + e, np.where(above, hi - e, n)),
        )
        x = np.clip(x.astype(space.dtype), space.low, space.high)
        return x
    if isinstance(space, s.Tuple):
        return tuple(_safe_sample(sp, rng) for sp in space.spaces)
    if isinstance(space, s.Dict):
        return {k: _safe_sample(sp, rng) for k, sp in space.spaces.items()}
    # other spaces (Text, Graph, ...): sample a seeded copy, leaving the space's RNG alone
    space = copy.deepcopy(space)
    space.seed(int(_integers(rng, 0, np.iinfo(np.int32).max)))
    return space.sample()


def safe_sample(space: gymnasium.Space, seed: Any = None) -> Any:
    """Safely sample from a gymnasium-style space.

    Unlike ``space.sample()``, this neither touches the space's own random generator nor
    produces huge numbers for unbounded or very wide boxes: bounded box dimensions are
    sampled uniformly, half-bounded ones as the bound plus or minus a standard exponential,
    and unbounded ones from a standard normal. A bound beyond :math:`10^6` counts as none,
    unless the dimension is narrower than :math:`10^6` (then it is sampled uniformly,
    wherever it lies) or the bound keeps the box away from zero (a low bound above
    :math:`10^6`, a high bound below :math:`-10^6`: samples start from it). Integer boxes
    follow the same rule (with whole exponentials and rounded normals). Samples are
    elements of the space, with the space's dtype. Tuple and Dict spaces are sampled
    recursively; other spaces fall back to ``sample()`` on a seeded copy.

    Parameters
    ----------
    space : gymnasium.Space
        A gymnasium-style space.
    seed : int or numpy random generator, optional
        The seed for the pseudo-random number generator (a ``numpy.random.Generator`` or
        ``RandomState`` is used as it is).

    Returns
    -------
    sample
        A single sample from the given ``space``.

    Examples
    --------
    >>> import gymnasium
    >>> space = gymnasium.spaces.Box(low=-1.0, high=1.0, shape=(3,))
    >>> x = safe_sample(space, seed=13)
    >>> x.shape, x.dtype, bool(space.contains(x))
    ((3,), dtype('float32'), True)
    """
    if not isinstance(space, gymnasium.Space):
        raise TypeError(f"space must be a gymnasium.Space, got {space!r}")
    return _safe_sample(space, _rng(seed))


def _with_batch_axis(X: jax.Array, space: gymnasium.Space) -> jax.Array:
    """``X`` reshaped to ``(-1, *space.shape)``.

    The trailing axes of ``X`` must be ``space.shape``, except that unit axes do not count:
    a single element may have more or fewer of them, and a space of size one takes any shape
    (a batch of ``X.size`` elements)."""
    shape = tuple(space.shape)
    trailing = X.ndim >= len(shape) and X.shape[X.ndim - len(shape) :] == shape
    squeezed = [d for d in X.shape if d != 1] == [d for d in shape if d != 1]
    if not (trailing or squeezed or math.prod(shape) == 1):
        raise ValueError(
            f"an element (or batch of elements) of {space} must have the shape {shape} "
            f"(or (..., *{shape})), got shape {X.shape}"
        )
    return jnp.reshape(X, (-1, *shape))


def default_preprocessor(space: gymnasium.Space) -> Callable[[jax.Array, Any], Any]:
    """The default preprocessor for a given space.

    The preprocessor ``func(rng, X)`` maps a single element or a batch of elements of
    ``space`` to arrays with a leading batch axis. For Box, MultiDiscrete and MultiBinary
    spaces the trailing axes of ``X`` must be the space's shape (leading batch axes are
    flattened into one; unit axes aside); another shape raises :class:`ValueError` (at trace
    time under jit) instead of being reshaped into elements that were never given:

    - Box: ``X`` as the box's (JAX) dtype, reshaped to ``(-1, *shape)`` and clipped to the
      bounds (integer bounds beyond that dtype's range, e.g. int64 bounds without x64, are
      clipped into it);
    - Discrete: one-hot encoding of ``X - start``, shape ``(-1, n)``;
    - MultiDiscrete: a list with the one-hot encoding of each entry (flattened order);
    - MultiBinary: float32, shape ``(-1, *shape)``;
    - Tuple, Dict: a tuple or dict of the subspaces' preprocessed values.

    The function is pure and jittable.

    Parameters
    ----------
    space : gymnasium.Space
        The domain of the preprocessor.

    Returns
    -------
    preprocessor : Callable[[PRNGKey, Element[space]], Any]
        The preprocessor function.

    Raises
    ------
    TypeError
        For other spaces.

    Examples
    --------
    >>> import gymnasium, jax
    >>> f = default_preprocessor(gymnasium.spaces.Discrete(3))
    >>> f(jax.random.key(0), 2)
    Array([[0., 0., 1.]], dtype=float32)
    """
    s = gymnasium.spaces
    if not isinstance(space, gymnasium.Space):
        raise TypeError(f"space must be a gymnasium.Space, got {space!r}")

    if isinstance(space, s.Discrete):
        n, start = int(space.n), int(space.start)

        def func(rng: jax.Array, X: Any) -> jax.Array:
            X = jnp.asarray(X)
            return jnp.reshape(jax.nn.one_hot(X - start, n), (-1, n))

    elif isinstance(space, s.Box):
        dtype = jax.dtypes.canonicalize_dtype(space.dtype)
        low, high = space.low, space.high
        if np.issubdtype(dtype, np.integer):
            # without x64, int64 bounds become int32: clip them into its range first, as a
            # plain cast wraps them around (iinfo(int64).max -> -1)
            info = np.iinfo(dtype)
            low, high = np.clip(low, info.min, info.max), np.clip(high, info.min, info.max)
        low, high = np.asarray(low, dtype), np.asarray(high, dtype)

        def func(rng: jax.Array, X: Any) -> jax.Array:
            return jnp.clip(_with_batch_axis(jnp.asarray(X, dtype), space), low, high)

    elif isinstance(space, s.MultiDiscrete):
        nvec = space.nvec.ravel().astype(int).tolist()
        start = space.start.ravel().astype(int).tolist()
        size = len(nvec)

        def func(rng: jax.Array, X: Any) -> list:
            X = jnp.reshape(_with_batch_axis(jnp.asarray(X), space), (-1, size))
            return [jax.nn.one_hot(X[:, i] - start[i], n) for i, n in enumerate(nvec)]

    elif isinstance(space, s.MultiBinary):

        def func(rng: jax.Array, X: Any) -> jax.Array:
            return _with_batch_axis(jnp.asarray(X, jnp.float32), space)

    elif isinstance(space, s.Tuple):
        subs = [default_preprocessor(sp) for sp in space.spaces]

        def func(rng: jax.Array, X: Any) -> tuple:
            keys = jax.random.split(rng, len(subs))
            return tuple(f(k, X[i]) for i, (f, k) in enumerate(zip(subs, keys)))

    elif isinstance(space, s.Dict):
        subs_d = {k: default_preprocessor(sp) for k, sp in space.spaces.items()}

        def func(rng: jax.Array, X: Any) -> dict:
            keys = jax.random.split(rng, len(subs_d))
            return {k: f(kk, X[k]) for (k, f), kk in zip(subs_d.items(), keys)}

    else:
        raise TypeError(
            f"default_preprocessor does not support {type(space).__name__} spaces ({space!r}); "
            "supported: Box, Discrete, MultiDiscrete, MultiBinary, Tuple, Dict"
        )

    return func


def check_preprocessors(
    space: gymnasium.Space,
    *preprocessors: Callable,
    num_samples: int = 20,
    random_seed: int | None = None,
) -> bool:
    """Check whether two (or more) preprocessors are the same.

    Every preprocessor is applied to the same ``num_samples`` elements of ``space`` (drawn
    with :func:`safe_sample`), each call for one element getting the same PRNG key; the
    outputs must have the same pytree structure and shapes, and equal values up to float
    round-off (``rtol=1e-6``); NaN matches NaN in the same place.

    Parameters
    ----------
    space : gymnasium.Space
        The domain of the preprocessors.
    *preprocessors
        Preprocessor functions, which are functions with input signature
        ``func(rng: PRNGKey, x: Element[space]) -> Any``.
    num_samples : positive int
        The number of samples in which to run checks.
    random_seed : int, optional
        Seed for the samples and keys.

    Returns
    -------
    match : bool
        Whether the preprocessors match.

    Raises
    ------
    ValueError
        With fewer than two preprocessors, or a non-positive ``num_samples``.

    Examples
    --------
    >>> import gymnasium, jax.numpy as jnp
    >>> space = gymnasium.spaces.Discrete(4)
    >>> f = default_preprocessor(space)
    >>> g = lambda rng, x: jnp.eye(4)[jnp.asarray(x)][None]
    >>> check_preprocessors(space, f, g, random_seed=0)
    True
    """
    if len(preprocessors) < 2:
        raise ValueError(
            f"need at least two preprocessors in order to run the check, got {len(preprocessors)}"
        )
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)):
        raise TypeError(f"num_samples must be a positive int, got {num_samples!r}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    rng = np.random.default_rng(random_seed)
    p0, *ps = preprocessors
    for _ in range(int(num_samples)):
        x = safe_sample(space, rng)
        key = jax.random.key(int(rng.integers(0, np.iinfo(np.int32).max)))
        y0 = p0(key, x)
        leaves0, tree0 = jax.tree_util.tree_flatten(y0)
        for p in ps:
            leaves, tree = jax.tree_util.tree_flatten(p(key, x))
            if tree != tree0:
                return False
            for a, b in zip(leaves, leaves0):
                a, b = np.asarray(a), np.asarray(b)
                if a.shape != b.shape or not np.allclose(a, b, 1e-6, 1e-7, equal_nan=True):
                    return False
    return True


def render_episode(
    env: gymnasium.Env, policy: Callable[[Any], Any] | None = None, step_delay_ms: float = 0
) -> float:
    """Run a single episode with ``env.render()`` calls with each time step.

    The env is reset, rendered, and then stepped and rendered until the episode terminates
    or is truncated. Make the env with ``render_mode="human"`` to watch it.

    Parameters
    ----------
    env : gymnasium environment
        A gymnasium environment.
    policy : callable, optional
        A policy objects that is used to pick actions: ``a = policy(s)``. If left
        unspecified, we'll just take random actions instead, i.e.
        ``a = env.action_space.sample()``.
    step_delay_ms : non-negative float
        The number of milliseconds to wait between consecutive timesteps. This can be used
        to slow down the rendering.

    Returns
    -------
    float
        The undiscounted return of the episode.

    Raises
    ------
    TypeError
        If ``policy`` is not callable or ``step_delay_ms`` is not a number.
    ValueError
        If ``step_delay_ms`` is negative, NaN or infinite (checked before the env is reset).
    """
    if isinstance(step_delay_ms, bool) or not isinstance(step_delay_ms, (int, float, np.number)):
        raise TypeError(f"step_delay_ms must be a non-negative number, got {step_delay_ms!r}")
    if not 0 <= step_delay_ms < np.inf:
        raise ValueError(
            f"step_delay_ms must be a finite non-negative number, got {step_delay_ms!r}"
        )
    if policy is not None and not callable(policy):
        raise TypeError(f"policy must be callable, got {policy!r}")
    s, _ = env.reset()
    env.render()
    total = 0.0
    while True:
        a = env.action_space.sample() if policy is None else policy(s)
        s, r, terminated, truncated, _ = env.step(a)
        total += float(r)
        env.render()
        if step_delay_ms:
            time.sleep(step_delay_ms / 1e3)
        if terminated or truncated:
            return total


_DMC_MAX_SEED = 2**32 - 1  # dm_control seeds a numpy RandomState


class _DmcEnv(gymnasium.Env):
    """A DeepMind Control suite task as a gymnasium env (observations flattened)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, domain: str, task: str, seed: int, height: int, width: int, camera_id: int):
        from dm_control import suite

        self._suite = suite
        self.domain, self.task = domain, task
        self.height, self.width, self.camera_id = height, width, camera_id
        self.render_mode = "rgb_array"
        self._load(seed)
        num_cameras = int(self._env.physics.model.ncam)
        if camera_id >= num_cameras:
            self._env.close()
            raise ValueError(
                f"camera_id must be -1 (free camera) or one of the {num_cameras} fixed cameras "
                f"of {domain}/{task} (0 .. {num_cameras - 1}), got {camera_id}"
            )
        spec = self._env.action_spec()
        self.action_space = gymnasium.spaces.Box(
            np.asarray(np.broadcast_to(spec.minimum, spec.shape), np.float32),
            np.asarray(np.broadcast_to(spec.maximum, spec.shape), np.float32),
            spec.shape,
            np.float32,
        )
        dim = sum(int(np.prod(v.shape)) for v in self._env.observation_spec().values())
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (dim,), np.float32)

    def _load(self, seed: int) -> None:
        self._env = self._suite.load(self.domain, self.task, task_kwargs={"random": int(seed)})

    def _flat(self, observation: dict) -> np.ndarray:
        parts = [np.asarray(v, np.float32).ravel() for v in observation.values()]
        return np.concatenate(parts).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        if seed is not None:  # before anything is reseeded
            seed = check_int(seed, "seed", low=0, high=_DMC_MAX_SEED)
        super().reset(seed=seed)
        if seed is not None:
            self._load(seed)
        return self._flat(self._env.reset().observation), {}

    def step(self, action: Any) -> tuple:
        action = np.asarray(action, np.float64).reshape(self.action_space.shape)
        ts = self._env.step(action)
        last = bool(ts.last())
        # dm_control ends episodes at its time limit with discount 1: that is a truncation
        terminated = last and float(ts.discount) == 0.0
        truncated = last and not terminated
        reward = 0.0 if ts.reward is None else float(ts.reward)
        return self._flat(ts.observation), reward, terminated, truncated, {}

    def render(self) -> np.ndarray:
        return self._env.physics.render(
            height=self.height, width=self.width, camera_id=self.camera_id
        )

    def close(self) -> None:
        self._env.close()


def make_dmc(
    domain: str,
    task: str,
    seed: int = 0,
    max_episode_steps: int = 1000,
    height: int = 84,
    width: int = 84,
    camera_id: int = 0,
) -> gymnasium.Env:
    """Create a Gym environment for a DeepMind Control suite task.

    The observation dict of the task is flattened into one float32 vector; actions are a
    float32 box; ``render()`` returns ``(height, width, 3)`` uint8 frames from ``camera_id``
    (render mode ``"rgb_array"``). The end of a dm_control episode at its own time limit is
    reported as truncation, a terminal step (discount 0) as termination. ``reset(seed=s)``
    reloads the task with seed ``s`` (an int in :math:`[0, 2^{32})`, checked before anything
    is reseeded). Rendering is headless: ``MUJOCO_GL`` defaults to
    ``"egl"`` (set it before calling to choose another backend, e.g. ``"osmesa"``).

    Needs the ``dmc`` extra: ``pip install coax_utils[dmc]``.

    Parameters
    ----------
    domain : str
        Name of the domain.
    task : str
        Name of the task.
    seed : int
        Random seed, in :math:`[0, 2^{32})`.
    max_episode_steps : int
        Maximum number of steps per episode.
    height : int
        Height of the rendered frames.
    width : int
        Width of the rendered frames.
    camera_id : int
        Camera ID: one of the task's fixed cameras, or -1 for MuJoCo's free camera.

    Returns
    -------
    env : gymnasium.Env
        Gym environment (wrapped in :class:`gymnasium.wrappers.TimeLimit`).

    Raises
    ------
    ImportError
        When dm_control is not installed.
    TypeError
        If ``seed`` or ``camera_id`` is not an int.
    ValueError
        For an unknown domain/task, non-positive sizes, a seed outside
        :math:`[0, 2^{32})`, or a camera the task does not have.
    """
    for name, value in (
        ("max_episode_steps", max_episode_steps),
        ("height", height),
        ("width", width),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    seed = check_int(seed, "seed", low=0, high=_DMC_MAX_SEED)
    camera_id = check_int(camera_id, "camera_id", low=-1)
    os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        from dm_control import suite
    except ImportError as e:
        raise ImportError(
            "make_dmc needs dm_control, which is not installed: pip install coax_utils[dmc]"
        ) from e
    if (domain, task) not in suite.ALL_TASKS:
        raise ValueError(
            f"unknown DeepMind Control task {domain!r}/{task!r}; see dm_control.suite.ALL_TASKS"
        )
    env = _DmcEnv(domain, task, seed, int(height), int(width), camera_id)
    return gymnasium.wrappers.TimeLimit(env, max_episode_steps=int(max_episode_steps))
