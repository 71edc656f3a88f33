"""The :class:`RolloutWorker` actor: gymnasium rollouts into a :class:`ReplayServer`."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import ray

from coax_utils._checks import check_float, check_int, check_seed, is_int
from coax_utils.distributed._actor import RemoteClass
from coax_utils.distributed._writer import ReplayWriter
from coax_utils.replay import NStep, RecordTransitions, TransitionBatch

__all__ = ["RolloutWorker"]

_RETURNS_KEPT = 100
_CHUNK_SIZE = 256  # the default chunk size


def _check_args(
    env_fn: Any,
    policy: Any,
    server: Any,
    params: Any,
    *,
    n: int = 1,
    gamma: float = 0.99,
    chunk_size: int = _CHUNK_SIZE,
    max_delay: float | None = 1.0,
    priority_fn: Any = None,
    sync_every: int = 100,
    seed: int | None = None,
    num_envs: int | None = None,
    batch_size: int | None = None,
) -> None:
    if not (callable(env_fn) or isinstance(env_fn, str)):
        raise TypeError(
            f"env_fn must be a callable returning a gymnasium.Env or an env id, got {env_fn!r}"
        )
    if not callable(policy):
        raise TypeError(f"policy must be a callable policy(params, s, rng) -> a, got {policy!r}")
    if priority_fn is not None and not callable(priority_fn):
        raise TypeError(f"priority_fn must be None or a callable, got {priority_fn!r}")
    if not isinstance(server, ray.actor.ActorHandle):
        raise TypeError(f"server must be a ReplayServer actor handle, got {type(server).__name__}")
    if params is None:
        raise ValueError(
            "params must be a ParameterServer actor handle or a parameter pytree, got None"
        )
    for name, value in (("n", n), ("chunk_size", chunk_size), ("sync_every", sync_every)):
        check_int(value, name, low=1)
    if batch_size is not None:
        check_int(batch_size, "batch_size", low=1)
        if chunk_size != _CHUNK_SIZE:
            raise TypeError("batch_size is the old name of chunk_size: pass chunk_size only")
    if max_delay is not None:
        check_float(max_delay, "max_delay", low=0.0, low_open=True)
    check_float(gamma, "gamma", 0.0, 1.0)
    check_seed(seed, "seed")
    if num_envs is not None:
        check_int(num_envs, "num_envs", low=1)


def _make_env(env_fn: Callable[[], Any] | str, num_envs: int | None) -> Any:
    """The worker's env: a gymnasium env, or with ``num_envs`` a vector env of that many."""
    import gymnasium

    if num_envs is None:
        return gymnasium.make(env_fn) if isinstance(env_fn, str) else env_fn()
    if isinstance(env_fn, str):
        return gymnasium.make_vec(env_fn, num_envs=num_envs)
    env = env_fn()
    if not isinstance(env, gymnasium.vector.VectorEnv):
        first = [env]
        env = gymnasium.vector.SyncVectorEnv([first.pop] + [env_fn] * (num_envs - 1))
    if env.num_envs != num_envs:
        raise ValueError(
            f"env_fn() returned a vector env of {env.num_envs} sub-envs, not {num_envs}"
        )
    return env


class _Outbox:
    """What the recorder writes into: every traced batch leaves the worker through
    ``RolloutWorker._emit``."""

    def __init__(self, emit: Callable[[TransitionBatch], None]) -> None:
        self.add = emit


