"""Offline data: fill any replay buffer from a Minari dataset, and write transitions as one."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import jax
import numpy as np

from coax_utils._minari import (
    Episode,
    check_episode,
    import_minari,
    read_episodes,
    select_episodes,
    space_spec,
)
from coax_utils.replay._functional import PrioritizedBuffer, UniformBuffer
from coax_utils.replay._host import PrioritizedReplayBuffer, SimpleReplayBuffer
from coax_utils.replay._seq_functional import PrioritizedSequenceBuffer, SequenceBuffer
from coax_utils.replay._seq_host import PrioritizedSequenceReplayBuffer, SequenceReplayBuffer
from coax_utils.replay._tracing import MonteCarlo
from coax_utils.replay._transition import TransitionBatch

__all__ = ["fill_from_minari", "save_as_minari"]


def _rows(tree: Any, index: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[index], tree)


def _one_step(ep: Episode) -> TransitionBatch:
    """The episode's 1-step transitions, as ``NStep(n=1, gamma=1.0)`` gives them.

    ``In`` is 0 after termination, else 1; after termination ``S_next``, ``A_next`` are
    placeholders (copies of ``S``, ``A``); after a truncation ``S_next`` is the real next
    state and ``A_next`` repeats ``A`` (the action there was never taken).
    """
    steps = len(ep.rewards)
    t = np.arange(steps)
    nxt = np.minimum(t + 1, steps - 1)
    last_terminal = bool(ep.terminations[-1])
    s_next_rows = t + 1
    if last_terminal:
        s_next_rows = s_next_rows.copy()
        s_next_rows[-1] = steps - 1
    nxt[-1] = steps - 1
    zeros = np.zeros(steps, np.float32)
    return TransitionBatch(
        S=_rows(ep.observations, t),
        A=_rows(ep.actions, t),
        logP=zeros,
        Rn=ep.rewards.copy(),
        In=(~ep.terminations).astype(np.float32),
        S_next=_rows(ep.observations, s_next_rows),
        A_next=_rows(ep.actions, nxt),
        logP_next=zeros.copy(),
        W=np.ones(steps, np.float32),
    )


def _traced(ep: Episode, tracer: Any) -> TransitionBatch:
    """The episode's transitions through ``tracer`` (a fresh trace), in time order."""
    tracer.reset()
    steps = len(ep.rewards)
    for t in range(steps):
        tracer.add(
            _rows(ep.observations, t),
            _rows(ep.actions, t),
            float(ep.rewards[t]),
            bool(ep.terminations[t]),
            truncated=bool(ep.truncations[t]),
            s_next=_rows(ep.observations, t + 1) if t == steps - 1 else None,
        )
    batches = []
    while tracer:
        batches.append(tracer.pop())
    batch = TransitionBatch.concatenate(*batches)
    return batch[::-1] if isinstance(tracer, MonteCarlo) else batch


def _check_tracer(tracer: Any) -> Any:
    if tracer is None:
        return None
    for method in ("add", "pop", "reset"):
        if not callable(getattr(tracer, method, None)):
            raise TypeError(f"tracer must have an {method!r} method (e.g. NStep), got {tracer!r}")
    return copy.deepcopy(tracer)


