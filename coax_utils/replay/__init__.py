"""Transitions, n-step tracing, and replay buffers (host-side and jittable)."""

from coax_utils.replay._frames import FrameStackReplayBuffer  # noqa: I001 (one name per line)
from coax_utils.replay._frames import PrioritizedFrameStackReplayBuffer
from coax_utils.replay._frames import frame_fingerprints
from coax_utils.replay._frames_functional import FrameStackBuffer
from coax_utils.replay._frames_functional import FrameStackBufferState
from coax_utils.replay._frames_functional import PrioritizedFrameStackBuffer
from coax_utils.replay._frames_functional import PrioritizedFrameStackBufferState
from coax_utils.replay._frames_functional import make_frame_stack_buffer
from coax_utils.replay._frames_functional import make_prioritized_frame_stack_buffer
from coax_utils.replay._functional import PrioritizedBuffer
from coax_utils.replay._functional import PrioritizedBufferState
from coax_utils.replay._functional import PrioritizedSample
from coax_utils.replay._functional import UniformBuffer
from coax_utils.replay._functional import UniformBufferState
from coax_utils.replay._functional import make_prioritized_buffer
from coax_utils.replay._functional import make_uniform_buffer
from coax_utils.replay._example import get_transition_batch
from coax_utils.replay._host import PrioritizedReplayBuffer
from coax_utils.replay._host import SimpleReplayBuffer
from coax_utils.replay._mesh import MeshBuffer
from coax_utils.replay._mesh import shard_buffer
from coax_utils.replay._minari import fill_from_minari
from coax_utils.replay._minari import save_as_minari
from coax_utils.replay._record import RecordTransitions
from coax_utils.replay._record import RecordVectorTransitions
from coax_utils.replay._record import next_observations
from coax_utils.replay._seq_common import SequenceReplaySample
from coax_utils.replay._seq_functional import PrioritizedSequenceBuffer
from coax_utils.replay._seq_functional import PrioritizedSequenceBufferState
from coax_utils.replay._seq_functional import SequenceBuffer
from coax_utils.replay._seq_functional import SequenceBufferState
from coax_utils.replay._seq_functional import make_prioritized_sequence_buffer
from coax_utils.replay._seq_functional import make_sequence_buffer
from coax_utils.replay._seq_host import PrioritizedSequenceReplayBuffer
from coax_utils.replay._seq_host import SequenceReplayBuffer
from coax_utils.replay._seq_record import RecordVectorSequences
from coax_utils.replay._sequence import SequenceSample
from coax_utils.replay._tracing import EpisodeDoneError
from coax_utils.replay._tracing import InsufficientCacheError
from coax_utils.replay._tracing import MonteCarlo
from coax_utils.replay._tracing import NStep
from coax_utils.replay._transition import TransitionBatch
from coax_utils.replay._vector_tracing import VectorMonteCarlo
from coax_utils.replay._vector_tracing import VectorNStep

from coax_utils.utils import register_checkpoint_type as _register

__all__ = [
    "EpisodeDoneError",
    "FrameStackBuffer",
    "FrameStackBufferState",
    "FrameStackReplayBuffer",
    "InsufficientCacheError",
    "MeshBuffer",
    "MonteCarlo",
    "NStep",
    "PrioritizedBuffer",
    "PrioritizedBufferState",
    "PrioritizedFrameStackBuffer",
    "PrioritizedFrameStackBufferState",
    "PrioritizedFrameStackReplayBuffer",
    "PrioritizedReplayBuffer",
    "PrioritizedSample",
    "PrioritizedSequenceBuffer",
    "PrioritizedSequenceBufferState",
    "PrioritizedSequenceReplayBuffer",
    "RecordTransitions",
    "RecordVectorSequences",
    "RecordVectorTransitions",
    "SequenceBuffer",
    "SequenceBufferState",
    "SequenceReplayBuffer",
    "SequenceReplaySample",
    "SequenceSample",
    "SimpleReplayBuffer",
    "TransitionBatch",
    "UniformBuffer",
    "UniformBufferState",
    "VectorMonteCarlo",
    "VectorNStep",
    "fill_from_minari",
    "frame_fingerprints",
    "get_transition_batch",
    "make_frame_stack_buffer",
    "make_prioritized_buffer",
    "make_prioritized_frame_stack_buffer",
    "make_prioritized_sequence_buffer",
    "make_uniform_buffer",
    "next_observations",
    "save_as_minari",
    "shard_buffer",
]

# This layer's checkpoint types, under the names files store (utils knows none of them).
for _cls in (
    FrameStackBuffer,
    FrameStackBufferState,
    FrameStackReplayBuffer,
    MonteCarlo,
    NStep,
    PrioritizedBuffer,
    PrioritizedBufferState,
    PrioritizedFrameStackBuffer,
    PrioritizedFrameStackBufferState,
    PrioritizedFrameStackReplayBuffer,
    PrioritizedReplayBuffer,
    PrioritizedSample,
    PrioritizedSequenceBuffer,
    PrioritizedSequenceBufferState,
    PrioritizedSequenceReplayBuffer,
    SequenceBuffer,
    SequenceBufferState,
    SequenceReplayBuffer,
    SequenceReplaySample,
    SequenceSample,
    SimpleReplayBuffer,
    TransitionBatch,
    UniformBuffer,
    UniformBufferState,
):
    _register(_cls, f"coax_utils.replay.{_cls.__name__}")
del _cls, _register
