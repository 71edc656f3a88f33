"""Double DQN on CartPole-v1 with n-step prioritized replay: the coax_utils main demo.

What it shows, in order:

1. a Haiku Q-network trained with optax, greedy actions through ``utils.argmax`` (random tie
   breaking), exploration from a ``utils.StepwiseLinearFunction`` schedule;
2. n-step tracing (``replay.NStep``) into a ``replay.PrioritizedReplayBuffer``, with the
   importance weights in the loss and the TD errors fed back as priorities;
3. a picklable jitted update (``utils.jit``);
4. checkpoints of the whole agent (params, target params, optimizer state, replay buffer,
   tracer, step counter, RNG key) saved every ``save_every`` steps by a
   ``utils.CheckpointManager`` in the background while training goes on (the newest three
   and the best by training return are kept), then a resume from ``manager.restore()``,
   exactly as a restarted process would do it (``--resume`` continues an earlier run from
   its newest checkpoint);
5. an evaluation over 10 greedy episodes, and an episode GIF made with ``utils.generate_gif``.

Outputs land in ``runs/dqn_cartpole/``: ``checkpoints/`` (the manager's folder), the final
agent in ``checkpoint.pkl.lz4`` (``utils.dump``) and the GIF. Run it with ``make demo`` or
``python examples/dqn_cartpole.py`` (``--smoke`` for a short run that only checks the
plumbing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import gymnasium as gym
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coax_utils import utils
from coax_utils.replay import NStep, PrioritizedReplayBuffer

# Frames are rendered off-screen (rgb_array); no display is needed.
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")

GAMMA = 0.99
N_STEP = 3
BATCH_SIZE = 64
TARGET_TAU = 0.01
WARMUP_STEPS = 1_000
TRAIN_EVERY = 1


def q_network(s: jnp.ndarray) -> jnp.ndarray:
    return hk.nets.MLP([64, 64, 2])(s)


q_net = hk.without_apply_rng(hk.transform(q_network))
optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))


def loss_fn(params, target_params, batch):
    q = q_net.apply(params, batch.S)
    q_sa = jnp.take_along_axis(q, batch.A[:, None], axis=1)[:, 0]
    # double DQN: the online network picks, the target network evaluates
    a_next = jnp.argmax(q_net.apply(params, batch.S_next), axis=1)
    q_next = jnp.take_along_axis(q_net.apply(target_params, batch.S_next), a_next[:, None], 1)
    target = batch.Rn + batch.In * jax.lax.stop_gradient(q_next[:, 0])
    td_error = target - q_sa
    loss = jnp.mean(batch.W * optax.huber_loss(td_error))
    return loss, td_error


def update(params, target_params, opt_state, batch):
    (loss, td_error), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, target_params, batch
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    target_params = optax.incremental_update(params, target_params, TARGET_TAU)
    return params, target_params, opt_state, loss, td_error


def greedy(params, key, s):
    return utils.argmax(key, q_net.apply(params, s))


update_jit = utils.jit(update)
greedy_jit = utils.jit(greedy)


def new_agent(seed: int, env: gym.Env, capacity: int) -> dict:
    key = jax.random.PRNGKey(seed)
    key, init_key = jax.random.split(key)
    s, _ = env.reset(seed=seed)
    params = q_net.init(init_key, jnp.asarray(s[None], jnp.float32))
    return {
        "params": params,
        "target_params": params,
        "opt_state": optimizer.init(params),
        "buffer": PrioritizedReplayBuffer(capacity, alpha=0.6, beta=0.4, random_seed=seed),
        "tracer": NStep(n=N_STEP, gamma=GAMMA),
        "key": key,
        "step": 0,
        "episode": 0,
        "returns": [],
    }


def train(
    agent: dict,
    env: gym.Env,
    num_steps: int,
    warmup: int,
    epsilon,
    beta,
    log_every: int,
    manager: utils.CheckpointManager,
    save_every: int,
) -> None:
    """Train in place for ``num_steps`` environment steps, printing progress.

    Every ``save_every`` steps the agent is handed to ``manager.save``, which returns once it
    has copied the agent; the checkpoint is compressed and written on a background thread
    while training goes on.
    """
    rng = np.random.default_rng(agent["step"])
    s, _ = env.reset(seed=int(agent["step"]))
    ep_return, t0, steps0 = 0.0, time.perf_counter(), agent["step"]
    for _ in range(num_steps):
        agent["key"], key = jax.random.split(agent["key"])
        if rng.random() < float(epsilon(agent["step"])):
            a = int(env.action_space.sample())
        else:
            a = int(greedy_jit(agent["params"], key, s[None].astype(np.float32))[0])
        s_next, r, terminated, truncated, _ = env.step(a)
        ep_return += float(r)
        agent["tracer"].add(
            s.astype(np.float32), a, float(r), terminated,
            truncated=truncated, s_next=s_next.astype(np.float32),
        )
        while agent["tracer"]:
            agent["buffer"].add(agent["tracer"].pop())
        s = s_next
        if terminated or truncated:
            agent["returns"].append(ep_return)
            agent["episode"] += 1
            ep_return = 0.0
            s, _ = env.reset()
        agent["step"] += 1

        if agent["step"] >= warmup and agent["step"] % TRAIN_EVERY == 0:
            agent["buffer"].beta = float(beta(agent["step"]))
            batch = agent["buffer"].sample(BATCH_SIZE)
            params, target_params, opt_state, _, td_error = update_jit(
                agent["params"], agent["target_params"], agent["opt_state"], batch
            )
            agent["params"], agent["target_params"], agent["opt_state"] = (
                params, target_params, opt_state,
            )
            agent["buffer"].update(batch.idx, np.asarray(td_error))

        if agent["step"] % save_every == 0:
            recent = agent["returns"][-10:]
            metrics = {"train_return": float(np.mean(recent)) if recent else 0.0}
            manager.save(agent["step"], agent, metrics=metrics)

        if agent["step"] % log_every == 0:
            now = time.perf_counter()
            recent = agent["returns"][-10:]
            print(
                f"step {agent['step']:6d}  episodes {agent['episode']:4d}  "
                f"avg return (last 10) {np.mean(recent) if recent else 0.0:6.1f}  "
                f"epsilon {float(epsilon(agent['step'])):.3f}  "
                f"{(agent['step'] - steps0) / (now - t0):6.0f} steps/s",
                flush=True,
            )


def evaluate(params, env: gym.Env, num_episodes: int, seed: int) -> float:
    key = jax.random.PRNGKey(seed)
    returns = []
    for i in range(num_episodes):
        s, _ = env.reset(seed=seed + i)
        done, total = False, 0.0
        while not done:
            key, subkey = jax.random.split(key)
            a = int(greedy_jit(params, subkey, s[None].astype(np.float32))[0])
            s, r, terminated, truncated, _ = env.step(a)
            total += float(r)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run checking the plumbing")
    parser.add_argument("--outdir", default="runs/dqn_cartpole")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-steps", type=int, default=60_000)
    parser.add_argument("--target-return", type=float, default=200.0)
    parser.add_argument(
        "--resume", action="store_true", help="continue an earlier run from its newest checkpoint"
    )
    args = parser.parse_args()

    outdir = Path(args.outdir)
    checkpoint = outdir / "checkpoint.pkl.lz4"
    checkpoints = outdir / "checkpoints"
    t_start = time.perf_counter()
    env = gym.make("CartPole-v1")
    eval_env = gym.make("CartPole-v1")

    max_steps = 600 if args.smoke else args.max_steps
    eval_every = 300 if args.smoke else 5_000
    first_phase = eval_every
    log_every = 100 if args.smoke else 1_000
    save_every = 100 if args.smoke else 1_000
    warmup = 100 if args.smoke else WARMUP_STEPS
    epsilon = utils.StepwiseLinearFunction((0, 1.0), (warmup, 1.0), (10_000, 0.02))
    beta = utils.StepwiseLinearFunction((0, 0.4), (max_steps, 1.0))

    def open_manager() -> utils.CheckpointManager:
        return utils.CheckpointManager(
            checkpoints, max_to_keep=3, best_fn=lambda metrics: metrics["train_return"]
        )

    if not args.resume and checkpoints.exists():
        print(f"== a new run: removing the checkpoints of an earlier run in {checkpoints}")
        shutil.rmtree(checkpoints)
    manager = open_manager()
    if manager.latest_step() is None:
        agent = new_agent(args.seed, env, capacity=50_000)
        print(
            f"== phase 1: train {first_phase} steps, saving a checkpoint every {save_every} "
            f"steps in the background to {checkpoints}"
        )
        train(agent, env, first_phase, warmup, epsilon, beta, log_every, manager, save_every)
        manager.close()  # waits for the last background save
        print(f"   checkpoints kept: steps {manager.all_steps()} (best: {manager.best_step()})")

        # Resume exactly as a restarted process would: nothing survives but the checkpoints.
        del agent, manager
        manager = open_manager()
    agent = manager.restore()
    print(
        f"== phase 2: resumed from the checkpoint at step {agent['step']} "
        f"with {len(agent['buffer'])} transitions in replay"
    )

    avg = float("-inf")
    while agent["step"] < max_steps:
        train(agent, env, eval_every, warmup, epsilon, beta, log_every, manager, save_every)
        avg = evaluate(agent["params"], eval_env, num_episodes=10, seed=10_000)
        elapsed = time.perf_counter() - t_start
        print(f"   eval at step {agent['step']}: average return over 10 episodes {avg:.1f} "
              f"({elapsed:.0f} s elapsed)")
        if avg >= args.target_return:
            break
    if avg == float("-inf"):  # resumed at max_steps: nothing left to train
        avg = evaluate(agent["params"], eval_env, num_episodes=10, seed=10_000)
    manager.close()
    print(f"   checkpoints kept: steps {manager.all_steps()} (best: {manager.best_step()})")
    utils.dump(agent, checkpoint)
    print(f"   final agent written: {checkpoint} ({checkpoint.stat().st_size / 1e6:.1f} MB)")

    gif = outdir / "dqn_cartpole.gif"
    gif_env = gym.make("CartPole-v1", render_mode="rgb_array")
    key = jax.random.PRNGKey(0)
    policy = lambda s: int(greedy_jit(agent["params"], key, s[None].astype(np.float32))[0])
    utils.generate_gif(gif_env, gif, policy=policy, resize_to=(300, 200), duration=30)
    print(f"   episode GIF written: {gif}")

    elapsed = time.perf_counter() - t_start
    if args.smoke:
        print(f"smoke run finished in {elapsed:.0f} s")
        return 0
    if avg >= args.target_return:
        print(f"SOLVED: average return {avg:.1f} >= {args.target_return:.0f} over 10 evaluation "
              f"episodes after {agent['step']} steps in {elapsed:.0f} s")
        return 0
    print(f"NOT SOLVED: average return {avg:.1f} < {args.target_return:.0f} after "
          f"{agent['step']} steps in {elapsed:.0f} s")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
