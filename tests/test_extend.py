"""Adding a role takes one class and one YAML, nothing else: a throw-away strategy, fault, detector and recovery
policy, written from this test outside the project, run end to end through Hydra's config search path. The
strategy declares a capability that no shipped strategy has, and brings the rule of the table that refuses a
combination with it (resilience/compat/)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, processes_mentioning

from resilience import compat
from resilience.proc import child
from resilience.__main__ import precheck
from resilience.config import ConfigError, check_group_choices

CLASSES = {
    "throwaway_ckpt.py": '''
        from dataclasses import dataclass

        from resilience import compat
        from resilience.caps import StrategyCaps
        from resilience.strategies.sync import SyncCheckpoint


        @dataclass(frozen=True, kw_only=True)
        class OffsiteCaps(StrategyCaps):
            offsite: bool = False  # each checkpoint is copied off the host too


        class ThrowawayCkpt(SyncCheckpoint):
            """sync under another name: the run must end in the same bits as sync's."""

            caps = OffsiteCaps(**{**vars(SyncCheckpoint.caps), "offsite": True})


        compat.RULES.append(compat.Rule(
            "offsite_copy_held_back", ("fault", "strategy"),
            "A disk fault, with a strategy that copies each checkpoint off the host (the copy would wait on it).",
            lambda c: isinstance(c.strategy, OffsiteCaps) and c.strategy.offsite and c.fault.acts_on_checkpoint_fs,
            lambda c: f"{c.set('fault')}: {c.set('strategy')} copies each checkpoint off-site, which this fault "
                      f"would hold back; use {c.instead('fault', lambda f: not f.acts_on_checkpoint_fs)}"))
        ''',
    "throwaway_fault.py": '''
        from injectors.base import Injector
        from injectors.kill import die


        class ThrowawayFault(Injector):
            def _plan_detail(self, step):
                return {"how": "SIGKILL"}

            def _act(self, step):
                die("SIGKILL")
        ''',
    "throwaway_detector.py": '''
        from resilience.detectors.base import Detection, Detector


        class ThrowawayDetector(Detector):
            def on_worker_failures(self, exit_codes):  # the ranks a signal ended (a peer may exit 1 after them)
                return [Detection(self.name, r, f"rank {r} exited {code}", code) for r, code in exit_codes.items()
                        if code < 0]
        ''',
    "throwaway_policy.py": '''
        from resilience.recovery.base import RecoveryPolicy


        class ThrowawayPolicy(RecoveryPolicy):
            on_silent = "restart"
        ''',
}
YAMLS = {
    "strategy/throwaway_ckpt.yaml": "_target_: rbext.throwaway_ckpt.ThrowawayCkpt\n",
    "fault/throwaway_fault.yaml": "_target_: rbext.throwaway_fault.ThrowawayFault\nrank: 1\nat_step: 13\n",
    "detector/throwaway_detector.yaml": "# @package detectors.throwaway_detector\n"
                                        "_target_: rbext.throwaway_detector.ThrowawayDetector\n",
    "recovery/throwaway_policy.yaml": "_target_: rbext.throwaway_policy.ThrowawayPolicy\nmax_restarts: 1\n",
}


def plug_in(tmp_path: Path) -> None:
    """The throw-away roles as a package under ``tmp_path/ext`` and their options under ``tmp_path/conf``."""
    package = tmp_path / "ext" / "rbext"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, code in CLASSES.items():
        (package / name).write_text(textwrap.dedent(code))
    for name, text in YAMLS.items():
        (tmp_path / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / name).write_text(text)


def test_a_plug_in_brings_its_capability_and_its_rule(tmp_path, monkeypatch):
    """In process, as the command checks a configuration before anything starts: one line, from the plug-in's own
    rule over its own capability."""
    plug_in(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "ext"))
    monkeypatch.setattr(compat, "RULES", list(compat.RULES))  # the plug-in's row leaves the table with this test
    argv = ["strategy=throwaway_ckpt", "fault=slow_disk", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            f"hydra.run.dir={tmp_path / 'run'}"]
    try:
        with pytest.raises(ConfigError) as info:
            check_group_choices(argv)
            precheck(argv)
    finally:
        for name in [m for m in sys.modules if m == "rbext" or m.startswith("rbext.")]:
            del sys.modules[name]
    line = str(info.value)
    assert "\n" not in line and line.startswith("fault=slow_disk: strategy=throwaway_ckpt copies"), line
    assert "use fault=" in line and "fault=slow_disk" not in line.partition("; use ")[2], line


def test_one_class_and_one_yaml_each(tmp_path, reference):
    plug_in(tmp_path)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "ext"), os.environ.get("PYTHONPATH", "")])}
    done = child.run(child.experiment_command(
        ["strategy=throwaway_ckpt", "fault=throwaway_fault", "detector=[throwaway_detector]",
         "recovery=throwaway_policy", "steps=30", "checkpoint.every=5", "world_size=2", "seed=0",
         f"hydra.searchpath=[file://{tmp_path / 'conf'}]"], run_dir), timeout_s=180, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert processes_mentioning(str(run_dir)) == []
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["strategy"], result["fault"], result["recovery"]) == \
        ("throwaway_ckpt", "throwaway_fault", "throwaway_policy")
    assert result["detected"] and result["detector"] == "throwaway_detector" and result["detected_rank"] == 1
    assert result["status"] == "ok" and result["recovered"] and result["attempts"] == 2
    assert result["final_state_sha256"] == reference["final_state_sha256"]  # recovered bit for bit
