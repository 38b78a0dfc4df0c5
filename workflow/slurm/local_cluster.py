"""A real SLURM cluster on this machine from Debian's packages, for the tests and for trying profiles/slurm by hand.

    python workflow/slurm/local_cluster.py up DIR     # start it; prints `export SLURM_CONF=DIR/slurm.conf`
    python workflow/slurm/local_cluster.py up DIR 2   # two nodes on this machine (two slurmd, see below)
    python workflow/slurm/local_cluster.py down DIR   # stop everything it started; DIR keeps the logs

Needs root and Debian's slurm-wlm (22.05), slurmdbd, munge and mariadb-server (`make test-slurm` installs them).
munged runs as `munge` and mariadbd as `mysql`, slurmdbd, slurmctld and slurmd as root (proctrack/linuxproc,
task/none: no cgroups in a container). Everything lives under DIR (key, configurations, spool, database,
sockets, logs) and every port is a free one picked at start, so nothing in /etc is touched and two clusters can
share a machine. Jobs find the configuration through SLURM_CONF, which sbatch passes into them (the executor
plugin submits with --export=ALL); without it every job step fails with "Could not establish a configuration
source".

With more than one node, each node is a slurmd of its own on this machine (Debian's slurmd is built with
multiple-slurmd support: a Port per NodeName, spool, pid and log files per node through %n), each with all of the
machine's CPUs: a job of several nodes (rule `multinode`) then really runs one job step task per "node".

Accounting is real (slurmdbd on MariaDB, AccountingStorageEnforce=associations): the executor plugin polls job
states with `sacct`, and a job whose account SLURM does not know is refused, as on a production cluster.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ACCOUNT = "rb-test"
PARTITION = "rb"
CLUSTER = "rbtest"
NODE = "rb1"  # the first node; others are rb2, rb3, ...
# The commands `up` needs, from the four packages.
TOOLS = ("munged", "munge", "mariadb-install-db", "mariadbd", "mariadb", "slurmdbd", "slurmctld", "slurmd",
         "sacctmgr", "scontrol", "sinfo", "squeue", "scancel", "sbatch", "srun", "sacct")
PACKAGES = "slurm-wlm slurmdbd munge mariadb-server"


class ClusterError(RuntimeError):
    """The cluster could not start (the message names the step and ends with the daemon's log)."""


def missing_tools() -> list[str]:
    """The commands of TOOLS that are not installed (empty: the cluster can start)."""
    return [t for t in TOOLS if shutil.which(t) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, logs: tuple[Path, ...] = (),
               pid: int | None = None) -> None:
    """Poll ``check`` until it holds; ClusterError after ``timeout_s`` (every wait here is bounded), or as soon
    as the daemon ``pid`` has exited."""
    deadline = time.monotonic() + timeout_s
    while not check():
        exited = pid is not None and not alive(pid)
        if exited or time.monotonic() > deadline:
            tails = "".join(f"\n{log}:\n{log.read_text(errors='replace')[-2000:]}" for log in logs if log.exists())
            raise ClusterError(f"{what}: {'exited' if exited else f'not ready after {timeout_s:.0f} s'}{tails}")
        time.sleep(0.3)


def proc_file(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:  # gone
        return b""


def mentions(pid: int, marker: str) -> bool:
    """Whether the command line or the environment of process ``pid`` names ``marker`` (a daemon: its
    directory; never a recycled pid of someone else)."""
    return any(marker.encode() in proc_file(pid, f) for f in ("cmdline", "environ"))


def job_process(pid: int, conf: Path) -> bool:
    """A process of a job of this cluster: slurmstepd (it inherits slurmd's SLURM_CONF) or anything a job
    started (SLURM_JOB_ID beside our SLURM_CONF). A shell that merely exported SLURM_CONF is not one."""
    env = proc_file(pid, "environ").split(b"\0")
    return f"SLURM_CONF={conf}".encode() in env and (
        proc_file(pid, "comm").startswith(b"slurmstepd") or any(v.startswith(b"SLURM_JOB_ID=") for v in env))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


@dataclass
class Daemon:
    """One daemon in the foreground (no forking away), its pid under DIR/pids and its output in DIR/log."""

    name: str
    argv: list[str]
    user: str = "root"

    def start(self, root: Path, env: dict[str, str]) -> int:
        log = open(root / "log" / f"{self.name}.out", "ab")
        proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, user=self.user, group=pwd.getpwnam(self.user).pw_gid,
                                extra_groups=[], cwd=root)
        log.close()
        (root / "pids" / self.name).write_text(str(proc.pid))
        return proc.pid


class LocalSlurm:
    """The cluster in ``root`` (an absolute directory; created by up, kept by down for its logs)."""

    # Start order, then one slurmd per node (slurmd-rb1, ...); down stops the slurmds first, then these in reverse.
    ORDER = ("munged", "mariadbd", "slurmdbd", "slurmctld")

    def __init__(self, root: Path, nodes: int = 1):
        self.root = Path(root).resolve()
        self.nodes = [f"rb{i}" for i in range(1, nodes + 1)]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.db_socket = self.root / "db" / "mysqld.sock"

    # -- commands against this cluster ------------------------------------------------------------------------
    def run(self, *argv: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def ok(self, *argv: str) -> bool:
        try:
            return self.run(*argv, timeout_s=15).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def node_state(self, node: str = NODE) -> str:
        try:
            return self.run("sinfo", "-h", "-n", node, "-o", "%T", timeout_s=15).stdout.strip()
        except subprocess.TimeoutExpired:
            return ""

    # -- up -----------------------------------------------------------------------------------------------------
    def up(self, timeout_s: float = 60) -> None:
        """Start munged, MariaDB, slurmdbd (with the test account), slurmctld and slurmd; return when the node
        is idle. ClusterError (naming the step and its log) if a step does not come up within ``timeout_s``."""
        if os.geteuid() != 0:
            raise ClusterError("the local SLURM cluster needs root (slurmctld and slurmd run as root)")
        if missing := missing_tools():
            raise ClusterError(f"not installed: {', '.join(missing)} (apt-get install {PACKAGES})")
        for sub in ("munge", "db", "log", "pids", "run", "ctld", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munge and mysql reach their sockets through it
        ports = {k: free_port() for k in ("db", "dbd", "ctld", *self.nodes)}
        self._start_munge(timeout_s)
        password = self._start_mariadb(ports["db"], timeout_s)
        self._write_configs(ports, password)
        self._start("slurmdbd", ["slurmdbd", "-D"], lambda: self.ok("sacctmgr", "-n", "list", "cluster"), timeout_s,
                    self.root / "log" / "slurmdbd.log")
        # Before slurmctld starts, so that it finds its cluster and the associations it enforces.
        for add in (["cluster", CLUSTER], ["account", ACCOUNT, f"cluster={CLUSTER}"],
                    ["user", "root", f"account={ACCOUNT}", f"cluster={CLUSTER}"]):
            done = self.run("sacctmgr", "-i", "add", *add)
            if done.returncode != 0 and "Nothing new added" not in done.stdout + done.stderr:
                raise ClusterError(f"sacctmgr add {' '.join(add)}: {done.stdout}{done.stderr}")
        self._start("slurmctld", ["slurmctld", "-D"], lambda: "UP" in self.run("scontrol", "ping").stdout,
                    timeout_s, self.root / "log" / "slurmctld.log")
        for node in self.nodes:
            self._start(f"slurmd-{node}", ["slurmd", "-D", "-N", node], lambda node=node: self.node_state(node) == "idle",
                        timeout_s, self.root / "log" / f"slurmd.{node}.log")

    def _start(self, name: str, argv: list[str], ready: Callable[[], bool], timeout_s: float, log: Path,
               user: str = "root") -> None:
        """Start one daemon and wait until ``ready`` holds (at most ``timeout_s``; at once if it exits)."""
        pid = Daemon(name, argv, user).start(self.root, self.env)
        wait_until(ready, timeout_s, name, (self.root / "log" / f"{name}.out", log), pid)

    def _start_munge(self, timeout_s: float) -> None:
        munge = pwd.getpwnam("munge")
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))  # this cluster's own key, not /etc/munge's
        for path, mode in ((self.root / "munge", 0o755), (key, 0o400)):  # munged wants its socket reachable
            os.chown(path, munge.pw_uid, munge.pw_gid)
            path.chmod(mode)
        d = self.root / "munge"
        self._start("munged", ["munged", "-F", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed",
                               f"--log-file={d}/munged.log"],
                    lambda: self.ok("munge", "-n", "-S", str(self.munge_socket)), timeout_s, d / "munged.log",
                    user="munge")

    def _start_mariadb(self, port: int, timeout_s: float) -> str:
        mysql = pwd.getpwnam("mysql")
        data = self.root / "db" / "data"
        os.chown(self.root / "db", mysql.pw_uid, mysql.pw_gid)
        done = self.run("mariadb-install-db", "--no-defaults", "--user=mysql", f"--datadir={data}",
                        "--auth-root-authentication-method=socket", "--skip-test-db", timeout_s=120)
        if done.returncode != 0:
            raise ClusterError(f"mariadb-install-db: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        sql = ["mariadb", "--no-defaults", f"--socket={self.db_socket}", "-uroot"]
        self._start("mariadbd", ["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={self.db_socket}",
                                 f"--port={port}", "--bind-address=127.0.0.1", "--skip-name-resolve",
                                 f"--log-error={self.root}/db/mariadbd.err", "--innodb-buffer-pool-size=256M",
                                 "--innodb-lock-wait-timeout=900"],
                    lambda: self.ok(*sql, "-e", "SELECT 1"), timeout_s, self.root / "db" / "mariadbd.err", user="mysql")
        password = secrets.token_hex(12)
        done = self.run(*sql, "-e", f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
                                    "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")
        if done.returncode != 0:
            raise ClusterError(f"mariadb: creating the slurm user: {done.stderr}")
        return password

    def _write_configs(self, ports: dict[str, int], db_password: str) -> None:
        r, host = self.root, socket.gethostname()
        cpus = len(os.sched_getaffinity(0))
        mem_mb = int(next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
                     / 1024 * 0.9)
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs={cpus} "
                          f"RealMemory={mem_mb} State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(f"""# written by workflow/slurm/local_cluster.py: one node, this machine
ClusterName={CLUSTER}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
{auth}CredType=cred/munge
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports['dbd']}
AccountingStoragePass={self.munge_socket}
AccountingStorageEnforce=associations
{nodes}
PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=NO MaxTime=INFINITE State=UP
""")
        dbd = r / "slurmdbd.conf"  # slurmdbd reads it beside SLURM_CONF; it holds a password: root only
        dbd.touch(mode=0o600)
        dbd.write_text(f"""{auth}DbdHost={host}
DbdAddr=127.0.0.1
DbdPort={ports['dbd']}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports['db']}
StorageUser=slurm
StoragePass={db_password}
StorageLoc=slurm_acct_db
PidFile={r}/run/slurmdbd.pid
LogFile={r}/log/slurmdbd.log
""")

    # -- down ---------------------------------------------------------------------------------------------------
    def down(self, timeout_s: float = 30) -> list[int]:
        """Cancel every job, stop every daemon (SIGTERM, SIGKILL after ``timeout_s``), then kill what is left of
        the cluster (job steps, their processes). Returns the pids still alive at the end (empty: all gone)."""
        if shutil.which("squeue") and self.conf.exists():
            try:
                jobs = self.run("squeue", "-h", "-o", "%i", timeout_s=10).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, timeout_s=10)
                    wait_until(lambda: not self.run("squeue", "-h", "-o", "%i", timeout_s=10).stdout.strip(),
                               timeout_s, "scancel")
            except (subprocess.TimeoutExpired, ClusterError):
                pass  # the controller is gone or stuck: the sweep below kills the jobs' processes
        left = []
        slurmds = sorted(p.name for p in (self.root / "pids").glob("slurmd-*"))  # however many `up` started
        for name in [*slurmds, *reversed(self.ORDER)]:
            pid_file = self.root / "pids" / name
            if pid_file.exists():
                left += self._stop([int(pid_file.read_text())], timeout_s)
                pid_file.unlink()
        return left + self._stop(self.leftovers(), timeout_s, signal.SIGKILL)

    def leftovers(self) -> list[int]:
        """Processes of this cluster still running (a job step whose daemon is gone, say)."""
        me = os.getpid()
        return [pid for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
                if pid != me and job_process(pid, self.conf) and alive(pid)]

    def _stop(self, pids: list[int], timeout_s: float, sig: int = signal.SIGTERM) -> list[int]:
        pids = [p for p in pids if mentions(p, str(self.root))]
        for pid in pids:
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in (p for p in pids if alive(p)):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        return [p for p in pids if alive(p)]


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[0] not in ("up", "down") or argv[2:] and not argv[2].isdigit():
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    cluster = LocalSlurm(Path(argv[1]), nodes=int(argv[2]) if argv[2:] else 1)
    if argv[0] == "up":
        try:
            cluster.up()
        except ClusterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            cluster.down()
            return 1
        print(f"export SLURM_CONF={cluster.conf}  # account {ACCOUNT}, partition {PARTITION}")
        return 0
    left = cluster.down()
    if left:
        print(f"error: still running after down: {left}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
