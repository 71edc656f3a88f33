"""Gymnasium wrappers that record every transition into a replay buffer."""

from __future__ import annotations

from typing import Any

import gymnasium
import jax
import numpy as np

from coax_utils.replay._host import PrioritizedReplayBuffer, SimpleReplayBuffer
from coax_utils.replay._tracing import InsufficientCacheError, MonteCarlo, NStep
from coax_utils.replay._transition import TransitionBatch
from coax_utils.replay._vector_tracing import VectorMonteCarlo, VectorNStep

__all__ = [
    "RecordTransitions",
    "RecordVectorTransitions",
    "autoreset_mode",
    "next_observations",
    "vector_tracer",
]


def _copy_tree(x: Any) -> Any:
    return jax.tree_util.tree_map(np.array, x)


def _check_tracer(tracer: Any) -> Any:
    if tracer is None:
        return NStep(n=1, gamma=1.0)
    for method in ("add", "pop", "reset"):
        if not callable(getattr(tracer, method, None)):
            raise TypeError(f"tracer must have an {method!r} method (e.g. NStep), got {tracer!r}")
    return tracer


_UNSYNCED = (
    "call reset() before step() (the recorder needs the observation the step starts from; "
    "after a step whose recording failed, it no longer knows it)"
)


def _check_buffer(buffer: Any) -> Any:
    if not callable(getattr(buffer, "add", None)):
        raise TypeError(f"buffer must have an 'add' method, got {buffer!r}")
    return buffer


def _drain(tracer: Any, buffer: Any, ended: bool) -> int:
    """Move every available transition from ``tracer`` into ``buffer``; return the count."""
    batches = []
    while tracer:
        batches.append(tracer.pop())
    if not batches:
        return 0
    batch = TransitionBatch.concatenate(*batches)
    if isinstance(tracer, MonteCarlo):  # it pops last step first: store in time order
        batch = batch[::-1]
    if isinstance(buffer, (SimpleReplayBuffer, PrioritizedReplayBuffer)):
        ends = np.zeros(batch.batch_size, bool)
        ends[-1] = ended and not len(tracer)
        buffer.add(batch, episode_end=ends)
    else:
        buffer.add(batch)
    return batch.batch_size


class RecordTransitions(gymnasium.Wrapper):
    r"""Record every transition of an environment into a replay buffer.

    Each :meth:`step` feeds :math:`(S_t, A_t, R_t)` with the ``terminated`` and ``truncated``
    flags (and the next observation, to bootstrap from after a truncation) into the tracer,
    and adds whatever the tracer can pop to the buffer, so at the end of an episode (either
    way) the tracer is flushed. A terminated episode's last transitions get ``In = 0``; a
    truncated one keeps bootstrapping (see :class:`NStep`). Transitions reach the buffer in
    time order (a :class:`MonteCarlo` tracer's, popped last step first, are reversed). Host
    buffers also get the ``episode_end`` marks that :meth:`SimpleReplayBuffer.sample_sequences`
    uses. Calling :meth:`reset` in the middle of an episode drops the transitions the tracer
    still holds (they have no known end). A step the env took but that could not be recorded
    (the tracer refused a non-finite reward, the buffer refused the batch) raises, and later
    steps raise RuntimeError until :meth:`reset`: the recorder no longer knows the state they
    start from.

    Given a gymnasium vector env, the constructor returns a :class:`RecordVectorTransitions`
    instead (one chain per sub-env).

    Parameters
    ----------
    env : gymnasium.Env or gymnasium.vector.VectorEnv
        The environment to wrap.
    buffer : replay buffer
        Anything with ``add(transition_batch)``, e.g. :class:`SimpleReplayBuffer`,
        :class:`PrioritizedReplayBuffer` or a ``ReplayServer`` handle wrapper.
    tracer : NStep or MonteCarlo, optional
        The reward tracer (default: ``NStep(n=1, gamma=1.0)``, plain 1-step transitions).

    Examples
    --------
    >>> import gymnasium
    >>> from coax_utils.replay import NStep, SimpleReplayBuffer
    >>> buffer = SimpleReplayBuffer(capacity=1000, random_seed=0)
    >>> env = RecordTransitions(gymnasium.make("CartPole-v1"), buffer, NStep(n=3, gamma=0.9))
    >>> s, info = env.reset(seed=0)
    >>> done = truncated = False
    >>> steps = 0
    >>> while not (done or truncated):
    ...     s, r, done, truncated, info = env.step(env.action_space.sample())
    ...     steps += 1
    >>> len(buffer) == steps
    True
    """

    def __new__(cls, env: Any, buffer: Any, tracer: Any = None) -> Any:
        if isinstance(env, gymnasium.vector.VectorEnv):
            return RecordVectorTransitions(env, buffer, tracer)
        return super().__new__(cls)

    def __init__(self, env: gymnasium.Env, buffer: Any, tracer: Any = None) -> None:
        super().__init__(env)
        self.buffer = _check_buffer(buffer)
        self.tracer = _check_tracer(tracer)
        self._obs: Any = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        """Reset the env (and the tracer); see :meth:`gymnasium.Env.reset`."""
        obs, info = self.env.reset(**kwargs)
        self.tracer.reset()
        self._obs = _copy_tree(obs)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        """Step the env and record the transition; see :meth:`gymnasium.Env.step`."""
        if self._obs is None:
            raise RuntimeError(_UNSYNCED)
        obs, reward, terminated, truncated, info = self.env.step(action)
        try:
            obs_copy = _copy_tree(obs)
            self.tracer.add(
                self._obs,
                _copy_tree(action),
                float(reward),
                bool(terminated),
                truncated=bool(truncated),
                s_next=obs_copy,
            )
            _drain(self.tracer, self.buffer, bool(terminated or truncated))
        except BaseException:
            self._obs = None  # the env moved on without the recorder: refuse steps until reset
            raise
        self._obs = obs_copy
        return obs, reward, terminated, truncated, info


