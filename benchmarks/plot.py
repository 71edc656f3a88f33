"""Figures for the docs from the benchmarks' own output (the JSON files of ``--results``).

``python benchmarks/plot.py RESULTS_DIR OUT_DIR`` reads every ``*.json`` in ``RESULTS_DIR``
that a benchmark wrote and draws the figure of its kind into ``OUT_DIR`` as
``bench_<kind>.png``; ``make bench`` runs the benchmarks, then this script into
``doc/_static``. Each figure's title says the machine, the date and the load of its run.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _subtitle(meta: dict) -> str:
    return (
        f"{meta['cpus']} CPUs, jax {meta['jax']}, {meta['date']}, "
        f"load average {meta['load_average']:.1f}"
    )


def segment_tree(results: dict, out: pathlib.Path) -> None:
    """PER step time (sample B + update B) against capacity, one panel per batch size."""
    rows = results["rows"]
    batches = sorted({r["B"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for v in variants:
            pts = sorted(
                (r["N"], r["median_us"]) for r in rows if r["B"] == b and r["variant"] == v
            )
            ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("capacity N")
        ax.set_title(f"batch B = {b}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per PER step (median)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(
        "Prioritized replay step: sample B + update B (lower is better)\n"
        + _subtitle(results["meta"]),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def frames_memory(results: dict, out: pathlib.Path) -> None:
    """Bytes per transition of the frame-stacked buffer against stacked storage."""
    rows = sorted(results["rows"], key=lambda r: r["transitions"])
    n = [r["transitions"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(
        n, [r["stacked_bytes"] / 1024 for r in rows], marker="s", label="S and S_next stored whole"
    )
    ax.plot(
        n,
        [r["bytes_per_transition"] / 1024 for r in rows],
        marker="o",
        label="FrameStackReplayBuffer (measured RSS)",
    )
    ax.plot(n, [r["frame_bytes"] / 1024 for r in rows], ls="--", label="one 84x84 frame")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("transitions held")
    ax.set_ylabel("KiB per transition")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.suptitle(
        "Atari replay memory, stacks of 4 (lower is better)\n" + _subtitle(results["meta"]),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


PLOTS = {"segment_tree": segment_tree, "frames_memory": frames_memory}


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=pathlib.Path)
    parser.add_argument("out_dir", type=pathlib.Path)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(args.results_dir.glob("*.json")):
        results = json.loads(path.read_text())
        plot = PLOTS.get(results.get("bench"))
        if plot is None:
            print(f"{path}: no figure for benchmark {results.get('bench')!r}")
            continue
        out = args.out_dir / f"bench_{results['bench']}.png"
        plot(results, out)
        print(f"{path} -> {out}")
        written.append(out)
    return written


if __name__ == "__main__":
    main()
