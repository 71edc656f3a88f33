"""End-to-end jitted DQN: collection and training of a whole chunk of steps in one XLA call.

It rolls out gymnax's CartPole-v1 (pure JAX) with ``sources.GymnaxSource`` (``--env
gymnasium``: gymnasium's CartPole-v1 behind ``envs.GymnasiumToJax`` instead, stepped by host
callbacks from inside the compiled loop, much slower, the same code otherwise). The replay
buffer is jittable and prioritized (``replay.make_prioritized_buffer``): it stores one-step
transitions with their episode boundaries, the update builds 3-step returns from the slots
that follow each sampled one, TD errors go back as priorities and the importance-weight
exponent is annealed by a traced ``utils.StepwiseLinearFunction``. The whole loop (act
epsilon-greedily, step, add, sample, double-DQN update, Polyak-averaged target) runs inside
``jax.lax.scan`` under one ``utils.jit``, the training state (a NamedTuple) donated, so the
buffer is updated in place. The host prints progress between chunks and evaluates the greedy
policy on gymnax's CartPole (10 episodes at once, vmapped); the best parameters are evaluated
on gymnasium's CartPole-v1 at the end. Outputs in ``runs/jitted_dqn/``: ``state.pkl.lz4``
(``utils.dump``) and ``returns.csv``. ``--smoke``: a short run checking the plumbing.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import _common
import gymnasium as gym
import gymnax
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coax_utils import utils
from coax_utils.envs import GymnasiumToJax
from coax_utils.replay import make_prioritized_buffer
from coax_utils.sources import GymnaxSource, GymnaxSourceState

GAMMA, N_STEP, BATCH_SIZE, TARGET_TAU = 0.99, 3, 64, 0.01

q_net = hk.without_apply_rng(hk.transform(lambda s: hk.nets.MLP([64, 64, 2])(s)))
optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))
buffer = make_prioritized_buffer(capacity=50_000, alpha=0.6, beta=0.4)
cartpole, cartpole_params = gymnax.make("CartPole-v1")  # pure JAX
# the replay buffer's fields and the source's items they come from
FIELDS = dict(s="state", a="action", r="reward", terminated="terminated", s_next="next_state")


class TrainState(NamedTuple):
    """Everything the jitted loop carries from one step to the next."""

    source: GymnaxSourceState  # the env, its observation and the policy's (params, epsilon)
    buffer: object  # the replay buffer's state
    params: hk.Params
    target_params: hk.Params
    opt_state: optax.OptState
    step: jax.Array  # env steps taken
    ep_return: jax.Array  # return of the episode under way


def policy_step(obs, policy_state, new_episode, key):
    """Epsilon-greedy: ``policy_state`` is ``(params, epsilon)``; the policy has no memory."""
    params, epsilon = policy_state
    tie_key, explore_key, random_key = jax.random.split(key, 3)
    greedy = utils.argmax(tie_key, q_net.apply(params, obs))
    explore = jax.random.uniform(explore_key) < epsilon
    return jnp.where(explore, jax.random.randint(random_key, (), 0, 2), greedy), policy_state


def n_step_batch(buffer_state, indices):
    """n-step transitions starting at the sampled slots ``indices``: the next ``N_STEP``
    slots are used while they hold the same episode and were already written; the return
    :math:`\\sum_k \\gamma^k r_{t+k}` bootstraps with discount :math:`\\gamma^{k+1}` from the
    last of them (0 when that step terminated the episode)."""
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
    s, a = steps["s"][:, 0], steps["a"][:, 0]
    return {"s": s, "a": a, "rn": rn, "discount": discount, "s_next": s_next}


def loss_fn(params, target_params, batch, weights):
    q_sa = jnp.take_along_axis(q_net.apply(params, batch["s"]), batch["a"][:, None], 1)[:, 0]
    # double DQN: the online network picks, the target network evaluates
    a_next = jnp.argmax(q_net.apply(params, batch["s_next"]), axis=1)
    q_next = jnp.take_along_axis(q_net.apply(target_params, batch["s_next"]), a_next[:, None], 1)
    td_error = batch["rn"] + batch["discount"] * jax.lax.stop_gradient(q_next[:, 0]) - q_sa
    return jnp.mean(weights * optax.huber_loss(td_error)), td_error


def make_train_chunk(source: GymnaxSource, chunk_size: int, warmup: int, total_steps: int):
    """A jitted ``(TrainState, key) -> (TrainState, stats)`` running ``chunk_size`` steps of
    collection and training in one ``jax.lax.scan``; the state is donated."""
    epsilon = utils.StepwiseLinearFunction((0, 1.0), (warmup, 1.0), (10_000, 0.02))
    beta = utils.StepwiseLinearFunction((0, 0.4), (total_steps, 1.0))

    def learn(ts: TrainState, key) -> tuple[TrainState, jax.Array]:
        sample = buffer.sample(ts.buffer, key, BATCH_SIZE, beta=beta(ts.step))
        batch = n_step_batch(ts.buffer, sample.indices)
        grads, td_error = jax.grad(loss_fn, has_aux=True)(
            ts.params, ts.target_params, batch, sample.weights
        )
        updates, opt_state = optimizer.update(grads, ts.opt_state, ts.params)
        params = optax.apply_updates(ts.params, updates)
        target_params = optax.incremental_update(params, ts.target_params, TARGET_TAU)
        buffer_state = buffer.update(ts.buffer, sample.indices, td_error, sample.versions)
        return ts._replace(
            buffer=buffer_state, params=params, target_params=target_params, opt_state=opt_state
        )

    def body(ts: TrainState, key):
        policy_state = (ts.params, jnp.asarray(epsilon(ts.step), jnp.float32))
        item, _, source_state = source.next(ts.source.replace(policy_state=policy_state))
        # one-step transitions (a time limit still bootstraps: "terminated", not "done");
        # episode_end tells n_step_batch where episodes end
        items = {k: item[v][None] for k, v in FIELDS.items()}
        buffer_state = buffer.add(ts.buffer, items, episode_end=item["done"][None])
        ep_return = ts.ep_return + item["reward"]
        ts = ts._replace(
            source=source_state,
            buffer=buffer_state,
            step=ts.step + 1,
            ep_return=jnp.where(item["done"], 0.0, ep_return),
        )
        ready = (ts.step >= warmup) & buffer.can_sample(ts.buffer, BATCH_SIZE)
        ts = jax.lax.cond(ready, learn, lambda ts, key: ts, ts, key)
        return ts, (item["done"], ep_return)

    def train_chunk(ts: TrainState, key):
        return jax.lax.scan(body, ts, jax.random.split(key, chunk_size))

    return utils.jit(train_chunk, donate_argnums=(0,))


@utils.jit
def greedy_action(params, s):
    return jnp.argmax(q_net.apply(params, s))


@utils.jit
def evaluate_gymnax(params, key):
    """The greedy policy's average return over 10 episodes of gymnax's CartPole, at once."""
    return _common.evaluate_gymnax(
        cartpole, cartpole_params, lambda obs: greedy_action(params, obs), key
    )


def main() -> int:
    parser = _common.make_parser(
        __doc__.splitlines()[0], outdir="runs/jitted_dqn", num_steps=40_000
    )
    parser.add_argument(
        "--env",
        choices=("jax", "gymnasium"),
        default="jax",
        help="gymnax's or gymnasium's CartPole",
    )
    parser.add_argument("--chunk-size", type=int, default=1_000)
    parser.add_argument("--target-return", type=float, default=475.0)
    args = parser.parse_args()
    t_start = time.perf_counter()
    chunk_size = 100 if args.smoke else args.chunk_size
    num_chunks = 3 if args.smoke else max(1, args.num_steps // chunk_size)
    warmup, eval_every = (100, 1) if args.smoke else (1_000, 5)

    env, env_params = cartpole, cartpole_params
    if args.env == "gymnasium":
        env = GymnasiumToJax(gym.make("CartPole-v1"), seed=args.seed)
        env_params = env.default_params
    key, init_key, source_key = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    params = q_net.init(init_key, jnp.zeros(4, jnp.float32))
    source = GymnaxSource(
        env, env_params, policy_step, (params, jnp.float32(1.0)), steps_per_epoch=2**30
    )
    spec = source.element_spec()
    example = {k: jnp.zeros(spec[v].shape, spec[v].dtype) for k, v in FIELDS.items()}
    source_state = source.init_state(source_key).replace(policy_state=(params, jnp.float32(1)))
    zero = jnp.zeros([], jnp.int32)
    opt_state = optimizer.init(params)
    ts = TrainState(source_state, buffer.init(example), params, params, opt_state, zero, zero * 0.0)
    # Donation needs a distinct buffer for every leaf (the parameters appear three times).
    ts = jax.tree_util.tree_map(jnp.copy, ts)
    train_chunk = make_train_chunk(source, chunk_size, warmup, num_chunks * chunk_size)

    print(
        f"== training {num_chunks * chunk_size} steps on the {args.env} CartPole, "
        f"{num_chunks} jitted chunks of {chunk_size} steps"
    )
    returns, episode_ends, t0 = [], [], time.perf_counter()
    best_avg, best_params = -np.inf, None
    for chunk in range(1, num_chunks + 1):
        key, chunk_key, eval_key = jax.random.split(key, 3)
        step0 = int(ts.step)
        ts, (done, ep_return) = train_chunk(ts, chunk_key)
        done = np.asarray(done)
        returns.extend(np.asarray(ep_return)[done].tolist())
        episode_ends.extend((step0 + 1 + np.flatnonzero(done)).tolist())
        if chunk % eval_every == 0 or chunk == num_chunks:
            _common.print_progress(int(ts.step), returns, t0)
            # DQN's greedy policy on CartPole can get worse again: keep the best one seen
            # (a copy: the next chunk donates, and so deletes, the state's arrays)
            avg = float(evaluate_gymnax(ts.params, eval_key))
            if avg > best_avg:
                best_avg, best_params = avg, jax.tree_util.tree_map(jnp.copy, ts.params)
            print(f"   greedy evaluation (10 episodes of gymnax's CartPole): {avg:.1f}")
            if avg >= args.target_return:
                break

    num_eval = 2 if args.smoke else 10
    greedy = lambda s: int(greedy_action(best_params, s))
    avg = _common.evaluate(gym.make("CartPole-v1"), greedy, num_eval, seed=10_000)
    state = {"params": ts.params, "best_params": best_params, "buffer": ts.buffer, "step": ts.step}
    utils.dump(state, args.outdir / "state.pkl.lz4")
    curve = _common.write_returns(args.outdir, episode_ends, returns)
    print(
        f"evaluation: average return {avg:.1f} over {num_eval} greedy episodes of "
        f"gymnasium's CartPole-v1 with the best parameters, after {int(ts.step)} steps "
        f"({time.perf_counter() - t_start:.0f} s); state in {args.outdir / 'state.pkl.lz4'}, "
        f"learning curve in {curve}"
    )
    if args.smoke:
        print("smoke run OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
