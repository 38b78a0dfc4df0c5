"""What the run's ended processes leave in /dev/shm is removed at the end of the run, and nothing else."""

from __future__ import annotations

import os

import mmap
from pathlib import Path
import time

from resilience.proc.orphans import remove_unreachable


def test_what_no_live_process_reaches_since_the_run_began_is_removed_and_nothing_else(tmp_path):
    """A job SIGKILLed whole leaves semaphores and segments no process maps; the job resuming it removes them."""
    (tmp_path / "sem.mp-before").write_bytes(b"x")  # older than the run: another's, left alone
    time.sleep(0.05)
    began = time.time()
    time.sleep(0.05)
    names = ["sem.mp-orphan", "torch_4000001_9_0", "cuda.shm.0.3d0901.1", "sem.mp-mapped", "torch_4000002_9_0", "rb-other_ckpt_shm_0"]
    for name in names:
        (tmp_path / name).write_bytes(b"y" * 4096)
    with (tmp_path / "sem.mp-mapped").open("r+b") as f, mmap.mmap(f.fileno(), 4096) as _mapped, \
            (tmp_path / "torch_4000002_9_0").open("rb") as _held:  # mapped by this live process, and held open
        removed = remove_unreachable(began, shm_dir=tmp_path)
    assert sorted(removed) == [("cuda.shm.0.3d0901.1", 4096), ("sem.mp-orphan", 4096), ("torch_4000001_9_0", 4096)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["sem.mp-before", "sem.mp-mapped", "torch_4000002_9_0", "rb-other_ckpt_shm_0"])  # not ours to judge


def test_a_live_semaphore_of_another_process_is_never_removed():
    """glibc maps a semaphore under a temporary name: a live one is known by its inode (seen: a data loader's
    semaphore removed under a concurrent run, its worker failing with FileNotFoundError)."""
    import multiprocessing

    began = time.time() - 1
    lock = multiprocessing.get_context("forkserver").Lock()  # a named semaphore in /dev/shm, mapped here
    name = next(p.name for p in Path("/dev/shm").glob("sem.mp-*") if p.stat().st_ctime >= began)
    assert name not in [n for n, _ in remove_unreachable(began)]
    assert (Path("/dev/shm") / name).exists()
    del lock


def test_what_a_rank_started_in_its_session_is_killed_wherever_it_was_reparented():
    """A rank leads its own session; a process it started (DLRover's forkserver) may escape the subreaper to init."""
    import subprocess
    import sys
    import time

    from resilience.proc.orphans import kill_sessions

    # the "rank" starts a sleeper and exits: the sleeper is reparented, its session stays the rank's
    rank = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                             "stdout=subprocess.DEVNULL); print(p.pid)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    sleeper = int(rank.communicate(timeout=30)[0])
    killed = kill_sessions({rank.pid})
    assert sleeper in killed and "time.sleep(60)" in killed[sleeper]
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{sleeper}") and time.monotonic() < deadline:
        with open(f"/proc/{sleeper}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # dead, waiting for init to reap it
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{sleeper}")
