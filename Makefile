# Two commands do all set-up on a fresh machine; each creates or refreshes the project's virtual environment.
#   make run    the main job: the default benchmark matrix and its report (results/default/report/index.html)
#   make test   the test suite (what CI runs, through .ci/run)
#   make demo   one killed rank recovered and checked bit for bit (half a minute)
PYTHON ?= python3
VENV   ?= .venv
TORCH_INDEX ?=   # optional: a CPU-only torch wheel index, used before everything else is installed
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

CORES  ?= 2

.PHONY: run test demo venv clean

venv: $(STAMP)

# Reinstalled whenever pyproject.toml changes. torch is pinned to 2.13.0: on a CPU-only machine pip takes
# the CPU build when one is offered; see README "Set-up".
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(strip $(TORCH_INDEX)),$(PY) -m pip install --quiet torch==2.13.0 --index-url $(strip $(TORCH_INDEX)))
	$(PY) -m pip install --quiet -e '.[test,peers]'
	touch $(STAMP)

# make run MATRIX=smoke: another conf/matrix/<name>.yaml (results in results/<name>/)
MATRIX ?= default

run: $(STAMP)
	$(VENV)/bin/snakemake --cores $(CORES) --config matrix=$(MATRIX)

demo: $(STAMP)
	$(PY) -m resilience.bench.demo

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf results outputs .pytest_cache
