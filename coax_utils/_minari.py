"""Reading Minari datasets: the one place that turns a Minari episode into checked arrays.

Minari (extra ``offline``) is imported only by :func:`import_minari`, inside the functions
that need it. Spaces are mapped as the env bridge maps them (``envs.to_jax_space``): Dict
observations become dicts, Tuple ones tuples, Box, Discrete, MultiDiscrete and MultiBinary
values arrays of the dtype JAX uses for the space's dtype (int64 becomes int32 without
``jax_enable_x64``; MultiBinary is int8).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any, NamedTuple

import gymnasium
import jax
import numpy as np

__all__ = [
    "Episode",
    "check_episode",
    "import_minari",
    "read_episodes",
    "select_episodes",
    "space_spec",
]

_SUPPORTED = "Box, Discrete, MultiDiscrete, MultiBinary, Tuple and Dict"


def import_minari() -> Any:
    """The ``minari`` module, or ImportError naming the extra that installs it."""
    try:
        import minari
    except ImportError as exc:
        raise ImportError(
            "reading and writing Minari datasets needs minari: pip install coax_utils[offline]"
        ) from exc
    return minari


def _canonical(dtype: Any) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def space_spec(space: Any, what: str) -> Any:
    """The pytree of :class:`jax.ShapeDtypeStruct` of one value of a gymnasium ``space``.

    The same structure, shapes and dtypes as ``envs.to_jax_space(space).shape_dtype()``.
    Raises TypeError naming ``what`` for a space without a fixed-shape array form.
    """
    s = gymnasium.spaces
    if isinstance(space, s.Dict):
        return {k: space_spec(sub, f"{what}[{k!r}]") for k, sub in space.spaces.items()}
    if isinstance(space, s.Tuple):
        return tuple(space_spec(sub, f"{what}[{i}]") for i, sub in enumerate(space.spaces))
    if isinstance(space, s.MultiBinary):
        return jax.ShapeDtypeStruct(tuple(space.shape), np.dtype(np.int8))
    if isinstance(space, (s.Box, s.Discrete, s.MultiDiscrete)):
        return jax.ShapeDtypeStruct(tuple(space.shape), _canonical(space.dtype))
    raise TypeError(
        f"the dataset's {what} space {space!r} has no fixed-shape array form; supported "
        f"spaces are {_SUPPORTED}"
    )


class Episode(NamedTuple):
    """One checked episode of ``T`` steps.

    ``observations`` has ``T + 1`` rows per leaf (the last one follows the last step),
    ``actions`` ``T``; ``rewards`` is float32, the flags bool, all of length ``T``. An episode
    whose last step carries neither flag (the data stopped there, or was cut at a transition
    limit) is marked truncated: its last transition bootstraps from the real next state.
    """

    id: int
    observations: Any
    actions: Any
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray


def _fit(values: Any, spec: jax.ShapeDtypeStruct, rows: int, where: str) -> np.ndarray:
    """``values`` as an array of ``rows`` rows shaped and typed as ``spec``, or ValueError."""
    x = np.asarray(values)
    want = (rows, *spec.shape)
    if x.shape != want:
        raise ValueError(f"{where} has shape {x.shape}, expected {want}")
    dtype = np.dtype(spec.dtype)
    if x.dtype == dtype:
        return x
    if x.dtype.kind not in "biuf":
        raise ValueError(f"{where} has dtype {x.dtype}, expected numbers ({dtype.name})")
    if dtype.kind in "iu" and x.size:
        if x.dtype.kind == "f" and not np.array_equal(x, np.round(x)):
            raise ValueError(f"{where} holds non-integer values, expected {dtype.name}")
        info = np.iinfo(dtype)
        low, high = x.min(), x.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise ValueError(f"{where} holds {bad}, which does not fit {dtype.name}")
    return x.astype(dtype)


def _fit_tree(values: Any, spec: Any, rows: int, where: str) -> Any:
    spec_leaves, treedef = jax.tree_util.tree_flatten(spec)
    try:
        leaves = treedef.flatten_up_to(values)
    except (ValueError, TypeError, KeyError) as exc:
        got = jax.tree_util.tree_structure(values)
        raise ValueError(f"{where} has the structure {got}, expected {treedef}") from exc
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(spec)]
    fitted = [
        _fit(leaf, s, rows, f"{where}{path}") for leaf, s, path in zip(leaves, spec_leaves, paths)
    ]
    return jax.tree_util.tree_unflatten(treedef, fitted)


def _check_finite(tree: Any, where: str) -> None:
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if x.dtype.kind == "f" and not np.all(np.isfinite(x)):
            step = int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])
            raise ValueError(f"{where}{jax.tree_util.keystr(path)} is not finite at step {step}")


def _flags(values: Any, rows: int, where: str) -> np.ndarray:
    x = np.asarray(values)
    if x.shape != (rows,):
        raise ValueError(f"{where} has shape {x.shape}, expected ({rows},)")
    if x.dtype != np.bool_:
        if x.dtype.kind not in "biu" or (x.size and not np.isin(x, (0, 1)).all()):
            raise ValueError(f"{where} must hold bools, got dtype {x.dtype}")
        x = x.astype(bool)
    return x


def check_episode(
    episode: Any, obs_spec: Any, act_spec: Any, check_finite: bool, limit: int | None = None
) -> Episode:
    """Check and convert a Minari ``EpisodeData``; errors name the episode and the field.

    ``limit`` keeps only the first ``limit`` steps (the cut episode ends truncated).
    """
    where = f"episode {episode.id}: "
    rewards = np.asarray(episode.rewards)
    if rewards.ndim != 1:
        raise ValueError(f"{where}rewards has shape {rewards.shape}, expected one per step")
    steps = len(rewards)
    if steps == 0:
        raise ValueError(f"{where}rewards is empty: an episode needs at least one step")
    if rewards.dtype.kind not in "biuf":
        raise ValueError(f"{where}rewards has dtype {rewards.dtype}, expected numbers")
    obs = _fit_tree(episode.observations, obs_spec, steps + 1, f"{where}observations")
    actions = _fit_tree(episode.actions, act_spec, steps, f"{where}actions")
    terminations = _flags(episode.terminations, steps, f"{where}terminations")
    truncations = _flags(episode.truncations, steps, f"{where}truncations")
    ends = np.flatnonzero(terminations[:-1] | truncations[:-1])
    if ends.size:
        name = "terminations" if terminations[ends[0]] else "truncations"
        raise ValueError(
            f"{where}{name} marks step {int(ends[0])} of {steps} as the end of the episode"
        )
    with np.errstate(over="ignore"):
        rewards32 = rewards.astype(np.float32)
    if check_finite:
        bad = np.flatnonzero(~np.isfinite(rewards32))
        if bad.size:
            raise ValueError(
                f"{where}rewards is not finite (as float32) at step {int(bad[0])}: "
                f"{rewards[bad[0]]!r}"
            )
        _check_finite(obs, f"{where}observations")
        _check_finite(actions, f"{where}actions")
    if limit is not None and limit < steps:
        cut = lambda tree, n: jax.tree_util.tree_map(lambda x: x[:n], tree)  # noqa: E731
        obs, actions, steps = cut(obs, limit + 1), cut(actions, limit), limit
        rewards32, terminations = rewards32[:limit], terminations[:limit]
        truncations = truncations[:limit]
    truncations = truncations.copy()
    truncations[-1] = not terminations[-1]
    return Episode(int(episode.id), obs, actions, rewards32, terminations, truncations)


def select_episodes(dataset: Any, episodes: Any, max_transitions: Any) -> tuple[list[int], Any]:
    """The episode ids to read (in order) and the checked transition limit (or None)."""
    if not hasattr(dataset, "iterate_episodes") or not hasattr(dataset, "episode_indices"):
        raise TypeError(f"dataset must be a minari.MinariDataset, got {dataset!r:.80}")
    available = [int(i) for i in np.asarray(dataset.episode_indices).reshape(-1)]
    if episodes is None:
        ids = available
    else:
        if isinstance(episodes, (str, bytes)) or not hasattr(episodes, "__iter__"):
            raise TypeError(f"episodes must be a sequence of episode ids, got {episodes!r:.80}")
        known = set(available)
        ids = []
        for e in episodes:
            if isinstance(e, (bool, np.bool_)):
                raise TypeError(f"episodes must hold ints, got {e!r}")
            try:
                i = operator.index(e)
            except TypeError:
                raise TypeError(f"episodes must hold ints, got {e!r}") from None
            if i not in known:
                raise ValueError(f"episode {i} is not in the dataset {dataset.id!r}")
            ids.append(i)
        if not ids:
            raise ValueError("episodes is empty: select at least one episode")
    if max_transitions is not None:
        if isinstance(max_transitions, bool) or not isinstance(max_transitions, (int, np.integer)):
            raise TypeError(f"max_transitions must be a positive int, got {max_transitions!r}")
        if max_transitions < 1:
            raise ValueError(f"max_transitions must be a positive int, got {max_transitions}")
        max_transitions = int(max_transitions)
    return ids, max_transitions


def read_episodes(
    dataset: Any,
    ids: list[int],
    max_transitions: int | None = None,
    check_finite: bool = False,
) -> Iterator[Episode]:
    """Checked episodes of ``dataset`` in the order of ``ids``, up to ``max_transitions``."""
    obs_spec = space_spec(dataset.observation_space, "observation")
    act_spec = space_spec(dataset.action_space, "action")
    left = max_transitions
    for episode in dataset.iterate_episodes(ids):
        ep = check_episode(episode, obs_spec, act_spec, check_finite, left)
        yield ep
        if left is not None:
            left -= len(ep.rewards)
            if left <= 0:
                return
