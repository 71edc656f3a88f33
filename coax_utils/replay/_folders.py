"""Replay folders: a host buffer saved as one ``.npy`` file per storage array beside a
``meta.lz4`` file of the rest of its state, and loaded back with every file checked."""

from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import time
from typing import Any

import numpy as np

from coax_utils import utils
from coax_utils._checks import checked_dtype, is_int
from coax_utils._files import open_regular_file
from coax_utils.replay._host_state import generator_from_record, split_state

__all__ = ["load_folder", "save_folder"]

_FOLDER_FORMAT = 2
_META = "meta.lz4"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _leftovers(target: str) -> tuple[dict[str, str], dict[str, str]]:
    """The folders of interrupted saves into ``target``: ``(staged, replaced)`` by token."""
    parent, base = os.path.split(target)
    staged, replaced = {}, {}
    for name in os.listdir(parent):
        for prefix, found in ((f".{base}.saving-", staged), (f".{base}.old-", replaced)):
            if name.startswith(prefix):
                found[name[len(prefix) :]] = os.path.join(parent, name)
    return staged, replaced


def _interrupted_swap(target: str) -> str | None:
    """The complete new folder of a save killed between its two renames, if ``target`` is
    missing because of one (the old folder was moved away, the new one not yet moved in)."""
    if os.path.lexists(target):
        return None
    staged, replaced = _leftovers(target)
    tokens = sorted(set(staged) & set(replaced))
    return staged[tokens[-1]] if tokens else None


def _is_saved_folder(path: str) -> bool:
    names = os.listdir(path)
    return all(n == _META or re.fullmatch(r"leaf_\d+\.npy", n) for n in names)


def _read_npy(path: str, dtype: np.dtype, shape: list, mmap_mode: str | None) -> np.ndarray:
    """The array of a ``.npy`` file that must hold ``dtype`` and ``shape``, opened once.

    The file must be a regular file, not a link; its header is checked against ``dtype``
    and ``shape``, and its size against the array's bytes, before anything is allocated or
    mapped (``np.load`` would allocate whatever a forged header claims).
    """
    with open_regular_file(path, follow_links=False) as (fd, size):
        with open(fd, "rb", closefd=False) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy format version {version}")
            read = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }[version]
            got_shape, fortran, got_dtype = read(f)
            if got_dtype != dtype or list(got_shape) != shape:
                raise ValueError(
                    f"it holds {got_dtype}{list(got_shape)}, the metadata says {dtype}{shape}"
                )
            start, nbytes = f.tell(), dtype.itemsize * math.prod(shape)
            if size < start + nbytes:
                raise ValueError(f"it is shorter than the {nbytes} bytes of its array")
            order = "F" if fortran else "C"
            if mmap_mode is not None and nbytes:
                return np.memmap(f, dtype, mmap_mode, start, tuple(shape), order)
            arr = np.empty(shape, dtype, order=order)
            if nbytes and f.readinto(arr.reshape(-1, order="A").view(np.uint8)) != nbytes:
                raise ValueError(f"it is shorter than the {nbytes} bytes of its array")
            return arr


