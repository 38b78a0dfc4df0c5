"""Whether a run ended on the fault-free run's state: every single run says so, not only the pipeline.

A run that recovered and reports ``ok`` may still have diverged (a rejected checkpoint that changed the optimizer
did: issue "job resume", item 8). The verdict needs the final state hash of the fault-free run of the same training:
same workload, seed, steps, world size, parallelism, device, threads per rank, torch, machine and code. Fault-free
runs of ``strategy=none`` record their hash in an index (``reference.index``, one JSON file per training, keyed by
a hash of those facts), and any later run of the same training is compared with it. ``reference.check``:

* ``auto``: compare when the index holds the reference, else say "not checked" and how to get one;
* ``run``: when the index lacks it, run the reference first (``strategy=none fault=none``, in ``<run dir>/reference``);
* ``none``: no verdict (the pipeline compares its cells with its own reference cells).
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from resilience.record.fsio import atomic_write_json

INDEX_VAR = "RB_REFERENCE_INDEX"  # the index's default place, when set (a test session's own)
REFERENCE_STRATEGY = "none"  # the pipeline's reference too: no checkpoint code on the training path
CODE_ROOTS = ("resilience", "injectors")  # the code a run's training goes through


def code_fingerprint() -> str:
    """SHA-256 of the project's Python sources: a reference from other code is no reference (the loop may differ)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(p for top in CODE_ROOTS for p in (root / top).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def data_fingerprint(cfg: DictConfig) -> str | None:
    """The token file's SHA-256 where the run reads one (train.data=loader): it is built from this machine's Python
    sources, which differ between Python versions."""
    if "train" not in cfg or str(cfg.train.data) != "loader":
        return None
    from resilience.data.tokens import prepare_tokens, token_info

    return str(token_info(prepare_tokens(Path(str(cfg.train.loader.dir))))["sha256"])


