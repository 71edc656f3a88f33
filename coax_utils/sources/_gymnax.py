"""GymnaxSource: a stream of transitions from rolling out a functional JAX environment."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from coax_utils._dataclass import pytree_dataclass
from coax_utils.envs import step_without_autoreset
from coax_utils.sources._base import CompiledNext, PyTree, check_positive_int, check_restored

__all__ = ["GymnaxSource", "GymnaxSourceState"]

PolicyStepFn = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[PyTree, PyTree]]


@pytree_dataclass
class GymnaxSourceState:
    """State of a :class:`GymnaxSource`.

    Attributes
    ----------
    env_state : pytree
        The environment's state.
    obs : pytree
        The observation the policy acts on next.
    key : jax.Array
        PRNG key for the policy, the environment steps and the resets.
    step : jax.Array
        int32 scalar: environment steps taken in the current epoch.
    epoch : jax.Array
        int32 scalar: number of completed epochs.
    new_episode : jax.Array
        bool scalar: True when ``obs`` is the first observation of an episode.
    policy_state : pytree or None
        What ``policy_step_fn`` needs (parameters, recurrent carry, ...). ``init_state``
        leaves it ``None``; inject one with ``state.replace(policy_state=...)`` before
        calling ``next``.
    """

    env_state: PyTree
    obs: PyTree
    key: jax.Array
    step: jax.Array
    epoch: jax.Array
    new_episode: jax.Array
    policy_state: PyTree = None

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state is one its source can produce."""
        check_restored(self, ("step", "epoch"), ("new_episode",))


