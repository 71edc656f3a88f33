"""JIT-friendly streaming data sources: pure state machines usable inside ``jax.lax.scan``."""

from coax_utils.sources._array import ArraySource  # noqa: I001 (one name per line)
from coax_utils.sources._array import ArraySourceState
from coax_utils.sources._base import Source
from coax_utils.sources._batched import BatchedSource
from coax_utils.sources._batched import BatchedSourceState
from coax_utils.sources._disk import DiskSource
from coax_utils.sources._disk import DiskSourceState
from coax_utils.sources._gymnax import GymnaxSource
from coax_utils.sources._gymnax import GymnaxSourceState

__all__ = [
    "ArraySource",
    "ArraySourceState",
    "BatchedSource",
    "BatchedSourceState",
    "DiskSource",
    "DiskSourceState",
    "GymnaxSource",
    "GymnaxSourceState",
    "Source",
]
