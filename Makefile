# Two commands do all set-up on a fresh machine; each creates or refreshes the project's virtual environment.
#   make run    the main job: the default benchmark matrix and its report (results/default/report/index.html)
#   make test   the test suite (what CI runs, through .ci/run); make test-long: the sweeps CI leaves out
#   make demo   one killed rank recovered and checked bit for bit (half a minute)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := workflow/envs/constraints.txt

CORES  ?= 2

# Where torch comes from. A machine with no NVIDIA driver whose pip has no wheel source of its own (index-url,
# find-links) gets PyTorch's CPU-only index, so set-up pulls no CUDA wheels; set TORCH_INDEX= (empty) to use
# pip's default, or another index. Evaluated only when the venv is (re)built.
PIP_SOURCES = $(shell $(PYTHON) -m pip config list 2>/dev/null | grep -E 'index-url|find-links'; \
                      env | grep -E '^PIP_(INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS)=')
TORCH_INDEX ?= $(if $(wildcard /proc/driver/nvidia/version)$(strip $(PIP_SOURCES)),,https://download.pytorch.org/whl/cpu)

.PHONY: run test demo venv lock clean

venv: $(STAMP)

# Reinstalled whenever pyproject.toml or the lock changes; one line per step, then pip's own progress.
$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "error: PYTHON=$(PYTHON) \
	is $$($(PYTHON) --version 2>/dev/null || echo 'not found'); resilience-bench needs Python >= 3.11: run make \
	$(or $(MAKECMDGOALS),venv) PYTHON=python3.11 (or another Python >= 3.11)" >&2; exit 2; }
	@echo "[set-up 1/3] virtual environment $(VENV) ($$($(PYTHON) --version))"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[set-up 2/3] torch 2.13.0 from $(or $(strip $(TORCH_INDEX)),pip's configured sources)"
	$(if $(strip $(TORCH_INDEX)),$(PY) -m pip install torch==2.13.0 --index-url $(strip $(TORCH_INDEX)),@true)
	@echo "[set-up 3/3] the project, its test tools, the peer libraries and the data loader, at the versions of $(LOCK)"
	$(PY) -m pip install -c $(LOCK) -e '.[test,peers,data]'
	@touch $(STAMP) && echo "[set-up] done: $(VENV)"

# Rewrite the lock from the venv after a deliberate upgrade (torch's local label left to the index).
lock: $(STAMP)
	@{ sed -n '1,2p' $(LOCK); $(PY) -m pip freeze --exclude-editable | sed 's/+cpu$$//' | LC_ALL=C sort -f; } \
	  > $(LOCK).new && mv $(LOCK).new $(LOCK) && echo "wrote $(LOCK)"

# make run MATRIX=smoke: another conf/matrix/<name>.yaml (results in results/<name>/)
MATRIX ?= default

# A second pass runs again the cells measured while the host was busy (noisy: their first runs kept in noisy/),
# so that the report's intervals rest on quiet runs; RERUN_NOISY=false leaves them as they are. It is the same
# `make run`: its cells record the first pass's probe snapshot, taken minutes before (not probed again).
RERUN_NOISY ?= true
run: $(STAMP)
	$(VENV)/bin/snakemake --cores $(CORES) --config matrix=$(MATRIX)
ifeq ($(RERUN_NOISY),true)
	$(VENV)/bin/snakemake --cores $(CORES) --config matrix=$(MATRIX) rerun_noisy=true probe_max_age_h=1
endif

demo: $(STAMP)
	$(PY) -m resilience.bench.demo

test: $(STAMP)
	$(PY) -m pytest

# The sweeps CI leaves out (tests/tiers.py: the further strategies, libraries and phases of a mechanism CI covers
# once; 102 entries on 2026-11-28, each naming what CI keeps). 9 min 42 s on 2 idle cores when it held 37 tests
# (2026-11-26); not timed since. `pytest --all` runs both sets.
.PHONY: test-long
test-long: $(STAMP)
	$(PY) -m pytest --long

# The smoke matrix through profiles/slurm on a real SLURM cluster that the test starts and stops (two slurmd on this
# machine), then one run across its two nodes (rule multinode; tests/test_slurm.py, workflow/slurm/local_cluster.py).
# Minutes, and root: not part of `make test`, whose CI goal is 15 minutes for the suite (docs/pipeline.md, SLURM).
# Installs Debian's packages when missing (root and apt) and the `slurm` extra.
SLURM_PACKAGES := slurm-wlm slurmdbd munge mariadb-server
.PHONY: test-slurm
test-slurm: $(STAMP)
	@for t in slurmctld slurmd slurmdbd munged mariadbd; do command -v $$t >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then echo "[test-slurm] apt-get install $(SLURM_PACKAGES)"; apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SLURM_PACKAGES); fi
	@echo "[test-slurm] the slurm extra" && $(PY) -m pip install -q -c $(LOCK) -e '.[slurm]'
	$(PY) -m pytest tests/test_slurm.py -m slurm