def _write_npy(path: str, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.asanyarray(arr).view(np.ndarray), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def save_folder(buffer: Any, path: str | os.PathLike) -> None:
    """Save ``buffer`` to the folder ``path`` (see ``save`` of the host buffers)."""
    target = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(target)
    if os.path.lexists(target) and not (
        os.path.isdir(target) and not os.path.islink(target) and _is_saved_folder(target)
    ):
        raise ValueError(
            f"{target!r} exists and is not a folder written by save(); not replacing it"
        )
    meta, arrays, generators = split_state(buffer.__checkpoint_state__())
    os.makedirs(parent, exist_ok=True)
    staged, replaced = _leftovers(target)
    interrupted = _interrupted_swap(target)
    if interrupted is not None:  # finish the swap of a killed save: it was complete
        os.rename(interrupted, target)
        _fsync_path(parent)
    for leftover in list(staged.values()) + list(replaced.values()):
        if leftover != interrupted:
            _remove_tree(leftover)
    token = f"{time.time_ns():020d}-{secrets.token_hex(4)}"
    staging = os.path.join(parent, f".{base}.saving-{token}")
    os.mkdir(staging)
    try:
        files = []
        for i, (key, index, arr) in enumerate(arrays):
            file = f"leaf_{i}.npy"
            _write_npy(os.path.join(staging, file), arr)
            files.append(
                {
                    "file": file,
                    "key": key,
                    "index": index,
                    "dtype": arr.dtype.str,
                    "shape": list(arr.shape),
                }
            )
        record = {
            "format": _FOLDER_FORMAT,
            "class": type(buffer).__name__,
            "state": meta,
            "files": files,
            "generators": generators,
        }
        # written last: marks a complete folder
        utils.dump(record, os.path.join(staging, _META))
        _fsync_path(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.lexists(target):
        old = os.path.join(parent, f".{base}.old-{token}")
        os.rename(target, old)
        os.rename(staging, target)
        _fsync_path(parent)
        _remove_tree(old)
    else:
        os.rename(staging, target)
    _fsync_path(parent)


def load_folder(cls: type, path: str | os.PathLike, mmap_mode: str | None) -> Any:
    """A buffer of class ``cls`` read from the folder ``path`` (see ``load``)."""
    if mmap_mode not in ("c", "r", None):
        hint = " (writing through to a saved folder would break it; use save)"
        raise ValueError(
            f"mmap_mode must be 'c', 'r' or None, got {mmap_mode!r}"
            + (hint if mmap_mode in ("r+", "w+") else "")
        )
    target = os.path.abspath(os.fspath(path))
    folder = _interrupted_swap(target) or target
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no saved buffer at {target!r}")
    meta_path = os.path.join(folder, _META)

    def bad(what: str) -> ValueError:
        return ValueError(f"{folder!r} does not hold a complete saved {cls.__name__}: {what}")

    if not os.path.lexists(meta_path):
        raise bad(f"{_META} is missing (an incomplete save)")
    if os.path.islink(meta_path):  # (utils.load refuses FIFOs, folders and devices)
        raise bad(f"{_META} is a link, not a regular file")
    try:
        record = utils.load(meta_path, safe=True)
    except (ValueError, TypeError, OSError, EOFError) as e:
        raise bad(f"{_META} cannot be read ({e})") from None
    keys = ("format", "class", "state", "files", "generators")
    if not isinstance(record, dict) or set(record) != set(keys):
        raise bad(f"{_META} must hold a dict with the keys {list(keys)}")
    if record["class"] != cls.__name__:
        raise bad(f"it holds a {record['class']!r}")
    if record["format"] != _FOLDER_FORMAT:
        raise bad(f"unsupported format {record['format']!r}")
    state, files, generators = record["state"], record["files"], record["generators"]
    if not (isinstance(state, dict) and isinstance(files, list)):
        raise bad("state must be a dict and files a list")
    if not isinstance(generators, dict):
        raise bad("generators must be a dict")
    expected = {f"leaf_{i}.npy" for i in range(len(files))} | {_META}
    if set(os.listdir(folder)) != expected:
        raise bad(f"it must hold exactly {sorted(expected)}, found {os.listdir(folder)}")
    state = dict(state)
    for i, entry in enumerate(files):
        if not (isinstance(entry, dict) and entry.get("file") == f"leaf_{i}.npy"):
            raise bad(f"files[{i}] must describe leaf_{i}.npy")
        arr = _read_leaf(os.path.join(folder, entry["file"]), entry, mmap_mode, bad)
        key, index = entry.get("key"), entry.get("index")
        place = state.get(key) if isinstance(key, str) else "missing"
        if index is None and place is None and key in state:
            state[key] = arr
        elif is_int(index) and isinstance(place, list) and 0 <= index < len(place):
            if place[index] is not None:
                raise bad(f"files[{i}] points at {key}[{index}], which is not empty")
            state[key] = place = list(place)
            place[index] = arr
        else:
            raise bad(f"files[{i}] points at {key!r}[{index!r}], not an empty place")
    for key, generator in generators.items():
        if key not in state or state[key] is not None:
            raise bad(f"generator {key!r} has no empty place in the state")
        try:
            state[key] = generator_from_record(generator, key)
        except ValueError as e:
            raise bad(str(e)) from None
    try:
        return cls.__checkpoint_restore__(state)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None


def _read_leaf(path: str, entry: dict, mmap_mode: str | None, bad: Any) -> np.ndarray:
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if not (isinstance(dtype, str) and isinstance(shape, list)):
            raise bad(f"{entry['file']}: dtype and shape must be recorded")
        try:
            np_dtype = checked_dtype(dtype, "dtype")
            return _read_npy(path, np_dtype, shape, mmap_mode)
        except (TypeError, ValueError, OSError, EOFError) as e:
            raise bad(f"{entry['file']} cannot be read ({e})") from None
