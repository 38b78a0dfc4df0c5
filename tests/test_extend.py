"""Adding a role takes one class and one YAML, nothing else: a throw-away strategy, fault, detector and recovery
policy, written from this test outside the project, run end to end through Hydra's config search path."""

from __future__ import annotations

import json
import os
import textwrap

from conftest import ROOT, processes_mentioning

from resilience import child

CLASSES = {
    "throwaway_ckpt.py": '''
        from resilience.strategies.sync import SyncCheckpoint


        class ThrowawayCkpt(SyncCheckpoint):
            """sync under another name: the run must end in the same bits as sync's."""
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


def test_one_class_and_one_yaml_each(tmp_path, reference):
    package = tmp_path / "ext" / "rbext"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, code in CLASSES.items():
        (package / name).write_text(textwrap.dedent(code))
    for name, text in YAMLS.items():
        (tmp_path / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / name).write_text(text)
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
