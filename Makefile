# The README's commands. Every target creates .venv and installs the package if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint docs bench install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev]"
	# gymnax declares gymnasium<1.4 (it runs on 1.4): no deps, its imports are in [dev]
	$(PY) -m pip install --quiet --no-deps "gymnax==1.0.1"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@if [ ! -f examples/dqn_cartpole.py ]; then \
		echo "The demo (examples/dqn_cartpole.py) is not built yet."; exit 1; fi
	MUJOCO_GL=egl $(PY) examples/dqn_cartpole.py

test: $(STAMP)
	MUJOCO_GL=egl RAY_AUTH_MODE=disabled $(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check coax_utils tests examples benchmarks

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -b html doc doc/_build/html

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m pip install --quiet --no-deps coax
	@for f in benchmarks/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) doc/_build runs .pytest_cache