def fill_from_minari(
    dataset: Any,
    buffer: Any,
    state: Any = None,
    *,
    tracer: Any = None,
    episodes: Any = None,
    max_transitions: int | None = None,
    check_finite: bool = False,
    progress: bool = False,
) -> Any:
    r"""Fill a replay buffer with the transitions of a Minari dataset.

    Episodes are read in order (all of them, or ``episodes``) and turned into transitions,
    either plain 1-step ones (no ``tracer``: exactly what ``NStep(n=1, gamma=1.0)``, the
    default of :class:`RecordTransitions`, gives) or through ``tracer`` (:class:`NStep`,
    :class:`MonteCarlo`). Terminations and truncations stay distinct: a terminated step gets
    ``In = 0``; a truncated last step (a time limit, or the end of the data) keeps
    bootstrapping from its real next observation. An episode cut by ``max_transitions`` ends
    truncated. Observations and actions are mapped as the env bridge maps the dataset's
    spaces (:func:`coax_utils.envs.to_jax_space`): Dict values become dicts, Tuple values
    tuples, Box/Discrete/MultiDiscrete/MultiBinary values arrays of the dtype JAX uses (an
    int64 Discrete action is stored as int32 without ``jax_enable_x64``).

    Every episode is read and checked before the buffer is touched, and all transitions go
    in through the buffer's batch API in one call (a sequence buffer, whose API takes one
    step at a time, refuses a mismatch at the first step), so a refused dataset leaves the
    buffer exactly as it was. Host buffers
    get ``episode_end`` marks, so their :meth:`~SimpleReplayBuffer.sample_sequences` windows
    never cross an episode. If the dataset holds more transitions than the buffer's capacity,
    the newest ones are kept, as with any add.

    Parameters
    ----------
    dataset : minari.MinariDataset
        The dataset (e.g. from :func:`minari.load_dataset`).
    buffer : replay buffer
        A host buffer (:class:`SimpleReplayBuffer`, :class:`PrioritizedReplayBuffer`, the
        frame-stacked ones; a :class:`SequenceReplayBuffer` or
        :class:`PrioritizedSequenceReplayBuffer` with ``num_envs=1`` gets the steps, as dicts
        with the keys ``obs``, ``action``, ``reward``, ``next_obs`` that
        :class:`RecordVectorSequences` uses, and no tracer), a jittable one (the containers
        of :func:`make_uniform_buffer`, :func:`make_prioritized_buffer`,
        :func:`make_frame_stack_buffer`, :func:`make_prioritized_frame_stack_buffer`, and
        with ``num_envs=1`` :func:`make_sequence_buffer`,
        :func:`make_prioritized_sequence_buffer`, whose steps go in through one jitted scan
        of their ``add``), or anything with
        ``add(transition_batch)``.
    state : buffer state, optional
        For a jittable buffer: the state to add to (default: ``buffer.init`` of the first
        transition). Ignored by host buffers.
    tracer : NStep or MonteCarlo, optional
        The reward tracer. A copy is used: the tracer given is not changed.
    episodes : sequence of int, optional
        The ids of the episodes to read, in this order (default: all, in the dataset's
        order).
    max_transitions : int, optional
        Stop after this many steps (the last episode read is cut there).
    check_finite : bool
        Also refuse NaN or infinite rewards, float observations and float actions.
    progress : bool
        Show a progress bar (tqdm, on stderr) over the steps read.

    Returns
    -------
    state or None
        The new state for a jittable buffer; None for the others (filled in place).

    Raises
    ------
    ImportError
        Without minari (``pip install coax_utils[offline]``).
    TypeError
        If ``dataset`` is not a Minari dataset, a space has no fixed-shape array form, or
        ``buffer`` has no ``add``.
    ValueError
        If an episode does not fit the dataset's spaces (a mismatched length, shape or
        structure, an end flag before the last step, a value the dtype cannot hold, a NaN
        reward under ``check_finite``): the message names the episode and the field. If
        the transitions do not fit what the buffer already holds, the message names the
        first episode. The buffer is unchanged either way.

    Examples
    --------
    .. code-block:: python

        import minari
        from coax_utils.replay import NStep, PrioritizedReplayBuffer, fill_from_minari

        dataset = minari.load_dataset("local/cartpole/random-v0")
        buffer = PrioritizedReplayBuffer(capacity=100_000)
        fill_from_minari(dataset, buffer, tracer=NStep(n=3, gamma=0.99), progress=True)
    """
    import_minari()
    from tqdm import tqdm  # a progress bar only here: importing coax_utils stays light

    if not callable(getattr(buffer, "add", None)):
        raise TypeError(f"buffer must have an 'add' method, got {buffer!r:.80}")
    ids, limit = select_episodes(dataset, episodes, max_transitions)
    tracer = _check_tracer(tracer)
    sequences = isinstance(
        buffer,
        (
            SequenceReplayBuffer,
            PrioritizedSequenceReplayBuffer,
            SequenceBuffer,
            PrioritizedSequenceBuffer,
        ),
    )
    if sequences and (tracer is not None or buffer.num_envs != 1):
        raise ValueError(
            "a sequence buffer stores steps, not traced transitions: fill one with "
            f"num_envs=1 and no tracer (got num_envs={buffer.num_envs}, tracer={tracer!r})"
        )
    batches, ends, first, read = [], [], None, []
    with tqdm(
        total=limit or dataset.total_steps,
        disable=not progress,
        unit="step",
        desc="minari",
    ) as bar:
        for ep in read_episodes(dataset, ids, limit, check_finite):
            if first is None:
                first = ep.id
            if sequences:
                read.append(ep)
                bar.update(len(ep.rewards))
                continue
            batch = _one_step(ep) if tracer is None else _traced(ep, tracer)
            batches.append(batch)
            end = np.zeros(batch.batch_size, bool)
            end[-1] = True
            ends.append(end)
            bar.update(len(ep.rewards))
    try:
        if isinstance(buffer, (SequenceBuffer, PrioritizedSequenceBuffer)):
            return _scan_steps(buffer, state, read)
        if sequences:
            return _add_steps(buffer, read)
        batch = TransitionBatch.concatenate(*batches)
        return _add(buffer, state, batch, np.concatenate(ends))
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"the transitions of the dataset {dataset.id!r} do not fit the buffer (first "
            f"episode read: {first}): {exc}"
        ) from exc


