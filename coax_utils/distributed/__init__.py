"""Distributed replay on Ray (extra ``distributed``: ``pip install coax_utils[distributed]``)."""

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "coax_utils.distributed needs Ray; install the extra: pip install coax_utils[distributed]"
    ) from exc

from coax_utils.distributed._params import ParameterServer
from coax_utils.distributed._prefetch import PrefetchingSampler
from coax_utils.distributed._rate_limiter import RateLimiter
from coax_utils.distributed._server import ReplayServer
from coax_utils.distributed._shard import ReplayShardError
from coax_utils.distributed._sharded import PendingReply, ShardedReplay
from coax_utils.distributed._worker import RolloutWorker
from coax_utils.distributed._writer import ReplayWriter

__all__ = [
    "ParameterServer",
    "PendingReply",
    "PrefetchingSampler",
    "RateLimiter",
    "ReplayServer",
    "ReplayShardError",
    "ReplayWriter",
    "RolloutWorker",
    "ShardedReplay",
]
