"""The offline example runs end to end with ``--smoke``, as CI runs it."""

from __future__ import annotations

import gc
import warnings

import minari

from tests._examples import ROOT, run_example


def test_offline_bc_cartpole_smoke(tmp_path, monkeypatch):
    stdout = run_example("offline_bc_cartpole.py", "--smoke", "--outdir", str(tmp_path))
    assert "150 transitions, 3 episodes" in stdout
    assert "epoch   2  loss" in stdout and "smoke run OK" in stdout
    assert "greedy cloned policy: average return" in stdout
    # the dataset it collected is a Minari dataset that Minari itself loads
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    (dataset_id,) = minari.list_local_datasets()
    assert minari.load_dataset(dataset_id).total_steps == 150
    assert (tmp_path / "returns.csv").read_text().startswith("# command: python")


def test_the_offline_how_to_snippet_runs(tmp_path, monkeypatch):
    # doc/guide/offline.rst starts from a snippet meant to run as it is: run its first code block
    text = (ROOT / "doc" / "guide" / "offline.rst").read_text()
    block = text.split(".. code-block:: python\n\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    code = "\n".join(lines)
    assert "fill_from_minari" in code and "MinariSource" in code
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINARI_DATASETS_PATH", "unused")  # the snippet sets its own root
    # Minari's collector leaves TemporaryDirectory objects whose finalizers warn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        exec(compile(code, "doc/guide/offline.rst", "exec"), {})
        gc.collect()
    assert (tmp_path / "minari-data" / "local" / "cartpole" / "random-v0").is_dir()
