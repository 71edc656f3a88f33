"""One env step without autoreset, with termination and truncation apart, for any gymnax API."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["step_without_autoreset"]


def _time_limit(env: Any, state: Any, params: Any) -> jax.Array | None:
    """Whether ``state`` reached the env's time limit, or None when the env has none we know."""
    if callable(getattr(env, "is_truncated", None)):
        return jnp.asarray(env.is_truncated(state, params), jnp.bool_)
    limit = getattr(params, "max_steps_in_episode", None)
    time = getattr(state, "time", None)
    if limit is None or time is None:
        return None
    return jnp.asarray(time >= limit, jnp.bool_)


def _count(out: Any, what: str) -> tuple:
    out = tuple(out)
    if len(out) not in (5, 6):
        raise ValueError(
            f"{what} must return 5 values (obs, state, reward, done, info) or 6 values (obs, "
            f"state, reward, terminated, truncated, info), got {len(out)}"
        )
    return out


def step_without_autoreset(
    env: Any, key: jax.Array, state: Any, action: Any, params: Any
) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array, Any]:
    r"""Step a gymnax-style env once, without autoreset, with ``terminated`` and ``truncated``.

    Works with every gymnax API and with :class:`GymnasiumToJax`; pure and jittable (the API
    is told apart while tracing):

    - ``env.step_env`` returning 6 values (:class:`GymnasiumToJax`): used as it is.
    - gymnax >= 1.0, whose ``step_env`` returns ``(obs, state, reward, terminated, info)``
      and no longer applies the time limit (only the autoresetting ``step`` does):
      ``truncated`` is ``env.is_truncated(state, params)``, or
      ``state.time >= params.max_steps_in_episode`` for envs without ``is_truncated``.
      Both flags may be True at once, as in gymnax's ``step``.
    - gymnax < 1.0, whose ``step``/``step_env`` return ``(obs, state, reward, done, info)``
      with the time limit folded into ``done``: a ``done`` at the time limit (as above) is
      reported as ``truncated``, any other ``done`` as ``terminated``. Without a time limit
      to check, ``done`` is ``terminated`` and ``truncated`` is always False.
    - envs with only ``step`` (5 or 6 values) are read the same way; such a ``step`` must
      not reset the env by itself, or ``obs`` is not the last observation of an episode,
      except that a 6-value ``step`` whose info holds ``"final_observation"`` (gymnax >=
      1.0's autoresetting ``step``, and its wrappers') returns that as ``obs`` (the returned
      state is then the reset one).

    ``step_env`` (gymnax's step without autoreset) is preferred to ``step``, so the returned
    observation and state are the real last ones of an episode, as bootstrapping after a
    truncation needs; the caller resets the env. Only the env's own ``step_env`` is used:
    gymnax wrappers (``LogWrapper``, ``FlattenObservationWrapper``, ...) forward unknown
    attributes to the env they wrap, and that ``step_env`` would skip the wrapper, so a
    wrapped env is stepped with its ``step``.

    Parameters
    ----------
    env : gymnax-style env
        The env.
    key : jax.Array
        The step's PRNG key.
    state : pytree
        The env state.
    action : pytree
        The action.
    params : pytree
        The env parameters.

    Returns
    -------
    obs, state, reward, terminated, truncated, info
        ``terminated`` and ``truncated`` are boolean arrays.

    Raises
    ------
    ValueError
        If the step returns neither 5 nor 6 values, or an env with the gymnax >= 1.0 API
        has a 5-value ``step_env`` but no time limit this function can read
        (``is_truncated``, or ``state.time`` and ``params.max_steps_in_episode``).

    Examples
    --------
    >>> import gymnax, jax
    >>> env, params = gymnax.make("Pendulum-v1")
    >>> obs, state = env.reset(jax.random.key(0), params)
    >>> step = jax.jit(lambda s: step_without_autoreset(env, jax.random.key(1), s, 0.0, params))
    >>> for _ in range(params.max_steps_in_episode):
    ...     obs, state, reward, terminated, truncated, info = step(state)
    >>> bool(terminated), bool(truncated), int(state.time)
    (False, True, 200)
    """
    # a gymnax wrapper forwards unknown attributes to the env it wraps: that step_env
    # would skip the wrapper (and get the wrapper's state), so only the env's own counts
    own_step_env = inspect.getattr_static(env, "step_env", None) is not None
    step_env = getattr(env, "step_env", None) if own_step_env else None
    if callable(step_env):
        out = _count(step_env(key, state, action, params), "env.step_env")
        if len(out) == 5:
            new_api = len(_count(jax.eval_shape(env.step, key, state, action, params), "env.step"))
            new_api = new_api == 6
    else:
        out = _count(env.step(key, state, action, params), "env.step")
        new_api = False
    if len(out) == 6:
        obs, next_state, reward, terminated, truncated, info = out
        if step_env is None and isinstance(info, dict) and "final_observation" in info:
            # gymnax >= 1.0's autoresetting step keeps the observation before the reset
            obs = info["final_observation"]
        return obs, next_state, reward, terminated, truncated, info
    obs, next_state, reward, done, info = out
    done = jnp.asarray(done, jnp.bool_)
    limit = _time_limit(env, next_state, params)
    if new_api:
        if limit is None:
            raise ValueError(
                f"env {env!r} has the gymnax >= 1.0 API (a 6-value step) but a 5-value "
                "step_env and no time limit to read (is_truncated(state, params), or "
                "state.time and params.max_steps_in_episode): give step_env the 6-value "
                "signature (obs, state, reward, terminated, truncated, info)"
            )
        return obs, next_state, reward, done, limit, info
    if limit is None:
        return obs, next_state, reward, done, jnp.zeros_like(done), info
    truncated = done & limit
    return obs, next_state, reward, done & ~truncated, truncated, info
