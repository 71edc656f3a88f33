"""End-to-end jitted DQN: collection and training of a whole chunk of steps in one XLA call.

What it shows:

1. a gymnax-style environment rolled out by ``sources.GymnaxSource``: by default a small
   CartPole written in pure JAX in this file (``reset(key, params)`` and the 6-tuple
   ``step(key, state, action, params) -> (obs, state, reward, terminated, truncated,
   info)``, with the dynamics of gymnasium's CartPole-v1), or, with ``--env gymnasium``, the
   real gymnasium CartPole-v1 behind ``envs.GymnasiumToJax`` (host callbacks from inside
   the compiled loop; much slower per step, the same code otherwise);
2. a jittable prioritized replay buffer (``replay.make_prioritized_buffer``): its state is
   part of the loop carry, the TD errors go back as priorities, and the importance-weight
   exponent :math:`\\beta` is annealed by a traced ``utils.StepwiseLinearFunction``; the
   buffer stores one-step transitions with their episode boundaries, and the update builds
   3-step returns from the slots that follow each sampled one;
3. the whole loop (act epsilon-greedily with ``utils.argmax``, step, add to replay, sample,
   double-DQN update, Polyak-averaged target network) inside ``jax.lax.scan`` under one
   ``utils.jit`` with the carry, replay buffer state included, donated, so the buffer is
   updated in place instead of being copied every chunk.

The host only prints progress between chunks. At the end the greedy policy is evaluated on
gymnasium's CartPole-v1 (10 episodes) and the final training state (network parameters,
optimizer state, replay buffer, counters) is checkpointed with ``utils.dump`` to
``runs/jitted_dqn/state.pkl.lz4``. Run it with ``python examples/jitted_dqn.py``
(``--smoke`` for a short run that only checks the plumbing).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NamedTuple

import gymnasium as gym
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coax_utils import utils
from coax_utils.replay import make_prioritized_buffer
from coax_utils.sources import GymnaxSource

GAMMA = 0.99
N_STEP = 3
BATCH_SIZE = 64
TARGET_TAU = 0.01


# -- a pure-JAX CartPole (gymnax API, 6-tuple step) -------------------------------------------


class CartPoleParams(NamedTuple):
    gravity: float = 9.8
    masscart: float = 1.0
    masspole: float = 0.1
    length: float = 0.5  # half the pole's length
    force_mag: float = 10.0
    tau: float = 0.02  # seconds between state updates
    x_threshold: float = 2.4
    theta_threshold: float = 12 * 2 * np.pi / 360
    max_steps: int = 500


class CartPoleState(NamedTuple):
    physics: jax.Array  # (x, x_dot, theta, theta_dot)
    t: jax.Array  # steps taken in this episode


class CartPole:
    """CartPole-v1 in JAX: same dynamics, rewards, termination and time limit as gymnasium's.

    ``step`` does not reset at the end of an episode; ``GymnaxSource`` calls ``reset``.
    """

    default_params = CartPoleParams()

    def reset(self, key, params):
        physics = jax.random.uniform(key, (4,), jnp.float32, -0.05, 0.05)
        return physics, CartPoleState(physics, jnp.zeros([], jnp.int32))

    def step(self, key, state, action, params):
        x, x_dot, theta, theta_dot = state.physics
        force = jnp.where(action == 1, params.force_mag, -params.force_mag)
        cos, sin = jnp.cos(theta), jnp.sin(theta)
        total_mass = params.masscart + params.masspole
        polemass_length = params.masspole * params.length
        temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
        theta_acc = (params.gravity * sin - cos * temp) / (
            params.length * (4.0 / 3.0 - params.masspole * cos**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        # explicit Euler, as in gymnasium
        physics = jnp.stack(
            [
                x + params.tau * x_dot,
                x_dot + params.tau * x_acc,
                theta + params.tau * theta_dot,
                theta_dot + params.tau * theta_acc,
            ]
        ).astype(jnp.float32)
        t = state.t + 1
        terminated = (jnp.abs(physics[0]) > params.x_threshold) | (
            jnp.abs(physics[2]) > params.theta_threshold
        )
        truncated = t >= params.max_steps
        reward = jnp.float32(1.0)
        return physics, CartPoleState(physics, t), reward, terminated, truncated, {}


# -- the agent ---------------------------------------------------------------------------------


def q_network(s: jnp.ndarray) -> jnp.ndarray:
    return hk.nets.MLP([64, 64, 2])(s)


q_net = hk.without_apply_rng(hk.transform(q_network))
optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))
buffer = make_prioritized_buffer(capacity=50_000, alpha=0.6, beta=0.4)


class Learner(NamedTuple):
    params: hk.Params
    target_params: hk.Params
    opt_state: optax.OptState


def policy_step(obs, policy_state, new_episode, key):
    """Epsilon-greedy: ``policy_state`` is ``(params, epsilon)``; the policy has no memory."""
    params, epsilon = policy_state
    tie_key, explore_key, random_key = jax.random.split(key, 3)
    greedy = utils.argmax(tie_key, q_net.apply(params, obs))
    random_action = jax.random.randint(random_key, (), 0, 2)
    explore = jax.random.uniform(explore_key) < epsilon
    return jnp.where(explore, random_action, greedy).astype(jnp.int32), policy_state


def n_step_batch(buffer_state, indices):
    """n-step transitions starting at the sampled slots ``indices``.

    The buffer holds one-step transitions in insertion order, added with
    ``episode_end=done``, so its state knows the episode of every slot. The next ``N_STEP``
    slots after each sampled one are used as long as they belong to the same episode and
    were already written; the return is bootstrapped from the last of them:
    :math:`R = \\sum_k \\gamma^k r_{t+k}` and discount :math:`\\gamma^{k+1}` (0 when that last
    step terminated the episode).
    """
    capacity = buffer_state.episode.shape[0]
    offsets = jnp.arange(N_STEP, dtype=jnp.int32)
    slots = (indices[:, None] + offsets) % capacity  # (batch, n)
    written_after = (buffer_state.pos - 1 - indices) % capacity  # items added after each slot
    same_episode = buffer_state.episode[slots] == buffer_state.episode[indices][:, None]
    valid = (offsets <= written_after[:, None]) & same_episode
    steps = jax.tree_util.tree_map(lambda x: x[slots], buffer_state.items)
    rn = jnp.sum(jnp.where(valid, GAMMA**offsets * steps["r"], 0.0), axis=1)
    last = jnp.sum(valid, axis=1) - 1  # the sampled step itself is always valid
    s_next = jnp.take_along_axis(steps["s_next"], last[:, None, None], axis=1)[:, 0]
    terminated = jnp.take_along_axis(steps["terminated"], last[:, None], axis=1)[:, 0]
    discount = jnp.where(terminated, 0.0, GAMMA ** (last + 1).astype(jnp.float32))
    first = jax.tree_util.tree_map(lambda x: x[:, 0], steps)
    return {"s": first["s"], "a": first["a"], "rn": rn, "discount": discount, "s_next": s_next}


def loss_fn(params, target_params, batch, weights):
    q = q_net.apply(params, batch["s"])
    q_sa = jnp.take_along_axis(q, batch["a"][:, None], axis=1)[:, 0]
    # double DQN: the online network picks, the target network evaluates
    a_next = jnp.argmax(q_net.apply(params, batch["s_next"]), axis=1)
    q_next = jnp.take_along_axis(q_net.apply(target_params, batch["s_next"]), a_next[:, None], 1)
    target = batch["rn"] + batch["discount"] * jax.lax.stop_gradient(q_next[:, 0])
    td_error = target - q_sa
    return jnp.mean(weights * optax.huber_loss(td_error)), td_error


def make_train_chunk(source: GymnaxSource, chunk_size: int, warmup: int, total_steps: int):
    """A jitted ``(carry, key) -> (carry, stats)`` running ``chunk_size`` steps of collection
    and training in one ``jax.lax.scan``; the carry (replay buffer included) is donated."""
    epsilon = utils.StepwiseLinearFunction((0, 1.0), (warmup, 1.0), (10_000, 0.02))
    beta = utils.StepwiseLinearFunction((0, 0.4), (total_steps, 1.0))

    def learn(learner: Learner, buffer_state, key, step):
        sample = buffer.sample(buffer_state, key, BATCH_SIZE, beta=beta(step))
        batch = n_step_batch(buffer_state, sample.indices)
        (loss, td_error), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            learner.params, learner.target_params, batch, sample.weights
        )
        updates, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
        params = optax.apply_updates(learner.params, updates)
        target_params = optax.incremental_update(params, learner.target_params, TARGET_TAU)
        buffer_state = buffer.update(buffer_state, sample.indices, td_error, sample.versions)
        return Learner(params, target_params, opt_state), buffer_state, loss

    def skip(learner, buffer_state, key, step):
        return learner, buffer_state, jnp.zeros([], jnp.float32)

    def body(carry, key):
        source_state, buffer_state, learner, step, ep_return = carry
        eps = jnp.asarray(epsilon(step), jnp.float32)
        source_state = source_state.replace(policy_state=(learner.params, eps))
        item, _, source_state = source.next(source_state)
        # next_state is the true last observation at an episode end (the source steps
        # without autoreset and resets the env itself)
        s_next = item["next_state"]
        transition = {
            "s": item["state"],
            "a": item["action"],
            "r": item["reward"],
            "terminated": item["terminated"],  # a time limit (truncation) still bootstraps
            "s_next": s_next,
        }
        # one-step transitions; episode_end lets n_step_batch find the episode boundaries
        items = jax.tree_util.tree_map(lambda x: x[None], transition)
        buffer_state = buffer.add(buffer_state, items, episode_end=item["done"][None])
        step = step + 1
        ready = (step >= warmup) & buffer.can_sample(buffer_state, BATCH_SIZE)
        learner, buffer_state, loss = jax.lax.cond(
            ready, learn, skip, learner, buffer_state, key, step
        )
        ep_return = ep_return + item["reward"]
        stats = (item["done"], ep_return, loss)
        ep_return = jnp.where(item["done"], 0.0, ep_return)
        return (source_state, buffer_state, learner, step, ep_return), stats

    def train_chunk(carry, key):
        return jax.lax.scan(body, carry, jax.random.split(key, chunk_size))

    return utils.jit(train_chunk, donate_argnums=(0,))


def make_evaluate_jax(num_episodes: int):
    """A jitted ``(params, key) -> average return`` of the greedy policy over
    ``num_episodes`` episodes of the pure-JAX CartPole, all run at once (vmap + scan)."""
    env, env_params = CartPole(), CartPole.default_params

    def episode(params, key):
        obs, env_state = env.reset(key, env_params)

        def body(carry, _):
            obs, env_state, alive, total = carry
            action = jnp.argmax(q_net.apply(params, obs))
            obs, env_state, reward, terminated, truncated, _ = env.step(
                key, env_state, action, env_params
            )
            total = total + jnp.where(alive, reward, 0.0)
            alive = alive & ~(terminated | truncated)
            return (obs, env_state, alive, total), None

        carry = (obs, env_state, jnp.ones([], bool), jnp.zeros([], jnp.float32))
        (_, _, _, total), _ = jax.lax.scan(body, carry, None, length=env_params.max_steps)
        return total

    def evaluate(params, key):
        keys = jax.random.split(key, num_episodes)
        return jnp.mean(jax.vmap(episode, in_axes=(None, 0))(params, keys))

    return utils.jit(evaluate)


def evaluate(params, num_episodes: int, seed: int) -> float:
    """Average return of the greedy policy on gymnasium's CartPole-v1."""
    greedy = utils.jit(lambda params, key, s: utils.argmax(key, q_net.apply(params, s)))
    env = gym.make("CartPole-v1")
    key = jax.random.PRNGKey(seed)
    returns = []
    for i in range(num_episodes):
        s, _ = env.reset(seed=seed + i)
        done, total = False, 0.0
        while not done:
            key, subkey = jax.random.split(key)
            s, r, terminated, truncated, _ = env.step(int(greedy(params, subkey, s)))
            total += float(r)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run checking the plumbing")
    parser.add_argument(
        "--env",
        choices=("jax", "gymnasium"),
        default="jax",
        help="the CartPole in pure JAX (default) or gymnasium's through envs.GymnasiumToJax",
    )
    parser.add_argument("--outdir", default="runs/jitted_dqn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-steps", type=int, default=40_000)
    parser.add_argument("--chunk-size", type=int, default=1_000)
    parser.add_argument("--eval-every", type=int, default=5, help="chunks between evaluations")
    parser.add_argument("--target-return", type=float, default=475.0)
    args = parser.parse_args()

    t_start = time.perf_counter()
    chunk_size = 100 if args.smoke else args.chunk_size
    num_chunks = 3 if args.smoke else max(1, args.num_steps // chunk_size)
    total_steps = num_chunks * chunk_size
    warmup = 100 if args.smoke else 1_000

    if args.env == "jax":
        env, env_params = CartPole(), CartPole.default_params
    else:
        from coax_utils.envs import GymnasiumToJax

        env = GymnasiumToJax(gym.make("CartPole-v1"), seed=args.seed)
        env_params = env.default_params

    key = jax.random.PRNGKey(args.seed)
    key, init_key, source_key = jax.random.split(key, 3)
    params = q_net.init(init_key, jnp.zeros(4, jnp.float32))
    policy_state = (params, jnp.float32(1.0))
    source = GymnaxSource(env, env_params, policy_step, policy_state, steps_per_epoch=2**30)
    spec = source.element_spec()
    example = {
        "s": jnp.zeros(spec["state"].shape, spec["state"].dtype),
        "a": jnp.zeros(spec["action"].shape, spec["action"].dtype),
        "r": jnp.zeros(spec["reward"].shape, spec["reward"].dtype),
        "terminated": jnp.zeros(spec["terminated"].shape, spec["terminated"].dtype),
        "s_next": jnp.zeros(spec["next_state"].shape, spec["next_state"].dtype),
    }
    carry = (
        source.init_state(source_key).replace(policy_state=policy_state),
        buffer.init(example),
        Learner(params, params, optimizer.init(params)),
        jnp.zeros([], jnp.int32),
        jnp.zeros([], jnp.float32),
    )
    # Donation needs a distinct buffer for every leaf of the carry, but here some leaves share
    # one (the parameters appear three times, the CartPole's observation is its state).
    carry = jax.tree_util.tree_map(jnp.copy, carry)
    train_chunk = make_train_chunk(source, chunk_size, warmup, total_steps)

    print(
        f"== training {total_steps} steps on the {args.env} CartPole, "
        f"{num_chunks} jitted chunks of {chunk_size} steps"
    )
    returns: list[float] = []
    t0 = time.perf_counter()
    log_every = 1 if args.smoke else 5
    eval_every = 1 if args.smoke else args.eval_every
    evaluate_jax = make_evaluate_jax(num_episodes=10)
    best_avg, best_params = -np.inf, None
    for chunk in range(1, num_chunks + 1):
        key, chunk_key = jax.random.split(key)
        carry, (done, ep_return, loss) = train_chunk(carry, chunk_key)
        done = np.asarray(done)
        returns.extend(np.asarray(ep_return)[done].tolist())
        if chunk % log_every == 0 or chunk == num_chunks:
            recent = returns[-10:]
            steps = int(carry[3])
            print(
                f"step {steps:6d}  episodes {len(returns):4d}  "
                f"avg return (last 10) {np.mean(recent) if recent else 0.0:6.1f}  "
                f"loss {float(np.asarray(loss)[-1]):7.4f}  "
                f"{steps / (time.perf_counter() - t0):6.0f} steps/s",
                flush=True,
            )
        if chunk % eval_every == 0 or chunk == num_chunks:
            # DQN's greedy policy on CartPole can get worse again late in training: keep the
            # best one seen. The next chunk donates (and so deletes) the carry's arrays, so
            # keep a copy.
            key, eval_key = jax.random.split(key)
            avg = float(evaluate_jax(carry[2].params, eval_key))
            if avg > best_avg:
                best_avg = avg
                best_params = jax.tree_util.tree_map(jnp.copy, carry[2].params)
            print(f"   greedy evaluation (10 episodes of the JAX CartPole): {avg:.1f}")
            if avg >= args.target_return:
                break

    num_eval = 2 if args.smoke else 10
    avg = evaluate(best_params, num_episodes=num_eval, seed=10_000)
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    _, buffer_state, learner, step, _ = carry
    checkpoint = outdir / "state.pkl.lz4"
    utils.dump(
        {"learner": learner, "best_params": best_params, "buffer": buffer_state, "step": step},
        checkpoint,
    )
    elapsed = time.perf_counter() - t_start
    print(
        f"evaluation: average return {avg:.1f} over {num_eval} greedy episodes of gymnasium's "
        f"CartPole-v1 with the best parameters, after {int(step)} steps ({elapsed:.0f} s); "
        f"checkpoint in {checkpoint}"
    )
    if args.smoke:
        print("smoke run OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
