"""CheckpointManager: numbered checkpoints in one folder (``ckpt_<step>.pkl.lz4``, and
``ckpt_<step>.metrics.pkl.lz4`` written before it), background saves and retention; the folder
is held by a ``flock`` on ``.coax_utils-lock``. A ``.coax_utils-pending`` folder of older
versions is ignored."""

from __future__ import annotations

import concurrent.futures
import copy
import numbers
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from coax_utils._checks import check_choice, check_finite_number, check_int
from coax_utils._files import lock_file, remove_stale_temps, rename
from coax_utils.utils._checkpoint.container import num_threads
from coax_utils.utils._checkpoint.errors import CheckpointDamagedError
from coax_utils.utils._checkpoint.io import dump, load

__all__ = ["CheckpointManager"]

_DIGITS = 12  # zero-padded step numbers: plain `ls` lists the files in step order
# [0-9], not \d: \d also matches other scripts' digits, which int() reads
_NAME = re.compile(rf"ckpt_([0-9]{{{_DIGITS}}})(\.metrics)?\.pkl\.lz4")
_LOCK = ".coax_utils-lock"
_PIECE = 1 << 23  # bytes per piece of the array copies run on a few threads
_SMALL = 1 << 16  # arrays up to this many bytes are copied during the walk
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _name(step: int, kind: str = "") -> str:
    return f"ckpt_{step:0{_DIGITS}d}{kind}.pkl.lz4"


