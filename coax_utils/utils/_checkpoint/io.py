"""Checkpoints: ``dump``, ``dumps``, ``load`` and ``loads``.

A checkpoint (format version 2) is a container of byte segments (see ``container``):

- segment 0: the structure of the object, as JSON (see ``decoder`` for its nodes), stored
  uncompressed (parsing a compressed one could take thousands of times the file's size);
- segment 1: the pickle section, a cloudpickle of the objects that are not plain data
  (functions, foreign classes, cycles), empty when there are none; its large buffers are
  out of band, buffers of the data tree listed in ``pickle_buffers``;
- segment 2: the small array buffers, one after the other;
- segments 3, 4, ...: one large array buffer each.

``load(..., safe=True)`` reads only the structure and the buffers, and refuses a file whose
pickle section is not empty. Files of format version 1 (a pickle with out-of-band buffers)
and coax's files (``lz4.frame.compress(cloudpickle.dumps(obj))``) load with ``safe=False``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from coax_utils._files import as_path, atomic_write, open_regular_file
from coax_utils._version import __version__
from coax_utils.utils._checkpoint.container import (
    RAW,
    Corrupt,
    FileSource,
    MemorySource,
    container_bytes,
    decompress_legacy_frame,
    is_legacy_frame,
    parse,
    read_segments,
    write_container,
)
from coax_utils.utils._checkpoint.decoder import Decoder, jax_array, segments_to_read
from coax_utils.utils._checkpoint.encoder import Encoder
from coax_utils.utils._checkpoint.errors import (
    CheckpointDamagedError,
    CheckpointNotReadableError,
    UnsafeCheckpointError,
)
from coax_utils.utils._checkpoint.registry import jax_array_budget

__all__ = ["dump", "dumps", "load", "loads"]

FORMAT_VERSION = 2
_META = {"format": "coax_utils checkpoint", "coax_utils": __version__}
_STRUCTURE, _PICKLES = 0, 1
_LOAD_ERRORS = (Corrupt, ValueError, TypeError, LookupError, ArithmeticError, AttributeError)


# -- format version 1 (read with safe=False only; its pickles name these three functions) ---


def _rebuild_ndarray(buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    """Rebuild a numpy array of a version-1 file (always writable)."""
    dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
    if buf is None:
        return np.empty(shape, dtype)
    flat = np.frombuffer(buf, dtype=np.uint8).view(dtype)
    arr = flat.reshape(shape) if order == "C" else flat.reshape(shape[::-1]).T
    return arr if arr.flags.writeable else arr.copy(order="K")


def _rebuild_jax_array(buf: Any, dtype: Any, shape: Any, weak_type: bool) -> jax.Array:
    """Rebuild a jax array of a version-1 file (placed on the default device)."""
    return jax_array(_rebuild_ndarray(buf, dtype, shape, "C"), bool(weak_type))


def _rebuild_jax_key(data: Any, impl: str) -> jax.Array:
    """Rebuild a typed PRNG key array of a version-1 file."""
    return jax.random.wrap_key_data(data, impl=str(impl))


class _OldUnpickler(pickle.Unpickler):
    """Unpickles files of format version 1 and coax's files (``safe=False`` only).

    The stateful classes of coax_utils 0.1 were pickled with their attributes, which their
    checked ``__checkpoint_restore__`` does not take: such a file is refused rather than
    half built.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "coax_utils.utils._checkpoint":  # where version 1 had its rebuilders
            module = __name__
        obj = super().find_class(module, name)
        if module.startswith("coax_utils.") and hasattr(obj, "__checkpoint_restore__"):
            raise CheckpointNotReadableError(
                f"it holds a {name} of coax_utils 0.1, whose saved attributes this version "
                "cannot restore; load it with coax_utils 0.1 and save its data (or the object "
                "with replay buffers' save(folder)) again"
            )
        return obj


# -- writing and reading ---------------------------------------------------------------------