def _add_steps(buffer: Any, episodes: list[Episode]) -> None:
    """Feed a sequence buffer one step at a time (its API), as one sub-env.

    Steps are dicts with the keys :class:`RecordVectorSequences` uses: ``obs``, ``action``,
    ``reward`` and ``next_obs``. A mismatch is refused by the first add, before any write.
    """
    for ep in episodes:
        for t in range(len(ep.rewards)):
            steps = {
                "obs": _rows(ep.observations, slice(t, t + 1)),
                "action": _rows(ep.actions, slice(t, t + 1)),
                "reward": ep.rewards[t : t + 1],
                "next_obs": _rows(ep.observations, slice(t + 1, t + 2)),
            }
            buffer.add(
                steps,
                terminated=ep.terminations[t : t + 1],
                truncated=ep.truncations[t : t + 1],
            )


def _scan_steps(buffer: Any, state: Any, episodes: list[Episode]) -> Any:
    """Feed a jittable sequence buffer every step, one ``add`` per step in one jitted scan."""

    def cat(trees: list) -> Any:
        return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *trees)

    steps = {
        "obs": cat([_rows(ep.observations, slice(0, -1)) for ep in episodes]),
        "action": cat([ep.actions for ep in episodes]),
        "reward": np.concatenate([ep.rewards for ep in episodes]),
        "next_obs": cat([_rows(ep.observations, slice(1, None)) for ep in episodes]),
    }
    flags = tuple(
        np.concatenate([getattr(ep, name) for ep in episodes])
        for name in ("terminations", "truncations")
    )
    if state is None:
        state = buffer.init(_rows(steps, 0))

    def body(state: Any, xs: tuple) -> tuple:
        step, terminated, truncated = xs
        one = _rows(step, None)  # a leading sub-env axis of 1
        return buffer.add(state, one, terminated=terminated[None], truncated=truncated[None]), None

    return jax.jit(lambda state, xs: jax.lax.scan(body, state, xs)[0])(state, (steps, *flags))


def _add(buffer: Any, state: Any, batch: TransitionBatch, episode_end: np.ndarray) -> Any:
    if isinstance(buffer, (SimpleReplayBuffer, PrioritizedReplayBuffer)):
        buffer.add(batch, episode_end=episode_end)
        return None
    init = getattr(buffer, "init", None)
    if not callable(init):  # anything else with add(transition_batch)
        buffer.add(batch)
        return None
    capacity = int(buffer.capacity)
    n = batch.batch_size
    if n > capacity:  # a ring keeps the newest rows anyway
        batch, episode_end, n = batch[n - capacity :], episode_end[n - capacity :], capacity
    items = jax.tree_util.tree_map(np.asarray, batch)
    if state is None:
        state = init(_rows(items, 0))
    if isinstance(buffer, (UniformBuffer, PrioritizedBuffer)):
        return buffer.add(state, items, episode_end)
    return buffer.add(state, items)


