"""NVIDIA Resiliency Extension's launcher: ``ft_launcher`` runs the ranks instead of our supervisor
(``supervisor.launcher=ft_launcher``).

NVRx's ``ft_launcher`` is torchrun's agent with NVRx's fault tolerance in it: one ``RankMonitorServer`` per local
rank, which the rank's ``RankMonitorClient`` (our ``nvrx_heartbeat`` detector's rank side, through the socket the
launcher names in ``FT_RANK_MONITOR_IPC_SOCKET``) sends a heartbeat after every step; a rank whose heartbeat is
overdue (``--ft-rank-heartbeat-timeout`` = ``timeouts.heartbeat_s``; before the first one
``--ft-initial-rank-heartbeat-timeout`` = ``timeouts.collective_s``) is killed, and the launcher restarts every rank
within ``--max-restarts``. As under ``launcher=torchrun`` nothing of ours sits in its agent: no detector of ours
runs in the supervisor, and the recovery is timed from the ranks' own events. NVRx's verdicts are read from its
output (``<run dir>/ft_launcher.log``: "Did not get subsequent heartbeat", with the time and the rank monitor's local
rank) when it has exited, and recorded as ``fault_detected`` events of ``nvrx_heartbeat`` at the logged time (to the
millisecond), so that its detection latency and blame sit beside our detectors'.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

from resilience.record.events import EventLog
from resilience.supervise.observer import Observer

from resilience.supervise.torchrun import TorchrunSupervisor

LOG = "ft_launcher.log"  # in the run directory: the launcher's and its rank monitors' output
VERDICT = re.compile(r"^\[(?P<when>[\d-]+ [\d:]+,\d+)\] \[WARNING\] \[RankMonServer\d+@\S*:(?P<rank>\d+)\] "
                     r"Did not get (?P<which>initial|subsequent) heartbeat\. Waited (?P<waited>[\d.]+) seconds")


class FtLauncherSupervisor(TorchrunSupervisor):
    """Runs ``ft_launcher`` as a child and waits, as ``TorchrunSupervisor`` runs torchrun."""

    mode = "ft_launcher"
    log = LOG

    def caveats(self) -> list[str]:
        """What the run's settings ask for that ft_launcher does not do (said, never silently ignored)."""
        said = []
        unseen = [d.name for d in self.detectors if d.acts_in_supervisor() and d.caps.served_by != self.mode]
        if unseen:
            said.append(f"supervisor.launcher=ft_launcher: detector(s) {', '.join(unseen)} act in the supervisor, "
                        f"which ft_launcher's agent replaces: they do not run")
        if not any(d.caps.served_by == self.mode for d in self.detectors):
            said.append("supervisor.launcher=ft_launcher: no rank sends NVRx heartbeats (add nvrx_heartbeat to the "
                        "detector list): its rank monitors then see no hang")
        return said

    def command(self) -> list[str]:
        launcher = shutil.which("ft_launcher", path=os.path.dirname(sys.executable)) or shutil.which("ft_launcher")
        if launcher is None:  # checked at validation; a changed environment lands here
            raise RuntimeError("ft_launcher is not installed: pip install -e '.[nvrx]'")
        t = self.cfg.timeouts
        return [launcher, "--standalone", "--nnodes=1", f"--nproc-per-node={self.world_size}",
                f"--max-restarts={self.max_restarts}", f"--monitor-interval={self.cfg.supervisor.monitor_interval_s}",
                f"--ft-rank-heartbeat-timeout={t.heartbeat_s}", f"--ft-initial-rank-heartbeat-timeout={t.collective_s}",
                "-m", "resilience.rank", str(self.config_path)]

    def _run(self, events: EventLog, observer: Observer) -> str:
        try:
            return super()._run(events, observer)
        finally:
            for verdict in verdicts(self.run_dir / self.log):
                events.emit("fault_detected", detector="nvrx_heartbeat", blamed_rank=verdict["rank"],
                            verdict=f"ft_launcher's rank monitor: no {verdict['which']} heartbeat from rank "
                                    f"{verdict['rank']} within {verdict['waited']} s", silent=False,
                            t_wall=verdict["t_wall"], t_mono=verdict["t_mono"], from_log=True)


def verdicts(log: Path) -> list[dict]:
    """NVRx's rank monitors' verdicts in the launcher's output, in time order, on this host's monotonic clock."""
    if not log.exists():
        return []
    offset = time.time() - time.monotonic()
    found = []
    for line in log.read_text(errors="replace").splitlines():
        m = VERDICT.match(line)
        if m:  # the launcher logs local time
            wall = datetime.strptime(m["when"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append({"rank": int(m["rank"]), "which": m["which"], "waited": float(m["waited"]),
                          "t_wall": wall, "t_mono": wall - offset})
    return sorted(found, key=lambda v: v["t_mono"])
