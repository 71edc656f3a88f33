"""A gymnasium vector-env wrapper that records every step into a sequence replay buffer."""

from __future__ import annotations

from typing import Any

import gymnasium
import jax
import numpy as np

from coax_utils.replay._record import autoreset_mode, next_observations

__all__ = ["RecordVectorSequences"]


def _copy(x: Any) -> Any:
    return jax.tree_util.tree_map(np.array, x)


class RecordVectorSequences(gymnasium.vector.VectorWrapper):
    r"""Record the steps of a gymnasium vector env into a sequence replay buffer.

    Every :meth:`step` adds one step per sub-env to the buffer (one chain each, see
    :class:`SequenceReplayBuffer`), as the dict ``{"obs", "action", "reward", "next_obs"}``
    (``obs`` the observation the action was taken from, ``next_obs`` the one it led to: the
    final observation at an episode end), with the ``terminated`` and ``truncated`` flags
    and the recurrent core state the agent acted from, given to :meth:`step`. The three
    autoreset modes of gymnasium's vector envs (1.1 and newer; before, all reset on the next
    step) are handled: with ``NEXT_STEP`` the reset step after an episode end is not
    recorded (the sub-env is inactive in that add), with ``SAME_STEP`` ``next_obs`` at an
    episode end comes from ``info["final_obs"]``, and with ``DISABLED`` a masked
    :meth:`reset` starts new episodes in the reset sub-envs. Envs that report every
    sub-env's final observation in ``info["final_observation"]`` (gymnax's
    ``GymnaxToVectorGymWrapper``) reset in the same step and ``next_obs`` comes from there
    (see :func:`~coax_utils.replay.next_observations`).

    A reset of a sub-env in the middle of an episode drops the steps of its current window
    that no written window holds (the episode has no known end). A step the env took but
    that could not be recorded raises, and later steps raise RuntimeError until
    :meth:`reset`.

    Parameters
    ----------
    env : gymnasium.vector.VectorEnv
        The vector env.
    buffer : SequenceReplayBuffer or PrioritizedSequenceReplayBuffer
        A host sequence buffer with ``num_envs == env.num_envs``.
    """

    def __init__(self, env: gymnasium.vector.VectorEnv, buffer: Any) -> None:
        super().__init__(env)
        if not (callable(getattr(buffer, "add", None)) and hasattr(buffer, "reset_chains")):
            raise TypeError(f"buffer must be a sequence replay buffer, got {buffer!r}")
        if buffer.num_envs != self.num_envs:
            raise ValueError(
                f"the buffer has num_envs={buffer.num_envs}, the env {self.num_envs} sub-envs"
            )
        self.buffer = buffer
        self._mode = autoreset_mode(env)
        self._obs: Any = None
        self._skip = np.zeros(self.num_envs, bool)

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        """Reset the env (all sub-envs, or those in ``options["reset_mask"]``)."""
        # read before the env's reset: gymnasium's vector envs pop "reset_mask" from options
        mask = (kwargs.get("options") or {}).get("reset_mask")
        obs, info = self.env.reset(**kwargs)
        if mask is None or self._obs is None:
            mask = np.ones(self.num_envs, bool)
        mask = np.asarray(mask, bool)
        self.buffer.reset_chains(mask)
        self._skip[mask] = False
        self._obs = _copy(obs)
        return obs, info

    def step(self, actions: Any, core_state: Any = None) -> tuple[Any, Any, Any, Any, dict]:
        """Step the env and record one step per sub-env.

        ``core_state`` is the recurrent core state the agent chose ``actions`` from (leaves
        with a leading axis of ``num_envs``; None if the agent has none), stored with the
        windows that start at this step.
        """
        if self._obs is None:
            raise RuntimeError("call reset() before step() (or after a step that failed)")
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        try:
            next_obs, same_step = next_observations(obs, terminated, truncated, info, self._mode)
            ended = np.logical_or(terminated, truncated)
            steps = {
                "obs": self._obs,
                "action": _copy(actions),
                "reward": np.asarray(rewards, np.float32),
                "next_obs": next_obs,
            }
            self.buffer.add(
                steps,
                core_state=core_state,
                terminated=np.asarray(terminated, bool),
                truncated=np.asarray(truncated, bool),
                active=~self._skip,
            )
        except BaseException:
            self._obs = None
            raise
        self._skip = ended & (self._mode == "NextStep") & (not same_step)
        self._obs = _copy(obs)
        return obs, rewards, terminated, truncated, info
