"""The two families of errors a checkpoint load raises, both ``ValueError`` subclasses."""

from __future__ import annotations

__all__ = ["CheckpointDamagedError", "CheckpointNotReadableError", "UnsafeCheckpointError"]


class CheckpointDamagedError(ValueError):
    """The file is damaged or forged: its framing, a checksum, its length, a bound or an
    invariant of the data it holds does not hold.

    Nothing in it can be trusted; restore an older checkpoint (``CheckpointManager.restore``
    falls back past such a file with a warning).
    """


class CheckpointNotReadableError(ValueError):
    """The file is intact, but this process cannot read it as it is set up: a type in it is
    not registered (:func:`~coax_utils.utils.register_checkpoint_type`), it holds 64-bit jax
    arrays while ``jax_enable_x64`` is off, it holds a pickle section and ``safe=True`` was
    asked, or it was written by a newer version of coax_utils.

    Fix the set-up and load it again; the file is left as it is.
    """


class UnsafeCheckpointError(CheckpointNotReadableError):
    """A ``safe=True`` load met data that only unpickling could restore.

    The message names the first such object (its type and where it sits in the tree) and
    says how to proceed.
    """
