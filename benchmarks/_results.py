"""The benchmarks' machine-readable output: one JSON file per run, read by ``plot.py``.

A benchmark given ``--results PATH`` writes ``{"bench": name, "meta": {...}, "rows": [...]}``
there, each row a flat dict of the configuration and the measured figures of one variant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--results PATH`` option of every benchmark that feeds a figure."""
    parser.add_argument(
        "--results", default=None, help="also write the figures as JSON here (for plot.py)"
    )


def write(path: str | None, bench: str, rows: list[dict]) -> None:
    """Write ``rows`` of benchmark ``bench`` to ``path`` (nothing when ``path`` is None)."""
    if path is None:
        return
    import jax

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "jax": jax.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_average": os.getloadavg()[0],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"bench": bench, "meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")
    print(f"results written to {path}")
