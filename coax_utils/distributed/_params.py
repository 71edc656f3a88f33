"""The :class:`ParameterServer` actor: the learner's latest parameters, versioned."""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from coax_utils._checks import is_int
from coax_utils.distributed._actor import RemoteClass

__all__ = ["ParameterServer"]


def _frozen_copy(x: Any) -> np.ndarray:
    x = np.array(x)  # a copy: the publisher may change its arrays in place afterwards
    x.setflags(write=False)  # readers share it (in-process): none may change it for others
    return x


def _to_host(params: Any) -> Any:
    # Plain NumPy leaves: cheap to pickle, and readers need no accelerator.
    return jax.tree_util.tree_map(_frozen_copy, params)


def _containers_copy(params: Any) -> Any:
    # New dicts/lists around the shared read-only leaves: a reader that assigns into its
    # copy (in-process) changes nothing for the store or the other readers.
    return None if params is None else jax.tree_util.tree_map(lambda x: x, params)


class ParameterServer(RemoteClass):
    """A Ray actor holding the latest policy parameters with a version number.

    The learner publishes with ``set``; rollout workers poll with ``get_if_newer`` and
    receive the parameters only when they changed. Leaves are stored as read-only copies
    (NumPy arrays) and every reader gets containers (dicts, lists) of its own, so neither
    the publisher nor a reader can change published parameters in place, also when the
    class is used in-process.

    Keep Ray's default of one call at a time (``max_concurrency=1``): Ray then applies the
    ``set`` calls of the learner in the order it sent them. An actor started with more
    threads may apply two ``set`` calls in flight in either order, so that older parameters
    end up published under the newer version; there, wait for each ``set`` (``ray.get``)
    before sending the next.

    Parameters
    ----------
    params : pytree, optional
        Initial parameters (version 1); without them the version is 0 and ``get`` returns
        ``(0, None)`` until the first ``set``.

    Examples
    --------
    .. code-block:: python

        store = ParameterServer.remote(params)
        store.set.remote(jax.device_get(new_params))             # learner
        version, params = ray.get(store.get.remote())            # worker, first pull
        update = ray.get(store.get_if_newer.remote(version))     # None if unchanged

    In-process, without Ray:

    >>> import numpy as np
    >>> store = ParameterServer({"w": np.array([1.0, 2.0])})
    >>> store.get_if_newer(0)
    (1, {'w': array([1., 2.])})
    >>> store.set({"w": np.array([3.0, 4.0])}), store.get_if_newer(2)
    (2, None)
    """

    def __init__(self, params: Any = None) -> None:
        self._lock = threading.Lock()
        self._params = None if params is None else _to_host(params)
        self._version = 0 if params is None else 1

    def set(self, params: Any) -> int:
        """Publish new parameters; returns the new version number.

        Raises
        ------
        ValueError
            If ``params`` is None.
        """
        if params is None:
            raise ValueError("ParameterServer.set needs a parameter pytree, got None")
        params = _to_host(params)
        with self._lock:
            self._params = params
            self._version += 1
            return self._version

    def get(self) -> tuple[int, Any]:
        """Return ``(version, params)``; ``(0, None)`` before anything was published."""
        with self._lock:
            version, params = self._version, self._params
        return version, _containers_copy(params)

    def get_if_newer(self, version: int) -> tuple[int, Any] | None:
        """Return ``(version, params)`` if newer than ``version``, else None.

        Parameters
        ----------
        version : int
            The version the caller holds.

        Raises
        ------
        TypeError
            If ``version`` is not an int.
        ValueError
            If ``version`` is ahead of the latest version: the caller's parameters did not
            come from this store as it is now (e.g. Ray restarted it, which starts it over
            with its initial parameters), and "nothing newer" would keep the caller on them
            until the store's count passed it.
        """
        if not is_int(version):
            raise TypeError(f"version must be an int, got {version!r}")
        with self._lock:
            if int(version) > self._version:
                raise ValueError(
                    f"version {version} is ahead of this ParameterServer's latest version "
                    f"{self._version}: the store was restarted (it starts over from its "
                    "initial parameters) or the version came from another store"
                )
            if self._version <= int(version):
                return None
            newer, params = self._version, self._params
        return newer, _containers_copy(params)

    def version(self) -> int:
        """The version number of the latest parameters (0 if none were published)."""
        with self._lock:
            return self._version
