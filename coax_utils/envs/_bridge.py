"""The gymnasium -> functional-JAX environment bridge.

:class:`GymnasiumToJax` exposes a (stateful, host-side) gymnasium env through the functional
gymnax API, calling it from jitted code with :func:`jax.experimental.io_callback`. This
module is its JAX side; the host side (the wrapped env and its bookkeeping) is
:mod:`coax_utils.envs._bridge_host`, and :class:`~coax_utils.envs.JaxToGymnasium` (the other
direction) lives in :mod:`coax_utils.envs._jax_to_gymnasium`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from coax_utils._dataclass import pytree_dataclass
from coax_utils.envs._bridge_host import BridgeHost
from coax_utils.envs._dtypes import canonical_dtype, jax_can_hold
from coax_utils.envs._spaces import Space

__all__ = ["GymnasiumParams", "GymnasiumState", "GymnasiumToJax"]

# Before jax 0.8.2, an ordered io_callback inside custom_vmap loses its effect (a KeyError
# on OrderedIOEffect under jit or scan), so the bridge guards against vmap only from 0.8.2 on;
# before, jax itself refuses to vmap an ordered io_callback, in its own words.
_GUARD_VMAP = jax.__version_info__ >= (0, 8, 2)


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
    gymnasium vector env for batches; before jax 0.8.2 the ValueError is jax's own, "Cannot
    vmap ordered IO callback"), ``step`` before ``reset``, ``step`` with a stale
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
        self._host = host = BridgeHost(env, seed, info_spec)
        self.env = env
        self.num_envs = host.num_envs
        self._call_reset = self._no_vmap(self._io(host.reset, host.reset_result), "reset")
        self._call_step = self._no_vmap(
            self._io(functools.partial(host.step, True), host.step_out.spec), "step"
        )
        self._call_step_env = self._no_vmap(
            self._io(functools.partial(host.step, False), host.step_out.spec), "step_env"
        )

    # -- the gymnax API --------------------------------------------------------------------

    @property
    def default_params(self) -> GymnasiumParams:
        """The (empty) env parameters."""
        return GymnasiumParams()

    def observation_space(self, params: Any = None) -> Space:
        """The observation space as a JAX space (batched for vector envs)."""
        return self._host.obs_space

    def action_space(self, params: Any = None) -> Space:
        """The action space as a JAX space (batched for vector envs)."""
        return self._host.act_space

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
        return self._host.obs_treedef.unflatten(obs), GymnasiumState(counter=counter)

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
        out = self._host.step_out.unpack_jax(call(self._host.step_in.pack_jax([counter, *leaves])))
        n = len(self._host.obs_leaf_specs)
        obs = self._host.obs_treedef.unflatten(out[:n])
        reward, terminated, truncated = out[n : n + 3]
        final_obs = self._host.obs_treedef.unflatten(out[n + 3 : 2 * n + 3])
        info = {"final_obs": final_obs, **dict(zip(self._host.info_spec, out[2 * n + 3 :]))}
        return obs, GymnasiumState(counter=counter + 1), reward, terminated, truncated, info

    def close(self) -> None:
        """Close the wrapped env."""
        self.env.close()

    def __repr__(self) -> str:
        return f"GymnasiumToJax({self.env!r})"

    # -- JAX side helpers ------------------------------------------------------------------

    def _action_leaves(self, action: Any) -> list[jax.Array]:
        try:
            leaves = self._host.act_treedef.flatten_up_to(action)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"action {action!r} does not have the structure of the action space "
                f"{self._host.act_space!r}"
            ) from e
        out = []
        for x, spec in zip(leaves, self._host.act_leaf_specs):
            try:
                if not isinstance(x, jax.Array):
                    x = np.asarray(x)
                    if not jax_can_hold(x):
                        raise ValueError(
                            f"action {action!r} is beyond the range of {canonical_dtype(x.dtype)}, "
                            "the dtype JAX uses for it: it would wrap around; it is not an "
                            f"element of the action space {self._host.act_space!r}"
                        )
                x = jnp.asarray(x)
            except TypeError as e:
                raise ValueError(
                    f"action {action!r} does not have the structure of the action space "
                    f"{self._host.act_space!r}"
                ) from e
            if x.shape != spec.shape:
                raise ValueError(
                    f"action of shape {x.shape} does not match the action space "
                    f"{self._host.act_space!r}, which expects shape {spec.shape}"
                )
            if not np.can_cast(x.dtype, spec.dtype, "same_kind"):
                raise TypeError(
                    f"action {action!r} of dtype {x.dtype} cannot be an element of the action "
                    f"space {self._host.act_space!r} (dtype {spec.dtype}): casting would change it"
                )
            out.append(x.astype(spec.dtype))
        return out

    @staticmethod
    def _io(fn: Callable, result: tuple) -> Callable:
        def call(*args: Any) -> Any:
            return io_callback(fn, result, *args, ordered=True)

        return call

    def _no_vmap(self, fn: Callable, name: str) -> Callable:
        if not _GUARD_VMAP:
            return fn
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