def training_key(cfg: DictConfig, torch_version: str | None) -> str:
    """What determines the final state of a fault-free run, hashed: the index's file name."""
    facts = {
        "workload": OmegaConf.to_container(cfg.workload, resolve=True),
        "parallel": OmegaConf.to_container(cfg.parallel, resolve=True) if "parallel" in cfg else None,
        "seed": int(cfg.seed), "steps": int(cfg.steps), "world_size": int(cfg.world_size),
        "device": str(cfg.device), "backend": str(cfg.backend), "threads_per_rank": int(cfg.threads_per_rank),
        "torch": torch_version, "machine": platform.machine(), "code": code_fingerprint(),
        "train": OmegaConf.to_container(cfg.train, resolve=True) if "train" in cfg else None,
        "data": data_fingerprint(cfg),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class ReferenceIndex:
    """One JSON file per training under ``root``: the fault-free run's final hash and where it ran."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def lookup(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None

    def record(self, key: str, sha256: str, run_dir: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / f"{key}.json", {"final_state_sha256": sha256, "run_dir": str(run_dir)})

    def record_not_deterministic(self, key: str, run_dir: Path) -> None:
        """A second fault-free run ended elsewhere: later runs of this training are not judged against either."""
        known = self.lookup(key) or {}
        atomic_write_json(self.root / f"{key}.json", {**known, "differing_run_dir": str(run_dir)})


def is_reference(result: dict[str, Any]) -> bool:
    """A run whose final state is the reference of its training: fault-free, no checkpoint code, ended ok."""
    return (result.get("strategy") == REFERENCE_STRATEGY and result.get("fault") == "none"
            and result.get("status") == "ok" and isinstance(result.get("final_state_sha256"), str))


def not_by_design(result: dict[str, Any]) -> str | None:
    """Why this run cannot end on the reference's state by design (None: it must)."""
    if str(result.get("bit_exact") or "").startswith("not by design"):
        return str(result["bit_exact"])
    if result.get("world_resizes"):
        return "not by design: the world size changed during the run"
    return None


NOT_DETERMINISTIC = "two fault-free runs of the same training differ: it is not deterministic here"


def verdict(result: dict[str, Any], reference: dict[str, Any] | None, hint: str) -> dict[str, Any]:
    """``result.json``'s ``reference``: ``matches`` true / false, or null with ``why`` it was not checked."""
    own = result.get("final_state_sha256")
    if not isinstance(own, str):
        return {"matches": None, "why": "the run has no final state"}
    if (design := not_by_design(result)) is not None:
        return {"matches": None, "why": design}
    if reference is None:
        return {"matches": None, "why": hint}
    if "differing_run_dir" in reference:  # a NO here would blame the strategy for the training's own noise
        return {"matches": None, "why": f"{NOT_DETERMINISTIC} ({reference['run_dir']} and "
                                        f"{reference['differing_run_dir']}); no run of it is judged"}
    return {"matches": own == reference["final_state_sha256"], "sha256": reference["final_state_sha256"],
            "run_dir": reference["run_dir"]}


def said(v: dict[str, Any]) -> str:
    """The console line."""
    if v["matches"] is True:
        return f"  ended on the fault-free reference's state: yes, bit for bit ({v['run_dir']})"
    if v["matches"] is False:
        return (f"  ended on the fault-free reference's state: NO, the final state DIFFERS from "
                f"{v['sha256'][:16]}... ({v['run_dir']})" + (f": {v['why']}" if v.get("why") else ""))
    return f"  ended on the fault-free reference's state: not checked ({v['why']})"


# what a reference run keeps of the checked run's command line: the settings that shape the training
TRAINING_KEYS = ("workload", "parallel", "seed", "steps", "world_size", "device", "backend", "threads_per_rank",
                 "train", "checkpoint.every")  # checkpoint.every: where the real loop hashes its parts


def reference_overrides(overrides: list[str], index: Path) -> list[str]:
    """The command line of the checked run's reference: its training settings, no checkpoint, no fault; it records
    itself in the same ``index``."""
    def kept_key(override: str) -> bool:
        name = override.split("=", 1)[0].lstrip("+~")
        # hydra.searchpath: where a plug-in's options (a workload of the user's own) are found
        return name.split(".", 1)[0] in TRAINING_KEYS or name in (*TRAINING_KEYS, "hydra.searchpath")

    kept = [o for o in overrides if kept_key(o)]
    return [*kept, f"strategy={REFERENCE_STRATEGY}", "fault=none", "detector=[process_exit]",
            f"reference.index='{index}'"]


def judge(cfg: DictConfig, run_dir: Path, result: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The run's ``reference`` verdict (``reference.check``); a fault-free run of ``strategy=none`` records
    itself in the index, or, when one is there already, is compared with it (two fault-free runs that differ: the
    training is not deterministic on this machine, which no strategy is blamed for)."""
    check = str(cfg.reference.check)
    if check == "none":
        return {"matches": None, "why": "reference.check=none"}
    index = ReferenceIndex(Path(str(cfg.reference.index)).resolve())
    key = training_key(cfg, (result.get("provenance") or {}).get("torch"))
    known = index.lookup(key)
    if is_reference(result):
        if known is None:
            index.record(key, result["final_state_sha256"], run_dir)
            return {"matches": None, "why": f"this run is the reference of its training (recorded in {index.root})"}
        found = verdict(result, {k: v for k, v in known.items() if k != "differing_run_dir"}, "")
        if found["matches"] is False:
            found["why"] = NOT_DETERMINISTIC
            index.record_not_deterministic(key, run_dir)
        return found
    if known is None and check == "run" and isinstance(result.get("final_state_sha256"), str) \
            and not_by_design(result) is None:
        from resilience.proc import child

        ref_dir = run_dir / "reference"
        print(f"[supervisor] no fault-free reference recorded for this training: running it in {ref_dir}",
              flush=True)
        done = child.run(child.experiment_command(reference_overrides(overrides, index.root), ref_dir), timeout_s=24 * 3600)
        known = index.lookup(key) if done.returncode == 0 else None
    hint = ("no fault-free run of this training recorded yet: run it once (the same command with strategy=none "
            "fault=none), or set reference.check=run")
    return verdict(result, known, hint)
