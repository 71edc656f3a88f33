"""The gymnasium <-> functional-JAX environment bridge.

:class:`GymnasiumToJax` exposes a (stateful, host-side) gymnasium env through the functional
gymnax API, calling it from jitted code with :func:`jax.experimental.io_callback`.
:class:`JaxToGymnasium` goes the other way: it runs a functional JAX env behind the
:class:`gymnasium.Env` interface.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from coax_utils._checks import check_seed
from coax_utils._dataclass import pytree_dataclass
from coax_utils.envs._spaces import (
    Space,
    canonical_dtype,
    check_jax_can_hold,
    jax_can_hold,
    to_gymnasium_space,
    to_jax_space,
)
from coax_utils.envs._step import step_without_autoreset

__all__ = ["GymnasiumParams", "GymnasiumState", "GymnasiumToJax", "JaxToGymnasium"]

_COUNTER_MOD = 2**32
# each bridge starts counting at its own point, spread over the uint32 range (a golden-ratio
# stride), so that a state of one bridge is refused by another
_COUNTER_STRIDE = 0x9E3779B9
_instances = itertools.count()
_FINAL_OBSERVATION = "info['final_observation']"


@pytree_dataclass
class GymnasiumState:
    """The functional state of a :class:`GymnasiumToJax` env.

    The real env state lives in the wrapped gymnasium env on the host; this pytree only
    carries ``counter``, the number of ``reset``/``step`` calls the env has served when the
    state was produced, counted from a starting point of its own for each bridge (uint32,
    wrapping around). The host checks it on every ``step``, so a stale state (one that was
    already stepped) or a state of another bridge is refused instead of silently stepping
    the env from wherever it is now.
    """

    counter: Any


@pytree_dataclass
class GymnasiumParams:
    """The (empty) env parameters of a :class:`GymnasiumToJax` env.

    A gymnasium env is configured when it is made, so there is nothing to pass here; the
    class exists so that code written for gymnax's ``params`` argument runs unchanged.
    """


class _Packer:
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


def _cast_action(space: gymnasium.Space, x: Any) -> Any:
    """Convert a host copy of a JAX action to what the gymnasium ``space`` expects."""
    if isinstance(space, gymnasium.spaces.Tuple):
        return tuple(_cast_action(s, xi) for s, xi in zip(space.spaces, x))
    if isinstance(space, gymnasium.spaces.Dict):
        return {k: _cast_action(s, x[k]) for k, s in space.spaces.items()}
    if isinstance(space, gymnasium.spaces.Discrete):
        return int(x)
    arr = np.asarray(x, dtype=space.dtype)
    return arr[()] if arr.ndim == 0 else arr


class GymnasiumToJax:
    r"""A gymnasium env behind the functional gymnax API, callable from jitted code.

    Every ``reset``/``step`` is one :func:`jax.experimental.io_callback` (``ordered=True``)
    into the wrapped env on the host, so the methods work eagerly, under :func:`jax.jit` and
    inside :func:`jax.lax.scan`, and calls run in program order:

    .. code-block:: python

        env = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
        params = env.default_params

        @jax.jit
        def rollout(key):
            obs, state = env.reset(key, params)

            def body(carry, key):
                obs, state = carry
                action = env.action_space(params).sample(key)
                obs, state, reward, terminated, truncated, info = env.step(
                    key, state, action, params)
                return (obs, state), (reward, terminated, truncated)

            return jax.lax.scan(body, (obs, state), jax.random.split(key, 100))

    **Seeding.** With ``seed``, the first ``reset`` calls ``env.reset(seed=seed)`` (so it
    returns exactly what that call returns) and later resets call ``env.reset()``,
    continuing the env's own random stream. Without ``seed``, every ``reset`` draws a seed
    from its ``key``. ``step`` ignores its ``key``: the env uses its own random stream.

    **Autoreset.** Like gymnax, ``step`` on a single env resets it when the episode ends
    (``terminated or truncated``): the returned ``obs`` is then the first observation of
    the next episode, and ``info["final_obs"]`` is the last observation of the finished
    one. ``step_env`` is the same step without autoreset (as in gymnax): after the end of
    an episode the next call must be ``reset``. An env that resets itself in the step that
    ends an episode and reports the last observation in ``info["final_observation"]``
    (gymnax's ``GymnaxToGymWrapper``) is not reset a second time: that observation becomes
    ``info["final_obs"]`` (and ``obs`` of ``step_env``).

    **Vector envs.** :class:`gymnasium.vector.SyncVectorEnv` and
    :class:`~gymnasium.vector.AsyncVectorEnv` reset their sub-envs themselves, following
    their own ``autoreset_mode`` (gymnasium's default is next-step: the step after the end
    returns the reset observation with zero reward); the bridge adds nothing, and
    observations, rewards and flags carry a leading ``num_envs`` axis. Same-step vector envs
    report the last observations in the info (gymnasium's ``final_obs`` with its mask, or
    gymnax's ``GymnaxToVectorGymWrapper``'s batched ``final_observation``), which the bridge
    returns as ``info["final_obs"]``. A vector env with
    ``autoreset_mode=AutoresetMode.DISABLED`` does not reset its sub-envs, so the bridge
    treats it like a single env: ``step`` resets the sub-envs whose episode ended
    (``env.reset(options={"reset_mask": done})``, same step, the last observations in
    ``info["final_obs"]``), and after an end in ``step_env`` the next call must be ``reset``.

    **Info.** A gymnasium info dict has no fixed shape, so it is not passed through whole.
    The returned ``info`` contains exactly:

    - ``"final_obs"``: the observation reached by the action, before any autoreset (equal
      to ``obs`` unless the bridge or an env that resets itself in the same step did);
    - every key declared in ``info_spec``, cast to the declared dtype (zeros when the env
      did not report the key on this step).

    Every other info key is dropped.

    **Misuse.** The wrapped env has a single state on the host, so the bridge refuses what
    it cannot honour, with a :class:`ValueError` (surfacing from jitted code as a runtime
    error that carries the message): :func:`jax.vmap` over ``reset``/``step`` (use a
    gymnasium vector env for batches), ``step`` before ``reset``, ``step`` with a stale
    state, i.e. any state other than the one returned by the latest ``reset``/``step`` of
    this bridge (e.g. stepping the same state twice), stepping a single env (or a vector env without
    autoreset) whose episode ended in ``step_env`` without a ``reset`` in between, and
    stepping again after a step or reset whose observation or info could not be converted
    (the env has moved on, so no earlier state describes it: only ``reset`` goes on).

    Parameters
    ----------
    env : gymnasium.Env or gymnasium.vector.VectorEnv
        The env. Its spaces must be convertible with :func:`to_jax_space`, and the integer
        values of its observation space must fit the dtype JAX uses (32 bits without
        ``jax_enable_x64``): otherwise a ValueError is raised here, as they would wrap around.
        For the same reason an observation for an integer space that holds floats or
        integers beyond that dtype is refused (ValueError when it arrives) rather than
        truncated or wrapped.
    seed : int, optional
        The seed of the first reset.
    info_spec : mapping of str to jax.ShapeDtypeStruct, optional
        Info keys to keep, with their shape and dtype (per step; vector envs report arrays
        with a leading ``num_envs`` axis).

    Attributes
    ----------
    env : gymnasium.Env
        The wrapped env.
    num_envs : int or None
        The number of sub-envs of a vector env, None for a single env.

    Examples
    --------
    >>> import gymnasium, jax
    >>> env = GymnasiumToJax(gymnasium.make("CartPole-v1"), seed=0)
    >>> obs, state = env.reset(jax.random.key(0))
    >>> bool((obs == gymnasium.make("CartPole-v1").reset(seed=0)[0]).all())
    True
    >>> step = jax.jit(env.step)
    >>> obs, state, reward, terminated, truncated, info = step(None, state, 1)
    >>> float(reward), bool(terminated), sorted(info)
    (1.0, False, ['final_obs'])
    """

    def __init__(
        self,
        env: gymnasium.Env | gymnasium.vector.VectorEnv,
        seed: int | None = None,
        *,
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
        self._reset_sub_envs = self.num_envs is not None and (
            getattr(env, "metadata", {}).get("autoreset_mode")
            == gymnasium.vector.AutoresetMode.DISABLED
        )
        self._seed = None if seed is None else int(seed)
        self._obs_space = to_jax_space(env.observation_space)
        check_jax_can_hold(self._obs_space, "the observation space")
        self._act_space = to_jax_space(env.action_space)
        self._gym_act_space = env.action_space
        batch = () if self.num_envs is None else (self.num_envs,)

        obs_spec = self._obs_space.shape_dtype()
        self._obs_leaf_specs, self._obs_treedef = jax.tree_util.tree_flatten(obs_spec)
        act_spec = self._act_space.shape_dtype()
        self._act_leaf_specs, self._act_treedef = jax.tree_util.tree_flatten(act_spec)

        self._info_spec: dict[str, jax.ShapeDtypeStruct] = {}
        for k, v in dict(info_spec or {}).items():
            if not isinstance(k, str) or k == "final_obs":
                raise ValueError(
                    f"info_spec keys must be strings other than 'final_obs', got {k!r}"
                )
            if not (hasattr(v, "shape") and hasattr(v, "dtype")):
                raise TypeError(f"info_spec[{k!r}] must have a shape and a dtype, got {v!r}")
            self._info_spec[k] = jax.ShapeDtypeStruct(tuple(v.shape), canonical_dtype(v.dtype))

        flag = jax.ShapeDtypeStruct(batch, jnp.bool_)
        self._reset_result = (
            jax.ShapeDtypeStruct((), jnp.uint32),
            *self._obs_leaf_specs,
        )
        self._step_result = (
            *self._obs_leaf_specs,
            jax.ShapeDtypeStruct(batch, jnp.float32),
            flag,
            flag,
            *self._obs_leaf_specs,
            *self._info_spec.values(),
        )

        # host-side bookkeeping
        self._counter = next(_instances) * _COUNTER_STRIDE % _COUNTER_MOD
        self._reset_done = False
        # why the next step is refused until a reset (None when it may go on)
        self._must_reset: str | None = None

        self._call_reset = self._no_vmap(self._io(self._host_reset, self._reset_result), "reset")
        # a step moves one uint8 buffer each way: every extra callback operand or result
        # costs a host transfer, and that overhead dominates cheap envs
        self._step_in = _Packer([jax.ShapeDtypeStruct((), jnp.uint32), *self._act_leaf_specs])
        self._step_out = _Packer(self._step_result)
        self._call_step = self._no_vmap(
            self._io(functools.partial(self._host_step, True), self._step_out.spec), "step"
        )
        self._call_step_env = self._no_vmap(
            self._io(functools.partial(self._host_step, False), self._step_out.spec), "step_env"
        )

    # -- the gymnax API --------------------------------------------------------------------

    @property
    def default_params(self) -> GymnasiumParams:
        """The (empty) env parameters."""
        return GymnasiumParams()

    def observation_space(self, params: Any = None) -> Space:
        """The observation space as a JAX space (batched for vector envs)."""
        return self._obs_space

    def action_space(self, params: Any = None) -> Space:
        """The action space as a JAX space (batched for vector envs)."""
        return self._act_space

    def reset(self, key: jax.Array, params: Any = None) -> tuple[Any, GymnasiumState]:
        """Reset the env.

        Parameters
        ----------
        key : jax.Array
            A PRNG key; the reset seed is drawn from it unless the bridge was made with a
            ``seed`` (see the class docstring).
        params : GymnasiumParams, optional
            Ignored.

        Returns
        -------
        obs, state
            The first observation and the new state.
        """
        seed = jax.random.randint(key, (), 0, np.iinfo(np.int32).max, dtype=jnp.int32)
        counter, *obs = self._call_reset(seed)
        return self._obs_treedef.unflatten(obs), GymnasiumState(counter=counter)

    def step(
        self, key: jax.Array, state: GymnasiumState, action: Any, params: Any = None
    ) -> tuple[Any, GymnasiumState, jax.Array, jax.Array, jax.Array, dict]:
        """Take one step.

        Parameters
        ----------
        key : jax.Array
            Ignored (the env has its own random stream).
        state : GymnasiumState
            The state returned by the latest ``reset`` or ``step``.
        action : pytree of arrays
            An element of :meth:`action_space`.
        params : GymnasiumParams, optional
            Ignored.

        Returns
        -------
        obs, state, reward, terminated, truncated, info
            The next observation (after autoreset, see the class docstring), the new state,
            the reward (float32), the termination and truncation flags (bool) and the info
            dict.

        Raises
        ------
        ValueError
            When ``action`` does not have the action space's structure and shapes, or holds
            host integers beyond the dtype JAX uses (32 bits without x64; at trace time), or
            when it is not an element of the action space (e.g. out of range),
            the state is stale or no reset happened (when the step runs, before the env
            is stepped).
        TypeError
            When an action leaf has a dtype that does not cast to the space's dtype without
            changing kind (e.g. the float 0.9 for a Discrete space), at trace time.
        """
        return self._step(self._call_step, state, action)

    def step_env(
        self, key: jax.Array, state: GymnasiumState, action: Any, params: Any = None
    ) -> tuple[Any, GymnasiumState, jax.Array, jax.Array, jax.Array, dict]:
        """Take one step without autoreset (same arguments and returns as :meth:`step`).

        After a single env's episode ends here, the next call must be :meth:`reset`; so too
        after any sub-env's end in a vector env with ``autoreset_mode`` DISABLED. For other
        vector envs this is the same as :meth:`step`.
        """
        return self._step(self._call_step_env, state, action)

    def _step(self, call: Callable, state: GymnasiumState, action: Any) -> tuple:
        counter = jnp.asarray(state.counter, jnp.uint32)
        leaves = self._action_leaves(action)
        out = self._step_out.unpack_jax(call(self._step_in.pack_jax([counter, *leaves])))
        n = len(self._obs_leaf_specs)
        obs = self._obs_treedef.unflatten(out[:n])
        reward, terminated, truncated = out[n : n + 3]
        final_obs = self._obs_treedef.unflatten(out[n + 3 : 2 * n + 3])
        info = {"final_obs": final_obs, **dict(zip(self._info_spec, out[2 * n + 3 :]))}
        return obs, GymnasiumState(counter=counter + 1), reward, terminated, truncated, info

    def close(self) -> None:
        """Close the wrapped env."""
        self.env.close()

    def __repr__(self) -> str:
        return f"GymnasiumToJax({self.env!r})"

    # -- JAX side helpers ------------------------------------------------------------------

    def _action_leaves(self, action: Any) -> list[jax.Array]:
        try:
            leaves = self._act_treedef.flatten_up_to(action)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"action {action!r} does not have the structure of the action space "
                f"{self._act_space!r}"
            ) from e
        out = []
        for x, spec in zip(leaves, self._act_leaf_specs):
            try:
                if not isinstance(x, jax.Array):
                    x = np.asarray(x)
                    if not jax_can_hold(x):
                        raise ValueError(
                            f"action {action!r} is beyond the range of {canonical_dtype(x.dtype)}, "
                            "the dtype JAX uses for it: it would wrap around; it is not an "
                            f"element of the action space {self._act_space!r}"
                        )
                x = jnp.asarray(x)
            except TypeError as e:
                raise ValueError(
                    f"action {action!r} does not have the structure of the action space "
                    f"{self._act_space!r}"
                ) from e
            if x.shape != spec.shape:
                raise ValueError(
                    f"action of shape {x.shape} does not match the action space "
                    f"{self._act_space!r}, which expects shape {spec.shape}"
                )
            if not np.can_cast(x.dtype, spec.dtype, "same_kind"):
                raise TypeError(
                    f"action {action!r} of dtype {x.dtype} cannot be an element of the action "
                    f"space {self._act_space!r} (dtype {spec.dtype}): casting would change it"
                )
            out.append(x.astype(spec.dtype))
        return out

    @staticmethod
    def _io(fn: Callable, result: tuple) -> Callable:
        def call(*args: Any) -> Any:
            return io_callback(fn, result, *args, ordered=True)

        return call

    def _no_vmap(self, fn: Callable, name: str) -> Callable:
        guarded = jax.custom_batching.custom_vmap(fn)

        def refuse(axis_size: int, in_batched: Any, *args: Any) -> Any:
            kind = "vector env" if self.num_envs is not None else "single gymnasium env"
            raise ValueError(
                f"GymnasiumToJax.{name} cannot be vmapped: it drives one {kind} that has a "
                "single state on the host. For batched envs wrap a gymnasium vector env "
                "(gymnasium.vector.SyncVectorEnv/AsyncVectorEnv) instead of using jax.vmap."
            )

        guarded.def_vmap(refuse)
        return guarded

    # -- host side -------------------------------------------------------------------------

    def _obs_leaves(self, obs: Any, what: str) -> list[np.ndarray]:
        if self._obs_treedef.num_leaves == 1 and self._obs_treedef.num_nodes == 1:
            leaves = [obs]  # a single array: nothing to flatten
        else:
            leaves = self._flatten_obs(obs, what)
        out = []
        for x, spec in zip(leaves, self._obs_leaf_specs):
            arr = np.asarray(x)
            if arr.dtype != spec.dtype and np.issubdtype(spec.dtype, np.integer):
                self._check_int_obs(arr, spec.dtype, what)
            arr = np.asarray(arr, dtype=spec.dtype)
            if arr.shape != spec.shape:
                raise ValueError(
                    f"the env returned {what} of shape {arr.shape}, but its observation space "
                    f"{self._obs_space!r} has shape {spec.shape}"
                )
            out.append(arr)
        return out

    def _check_int_obs(self, arr: np.ndarray, dtype: np.dtype, what: str) -> None:
        """Refuse an observation that casting to the integer ``dtype`` would change."""
        if arr.dtype != np.bool_ and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"the env returned {what} of dtype {arr.dtype} for its integer observation "
                f"space {self._obs_space!r}: casting to {dtype} would truncate it"
            )
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(
                f"the env returned {what} with values in [{arr.min()}, {arr.max()}], beyond "
                f"the range of {dtype}, the dtype JAX uses for its observation space "
                f"{self._obs_space!r}: they would wrap around"
            )

    def _flatten_obs(self, obs: Any, what: str) -> list:
        try:
            return self._obs_treedef.flatten_up_to(obs)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"the env returned {what} {obs!r}, which does not have the structure of its "
                f"observation space {self._obs_space!r}"
            ) from e

    def _host_reset(self, seed: Any) -> tuple:
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

    def _host_step(self, autoreset: bool, buf: Any) -> np.ndarray:
        counter, *action_leaves = self._step_in.unpack_np(buf)
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
        action = _cast_action(self._gym_act_space, self._act_treedef.unflatten(action_leaves))
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
        extra = self._info_leaves(info) if self._info_spec else []
        # the packer casts reward and flags while writing them into the buffer
        return self._step_out.pack_np([*leaves, reward, terminated, truncated, *final, *extra])

    def _final_obs_of_vector(self, obs_leaves: list[np.ndarray], info: dict) -> list:
        """Same-step autoreset vector envs report the final observations in the info."""
        final = [np.array(x) for x in obs_leaves]
        for i in np.flatnonzero(np.asarray(info["_final_obs"])):
            sub = self._obs_treedef.flatten_up_to(info["final_obs"][i])
            for leaf, x in zip(final, sub):
                leaf[i] = x
        return final

    def _info_leaves(self, info: dict) -> list[np.ndarray]:
        out = []
        for k, spec in self._info_spec.items():
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
