"""Every snippet of the Guide (doc/guide/*.rst) runs and prints what the page says."""

from __future__ import annotations

import doctest
import pathlib

import pytest

# pages whose code needs more than seconds to run; the tests named here run the same code
SHOWN_ONLY = {
    "distributed": "a Ray cluster: tests/distributed/test_apex_example.py",
    "offline": "a Minari dataset on disk: tests/test_example_offline.py runs its snippet",
}
PAGES = sorted((pathlib.Path(__file__).resolve().parents[1] / "doc" / "guide").glob("*.rst"))


def test_the_guide_has_pages():
    assert len(PAGES) >= 6


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_guide_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    test = doctest.DocTestParser().get_doctest(page.read_text(), {}, page.stem, str(page), 0)
    if page.stem in SHOWN_ONLY:
        assert not test.examples
        return
    assert test.examples, f"{page.name} has no runnable snippet"
    out: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
