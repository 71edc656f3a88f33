"""CheckpointManager: numbered checkpoints in one folder, background saves and retention.

Layout of a managed folder::

    ckpt_000000001000.pkl.lz4            the checkpoint of step 1000 (written with ``dump``)
    ckpt_000000001000.metrics.pkl.lz4    its metrics, when ``save`` was given some
    .coax_utils-pending/                 where files are written before they are renamed in
    .coax_utils-lock                     held (``flock``) by the manager that writes here

A step is complete when its checkpoint file is in the folder: ``dump`` writes the file in
the pending folder (atomically, fsynced), and only then is it renamed into the folder. The
metrics file of a step is renamed in before its checkpoint, so a complete step always has
its metrics; a metrics file without a checkpoint is left over from a killed save and is
removed by the next manager, together with everything in the pending folder.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import re
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from coax_utils.utils._checkpoint.io import dump, load

__all__ = ["CheckpointManager"]

_DIGITS = 12  # zero-padded step numbers: plain `ls` lists the files in step order
_MAX_STEP = 10**_DIGITS - 1
# [0-9], not \d: \d also matches other scripts' digits, which int() reads but the names the
# manager writes never contain
_CHECKPOINT = re.compile(rf"ckpt_([0-9]{{{_DIGITS}}})\.pkl\.lz4")
_METRICS = re.compile(rf"ckpt_([0-9]{{{_DIGITS}}})\.metrics\.pkl\.lz4")
_PENDING = ".coax_utils-pending"
_LOCK = ".coax_utils-lock"
_ALIGN = 64  # the alignment jax needs to adopt host memory without a copy


def _checkpoint_name(step: int) -> str:
    return f"ckpt_{step:0{_DIGITS}d}.pkl.lz4"


def _metrics_name(step: int) -> str:
    return f"ckpt_{step:0{_DIGITS}d}.metrics.pkl.lz4"


def _check_count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be None or an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    return int(value)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be a non-negative int, got {step!r}")
    if not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step must be an int in [0, {_MAX_STEP}], got {step!r}")
    return int(step)


def _check_metrics(metrics: Any) -> dict[str, bool | int | float | str] | None:
    """A plain copy of ``metrics``: str keys, Python scalars (numpy/jax scalars converted)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be None or a dict, got {type(metrics).__name__}")
    plain: dict[str, bool | int | float | str] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metrics keys must be str, got {key!r}")
        if isinstance(value, str):
            plain[key] = value
            continue
        arr = (
            np.asarray(value)
            if isinstance(value, (numbers.Number, np.generic, np.ndarray, jax.Array))
            else None
        )
        if arr is None or arr.ndim != 0 or arr.dtype.kind not in "biuf":
            raise TypeError(
                f"metrics[{key!r}] must be a str or a real scalar (bool, int, float, or a "
                f"0-d numpy/jax array of such), got {value!r}"
            )
        plain[key] = arr.item()
    return plain


def _fsync_folder(path: str) -> None:
    if os.name != "nt":  # Windows cannot open a folder for fsync
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _unlink(path: str) -> None:
    """Remove the file or link ``path``; a missing one, or a folder of that name, stays."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        if os.path.islink(path) or not os.path.isdir(path):
            raise


def _lock_folder(path: str) -> int | None:
    """Take the folder's writer lock (``flock``; the kernel drops it when the process dies)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one writer per folder is left to the user
        return None
    lock_path = os.path.join(path, _LOCK)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"{path!r} is in use by another CheckpointManager (it holds {lock_path!r}); "
            f"close that one first"
        ) from None
    return fd


def _host_copy(x: jax.Array, host: jax.Device | None) -> jax.Array:
    """``x`` copied to host memory, as a jax array on the CPU device that shares nothing."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _host_copy(jax.random.key_data(x), host)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if host is None or x.weak_type:  # a weak type survives jax's own (slower) copy only
        return jax.device_put(x, host, may_alias=False)
    # numpy copies at memory speed (jax's CPU copy is several times slower); a 64-byte
    # aligned buffer lets device_put adopt the copy as the array's memory instead of copying
    src = np.asarray(x)  # a view of a CPU array's memory, or the array fetched from a GPU
    raw = np.empty(src.nbytes + _ALIGN, np.uint8)
    skip = -raw.__array_interface__["data"][0] % _ALIGN
    out = raw[skip : skip + src.nbytes].view(src.dtype).reshape(src.shape)
    np.copyto(out, src)
    return jax.device_put(out, host, may_alias=True)


def _host_snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that nothing the caller does afterwards can change.

    jax arrays among the pytree leaves of ``obj`` are copied to host memory as jax arrays on
    the CPU device (so they load back as jax arrays), and the copies are waited for: the
    caller may then donate or delete its buffers. Everything else is deep-copied
    (:func:`copy.deepcopy`, one memo for the whole object, so shared references stay shared):
    numpy arrays are copied, containers and stateful objects such as replay buffers are
    duplicated, functions are kept as they are.
    """
    arrays = [x for x in jax.tree_util.tree_leaves(obj) if isinstance(x, jax.Array)]
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend in this process: copy on the array's own device
        host = None
    memo: dict[int, Any] = {}
    for x in arrays:
        if id(x) not in memo:  # the same array twice: one copy
            memo[id(x)] = _host_copy(x, host)
    jax.block_until_ready(list(memo.values()))
    return copy.deepcopy(obj, memo)


