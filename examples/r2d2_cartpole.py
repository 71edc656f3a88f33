"""R2D2-style recurrent DQN on CartPole-v1 with the velocities hidden.

The agent sees only the cart position and the pole angle, so it must infer the velocities
from what it saw before: a Haiku LSTM (``hk.LSTM``) carries that memory. It acts in a
gymnasium vector env of 8 sub-envs (next-step autoreset); ``replay.RecordVectorSequences``
records every step into a ``replay.PrioritizedSequenceReplayBuffer``, one chain per
sub-env, with the LSTM state the agent acted from. The learner samples windows of 20 steps
(written every 15 steps), unrolls the LSTM from each window's stored state, leaves the first
5 steps out of the loss (burn-in, ``loss_mask``), and trains double Q-learning with
importance weights; the per-step TD errors go back to the buffer as R2D2's priority mixture
``0.9 max|delta| + 0.1 mean|delta|``.

Measured with ``python examples/r2d2_cartpole.py`` (seed 0, 150k env steps, about 12
minutes on 2 heavily shared CPU cores): the average return of the last 20 training episodes
(epsilon 0.02) was 181.5 and a greedy evaluation over 10 episodes averaged 173.8 (the
training average peaked at 312 around 100k steps; a random policy averages about 22). One
seed, one run: expect others to differ. ``--smoke`` is a short plumbing check (2000 steps).
"""

from __future__ import annotations

import time

import _common
import gymnasium as gym
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coax_utils.replay import PrioritizedSequenceReplayBuffer, RecordVectorSequences

NUM_ENVS, HIDDEN, GAMMA, TARGET_TAU = 8, 64, 0.99, 0.01
LENGTH, PERIOD, BURN_IN = 20, 15, 5
UPDATES_PER_STEP = 2  # learner updates per step of the vector env


