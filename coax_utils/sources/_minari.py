"""MinariSource: the transitions of a Minari dataset streamed into jitted loops."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from coax_utils._dataclass import pytree_dataclass
from coax_utils._minari import import_minari, read_episodes, select_episodes, space_spec
from coax_utils._rows import RowLayout
from coax_utils.sources._base import (
    CompiledNext,
    PyTree,
    check_ordering,
    check_positive_int,
    check_restored,
)

__all__ = ["MinariSource", "MinariSourceState", "permuted"]


@pytree_dataclass
class MinariSourceState:
    """State of a :class:`MinariSource`.

    Attributes
    ----------
    key : jax.Array
        The PRNG key given to ``init_state``; with ``epoch`` it seeds each epoch's order.
    epoch : jax.Array
        int32 scalar: number of completed epochs.
    position : jax.Array
        int32 scalar: how many batches of the current epoch have been emitted.
    buffer : jax.Array
        uint32, shape ``(prefetch, batch_size, width)`` (``(prefetch, batch_size, window,
        width)`` for windows): the prefetched batches, each step (observation, action,
        reward, flags, next observation and mask) packed into a row of words.
    buffer_start : jax.Array
        int32 scalar: the batch position of ``buffer[0]``; -1 when the buffer holds nothing
        of the current epoch.
    """

    key: jax.Array
    epoch: jax.Array
    position: jax.Array
    buffer: jax.Array
    buffer_start: jax.Array

    def __checkpoint_check__(self) -> None:
        """Raise ValueError unless this (restored) state is one its source can produce."""
        check_restored(self, ("position", "epoch"), buffer_start=True)
        buffer = self.buffer
        if not isinstance(buffer, (np.ndarray, jax.Array)) or buffer.dtype != np.uint32:
            raise ValueError("MinariSourceState.buffer must be a uint32 array")
        if buffer.ndim not in (3, 4):
            raise ValueError(f"MinariSourceState.buffer has {buffer.ndim} axes, not 3 or 4")


_ROUNDS = 4  # of the Feistel network of :func:`permuted`
_MASK = RowLayout.of(jax.ShapeDtypeStruct((), np.dtype(np.bool_)))  # a step mask's word


def permuted(key: jax.Array, positions: jax.Array, n: int) -> jax.Array:
    """The images of ``positions`` (int32, in ``[0, n)``) under a pseudo-random permutation
    of ``[0, n)`` drawn from ``key``: each position computed on its own, in O(1).

    Holding an epoch's permutation in a loop's state instead costs a copy of all of it on
    every step on XLA:CPU (a conditional that redraws it at the epoch's start cannot update
    it in place). Here a 4-round balanced Feistel network, whose round keys are drawn from
    ``key``, permutes the ``2 ** bits`` values of the smallest even ``bits`` that covers
    ``n`` (fewer than ``4 n``), and cycle-walking maps the images at or beyond ``n`` back
    into ``[0, n)`` (a walk ends: the cycle of a position holds that position).
    """
    bits = max(2, (n - 1).bit_length())
    half = (bits + bits % 2) // 2
    low = jnp.uint32((1 << half) - 1)
    keys = jax.random.bits(key, (_ROUNDS,), jnp.uint32)

    def feistel(x: jax.Array) -> jax.Array:
        left, right = x >> half, x & low
        for r in range(_ROUNDS):
            h = (right ^ keys[r]) * jnp.uint32(0x9E3779B1)  # a murmur-style mix
            h = (h ^ (h >> 15)) * jnp.uint32(0x85EBCA6B)
            h = h ^ (h >> 13)
            left, right = right, (left ^ h) & low
        return (left << half) | right

    x = feistel(positions.astype(jnp.uint32))
    x = jax.lax.while_loop(lambda x: jnp.any(x >= n), lambda x: jnp.where(x >= n, feistel(x), x), x)
    return x.astype(jnp.int32)


class _Chunk:
    """The transitions of consecutive episodes as flat NumPy arrays, read on the host; or,
    after :meth:`to_device`, one table of words on the device that :meth:`gather` reads inside
    compiled code."""

    def __init__(self, episodes: list) -> None:
        def cat(trees: list) -> Any:
            return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *trees)

        self.observations = cat([ep.observations for ep in episodes])
        # per transition: actions, rewards, terminations, truncations
        self.fields = (
            cat([ep.actions for ep in episodes]),
            np.concatenate([ep.rewards for ep in episodes]),
            np.concatenate([ep.terminations for ep in episodes]),
            np.concatenate([ep.truncations for ep in episodes]),
        )
        lengths = [len(ep.rewards) for ep in episodes]
        self.ends = np.cumsum(lengths) - 1  # the last transition of each episode
        # the episode of each transition (one read where a binary search in ``ends`` took
        # a dozen dependent ones)
        self.episode = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)

    def to_device(self) -> _Chunk:
        """Put the data on the default device as one table of words, a row per observation.

        Row ``o`` holds observation ``o`` followed by the fields of the transition that
        starts there (zeros on the last observation of an episode), so a transition read at
        random is one read of two adjacent rows, not one read per field: the gathers of a
        shuffled epoch are bound by the memory's latency (see ``coax_utils/_rows.py``). Two
        rows of zeros end the table: the rows a padding step reads.
        """
        n_obs = len(jax.tree_util.tree_leaves(self.observations)[0])
        starts = np.arange(len(self.fields[1]))  # the observation row of each transition
        starts += np.repeat(np.arange(len(self.ends)), np.diff(self.ends, prepend=-1))

        def per_row(x: np.ndarray) -> np.ndarray:  # a transition's field, on its first row
            out = np.zeros((n_obs, *x.shape[1:]), x.dtype)
            out[starts] = x
            return out

        rows = (self.observations, jax.tree_util.tree_map(per_row, self.fields))
        example = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), rows)
        self._layout = RowLayout.of(example)
        self._obs_layout = RowLayout.of(example[0])  # the first words of a row
        self.table = jnp.concatenate(
            [self._layout.pack(rows), jnp.zeros((2, self._layout.width), jnp.uint32)]
        )
        self.ends = jnp.asarray(self.ends.astype(np.int32))
        self.episode = jnp.asarray(self.episode)
        del self.observations, self.fields
        return self

    def _locate(self, rows: Any, window: int | None) -> tuple[Any, Any, Any]:
        """The observation rows and transitions of ``rows`` (or of the windows starting there)
        and their step masks; NumPy or traced ``rows`` alike."""
        xp = np if isinstance(rows, np.ndarray) else jnp
        episode = self.episode[rows]
        if window is None:  # single transitions: every step valid
            steps, mask = rows, xp.ones(rows.shape, bool)
        else:
            episode = episode[:, None]
            steps = rows[:, None] + xp.arange(window, dtype=rows.dtype)
            last = self.ends[episode]
            mask = steps <= last
            steps = xp.minimum(steps, last)
        return steps + episode, steps, mask  # each episode has one observation more

    def gather(self, rows: np.ndarray, window: int | None) -> tuple[tuple, np.ndarray]:
        """``(observation, (action, reward, terminated, truncated), next_observation)`` of
        the transitions at ``rows`` (or of the windows starting there), from the host arrays,
        and their step masks."""
        obs_rows, steps, mask = self._locate(rows, window)
        take = lambda tree, index: jax.tree_util.tree_map(lambda x: x[index], tree)  # noqa: E731
        observation, next_observation = (take(self.observations, obs_rows + i) for i in (0, 1))
        return (observation, take(self.fields, steps), next_observation), mask

    def gather_words(self, rows: jax.Array, valid: jax.Array, window: int | None) -> jax.Array:
        """The same from the table :meth:`to_device` made, as words: per step the row of the
        observation (with the transition's fields), the words of the next observation and
        the step mask, which is the layout ``MinariSource`` holds its batches in. Where
        ``valid`` is False (padding) every word is zero."""
        obs_rows, _, mask = self._locate(rows, window)
        if window is not None:
            valid = valid[:, None]
        obs_rows = jnp.where(valid, obs_rows, len(self.table) - 2)  # padding: the zero rows
        mask = mask & valid
        # one gather: rows o and o + 1 of each transition
        two = jax.vmap(lambda o: jax.lax.dynamic_slice_in_dim(self.table, o, 2))
        pairs = two(obs_rows.reshape(-1)).reshape(obs_rows.shape + (2, self._layout.width))
        next_obs = pairs[..., 1, : self._obs_layout.width]
        return jnp.concatenate([pairs[..., 0, :], next_obs, _MASK.pack(mask)], -1)


class MinariSource(CompiledNext):
    r"""Stream the transitions of a Minari dataset in batches, for jitted training loops.

    Each :meth:`next` emits a batch of ``batch_size`` transitions as a dict with the keys
    ``observation``, ``action``, ``reward``, ``next_observation``, ``terminated`` and
    ``truncated`` (leading axis ``batch_size``; spaces mapped as the env bridge maps them:
    Dict observations are dicts, Discrete actions int32, rewards float32). The flags are
    Minari's: a truncated step (a time limit, or the end of the data) has a real
    ``next_observation`` to bootstrap from; a terminated one does not. An epoch visits every
    transition exactly once (without replacement), ``ceil(transitions / batch_size)`` batches;
    the last batch is padded and its mask is False on the padding rows.

    With ``window=L`` each row is instead a window of ``L`` consecutive steps starting at the
    transition drawn (leaves of shape ``(batch_size, L, ...)``) and the mask has shape
    ``(batch_size, L)``: as in :class:`~coax_utils.replay.SequenceSample`, steps past the end
    of the window's episode are masked and repeat the episode's last step.

    Without ``chunk_steps`` (data that fit in memory), the whole selection is read once, at
    construction, into a table on the default device (a row of words per observation, with
    its transition's fields, and one int32 per transition: its episode), and :meth:`next`
    gathers there, in compiled code, the next ``prefetch`` batches at once into the state
    (a take by the epoch's permutation, whose entries are computed from the key and the
    epoch, so the state holds no order of its own) and the following calls read them from
    the state: a :func:`jax.lax.scan` over an epoch never leaves XLA and never waits on the
    host, and the fixed cost of a gather is paid once per ``prefetch`` batches. Each epoch is
    shuffled as one.

    Data larger than memory: with ``chunk_steps`` the episodes are grouped into chunks of
    consecutive episodes of about that many transitions, and only the chunks a prefetch
    touches are held in (host) memory (each chunk is read from the dataset when the epoch
    reaches it). Shuffling then draws the chunks in random order and shuffles the transitions
    within each chunk (a two-level shuffle: without it every batch would read the whole
    dataset). Data then reach the compiled loop through :func:`jax.experimental.io_callback`:
    one callback gathers the next ``prefetch`` batches at once on the host and the following
    calls read them from the state, so a :func:`jax.lax.scan` leaves XLA only once every
    ``prefetch`` steps; a background thread gathers (and reads) the following ``prefetch``
    batches while the loop computes.

    Parameters
    ----------
    dataset : minari.MinariDataset
        The dataset.
    batch_size : int
        Transitions (or windows) per batch.
    ordering : {"shuffle", "sequential"}
        ``"shuffle"``: a new order every epoch, a function of the state's key and the epoch
        number (the same key gives the same orders; in memory a pseudo-random permutation
        drawn from ``fold_in(key, epoch)``, each batch's part computed when it is gathered;
        with ``chunk_steps`` drawn on the host by NumPy from the key's bits and the epoch);
        ``"sequential"``: the episodes' order.
    window : int, optional
        Emit windows of this many steps instead of single transitions.
    episodes : sequence of int, optional
        The ids of the episodes to use (default: all).
    max_transitions : int, optional
        Use only the first this many steps (the last episode is cut there, truncated).
    chunk_steps : int, optional
        Hold about this many transitions in memory at a time (see above).
    prefetch : int, optional
        Batches gathered at once (per host callback with ``chunk_steps``) and held in the
        state, at most the batches of an epoch. Default: as many as fit in 4 MiB, at least
        1 and at most 64.
    check_finite : bool
        Refuse NaN or infinite rewards, observations or actions (naming the episode).

    Raises
    ------
    ImportError
        Without minari (``pip install coax_utils[offline]``).
    TypeError, ValueError
        For bad arguments, or an episode that does not fit the dataset's spaces (the
        message names the episode and the field).

    Examples
    --------
    .. code-block:: python

        source = MinariSource(minari.load_dataset("local/cartpole/random-v0"), 256)
        state = source.init_state(jax.random.key(0))

        def step(carry, _):
            params, state = carry
            batch, mask, state = source.next(state)
            params = update(params, batch, mask)  # rows where mask is False are padding
            return (params, state), None

        (params, state), _ = jax.lax.scan(step, (params, state), None, source.steps_per_epoch)
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        ordering: str = "shuffle",
        window: int | None = None,
        episodes: Any = None,
        max_transitions: int | None = None,
        chunk_steps: int | None = None,
        prefetch: int | None = None,
        check_finite: bool = False,
    ) -> None:
        import_minari()
        self._batch_size = check_positive_int("batch_size", batch_size)
        self._ordering = check_ordering(ordering)
        self._window = None if window is None else check_positive_int("window", window)
        if prefetch is not None:
            prefetch = check_positive_int("prefetch", prefetch)
        if chunk_steps is not None:
            chunk_steps = check_positive_int("chunk_steps", chunk_steps)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        self._check_finite = check_finite
        ids, limit = select_episodes(dataset, episodes, max_transitions)
        obs_spec = space_spec(dataset.observation_space, "observation")
        act_spec = space_spec(dataset.action_space, "action")
        self._dataset = dataset
        # one pass over the data: checks every episode and finds the chunks
        chunks: list[list[int]] = []  # the episode ids of each chunk
        lengths: list[int] = []
        held: list = []
        size = 0
        for ep in read_episodes(dataset, ids, limit, check_finite):
            steps = len(ep.rewards)
            if chunk_steps is not None and size and size + steps > chunk_steps:
                chunks.append([e.id for e in held])
                lengths.append(size)
                held, size = [], 0
            held.append(ep if chunk_steps is None else ep._replace(observations=None))
            size += steps
        chunks.append([e.id for e in held])
        lengths.append(size)
        self._chunk_ids = chunks
        self._memory: dict[int, _Chunk] = {}  # the chunks held on the host
        self._chunk_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._length = int(self._chunk_starts[-1])
        if self._length > np.iinfo(np.int32).max:
            raise ValueError(f"the selection holds {self._length} transitions, beyond int32")
        # data in memory: every transition on the device, gathered in compiled code
        self._device = None if chunk_steps is not None else _Chunk(held).to_device()
        del held
        self._steps_per_epoch = -(-self._length // self._batch_size)
        self._chunk_of = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        lead = (self._batch_size,) if window is None else (self._batch_size, self._window)

        def spec(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(lead + tuple(s.shape), s.dtype)

        scalar = lambda dtype: jax.ShapeDtypeStruct((), np.dtype(dtype))  # noqa: E731
        self._spec = jax.tree_util.tree_map(
            spec,
            {
                "observation": obs_spec,
                "action": act_spec,
                "reward": scalar(np.float32),
                "next_observation": obs_spec,
                "terminated": scalar(np.bool_),
                "truncated": scalar(np.bool_),
            },
        )
        # a step of the state's buffer, as words: the observation and the transition's
        # fields (the words of a device table's row), the next observation, the step mask
        fields = (act_spec, scalar(np.float32), scalar(np.bool_), scalar(np.bool_))
        step = (obs_spec, fields, obs_spec, scalar(np.bool_))
        self._rows = RowLayout.of(step)
        if prefetch is None:  # as many batches as fit in 4 MiB, 1 to 64
            words = self._batch_size * (self._window or 1) * self._rows.width
            prefetch = min(64, max(1, 2**20 // words))
        # batches a state holds: never more than an epoch's (the buffer restarts with each)
        self._prefetch = held = min(prefetch, self._steps_per_epoch)
        self._fetch_leaves, self._step_treedef = jax.tree_util.tree_flatten(
            jax.tree_util.tree_map(
                lambda s: jax.ShapeDtypeStruct((held, *lead, *s.shape), s.dtype), step
            )
        )
        self._buffer_shape = (held, *lead, self._rows.width)
        if self._device is not None:  # the table's words start a step's words
            table = self._device._layout.width + self._device._obs_layout.width
            assert table == self._rows.width - _MASK.width, (table, self._rows.width)
        self._epoch_order: tuple = (None, None)  # (key bits and epoch, order), on the host
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._ahead: tuple = (None, None)  # (what, future) of the refill prepared ahead
        self._lock = threading.Lock()

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``ceil(transitions / batch_size)``."""
        return self._steps_per_epoch

    @property
    def num_transitions(self) -> int:
        """The number of transitions (window starts) an epoch visits."""
        return self._length

    @property
    def batch_size(self) -> int:
        """Transitions (or windows) per batch."""
        return self._batch_size

    def element_spec(self) -> PyTree:
        """Pytree of :class:`jax.ShapeDtypeStruct` describing one batch."""
        return self._spec

    def _chunk(self, c: int) -> _Chunk:
        chunk = self._memory.get(c)
        if chunk is None:
            limit = int(self._chunk_starts[c + 1] - self._chunk_starts[c])  # a cut last episode
            ids = self._chunk_ids[c]
            episodes = list(read_episodes(self._dataset, ids, limit, self._check_finite))
            chunk = self._memory[c] = _Chunk(episodes)
        return chunk

    def _gather(self, indices: np.ndarray) -> list[np.ndarray]:
        """The steps at ``indices`` (-1: padding), stacked in batches: the leaves of the
        buffer's step (see ``__init__``)."""
        flat = np.asarray(indices).reshape(-1)
        valid = flat >= 0
        if np.any(flat >= self._length):
            raise ValueError(f"MinariSource: asked for a transition beyond the {self._length} held")
        index = np.where(valid, flat, 0)
        chunk_of = self._chunk_of[index]
        needed = np.unique(chunk_of[valid]) if valid.any() else np.zeros(1, np.int32)
        for c in list(self._memory):  # keep only what this prefetch reads
            if c not in needed:
                del self._memory[c]
        # padding rows hold zeros (their mask False), as in the other sources
        out = [np.zeros(s.shape, s.dtype) for s in self._fetch_leaves]
        flat_out = [x.reshape((len(flat), *x.shape[2:])) for x in out]
        for c in needed.tolist():
            rows = np.flatnonzero(valid & (chunk_of == c))
            local = index[rows] - self._chunk_starts[c]
            value, step_mask = self._chunk(c).gather(local, self._window)
            for target, leaf in zip(flat_out, jax.tree_util.tree_leaves((value, step_mask))):
                target[rows] = leaf
        return out

    def _order(self, bits: np.ndarray, epoch: int) -> np.ndarray:
        """The transitions in the order of ``epoch``, drawn from the key's bits (cached)."""
        tag = (bits.tobytes(), epoch)
        if self._epoch_order[0] == tag:
            return self._epoch_order[1]
        if self._ordering == "sequential":
            order = np.arange(self._length)
        else:
            rng = np.random.default_rng([*bits.reshape(-1).astype(np.uint32).tolist(), epoch])
            starts = self._chunk_starts
            order = np.concatenate(
                [
                    starts[c] + rng.permutation(starts[c + 1] - starts[c])
                    for c in rng.permutation(len(self._chunk_ids))
                ]
            )
        self._epoch_order = (tag, order)
        return order

    def _prepare(self, bits: np.ndarray, epoch: int, position: int) -> tuple:
        """The ``prefetch`` batches of ``epoch`` starting at batch ``position``."""
        size = self._prefetch * self._batch_size
        start = position * self._batch_size
        with self._lock:  # the prefetch thread and a refill that did not wait for it
            order = self._order(bits, epoch)[start : start + size]
            indices = np.full(size, -1, np.int64)
            indices[: len(order)] = order
            return self._gather(indices)

    def _fetch(self, bits: Any, epoch: Any, position: Any) -> tuple:
        """Host side of a refill: the batches asked for, then the next ones prepared in the
        background (the next refill of this epoch, or the first of the next epoch)."""
        bits = np.asarray(bits)
        epoch, position = int(np.asarray(epoch)), int(np.asarray(position))
        if not 0 <= position < self._steps_per_epoch:
            raise ValueError(
                f"MinariSource: the state's position {position} lies outside the "
                f"{self._steps_per_epoch} batches of an epoch (a damaged state?)"
            )
        tag = (bits.tobytes(), epoch, position)
        ahead_tag, ahead = self._ahead
        result = ahead.result() if ahead is not None and ahead_tag == tag else None
        if result is None:
            result = self._prepare(bits, epoch, position)
        nxt = position + self._prefetch
        nxt_epoch, nxt = (epoch, nxt) if nxt < self._steps_per_epoch else (epoch + 1, 0)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "minari-prefetch")
        future = self._executor.submit(self._prepare, bits, nxt_epoch, nxt)
        self._ahead = ((bits.tobytes(), nxt_epoch, nxt), future)
        return result

    def init_state(self, key: jax.Array) -> MinariSourceState:
        """Return the state at the start of epoch 0 (nothing fetched yet).

        Parameters
        ----------
        key : jax.Array
            PRNG key (typed or raw) seeding the epoch orders.
        """
        compiled = self.__dict__.get("_jit_init")
        if compiled is None:
            compiled = self._jit_init = jax.jit(self._init_state)
        return compiled(key)

    def _init_state(self, key: jax.Array) -> MinariSourceState:
        return MinariSourceState(
            key=key,
            epoch=jnp.zeros([], jnp.int32),
            position=jnp.zeros([], jnp.int32),
            buffer=jnp.zeros(self._buffer_shape, jnp.uint32),
            buffer_start=jnp.full([], -1, jnp.int32),
        )

    def _refill(self, state: MinariSourceState) -> MinariSourceState:
        """Gather the ``prefetch`` batches that start at ``state.position``."""
        if self._device is not None:
            buffer = self._gather_on_device(state)
        else:
            key = state.key
            bits = (
                jax.random.key_data(key)
                if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
                else key
            )
            leaves = io_callback(self._fetch, self._fetch_leaves, bits, state.epoch, state.position)
            buffer = self._rows.pack(jax.tree_util.tree_unflatten(self._step_treedef, leaves))
        return state.replace(buffer=buffer, buffer_start=state.position)

    def _gather_on_device(self, state: MinariSourceState) -> jax.Array:
        """The ``prefetch`` batches at ``state.position``, gathered from the device table
        by the epoch's order in one gather, as the buffer's words (rows past the epoch's
        end: zeros, so masked)."""
        n, size = self._length, self._prefetch * self._batch_size
        positions = state.position * self._batch_size + jnp.arange(size, dtype=jnp.int32)
        # a restored position beyond the epoch (the state alone cannot show it; its product
        # may even wrap around int32) reads padding, like the end of an epoch
        valid = (positions < n) & (state.position < self._steps_per_epoch)
        rows = jnp.minimum(positions, n - 1)
        if self._ordering == "shuffle":
            rows = permuted(jax.random.fold_in(state.key, state.epoch), rows, n)
        return self._device.gather_words(rows, valid, self._window).reshape(self._buffer_shape)

    def next(self, state: MinariSourceState) -> tuple[PyTree, jax.Array, MinariSourceState]:
        """Return ``(batch, mask, new_state)``, gathering the next batches when needed.

        Raises
        ------
        TypeError
            If ``state`` is not a :class:`MinariSourceState`.
        ValueError
            If ``state`` belongs to another source (at trace time).
        """
        return self._compiled_next(state)

    def _next(self, state: MinariSourceState) -> tuple[PyTree, jax.Array, MinariSourceState]:
        if not isinstance(state, MinariSourceState):
            raise TypeError(f"{self!r}.next needs a MinariSourceState, got {type(state).__name__}")
        if tuple(np.shape(state.buffer)) != self._buffer_shape:
            raise ValueError(f"{self!r}.next got the state of another source (its buffer)")
        stale = jnp.logical_or(
            state.buffer_start < 0, state.position >= state.buffer_start + self._prefetch
        )
        state = jax.lax.cond(stale, self._refill, lambda state: state, state)
        row = state.position - state.buffer_start
        words = jax.lax.dynamic_index_in_dim(state.buffer, row, 0, False)
        observation, (action, reward, terminated, truncated), next_observation, mask = (
            self._rows.unpack(words)
        )
        batch = {
            "observation": observation,
            "action": action,
            "reward": reward,
            "next_observation": next_observation,
            "terminated": terminated,
            "truncated": truncated,
        }
        position = state.position + 1
        epoch_ends = position >= self._steps_per_epoch
        new_state = state.replace(
            position=jnp.where(epoch_ends, 0, position).astype(jnp.int32),
            epoch=state.epoch + epoch_ends.astype(jnp.int32),
            buffer_start=jnp.where(epoch_ends, -1, state.buffer_start).astype(jnp.int32),
        )
        return batch, mask, new_state

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_jit_init", None)
        state["_executor"], state["_ahead"], state["_lock"] = None, (None, None), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"MinariSource({self._dataset.id!r}, batch_size={self._batch_size}, "
            f"ordering={self._ordering!r}, window={self._window}, "
            f"transitions={self._length})"
        )
