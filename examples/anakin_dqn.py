"""Anakin-style DQN: envs, acting, replay and learning on every device of a mesh at once.

The Anakin pattern of the Podracer architectures: each device of a ``jax.sharding.Mesh``
(axis ``"data"``) steps its own vmapped batch of gymnax CartPole-v1 envs, writes their
transitions into its shard of one prioritized replay buffer
(``replay.shard_buffer(replay.make_prioritized_buffer(...), mesh, "data")``), samples its
share of a batch drawn exactly by priority over the whole buffer, computes gradients on it,
and averages them over the mesh with ``jax.lax.pmean``; the parameters (replicated) then
stay equal on every device. Each chunk of steps is one ``jax.lax.scan`` inside one
``shard_map`` under one ``jax.jit``, the training state donated.

What lives where, and what crosses devices (``n`` devices, ``E`` envs per device):

- on every device: the parameters, target parameters and optimizer state (replicated); its
  ``E`` env states; its shard of the buffer (``capacity / n`` rows, with its sum tree);
- per step, across devices: the ``n`` shard totals (one all-gather), the sampled rows that
  another shard owns (an all-gather of the rows served), the minimum sampled priority (for
  the weights), the sampled indices and new priorities (an all-gather, so each shard
  updates its own), the largest priority, the gradients (``pmean``) and the episode
  statistics (``psum``). Transitions are written where they are made: nothing crosses.
  With ``scope="shard"`` given to ``shard_sample`` and ``shard_update``, each device would
  sample its own shard by its own priorities instead (as flashbax under ``pmap``), and
  only the gradients and the statistics would cross.

On a CPU, run it on 8 host devices with
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/anakin_dqn.py``.
Outputs in ``runs/anakin_dqn/``: ``buffer.ckpt`` (the sharded buffer state, written with
``utils.dump`` and put back onto the mesh with ``put``) and ``returns.csv``. ``--smoke``: a
short run checking the plumbing.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import _common
import gymnax
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from coax_utils import utils
from coax_utils.envs import step_without_autoreset
from coax_utils.replay import make_prioritized_buffer, shard_buffer


def shard_map(f, mesh, in_specs, out_specs):
    """``jax.shard_map`` (jax >= 0.6), else ``jax.experimental.shard_map`` (older jax)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental

    return experimental(f, mesh, in_specs, out_specs, check_rep=False)


GAMMA, TARGET_TAU = 0.99, 0.01
AXIS = "data"

q_net = hk.without_apply_rng(hk.transform(lambda s: hk.nets.MLP([64, 64, 2])(s)))
optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))
cartpole, cartpole_params = gymnax.make("CartPole-v1")


class TrainState(NamedTuple):
    """The state one chunk carries to the next (sharded leaves: ``buffer``, ``env``, ``obs``,
    ``ep_return``; the rest replicated)."""

    buffer: object
    env: object  # the envs' states, (n * E, ...)
    obs: jax.Array  # (n * E, 4)
    ep_return: jax.Array  # (n * E,)
    params: hk.Params
    target_params: hk.Params
    opt_state: optax.OptState
    step: jax.Array  # steps taken by each env


def loss_fn(params, target_params, batch, weights):
    q_sa = jnp.take_along_axis(q_net.apply(params, batch["s"]), batch["a"][:, None], 1)[:, 0]
    a_next = jnp.argmax(q_net.apply(params, batch["s_next"]), axis=1)  # double DQN
    q_next = jnp.take_along_axis(q_net.apply(target_params, batch["s_next"]), a_next[:, None], 1)
    target = batch["r"] + GAMMA * (1.0 - batch["terminated"]) * q_next[:, 0]
    td_error = jax.lax.stop_gradient(target) - q_sa
    return jnp.mean(weights * optax.huber_loss(td_error)), td_error