class GymnaxSource(CompiledNext):
    r"""Stream transitions by rolling out a gymnax-style JAX environment with a policy.

    The environment follows the gymnax API: ``env.reset(key, params) -> (obs, env_state)``
    and a step of any gymnax release: the 5-tuple step of gymnax < 1.0,
    ``env.step(key, env_state, action, params) -> (obs, env_state, reward, done, info)``,
    gymnax >= 1.0 (whose ``step_env`` no longer applies the time limit), or a 6-tuple
    ``-> (obs, env_state, reward, terminated, truncated, info)``. Every step is
    :func:`coax_utils.envs.step_without_autoreset`, which tells these apart while tracing,
    prefers ``step_env`` (no autoreset, so ``next_state`` is the real last observation of an
    episode, as bootstrapping after a truncation needs), applies the env's time limit
    (``max_steps_in_episode``) and reports truncation apart from termination. Gymnasium
    environments run through :class:`coax_utils.envs.GymnasiumToJax`.

    Each ``next`` call takes one environment step and emits the transition

    .. code-block:: python

        {"state": obs, "action": a, "reward": r, "next_state": obs_next, "done": done,
         "terminated": terminated, "truncated": truncated, "info": info}

    with ``done = terminated | truncated``. The action comes from
    ``policy_step_fn(obs, policy_state, new_episode, key) -> (action, policy_state)``, where
    ``new_episode`` is True on an episode's first step. When an episode ends the
    environment is reset with ``env.reset``; after ``steps_per_epoch`` steps the epoch
    ends and a fresh episode starts: the epoch's last transition is marked ``truncated``
    (and ``done``) unless it is ``terminated``, as the episode it cuts ends there for whoever
    reads the stream.
    ``env.reset`` runs under :func:`jax.lax.cond`, only when needed, so host-backed
    environments see no extra resets. The mask of every item is a scalar ``True``.

    Parameters
    ----------
    env : object
        The environment (``reset``/``step`` as above).
    env_params : pytree
        Passed to ``env.reset`` and ``env.step``.
    policy_step_fn : callable
        ``(obs, policy_state, new_episode, key) -> (action, policy_state)``, jittable.
    policy_state_template : pytree
        An example policy state, used only to infer :meth:`element_spec`; it is not kept.
    steps_per_epoch : int
        Environment steps per epoch.

    Raises
    ------
    ValueError
        If ``steps_per_epoch`` is not positive or exceeds ``2**31 - 1`` (the step counter
        is int32), ``policy_state_template`` is None, or
        the step cannot be read (see :func:`coax_utils.envs.step_without_autoreset`).
    TypeError
        If ``policy_step_fn`` is not callable.

    Examples
    --------
    A one-dimensional walk that ends after three steps, driven by a policy that always
    steps forward and counts its calls:

    >>> import jax, jax.numpy as jnp
    >>> from coax_utils.sources import GymnaxSource
    >>> class Walk:
    ...     def reset(self, key, params):
    ...         return jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
    ...     def step(self, key, state, action, params):
    ...         state = state + action
    ...         return state, state, jnp.float32(1.0), state >= 3, {}
    >>> policy = lambda obs, n, new_episode, key: (jnp.int32(1), n + 1)
    >>> source = GymnaxSource(Walk(), None, policy, jnp.int32(0), steps_per_epoch=4)
    >>> state = source.init_state(jax.random.key(0))
    >>> state = state.replace(policy_state=jnp.int32(0))
    >>> for _ in range(4):
    ...     item, mask, state = source.next(state)
    ...     print(int(item["state"]), int(item["next_state"]), bool(item["terminated"]))
    0 1 False
    1 2 False
    2 3 True
    0 1 False
    >>> int(state.epoch), int(state.policy_state)
    (1, 4)
    """

    def __init__(
        self,
        env: Any,
        env_params: PyTree,
        policy_step_fn: PolicyStepFn,
        policy_state_template: PyTree,
        steps_per_epoch: int = 1024,
    ) -> None:
        self._steps_per_epoch = check_positive_int("steps_per_epoch", steps_per_epoch)
        if not callable(policy_step_fn):
            raise TypeError(f"policy_step_fn must be callable, got {policy_step_fn!r}")
        if policy_state_template is None:
            raise ValueError(
                "GymnaxSource needs a policy_state_template (an example policy state) to "
                "infer the element spec, got None"
            )
        self._env = env
        self._env_params = env_params
        self._policy_step_fn = policy_step_fn

        def first_step(key: jax.Array, policy_state: PyTree) -> dict:
            obs, env_state = env.reset(key, env_params)
            action, _ = policy_step_fn(obs, policy_state, jnp.ones([], jnp.bool_), key)
            return self._transition(obs, action, self._step(key, env_state, action))

        self._spec = jax.eval_shape(first_step, jax.random.key(0), policy_state_template)

    @property
    def steps_per_epoch(self) -> int:
        """Environment steps per epoch."""
        return self._steps_per_epoch

    @property
    def env(self) -> Any:
        """The environment."""
        return self._env

    @property
    def env_params(self) -> PyTree:
        """The environment parameters."""
        return self._env_params

    def element_spec(self) -> PyTree:
        """Pytree of :class:`jax.ShapeDtypeStruct` describing one transition dict."""
        return self._spec

    def _step(self, key: jax.Array, env_state: PyTree, action: PyTree) -> tuple:
        return step_without_autoreset(self._env, key, env_state, action, self._env_params)

    @staticmethod
    def _transition(obs: PyTree, action: PyTree, step_out: tuple[Any, ...]) -> dict:
        next_obs, _, reward, terminated, truncated, info = step_out
        terminated = jnp.asarray(terminated, jnp.bool_)
        truncated = jnp.asarray(truncated, jnp.bool_)
        return {
            "state": obs,
            "action": action,
            "reward": reward,
            "next_state": next_obs,
            "done": terminated | truncated,
            "terminated": terminated,
            "truncated": truncated,
            "info": info,
        }

    def init_state(self, key: jax.Array) -> GymnaxSourceState:
        """Reset the environment and return the state at the start of epoch 0.

        The returned state has ``policy_state=None``; inject the policy state with
        ``state.replace(policy_state=...)`` before calling :meth:`next`.

        Parameters
        ----------
        key : jax.Array
            PRNG key (typed or raw).

        Returns
        -------
        GymnaxSourceState
        """
        key, reset_key = jax.random.split(key)
        obs, env_state = self._env.reset(reset_key, self._env_params)
        return GymnaxSourceState(
            env_state=env_state,
            obs=obs,
            key=key,
            step=jnp.zeros([], jnp.int32),
            epoch=jnp.zeros([], jnp.int32),
            new_episode=jnp.ones([], jnp.bool_),
            policy_state=None,
        )

    def next(self, state: GymnaxSourceState) -> tuple[dict, jax.Array, GymnaxSourceState]:
        """Take one environment step and return ``(transition, mask, new_state)``.

        Parameters
        ----------
        state : GymnaxSourceState
            A state whose ``policy_state`` has been set.

        Returns
        -------
        tuple
            The transition dict, a scalar ``True`` mask and the advanced state.

        Raises
        ------
        ValueError
            If ``state.policy_state`` is None (not injected yet).
        """
        return self._compiled_next(state)

    def _next(self, state: GymnaxSourceState) -> tuple[dict, jax.Array, GymnaxSourceState]:
        if state.policy_state is None:
            raise ValueError(
                "GymnaxSource state has no policy_state; inject one with "
                "state.replace(policy_state=...) before calling next"
            )
        key, policy_key, step_key, reset_key = jax.random.split(state.key, 4)
        action, policy_state = self._policy_step_fn(
            state.obs, state.policy_state, state.new_episode, policy_key
        )
        step_out = self._step(step_key, state.env_state, action)
        step = state.step + 1
        epoch_ends = step >= self._steps_per_epoch
        # the epoch's last step cuts its episode (the next item starts a fresh one): it is
        # a truncation, so n-step returns and episode boundaries never run across epochs
        # (unless the episode terminated there: a terminal step is not also truncated)
        *head, terminated, truncated, info = step_out
        cut = jnp.logical_and(epoch_ends, jnp.logical_not(jnp.asarray(terminated, jnp.bool_)))
        step_out = (*head, terminated, jnp.logical_or(truncated, cut), info)
        transition = self._transition(state.obs, action, step_out)
        next_obs, next_env_state = step_out[0], step_out[1]
        done = jnp.reshape(jnp.asarray(transition["done"], jnp.bool_), ())

        def reset(_: None) -> tuple[PyTree, PyTree]:
            return self._env.reset(reset_key, self._env_params)

        def keep(_: None) -> tuple[PyTree, PyTree]:
            return next_obs, next_env_state

        # Reset only when needed: a host-backed environment must not see extra resets.
        obs, env_state = jax.lax.cond(jnp.logical_or(done, epoch_ends), reset, keep, None)
        new_state = GymnaxSourceState(
            env_state=env_state,
            obs=obs,
            key=key,
            step=jnp.where(epoch_ends, 0, step).astype(jnp.int32),
            epoch=state.epoch + epoch_ends.astype(jnp.int32),
            new_episode=jnp.logical_or(done, epoch_ends),
            policy_state=policy_state,
        )
        return transition, jnp.ones([], jnp.bool_), new_state

    def __repr__(self) -> str:
        return f"GymnaxSource(env={self._env!r}, steps_per_epoch={self._steps_per_epoch})"