class HideVelocities(gym.ObservationWrapper):
    """CartPole with only the cart position and the pole angle observed."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        low, high = env.observation_space.low[[0, 2]], env.observation_space.high[[0, 2]]
        self.observation_space = gym.spaces.Box(low, high, dtype=np.float32)

    def observation(self, obs: np.ndarray) -> np.ndarray:
        return obs[[0, 2]].astype(np.float32)


def make_env(num_envs: int) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: HideVelocities(gym.make("CartPole-v1")) for _ in range(num_envs)]
    )


def net_fn(obs: jax.Array, state: hk.LSTMState) -> tuple[jax.Array, hk.LSTMState]:
    x = jax.nn.relu(hk.Linear(HIDDEN)(obs))
    out, state = hk.LSTM(HIDDEN)(x, state)
    return hk.Linear(2)(jax.nn.relu(out)), state


net = hk.without_apply_rng(hk.transform(net_fn))
optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))


def zero_state(batch: int) -> hk.LSTMState:
    return hk.LSTMState(jnp.zeros((batch, HIDDEN)), jnp.zeros((batch, HIDDEN)))


@jax.jit
def act(params, key, obs, state, epsilon):
    """Epsilon-greedy actions of every sub-env and the next LSTM states."""
    q, state = net.apply(params, obs, state)
    k1, k2 = jax.random.split(key)
    explore = jax.random.uniform(k1, (obs.shape[0],)) < epsilon
    random = jax.random.randint(k2, (obs.shape[0],), 0, 2)
    return jnp.where(explore, random, jnp.argmax(q, axis=1)), state


@jax.jit
def restart(state, mask):
    """``state`` with the rows of ``mask`` set to the zero state."""
    return jax.tree_util.tree_map(lambda s: jnp.where(mask[:, None], 0.0, s), state)


def unroll(params, obs, state):
    """Q-values of the windows ``obs`` (time first) and the LSTM state after each step."""

    def step(state, o):
        q, state = net.apply(params, o, state)
        return state, (q, state)

    return jax.lax.scan(step, state, obs)[1]


def loss_fn(params, target_params, batch):
    steps = jax.tree_util.tree_map(lambda x: jnp.swapaxes(x, 0, 1), batch.items)  # time first
    q, states = unroll(params, steps["obs"], batch.core_state)
    # the next observation of each step, from the state after the step (the final
    # observation at an episode end, so truncated episodes bootstrap correctly)
    q_next = jax.vmap(net.apply, (None, 0, 0))(params, steps["next_obs"], states)[0]
    q_next_target = jax.vmap(net.apply, (None, 0, 0))(target_params, steps["next_obs"], states)[0]
    a_next = jnp.argmax(q_next, axis=-1)[..., None]
    bootstrap = jnp.take_along_axis(q_next_target, a_next, axis=-1)[..., 0]
    done = jnp.swapaxes(batch.terminated, 0, 1).astype(jnp.float32)
    target = steps["reward"] + GAMMA * (1.0 - done) * jax.lax.stop_gradient(bootstrap)
    q_sa = jnp.take_along_axis(q, steps["action"][..., None], axis=-1)[..., 0]
    td = target - q_sa
    mask = jnp.swapaxes(batch.loss_mask, 0, 1)
    loss = jnp.sum(mask * batch.weights * optax.huber_loss(td)) / jnp.maximum(mask.sum(), 1)
    return loss, jnp.swapaxes(td, 0, 1)


@jax.jit
def update(params, target_params, opt_state, batch):
    (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, target_params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, optax.incremental_update(params, target_params, TARGET_TAU), opt_state, loss, td


def evaluate(params, num_episodes: int, seed: int) -> float:
    """The average return of the greedy policy over ``num_episodes`` parallel episodes."""
    env = make_env(num_episodes)
    obs, _ = env.reset(seed=seed)
    state, key = zero_state(num_episodes), jax.random.PRNGKey(seed)
    returns, done = np.zeros(num_episodes), np.zeros(num_episodes, bool)
    while not done.all():
        actions, state = act(params, key, obs, state, 0.0)
        obs, r, term, trunc, _ = env.step(np.asarray(actions))
        returns += r * ~done
        done |= term | trunc
    env.close()
    return float(returns.mean())


def main() -> None:
    parser = _common.make_parser(__doc__, outdir="runs/r2d2_cartpole", num_steps=150_000)
    args = parser.parse_args()
    smoke = args.smoke
    max_steps = 2_000 if smoke else args.num_steps  # env steps, all sub-envs together
    warmup, batch_size, log_every = (400, 8, 800) if smoke else (5_000, 32, 10_000)
    decay = 0.4 * max_steps  # epsilon from 1 to 0.02 over the first 40 % of the steps

    buffer = PrioritizedSequenceReplayBuffer(
        capacity=10_000,
        length=LENGTH,
        period=PERIOD,
        burn_in=BURN_IN,
        num_envs=NUM_ENVS,
        alpha=0.6,
        beta=0.4,
        random_seed=args.seed,
    )
    env = RecordVectorSequences(make_env(NUM_ENVS), buffer)
    key, init_key = jax.random.split(jax.random.PRNGKey(args.seed))
    params = net.init(init_key, jnp.zeros((1, 2)), zero_state(1))
    target_params, opt_state = params, optimizer.init(params)

    obs, _ = env.reset(seed=args.seed)
    state = zero_state(NUM_ENVS)
    skip = np.zeros(NUM_ENVS, bool)  # sub-envs whose last step only reset them
    episode_return, returns, losses = np.zeros(NUM_ENVS), [], []
    t0 = time.perf_counter()
    step = 0
    while step < max_steps:
        key, subkey = jax.random.split(key)
        epsilon = max(0.02, 1.0 - step / decay)
        actions, next_state = act(params, subkey, obs, state, epsilon)
        obs, r, term, trunc, _ = env.step(np.asarray(actions), core_state=state)
        step += NUM_ENVS
        episode_return += r * ~skip
        ended = term | trunc
        returns += episode_return[ended].tolist()
        episode_return[ended] = 0.0
        state = restart(next_state, skip)  # a sub-env just reset starts from zeros
        skip = ended
        for _ in range(UPDATES_PER_STEP if step >= warmup and len(buffer) else 0):
            buffer.beta = min(1.0, 0.4 + 0.6 * step / max_steps)
            batch = buffer.sample(batch_size)
            params, target_params, opt_state, loss, td = update(
                params, target_params, opt_state, batch
            )
            buffer.update(batch.indices, np.asarray(td), mask=batch.loss_mask)
            losses.append(float(loss))
        if step % log_every < NUM_ENVS:
            loss = np.mean(losses[-100:]) if losses else float("nan")
            _common.print_progress(step, returns, t0, window=20, loss=loss, epsilon=epsilon)
    env.close()
    result = evaluate(params, num_episodes=10, seed=args.seed + 1000)
    recent = float(np.mean(returns[-20:])) if returns else float("nan")
    print(f"average return of the last 20 training episodes: {recent:.1f}")
    print(f"greedy evaluation over 10 episodes: average return {result:.1f}")
    if smoke:
        print(f"smoke run finished in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