def _segments(obj: Any, max_jax_arrays: int | None) -> tuple[list[list[memoryview]], int]:
    """Encode ``obj``: the container's segments (errors surface before anything is written)
    and the number of jax arrays its data tree holds."""
    encoder = Encoder(max_jax_arrays)
    tree = encoder.encode(obj)
    pickled = b""
    if encoder.pickled:
        pickled, tree["pickle_buffers"] = encoder.pickle_section()
    segments = encoder.segments
    segments[_STRUCTURE] = [memoryview(json.dumps(tree, separators=(",", ":")).encode())]
    segments[_PICKLES] = [memoryview(pickled)]
    return segments, encoder.jax_arrays


class _TooManyJaxArrays(Exception):
    """The file written holds more jax arrays than a reader allows a file of its size."""


def _check_size(size: int, jax_arrays: int) -> None:
    if jax_arrays > jax_array_budget(size):
        raise _TooManyJaxArrays(jax_array_budget(size))


def _written(obj: Any, write: Callable[[list[list[memoryview]], int], Any]) -> Any:
    """Encode ``obj`` and return ``write(segments, jax_arrays)``, which writes the container
    and calls :func:`_check_size` before it makes it visible.

    Where the file holds more jax arrays than :func:`jax_array_budget` allows a file of its
    size (many tiny ones), it is encoded and written again with the arrays past that number
    in the pickle section: ``dump`` never writes what ``load`` refuses.
    """
    limit = None
    while True:
        try:
            return write(*_segments(obj, limit))
        except _TooManyJaxArrays as e:
            limit = e.args[0]


def _unsafe(what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"it holds {what}, which only unpickling can restore, and safe=True never unpickles. "
        "Load it with safe=False only if you trust its source. A file that safe mode reads "
        "holds plain data only: no functions or cycles, and classes of your own registered "
        "with coax_utils.utils.register_checkpoint_type"
    )


def _unpickle(stream: Any, buffers: list[Any] | None = None, old: bool = False) -> Any:
    unpickler = _OldUnpickler if old else pickle.Unpickler
    try:
        return unpickler(io.BytesIO(stream), buffers=buffers).load()
    except (ImportError, AttributeError) as e:  # intact, names what is not installed here
        raise CheckpointNotReadableError(
            f"its pickle section needs something this environment lacks ({e}); install or "
            "import it and load again"
        ) from None
    except (pickle.UnpicklingError, EOFError) as e:
        raise Corrupt(f"the pickle is damaged ({e})") from None


def _load_v2(data: Any, container: Any, safe: bool) -> Any:
    sizes = [n for n, _ in container.segments]
    if len(sizes) < 3:
        raise Corrupt("fewer segments than a version-2 checkpoint has")
    if any(chunk[3] != RAW for chunk in container.segments[_STRUCTURE][1]):
        raise Corrupt("the structure is stored compressed")
    raw = read_segments(data, container, [_STRUCTURE])[_STRUCTURE]
    try:
        structure = json.loads(raw.tobytes())
    except (ValueError, RecursionError) as e:
        raise Corrupt(f"the structure is not valid JSON ({e})") from None
    if type(structure) is not dict:
        raise Corrupt("the structure is not a checkpoint tree")
    if safe and sizes[_PICKLES]:
        described = structure.get("pickled")
        first = described[0] if isinstance(described, list) and described else "?"
        raise _unsafe(f"data that is not plain data: {str(first)[:300]}")
    if "pickle_buffers" in structure and not sizes[_PICKLES]:
        raise Corrupt("the structure names buffers of a pickle section the file does not have")
    segments = read_segments(data, container, segments_to_read(structure, sizes))
    decoder = Decoder(structure, raw.nbytes, segments, None if safe else [], data.size)
    del segments  # the decoder hands each large buffer to its owner and drops it
    if not safe and sizes[_PICKLES]:
        stream = read_segments(data, container, [_PICKLES])[_PICKLES]
        buffers = [pickle.PickleBuffer(b) for b in decoder.pickle_buffers()]  # as dumped
        decoder.pickled = _unpickle(stream, buffers)
        if type(decoder.pickled) is not list:
            raise Corrupt("the pickle section is not a list")
    return decoder.decode()


