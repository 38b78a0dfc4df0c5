"""Included by the Snakefile: one experiment across nodes with torchrun, as one SLURM job of several nodes.

    snakemake --profile profiles/slurm multinode --config multinode="strategy=sync fault=kill" nodes=2 nproc_per_node=4

The job asks SLURM for `nodes` nodes and one task per rank (resources nodes, tasks_per_node or tasks); its command,
workflow/scripts/srun_multinode.sh, starts run_multinode.sh once per node with srun, and each node starts torchrun
with its `nproc_per_node` ranks (NNODES, NPROC_PER_NODE, RDZV_ENDPOINT: the allocation's first node). The `mpi`
resource tells the executor plugin that the command starts its own srun (the plugin then does not wrap it in one).
The run directory is results/<matrix>/multinode/<nodes>x<nproc>-<hash of the overrides>/; the overrides are checked
like a matrix cell's before anything is submitted."""

import hashlib

MULTINODE = str(config.get("multinode", "")).split()  # the experiment's overrides
try:
    NODES, NPROC_PER_NODE = int(config.get("nodes", 2)), int(config.get("nproc_per_node", 1))
    assert NODES >= 1 and NPROC_PER_NODE >= 1 and NODES * NPROC_PER_NODE >= 2
except (TypeError, ValueError, AssertionError):
    sys.exit(
        f"error: nodes={config.get('nodes', 2)} nproc_per_node={config.get('nproc_per_node', 1)}: must be "
        "integers >= 1 with at least 2 ranks in all (nodes x nproc_per_node)"
    )
if any(o.startswith("world_size=") for o in MULTINODE):
    sys.exit("error: multinode: world_size is nodes x nproc_per_node; set those instead")
MULTINODE_WORLD = NODES * NPROC_PER_NODE
MULTINODE_HASH = hashlib.sha256(" ".join(MULTINODE).encode()).hexdigest()[:8]
MULTINODE_NAME = f"{NODES}x{NPROC_PER_NODE}-{MULTINODE_HASH}"
MULTINODE_DIR = f"{RESULTS}/multinode/{MULTINODE_NAME}"
MULTINODE_OVERRIDES = [*MULTINODE, "supervisor.launcher=external", f"world_size={MULTINODE_WORLD}"]
if MULTINODE and workflow.is_main_process:
    from resilience.__main__ import precheck
    from resilience.settings.command_line import CommandLineError
    from resilience.config import ConfigError

    try:  # what node 0 will prepare, checked here: a bad override is one line, before any submission
        precheck(MULTINODE_OVERRIDES)
    except (ConfigError, CommandLineError) as exc:
        sys.exit(f"error: multinode: {exc}")


rule multinode:
    """One experiment across `nodes` nodes with `nproc_per_node` ranks each (--config multinode="<overrides>"):
    one batch job; srun starts torchrun on each of its nodes. Under profiles/slurm (a SLURM allocation) only."""
    output:
        f"{MULTINODE_DIR}/result.json",
    log:
        f"{RESULTS}/logs/multinode/{MULTINODE_NAME}.log",
    conda:
        "../envs/bench.yaml"  # relative to this file (the Snakefile's ENV)
    resources:
        nodes=NODES,
        # One SLURM task per rank. The plugin accepts one of the two, and only above 1, for an `mpi` job.
        tasks_per_node=NPROC_PER_NODE if NPROC_PER_NODE > 1 else 0,
        tasks=NODES if NPROC_PER_NODE == 1 else 0,
        mpi="srun",  # the command runs srun itself
        mem_mb=1500 * NPROC_PER_NODE + 1000,  # per node, as a cell's per rank
        runtime=MATRIX.runtime_min,
    params:
        overrides=MULTINODE,
        nproc=NPROC_PER_NODE,
        run_dir=lambda wc, output: os.path.dirname(output[0]),
    shell:
        # A run cut off earlier leaves its directory: node 0 prepares it anew, the others must not read the old one.
        "rm -rf {params.run_dir:q} && NPROC_PER_NODE={params.nproc} RUN_DIR={params.run_dir:q} "
        "workflow/scripts/srun_multinode.sh {params.overrides:q} > {log:q} 2>&1"
