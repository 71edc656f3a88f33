"""Ape-X style DQN on CartPole with Ray: one learner, N rollout workers, sharded replay.

The learner (this process) trains a Haiku Q-network with double-DQN n-step targets on
batches sampled from a :class:`~coax_utils.distributed.ShardedReplay`: ``--num-shards``
:class:`~coax_utils.distributed.ReplayServer` shards, each wrapping a prioritized replay
buffer, sampled as one buffer. A :class:`~coax_utils.distributed.RateLimiter` holds the
ratio of sampled to inserted transitions at ``--samples-per-insert`` (writers wait when
they run ahead, the learner when it does), and a
:class:`~coax_utils.distributed.PrefetchingSampler` keeps sample requests in flight while
the learner trains. Rollout workers (:class:`~coax_utils.distributed.RolloutWorker`
actors) play with epsilon-greedy policies of different epsilons (as in Ape-X), pull the
latest parameters from a :class:`~coax_utils.distributed.ParameterServer`, compute initial
priorities (|TD error| under their parameters) and push n-step transitions to their shard
(worker i writes to shard i mod the number of shards). The learner sends the new |TD errors|
of every trained batch back as priorities, without waiting.

Run it on this machine (starts a local Ray cluster)::

    python examples/apex_dqn_ray.py

on a running multi-node cluster (same code; workers spread over the nodes, each node needs
coax_utils installed)::

    ray start --head                       # on the head node, then `ray start --address=...`
    python examples/apex_dqn_ray.py --address auto --num-workers 16

or as a quick check (what CI runs; well under a minute)::

    python examples/apex_dqn_ray.py --smoke

At the end it evaluates the learner's greedy policy over 10 episodes and writes the learning
curve (every worker's episode returns against the env steps of all workers) to
``runs/apex_dqn_ray/returns.csv``.
"""

from __future__ import annotations

import argparse
import os
import time

import _common
import gymnasium
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import ray

from coax_utils.distributed import (
    ParameterServer,
    PrefetchingSampler,
    RateLimiter,
    RolloutWorker,
    ShardedReplay,
)
from coax_utils.replay import PrioritizedReplayBuffer


def parse_args() -> argparse.Namespace:
    parser = _common.make_parser(
        __doc__.splitlines()[0],
        outdir="runs/apex_dqn_ray",
        num_steps=6000,
        steps_help="learner steps (updates) of a full run",
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local cluster")
    parser.add_argument("--temp-dir", default=None, help="Ray temp dir of the local cluster")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1000, help="transitions before training")
    parser.add_argument("--capacity", type=int, default=50_000, help="over all shards")
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--samples-per-insert", type=float, default=8.0)
    parser.add_argument("--prefetch", type=int, default=4, help="sample requests in flight")
    parser.add_argument("--n-step", type=int, default=3)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--publish-every", type=int, default=50, help="learner steps")
    parser.add_argument("--log-every", type=int, default=500, help="learner steps")
    parser.add_argument("--checkpoint", default=None, help="save the replay buffer here")
    args = parser.parse_args()
    if args.smoke:
        args.num_steps, args.warmup, args.batch_size = 200, 200, 32
        args.log_every, args.capacity = 100, 5000
    return args


def make_q(num_actions: int) -> hk.Transformed:
    def forward(S):
        return hk.nets.MLP([64, 64, num_actions])(S)

    return hk.without_apply_rng(hk.transform(forward))


def make_policy(q: hk.Transformed, epsilon: float, num_actions: int):
    """Epsilon-greedy policy(params, s, rng) for a worker (sent to it by Ray)."""
    q_values = jax.jit(q.apply)

    def policy(params, s, rng):
        if rng.random() < epsilon:
            return int(rng.integers(num_actions))
        return int(np.argmax(q_values(params, s[None])[0]))

    return policy


