"""JAX spaces, space conversion, and the gymnasium <-> functional-JAX env bridge."""

from coax_utils.envs._bridge import (
    GymnasiumParams,
    GymnasiumState,
    GymnasiumToJax,
)
from coax_utils.envs._jax_to_gymnasium import JaxToGymnasium
from coax_utils.envs._spaces import (
    Box,
    Dict,
    Discrete,
    MultiBinary,
    MultiDiscrete,
    Space,
    Tuple,
)
from coax_utils.envs._convert import to_gymnasium_space, to_jax_space
from coax_utils.envs._step import step_without_autoreset

from coax_utils.utils import register_checkpoint_type as _register

__all__ = [
    "Box",
    "Dict",
    "Discrete",
    "GymnasiumParams",
    "GymnasiumState",
    "GymnasiumToJax",
    "JaxToGymnasium",
    "MultiBinary",
    "MultiDiscrete",
    "Space",
    "Tuple",
    "step_without_autoreset",
    "to_gymnasium_space",
    "to_jax_space",
]

# This layer's checkpoint types, under the names files store (utils knows none of them).
for _cls in (
    GymnasiumParams,
    GymnasiumState,
):
    _register(_cls, f"coax_utils.envs.{_cls.__name__}")
del _cls, _register
