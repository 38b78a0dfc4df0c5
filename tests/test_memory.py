"""The host-memory figure counts what the run's process tree takes from the host: memory shared by several
processes once, a child's private memory fully."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing import shared_memory

import pytest

from resilience.record.memory import MemorySampler, available, tree_pss_bytes

MB = 1 << 20
SIZE = 64 * MB

# A child that waits, then maps the segment named on its command line (or allocates privately) and writes every page.
CHILD = """
import sys
import time
from multiprocessing import shared_memory, resource_tracker
print("base", flush=True); sys.stdin.readline()
name, size = sys.argv[1], int(sys.argv[2])
if name == "private":
    buf = bytearray(size); buf[::4096] = b"x" * len(buf[::4096])
else:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the test owns it
    shm.buf[::4096] = b"y" * len(shm.buf[::4096])
print("mapped", flush=True); sys.stdin.readline()
"""

pytestmark = pytest.mark.skipif(not available(), reason="no /proc/self/smaps_rollup (Linux only)")


def _children(args: list[str], n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "base"
    return procs


def _step(procs: list[subprocess.Popen], expect: str | None) -> None:
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
        if expect:
            assert p.stdout.readline().strip() == expect


def _growth(args: list[str], n: int, hold_s: float = 0.0) -> int:
    procs = _children(args, n)
    try:
        before = tree_pss_bytes(os.getpid())
        _step(procs, "mapped")
        grown = tree_pss_bytes(os.getpid()) - before
        time.sleep(hold_s)
        return grown
    finally:
        _step(procs, None)
        for p in procs:
            p.wait(timeout=30)


@pytest.mark.timeout(60)
def test_a_segment_mapped_by_three_processes_counts_once():
    shm = shared_memory.SharedMemory(create=True, size=SIZE)
    try:
        shm.buf[::4096] = b"z" * len(shm.buf[::4096])  # the parent maps it too
        grown = _growth([shm.name, str(SIZE)], 2)
    finally:
        shm.close()
        shm.unlink()
    # RSS would add 2 x 64 MB; PSS moves the parent's share onto the children: the total hardly changes.
    assert grown < 0.25 * SIZE, grown / MB


@pytest.mark.timeout(60)
def test_private_memory_of_children_counts_fully():
    grown = _growth(["private", str(SIZE)], 2)
    assert 1.8 * SIZE < grown < 2.4 * SIZE, grown / MB


@pytest.mark.timeout(60)
def test_sampler_reports_a_peak_and_its_sample_count():
    idle = tree_pss_bytes(os.getpid())
    sampler = MemorySampler(interval_s=0.05).start()
    _growth(["private", str(SIZE)], 1, hold_s=0.3)  # the child holds 64 MB for 0.3 s, then exits
    peak, samples = sampler.stop()
    assert samples >= 2 and peak is not None and peak > idle + 0.9 * SIZE, (idle / MB, peak and peak / MB)
