# The README's commands. Every target creates .venv and installs the package if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
# the floor job: a second venv with every declared floor pinned exactly
FLOOR_VENV := .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed-floor
GYMNAX := gymnax==1.0.1
FLOOR_DOCS := ['-W', '--keep-going', '-q', '-b', 'html', 'doc', 'doc/_build/html-floor']

.PHONY: demo test test-floor lint docs bench install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev]"
	# gymnax declares gymnasium<1.4 (it runs on 1.4): no deps, its imports are in [dev]
	$(PY) -m pip install --quiet --no-deps "$(GYMNAX)"
	touch $(STAMP)

$(FLOOR_STAMP): pyproject.toml constraints/floor.txt
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install --quiet --upgrade pip
	$(FLOOR_PY) -m pip install --quiet -c constraints/floor.txt -e ".[dev]"
	$(FLOOR_PY) -m pip install --quiet --no-deps "$(GYMNAX)"
	touch $(FLOOR_STAMP)

install: $(STAMP)

demo: $(STAMP)
	@if [ ! -f examples/dqn_cartpole.py ]; then \
		echo "The demo (examples/dqn_cartpole.py) is not built yet."; exit 1; fi
	MUJOCO_GL=egl $(PY) examples/dqn_cartpole.py

test: $(STAMP)
	MUJOCO_GL=egl RAY_AUTH_MODE=disabled $(PY) -m pytest

# The suite, lint and docs on the declared floors (constraints/floor.txt); tests marked
# requires(...) with a newer version are skipped, each naming the version it needs.
# Sphinx imports modules with typing.TYPE_CHECKING set, which older Ray releases do not
# survive as a first import: the docs build imports ray first.
test-floor: $(FLOOR_STAMP)
	COAX_UTILS_FLOOR_JOB=1 MUJOCO_GL=egl RAY_AUTH_MODE=disabled $(FLOOR_PY) -m pytest
	$(FLOOR_PY) -m ruff check coax_utils tests examples benchmarks
	$(FLOOR_PY) -c "import ray, sphinx.cmd.build as b; raise SystemExit(b.main($(FLOOR_DOCS)))"

lint: $(STAMP)
	$(PY) -m ruff check coax_utils tests examples benchmarks

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -b html doc doc/_build/html

# Every benchmark against its peers; those that feed a figure also write their figures as
# JSON (--results, into benchmarks/results/), from which plot.py draws doc/_static/bench_*.png.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m pip install --quiet --no-deps coax
	@for f in benchmarks/bench_*.py; do n=$$(basename $$f .py); echo "== $$f"; \
		$(PY) $$f $$(grep -q "_results.add_argument" $$f && echo --results benchmarks/results/$${n#bench_}.json) \
		|| exit 1; done
	$(PY) benchmarks/plot.py benchmarks/results doc/_static

clean:
	rm -rf $(VENV) $(FLOOR_VENV) doc/_build runs .pytest_cache
