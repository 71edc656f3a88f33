"""Plain Python classes that start themselves as Ray actors (``Cls.remote(...)``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import ray

__all__ = ["RemoteClass", "wait_ready"]

_WAIT_SLICE = 0.1  # seconds between the checks of an interruptible wait


def wait_ready(
    ref: Any, deadline: float | None = None, interrupt: Callable[[], bool] | None = None
) -> bool:
    """Wait until the object ``ref`` is ready (True), in slices of 0.1 s; False as soon as
    ``interrupt()`` returns True or the ``deadline`` (``time.monotonic``) has passed.

    A plain ``ray.get`` cannot be told to stop; this wait can, e.g. by ``close()`` or
    ``stop()`` from another thread while the reply waits for a rate limiter."""
    while not ray.wait([ref], timeout=_WAIT_SLICE)[0]:
        if interrupt is not None and interrupt():
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
    return True


class _Hidden:
    """A class attribute that looks absent (``hasattr`` is False) on the actor copy."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        raise AttributeError("remote/options are only available on the local class")


_ACTOR_CLASSES: dict[type, Any] = {}


def _actor_class(cls: type) -> Any:
    """The Ray actor class made from ``cls`` (created once per class)."""
    actor_cls = _ACTOR_CLASSES.get(cls)
    if actor_cls is None:
        # The actor runs a subclass that hides the local-only class methods, so Ray neither
        # warns about overwriting ``remote`` nor exposes ``options`` as an actor method.
        namespace = {
            "remote": _Hidden(),
            "options": _Hidden(),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        local = type(cls.__name__, (cls,), namespace)
        groups = cls._concurrency_groups
        # Ray takes concurrency groups only here, not in ``.options``
        actor_cls = ray.remote(concurrency_groups=groups)(local) if groups else ray.remote(local)
        _ACTOR_CLASSES[cls] = actor_cls
    return actor_cls


class _Launcher:
    """What ``Cls.options(...)`` returns: validates the arguments, then starts the actor."""

    def __init__(self, cls: type[RemoteClass], actor_options: dict[str, Any]) -> None:
        self._cls = cls
        self._options = actor_options

    def remote(self, *args: Any, **kwargs: Any) -> ray.actor.ActorHandle:
        """Validate the constructor arguments here, then start the actor; returns its handle."""
        self._cls._validate_args(*args, **kwargs)
        return _actor_class(self._cls).options(**self._options).remote(*args, **kwargs)


class RemoteClass:
    """Mixin: ``Cls.remote(*args)`` starts ``Cls(*args)`` as a Ray actor.

    The constructor arguments are checked in the calling process first (``_validate_args``),
    so bad input raises its ValueError/TypeError right there instead of killing the actor.
    ``Cls.options(**ray_actor_options).remote(*args)`` passes options such as ``num_cpus``,
    ``name`` or ``max_restarts`` on to Ray; ``_ray_options`` holds the class's defaults and
    ``_concurrency_groups`` its Ray concurrency groups (fixed per class).
    """

    _ray_options: ClassVar[dict[str, Any]] = {}
    #: Ray concurrency groups of the actor class (name -> threads); methods join one with
    #: ``@ray.method(concurrency_group=name)``, the others share ``max_concurrency`` threads.
    _concurrency_groups: ClassVar[dict[str, int] | None] = None

    @classmethod
    def _validate_args(cls, *args: Any, **kwargs: Any) -> None:
        """Raise ValueError/TypeError for bad constructor arguments (default: no checks)."""

    @classmethod
    def options(cls, **actor_options: Any) -> _Launcher:
        """Ray actor options for the next start: ``Cls.options(num_cpus=0).remote(...)``.

        Parameters
        ----------
        **actor_options
            Any option of Ray's ``ActorClass.options`` (``num_cpus``, ``num_gpus``,
            ``resources``, ``name``, ``namespace``, ``lifetime``, ``max_restarts``,
            ``max_concurrency``, ``scheduling_strategy``, ...).

        Returns
        -------
        launcher
            An object whose ``remote(*args, **kwargs)`` starts the actor.
        """
        return _Launcher(cls, {**cls._ray_options, **actor_options})

    @classmethod
    def remote(cls, *args: Any, **kwargs: Any) -> ray.actor.ActorHandle:
        """Start an instance as a Ray actor (``ray.init`` must have run) and return its handle.

        The arguments are those of the constructor; they are validated in the calling
        process before anything is sent to the cluster.

        Returns
        -------
        ray.actor.ActorHandle
            Call methods as ``handle.method.remote(...)``; ``ray.get`` the returned refs.
        """
        return cls.options().remote(*args, **kwargs)
