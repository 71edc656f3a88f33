"""The functional-JAX -> gymnasium environment bridge: :class:`JaxToGymnasium`.

It runs a functional JAX env (gymnax style) behind the :class:`gymnasium.Env` interface; the
other direction is :class:`~coax_utils.envs.GymnasiumToJax`.
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np

from coax_utils.envs._convert import to_gymnasium_space, to_jax_space
from coax_utils.envs._step import step_without_autoreset

__all__ = ["JaxToGymnasium"]


class JaxToGymnasium(gymnasium.Env):
    """A functional JAX env (gymnax style) behind the :class:`gymnasium.Env` interface.

    The JAX env needs ``default_params``, ``reset(key, params) -> (obs, state)``,
    ``observation_space(params)``, ``action_space(params)`` and ``step``/``step_env`` of any
    gymnax API (the 5-tuple ``(obs, state, reward, done, info)`` of gymnax < 1.0, gymnax >=
    1.0, or the 6-tuple ``(obs, state, reward, terminated, truncated, info)``). Every step is
    :func:`step_without_autoreset`: the terminal observation is the real one, the env's time
    limit (``max_steps_in_episode``) ends episodes with ``truncated=True``, and termination
    is reported apart from truncation. Spaces may be this package's JAX spaces or
    gymnax-style ones (see :func:`to_gymnasium_space`).

    Reset and step are jitted once. Keys come from the env's ``np_random``: ``reset(seed=s)``
    is deterministic, and ``reset()`` continues the seeded stream. Observations, rewards and
    infos are returned as fresh NumPy values of the gymnasium spaces' dtypes, except that a
    Discrete observation is a Python int (as gymnasium's own envs return it).

    Parameters
    ----------
    env : gymnax-style env
        The functional JAX env.
    params : pytree, optional
        The env parameters (``env.default_params`` by default).
    seed : int, optional
        The seed used by the first ``reset`` when it is called without one (even when
        ``np_random`` was read before it).
    render_mode : {None, "rgb_array"}, optional
        With ``"rgb_array"``, :meth:`render` returns ``env.render(state, params)`` as a uint8
        array, so the JAX env must have such a ``render`` method, returning uint8 frames or
        integer ones within [0, 255] (float frames are refused: cast as they are, frames
        drawn in [0, 1] came out black).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(
        self,
        env: Any,
        params: Any = None,
        seed: int | None = None,
        render_mode: str | None = None,
    ) -> None:
        for attr in ("reset", "observation_space", "action_space"):
            if not hasattr(env, attr):
                raise TypeError(f"env must be a gymnax-style JAX env, got {env!r} without {attr!r}")
        if not (hasattr(env, "step_env") or hasattr(env, "step")):
            raise TypeError(f"env must have a step or step_env method, got {env!r}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        if render_mode == "rgb_array" and not callable(getattr(env, "render", None)):
            raise ValueError("render_mode='rgb_array' needs a JAX env with render(state, params)")
        if params is None:
            params = getattr(env, "default_params", None)
        self.jax_env = env
        self.params = params
        self.render_mode = render_mode
        self._seed = seed
        # the constructor seed waits for the first reset: gymnasium seeds np_random at
        # random as soon as np_random or np_random_seed is read, so that cannot tell
        self._seed_pending = seed is not None
        self.observation_space = to_gymnasium_space(env.observation_space(params))
        self.action_space = to_gymnasium_space(env.action_space(params))
        # actions are cast to fixed JAX dtypes, so that the jitted step never retraces
        act_spec = to_jax_space(self.action_space).shape_dtype()
        self._act_dtypes, self._act_treedef = jax.tree_util.tree_flatten(act_spec)
        self._reset_fn = jax.jit(env.reset)
        self._step_fn = jax.jit(functools.partial(step_without_autoreset, env))
        self._key: jax.Array | None = None
        self._state: Any = None

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        """Reset the JAX env with a key drawn from ``np_random``; returns ``(obs, info)``."""
        if seed is None and self._seed_pending:
            seed = self._seed
        self._seed_pending = False
        super().reset(seed=seed)
        key = jax.random.key(int(self.np_random.integers(0, np.iinfo(np.int32).max)))
        self._key, sub = jax.random.split(key)
        obs, self._state = self._reset_fn(sub, self.params)
        return self._to_numpy(obs, self.observation_space), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Step the JAX env; returns ``(obs, reward, terminated, truncated, info)``."""
        if self._state is None:
            raise ValueError("JaxToGymnasium.step was called before reset")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not an element of {self.action_space}")
        self._key, sub = jax.random.split(self._key)
        leaves = self._act_treedef.flatten_up_to(action)
        action = self._act_treedef.unflatten(
            [jnp.asarray(x, s.dtype) for x, s in zip(leaves, self._act_dtypes)]
        )
        out = self._step_fn(sub, self._state, action, self.params)
        obs, state, reward, terminated, truncated, info = out
        self._state = state
        info = jax.tree_util.tree_map(np.array, dict(info or {}))
        return (
            self._to_numpy(obs, self.observation_space),
            float(reward),
            bool(terminated),
            bool(truncated),
            info,
        )

    def render(self) -> np.ndarray | None:
        """The current frame (``render_mode="rgb_array"``), or None without a render mode.

        Raises
        ------
        TypeError
            When the JAX env's frame is not of an integer dtype (a float frame's scale,
            [0, 1] or [0, 255], cannot be told).
        ValueError
            When an integer frame has values outside [0, 255].
        """
        if self.render_mode is None or self._state is None:
            return None
        frame = np.asarray(self.jax_env.render(self._state, self.params))
        if frame.dtype == np.uint8:
            return np.array(frame)
        if frame.dtype == np.bool_ or not np.issubdtype(frame.dtype, np.integer):
            raise TypeError(
                f"the JAX env rendered a frame of dtype {frame.dtype}; JaxToGymnasium needs "
                "uint8 frames (colours 0..255), e.g. (frame * 255).astype(jnp.uint8) for a "
                "float frame in [0, 1]"
            )
        if frame.size and (frame.min() < 0 or frame.max() > 255):
            raise ValueError(
                f"the JAX env rendered a {frame.dtype} frame with values in [{frame.min()}, "
                f"{frame.max()}]; colours must lie in [0, 255]"
            )
        return frame.astype(np.uint8)

    def close(self) -> None:
        """Close the JAX env when it has a ``close`` method (a :class:`GymnasiumToJax`
        closes the gymnasium env it wraps); gymnax envs have nothing to close."""
        close = getattr(self.jax_env, "close", None)
        if callable(close):
            close()
        super().close()

    def _to_numpy(self, x: Any, space: gymnasium.Space) -> Any:
        if isinstance(space, gymnasium.spaces.Tuple):
            return tuple(self._to_numpy(xi, s) for xi, s in zip(x, space.spaces))
        if isinstance(space, gymnasium.spaces.Dict):
            return {k: self._to_numpy(x[k], s) for k, s in space.spaces.items()}
        arr = np.array(x, dtype=space.dtype)
        if isinstance(space, gymnasium.spaces.Discrete):
            # a Python int, like gymnasium's own envs: an element of the space whatever its
            # dtype (an int64 scalar is not in an int32 space), and what env_checker expects
            return int(arr.reshape(()))
        return arr
