"""Without Ray, importing coax_utils.distributed names the extra to install."""

import subprocess
import sys


def test_import_without_ray_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # makes `import ray` raise ImportError\n"
        "import coax_utils\n"
        "try:\n"
        "    import coax_utils.distributed\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("ImportError:"), out.stdout + out.stderr
    assert "pip install coax_utils[distributed]" in out.stdout


def test_import_with_ray_exports_the_actors():
    import coax_utils.distributed as distributed

    assert distributed.__all__ == [
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
    for name in ("ParameterServer", "RateLimiter", "ReplayServer", "RolloutWorker"):
        cls = getattr(distributed, name)
        assert cls.__doc__ and callable(cls.remote) and callable(cls.options)