def make_td_error(q: hk.Transformed):
    """TD errors of n-step transitions (double DQN); ``In`` is the bootstrap factor."""

    def td_error(params, target_params, S, A, Rn, In, S_next):
        A_next = jnp.argmax(q.apply(params, S_next), axis=1)
        q_next = jnp.take_along_axis(q.apply(target_params, S_next), A_next[:, None], axis=1)
        target = jax.lax.stop_gradient(Rn + In * q_next[:, 0])
        q_sa = jnp.take_along_axis(q.apply(params, S), A[:, None], axis=1)[:, 0]
        return target - q_sa

    return td_error


def make_priority_fn(q: hk.Transformed):
    """Initial priorities in a worker: |TD error| under the worker's current parameters."""
    td_error = jax.jit(make_td_error(q))

    def priority_fn(params, batch):
        td = td_error(params, params, batch.S, batch.A, batch.Rn, batch.In, batch.S_next)
        return np.abs(np.asarray(td))

    return priority_fn


def make_train_step(q: hk.Transformed, optimizer: optax.GradientTransformation):
    td_error = make_td_error(q)

    @jax.jit
    def train_step(params, target_params, opt_state, S, A, Rn, In, S_next, W):
        def loss_fn(p):
            td = td_error(p, target_params, S, A, Rn, In, S_next)
            return jnp.mean(W * optax.huber_loss(td)), td

        (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        target_params = optax.incremental_update(params, target_params, step_size=0.01)
        return params, target_params, opt_state, loss, td

    return train_step


def init_ray(args: argparse.Namespace) -> None:
    if args.address:
        ray.init(address=args.address)
    else:
        # a new local cluster, even if another one runs on this machine
        ray.init(
            address="local",
            num_cpus=args.num_cpus,
            include_dashboard=False,
            _temp_dir=args.temp_dir,
            log_to_driver=True,
        )


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    init_ray(args)

    env = gymnasium.make(args.env)
    num_actions = int(env.action_space.n)
    S_example = np.asarray(env.observation_space.sample(), np.float32)[None]
    q = make_q(num_actions)
    params = q.init(jax.random.PRNGKey(args.seed), S_example)
    target_params = params
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    train_step = make_train_step(q, optimizer)

    buffers = [
        PrioritizedReplayBuffer(
            args.capacity // args.num_shards, alpha=0.6, beta=0.4, random_seed=args.seed + i
        )
        for i in range(args.num_shards)
    ]
    # the window holds every worker's in-flight pushes plus the learner's prefetched batches
    error_buffer = args.samples_per_insert * 32 * 3 * args.num_workers
    error_buffer += args.batch_size * (args.prefetch + 1)
    limiter = RateLimiter.remote(args.warmup, args.samples_per_insert, error_buffer)
    replay = ShardedReplay(buffers, rate_limiter=limiter, seed=args.seed, timeout=60.0)
    store = ParameterServer.remote(jax.device_get(params))
    priority_fn = make_priority_fn(q)
    workers = []
    for i in range(args.num_workers):
        # Ape-X's epsilons: 0.4 ** (1 + 7 i / (N - 1)), from 0.4 down to 0.4**8
        epsilon = 0.4 ** (1 + 7 * i / max(args.num_workers - 1, 1))
        workers.append(
            RolloutWorker.remote(
                args.env,
                make_policy(q, epsilon, num_actions),
                replay.shards[i % args.num_shards],
                store,
                n=args.n_step,
                gamma=args.gamma,
                batch_size=32,
                priority_fn=priority_fn,
                sync_every=100,
                seed=args.seed + 1000 * (i + 1),
            )
        )
    ray.get([w.start.remote() for w in workers])

    while replay.size() < args.warmup:
        ray.get([w.stats.remote() for w in workers])  # raises if a worker failed
        time.sleep(0.1)
    print(f"warm-up done: {replay.size()} transitions", flush=True)

    sampler = PrefetchingSampler(
        replay, args.batch_size, num_in_flight=args.prefetch, timeout=120.0
    )
    # the learning curve: every worker's episodes, each stamped with the env steps of all
    # workers together when the learner saw it end (it asks every `publish_every` steps)
    returns, episode_ends, seen = [], [], [0] * args.num_workers
    tic = time.perf_counter()
    for step in range(1, args.num_steps + 1):
        batch = sampler.sample()  # waits only if the rate limiter holds the learner back
        fields = (batch.S, batch.A, batch.Rn, batch.In, batch.S_next, batch.W)
        params, target_params, opt_state, loss, td = train_step(
            params, target_params, opt_state, *fields
        )
        sampler.update(batch.idx, np.abs(np.asarray(td)))  # sent without waiting
        if step % args.publish_every == 0:
            store.set.remote(jax.device_get(params))
        log = step % args.log_every == 0 or step == args.num_steps
        if step % args.publish_every == 0 or log:
            stats = ray.get([w.stats.remote() for w in workers])
            env_steps = sum(s["steps"] for s in stats)
            for i, s in enumerate(stats):
                new = min(s["episodes"] - seen[i], len(s["episode_returns"]))
                returns.extend(s["episode_returns"][len(s["episode_returns"]) - new :])
                episode_ends.extend([env_steps] * new)
                seen[i] = s["episodes"]
        if log:
            # mean return of the last 10 episodes of each worker (most exploring first)
            recent = " ".join(
                f"{np.mean(s['episode_returns'][-10:]) if s['episode_returns'] else 0.0:5.1f}"
                for s in stats
            )
            print(
                f"learner step {step:6d}  loss {float(loss):7.4f}  "
                f"replay {replay.size():6d}  "
                f"env steps {env_steps:7d}  "
                f"returns {recent}  "
                f"{step / (time.perf_counter() - tic):4.0f} updates/s",
                flush=True,
            )
    sampler.close()  # waits for the last priority updates

    # The workers may now wait for the rate limiter (the learner stopped sampling), so they
    # are killed rather than stopped; the shards keep every batch that reached them.
    final = ray.get([w.stats.remote() for w in workers])
    for w in workers:
        ray.kill(w)
    counts = ray.get(limiter.counts.remote())
    num_added = replay.num_added()
    acknowledged = sum(s["transitions_added"] for s in final)
    sent = sum(s["transitions_sent"] for s in final)
    print(
        f"done in {time.perf_counter() - start:.1f} s: {args.num_steps} learner steps, "
        f"{sum(s['steps'] for s in final)} env steps, {num_added} transitions received by "
        f"{args.num_shards} shards, samples per insert {counts['samples'] / counts['inserts']:.2f}"
        f" (target {args.samples_per_insert}), {ray.get(store.version.remote())} parameter "
        "versions",
        flush=True,
    )
    q_values = jax.jit(q.apply)
    greedy = lambda s: int(np.argmax(q_values(params, s[None].astype(np.float32))[0]))
    num_eval = 2 if args.smoke else 10
    avg = _common.evaluate(env, greedy, num_eval, seed=10_000)
    curve = _common.write_returns(args.outdir, episode_ends, returns)
    print(
        f"evaluation: average return {avg:.1f} over {num_eval} greedy episodes of the "
        f"learner's policy; learning curve in {curve}",
        flush=True,
    )
    if args.checkpoint:
        path = replay.save(os.path.abspath(args.checkpoint))
        print(f"replay shards saved to {path}", flush=True)
    if args.smoke:
        # every acknowledged transition reached a shard, none that was not sent, and training
        # ran under the rate limiter's window
        assert 0 < acknowledged <= num_added <= sent, (acknowledged, num_added, sent)
        lag = args.samples_per_insert * counts["inserts"] - counts["samples"]
        assert abs(lag - args.samples_per_insert * args.warmup) <= error_buffer, counts
        assert np.isfinite(float(loss))
        print("smoke run OK", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