def make_train_chunk(buffer, mesh, chunk_size, warmup, batch_per_device, epsilon):
    """A jitted ``(TrainState, key) -> (TrainState, (returns, episodes))`` running
    ``chunk_size`` steps of every env on every device, and as many learning steps."""

    def learn(ts: TrainState, key):
        sample = buffer.shard_sample(ts.buffer, key, batch_per_device)  # exact over the mesh
        grads, td_error = jax.grad(loss_fn, has_aux=True)(
            ts.params, ts.target_params, sample.items, sample.weights
        )
        grads = jax.lax.pmean(grads, AXIS)  # the same update on every device
        updates, opt_state = optimizer.update(grads, ts.opt_state, ts.params)
        params = optax.apply_updates(ts.params, updates)
        target_params = optax.incremental_update(params, ts.target_params, TARGET_TAU)
        block = buffer.shard_update(ts.buffer, sample.indices, td_error, sample.versions)
        return ts._replace(
            buffer=block, params=params, target_params=target_params, opt_state=opt_state
        )

    def body(carry, key):
        ts, done_returns, episodes = carry
        # the same key on every device for the replay sample, one per device for the envs
        sample_key, key = jax.random.split(key)
        key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
        act_key, explore_key, step_key, reset_key = jax.random.split(key, 4)
        n_envs = ts.obs.shape[0]
        q = q_net.apply(ts.params, ts.obs)
        greedy = jnp.argmax(q, axis=1)
        explore = jax.random.uniform(explore_key, (n_envs,)) < epsilon(ts.step)
        action = jnp.where(explore, jax.random.randint(act_key, (n_envs,), 0, 2), greedy)
        step = functools.partial(step_without_autoreset, cartpole, params=cartpole_params)
        obs, env, reward, terminated, truncated, _ = jax.vmap(lambda k, s, a: step(k, s, a))(
            jax.random.split(step_key, n_envs), ts.env, action
        )
        items = {
            "s": ts.obs,
            "a": action.astype(jnp.int32),
            "r": reward.astype(jnp.float32),
            "terminated": terminated.astype(jnp.float32),
            "s_next": obs,
        }
        block = buffer.shard_add(ts.buffer, items)  # this device's envs, this device's shard
        done = terminated | truncated
        reset_obs, reset_env = jax.vmap(cartpole.reset, in_axes=(0, None))(
            jax.random.split(reset_key, n_envs), cartpole_params
        )
        env = jax.tree_util.tree_map(
            lambda r, x: jnp.where(done.reshape(done.shape + (1,) * (x.ndim - 1)), r, x),
            reset_env,
            env,
        )
        ep_return = ts.ep_return + reward
        ts = ts._replace(
            buffer=block,
            env=env,
            obs=jnp.where(done[:, None], reset_obs, obs),
            ep_return=jnp.where(done, 0.0, ep_return),
            step=ts.step + 1,
        )
        ts = jax.lax.cond(ts.step > warmup, learn, lambda ts, key: ts, ts, sample_key)
        done_returns = done_returns + jax.lax.psum(jnp.sum(jnp.where(done, ep_return, 0)), AXIS)
        episodes = episodes + jax.lax.psum(jnp.sum(done), AXIS)
        return (ts, done_returns, episodes), None

    def chunk(ts: TrainState, key):
        zero = jnp.zeros([], jnp.float32)
        (ts, returns, episodes), _ = jax.lax.scan(
            body, (ts, zero, zero.astype(jnp.int32)), jax.random.split(key, chunk_size)
        )
        return ts, (returns, episodes)

    shard, rep = PartitionSpec(AXIS), PartitionSpec()
    specs = TrainState(shard, shard, shard, shard, rep, rep, rep, rep)
    mapped = shard_map(chunk, mesh, (specs, rep), (specs, (rep, rep)))
    return jax.jit(mapped, donate_argnums=0)


@jax.jit
def evaluate_gymnax(params, key):
    """The greedy policy's average return over 10 episodes of gymnax's CartPole, at once."""
    return _common.evaluate_gymnax(
        cartpole, cartpole_params, lambda obs: jnp.argmax(q_net.apply(params, obs)), key
    )


