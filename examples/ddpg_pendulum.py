"""DDPG on Pendulum-v1 with Ornstein-Uhlenbeck exploration inside a jitted act function.

A deterministic Haiku actor :math:`\\mu_\\theta(s)` and a critic :math:`Q_\\phi(s, a)` trained
with optax: the critic regresses on :math:`r + \\gamma\\,Q_{\\phi'}(s', \\mu_{\\theta'}(s'))`, the
actor ascends :math:`Q_\\phi(s, \\mu_\\theta(s))`, and both targets follow by Polyak averaging.
Exploration uses the *pure* OU process of ``coax_utils.utils``: ``ou_noise_init`` makes its
state (a pytree), ``ou_noise_step`` advances it inside the jitted ``act`` (state in, state
out, an explicit key) and ``ou_noise_reset`` restarts it every episode (host code can use
the seeded ``utils.OrnsteinUhlenbeckNoise`` object instead). One jitted step adds the
transition to a jittable buffer (``replay.make_uniform_buffer``, its state donated) and
trains on a sampled batch. Outputs in ``runs/ddpg_pendulum/``: ``params.pkl.lz4`` and
``returns.csv``. ``--smoke``: a short run that only checks the plumbing.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import _common
import gymnasium as gym
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coax_utils import utils
from coax_utils.replay import make_uniform_buffer

GAMMA = 0.99
MAX_ACTION = 2.0  # Pendulum-v1 torques lie in [-2, 2]
BATCH_SIZE = 128
TARGET_TAU = 0.005
OU_SIGMA = 0.3
OU_THETA = 0.15


def actor_network(s: jnp.ndarray) -> jnp.ndarray:
    h = hk.nets.MLP([64, 64], activate_final=True)(s)
    return MAX_ACTION * jnp.tanh(hk.Linear(1)(h))


def critic_network(s: jnp.ndarray, a: jnp.ndarray) -> jnp.ndarray:
    x = jnp.concatenate([s, a / MAX_ACTION], axis=-1)
    return hk.nets.MLP([64, 64, 1])(x)[..., 0]


actor = hk.without_apply_rng(hk.transform(actor_network))
critic = hk.without_apply_rng(hk.transform(critic_network))
actor_opt = optax.adam(1e-3)
critic_opt = optax.adam(1e-3)
buffer = make_uniform_buffer(capacity=100_000)


class DDPGState(NamedTuple):
    """The networks' parameters, their targets (Polyak averages) and optimizer states."""

    actor: hk.Params
    critic: hk.Params
    actor_target: hk.Params
    critic_target: hk.Params
    actor_opt: optax.OptState
    critic_opt: optax.OptState


def act(actor_params, key, s, noise_state, explore):
    """The policy's action for one observation, plus OU noise when ``explore`` is True."""
    a = actor.apply(actor_params, s[None])[0]
    noisy, new_noise_state = utils.ou_noise_step(key, a, noise_state)
    a = jnp.where(explore, noisy, a)
    noise_state = jax.tree_util.tree_map(
        lambda new, old: jnp.where(explore, new, old), new_noise_state, noise_state
    )
    return a, noise_state


def critic_loss(critic_params, state, batch):
    a_next = actor.apply(state.actor_target, batch["s_next"])
    q_next = critic.apply(state.critic_target, batch["s_next"], a_next)
    target = batch["r"] + GAMMA * (1.0 - batch["terminated"]) * q_next
    q = critic.apply(critic_params, batch["s"], batch["a"])
    return jnp.mean(jnp.square(q - jax.lax.stop_gradient(target)))


def actor_loss(actor_params, critic_params, batch):
    return -jnp.mean(critic.apply(critic_params, batch["s"], actor.apply(actor_params, batch["s"])))


