"""The docs' benchmark figures: drawn by benchmarks/plot.py from the benchmarks' own output."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PNG = b"\x89PNG\r\n\x1a\n"


def load_plot():
    spec = importlib.util.spec_from_file_location(
        "coax_utils_bench_plot", ROOT / "benchmarks" / "plot.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_committed_result_has_its_figure_in_the_docs(tmp_path):
    plot = load_plot()
    kinds = {json.loads(p.read_text())["bench"] for p in RESULTS.glob("*.json")}
    assert kinds and kinds <= set(plot.PLOTS)
    written = plot.main([str(RESULTS), str(tmp_path)])
    assert sorted(p.name for p in written) == sorted(f"bench_{k}.png" for k in kinds)
    for path in written:
        assert path.read_bytes()[:8] == PNG
        assert (ROOT / "doc" / "_static" / path.name).read_bytes()[:8] == PNG  # committed


def test_plot_runs_on_a_benchmark_smoke_run(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_frames.py"), "--quick", "--only", "1"]
    subprocess.run(cmd + ["--results", str(results / "frames.json")], check=True, timeout=300)
    rows = json.loads((results / "frames.json").read_text())["rows"]
    assert [r["transitions"] for r in rows] == [2_000, 5_000]
    # each frame is stored about once: far below storing S and S_next whole
    assert all(r["bytes_per_transition"] < r["stacked_bytes"] / 2 for r in rows)
    (figure,) = load_plot().main([str(results), str(tmp_path / "figures")])
    assert figure.name == "bench_frames_memory.png" and figure.read_bytes()[:8] == PNG


def test_plot_skips_results_it_has_no_figure_for(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"bench": "unknown", "meta": {}, "rows": []}))
    assert load_plot().main([str(tmp_path), str(tmp_path / "figures")]) == []