def main() -> int:
    parser = _common.make_parser(
        __doc__.splitlines()[0],
        outdir="runs/anakin_dqn",
        num_steps=200_000,
        steps_help="environment steps of a full run, all envs of all devices together",
    )
    parser.add_argument("--envs-per-device", type=int, default=8)
    parser.add_argument("--batch-per-device", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=250, help="steps of each env per call")
    args = parser.parse_args()
    t_start = time.perf_counter()
    devices = jax.devices()
    n, n_envs = len(devices), args.envs_per_device
    mesh = Mesh(np.array(devices), (AXIS,))
    chunk_size = 20 if args.smoke else args.chunk_size
    num_chunks = 3 if args.smoke else max(1, args.num_steps // (chunk_size * n * n_envs))
    warmup = 10 if args.smoke else 100
    epsilon = utils.StepwiseLinearFunction((0, 1.0), (warmup, 1.0), (warmup + 2_000, 0.02))
    buffer = shard_buffer(make_prioritized_buffer(n * 8_192, alpha=0.6, beta=0.4), mesh, AXIS)

    key, init_key, env_key = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    params = q_net.init(init_key, jnp.zeros(4, jnp.float32))
    obs, env = jax.vmap(cartpole.reset, in_axes=(0, None))(
        jax.random.split(env_key, n * n_envs), cartpole_params
    )
    example = {
        "s": jnp.zeros(4, jnp.float32),
        "a": jnp.int32(0),
        "r": jnp.float32(0),
        "terminated": jnp.float32(0),
        "s_next": jnp.zeros(4, jnp.float32),
    }
    sharded, replicated = buffer.batch_sharding, buffer.replicated
    ts = TrainState(
        buffer.init(example),
        jax.device_put(env, sharded),
        jax.device_put(obs, sharded),
        jax.device_put(jnp.zeros(n * n_envs), sharded),
        *jax.device_put((params, params, optimizer.init(params), jnp.int32(0)), replicated),
    )
    # donation needs a distinct buffer for every leaf (the parameters appear twice)
    ts = ts._replace(target_params=jax.tree_util.tree_map(jnp.copy, ts.target_params))
    train_chunk = make_train_chunk(buffer, mesh, chunk_size, warmup, args.batch_per_device, epsilon)

    print(
        f"== {n} devices ({devices[0].platform}), {n_envs} envs and a buffer shard of "
        f"{buffer.capacity // n} rows on each; {num_chunks} chunks of {chunk_size} steps "
        f"per env, batches of {n * args.batch_per_device} drawn over the whole buffer"
    )
    env_steps, returns, t0 = [], [], time.perf_counter()
    for k in range(1, num_chunks + 1):
        key, chunk_key, eval_key = jax.random.split(key, 3)
        ts, (total, episodes) = train_chunk(ts, jax.device_put(chunk_key, replicated))
        episodes = int(episodes)
        steps = int(ts.step) * n * n_envs
        if episodes:
            env_steps.append(steps)
            returns.append(float(total) / episodes)
        avg = float(evaluate_gymnax(jax.device_get(ts.params), eval_key))
        rate = steps / (time.perf_counter() - t0)
        print(
            f"chunk {k:3d}  env steps {steps:7d}  episodes {episodes:4d}  "
            f"avg return {returns[-1] if episodes else float('nan'):6.1f}  greedy eval {avg:6.1f}"
            f"  {rate:6.0f} steps/s",
            flush=True,
        )

    path = args.outdir / "buffer.ckpt"
    args.outdir.mkdir(parents=True, exist_ok=True)
    utils.dump(ts.buffer, path)
    restored = buffer.put(utils.load(path, safe=True))
    assert np.array_equal(jax.device_get(restored.size), jax.device_get(ts.buffer.size))
    curve = _common.write_returns(args.outdir, env_steps, returns)
    print(
        f"buffer of {int(jnp.sum(restored.size))} transitions saved to {path} and restored onto "
        f"the {n}-device mesh; learning curve in {curve} "
        f"({time.perf_counter() - t_start:.0f} s)"
    )
    if args.smoke:
        print("smoke run OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
