"""The flat helper module: every helper documented by ``coax.utils``, on current JAX.

Implementations live in private modules, one topic each; this module re-exports them.
Import from here (``from coax_utils import utils; utils.argmax(...)``), never from ``_x``
modules.

``get_transition_batch`` builds a :class:`coax_utils.replay.TransitionBatch`, so it lives in
:mod:`coax_utils.replay` (above this module) and is re-exported here lazily, on first access:
importing ``utils`` never imports ``replay``.
"""

from typing import Any

# -- arrays and pytrees ------------------------------------------------------------------
from coax_utils.utils._arrays import argmax
from coax_utils.utils._arrays import argmin
from coax_utils.utils._arrays import check_array
from coax_utils.utils._arrays import clipped_logit
from coax_utils.utils._arrays import diff_transform
from coax_utils.utils._arrays import diff_transform_matrix
from coax_utils.utils._arrays import double_relu
from coax_utils.utils._arrays import idx
from coax_utils.utils._arrays import isscalar
from coax_utils.utils._trees import batch_to_single
from coax_utils.utils._trees import get_grads_diagnostics
from coax_utils.utils._trees import get_magnitude_quantiles
from coax_utils.utils._trees import single_to_batch
from coax_utils.utils._trees import stack_trees
from coax_utils.utils._trees import sync_shared_params
from coax_utils.utils._trees import tree_ravel
from coax_utils.utils._trees import unstack_trees
from coax_utils.utils._trees import unvectorize
# -- jit, docs, logging, misc --------------------------------------------------------------
from coax_utils.utils._jit import jit
from coax_utils.utils._misc import docstring
from coax_utils.utils._misc import enable_logging
from coax_utils.utils._misc import merge_dicts
from coax_utils.utils._misc import pretty_print
from coax_utils.utils._misc import pretty_repr
from coax_utils.utils._misc import reload_recursive
# -- quantiles ---------------------------------------------------------------------------
from coax_utils.utils._quantiles import quantile_cos_embedding
from coax_utils.utils._quantiles import quantiles
from coax_utils.utils._quantiles import quantiles_uniform
# -- function-approximator protocols -------------------------------------------------------
from coax_utils.utils._protocols import is_policy
from coax_utils.utils._protocols import is_qfunction
from coax_utils.utils._protocols import is_reward_function
from coax_utils.utils._protocols import is_stochastic
from coax_utils.utils._protocols import is_transition_model
from coax_utils.utils._protocols import is_vfunction
# -- segment trees, noise, schedules --------------------------------------------------------
from coax_utils.utils._noise import OUNoiseState
from coax_utils.utils._noise import OrnsteinUhlenbeckNoise
from coax_utils.utils._noise import ou_noise_init
from coax_utils.utils._noise import ou_noise_reset
from coax_utils.utils._noise import ou_noise_step
from coax_utils.utils._schedules import StepwiseLinearFunction
from coax_utils.utils._segment_tree import MaxTree
from coax_utils.utils._segment_tree import MinTree
from coax_utils.utils._segment_tree import SegmentTree
from coax_utils.utils._segment_tree import SumTree
from coax_utils.utils._segment_tree_fn import SUM_TREE_STRATEGIES
from coax_utils.utils._segment_tree_fn import SumTreeState
from coax_utils.utils._segment_tree_fn import sum_tree_init
from coax_utils.utils._segment_tree_fn import sum_tree_inverse_cdf
from coax_utils.utils._segment_tree_fn import sum_tree_reduce
from coax_utils.utils._segment_tree_fn import sum_tree_sample
from coax_utils.utils._segment_tree_fn import sum_tree_set
from coax_utils.utils._segment_tree_fn import sum_tree_total
from coax_utils.utils._segment_tree_fn import sum_tree_values
# -- checkpoints ---------------------------------------------------------------------------
from coax_utils.utils._checkpoint.io import dump
from coax_utils.utils._checkpoint.io import dumps
from coax_utils.utils._checkpoint.io import load
from coax_utils.utils._checkpoint.io import loads
from coax_utils.utils._checkpoint.errors import CheckpointDamagedError
from coax_utils.utils._checkpoint.errors import CheckpointNotReadableError
from coax_utils.utils._checkpoint.errors import UnsafeCheckpointError
from coax_utils.utils._checkpoint.registry import register_checkpoint_type
from coax_utils.utils._checkpoint.manager import CheckpointManager
# -- environments and GIFs -----------------------------------------------------------------
from coax_utils.utils._envs import check_preprocessors
from coax_utils.utils._envs import default_preprocessor
from coax_utils.utils._envs import get_env_attr
from coax_utils.utils._envs import has_env_attr
from coax_utils.utils._envs import make_dmc
from coax_utils.utils._envs import render_episode
from coax_utils.utils._envs import safe_sample
from coax_utils.utils._gif import generate_gif

__all__ = [
    "CheckpointDamagedError",
    "CheckpointManager",
    "CheckpointNotReadableError",
    "MaxTree",
    "MinTree",
    "OUNoiseState",
    "OrnsteinUhlenbeckNoise",
    "SUM_TREE_STRATEGIES",
    "SegmentTree",
    "StepwiseLinearFunction",
    "SumTree",
    "SumTreeState",
    "UnsafeCheckpointError",
    "argmax",
    "argmin",
    "batch_to_single",
    "check_array",
    "check_preprocessors",
    "clipped_logit",
    "default_preprocessor",
    "diff_transform",
    "diff_transform_matrix",
    "docstring",
    "double_relu",
    "dump",
    "dumps",
    "enable_logging",
    "generate_gif",
    "get_env_attr",
    "get_grads_diagnostics",
    "get_magnitude_quantiles",
    "get_transition_batch",
    "has_env_attr",
    "idx",
    "is_policy",
    "is_qfunction",
    "is_reward_function",
    "is_stochastic",
    "is_transition_model",
    "is_vfunction",
    "isscalar",
    "jit",
    "load",
    "loads",
    "make_dmc",
    "merge_dicts",
    "ou_noise_init",
    "ou_noise_reset",
    "ou_noise_step",
    "pretty_print",
    "pretty_repr",
    "quantile_cos_embedding",
    "quantiles",
    "quantiles_uniform",
    "register_checkpoint_type",
    "reload_recursive",
    "render_episode",
    "safe_sample",
    "single_to_batch",
    "stack_trees",
    "sum_tree_init",
    "sum_tree_inverse_cdf",
    "sum_tree_reduce",
    "sum_tree_sample",
    "sum_tree_set",
    "sum_tree_total",
    "sum_tree_values",
    "sync_shared_params",
    "tree_ravel",
    "unstack_trees",
    "unvectorize",
]


def __getattr__(name: str) -> Any:
    if name == "get_transition_batch":  # the lazy re-export (see the module docstring)
        from coax_utils import replay

        return replay.get_transition_batch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

# This layer's checkpoint types, under the names files store (utils knows none of them).
for _cls in (
    MaxTree,
    MinTree,
    OUNoiseState,
    OrnsteinUhlenbeckNoise,
    SegmentTree,
    StepwiseLinearFunction,
    SumTree,
    SumTreeState,
):
    register_checkpoint_type(_cls, f"coax_utils.utils.{_cls.__name__}")
del _cls
