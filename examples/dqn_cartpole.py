"""Double DQN on CartPole-v1 with n-step prioritized replay: the coax_utils main demo.

It shows a Haiku Q-network trained with optax; greedy actions through ``utils.argmax``
(random tie breaking) and exploration from a ``utils.StepwiseLinearFunction`` schedule;
n-step tracing (``replay.NStep``) into a ``replay.PrioritizedReplayBuffer`` with importance
weights in the loss and TD errors fed back as priorities; a picklable jitted update
(``utils.jit``); checkpoints of the whole agent written in the background by a
``utils.CheckpointManager`` (the newest three and the best by training return are kept) and a
resume from them exactly as a restarted process would do it (``--resume`` continues an
earlier run); an evaluation over 10 greedy episodes and an episode GIF.

Outputs in ``runs/dqn_cartpole/``: ``checkpoints/``, the final agent ``checkpoint.pkl.lz4``
(``utils.dump``), ``returns.csv`` (the learning curve) and ``dqn_cartpole.gif``. Run it with
``make demo`` or ``python examples/dqn_cartpole.py`` (``--smoke``: a short plumbing check).
"""

from __future__ import annotations

import os
import shutil
import time

import _common
import gymnasium as gym
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coax_utils import utils
from coax_utils.replay import NStep, PrioritizedReplayBuffer

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # frames are rendered off-screen
GAMMA, N_STEP, BATCH_SIZE, TARGET_TAU = 0.99, 3, 64, 0.01

q_net = hk.without_apply_rng(hk.transform(lambda s: hk.nets.MLP([64, 64, 2])(s)))
optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3))


def loss_fn(params, target_params, batch):
    q_sa = jnp.take_along_axis(q_net.apply(params, batch.S), batch.A[:, None], axis=1)[:, 0]
    # double DQN: the online network picks, the target network evaluates
    a_next = jnp.argmax(q_net.apply(params, batch.S_next), axis=1)
    q_next = jnp.take_along_axis(q_net.apply(target_params, batch.S_next), a_next[:, None], 1)
    td_error = batch.Rn + batch.In * jax.lax.stop_gradient(q_next[:, 0]) - q_sa
    return jnp.mean(batch.W * optax.huber_loss(td_error)), td_error


