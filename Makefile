# Two commands do all set-up on a fresh machine; each creates or refreshes the project's virtual environment.
#   make run    the main job (today: the demo experiment, a killed rank recovered and checked bit for bit)
#   make test   the test suite (what CI runs, through .ci/run)
PYTHON ?= python3
VENV   ?= .venv
TORCH_INDEX ?=   # optional: a CPU-only torch wheel index, used before everything else is installed
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test venv clean

venv: $(STAMP)

# Reinstalled whenever pyproject.toml changes. torch is pinned to 2.13.0: on a CPU-only machine pip takes
# the CPU build when one is offered; see README "Set-up".
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(strip $(TORCH_INDEX)),$(PY) -m pip install --quiet torch==2.13.0 --index-url $(strip $(TORCH_INDEX)))
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m resilience.demo

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf results outputs .pytest_cache
