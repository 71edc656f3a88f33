"""What every example shares: its command line, progress lines, evaluation and returns log.

The examples import this module as ``_common`` (Python puts a script's folder on
``sys.path``, so ``python examples/<name>.py`` finds it). Everything here is a plain function:

- :func:`make_parser`: the options every example has (``--smoke``, ``--outdir``, ``--seed``,
  ``--num-steps``); an example adds its own before parsing;
- :func:`print_progress`: one progress line (step, episodes, recent average return, any
  metrics, steps per second);
- :func:`evaluate`: the average return of a policy over a few episodes of a gymnasium env;
  :func:`evaluate_gymnax` the same for a gymnax env, all episodes at once in compiled code;
- :func:`write_returns` and :func:`read_returns`: the learning curve, one row per finished
  episode (the environment step at which it ended and its return), in ``returns.csv`` in the
  run's output folder; ``examples/plot_returns.py`` draws it.
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

RETURNS_FILE = "returns.csv"
RETURNS_HEADER = "env_step,episode_return"


def make_parser(
    description: str,
    *,
    outdir: str,
    seed: int = 0,
    num_steps: int,
    steps_help: str = "environment steps of a full run",
) -> argparse.ArgumentParser:
    """An argument parser with the options every example has.

    Parameters
    ----------
    description : str
        Shown by ``--help`` (an example passes its docstring's first line).
    outdir : str
        Default of ``--outdir``, the folder for the run's outputs.
    seed : int
        Default of ``--seed``.
    num_steps : int
        Default of ``--num-steps``, the length of a full run.
    steps_help : str
        The help of ``--num-steps``: what it counts (environment steps by default).

    Returns
    -------
    argparse.ArgumentParser
        With ``--smoke`` (a short run that only checks the plumbing), ``--outdir``,
        ``--seed`` and ``--num-steps``.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="a short run checking the plumbing")
    parser.add_argument("--outdir", type=Path, default=Path(outdir), help="output folder")
    parser.add_argument("--seed", type=int, default=seed, help="seed of every random number")
    parser.add_argument("--num-steps", type=int, default=num_steps, help=steps_help)
    return parser


def print_progress(
    step: int,
    returns: Sequence[float],
    t0: float,
    start_step: int = 0,
    *,
    window: int = 10,
    **metrics: float,
) -> None:
    """Print one progress line.

    Parameters
    ----------
    step : int
        Environment steps taken so far.
    returns : sequence of float
        The returns of the episodes finished so far.
    t0 : float
        ``time.perf_counter()`` when ``start_step`` steps had been taken.
    start_step : int
        The step count at ``t0`` (0 unless the run was resumed): the steps per second are
        ``(step - start_step) / (time.perf_counter() - t0)``.
    window : int
        The number of recent episodes averaged.
    **metrics : float
        Printed as ``name value`` (underscores become spaces), e.g. ``loss=0.5``.
    """
    recent = list(returns)[-window:]
    avg = float(np.mean(recent)) if recent else float("nan")
    extra = "".join(f"  {name.replace('_', ' ')} {float(v):.4g}" for name, v in metrics.items())
    rate = (step - start_step) / max(time.perf_counter() - t0, 1e-9)
    print(
        f"step {step:6d}  episodes {len(returns):4d}  avg return (last {window}) {avg:7.1f}"
        f"{extra}  {rate:5.0f} steps/s",
        flush=True,
    )


def evaluate(
    env: gym.Env, policy: Callable[[np.ndarray], Any], num_episodes: int, seed: int
) -> float:
    """The average undiscounted return of ``policy`` over ``num_episodes`` episodes.

    Parameters
    ----------
    env : gymnasium.Env
        The environment; episode ``i`` starts from ``env.reset(seed=seed + i)``.
    policy : callable
        ``policy(observation) -> action``.
    num_episodes : int
        The number of episodes.
    seed : int
        The seed of the first episode.

    Returns
    -------
    float
        The average return.
    """
    returns = []
    for i in range(num_episodes):
        s, _ = env.reset(seed=seed + i)
        done, total = False, 0.0
        while not done:
            s, r, terminated, truncated, _ = env.step(policy(s))
            total += float(r)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def evaluate_gymnax(env: Any, env_params: Any, policy: Callable, key: Any, num_episodes: int = 10):
    """The average undiscounted return of ``policy(observation) -> action`` over
    ``num_episodes`` episodes of the gymnax env ``env``, run at once (``vmap`` over episodes,
    ``scan`` over steps; jittable): a float32 scalar array."""
    import jax
    import jax.numpy as jnp

    from coax_utils.envs import step_without_autoreset

    def episode(key):
        def body(carry, step_key):
            obs, env_state, alive, total = carry
            obs, env_state, reward, terminated, truncated, _ = step_without_autoreset(
                env, step_key, env_state, policy(obs), env_params
            )
            alive_next = alive & ~(terminated | truncated)
            return (obs, env_state, alive_next, total + jnp.where(alive, reward, 0.0)), None

        obs, env_state = env.reset(key, env_params)
        carry = (obs, env_state, jnp.ones([], bool), jnp.zeros([], jnp.float32))
        steps = jax.random.split(key, env_params.max_steps_in_episode)
        return jax.lax.scan(body, carry, steps)[0][3]

    return jnp.mean(jax.vmap(episode)(jax.random.split(key, num_episodes)))


def write_returns(outdir: Path | str, env_steps: Sequence[int], returns: Sequence[float]) -> Path:
    """Write the learning curve to ``<outdir>/returns.csv`` (atomically; any older one is
    replaced).

    The file starts with a comment line holding the command that ran (``# command: ...``),
    then the header ``env_step,episode_return`` and one row per finished episode: the
    environment step at which it ended and its undiscounted return.

    Parameters
    ----------
    outdir : path
        The run's output folder (created if needed).
    env_steps : sequence of int
        For each finished episode, the number of environment steps taken when it ended.
    returns : sequence of float
        The episodes' returns, as many as ``env_steps``.

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        If ``env_steps`` and ``returns`` differ in length.
    """
    if len(env_steps) != len(returns):
        raise ValueError(
            f"env_steps and returns differ in length: {len(env_steps)} != {len(returns)}"
        )
    text = io.StringIO()
    command = shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    text.write(f"# command: python {command}\n{RETURNS_HEADER}\n")
    for step, ret in zip(env_steps, returns, strict=True):
        text.write(f"{int(step)},{float(ret):.6g}\n")
    path = Path(outdir) / RETURNS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # written next to its place, then renamed over it: a reader never sees half a file
    fd, temp = tempfile.mkstemp(prefix=f".{RETURNS_FILE}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    return path


def read_returns(path: Path | str) -> tuple[np.ndarray, np.ndarray]:
    """Read a file written by :func:`write_returns`.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        The environment steps (int64) and the episode returns (float64), one per episode.

    Raises
    ------
    ValueError
        If the file does not have the header ``env_step,episode_return``.
    """
    lines = [line for line in Path(path).read_text().splitlines() if not line.startswith("#")]
    if not lines or lines[0].strip() != RETURNS_HEADER:
        raise ValueError(f"{path} is not a returns file: no header {RETURNS_HEADER!r}")
    rows = [line.split(",") for line in lines[1:] if line.strip()]
    steps = np.array([int(row[0]) for row in rows], np.int64)
    returns = np.array([float(row[1]) for row in rows], np.float64)
    return steps, returns
