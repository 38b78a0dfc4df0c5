#!/usr/bin/env bash
# One experiment across nodes with torchrun: run this same command on every node (by hand, or one task per node
# under `srun --ntasks-per-node=1`). Node 0 prepares the run directory (on a shared file system), every node starts
# its ranks with torchrun, node 0 writes result.json when all have finished.
#
#   NNODES=2 NPROC_PER_NODE=4 RDZV_ENDPOINT=node0:29400 RUN_DIR=/shared/runs/kill1 \
#       workflow/scripts/run_multinode.sh strategy=sync fault=kill fault.rank=5
#
# NODE_RANK (default: SLURM_NODEID, else 0), RDZV_ID (default: SLURM_JOB_ID, else the run directory's name),
# PYTHON (default: the project's .venv, else python) and PREPARE_TIMEOUT_S (how long other nodes wait for node 0's config, default 300)
# are optional. Device, backend and threads per rank are decided by each node at start (the config says auto).
set -euo pipefail

for var in NNODES NPROC_PER_NODE RDZV_ENDPOINT RUN_DIR; do
  if [ -z "${!var:-}" ]; then
    echo "error: $var is not set (needed: NNODES, NPROC_PER_NODE, RDZV_ENDPOINT=host:port, RUN_DIR)" >&2
    exit 2
  fi
done
HERE=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$([ -x "$HERE/.venv/bin/python" ] && echo "$HERE/.venv/bin/python" || echo python)}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-$(basename "$RUN_DIR")}}
CONFIG="$RUN_DIR/config.yaml"

if [ "$NODE_RANK" = 0 ]; then
  "$PYTHON" -m resilience supervisor.launcher=external "world_size=$((NNODES * NPROC_PER_NODE))" \
    "hydra.run.dir=$RUN_DIR" "$@" > /dev/null
else  # the others wait for node 0's prepared config, bounded
  deadline=$((SECONDS + ${PREPARE_TIMEOUT_S:-300}))
  until [ -s "$CONFIG" ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "error: $CONFIG did not appear within ${PREPARE_TIMEOUT_S:-300} s (is RUN_DIR shared?)" >&2
      exit 1
    fi
    sleep 1
  done
fi

restarts=$("$PYTHON" -c "import sys; from omegaconf import OmegaConf; \
print(OmegaConf.load(sys.argv[1]).recovery.max_restarts)" "$CONFIG")
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" \
  --nproc-per-node="$NPROC_PER_NODE" --node-rank="$NODE_RANK" --rdzv-backend=c10d \
  --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" --max-restarts="$restarts" \
  -m resilience.rank "$CONFIG"

if [ "$NODE_RANK" = 0 ]; then
  "$PYTHON" -m resilience.result "$RUN_DIR"
fi
