"""IQN (implicit quantile network) on CartPole-v1: a distributional Q-learning agent.

The network multiplies a state embedding element-wise with a cosine embedding of random
quantile fractions :math:`\\tau` (``utils.quantiles_uniform``, ``utils.quantile_cos_embedding``)
and predicts the return quantiles :math:`Z_\\tau(s, a)` of every action. n-step returns are
traced on the host (``replay.NStep``) into a jittable buffer (``replay.make_uniform_buffer``,
its state donated to a jitted ``add``); the quantile Huber loss against the targets
:math:`R^{(n)} + \\gamma^n Z_{\\tau'}(s_{t+n}, a^*)` is minimized in a jitted update that samples
its own batch. Actions are epsilon-greedy on Q, the average of the sampled quantiles.
Outputs in ``runs/iqn_cartpole/``: ``params.pkl.lz4`` and ``returns.csv``. ``--smoke``: a
short run that only checks the plumbing.
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

from coax_utils import utils
from coax_utils.replay import NStep, make_uniform_buffer

GAMMA = 0.99
N_STEP = 3
NUM_ACTIONS = 2
NUM_TAU = 16  # quantile fractions per state in the loss (for predictions and targets)
NUM_TAU_ACT = 32  # quantile fractions per state when acting
EMBEDDING_DIM = 64  # size of the cosine embedding of tau
BATCH_SIZE = 64
TARGET_TAU = 0.01  # soft target-network update rate
KAPPA = 1.0  # Huber threshold of the quantile loss


def quantile_network(s: jnp.ndarray, tau: jnp.ndarray) -> jnp.ndarray:
    """Quantiles ``Z_tau(s, a)``: ``s`` (batch, 4), ``tau`` (batch, k) -> (batch, k, actions)."""
    psi = jax.nn.relu(hk.Linear(64)(s))  # state embedding, (batch, 64)
    cos = utils.quantile_cos_embedding(tau, n=EMBEDDING_DIM)  # (batch, k, n)
    phi = jax.nn.relu(hk.Linear(64)(cos))  # tau embedding, (batch, k, 64)
    h = jax.nn.relu(hk.Linear(64)(psi[:, None, :] * phi))
    return hk.Linear(NUM_ACTIONS)(h)


iqn = hk.without_apply_rng(hk.transform(quantile_network))
optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))
buffer = make_uniform_buffer(capacity=50_000)


def sample_quantile_levels(key, batch_size, num_quantiles):
    """Random quantile levels (the midpoints of a random partition of [0, 1], never 1, the
    maximum, which the quantile loss only ever pushes up) and their cell widths."""
    tau = utils.quantiles_uniform(key, batch_size, num_quantiles=num_quantiles)
    tau_prev = jnp.pad(tau[:, :-1], ((0, 0), (1, 0)))
    return (tau_prev + tau) / 2, tau - tau_prev


def q_values(params, key, s):
    """Q(s, .) as the width-weighted sum of ``NUM_TAU_ACT`` random quantiles."""
    levels, widths = sample_quantile_levels(key, s.shape[0], NUM_TAU_ACT)
    return jnp.sum(widths[:, :, None] * iqn.apply(params, s, levels), axis=1)


def act(params, key, s, epsilon):
    """Epsilon-greedy action for one observation ``s``."""
    q_key, tie_key, explore_key, random_key = jax.random.split(key, 4)
    greedy = utils.argmax(tie_key, q_values(params, q_key, s[None])[0])
    random_action = jax.random.randint(random_key, (), 0, NUM_ACTIONS)
    explore = jax.random.uniform(explore_key) < epsilon
    return jnp.where(explore, random_action, greedy).astype(jnp.int32)


def quantile_huber_loss(params, target_params, batch, key):
    tau_key, tau_next_key, act_key, tie_key = jax.random.split(key, 4)
    b = batch["s"].shape[0]
    tau, _ = sample_quantile_levels(tau_key, b, NUM_TAU)
    z = iqn.apply(params, batch["s"], tau)  # (b, k, actions)
    z_sa = jnp.take_along_axis(z, batch["a"][:, None, None], axis=2)[:, :, 0]  # (b, k)

    # target: the online network picks a* (double Q-learning), the target network evaluates
    a_next = utils.argmax(tie_key, q_values(params, act_key, batch["s_next"]))
    tau_next, _ = sample_quantile_levels(tau_next_key, b, NUM_TAU)
    z_next = iqn.apply(target_params, batch["s_next"], tau_next)
    z_next = jnp.take_along_axis(z_next, a_next[:, None, None], axis=2)[:, :, 0]  # (b, k')
    # In = gamma^n while the episode goes on (truncation included), 0 after termination
    target = jax.lax.stop_gradient(batch["Rn"][:, None] + batch["In"][:, None] * z_next)

    # pairwise TD errors u_ij = target_j - z_i, weighted by |tau_i - 1{u_ij < 0}|
    u = target[:, None, :] - z_sa[:, :, None]  # (b, k, k')
    weight = jnp.abs(tau[:, :, None] - (u < 0).astype(jnp.float32))
    loss = weight * optax.huber_loss(u, delta=KAPPA) / KAPPA
    return jnp.mean(jnp.sum(jnp.mean(loss, axis=2), axis=1))


def update(params, target_params, opt_state, buffer_state, key):
    """One gradient step on a batch sampled from the replay buffer."""
    sample_key, loss_key = jax.random.split(key)
    batch = buffer.sample(buffer_state, sample_key, BATCH_SIZE)
    loss, grads = jax.value_and_grad(quantile_huber_loss)(params, target_params, batch, loss_key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    target_params = optax.incremental_update(params, target_params, TARGET_TAU)
    return params, target_params, opt_state, loss


act_jit = utils.jit(act)
add_jit = utils.jit(buffer.add, donate_argnums=(0,))
update_jit = utils.jit(update)


def main() -> int:
    parser = _common.make_parser(
        __doc__.splitlines()[0], outdir="runs/iqn_cartpole", seed=0, num_steps=30_000
    )
    args = parser.parse_args()
    t_start = time.perf_counter()
    num_steps = 300 if args.smoke else args.num_steps
    warmup, log_every = (100, 100) if args.smoke else (1_000, 2_000)
    epsilon = utils.StepwiseLinearFunction((0, 1.0), (warmup, 1.0), (10_000, 0.02))

    env = gym.make("CartPole-v1")
    s, _ = env.reset(seed=args.seed)
    key, init_key = jax.random.split(jax.random.PRNGKey(args.seed))
    tau0 = utils.quantiles_uniform(init_key, 1, num_quantiles=NUM_TAU)
    params = iqn.init(init_key, jnp.zeros((1, 4), jnp.float32), tau0)
    target_params, opt_state = params, optimizer.init(params)
    example = dict(s=s, a=np.int32(0), Rn=np.float32(0), In=np.float32(0), s_next=s)
    buffer_state = buffer.init(example)
    tracer = NStep(n=N_STEP, gamma=GAMMA)

    returns, episode_ends, ep_return, loss, t0 = [], [], 0.0, 0.0, time.perf_counter()
    for step in range(1, num_steps + 1):
        key, act_key, train_key = jax.random.split(key, 3)
        a = int(act_jit(params, act_key, s, float(epsilon(step))))
        s_next, r, terminated, truncated, _ = env.step(a)
        ep_return += float(r)
        # a time limit (truncation) ends the trace but still bootstraps
        tracer.add(s, a, float(r), terminated, truncated=truncated)
        while tracer:
            b = tracer.pop()  # a TransitionBatch of one n-step transition
            items = dict(s=b.S, a=b.A.astype(np.int32), Rn=b.Rn, In=b.In, s_next=b.S_next)
            buffer_state = add_jit(buffer_state, items)
        if step >= warmup:
            params, target_params, opt_state, loss = update_jit(
                params, target_params, opt_state, buffer_state, train_key
            )
        s = s_next
        if terminated or truncated:
            returns.append(ep_return)
            episode_ends.append(step)
            ep_return = 0.0
            s, _ = env.reset()
        if step % log_every == 0:
            _common.print_progress(step, returns, t0, loss=loss, epsilon=epsilon(step))

    num_eval = 2 if args.smoke else 10
    key, eval_key = jax.random.split(key)
    greedy = lambda s: int(act_jit(params, eval_key, s, 0.0))
    avg = _common.evaluate(gym.make("CartPole-v1"), greedy, num_eval, seed=10_000)
    args.outdir.mkdir(parents=True, exist_ok=True)
    utils.dump(params, args.outdir / "params.pkl.lz4")
    curve = _common.write_returns(args.outdir, episode_ends, returns)
    print(
        f"evaluation: average return {avg:.1f} over {num_eval} greedy episodes after "
        f"{num_steps} steps ({time.perf_counter() - t_start:.0f} s); parameters in "
        f"{args.outdir / 'params.pkl.lz4'}, learning curve in {curve}"
    )
    if args.smoke:
        print("smoke run OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