class RolloutWorker(RemoteClass):
    r"""A Ray actor that runs a gymnasium env (or vector env) and feeds n-step transitions to
    a server.

    Start it with ``RolloutWorker.remote(env_fn, policy, server, params, ...)``. The worker
    steps its env with ``policy(params, s, rng)``, traces n-step transitions with
    :class:`coax_utils.replay.NStep` (through :class:`~coax_utils.replay.RecordTransitions`),
    and sends them to a :class:`ReplayServer` (or a shard of a :class:`ShardedReplay`)
    through a :class:`ReplayWriter`: in chunks of ``chunk_size`` transitions, one Ray call
    each, a chunk leaving at the latest ``max_delay`` seconds after its first transition.

    With ``num_envs`` the worker runs a vector env of that many sub-envs: ``policy(params, S,
    rng)`` gets the batched observations (leading axis ``num_envs``) and returns one action
    per sub-env (NumPy or JAX arrays: a jitted policy works as is; draw its key from
    ``rng``), and every vector step is traced in one call for all sub-envs
    (:class:`~coax_utils.replay.VectorNStep`), with gymnasium's autoreset modes and gymnax's
    ``final_observation`` handled as in
    :class:`~coax_utils.replay.RecordVectorTransitions`. Initial priorities come from
    ``priority_fn(params, transition_batch)``, called on every traced batch (one env step's,
    or one vector step's for all sub-envs) with the parameters it was traced under (e.g.
    :math:`|\delta|`, the absolute TD error); without it, new transitions get the buffer's
    current maximum priority.

    Episode ends do not flush the writer: with short episodes, or sub-envs of a vector env
    ending episodes every few steps, that would send many small chunks (one Ray call each);
    ``max_delay`` bounds how long a finished episode's transitions wait instead.

    Parameters come from a :class:`ParameterServer`: the worker pulls the latest version
    before its first step and then every ``sync_every`` steps (only changed parameters are
    sent). A plain pytree (or a Ray object ref to one) instead fixes the parameters. A store
    whose latest version is behind the worker's (Ray restarted it from its initial
    parameters) makes the pull raise ValueError rather than leave the worker on old ones.

    Two ways to run:

    - ``run(num_steps)``: take exactly ``num_steps`` env steps, flush the writer, wait for
      the server's acknowledgements and return the statistics (blocking; good for tests and
      synchronous schedules);
    - ``start()`` / ``stop()``: step in a background thread of the actor until ``stop()``,
      which flushes the writer, waits for the server's acknowledgements (at most
      ``stop(timeout)`` seconds) and returns the statistics. ``ray.kill(worker)`` ends the
      actor process at any time; the server keeps every chunk that reached it (a chunk
      lands whole or not at all, and a writer's chunks in order): a killed worker loses at
      most what it traced since its last acknowledgement (``transitions_sent -
      transitions_added``), never an acknowledged transition. A worker
      that Ray restarts (``max_restarts``) starts over as constructed: statistics at 0, no
      background loop until ``start()`` is called again, and with a ``seed`` the same
      episodes again.

    One chunk is in flight at a time; while a second full chunk waits for it (a rate
    limiter holding the adds), the worker waits too, and ``stop()`` interrupts that wait.
    An error while stepping or sending (raised by the server, e.g. a rejected chunk, or by
    the env, ``policy`` or ``priority_fn``) stops the worker, in ``run`` and ``stop`` as in
    the background loop: that call and every later ``run``, ``start``, ``stop`` and
    ``stats`` raise it, so the worker never steps on past transitions that did not reach the
    server. A failed parameter pull (e.g. nothing published yet) changes nothing: ``run``
    raises it and may be called again; in the background loop it stops the worker too.

    Parameters
    ----------
    env_fn : callable or str
        ``env_fn()`` returns a :class:`gymnasium.Env`; a string is a gymnasium env id. With
        ``num_envs``, ``env_fn()`` may also return a vector env of ``num_envs`` sub-envs
        (else the worker makes a :class:`gymnasium.vector.SyncVectorEnv` of ``num_envs``
        calls), and an env id is made with :func:`gymnasium.make_vec` (the env's own vector
        implementation where it has one).
    policy : callable
        ``policy(params, s, rng) -> a`` with ``rng`` a :class:`numpy.random.Generator`
        (batched with ``num_envs``).
    server : ray.actor.ActorHandle
        A :class:`ReplayServer` handle, or one of :attr:`ShardedReplay.shards`.
    params : ray.actor.ActorHandle or pytree
        A :class:`ParameterServer` handle, or fixed parameters.
    n : int
        Number of steps of the n-step returns.
    gamma : float
        Discount factor in [0, 1] (a real number: not a string or a bool).
    chunk_size : int
        Transitions per chunk, i.e. per Ray call to the server (>= 1; with a rate limiter,
        at most its :meth:`RateLimiter.max_insert`, checked at the first chunk).
    max_delay : float or None
        Seconds (> 0) a transition waits at most before its chunk is sent; None: only full
        chunks, ``run`` and ``stop`` send.
    priority_fn : callable, optional
        ``priority_fn(params, transition_batch) -> Adv`` (one value per transition).
    sync_every : int
        Env steps between parameter pulls.
    seed : int, optional
        Seeds the env's first reset, its action space and ``rng`` (>= 0).
    num_envs : int, optional
        Run a vector env of this many sub-envs (>= 1); ``steps`` in the statistics then
        counts sub-env steps.
    batch_size : int, optional
        The old name of ``chunk_size`` (kept for compatibility; ``max_in_flight`` is gone:
        the writer keeps one chunk in flight).

    Raises
    ------
    TypeError, ValueError
        For bad arguments (raised by ``RolloutWorker.remote`` in the calling process).
    """

    def __init__(
        self,
        env_fn: Callable[[], Any] | str,
        policy: Callable[[Any, Any, np.random.Generator], Any],
        server: Any,
        params: Any,
        *,
        n: int = 1,
        gamma: float = 0.99,
        chunk_size: int = _CHUNK_SIZE,
        max_delay: float | None = 1.0,
        priority_fn: Callable[[Any, TransitionBatch], Any] | None = None,
        sync_every: int = 100,
        seed: int | None = None,
        num_envs: int | None = None,
        batch_size: int | None = None,
    ) -> None:
        _check_args(
            env_fn,
            policy,
            server,
            params,
            n=n,
            gamma=gamma,
            chunk_size=chunk_size,
            max_delay=max_delay,
            priority_fn=priority_fn,
            sync_every=sync_every,
            seed=seed,
            num_envs=num_envs,
            batch_size=batch_size,
        )
        self._num_envs = num_envs
        env = _make_env(env_fn, num_envs)
        self._env = RecordTransitions(env, _Outbox(self._emit), NStep(n=n, gamma=gamma))
        self._autoreset = None if num_envs is None else self._env.autoreset_mode
        self._policy = policy
        self._priority_fn = priority_fn
        self._server = server
        if isinstance(params, ray.actor.ActorHandle):
            self._param_server, self._params, self._version = params, None, 0
        else:
            self._param_server, self._params, self._version = None, params, 0
        self._chunk_size = chunk_size if batch_size is None else batch_size
        self._max_delay = max_delay
        self._writer: ReplayWriter | None = None  # made at the first transition
        self._sync_every = sync_every
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        if seed is not None:
            self._env.action_space.seed(seed)

        self._obs: Any = None
        self._episode_return = np.zeros(num_envs or 1)
        self._synced_at = 0
        self._steps = 0
        self._episodes = 0
        self._returns: collections.deque = collections.deque(maxlen=_RETURNS_KEPT)
        self._returns_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._error: BaseException | None = None

    @classmethod
    def _validate_args(cls, *args: Any, **kwargs: Any) -> None:
        _check_args(*args, **kwargs)

    # -- the rollout loop ------------------------------------------------------------------

    def _sync_params(self) -> None:
        if self._param_server is None:
            return
        if self._version == 0:
            version, params = ray.get(self._param_server.get.remote())
            if params is None:
                raise ValueError(
                    "the ParameterServer holds no parameters yet; publish them with "
                    "set.remote(params) before the workers run"
                )
            self._version, self._params = version, params
            self._synced_at = self._steps
        elif self._steps - self._synced_at >= self._sync_every:
            newer = ray.get(self._param_server.get_if_newer.remote(self._version))
            self._synced_at = self._steps
            if newer is not None:
                self._version, self._params = newer

    def _step(self) -> None:
        """One step of the env (of every sub-env of a vector env), recorded."""
        self._sync_params()  # changes nothing when it raises: run() may be called again
        with self._stop_on_error():
            if self._obs is None:
                self._obs, _ = self._env.reset(seed=self._seed if self._episodes == 0 else None)
                self._episode_return[:] = 0.0
            a = self._policy(self._params, self._obs, self._rng)
            if self._num_envs is not None:
                a = jax.tree_util.tree_map(np.asarray, a)
            # the recorder traces the step and hands what it pops to _emit
            s_next, r, terminated, truncated, _ = self._env.step(a)
            self._steps += self._num_envs or 1
            self._episode_return += np.asarray(r, np.float64)
            ended = np.flatnonzero(np.logical_or(terminated, truncated))
            if ended.size:
                self._episodes += ended.size
                with self._returns_lock:
                    self._returns.extend(self._episode_return[ended].tolist())
                self._episode_return[ended] = 0.0
            if self._num_envs is None and ended.size:
                self._obs = None
            elif ended.size and self._autoreset == "Disabled":  # reset the ended sub-envs
                mask = np.logical_or(terminated, truncated)
                self._obs, _ = self._env.reset(options={"reset_mask": mask})
            else:
                self._obs = s_next

    def _emit(self, batch: TransitionBatch) -> None:
        """The one place traced transitions leave the worker: into the writer, which sends
        them in chunks. Its waits end early once ``stop()`` sets the stop flag: the rows
        stay taken and go out with ``stop()``'s flush."""
        Adv = None
        if self._priority_fn is not None:
            Adv = np.asarray(self._priority_fn(self._params, batch))
        if self._writer is None:  # its constructor asks the server once (a Ray call)
            self._writer = ReplayWriter(
                self._server,
                chunk_size=self._chunk_size,
                max_delay=self._max_delay,
                interrupt=self._stop_event.is_set,
            )
        self._writer.add(batch, Adv)

    def _flush(self, timeout: float | None) -> None:
        """Flush the writer and wait for every acknowledgement (at most ``timeout`` s).

        The server's errors stop the worker; running out of time does not (TimeoutError:
        what is left stays on its way, a later call waits on)."""
        if self._writer is None:
            return
        with self._stop_on_error():
            try:
                self._writer.flush(timeout=timeout)
            except TimeoutError as exc:
                if isinstance(exc, ray.exceptions.RayError):  # the server's own TimeoutError
                    raise
                late = self._writer.num_unacknowledged
            else:
                return
        raise TimeoutError(
            f"{late} transitions sent were not acknowledged by the server within {timeout} s "
            "(a rate-limited shard holds adds until the learner samples); call stop() again "
            "to wait on, or ray.kill the worker"
        )

    def _loop(self) -> None:
        try:
            with self._stop_on_error():
                while not self._stop_event.is_set():
                    self._step()
        except BaseException:  # recorded: stop(), stats() and every later call raise it
            pass

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    @contextlib.contextmanager
    def _stop_on_error(self) -> Iterator[None]:
        """Record an error of the block: it stops the worker (see :meth:`_raise_error`)."""
        try:
            yield
        except BaseException as exc:
            self._error = exc
            raise

    # -- public methods (actor methods) ----------------------------------------------------

    def run(self, num_steps: int) -> dict[str, Any]:
        """Take ``num_steps`` env steps, send every traced transition, wait for the server.

        Every transition traced so far is sent (the writer is flushed) and acknowledged when
        this returns; transitions of unfinished n-step traces stay in the tracer.

        Parameters
        ----------
        num_steps : int
            The number of env steps (>= 0); with ``num_envs``, rounded up to whole vector
            steps of ``num_envs`` sub-env steps each.

        Returns
        -------
        dict
            The statistics (see :meth:`stats`).

        Raises
        ------
        ValueError
            If ``num_steps`` is negative or not an int.
        RuntimeError
            If the worker is running in the background (after :meth:`start`).
        Exception
            The error that stopped the worker, in this call or before (see the class
            docstring).
        """
        if not is_int(num_steps) or num_steps < 0:
            raise ValueError(f"num_steps must be an int >= 0, got {num_steps!r}")
        if self._thread is not None:
            raise RuntimeError("the worker is running in the background; call stop() first")
        self._raise_error()
        per_step = self._num_envs or 1
        for _ in range(-(-num_steps // per_step)):  # whole vector steps
            self._step()
        self._flush(None)
        return self._stats()

    def start(self) -> None:
        """Start stepping in a background thread of the actor (until :meth:`stop`).

        Raises
        ------
        RuntimeError
            If the worker is already running.
        Exception
            The error that stopped the worker, if any.
        """
        if self._thread is not None:
            raise RuntimeError("the worker is already running")
        self._raise_error()
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._loop, name="rollout", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> dict[str, Any]:
        """Stop the background loop, flush the writer, wait for the server.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most for the server's acknowledgements (None: no limit). A
            shard with a rate limiter holds adds until the learner samples, so once the
            learner has stopped, only a timeout (or ``ray.kill``) ends the wait.

        Returns
        -------
        dict
            The final statistics (see :meth:`stats`).

        Raises
        ------
        TypeError, ValueError
            For a ``timeout`` that is not None or a finite number >= 0 (nothing is changed).
        TimeoutError
            If transitions were not acknowledged within ``timeout``. The worker is stopped
            and they stay on their way: a later ``stop`` (or ``run``) waits for them again.
        Exception
            The error that stopped the worker, if any (e.g. the server rejected a chunk), in
            the background loop, an earlier call or this call's flush.
        """
        if timeout is not None:
            check_float(timeout, "timeout", 0.0)
        if self._thread is not None:
            self._stop_event.set()
            self._thread.join()  # the loop ends after its step, also while the writer waits
            self._thread = None
            self._stop_event.clear()
        self._raise_error()
        self._flush(timeout)
        return self._stats()

    def stats(self) -> dict[str, Any]:
        """Statistics so far.

        Returns
        -------
        dict
            ``steps`` (env steps), ``episodes`` (finished episodes), ``transitions_sent``
            (handed to the writer: sent, or in its open chunk), ``transitions_added``
            (acknowledged by the server),
            ``params_version`` (version of the parameters in use; 0 for fixed parameters)
            and ``episode_returns`` (the last 100 undiscounted episode returns).

        Raises
        ------
        Exception
            The error that stopped the worker, if any.
        """
        self._raise_error()
        return self._stats()

    def _stats(self) -> dict[str, Any]:
        with self._returns_lock:
            returns = list(self._returns)
        writer = self._writer
        return {
            "steps": self._steps,
            "episodes": self._episodes,
            "transitions_sent": 0 if writer is None else writer.num_added,
            "transitions_added": 0 if writer is None else writer.num_acknowledged,
            "params_version": self._version,
            "episode_returns": returns,
        }