def autoreset_mode(env: gymnasium.vector.VectorEnv) -> str:
    """The autoreset mode of a vector env: "NextStep", "SameStep" or "Disabled".

    Gymnasium has the modes from 1.1 on; before, every vector env resets on the next step,
    and a mode that an env declares anyway is refused rather than misread.
    """
    mode = env.metadata.get("autoreset_mode", "NextStep")
    modes = getattr(gymnasium.vector, "AutoresetMode", None)
    if modes is not None:
        return modes(mode).value
    if mode != "NextStep":
        raise ValueError(
            f"the vector env declares autoreset_mode {mode!r}, which needs gymnasium 1.1 or "
            f"newer (installed: {gymnasium.__version__}, whose vector envs reset on the next "
            "step)"
        )
    return mode


def next_observations(
    obs: Any, terminated: Any, truncated: Any, info: dict, mode: str
) -> tuple[Any, bool]:
    """The observations a vector env's step led to, as a NumPy copy of ``obs``, and whether
    the env reset its ended sub-envs within this same step.

    At an episode end a same-step autoreset env returns the first observation of the next
    episode; the one the step led to is its *final* observation: gymnax's
    ``GymnaxToVectorGymWrapper`` gives every sub-env's, batched, in
    ``info["final_observation"]`` (which then replaces ``obs`` whole), gymnasium's
    ``SAME_STEP`` vector envs those of the ended sub-envs in ``info["final_obs"]`` (a loop
    over the ended sub-envs only). ``mode`` is the env's autoreset mode ("NextStep",
    "SameStep" or "Disabled").
    """
    if isinstance(info, dict) and "final_observation" in info:
        return _copy_tree(info["final_observation"]), True
    next_obs = _copy_tree(obs)
    if mode != "SameStep":
        return next_obs, False
    leaves = jax.tree_util.tree_leaves(next_obs)
    for i in np.flatnonzero(np.logical_or(terminated, truncated)):
        for x, v in zip(leaves, jax.tree_util.tree_leaves(info["final_obs"][i])):
            x[i] = v
    return next_obs, True


def vector_tracer(tracer: Any, num_envs: int) -> Any:
    """The vector tracer for ``num_envs`` sub-envs with the settings of ``tracer``: an
    :class:`NStep` or :class:`MonteCarlo` template (default ``NStep(n=1, gamma=1.0)``), or a
    :class:`VectorNStep` or :class:`VectorMonteCarlo` for ``num_envs`` sub-envs, used as is
    (emptied)."""
    if tracer is None:
        tracer = NStep(n=1, gamma=1.0)
    if isinstance(tracer, (VectorNStep, VectorMonteCarlo)):
        if tracer.num_envs != num_envs:
            raise ValueError(
                f"the tracer has num_envs={tracer.num_envs}, the env {num_envs} sub-envs"
            )
        tracer.reset()
        return tracer
    if isinstance(tracer, NStep):
        if tracer.record_extra_info:
            raise ValueError("record_extra_info is not offered for vector envs")
        return VectorNStep(tracer.n, tracer.gamma, num_envs)
    if isinstance(tracer, MonteCarlo):
        return VectorMonteCarlo(tracer.gamma, num_envs)
    raise TypeError(
        f"a vector env needs an NStep or MonteCarlo tracer (or their vector forms), got {tracer!r}"
    )


