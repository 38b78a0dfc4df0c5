#!/usr/bin/env bash
# make gpu-check: the CUDA path end to end on a lent GPU machine (docs/gpu.md). That machine has its own Python 3.12
# and torch and no network: the project goes in without dependencies, the pure-Python ones from the wheels that
# `make gpu-wheels` downloaded here into .whl/ (git-ignored; carried along). Its torch is used as it is, and the
# difference from the lock is declared in the table rather than refused.
#   GPU_PY   the machine's Python (python3)      GPU_SITE  where the wheels and the project go (/tmp/rb-gpu-site)
#   $@       passed on to python -m resilience.bench.gpu_check (--dry-run: compose the plan, run nothing)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${GPU_PY:-python3}
SITE=${GPU_SITE:-/tmp/rb-gpu-site}
if [ "${1:-}" != "--dry-run" ]; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "error: no wheels in .whl/: run make gpu-wheels on a machine with network first" >&2; exit 2; }
  echo "[gpu-check] installing $(ls .whl/*.whl | wc -l) wheels (no dependencies) into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
# the project as `pip install -e` puts it (this checkout on the path, conf/ beside its packages), no dependencies
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" != "--dry-run" ]; then
  "$PY" -c 'import hydra, torchsnapshot, dlrover, nvidia_resiliency_ext, torchdata, xxhash, torch_checkpointing' \
    || { echo "error: a dependency is missing from .whl/ (make gpu-wheels)" >&2; exit 2; }
fi
PYTHONUNBUFFERED=1 exec "$PY" -m resilience.bench.gpu_check "$@"
