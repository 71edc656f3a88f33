"""Dummy transitions drawn from an environment's spaces (coax's ``get_transition_batch``).

It lives in :mod:`coax_utils.replay` because it builds a :class:`TransitionBatch`;
:mod:`coax_utils.utils` re-exports it lazily (coax's name), so importing ``utils`` never
imports ``replay``.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import jax
import numpy as np

from coax_utils._checks import check_float, check_int, check_seed
from coax_utils.replay._transition import TransitionBatch
from coax_utils.utils import safe_sample

__all__ = ["get_transition_batch"]


def get_transition_batch(
    env: Any, batch_size: int = 1, gamma: float = 0.9, random_seed: int | None = None
) -> TransitionBatch:
    """Generate a batch of dummy transitions from an environment's spaces.

    The env is not stepped: states and actions are drawn from ``env.observation_space`` and
    ``env.action_space`` with :func:`coax_utils.utils.safe_sample`, rewards from a clipped
    standard normal, log-propensities from the log of a uniform in :math:`[0.01, 0.99]`,
    bootstrap factors ``In`` from :math:`\\{0, \\gamma\\}` and weights ``W`` from a clipped
    ratio of uniforms. It is meant for initializing function approximators and for tests.

    Parameters
    ----------
    env : gymnasium environment
        A gymnasium-style environment.
    batch_size : positive int, optional
        The desired batch size of the sample.
    gamma : float between 0 and 1, optional
        The discount factor used for ``In``.
    random_seed : int, optional
        In order to generate the transition, we do some random sampling from the provided
        spaces. This ``random_seed`` sets the seed for the pseudo-random number generators.
        It must be a non-negative int (a bool raises TypeError).

    Returns
    -------
    transition_batch : TransitionBatch
        A batch of transitions (NumPy leaves with a leading batch axis).

    Examples
    --------
    >>> import gymnasium
    >>> tb = get_transition_batch(gymnasium.make("CartPole-v1"), batch_size=4, random_seed=0)
    >>> tb.batch_size, tb.S.shape, tb.A.shape, tb.In.dtype
    (4, (4, 4), (4,), dtype('float32'))
    """
    n = check_int(batch_size, "batch_size", low=1)
    gamma = check_float(gamma, "gamma", low=0, high=1)
    for attr in ("observation_space", "action_space"):
        if not isinstance(getattr(env, attr, None), gymnasium.Space):
            raise TypeError(f"env must have a gymnasium {attr}, got {env!r}")

    rng = np.random.default_rng(check_seed(random_seed))

    def batch_sample(space: gymnasium.Space) -> Any:
        xs = [safe_sample(space, rng) for _ in range(n)]
        return jax.tree_util.tree_map(lambda *leaves: np.stack(leaves, axis=0), *xs)

    def logp() -> np.ndarray:
        return np.log(np.clip(rng.random(n), 0.01, 0.99)).astype(np.float32)

    return TransitionBatch(
        S=batch_sample(env.observation_space),
        A=batch_sample(env.action_space),
        logP=logp(),
        Rn=np.clip(rng.standard_normal(n), -5.0, 5.0).astype(np.float32),
        In=rng.choice(np.array([0.0, gamma], np.float32), n),
        S_next=batch_sample(env.observation_space),
        A_next=batch_sample(env.action_space),
        logP_next=logp(),
        W=np.clip(rng.random(n) / rng.random(n), 0.01, 100.0).astype(np.float32),
    )