def _add_vector_rows(tracer: Any, buffer: Any, ended: np.ndarray) -> int:
    """Add every row ``tracer`` can pop to ``buffer`` in one call (host buffers also get the
    ``episode_end`` marks: the last row of each sub-env whose episode ``ended``)."""
    try:
        batch, envs = tracer.pop(return_envs=True)
    except InsufficientCacheError:  # nothing complete: cheaper than asking first
        return 0
    if isinstance(buffer, (SimpleReplayBuffer, PrioritizedReplayBuffer)):
        last = np.append(envs[1:] != envs[:-1], True)
        buffer.add(batch, episode_end=last & ended[envs])
    else:
        buffer.add(batch)
    return len(envs)


class RecordVectorTransitions(gymnasium.vector.VectorWrapper):
    r"""Record every transition of a gymnasium vector env into a replay buffer.

    Like :class:`RecordTransitions` (which returns this class for vector envs), with one
    chain per sub-env in one vector tracer (:class:`VectorNStep` or
    :class:`VectorMonteCarlo`): each :meth:`step` is one ``add`` of all sub-envs and at most
    one ``pop`` and one ``buffer.add``. All three autoreset modes of gymnasium's vector envs
    (1.1 and newer; before, they all reset on the next step) are supported: with
    ``NEXT_STEP`` (the default) the reset step that follows an episode end is not recorded,
    with ``SAME_STEP`` the final observation is read from ``info["final_obs"]``, and with
    ``DISABLED`` a masked ``reset`` restarts the chains of the reset sub-envs. Envs that
    report every sub-env's final observation in ``info["final_observation"]`` (gymnax's
    ``GymnaxToVectorGymWrapper``) reset in the same step, whatever their metadata says; see
    :func:`next_observations`. The rows of each step reach the buffer ordered by sub-env,
    then by time; use one buffer per sub-env if episodes must be stored contiguously (for
    sequence sampling).

    Parameters
    ----------
    env : gymnasium.vector.VectorEnv
        The vector environment.
    buffer : replay buffer
        Anything with ``add(transition_batch)``.
    tracer : NStep, MonteCarlo, VectorNStep or VectorMonteCarlo, optional
        The tracer, or a single-env template whose settings the vector tracer takes (default
        ``NStep(n=1, gamma=1.0)``).
    """

    def __init__(self, env: gymnasium.vector.VectorEnv, buffer: Any, tracer: Any = None) -> None:
        super().__init__(env)
        self.buffer = _check_buffer(buffer)
        self.tracer = vector_tracer(tracer, self.num_envs)
        self._mode = autoreset_mode(env)
        self._obs: Any = None
        self._skip = np.zeros(self.num_envs, bool)

    @property
    def autoreset_mode(self) -> str:
        """The env's autoreset mode: "NextStep", "SameStep" or "Disabled" (gymnasium's
        vector envs declare it in their metadata; before gymnasium 1.1 all are
        "NextStep")."""
        return self._mode

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        """Reset the env (all sub-envs, or those in ``options["reset_mask"]``)."""
        # read before the env's reset: gymnasium's vector envs pop "reset_mask" from options
        mask = (kwargs.get("options") or {}).get("reset_mask")
        obs, info = self.env.reset(**kwargs)
        if mask is None or self._obs is None:  # after a failed recording, restart all chains
            mask = np.ones(self.num_envs, bool)
        mask = np.asarray(mask, bool)
        self.tracer.reset(mask)
        self._skip[mask] = False
        self._obs = _copy_tree(obs)
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict]:
        """Step the env and record one transition per sub-env."""
        if self._obs is None:
            raise RuntimeError(_UNSYNCED)
        # a list of actions (one per sub-env) becomes an array
        acts = np.array(actions) if isinstance(actions, list) else _copy_tree(actions)
        for x in jax.tree_util.tree_leaves(acts):  # refused before stepping
            if x.shape[:1] != (self.num_envs,):
                raise ValueError(
                    f"actions must hold one action per sub-env ({self.num_envs}), got a leaf "
                    f"of shape {x.shape}"
                )
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        try:
            next_obs, same_step = next_observations(obs, terminated, truncated, info, self._mode)
            ended = np.logical_or(terminated, truncated) & ~self._skip
            self.tracer.add(
                self._obs,
                acts,
                rewards,
                terminated,
                truncated=truncated,
                s_next=next_obs,
                active=~self._skip,
            )
            _add_vector_rows(self.tracer, self.buffer, ended)
        except BaseException:
            self._obs = None  # the env moved on without the recorder: refuse steps until reset
            raise
        self._skip = ended & (self._mode == "NextStep") & (not same_step)
        self._obs = next_obs if not same_step else _copy_tree(obs)
        return obs, rewards, terminated, truncated, info