def train_step(state, buffer_state, transition, key, learn):
    """Add ``transition`` to the replay buffer, then (if ``learn``) do one DDPG update."""
    items = jax.tree_util.tree_map(lambda x: x[None], transition)
    buffer_state = buffer.add(buffer_state, items)

    def learn_fn(state):
        batch = buffer.sample(buffer_state, key, BATCH_SIZE)
        q_loss, grads = jax.value_and_grad(critic_loss)(state.critic, state, batch)
        updates, critic_opt_state = critic_opt.update(grads, state.critic_opt)
        critic_params = optax.apply_updates(state.critic, updates)
        pi_loss, grads = jax.value_and_grad(actor_loss)(state.actor, critic_params, batch)
        updates, actor_opt_state = actor_opt.update(grads, state.actor_opt)
        actor_params = optax.apply_updates(state.actor, updates)
        actor_target = optax.incremental_update(actor_params, state.actor_target, TARGET_TAU)
        critic_target = optax.incremental_update(critic_params, state.critic_target, TARGET_TAU)
        opt_states = (actor_opt_state, critic_opt_state)
        new = DDPGState(actor_params, critic_params, actor_target, critic_target, *opt_states)
        return new, jnp.stack([q_loss, pi_loss])

    def skip(state):
        return state, jnp.zeros(2, jnp.float32)

    state, losses = jax.lax.cond(learn, learn_fn, skip, state)
    return state, buffer_state, losses


act_jit = utils.jit(act)
train_step_jit = utils.jit(train_step, donate_argnums=(1,))


def main() -> int:
    parser = _common.make_parser(
        __doc__.splitlines()[0], outdir="runs/ddpg_pendulum", seed=0, num_steps=20_000
    )
    args = parser.parse_args()
    t_start = time.perf_counter()
    num_steps = 300 if args.smoke else args.num_steps
    warmup, log_every = (150, 100) if args.smoke else (1_000, 2_000)

    env = gym.make("Pendulum-v1")
    s, _ = env.reset(seed=args.seed)
    key, actor_key, critic_key = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    s0, a0 = jnp.zeros((1, 3), jnp.float32), jnp.zeros((1, 1), jnp.float32)
    actor_params, critic_params = actor.init(actor_key, s0), critic.init(critic_key, s0, a0)
    opt_states = (actor_opt.init(actor_params), critic_opt.init(critic_params))
    state = DDPGState(actor_params, critic_params, actor_params, critic_params, *opt_states)
    a_example, r_example = np.zeros(1, np.float32), np.float32(0)
    example = {"s": s, "a": a_example, "r": r_example, "terminated": r_example, "s_next": s}
    buffer_state = buffer.init(example)
    # The pure OU process: a pytree state, advanced inside the jitted act function.
    noise_state = utils.ou_noise_init(
        a0[0], sigma=OU_SIGMA, theta=OU_THETA, min_value=-MAX_ACTION, max_value=MAX_ACTION
    )

    returns, episode_ends, ep_return, losses = [], [], 0.0, np.zeros(2)
    t0 = time.perf_counter()
    for step in range(1, num_steps + 1):
        key, act_key, train_key = jax.random.split(key, 3)
        a, noise_state = act_jit(state.actor, act_key, s, noise_state, True)
        a = np.asarray(a)
        s_next, r, terminated, truncated, _ = env.step(a)
        ep_return += float(r)
        # a time limit (truncation) is not a terminal state: the target still bootstraps
        transition = dict(
            s=s, a=a, r=np.float32(r), terminated=np.float32(terminated), s_next=s_next
        )
        state, buffer_state, losses = train_step_jit(
            state, buffer_state, transition, train_key, step >= warmup
        )
        s = s_next
        if terminated or truncated:
            returns.append(ep_return)
            episode_ends.append(step)
            ep_return = 0.0
            s, _ = env.reset()
            noise_state = utils.ou_noise_reset(noise_state)
        if step % log_every == 0:
            q_loss, pi_loss = np.asarray(losses)
            _common.print_progress(
                step, returns, t0, window=5, critic_loss=q_loss, actor_loss=pi_loss
            )

    num_eval = 1 if args.smoke else 10
    greedy = lambda s: np.asarray(act_jit(state.actor, key, s, noise_state, False)[0])
    avg = _common.evaluate(gym.make("Pendulum-v1"), greedy, num_eval, seed=10_000)
    args.outdir.mkdir(parents=True, exist_ok=True)
    utils.dump({"actor": state.actor, "critic": state.critic}, args.outdir / "params.pkl.lz4")
    curve = _common.write_returns(args.outdir, episode_ends, returns)
    print(
        f"evaluation: average return {avg:.1f} over {num_eval} noiseless episodes after "
        f"{num_steps} steps ({time.perf_counter() - t_start:.0f} s); parameters in "
        f"{args.outdir / 'params.pkl.lz4'}, learning curve in {curve}"
    )
    if args.smoke:
        print("smoke run OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
