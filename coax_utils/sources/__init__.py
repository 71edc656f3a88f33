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
from coax_utils.sources._minari import MinariSource
from coax_utils.sources._minari import MinariSourceState

from coax_utils.utils import register_checkpoint_type as _register

__all__ = [
    "ArraySource",
    "ArraySourceState",
    "BatchedSource",
    "BatchedSourceState",
    "DiskSource",
    "DiskSourceState",
    "GymnaxSource",
    "GymnaxSourceState",
    "MinariSource",
    "MinariSourceState",
    "Source",
]

# This layer's checkpoint types, under the names files store (utils knows none of them).
for _cls in (
    ArraySourceState,
    BatchedSourceState,
    DiskSourceState,
    GymnaxSourceState,
    MinariSourceState,
):
    _register(_cls, f"coax_utils.sources.{_cls.__name__}")
del _cls, _register
