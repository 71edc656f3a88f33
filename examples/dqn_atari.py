"""DQN on ALE Pong with frame-stacked prioritized replay that stores each frame once.

What it shows:

1. ALE Pong through ``ale-py`` (its wheels ship the ROMs) with gymnasium's
   ``AtariPreprocessing`` (84x84 grayscale, frame skip 4) and ``FrameStackObservation``
   (stacks of 4 frames, the first frame repeated at episode start);
2. ``replay.RecordTransitions`` feeding n-step transitions into a
   ``replay.PrioritizedFrameStackReplayBuffer``: each 84x84 frame is stored once (about 7 KB
   per transition instead of 56 KB), and sampled stacks are exactly what the agent saw;
3. a Haiku convolutional Q-network (the Nature DQN torso) trained with optax on the
   importance-weighted Huber loss, the TD errors fed back as priorities;
4. the buffer saved with ``save`` (a folder of ``.npy`` files, each leaf checksummed) and
   read back with ``load``; the learning curve in ``returns.csv`` (written every 10,000
   steps).

Needs the ``atari`` extra (``pip install coax_utils[atari]``). ``--smoke`` runs a few hundred
steps with a small buffer, as CI does; a real run needs millions of steps (and a GPU).
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
from coax_utils.replay import NStep, PrioritizedFrameStackReplayBuffer, RecordTransitions

STACK = 4
GAMMA = 0.99
N_STEP = 3


def make_env(max_episode_steps: int | None = None) -> gym.Env:
    try:
        import ale_py
    except ImportError as e:
        raise ImportError("this example needs ale-py: pip install coax_utils[atari]") from e
    gym.register_envs(ale_py)
    env = gym.make(
        "ALE/Pong-v5",
        frameskip=1,  # AtariPreprocessing skips frames itself
        repeat_action_probability=0.25,
        max_episode_steps=None if max_episode_steps is None else 4 * max_episode_steps,
    )
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    return gym.wrappers.FrameStackObservation(env, STACK)


def q_network(s: jnp.ndarray, num_actions: int) -> jnp.ndarray:
    x = jnp.transpose(s.astype(jnp.float32) / 255.0, (0, 2, 3, 1))  # (B, k, H, W) -> NHWC
    x = jax.nn.relu(hk.Conv2D(32, 8, stride=4)(x))
    x = jax.nn.relu(hk.Conv2D(64, 4, stride=2)(x))
    x = jax.nn.relu(hk.Conv2D(64, 3, stride=1)(x))
    x = jax.nn.relu(hk.Linear(512)(hk.Flatten()(x)))
    return hk.Linear(num_actions)(x)


def main() -> None:
    parser = _common.make_parser(
        __doc__.splitlines()[0], outdir="runs/dqn_atari", num_steps=5_000_000
    )
    args = parser.parse_args()

    if args.smoke:
        steps, capacity, warmup, batch_size, max_ep = 160, 1_000, 80, 8, 60
    else:
        steps, capacity, warmup, batch_size, max_ep = args.num_steps, 1_000_000, 50_000, 32, None
    env = make_env(max_ep)
    num_actions = int(env.action_space.n)
    q_net = hk.without_apply_rng(hk.transform(lambda s: q_network(s, num_actions)))
    optimizer = optax.adam(6.25e-5, eps=1.5e-4)
    buffer = PrioritizedFrameStackReplayBuffer(
        capacity, stack_size=STACK, alpha=0.5, beta=0.4, random_seed=args.seed
    )
    env = RecordTransitions(env, buffer, NStep(n=N_STEP, gamma=GAMMA))
    epsilon = utils.StepwiseLinearFunction((0, 1.0), (max(1, steps // 10), 0.01))

    def loss_fn(params, target_params, batch):
        q = q_net.apply(params, batch.S)
        q_sa = jnp.take_along_axis(q, batch.A[:, None], axis=1)[:, 0]
        q_next = q_net.apply(target_params, batch.S_next).max(axis=1)
        td_error = batch.Rn + batch.In * jax.lax.stop_gradient(q_next) - q_sa
        return jnp.mean(batch.W * optax.huber_loss(td_error)), td_error

    @jax.jit
    def update(params, opt_state, target_params, batch):
        (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, target_params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, td

    @jax.jit
    def greedy(params, key, s):
        return utils.argmax(key, q_net.apply(params, s))

    key = jax.random.PRNGKey(args.seed)
    s, _ = env.reset(seed=args.seed)
    params = q_net.init(key, s[None])
    target_params, opt_state = params, optimizer.init(params)
    rng = np.random.default_rng(args.seed)
    ep_return, returns, episode_ends = 0.0, [], []
    t0, loss = time.perf_counter(), float("nan")
    for step in range(steps):
        key, k = jax.random.split(key)
        if rng.random() < float(epsilon(step)):
            a = int(rng.integers(num_actions))
        else:
            a = int(greedy(params, k, s[None])[0])
        s, r, terminated, truncated, _ = env.step(a)
        ep_return += float(r)
        if terminated or truncated:
            returns.append(ep_return)
            episode_ends.append(step + 1)
            ep_return = 0.0
            s, _ = env.reset()
        if step >= warmup and step % 4 == 0:
            batch = buffer.sample(batch_size)
            params, opt_state, loss, td = update(params, opt_state, target_params, batch)
            buffer.update(batch.idx, np.asarray(td))
        if step % 2_000 == 0:
            target_params = params
        if (step + 1) % 10_000 == 0 or step == steps - 1:
            _common.print_progress(step + 1, returns, t0, loss=loss, frames=buffer.frame_count)
            _common.write_returns(args.outdir, episode_ends, returns)

    frames_per_transition = buffer.frame_count / max(len(buffer), 1)
    print(f"frames stored per transition: {frames_per_transition:.3f}")
    buffer.save(args.outdir / "buffer")
    loaded = PrioritizedFrameStackReplayBuffer.load(args.outdir / "buffer")
    print(f"saved and reloaded the buffer: {len(loaded)} transitions")
    if args.smoke:
        print("smoke run finished")


if __name__ == "__main__":
    main()