@utils.jit
def update(params, target_params, opt_state, batch):
    grads, td_error = jax.grad(loss_fn, has_aux=True)(params, target_params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, optax.incremental_update(params, target_params, TARGET_TAU), opt_state, td_error


@utils.jit
def greedy(params, key, s):
    return utils.argmax(key, q_net.apply(params, s[None].astype(jnp.float32)))[0]


def policy(params, key=jax.random.PRNGKey(0)):  # noqa: B008 (one key, made once)
    """The greedy policy ``s -> a`` of ``params``."""
    return lambda s: int(greedy(params, key, s))


def new_agent(seed: int) -> dict:
    key, init_key = jax.random.split(jax.random.PRNGKey(seed))
    params = q_net.init(init_key, jnp.zeros((1, 4), jnp.float32))
    return {
        "params": params,
        "target_params": params,
        "opt_state": optimizer.init(params),
        "buffer": PrioritizedReplayBuffer(50_000, alpha=0.6, beta=0.4, random_seed=seed),
        "tracer": NStep(n=N_STEP, gamma=GAMMA),
        "key": key,
        "step": 0,
        "returns": [],  # the learning curve: each episode's return
        "episode_ends": [],  # and the env step at which it ended
    }


def train(agent, env, num_steps, warmup, epsilon, beta, manager, save_every, log_every):
    """Train in place for ``num_steps`` steps; every ``save_every`` steps ``manager.save``
    copies the agent and writes it on a background thread while training goes on."""
    rng = np.random.default_rng(agent["step"])
    s, _ = env.reset(seed=agent["step"])
    ep_return, t0, start_step = 0.0, time.perf_counter(), agent["step"]
    for _ in range(num_steps):
        agent["key"], key = jax.random.split(agent["key"])
        explore = rng.random() < float(epsilon(agent["step"]))
        a = int(rng.integers(2) if explore else greedy(agent["params"], key, s))
        s_next, r, terminated, truncated, _ = env.step(a)
        agent["tracer"].add(s, a, r, terminated, truncated=truncated, s_next=s_next)
        while agent["tracer"]:
            agent["buffer"].add(agent["tracer"].pop())
        s, ep_return, agent["step"] = s_next, ep_return + r, agent["step"] + 1
        if terminated or truncated:
            agent["returns"].append(ep_return)
            agent["episode_ends"].append(agent["step"])
            s, ep_return = env.reset()[0], 0.0
        if agent["step"] >= warmup:
            agent["buffer"].beta = float(beta(agent["step"]))
            batch = agent["buffer"].sample(BATCH_SIZE)
            *learner, td_error = update(
                agent["params"], agent["target_params"], agent["opt_state"], batch
            )
            agent["params"], agent["target_params"], agent["opt_state"] = learner
            agent["buffer"].update(batch.idx, np.asarray(td_error))
        if agent["step"] % save_every == 0:
            train_return = float(np.mean(agent["returns"][-10:] or 0.0))
            manager.save(agent["step"], agent, metrics={"train_return": train_return})
        if agent["step"] % log_every == 0:
            eps = epsilon(agent["step"])
            _common.print_progress(agent["step"], agent["returns"], t0, start_step, epsilon=eps)


def main() -> int:
    parser = _common.make_parser(
        __doc__.splitlines()[0], outdir="runs/dqn_cartpole", seed=7, num_steps=60_000
    )
    parser.add_argument("--target-return", type=float, default=200.0)
    parser.add_argument("--resume", action="store_true", help="continue from the newest save")
    args = parser.parse_args()
    smoke, checkpoints = args.smoke, args.outdir / "checkpoints"
    t_start, env, eval_env = time.perf_counter(), gym.make("CartPole-v1"), gym.make("CartPole-v1")
    max_steps = 600 if smoke else args.num_steps
    eval_every, save_every, log_every = (300, 100, 100) if smoke else (5_000, 1_000, 1_000)
    warmup = 100 if smoke else 1_000
    epsilon = utils.StepwiseLinearFunction((0, 1.0), (warmup, 1.0), (10_000, 0.02))
    beta = utils.StepwiseLinearFunction((0, 0.4), (max_steps, 1.0))
    schedule = (warmup, epsilon, beta)

    def open_manager() -> utils.CheckpointManager:
        return utils.CheckpointManager(
            checkpoints, max_to_keep=3, best_fn=lambda metrics: metrics["train_return"]
        )

    if not args.resume and checkpoints.exists():
        print(f"== a new run: removing the checkpoints of an earlier run in {checkpoints}")
        shutil.rmtree(checkpoints)
    manager = open_manager()
    if manager.latest_step() is None:
        print(
            f"== phase 1: train {eval_every} steps, saving every {save_every} steps in the "
            f"background to {checkpoints}"
        )
        train(new_agent(args.seed), env, eval_every, *schedule, manager, save_every, log_every)
        manager.close()  # waits for the last background save
        print(f"   checkpoints kept: steps {manager.all_steps()} (best: {manager.best_step()})")
        manager = open_manager()  # resume as a restarted process would: from the files alone
    agent = manager.restore()
    print(
        f"== phase 2: resumed from the checkpoint at step {agent['step']} "
        f"with {len(agent['buffer'])} transitions in replay"
    )

    avg = float("-inf")
    while agent["step"] < max_steps and avg < args.target_return:
        train(agent, env, eval_every, *schedule, manager, save_every, log_every)
        avg = _common.evaluate(eval_env, policy(agent["params"]), num_episodes=10, seed=10_000)
        print(
            f"   eval at step {agent['step']}: average return over 10 episodes {avg:.1f} "
            f"({time.perf_counter() - t_start:.0f} s elapsed)"
        )
    if avg == float("-inf"):  # resumed at max_steps: nothing left to train
        avg = _common.evaluate(eval_env, policy(agent["params"]), num_episodes=10, seed=10_000)
    manager.close()
    print(f"   checkpoints kept: steps {manager.all_steps()} (best: {manager.best_step()})")
    utils.dump(agent, args.outdir / "checkpoint.pkl.lz4")
    curve = _common.write_returns(args.outdir, agent["episode_ends"], agent["returns"])
    print(f"   final agent written: {args.outdir / 'checkpoint.pkl.lz4'}, learning curve: {curve}")
    gif_env = gym.make("CartPole-v1", render_mode="rgb_array")
    gif = args.outdir / "dqn_cartpole.gif"
    utils.generate_gif(gif_env, gif, policy(agent["params"]), resize_to=(300, 200), duration=30)
    print(f"   episode GIF written: {gif}")

    elapsed, solved = time.perf_counter() - t_start, avg >= args.target_return
    if smoke:
        print(f"smoke run finished in {elapsed:.0f} s")
        return 0
    print(
        f"{'SOLVED' if solved else 'NOT SOLVED'}: average return {avg:.1f} (target "
        f"{args.target_return:.0f}) after {agent['step']} steps in {elapsed:.0f} s"
    )
    return 0 if solved else 1


if __name__ == "__main__":
    raise SystemExit(main())
