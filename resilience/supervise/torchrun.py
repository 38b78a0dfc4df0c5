"""The stock ``torchrun`` as the launcher: the plain baseline of restart cost (``supervisor.launcher=torchrun``).

PyTorch's launcher, run as users run it (``python -m torch.distributed.run --standalone``), starts the ranks, and
when one fails stops all and starts them again within ``--max-restarts``. Nothing of ours sits in its agent: no
detector sees the failure (the run has no detection events; hangs are not detected at all), and the recovery is
timed from the ranks' own events (fault record to training again). Our ``restart_all`` supervisor is the same agent
with our eyes on it (``resilience.supervise.elastic``): the two side by side show what the observation costs.
"""

from __future__ import annotations

import os
import subprocess
import sys

from resilience.record.events import EventLog
from resilience.supervise.observer import Observer, say
from resilience.supervise.supervisor import Supervisor

LOG = "torchrun.log"  # in the run directory: the launcher's own output


class TorchrunSupervisor(Supervisor):
    """Runs torchrun as a child and waits; what it leaves is cleaned up as after any run."""

    mode = "torchrun"

    def caveats(self) -> list[str]:
        """What the run's settings ask for that torchrun does not do (not an error: said, never silently ignored)."""
        unseen = [d.name for d in self.detectors if d.acts_in_supervisor()]
        return [f"supervisor.launcher=torchrun: detector(s) {', '.join(unseen)} act in the supervisor, which "
                f"torchrun's agent replaces: they do not run (it sees rank exits only, no hang)"] if unseen else []

    log = LOG

    def command(self) -> list[str]:
        """The launcher's command line (a launcher built on torchrun's agent changes only this)."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                f"--nproc-per-node={self.world_size}", f"--max-restarts={self.max_restarts}",
                f"--monitor-interval={self.cfg.supervisor.monitor_interval_s}",
                "-m", "resilience.rank", str(self.config_path)]

    def _run(self, events: EventLog, observer: Observer) -> str:
        cmd = self.command()
        # As our elastic supervisor: a fresh store per attempt (pytorch/pytorch#135712).
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        with open(self.run_dir / self.log, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        say(f"{self.mode} started (pid {proc.pid}); its output in {self.run_dir / self.log}")
        try:
            return "succeeded" if proc.wait() == 0 else "failed"
        finally:
            if proc.poll() is None:  # interrupted: torchrun stops its ranks on SIGTERM
                proc.terminate()
                try:
                    proc.wait(float(self.cfg.timeouts.shutdown_s) + 5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
