"""coax_utils: utilities for reinforcement-learning agents in JAX, Haiku and optax.

The subpackages are:

- :mod:`coax_utils.utils`: the flat module of helpers (everything ``coax.utils`` documents),
- :mod:`coax_utils.sources`: JIT-friendly streaming data sources,
- :mod:`coax_utils.replay`: transitions, n-step tracing and replay buffers,
- :mod:`coax_utils.envs`: JAX spaces and the gymnasium <-> JAX env bridge,
- :mod:`coax_utils.distributed`: distributed replay on Ray (extra ``distributed``).

Importing :mod:`coax_utils` is cheap; heavy and optional dependencies are imported by the
functions that need them.
"""

from coax_utils import envs, replay, sources, utils
from coax_utils._version import __version__

__all__ = ["__version__", "envs", "replay", "sources", "utils"]