class _Writer:
    """Runs at most one background job at a time and keeps its error for the next ``wait``."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, job: Callable[[], None]) -> None:
        self.wait()
        # not a daemon: at interpreter exit Python waits for the job to finish
        self._thread = threading.Thread(
            target=self._run, args=(job,), name="coax_utils-checkpoint-writer", daemon=False
        )
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as err:  # kept for the caller's next save/wait/close
            self._error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def _finish(writer: _Writer, lock_fd: int | None) -> None:
    """Finish the pending save, then release the folder (close() and interpreter exit)."""
    try:
        writer.wait()
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


class CheckpointManager:
    """Numbered checkpoints of a training run in one folder: background saves, retention,
    and restore of the newest checkpoint that loads.

    Every :meth:`save` writes one file, ``ckpt_<step, 12 digits>.pkl.lz4``, with
    :func:`dump` (atomic, checksummed), so that ``ls`` lists the checkpoints in step order.
    See :doc:`/checkpoint_manager` for a walk-through.

    **Background saves** (``background=True``): :meth:`save` returns as soon as the state
    is copied (jax arrays among the pytree leaves fetched to host memory, everything else
    deep-copied with :func:`copy.deepcopy`: numpy arrays, containers, replay buffers and
    other stateful objects), so the training loop may overwrite, mutate or donate its
    buffers right away; compression and writing run on a background thread. The copy needs
    as much host memory as the state. A ``save`` while the previous one still runs waits for
    it (there is never more than one writer), and an error raised in the background is
    raised by the next :meth:`save`, :meth:`wait`, :meth:`restore` or :meth:`close`. At
    interpreter exit Python waits for a pending save to finish; an error it raises there is
    printed. Objects that :func:`copy.deepcopy` cannot copy need ``background=False``.

    **Retention**: after each save has completed, the manager keeps the newest
    ``max_to_keep`` checkpoints, the oldest checkpoint in each window of
    ``keep_every_n_steps`` steps (``[0, n)``, ``[n, 2n)``, ...: with saves at multiples of
    ``n``, exactly those), and the best one by ``best_fn(metrics)``, and deletes the
    others. A checkpoint is deleted only after the new one is complete, so a process killed
    at any moment leaves every checkpoint that had completed loadable.

    **Restart**: a new manager on the folder removes what a killed save left unfinished and
    finds the steps that completed, with their metrics (stored atomically next to each
    checkpoint, so ``best_fn`` ranks them as before). Only one manager may write to a folder
    at a time (an OS file lock, released when its process ends).

    Parameters
    ----------
    directory : str or os.PathLike
        The folder of the checkpoints; created if missing. Files in it that do not follow
        the manager's naming, and folders in it whatever their names, are left alone.
    max_to_keep : int or None, optional
        How many of the newest checkpoints to keep (``None``: all).
    keep_every_n_steps : int or None, optional
        Also keep the oldest checkpoint in every window of this many steps.
    best_fn : callable or None, optional
        ``best_fn(metrics) -> float``, the score of a checkpoint from the metrics dict given
        to :meth:`save`; the checkpoint with the best score is kept (ties: the newest). Steps
        saved without metrics have no score.
    best_mode : {'max', 'min'}, optional
        Whether a higher or a lower score is better.
    background : bool, optional
        Write on a background thread (``True``) or before :meth:`save` returns (``False``).

    Raises
    ------
    TypeError
        If an argument has the wrong type.
    ValueError
        If an argument has a wrong value, or ``directory`` exists and is not a folder.
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
    >>> manager.restore()['w']
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
        self._max_to_keep = _check_count(max_to_keep, "max_to_keep")
        self._keep_every = _check_count(keep_every_n_steps, "keep_every_n_steps")
        if best_fn is not None and not callable(best_fn):
            raise TypeError(f"best_fn must be None or callable, got {best_fn!r}")
        if not isinstance(best_mode, str):
            raise TypeError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if not isinstance(background, bool):
            raise TypeError(f"background must be a bool, got {background!r}")
        path = os.path.abspath(os.fspath(directory))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"directory {path!r} exists and is not a folder")
        self._best_fn = best_fn
        self._best_mode = best_mode
        self._background = background
        self._directory = path
        self._pending = os.path.join(path, _PENDING)

        os.makedirs(path, exist_ok=True)
        lock_fd = _lock_folder(path)
        try:
            self._scores = self._scan()
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        self._records_lock = threading.Lock()
        self._writer = _Writer()
        self._finalizer = weakref.finalize(self, _finish, self._writer, lock_fd)

    # -- folder ------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self._directory, name)

    def _scan(self) -> dict[int, float | None]:
        """Clean up after killed saves; return {complete step: score}."""
        if os.path.islink(self._pending) or not os.path.isdir(self._pending):
            _unlink(self._pending)  # a file or a link in the manager's place: only it goes
        else:
            shutil.rmtree(self._pending, ignore_errors=True)
        os.makedirs(self._pending, exist_ok=True)
        names = os.listdir(self._directory)
        steps = {
            int(m.group(1))
            for m in map(_CHECKPOINT.fullmatch, names)
            if m and os.path.isfile(self._path(m.group(0)))
        }
        scores: dict[int, float | None] = {step: None for step in steps}
        for m in filter(None, map(_METRICS.fullmatch, names)):
            if not os.path.isfile(self._path(m.group(0))):  # e.g. a folder: not the manager's
                continue
            step = int(m.group(1))
            if step not in steps:  # a save was killed between the metrics and the checkpoint
                _unlink(self._path(m.group(0)))
                continue
            try:
                metrics = _check_metrics(load(self._path(m.group(0)), safe=True))
            except (ValueError, TypeError) as err:
                warnings.warn(
                    f"ignoring the metrics of step {step}: {self._path(m.group(0))!r} does "
                    f"not hold a metrics dict ({err})",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            try:
                # metrics from disk may predate this best_fn (a missing key, a NaN): such a
                # step has no score, and the folder still opens
                scores[step] = self._score(metrics, step)
            except Exception as err:
                warnings.warn(
                    f"step {step} has no score: best_fn failed on its stored metrics "
                    f"{metrics!r} ({type(err).__name__}: {err})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return scores

    def _score(self, metrics: dict[str, Any] | None, step: int) -> float | None:
        if self._best_fn is None or metrics is None:
            return None
        value = self._best_fn(dict(metrics))
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"best_fn must return a real number, got {value!r} for step {step}")
        if not math.isfinite(value):
            raise ValueError(
                f"best_fn returned {value!r} for step {step}; expected a finite number"
            )
        return float(value)

    def _retained(self, scores: dict[int, float | None]) -> set[int]:
        steps = sorted(scores)
        keep = set(steps if self._max_to_keep is None else steps[-self._max_to_keep :])
        if self._keep_every is not None:
            first_in_window: dict[int, int] = {}
            for step in steps:
                first_in_window.setdefault(step // self._keep_every, step)
            keep.update(first_in_window.values())
        best = self._best(scores)
        if best is not None:
            keep.add(best)
        return keep

    def _best(self, scores: dict[int, float | None]) -> int | None:
        sign = 1.0 if self._best_mode == "max" else -1.0
        scored = [(sign * score, step) for step, score in scores.items() if score is not None]
        return max(scored)[1] if scored else None  # ties: the newest step

    def _write(
        self, step: int, obj: Any, metrics: dict[str, Any] | None, score: float | None
    ) -> None:
        """Write and commit one step (metrics first), then apply the retention rules."""
        files = [(obj, _checkpoint_name(step))]
        if metrics is not None:
            files.insert(0, (metrics, _metrics_name(step)))
        try:
            for item, name in files:
                dump(item, os.path.join(self._pending, name))
            for _, name in files:
                os.replace(os.path.join(self._pending, name), self._path(name))
        finally:  # after a failure: nothing of this step stays in the pending folder
            for _, name in files:
                _unlink(os.path.join(self._pending, name))
        _fsync_folder(self._directory)
        with self._records_lock:
            self._scores[step] = score
            dropped = sorted(set(self._scores) - self._retained(self._scores))
            for old in dropped:
                del self._scores[old]
        for old in dropped:
            self._delete(old)

    def _delete(self, step: int) -> None:
        _unlink(self._path(_checkpoint_name(step)))  # the checkpoint first: no orphan step
        _unlink(self._path(_metrics_name(step)))

    def _forget(self, step: int) -> None:
        """Drop a step whose checkpoint is gone or moved aside (its metrics file too)."""
        _unlink(self._path(_metrics_name(step)))
        with self._records_lock:
            del self._scores[step]

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError(f"the CheckpointManager of {self._directory!r} is closed")

    # -- public API --------------------------------------------------------------------------

    @property
    def directory(self) -> str:
        """The absolute path of the managed folder."""
        return self._directory

    def save(self, step: int, obj: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Save ``obj`` as the checkpoint of ``step``.

        With ``background=True`` this returns once ``obj`` is copied (see the class
        docstring) and the file is written on a background thread; otherwise once the
        checkpoint is complete and the retention rules are applied.

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
        step = _check_step(step)
        metrics = _check_metrics(metrics)
        score = self._score(metrics, step)
        self._writer.wait()  # never two writers; raises the previous save's error
        newest = self.latest_step()
        if newest is not None and step <= newest:
            raise ValueError(f"step {step} is not after the newest saved step {newest}")
        if self._background:
            snapshot = _host_snapshot(obj)
            self._writer.start(lambda: self._write(step, snapshot, metrics, score))
        else:
            self._write(step, obj, metrics, score)

    def restore(self, step: int | None = None, safe: bool = False) -> Any:
        """Load a checkpoint (after waiting for a pending save).

        Parameters
        ----------
        step : int or None, optional
            The step to load; ``None`` loads the newest checkpoint that loads. A newer
            checkpoint that does not load (truncated or corrupted: :func:`load` raises
            ``ValueError``) is skipped with a :class:`RuntimeWarning` naming the file; with
            ``safe=False`` it is also renamed to ``<name>.corrupt`` and leaves the manager's
            steps, so that training can go on from the restored step (where that name is
            taken, e.g. by a folder, it is left in place). With ``safe=True`` a
            refusal cannot be told from corruption, and the file is left in place. A
            checkpoint file removed from the folder since the manager listed it is skipped
            the same way (with a warning) and leaves the manager's steps.
        safe : bool, optional
            Passed to :func:`load`: ``True`` never unpickles.

        Returns
        -------
        obj : object
            The restored object.

        Raises
        ------
        FileNotFoundError
            If there is no checkpoint of ``step``, or (``step=None``) none that loads.
        ValueError
            If the checkpoint of an explicit ``step`` does not load, or the manager is
            closed.
        """
        self._check_open()
        if step is not None:
            step = _check_step(step)
        if not isinstance(safe, bool):
            raise TypeError(f"safe must be a bool, got {safe!r}")
        self._writer.wait()
        if step is not None:
            if step not in self.all_steps():
                raise FileNotFoundError(
                    f"no checkpoint of step {step} in {self._directory!r}; steps: "
                    f"{self.all_steps()}"
                )
            return load(self._path(_checkpoint_name(step)), safe=safe)
        for candidate in reversed(self.all_steps()):
            path = self._path(_checkpoint_name(candidate))
            try:
                return load(path, safe=safe)
            except FileNotFoundError as err:  # removed behind the manager's back
                self._forget(candidate)
                action, error = "it is gone", err
            except ValueError as err:
                action, error = "left in place", err
                if not safe:
                    try:
                        os.replace(path, path + ".corrupt")
                    except OSError as rename_error:  # e.g. a folder holds that name
                        action = f"left in place, as it could not be renamed: {rename_error}"
                    else:
                        self._forget(candidate)
                        action = f"renamed to {os.path.basename(path)}.corrupt"
            warnings.warn(
                f"skipping checkpoint {path!r} (step {candidate}), which does not load "
                f"({action}): {error}",
                RuntimeWarning,
                stacklevel=2,
            )
        raise FileNotFoundError(f"no checkpoint in {self._directory!r} loads")

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``; a save still running is not counted."""
        with self._records_lock:
            return max(self._scores, default=None)

    def best_step(self) -> int | None:
        """The complete step with the best ``best_fn`` score, or ``None`` (no ``best_fn``, or
        no step saved with metrics)."""
        with self._records_lock:
            return self._best(self._scores)

    def all_steps(self) -> list[int]:
        """The complete steps in the folder, oldest first."""
        with self._records_lock:
            return sorted(self._scores)

    def wait(self) -> None:
        """Wait for the pending background save; raise its error, if it failed."""
        self._writer.wait()

    def close(self) -> None:
        """Finish the pending save and release the folder; raise the save's error, if any.

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