clean:
	rm -rf results outputs .pytest_cache

# A lent GPU machine (docs/gpu.md): its own Python 3.12 and torch, no network, 64 MiB carried along. `make gpu-wheels`
# here downloads the pure-Python dependencies and the cp312 manylinux wheels of the compiled ones (the libraries',
# xxhash's) at the lock's versions into .whl/ (git-ignored): every name is fetched with the same cp312/manylinux
# tags, so a compiled dependency needs only its name in GPU_WHEELS. `make gpu-check` there installs them, no
# dependencies, and runs python -m resilience.bench.gpu_check (about 4 minutes on one H100);
# `make gpu-check GPU_CHECK=--dry-run` anywhere composes its plan and runs nothing.
GPU_WHEELS := hydra-core omegaconf torchsnapshot torch-checkpointing dlrover nvidia-resiliency-ext torchdata Deprecated \
              defusedxml importlib_metadata lazy-importer nest-asyncio xxhash
GPU_TAGS := --only-binary=:all: --python-version 3.12 --implementation cp $(foreach n,17 24 27 28 31 34 35 39,\
            --platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
GPU_CHECK ?=
.PHONY: gpu-wheels gpu-check
gpu-wheels: $(STAMP)
	@mkdir -p .whl && echo "[gpu-wheels] $(GPU_WHEELS) antlr4-python3-runtime, at the versions of $(LOCK), into .whl/"
	$(PY) -m pip download -q --no-deps $(GPU_TAGS) -d .whl \
	  $(foreach p,$(GPU_WHEELS),$(shell grep -i '^$(p)==' $(LOCK) || echo '$(p)-not-in-lock'))
	$(PY) -m pip wheel -q --no-deps -w .whl $$(grep -i '^antlr4-python3-runtime==' $(LOCK))  # an sdist only
	@du -sh .whl

gpu-check:
	bash workflow/gpu/check.sh $(GPU_CHECK)

# The projection checked against a measured failure trace (docs/projection.md, "The failure trace"): per compared
# technique three fit runs and one 1,400-step run under failures in wall time (exponential gaps of mean 4 s drawn
# stratified, a declared variance reduction of the count of failures; recoveries included: ~60-80 failures), beside
# the fault-free reference of its training; ~20 min on 2 idle cores where a cold start takes ~3 s, ~40 where it takes
# ~5 s. SEEDS=11,12,13: fit runs and a trace run per seed, pooled per technique (chance's spread of the steps lost,
# ~11% at one trace's ~33 failures in training, falls as 1/sqrt of the failures): as many times as long.
.PHONY: trace
trace: $(STAMP)
	$(PY) -m resilience.bench.trace --clock wall --steps 1400 --mtbf-r 1.33 --arrivals stratified $(if $(SEEDS),--seeds $(SEEDS))