def _episodes_of(batch: TransitionBatch, episode_end: Any) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` rows of each episode of a time-ordered 1-step batch."""
    n = batch.batch_size
    if episode_end is None and n == 1:
        return [(0, 1)]
    if episode_end is None:
        same = jax.tree_util.tree_map(
            lambda a, b: np.all((a[:-1] == b[1:]).reshape(n - 1, -1), axis=1),
            batch.S_next,
            batch.S,
        )
        continues = np.logical_and.reduce(jax.tree_util.tree_leaves(same) or [np.ones(n - 1)])
        ends = np.append(~continues | (np.asarray(batch.In[:-1]) == 0), True)
    else:
        ends = np.asarray(episode_end, bool).reshape(-1)
        if ends.shape != (n,):
            raise ValueError(f"episode_end must hold one bool per transition ({n})")
        ends = ends.copy()
        ends[-1] = True
    stops = np.flatnonzero(ends) + 1
    return list(zip(np.concatenate([[0], stops[:-1]]).tolist(), stops.tolist()))


def save_as_minari(
    dataset_id: str,
    transitions: Any,
    observation_space: Any,
    action_space: Any,
    *,
    episode_end: Any = None,
    env: Any = None,
    data_format: str | None = None,
    **metadata: Any,
) -> Any:
    """Write 1-step transitions (as :class:`RecordTransitions` records them) as a Minari
    dataset that :func:`minari.load_dataset` loads.

    ``transitions`` must be in time order, one episode after the other: a
    :class:`TransitionBatch`, a host buffer (read oldest first), or a list of them, each a
    separate stream (e.g. one buffer per sub-env of a :class:`RecordVectorTransitions`
    recording, whose sub-envs' transitions are interleaved otherwise). Episodes end where
    ``episode_end`` is True, else where ``In`` is 0 (termination) or ``S_next`` is not the
    next row's ``S`` (truncation; the end of each stream counts as one). A transition with
    ``In = 0`` is written as a termination, an episode's last one otherwise as a truncation;
    rewards are ``Rn``. The observation after a termination is the ``S_next`` placeholder
    the tracers store (a copy of ``S``: the recorder does not keep terminal states, whose
    value no target uses).

    Parameters
    ----------
    dataset_id : str
        The Minari id, e.g. ``"local/cartpole/random-v0"``; written under Minari's data root
        (``MINARI_DATASETS_PATH`` or ``~/.minari/datasets``). An existing id is refused.
    transitions : TransitionBatch, host buffer, or list of them
        1-step transitions (``NStep(n=1, ...)``).
    observation_space, action_space : gymnasium.Space
        The spaces of the recorded env.
    episode_end : array of bool, optional
        One flag per transition (a single stream only).
    env : str, gymnasium.Env or EnvSpec, optional
        The env, stored in the dataset's metadata (:meth:`recover_environment`).
    data_format : {"hdf5", "arrow"}, optional
        Minari's storage format (default: Minari's default).
    **metadata
        Passed on to :func:`minari.create_dataset_from_buffers` (``algorithm_name``,
        ``author``, ``description``, ...).

    Returns
    -------
    minari.MinariDataset

    Raises
    ------
    ValueError
        If a transition does not fit the spaces (naming the episode and the field), or the
        dataset id exists. Nothing is written then.
    """
    minari = import_minari()
    from minari.data_collector import EpisodeBuffer

    obs_spec = space_spec(observation_space, "observation")
    act_spec = space_spec(action_space, "action")
    from minari.storage import get_dataset_path

    path = get_dataset_path(dataset_id)
    if os.path.exists(path):
        raise ValueError(f"a Minari dataset {dataset_id!r} exists already ({path})")
    streams = transitions if isinstance(transitions, (list, tuple)) else [transitions]
    if episode_end is not None and len(streams) != 1:
        raise ValueError("episode_end applies to a single stream of transitions")
    episodes = []
    for stream in streams:
        if isinstance(stream, (SimpleReplayBuffer, PrioritizedReplayBuffer)):
            stream = TransitionBatch.concatenate(*stream) if len(stream) else None
        if stream is None:
            continue
        if not isinstance(stream, TransitionBatch):
            raise TypeError(
                f"transitions must be TransitionBatches or host buffers, got {stream!r:.80}"
            )
        batch = jax.tree_util.tree_map(np.asarray, stream)
        for start, stop in _episodes_of(batch, episode_end):
            rows = np.arange(start, stop)
            obs = jax.tree_util.tree_map(
                lambda s, s_next, rows=rows, stop=stop: np.concatenate(
                    [s[rows], s_next[stop - 1 : stop]]
                ),
                batch.S,
                batch.S_next,
            )
            terminated = np.asarray(batch.In[rows]) == 0
            truncated = np.zeros(len(rows), bool)
            truncated[-1] = not terminated[-1]
            episodes.append(
                EpisodeBuffer(
                    id=len(episodes),
                    observations=obs,
                    actions=_rows(batch.A, rows),
                    rewards=np.asarray(batch.Rn[rows], np.float64),
                    terminations=terminated,
                    truncations=truncated,
                )
            )
    if not episodes:
        raise ValueError("transitions holds no transition: nothing to write")
    for ep in episodes:  # the same checks as reading, before anything is written
        check_episode(ep, obs_spec, act_spec, False)
    kwargs = {} if data_format is None else {"data_format": data_format}
    try:
        return minari.create_dataset_from_buffers(
            dataset_id,
            episodes,
            env=env,
            observation_space=observation_space,
            action_space=action_space,
            **kwargs,
            **metadata,
        )
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # no half-written dataset left behind
        raise
