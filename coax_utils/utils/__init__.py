"""The flat helper module: every helper documented by ``coax.utils``, on current JAX.

Implementations live in private modules, one topic each; this module re-exports them.
Import from here (``from coax_utils import utils; utils.argmax(...)``), never from ``_x``
modules.
"""

# -- arrays and pytrees ------------------------------------------------------------------
# -- jit, docs, logging, misc --------------------------------------------------------------
# -- quantiles ---------------------------------------------------------------------------
# -- function-approximator protocols -------------------------------------------------------
# -- segment trees, noise, schedules --------------------------------------------------------
from coax_utils.utils._segment_tree_fn import SumTreeState
from coax_utils.utils._segment_tree_fn import sum_tree_init
from coax_utils.utils._segment_tree_fn import sum_tree_inverse_cdf
from coax_utils.utils._segment_tree_fn import sum_tree_reduce
from coax_utils.utils._segment_tree_fn import sum_tree_sample
from coax_utils.utils._segment_tree_fn import sum_tree_set
from coax_utils.utils._segment_tree_fn import sum_tree_total
from coax_utils.utils._segment_tree_fn import sum_tree_values
# -- checkpoints ---------------------------------------------------------------------------
# -- environments and GIFs -----------------------------------------------------------------

__all__ = [
    "SumTreeState",
    "sum_tree_init",
    "sum_tree_inverse_cdf",
    "sum_tree_reduce",
    "sum_tree_sample",
    "sum_tree_set",
    "sum_tree_total",
    "sum_tree_values",
]
