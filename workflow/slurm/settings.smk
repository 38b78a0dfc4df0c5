"""Included first by the Snakefile: under profiles/slurm, the account and the partition must be set before anything
is submitted. The profile takes them from $SBATCH_ACCOUNT and $SBATCH_PARTITION; left unset, the value would
stay the literal `$SBATCH_ACCOUNT`, pass a dry run, and fail at the first sbatch (or, worse, the executor plugin
would guess an account). One line instead, dry runs included. Jobs on the nodes parse the Snakefile again and
skip the check (their resources come from the submitting process)."""

import os
import sys


def _unset_slurm_settings(resources) -> list[str]:
    """The SLURM settings among ``resources`` (the default resources) that are empty or an unexpanded $VAR."""
    unset = []
    for name in ("slurm_account", "slurm_partition"):
        raw = resources[name].raw if resources is not None and name in resources else None
        value = os.path.expandvars(str(raw)).strip("'\" ")
        if raw is not None and (not value or "$" in value):  # raw None: set from Python, not from a profile
            unset.append(f"{name} ({raw})")
    return unset


if workflow.is_main_process and (_unset := _unset_slurm_settings(workflow.resource_settings.default_resources)):
    sys.exit(
        f"error: SLURM: {' and '.join(_unset)} not set: export SBATCH_ACCOUNT=<account> "
        "SBATCH_PARTITION=<partition> (sacctmgr show assoc user=$USER and sinfo list yours)"
    )