def _check_count(value: Any, name: str) -> int | None:
    return None if value is None else check_int(value, name, low=1)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _check_metrics(metrics: Any) -> dict[str, bool | int | float | str] | None:
    """A plain copy of ``metrics``: str keys, Python scalars (numpy/jax scalars converted)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be None or a dict, got {type(metrics).__name__}")
    plain = {}
    for key, value in metrics.items():
        number = isinstance(value, (numbers.Number, np.generic, np.ndarray, jax.Array))
        arr = np.asarray(value) if number else np.asarray(None)
        if not isinstance(key, str) or not (
            isinstance(value, str) or arr.ndim == 0 and arr.dtype.kind in "biuf"
        ):
            raise TypeError(
                "metrics must map str keys to a str or a real scalar (bool, int, float, or a "
                f"0-d numpy/jax array of such), got {key!r}: {value!r}"
            )
        plain[key] = value if isinstance(value, str) else arr.item()
    return plain


def _unlink(path: str) -> None:
    """Remove the file or link ``path``; a missing one, or a folder of that name, stays."""
    try:
        os.unlink(path)
    except OSError:
        if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
            raise


class _Background:
    """The background saves of a manager: a snapshot of the state, then one writer thread.

    The snapshot is a copy that nothing the caller does afterwards can change: one walk with
    one memo by ``id`` (shared with :func:`copy.deepcopy`, which copies what the walk does not
    open: all but lists, dicts and pytree nodes) copies each object once, so shared references
    stay shared and cycles close. numpy arrays are copied after the walk, in pieces on a few
    threads, into one buffer kept from one save to the next: after the first saves a copy
    touches no fresh pages, which the kernel would have to zero and compact first. jax arrays
    never change and are not copied: the snapshot holds a CPU array itself, with a view of
    its memory until the write ends (jax declines to donate a buffer that a view refers to),
    and the host copy of any other array (from a GPU, say) as a CPU array.
    """

    def __init__(self) -> None:
        try:
            self._host: jax.Device | None = jax.devices("cpu")[0]
        except RuntimeError:  # no CPU backend in this process: copy on the array's own device
            self._host = None
        self._buffer = np.empty(0, np.uint8)
        self._need = 0  # the bytes of the buffer the current snapshot asked for
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, obj: Any, write: Callable[[Any], None]) -> None:
        """Take a snapshot of ``obj``, then run ``write(snapshot)`` on the writer thread."""
        self.wait()  # the previous snapshot is no longer used: its buffer serves this one
        if not self._buffer.size // 2 <= self._need <= self._buffer.size:  # as the last save
            self._buffer = np.empty(0, np.uint8)  # released before the new one is taken
            self._buffer = np.empty(self._need, np.uint8)
        self._need, self._pairs, views = 0, [], []
        self._views: list[memoryview] = views  # held until the write ends
        # the originals stay alive until the walk ends, so no id is reused (as in deepcopy)
        self._keep: list[Any] = []
        self._memo: dict[int, Any] = {}
        self._memo[id(self._memo)] = self._keep  # where copy.deepcopy keeps its originals
        try:
            snapshot = self._copy(obj)
            self._copy_arrays()
        finally:
            del self._memo, self._keep, self._pairs, self._views
        # not a daemon: at interpreter exit Python waits for the write to finish
        self._thread = threading.Thread(
            target=self._run, args=(write, snapshot, views), name="coax_utils-checkpoint-writer"
        )
        self._thread.start()

    def _run(self, write: Callable[[Any], None], snapshot: Any, views: list) -> None:
        """``write(snapshot)``, with ``views`` (of the snapshot's jax arrays) held meanwhile."""
        time.sleep(0)  # hands the GIL back: the caller goes on before the write starts
        try:
            write(snapshot)
        except BaseException as err:  # raised by the caller's next save, wait or close
            self._error = err

    def wait(self) -> None:
        """Wait for the pending write; raise its error, if it failed (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def finish(self, lock_fd: int) -> None:
        """Finish the pending write, then release the folder (close() and interpreter exit)."""
        try:
            self.wait()
        finally:
            os.close(lock_fd)
            self._buffer = np.empty(0, np.uint8)

    def _copy(self, x: Any) -> Any:
        t = type(x)
        if t in _ATOMS:
            return x
        if id(x) in self._memo:
            return self._memo[id(x)]
        if isinstance(x, jax.Array):
            y = self._jax(x)
        elif t is np.ndarray and not x.dtype.hasobject:
            start = -(-self._need // 64) * 64  # 64-byte aligned, as numpy aligns arrays
            self._need = start + x.nbytes
            if self._need > self._buffer.size:  # more than the last save: fresh memory
                y = np.empty_like(x)
            else:
                y = self._buffer[start : self._need].view(x.dtype).reshape(x.shape)
            if x.nbytes <= _SMALL:
                np.copyto(y, x)
            else:
                self._pairs.append((y, x))
        elif t is list:  # in the memo before its items: a list may hold itself
            y = self._memo[id(x)] = []
            y.extend(x if _ATOMS.issuperset(map(type, x)) else map(self._copy, x))
        elif t is dict:  # opened here, not as a pytree: jax would sort the keys
            y = self._memo[id(x)] = {}
            for key, value in x.items():
                y[key if type(key) in _ATOMS else self._copy(key)] = self._copy(value)
        else:
            children, node = jax.tree_util.tree_flatten(x, is_leaf=lambda c: c is not x)
            if node.num_nodes == 1 and node.num_leaves == 1:  # not a pytree node
                return copy.deepcopy(x, self._memo)
            children = [self._copy(c) for c in children]
            if id(x) in self._memo:  # a cycle through x's children copied x already
                return self._memo[id(x)]
            y = node.unflatten(children)
        self._memo[id(x)] = y
        self._keep.append(x)
        return y

    def _jax(self, x: jax.Array) -> jax.Array:
        try:  # a view of a CPU array's memory: jax keeps it (no donation) while the view lives
            self._views.append(memoryview(x))
            return x
        except (BufferError, TypeError):  # on a GPU, of a type such as bfloat16, a PRNG key
            pass
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = self._jax(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        if self._host is None or x.weak_type:  # a copy by jax keeps the weak type
            return jax.block_until_ready(jax.device_put(x, self._host, may_alias=False))
        return jax.device_put(np.asarray(x), self._host, may_alias=True)

    def _copy_arrays(self) -> None:
        pieces = []
        for dst, src in self._pairs:
            if src.flags.forc and dst.strides == src.strides:  # views, in memory order
                n = -(-src.nbytes // _PIECE)
                pieces += zip(np.array_split(dst.ravel("K"), n), np.array_split(src.ravel("K"), n))
            else:
                pieces.append((dst, src))
        try:  # a new pool each time (0.5 ms): no idle threads, nothing to go wrong in a fork
            with concurrent.futures.ThreadPoolExecutor(num_threads()) as pool:
                list(pool.map(lambda piece: np.copyto(*piece), pieces))
        except RuntimeError:  # the interpreter is exiting (a save from an atexit handler)
            for dst, src in pieces:
                np.copyto(dst, src)


class CheckpointManager:
    """Numbered checkpoints of a training run in one folder (``ckpt_<step, 12 digits>.pkl.lz4``,
    written with :func:`dump`): background saves, retention, and restore of the newest
    checkpoint. See :doc:`/checkpoint_manager` for a walk-through.

    Retention is applied after each save has completed: a process killed at any moment leaves
    every completed step. One manager at a time writes to a folder (an OS file lock, released
    when its process ends).

    Parameters
    ----------
    directory : str or os.PathLike
        The folder of the checkpoints; created if missing. Files in it that do not follow
        the manager's naming, and folders in it whatever their names, are left alone.
    max_to_keep : int or None, optional
        How many of the newest checkpoints to keep (``None``: all).
    keep_every_n_steps : int or None, optional
        Also keep the oldest checkpoint in every window of this many steps (``[0, n)``,
        ``[n, 2n)``, ...).
    best_fn : callable or None, optional
        ``best_fn(metrics) -> float``, the score of a checkpoint from the metrics dict given
        to :meth:`save`; the checkpoint with the best score is kept (ties: the newest). Steps
        saved without metrics have no score.
    best_mode : {'max', 'min'}, optional
        Whether a higher or a lower score is better.
    background : bool, optional
        Write on a background thread (``True``) or before :meth:`save` returns (``False``).
        There is never more than one writer; a background error is raised by the next
        :meth:`save`, :meth:`wait`, :meth:`restore` or :meth:`close` (printed if the
        interpreter exits first). The memory of the copies of numpy arrays is kept from one
        background save to the next.

    Raises
    ------
    TypeError
        If an argument has the wrong type.
    ValueError
        If an argument has a wrong value, ``directory`` exists and is not a folder, or its
        lock file ``.coax_utils-lock`` is a symbolic link or not a regular file.
    RuntimeError
        If another manager (in this process or another) writes to ``directory``.

    Examples
    --------
    >>> import tempfile
    >>> import numpy as np
    >>> from coax_utils import utils
    >>> folder = tempfile.mkdtemp()
    >>> with utils.CheckpointManager(folder, max_to_keep=2) as manager:
    ...     for step in range(0, 500, 100):
    ...         manager.save(step, {'w': np.full(3, step), 'step': step})
    >>> manager = utils.CheckpointManager(folder)  # e.g. in a restarted process
    >>> manager.all_steps()
    [300, 400]
    >>> if manager.latest_step() is not None:
    ...     state = manager.restore()
    >>> state['w']
    array([400, 400, 400])
    >>> manager.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 3,
        keep_every_n_steps: int | None = None,
        best_fn: Callable[[dict[str, Any]], float] | None = None,
        best_mode: str = "max",
        background: bool = True,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not isinstance(
            os.fspath(directory), str
        ):
            raise TypeError(f"directory must be a str or os.PathLike of str, got {directory!r}")
        path = os.path.abspath(os.fspath(directory))
        self._max_to_keep = _check_count(max_to_keep, "max_to_keep")
        self._keep_every = _check_count(keep_every_n_steps, "keep_every_n_steps")
        if best_fn is not None and not callable(best_fn):
            raise TypeError(f"best_fn must be None or callable, got {best_fn!r}")
        self._best_fn = best_fn
        self._best_mode = check_choice(best_mode, "best_mode", ("max", "min"))
        self._background = _check_bool(background, "background")
        self._directory = path
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"directory {path!r} exists and is not a folder")
        os.makedirs(path, exist_ok=True)
        try:
            lock_fd = lock_file(self._path(_LOCK), blocking=False)
        except BlockingIOError:
            raise RuntimeError(
                f"{path!r} is in use by another CheckpointManager (it holds "
                f"{self._path(_LOCK)!r}); close that one first"
            ) from None
        try:
            self._scores = self._scan()  # {complete step: score}
        except BaseException:
            os.close(lock_fd)
            raise
        self._saves = _Background()
        self._finalizer = weakref.finalize(self, self._saves.finish, lock_fd)

    def _path(self, name: str) -> str:
        return os.path.join(self._directory, name)

    def _scan(self) -> dict[int, float | None]:
        """Remove what killed saves left; return {complete step: score}."""
        remove_stale_temps(self._directory)
        checkpoints, metrics = {}, {}
        for name in os.listdir(self._directory):
            match = _NAME.fullmatch(name)
            if match and os.path.isfile(self._path(name)):  # folders are not the manager's
                (metrics if match[2] else checkpoints)[int(match[1])] = self._path(name)
        scores: dict[int, float | None] = dict.fromkeys(checkpoints)
        for step, path in metrics.items():
            if step not in scores:  # a save was killed between the metrics and the checkpoint
                _unlink(path)
                continue
            try:  # metrics may predate this best_fn (a missing key): the step has no score
                scores[step] = self._score(_check_metrics(load(path, safe=True)), step)
            except Exception as err:
                warnings.warn(
                    f"step {step} has no score: its metrics {path!r} do not load or best_fn "
                    f"fails on them ({type(err).__name__}: {err})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return scores

    def _score(self, metrics: dict[str, Any] | None, step: int) -> float | None:
        if self._best_fn is None or metrics is None:
            return None
        value = self._best_fn(dict(metrics))
        check_finite_number(value, f"the score best_fn returned for step {step}")
        return float(value)

    def _best(self, scores: dict[int, float | None]) -> int | None:
        sign = 1.0 if self._best_mode == "max" else -1.0
        scored = [(sign * s, step) for step, s in scores.items() if s is not None]
        return max(scored)[1] if scored else None  # ties: the newest step

    def _write(self, step: int, obj: Any, metrics: dict | None, score: float | None) -> None:
        """Write one step (metrics first, then the checkpoint), then apply retention."""
        metrics_path = self._path(_name(step, ".metrics"))
        if metrics is not None:
            dump(metrics, metrics_path)
        else:  # the metrics of an earlier step of this number, removed behind our back
            _unlink(metrics_path)
        try:
            dump(obj, self._path(_name(step)))
        except BaseException:  # no metrics of a step that is not there
            _unlink(metrics_path)
            raise
        scores = {**self._scores, step: score}
        steps = sorted(scores)
        keep = set(steps[-self._max_to_keep :] if self._max_to_keep else steps)
        if self._keep_every is not None:  # the oldest step of each window
            keep.update({s // self._keep_every: s for s in reversed(steps)}.values())
        keep.add(self._best(scores))
        # a new dict, never changed once set: other threads read it without a lock
        self._scores = {s: scores[s] for s in steps if s in keep}
        for old in set(steps) - keep:  # the checkpoint first: no step without its metrics
            _unlink(self._path(_name(old)))
            _unlink(self._path(_name(old, ".metrics")))

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError(f"the CheckpointManager of {self._directory!r} is closed")

    @property
    def directory(self) -> str:
        """The absolute path of the managed folder."""
        return self._directory

    def save(self, step: int, obj: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Save ``obj`` as the checkpoint of ``step``.

        With ``background=True`` this returns once ``obj`` is copied (each object once, so
        shared references and cycles are kept), and the loop may then mutate its arrays or
        donate its jax buffers; otherwise once the checkpoint is complete and retained.

        Parameters
        ----------
        step : int
            The step number: a non-negative int (at most 12 digits), greater than every
            step saved before.
        obj : object
            What to save: anything :func:`dump` takes (a dict of the whole agent, say).
        metrics : dict or None, optional
            ``{name: value}`` with str names and str or real scalar values (numpy and jax
            scalars are converted to Python numbers); stored next to the checkpoint and
            passed to ``best_fn``.

        Raises
        ------
        TypeError
            If ``step`` is not an int (bools are refused) or ``metrics`` is malformed.
        ValueError
            If ``step`` is negative, too large, or not greater than the newest saved step,
            if ``best_fn`` returns a non-finite score, or if the manager is closed.
        Exception
            Whatever the previous background save raised (this save is then not made).
        """
        self._check_open()
        step = check_int(step, "step", 0, 10**_DIGITS - 1)
        metrics = _check_metrics(metrics)
        score = self._score(metrics, step)
        self._saves.wait()  # never two writers; raises the previous save's error
        newest = self.latest_step()
        if newest is not None and step <= newest:
            raise ValueError(f"step {step} is not after the newest saved step {newest}")
        if self._background:
            self._saves.start(obj, lambda snapshot: self._write(step, snapshot, metrics, score))
        else:
            self._write(step, obj, metrics, score)

    def restore(self, step: int | None = None, safe: bool = False, quarantine: bool = False) -> Any:
        """Load and return a checkpoint (after waiting for a pending save).

        If :func:`load` raises :class:`CheckpointDamagedError` (damaged or forged) and
        ``step=None``, the next older step is tried, with a :class:`RuntimeWarning` naming
        the step and the reason; the file and its step stay, unless ``quarantine=True``. Any
        other error, e.g. :class:`CheckpointNotReadableError` (intact, but not readable by
        this process: a type not registered, 64-bit arrays with ``jax_enable_x64`` off, a
        pickle section with ``safe=True``, a newer format) is raised at once, nothing touched:
        fix the set-up and call ``restore`` again.

        Parameters
        ----------
        step : int or None, optional
            The step to load; ``None``: the newest step whose checkpoint is not damaged.
        safe : bool, optional
            Passed to :func:`load`: ``True`` never unpickles.
        quarantine : bool, optional
            Rename each damaged checkpoint skipped to ``<name>.corrupt`` and drop its step,
            so that training can go on and save the steps after the restored one.

        Raises
        ------
        FileNotFoundError
            If there is no checkpoint of ``step``, or none at all.
        CheckpointNotReadableError
            If the checkpoint tried cannot be read by this process (nothing is touched).
        CheckpointDamagedError
            If the checkpoint of ``step``, or (``step=None``) every checkpoint, is damaged.
        ValueError
            If the manager is closed.
        """
        self._check_open()
        if step is not None:
            step = check_int(step, "step", 0, 10**_DIGITS - 1)
        safe = _check_bool(safe, "safe")
        quarantine = _check_bool(quarantine, "quarantine")
        self._saves.wait()
        steps = self.all_steps()
        if not steps or (step is not None and step not in steps):
            which = "any step" if step is None else f"step {step}"
            raise FileNotFoundError(
                f"no checkpoint of {which} in {self._directory!r}; steps: {steps}"
            )
        if step is not None:
            return load(self._path(_name(step)), safe=safe)
        damaged = None
        for candidate in reversed(steps):
            path = self._path(_name(candidate))
            try:
                return load(path, safe=safe)
            except FileNotFoundError as err:  # removed behind the manager's back
                forget, reason = True, f"its file is gone ({err})"
            except CheckpointDamagedError as err:
                damaged, forget, reason = err, False, f"it is damaged ({err})"
                try:
                    if quarantine:
                        rename(path, path + ".corrupt")
                        forget, reason = True, f"{reason}; renamed to {path + '.corrupt'!r}"
                except OSError as rename_error:  # e.g. a folder holds that name
                    reason += f"; it could not be renamed ({rename_error})"
                if not forget:
                    reason += "; the file is left in place"
            if forget:
                self._scores = {s: v for s, v in self._scores.items() if s != candidate}
            warnings.warn(
                f"not restoring step {candidate}: {reason}; trying an older step",
                RuntimeWarning,
                stacklevel=2,
            )
        if damaged is None:
            raise FileNotFoundError(f"every checkpoint of {self._directory!r} is gone")
        raise CheckpointDamagedError(
            f"no checkpoint in {self._directory!r} loads: steps {steps} are damaged or gone"
        ) from damaged

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``; a save still running is not counted."""
        return max(self._scores, default=None)

    def best_step(self) -> int | None:
        """The complete step with the best ``best_fn`` score, or ``None`` (no ``best_fn``, or
        no step saved with metrics)."""
        return self._best(self._scores)

    def all_steps(self) -> list[int]:
        """The complete steps in the folder, oldest first."""
        return sorted(self._scores)

    def wait(self) -> None:
        """Wait for the pending background save; raise its error, if it failed."""
        self._saves.wait()

    def close(self) -> None:
        """Finish the pending save, release the folder and free the memory kept for the copies
        of background saves; raise the save's error, if any.

        Calling it again does nothing. The manager cannot save or restore afterwards.
        """
        self._finalizer()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self._directory!r}, max_to_keep={self._max_to_keep}, "
            f"keep_every_n_steps={self._keep_every}, best_mode={self._best_mode!r}, "
            f"background={self._background}, steps={self.all_steps()})"
        )
