"""A stand-in for a rank of tests/test_worker_notice.py: it patches a library-like worker function with
``start_outliving_notice``, spawns its worker as DCP and NVRx do (``multiprocessing`` spawn, daemonic), prints one
JSON line, then does what ``argv[1]`` says: ``term`` (SIGTERM to the worker at once, in its start-up, and to
itself), ``exit`` (leave at once, the worker still running) or ``wait`` (until killed); ``helper`` starts a
multiprocessing manager inside ``spawning_outliving_notice`` instead, ``forkserver`` a module's function by a fork
server."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's modules

from resilience.libs.worker_notice import spawning_outliving_notice, start_outliving_notice  # noqa: E402


class Library:
    @staticmethod
    def worker(seconds: float) -> None:
        time.sleep(seconds)


def _ignores_term(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def module_worker(seconds: float) -> None:
    time.sleep(seconds)


def forkserver() -> None:
    """A module's worker function started by a fork server (DLRover's saver): SIGTERM once it runs, then exit."""
    start_outliving_notice(sys.modules[__name__], "module_worker")
    worker = multiprocessing.get_context("forkserver").Process(target=module_worker, args=(60.0,), daemon=True)
    worker.start()
    time.sleep(2.0)  # past its first line of ours
    os.kill(worker.pid, signal.SIGTERM)
    time.sleep(1.0)
    print(json.dumps({"worker": worker.pid, "worker_alive": worker.is_alive(),
                      "worker_ignores_term": _ignores_term(worker.pid)}), flush=True)


def helper() -> None:
    """A helper spawned inside a library's call (NVRx's result-queue manager): SIGTERM at once, then used."""
    with spawning_outliving_notice():
        manager = multiprocessing.get_context("spawn").Manager()
    server = manager._process
    os.kill(server.pid, signal.SIGTERM)
    time.sleep(2.0)
    queue = manager.Queue()
    queue.put("written")
    print(json.dumps({"worker": server.pid, "worker_alive": server.is_alive(),
                      "worker_ignores_term": _ignores_term(server.pid), "queue": queue.get()}), flush=True)


def main(mode: str) -> None:
    if mode == "helper":
        return helper()
    if mode == "forkserver":
        return forkserver()
    noted = []
    signal.signal(signal.SIGTERM, lambda *_: noted.append(time.monotonic()))
    start_outliving_notice(Library, "worker")
    worker = multiprocessing.get_context("spawn").Process(target=Library.worker, args=(60.0,), daemon=True)
    worker.start()
    report = {"worker": worker.pid, "rank": os.getpid(), "rank_ignores_term": _ignores_term(os.getpid())}
    if mode == "term":
        os.kill(worker.pid, signal.SIGTERM)  # at once: the worker is still importing
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3.0)
        report.update(worker_alive=worker.is_alive(), worker_ignores_term=_ignores_term(worker.pid),
                      rank_noted_term=len(noted))
    print(json.dumps(report), flush=True)
    if mode == "wait":
        time.sleep(60.0)


if __name__ == "__main__":
    main(sys.argv[1])
