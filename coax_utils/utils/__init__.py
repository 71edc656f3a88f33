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
# -- checkpoints ---------------------------------------------------------------------------
# -- environments and GIFs -----------------------------------------------------------------

__all__ = [
]
