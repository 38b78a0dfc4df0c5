#!/usr/bin/env bash
# One experiment across the nodes of a SLURM allocation: srun starts workflow/scripts/run_multinode.sh once per
# node (one task per node), and each starts torchrun with that node's ranks. Run it inside the allocation
# (an sbatch script, salloc, or the Snakefile's `multinode` rule), on its first node, where sbatch runs the script:
#
#   sbatch --nodes=2 --ntasks-per-node=4 --wrap \
#       'NPROC_PER_NODE=4 RUN_DIR=/shared/runs/kill5 workflow/scripts/srun_multinode.sh strategy=sync fault=kill'
#
# NNODES is the allocation's node count (SLURM_JOB_NUM_NODES); RDZV_ENDPOINT is the first node of
# SLURM_JOB_NODELIST, at its NodeAddr (what slurmd is reached at; a node name need not resolve), and a port free
# on it (RDZV_PORT to choose one). The rendezvous id is the job id. Arguments are the experiment's overrides.
set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "error: SLURM_JOB_ID is not set: run inside a SLURM allocation (sbatch --nodes=N, or salloc)" >&2
  exit 2
fi
for var in NPROC_PER_NODE RUN_DIR; do
  if [ -z "${!var:-}" ]; then
    echo "error: $var is not set (needed: NPROC_PER_NODE, the ranks per node, and RUN_DIR, on a shared file system)" >&2
    exit 2
  fi
done
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-$([ -x "$HERE/../../.venv/bin/python" ] && echo "$HERE/../../.venv/bin/python" || echo python)}
NNODES=${NNODES:-$SLURM_JOB_NUM_NODES}
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
addr=$(scontrol show node "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
# Free on this node, which is the first one: sbatch runs the batch script there.
port=${RDZV_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
export NNODES NPROC_PER_NODE RUN_DIR PYTHON RDZV_ENDPOINT="${addr:-$first}:$port" RDZV_ID="$SLURM_JOB_ID"
echo "srun_multinode: $NNODES node(s) x $NPROC_PER_NODE rank(s), rendezvous at $RDZV_ENDPOINT, run dir $RUN_DIR"

# One task per node, each with the cores of its ranks; a node that fails ends the others (--kill-on-bad-exit).
exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --cpus-per-task="$NPROC_PER_NODE" \
  --kill-on-bad-exit=1 "$HERE/run_multinode.sh" "$@"