def _load_from(data: Any, safe: bool, source: str) -> Any:
    try:
        if is_legacy_frame(data):
            if safe:
                raise _unsafe("a legacy coax pickle (lz4 frame)")
            return _unpickle(decompress_legacy_frame(data), old=True)
        container = parse(data, FORMAT_VERSION)
        if container.version == 2:
            return _load_v2(data, container, safe)
        if safe:
            raise _unsafe("a pickle (format version 1)")
        segments = read_segments(data, container, list(range(len(container.segments))))
        return _unpickle(segments[0], [segments[i] for i in range(1, len(segments))], old=True)
    except CheckpointNotReadableError as e:
        raise type(e)(f"{source} is intact but cannot be read here: {e}") from None
    except (*_LOAD_ERRORS, RecursionError) as e:
        raise CheckpointDamagedError(
            f"{source} is damaged or forged, not a valid coax_utils checkpoint: {e}. Nothing "
            "in it can be trusted; restore an older checkpoint"
        ) from None


_REFERENCES = """
    .. warning::

        References between objects are only preserved within one dumped object: dump the
        whole state as one dict or tuple (see :doc:`/checkpoints`).
"""


def dumps(obj: Any) -> bytes:
    """Serialize an object to an lz4-compressed byte-string.

    Plain data (containers, numbers, strings, bytes, numpy and jax arrays of non-object
    dtypes, PRNG keys, numpy random generators, optax/haiku/coax_utils states and coax_utils
    stateful objects such as replay buffers) is stored as a data tree that
    ``loads(..., safe=True)`` reads without unpickling; anything else (functions, jitted
    functions, classes of other packages) goes to a pickle section (cloudpickle). Array
    memory is compressed in chunks with lz4 on a few threads, and every part is covered by a
    CRC-32. jax arrays come back as jax arrays on the default device (with their weak
    type); numpy arrays as writable numpy arrays. See :doc:`/checkpoints` for the format.

    {references}

    Parameters
    ----------
    obj : object
        Plain data, or any object cloudpickle can pickle.

    Returns
    -------
    s : bytes
        The checkpoint, to be read back with :func:`loads`.

    Raises
    ------
    pickle.PicklingError, TypeError, AttributeError
        When a part of ``obj`` that is not plain data cannot be pickled.

    Examples
    --------
    >>> import numpy as np
    >>> from coax_utils.utils import dumps, loads
    >>> state = {'step': 3, 'w': np.arange(6, dtype=np.float32).reshape(2, 3)}
    >>> restored = loads(dumps(state), safe=True)
    >>> restored['step'], restored['w'].dtype, restored['w'].shape
    (3, dtype('float32'), (2, 3))
    """

    def write(segments: list[list[memoryview]], jax_arrays: int) -> bytes:
        out = container_bytes(FORMAT_VERSION, _META, segments, uncompressed=1)
        _check_size(len(out), jax_arrays)
        return out

    return _written(obj, write)


def loads(s: bytes | bytearray | memoryview, safe: bool = False) -> Any:
    """Load an object from a byte-string that was created by :func:`dumps`.

    Byte-strings of format version 1 and of coax (``lz4.frame.compress(cloudpickle.dumps(
    obj))``) are read too, with ``safe=False``.

    .. danger::

        With the default ``safe=False`` the pickle section (if any) is unpickled, which can
        run arbitrary code: only load data from a source you trust. For anything else use
        ``safe=True``.

    {references}

    Parameters
    ----------
    s : bytes, bytearray or memoryview
        A checkpoint byte-string.
    safe : bool, optional
        Never unpickle: read the data tree only, rebuilding registered types through their
        checked constructors, and refuse data that has a pickle section (and files of
        format version 1 or of coax, which are pickles) with
        :class:`UnsafeCheckpointError`.

    Returns
    -------
    obj : object
        The restored object.

    Raises
    ------
    CheckpointDamagedError
        If ``s`` is damaged or forged: foreign, truncated, corrupted (checksum mismatch), or
        lying about any size, count or invariant of the objects it holds.
    CheckpointNotReadableError
        If ``s`` is intact but cannot be read here: a type that is not registered, 64-bit
        jax arrays while ``jax_enable_x64`` is off, a newer format, or (with ``safe=True``)
        data that needs unpickling (:class:`UnsafeCheckpointError`, whose message names the
        first object that is not plain data). Both families are ValueErrors.

    Examples
    --------
    >>> from coax_utils.utils import dumps, loads
    >>> loads(dumps({'a': [1, 2.5, 'x']}), safe=True)
    {'a': [1, 2.5, 'x']}
    """
    if isinstance(s, str) or not isinstance(s, (bytes, bytearray, memoryview)):
        raise TypeError(f"s must be bytes, bytearray or memoryview, got {type(s).__name__}")
    return _load_from(MemorySource(memoryview(s).cast("B")), bool(safe), "the given data")


