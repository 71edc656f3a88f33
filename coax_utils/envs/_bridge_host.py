"""The host side of :class:`~coax_utils.envs.GymnasiumToJax`.

:class:`BridgeHost` owns the wrapped gymnasium env and everything the bridge knows about it on
the host: the layout of observations, actions and infos, the call counter that tells stale
states apart, and the reset/step callbacks that :func:`jax.experimental.io_callback` runs.
:class:`Packer` carries arrays across a callback as one byte buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np

from coax_utils._checks import check_seed
from coax_utils.envs._convert import check_jax_can_hold, to_jax_space
from coax_utils.envs._dtypes import canonical_dtype

__all__ = ["BridgeHost", "Packer", "cast_action"]

_COUNTER_MOD = 2**32
# each bridge starts counting at its own point, spread over the uint32 range (a golden-ratio
# stride), so that a state of one bridge is refused by another
_COUNTER_STRIDE = 0x9E3779B9
_instances = itertools.count()
_FINAL_OBSERVATION = "info['final_observation']"


class Packer:
    """Carry a fixed list of arrays as one uint8 buffer across a host callback.

    Leaves of the same dtype sit next to each other (groups ordered by item size, so every
    group is aligned), each group in its dtype's native byte order; booleans take one byte.
    Both sides run on the same machine, so the byte order agrees. On the host, each leaf is
    written with one slice assignment into a typed view of its group.
    """

    def __init__(self, specs: Any) -> None:
        self.specs = [jax.ShapeDtypeStruct(tuple(s.shape), np.dtype(s.dtype)) for s in specs]
        dtypes = sorted({s.dtype for s in self.specs}, key=lambda d: (-d.itemsize, d.str))
        self.groups: list[tuple[np.dtype, int, int]] = []  # (dtype, start byte, stop byte)
        self.slots: list[tuple[int, int, int]] = [(0, 0, 0)] * len(self.specs)
        start = 0
        for g, dt in enumerate(dtypes):
            count = 0
            for i, spec in enumerate(self.specs):
                if spec.dtype == dt:
                    size = int(np.prod(spec.shape))
                    self.slots[i] = (g, count, count + size)
                    count += size
            self.groups.append((dt, start, start + count * dt.itemsize))
            start += count * dt.itemsize
        self.nbytes = start
        self.spec = jax.ShapeDtypeStruct((start,), jnp.uint8)

    def pack_jax(self, leaves: list) -> jax.Array:
        parts = []
        for g, (dt, _, _) in enumerate(self.groups):
            flat = [
                jnp.asarray(x, dt).reshape(-1)
                for x, (gx, _, _) in zip(leaves, self.slots)
                if gx == g
            ]
            x = jnp.concatenate(flat)
            if dt == np.bool_:
                x = x.astype(jnp.uint8)
            parts.append(jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1))
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)

    def unpack_jax(self, buf: jax.Array) -> list[jax.Array]:
        typed = []
        for dt, a, b in self.groups:
            chunk = buf[a:b]
            if dt == np.bool_:
                typed.append(chunk != 0)
            elif dt.itemsize == 1:
                typed.append(jax.lax.bitcast_convert_type(chunk, dt))
            else:
                typed.append(jax.lax.bitcast_convert_type(chunk.reshape(-1, dt.itemsize), dt))
        return [
            typed[g][i:j].reshape(spec.shape) for spec, (g, i, j) in zip(self.specs, self.slots)
        ]

    def pack_np(self, leaves: list) -> np.ndarray:
        buf = np.empty(self.nbytes, np.uint8)
        views = [buf[a:b].view(dt) for dt, a, b in self.groups]
        for x, (g, i, j) in zip(leaves, self.slots):
            views[g][i:j] = np.ravel(x) if np.ndim(x) > 1 else x
        return buf

    def unpack_np(self, buf: Any) -> list[np.ndarray]:
        buf = np.asarray(buf)
        views = [buf[a:b].view(dt) for dt, a, b in self.groups]
        return [
            views[g][i:j].reshape(spec.shape) for spec, (g, i, j) in zip(self.specs, self.slots)
        ]


def cast_action(space: gymnasium.Space, x: Any) -> Any:
    """Convert a host copy of a JAX action to what the gymnasium ``space`` expects."""
    if isinstance(space, gymnasium.spaces.Tuple):
        return tuple(cast_action(s, xi) for s, xi in zip(space.spaces, x))
    if isinstance(space, gymnasium.spaces.Dict):
        return {k: cast_action(s, x[k]) for k, s in space.spaces.items()}
    if isinstance(space, gymnasium.spaces.Discrete):
        return int(x)
    arr = np.asarray(x, dtype=space.dtype)
    return arr[()] if arr.ndim == 0 else arr


def _autoreset_disabled(env: gymnasium.vector.VectorEnv) -> bool:
    """Whether the vector env's sub-envs never reset themselves (``AutoresetMode.DISABLED``).

    Gymnasium has autoreset modes from 1.1 on; before, every vector env resets its sub-envs
    on the next step, and a mode that an env declares anyway is refused rather than misread.
    """
    mode = getattr(env, "metadata", {}).get("autoreset_mode")
    modes = getattr(gymnasium.vector, "AutoresetMode", None)
    if modes is not None:
        return mode is not None and modes(mode) == modes.DISABLED
    if mode not in (None, "NextStep"):
        raise ValueError(
            f"the vector env declares autoreset_mode {mode!r}, which needs gymnasium 1.1 or "
            f"newer (installed: {gymnasium.__version__}, whose vector envs reset on the next "
            "step)"
        )
    return False


class BridgeHost:
    """The wrapped env of a bridge and its host-side bookkeeping.

    The constructor checks the env and ``info_spec`` (see
    :class:`~coax_utils.envs.GymnasiumToJax`) and works out the layout of what crosses a
    callback; :meth:`reset` and :meth:`step` are the callbacks.

    Attributes
    ----------
    env : gymnasium.Env or gymnasium.vector.VectorEnv
        The wrapped env.
    num_envs : int or None
        The number of sub-envs of a vector env, None for a single env.
    obs_space, act_space : Space
        The env's spaces as JAX spaces.
    obs_leaf_specs, act_leaf_specs : list of jax.ShapeDtypeStruct
        The leaves of an observation and of an action.
    obs_treedef, act_treedef : jax.tree_util.PyTreeDef
        Their structures.
    info_spec : dict of str to jax.ShapeDtypeStruct
        The info keys kept.
    reset_result : tuple of jax.ShapeDtypeStruct
        What :meth:`reset` returns: the call counter and the observation leaves.
    step_in, step_out : Packer
        The byte layouts of what :meth:`step` takes (call counter and action leaves) and
        returns (observation, reward, flags, final observation and info leaves).
    """

    def __init__(
        self,
        env: gymnasium.Env | gymnasium.vector.VectorEnv,
        seed: int | None = None,
        info_spec: Mapping[str, Any] | None = None,
    ) -> None:
        for attr in ("reset", "step", "observation_space", "action_space"):
            if not hasattr(env, attr):
                raise TypeError(f"env must be a gymnasium env, got {env!r} without {attr!r}")
        if seed is not None:
            check_seed(seed, "seed")
        self.env = env
        self.num_envs = int(env.num_envs) if isinstance(env, gymnasium.vector.VectorEnv) else None
        # a vector env whose sub-envs never reset themselves: the bridge resets them
        self._reset_sub_envs = self.num_envs is not None and _autoreset_disabled(env)
        self._seed = None if seed is None else int(seed)
        self.obs_space = to_jax_space(env.observation_space)
        check_jax_can_hold(self.obs_space, "the observation space")
        self.act_space = to_jax_space(env.action_space)
        self._gym_act_space = env.action_space
        batch = () if self.num_envs is None else (self.num_envs,)

        obs_spec = self.obs_space.shape_dtype()
        self.obs_leaf_specs, self.obs_treedef = jax.tree_util.tree_flatten(obs_spec)
        act_spec = self.act_space.shape_dtype()
        self.act_leaf_specs, self.act_treedef = jax.tree_util.tree_flatten(act_spec)

        self.info_spec: dict[str, jax.ShapeDtypeStruct] = {}
        for k, v in dict(info_spec or {}).items():
            if not isinstance(k, str) or k == "final_obs":
                raise ValueError(
                    f"info_spec keys must be strings other than 'final_obs', got {k!r}"
                )
            if not (hasattr(v, "shape") and hasattr(v, "dtype")):
                raise TypeError(f"info_spec[{k!r}] must have a shape and a dtype, got {v!r}")
            self.info_spec[k] = jax.ShapeDtypeStruct(tuple(v.shape), canonical_dtype(v.dtype))

        flag = jax.ShapeDtypeStruct(batch, jnp.bool_)
        self.reset_result = (
            jax.ShapeDtypeStruct((), jnp.uint32),
            *self.obs_leaf_specs,
        )
        # a step moves one uint8 buffer each way: every extra callback operand or result
        # costs a host transfer, and that overhead dominates cheap envs
        self.step_in = Packer([jax.ShapeDtypeStruct((), jnp.uint32), *self.act_leaf_specs])
        self.step_out = Packer(
            (
                *self.obs_leaf_specs,
                jax.ShapeDtypeStruct(batch, jnp.float32),
                flag,
                flag,
                *self.obs_leaf_specs,
                *self.info_spec.values(),
            )
        )

        self._counter = next(_instances) * _COUNTER_STRIDE % _COUNTER_MOD
        self._reset_done = False
        # why the next step is refused until a reset (None when it may go on)
        self._must_reset: str | None = None

    def _obs_leaves(self, obs: Any, what: str) -> list[np.ndarray]:
        if self.obs_treedef.num_leaves == 1 and self.obs_treedef.num_nodes == 1:
            leaves = [obs]  # a single array: nothing to flatten
        else:
            leaves = self._flatten_obs(obs, what)
        out = []
        for x, spec in zip(leaves, self.obs_leaf_specs):
            arr = np.asarray(x)
            if arr.dtype != spec.dtype and np.issubdtype(spec.dtype, np.integer):
                self._check_int_obs(arr, spec.dtype, what)
            arr = np.asarray(arr, dtype=spec.dtype)
            if arr.shape != spec.shape:
                raise ValueError(
                    f"the env returned {what} of shape {arr.shape}, but its observation space "
                    f"{self.obs_space!r} has shape {spec.shape}"
                )
            out.append(arr)
        return out

    def _check_int_obs(self, arr: np.ndarray, dtype: np.dtype, what: str) -> None:
        """Refuse an observation that casting to the integer ``dtype`` would change."""
        if arr.dtype != np.bool_ and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"the env returned {what} of dtype {arr.dtype} for its integer observation "
                f"space {self.obs_space!r}: casting to {dtype} would truncate it"
            )
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(
                f"the env returned {what} with values in [{arr.min()}, {arr.max()}], beyond "
                f"the range of {dtype}, the dtype JAX uses for its observation space "
                f"{self.obs_space!r}: they would wrap around"
            )

    def _flatten_obs(self, obs: Any, what: str) -> list:
        try:
            return self.obs_treedef.flatten_up_to(obs)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"the env returned {what} {obs!r}, which does not have the structure of its "
                f"observation space {self.obs_space!r}"
            ) from e

    def reset(self, seed: Any) -> tuple:
        """Reset the env (callback of ``reset``); returns the counter and observation leaves."""
        if self._seed is None:
            reset_seed: int | None = int(seed)
        else:
            reset_seed = None if self._reset_done else self._seed
        obs, _ = self.env.reset(seed=reset_seed)
        try:
            leaves = self._obs_leaves(obs, "the observation of reset")
        except Exception:
            # the env was reset: the state of the episode before no longer describes it
            self._must_reset = "a reset whose observation could not be converted"
            raise
        self._reset_done = True
        self._must_reset = None
        self._counter = (self._counter + 1) % _COUNTER_MOD
        return (np.uint32(self._counter), *leaves)

    def step(self, autoreset: bool, buf: Any) -> np.ndarray:
        """Step the env (callback of ``step``, or of ``step_env`` without ``autoreset``).

        ``buf`` is packed by :attr:`step_in`; the result is packed by :attr:`step_out`.
        """
        counter, *action_leaves = self.step_in.unpack_np(buf)
        counter = int(counter)
        if not self._reset_done:
            raise ValueError(
                "GymnasiumToJax.step was called before reset: call reset(key, params) first"
            )
        if counter != self._counter:
            raise ValueError(
                f"GymnasiumToJax.step got a stale state (call counter {counter}, but the "
                f"env's latest state has {self._counter}): pass the state returned by the "
                "latest reset or step of this bridge; the wrapped env cannot step from an "
                "earlier state, and calls must happen in order"
            )
        if self._must_reset is not None:
            raise ValueError(
                f"GymnasiumToJax.step was called after {self._must_reset}: call "
                "reset(key, params) first"
            )
        action = cast_action(self._gym_act_space, self.act_treedef.unflatten(action_leaves))
        if not self._gym_act_space.contains(action):
            raise ValueError(
                f"GymnasiumToJax.step got the action {action!r}, which is not an element of "
                f"the action space {self._gym_act_space}; the env was not stepped"
            )
        obs, reward, terminated, truncated, info = self.env.step(action)
        try:
            out = self._step_result_of(autoreset, obs, reward, terminated, truncated, info)
        except Exception:
            # the env has moved on, so the state that was passed in no longer describes it:
            # a retry with that state would silently skip this step
            self._must_reset = "a step whose result could not be converted"
            raise
        self._counter = (self._counter + 1) % _COUNTER_MOD
        return out

    def _step_result_of(
        self, autoreset: bool, obs: Any, reward: Any, terminated: Any, truncated: Any, info: dict
    ) -> np.ndarray:
        """The packed result of one env step (resetting a single env when it asks for it)."""
        final = self._obs_leaves(obs, "the observation of step")
        leaves = final
        if self.num_envs is None:
            if terminated or truncated:
                reset_itself = "final_observation" in info
                if reset_itself:  # obs is already the first one of the next episode
                    final = self._obs_leaves(info["final_observation"], _FINAL_OBSERVATION)
                if not autoreset:
                    leaves = final
                    self._must_reset = "the episode ended in step_env"
                elif not reset_itself:
                    obs, _ = self.env.reset()
                    leaves = self._obs_leaves(obs, "the observation of reset")
        elif self._reset_sub_envs:
            done = np.logical_or(terminated, truncated)
            if np.any(done):
                if autoreset:
                    obs, _ = self.env.reset(options={"reset_mask": done})
                    leaves = self._obs_leaves(obs, "the observation of reset")
                else:
                    self._must_reset = "a sub-env's episode ended in step_env"
        elif "final_obs" in info and "_final_obs" in info:
            final = self._final_obs_of_vector(final, info)
        elif "final_observation" in info:  # every sub-env's last observation, batched
            final = self._obs_leaves(info["final_observation"], _FINAL_OBSERVATION)
        extra = self._info_leaves(info) if self.info_spec else []
        # the packer casts reward and flags while writing them into the buffer
        return self.step_out.pack_np([*leaves, reward, terminated, truncated, *final, *extra])

    def _final_obs_of_vector(self, obs_leaves: list[np.ndarray], info: dict) -> list:
        """Same-step autoreset vector envs report the final observations in the info."""
        final = [np.array(x) for x in obs_leaves]
        for i in np.flatnonzero(np.asarray(info["_final_obs"])):
            sub = self.obs_treedef.flatten_up_to(info["final_obs"][i])
            for leaf, x in zip(final, sub):
                leaf[i] = x
        return final

    def _info_leaves(self, info: dict) -> list[np.ndarray]:
        out = []
        for k, spec in self.info_spec.items():
            if k not in info:
                out.append(np.zeros(spec.shape, spec.dtype))
                continue
            arr = np.asarray(info[k], dtype=spec.dtype)
            if arr.shape != spec.shape:
                raise ValueError(
                    f"info[{k!r}] has shape {arr.shape}, but info_spec declares {spec.shape}"
                )
            out.append(arr)
        return out
