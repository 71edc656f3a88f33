"""Plot the learning curves the examples write: one PNG of episode return against env steps.

Each input is a ``returns.csv`` written by an example (``_common.write_returns``): episode
returns as dots, their moving average as a line, the command that made the run below the
title. The figure of ``runs/<name>/returns.csv`` (or of ``<name>.csv``) is written to
``<outdir>/curve_<name>.png``::

    python examples/plot_returns.py runs/dqn_cartpole/returns.csv --outdir doc/_static
    python examples/plot_returns.py doc/_static/curves/*.csv --outdir doc/_static
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import _common
import matplotlib
import numpy as np

from coax_utils._files import atomic_write

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)


def curve_name(path: Path) -> str:
    """``runs/<name>/returns.csv`` -> ``<name>``; ``<name>.csv`` -> ``<name>``."""
    return path.parent.name if path.name == _common.RETURNS_FILE else path.stem


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of the last ``window`` values at each point (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


def plot(path: Path, out: Path, window: int = 10, dpi: int = 90) -> Path:
    """Draw the learning curve in ``path`` (a returns file) to the PNG ``out``.

    Raises
    ------
    ValueError
        If the file is not a returns file or holds no episode.
    """
    steps, returns = _common.read_returns(path)
    if len(steps) == 0:
        raise ValueError(f"{path} holds no finished episode: nothing to plot")
    first = Path(path).read_text().splitlines()[0]
    command = first.removeprefix("# command:").strip() if first.startswith("#") else ""
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    ax.plot(steps, returns, ".", alpha=0.3, markersize=3, label="episode return")
    avg = moving_average(returns, window)
    ax.plot(steps, avg, "-", linewidth=2, label=f"average of the last {window} episodes")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(curve_name(Path(path)), fontsize=11)
    if command:
        fig.text(0.01, 0.01, command, fontsize=6, family="monospace", color="0.4")
        fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    plt.close(fig)
    data = png.getvalue()
    atomic_write(str(out), lambda place: place(0, data))  # creates the folder if needed
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="returns files (CSV)")
    parser.add_argument("--outdir", type=Path, default=Path("."), help="where the PNGs go")
    parser.add_argument("--window", type=int, default=10, help="episodes averaged")
    parser.add_argument("--dpi", type=int, default=90)
    args = parser.parse_args(argv)
    for path in args.files:
        try:
            out = plot(path, args.outdir / f"curve_{curve_name(path)}.png", args.window, args.dpi)
        except (OSError, ValueError) as e:
            print(f"plot_returns.py: error: {e}", file=sys.stderr)
            return 1
        print(f"{path} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