def dump(obj: Any, filepath: str | os.PathLike) -> None:
    """Save an object to disk.

    The file holds the same bytes :func:`dumps` returns. It is written atomically: the data
    goes to a temporary file in the same folder, which is fsynced and renamed over
    ``filepath``; the folder is fsynced too. A dump that fails leaves the previous file
    intact and no temporary file; one that is killed leaves the previous file intact and a
    temporary file that the next dump into that folder removes. The new file keeps the
    permission bits of the file it replaces. Missing parent folders are created. See
    :doc:`/checkpoints`.

    {references}

    Parameters
    ----------
    obj : object
        Plain data, or any object cloudpickle can pickle (see :func:`dumps`).
    filepath : str, bytes or os.PathLike
        Where to store the object.

    Raises
    ------
    TypeError
        If ``filepath`` is not a path.
    pickle.PicklingError, TypeError, AttributeError
        When ``obj`` cannot be serialized (nothing is written).
    OSError
        When the file cannot be written (the previous file is kept).

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> from coax_utils.utils import dump, load
    >>> path = os.path.join(tempfile.mkdtemp(), 'run', 'ckpt.pkl.lz4')
    >>> dump({'w': np.ones(3)}, path)
    >>> load(path, safe=True)['w']
    array([1., 1., 1.])
    """
    path = as_path(filepath)

    def write(segments: list[list[memoryview]], jax_arrays: int) -> None:
        def write_all(place: Callable[[int, Any], None]) -> None:
            size = write_container(FORMAT_VERSION, _META, segments, place, uncompressed=1)
            _check_size(size, jax_arrays)

        atomic_write(path, write_all)

    _written(obj, write)  # serialization errors surface before any file is touched


def load(filepath: str | os.PathLike, safe: bool = False) -> Any:
    """Load an object from a file that was created by :func:`dump`.

    Files of format version 1 and of coax (an lz4 frame of a cloudpickle) are read too, with
    ``safe=False``.

    .. danger::

        With the default ``safe=False`` the pickle section (if any) is unpickled, which can
        run arbitrary code: only load files you trust. For files from anywhere else use
        ``safe=True``.

    {references}

    Parameters
    ----------
    filepath : str, bytes or os.PathLike
        File to load.
    safe : bool, optional
        Never unpickle (see :func:`loads`).

    Returns
    -------
    obj : object
        The restored object.

    Raises
    ------
    CheckpointDamagedError
        If the file is damaged or forged (see :func:`loads`; the message names the file).
    CheckpointNotReadableError
        If the file is intact but cannot be read here (see :func:`loads`).
    ValueError
        If the file is not a regular file (a FIFO, a folder or a device is refused at once).
    OSError
        If the file cannot be read (FileNotFoundError if it does not exist).

    Examples
    --------
    >>> import os, tempfile
    >>> from coax_utils.utils import dump, load
    >>> path = os.path.join(tempfile.mkdtemp(), 'ckpt.pkl.lz4')
    >>> dump({'episode': 7, 'name': 'cartpole'}, path)
    >>> load(path, safe=True)
    {'episode': 7, 'name': 'cartpole'}
    """
    path = as_path(filepath)
    with open_regular_file(path) as (fd, size):
        if hasattr(os, "preadv"):
            data: Any = FileSource(fd, size)
        else:  # read it whole where the OS has no preadv (macOS before 11)
            with os.fdopen(os.dup(fd), "rb") as f:
                data = MemorySource(memoryview(f.read()))
        return _load_from(data, bool(safe), f"file {path!r}")


for _fn in (dump, dumps, load, loads):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("    {references}\n", _REFERENCES.lstrip("\n"))
del _fn
