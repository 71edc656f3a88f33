"""Small envs for the bridge tests: a gymnasium env and pure-JAX gymnax-style envs."""

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
from packaging.version import Version

from coax_utils import envs
from coax_utils._dataclass import pytree_dataclass, static_field

gs = gymnasium.spaces

# gymnasium's Discrete takes a dtype from 1.2.2 on; before, its elements are always int64
DISCRETE_TAKES_DTYPE = Version(gymnasium.__version__) >= Version("1.2.2")


def gym_discrete_dtype(dtype):
    """The dtype of a gymnasium Discrete asked for with ``dtype`` (int64 before 1.2.2)."""
    return np.dtype(dtype if DISCRETE_TAKES_DTYPE else np.int64)

MOVES = np.array([[1, 0], [-1, 0], [0, 1], [0, -1]], np.float32)


class DriftEnv(gymnasium.Env):
    """A noisy walk on the plane with a Dict observation.

    Start, moves and rewards are random (through ``np_random``), the episode terminates when
    the walker leaves the square [-3, 3]^2, and the info has one key of fixed shape
    (``noise``) and one whose shape changes every step (``trail``).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode=None):
        self.observation_space = gs.Dict(
            {"pos": gs.Box(-10.0, 10.0, (2,), np.float32), "steps": gs.Discrete(100)}
        )
        self.action_space = gs.Discrete(4)
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._pos = self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32)
        self._t = 0
        return self._obs(), {"start": self._pos.copy()}

    def step(self, action):
        noise = self.np_random.normal(0.0, 0.3, 2).astype(np.float32)
        self._pos = (self._pos + MOVES[int(action)] + noise).astype(np.float32)
        self._t += 1
        terminated = bool(np.abs(self._pos).max() > 3.0)
        reward = float(-np.abs(self._pos).sum() + self.np_random.normal())
        info = {"noise": np.float32(noise.sum()), "trail": np.zeros(self._t)}
        return self._obs(), reward, terminated, False, info

    def _obs(self):
        pos = np.clip(self._pos, -10.0, 10.0).astype(np.float32)
        return {"pos": pos, "steps": np.int64(min(self._t, 99))}

    def render(self):
        frame = np.zeros((16, 16, 3), np.uint8)
        i, j = np.clip(np.round(self._pos * 2 + 8).astype(int), 0, 15)
        frame[i, j] = (255, 128, 0)
        frame[0, : min(self._t, 16)] = (0, 0, 255)  # a step counter: every frame differs
        return frame


def make_drift_env(max_episode_steps=12, render_mode=None):
    return gymnasium.wrappers.TimeLimit(DriftEnv(render_mode), max_episode_steps)


@pytree_dataclass
class LineParams:
    push: float = 0.5
    max_steps: int = static_field(default=25)


@pytree_dataclass
class LineState:
    pos: jax.Array
    t: jax.Array


class LineEnv:
    """A pure-JAX gymnax-style env: a point pushed around the plane, with random pushes.

    ``api="new"``: ``step_env`` returns the 6-tuple and ``step`` autoresets like gymnax.
    ``api="old"``: only ``step``, returning the 5-tuple ``(obs, state, reward, done, info)``
    without autoreset.
    """

    def __init__(self, api="new"):
        self.api = api
        if api == "old":
            self.step = self._step_old

    @property
    def default_params(self):
        return LineParams()

    def observation_space(self, params):
        return envs.Box(-5.0, 5.0, (2,), np.float32)

    def action_space(self, params):
        return envs.Discrete(4)

    def reset(self, key, params=None):
        pos = jax.random.uniform(key, (2,), jnp.float32, -1.0, 1.0)
        state = LineState(pos=pos, t=jnp.zeros([], jnp.int32))
        return self._obs(state), state

    def _obs(self, state):
        return jnp.clip(state.pos, -5.0, 5.0)

    def _transition(self, key, state, action, params):
        push = params.push * jax.random.normal(key, (2,), jnp.float32)
        pos = state.pos + jnp.asarray(MOVES)[action] + push
        state = LineState(pos=pos, t=state.t + 1)
        reward = -jnp.abs(pos).sum()
        terminated = jnp.abs(pos).max() > 3.0
        truncated = jnp.logical_and(~terminated, state.t >= params.max_steps)
        return state, reward, terminated, truncated

    def step_env(self, key, state, action, params):
        state, reward, terminated, truncated = self._transition(key, state, action, params)
        info = {"t": state.t}
        return self._obs(state), state, reward, terminated, truncated, info

    def step(self, key, state, action, params=None):
        if params is None:
            params = self.default_params
        key, key_reset = jax.random.split(key)
        obs, state, reward, terminated, truncated, info = self.step_env(key, state, action, params)
        obs_re, state_re = self.reset(key_reset, params)
        done = jnp.logical_or(terminated, truncated)
        state = jax.tree_util.tree_map(lambda a, b: jnp.where(done, a, b), state_re, state)
        obs = jnp.where(done, obs_re, obs)
        return obs, state, reward, terminated, truncated, info

    def _step_old(self, key, state, action, params=None):
        if params is None:
            params = self.default_params
        state, reward, terminated, truncated = self._transition(key, state, action, params)
        done = jnp.logical_or(terminated, truncated)
        return self._obs(state), state, reward, done, {"discount": 1.0 - done}

    def render(self, state, params):
        frame = jnp.zeros((8, 8, 3), jnp.uint8)
        i, j = jnp.clip(jnp.round(state.pos + 4).astype(jnp.int32), 0, 7)
        return frame.at[i, j].set(jnp.array([255, 255, 255], jnp.uint8))
