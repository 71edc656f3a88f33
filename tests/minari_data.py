"""Small Minari datasets made locally with Minari's DataCollector on real gymnasium envs.

Every step the env takes is also kept in a list (``steps``), the oracle the tests compare
with. The datasets go under ``MINARI_DATASETS_PATH``, which the ``minari_root`` fixtures
point at a tmp_path: nothing is written into the home directory, nothing is downloaded.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import gymnasium
import numpy as np


class DictObservation(gymnasium.ObservationWrapper):
    """CartPole with Dict observations: {"position": (x, theta), "velocity": (...)}."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        box = gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.observation_space = gymnasium.spaces.Dict({"position": box, "velocity": box})

    def observation(self, obs: Any) -> dict:
        obs = np.asarray(obs, np.float32)
        return {"position": obs[[0, 2]], "velocity": obs[[1, 3]]}


def collect(
    env: gymnasium.Env,
    dataset_id: str,
    episodes: int,
    seed: int = 0,
    wrap: Any = None,
) -> tuple[Any, list[dict]]:
    """Run ``episodes`` random episodes through a DataCollector; return (dataset, steps).

    ``wrap(env)`` (e.g. a RecordTransitions) is applied inside the collector, so it sees the
    very steps the dataset stores.
    """
    import minari

    inner = env if wrap is None else wrap(env)
    collector = minari.DataCollector(inner)
    collector.action_space.seed(seed)
    steps: list[dict] = []
    for e in range(episodes):
        obs, _ = collector.reset(seed=seed + e)
        done = False
        while not done:
            action = collector.action_space.sample()
            nxt, reward, term, trunc, _ = collector.step(action)
            steps.append(
                dict(
                    obs=obs,
                    action=action,
                    reward=reward,
                    terminated=term,
                    truncated=trunc,
                    next_obs=nxt,
                    episode=e,
                )
            )
            obs, done = nxt, term or trunc
    # Minari's collector removes its temporary folders without closing their
    # TemporaryDirectory objects, whose finalizers then warn (ResourceWarning) when collected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        dataset = collector.create_dataset(
            dataset_id,
            algorithm_name="random",
            author="coax_utils tests",
            author_email="tests@example.org",
            code_permalink="https://example.org/coax_utils",
            description="random actions",
            eval_env=env.spec,
        )
        collector.close()
        del collector, inner
        gc.collect()
    return dataset, steps
