"""A library's checkpoint worker process that outlives the job's SIGTERM until its rank has saved on it.

DCP's process executor and NVRx's persistent worker are spawned by the rank, DLRover's standalone saver started by
its fork server. A preemption's SIGTERM reaches them
too (torch's elastic agent signals the rank's whole process group, SLURM every process of the job) and they die of
it at once, so a rank that saves on the notice (``checkpoint.on_notice``) waits for a dead worker until the grace
period ends (measured: "save NOT in time", docs/resume.md). The workaround (a library's ``Patch``, declared in
``result.json``) starts the worker through :func:`run_outliving_notice`, which keeps ignoring SIGTERM and ends the
worker when its rank ends (``resilience.proc.lifeline``), as our loader's workers do. The library's code is
unchanged: its worker function is named by a string and looked up in the spawned process, where nothing is patched.

Three details close the gaps:

- The spawned interpreter needs about 2 s (imports) before it runs any code of ours; a notice in that window would
  still kill it. A disposition of SIG_IGN is the one that survives ``exec``, so the rank ignores SIGTERM for the
  moment it spawns such a worker (``_spawned_ignoring_term``): the worker starts ignoring it. A SIGTERM to the rank
  in that moment (the fork and exec, milliseconds) is lost to it: the job then ends at the grace period's SIGKILL
  and resumes from its newest durable checkpoint, as without a save on notice.
- A worker that ignores SIGTERM would also ignore multiprocessing's ``terminate()``, with which the rank ends a
  daemonic child at its exit (and then waits for it without a time limit) and DCP ends its daemon: for these
  workers ``terminate()`` is ``kill()``.
- A worker whose rank was SIGKILLed ends with it (the lifeline), instead of waiting on its queue forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import multiprocessing.context
import os
import platform
import signal
import threading
from types import ModuleType
from typing import Iterator

from resilience.proc.lifeline import outlive_notice


def run_outliving_notice(rank_pid: int, target: str, *args, **kwargs):
    """In the spawned worker: ignore SIGTERM, end with the rank, then run ``module:Class.attr``. The rank's pid
    comes from the rank: a rank SIGKILLed while its worker still imports has left no parent to ask for."""
    outlive_notice(rank_pid, "die-with-rank")
    return _resolve(target)(*args, **kwargs)


def run_with_lifeline(rank_pid: int, target, *args, **kwargs):
    """In a helper spawned inside :func:`spawning_outliving_notice` (SIGTERM already ignored): end with the rank."""
    outlive_notice(rank_pid, "die-with-rank")
    return target(*args, **kwargs)


@contextlib.contextmanager
def spawning_outliving_notice() -> Iterator[None]:
    """The processes this thread spawns meanwhile outlive the notice as the patched workers do: for a library's
    helper started inside one of its calls (NVRx's result-queue manager), whose target is not the library's own."""
    _install_spawn_hooks()
    _SPAWNING.on = True
    try:
        yield
    finally:
        _SPAWNING.on = False


def start_outliving_notice(owner: type | ModuleType, attr: str) -> None:
    """In the rank: make ``owner.attr``, a worker function (static in a class, or of a module) that a library passes
    as a spawned or fork-server process's ``target``, start its worker through :func:`run_outliving_notice`
    (idempotent)."""
    current = owner.__dict__[attr]
    function = current.__func__ if isinstance(current, staticmethod) else current
    if _ours(function):
        return
    if isinstance(owner, ModuleType):
        target = f"{owner.__name__}:{attr}"
        setattr(owner, attr, functools.partial(run_outliving_notice, os.getpid(), target))
    else:
        target = f"{owner.__module__}:{owner.__qualname__}.{attr}"
        setattr(owner, attr, staticmethod(functools.partial(run_outliving_notice, os.getpid(), target)))
    _install_spawn_hooks()


def _ours(target: object) -> bool:
    return isinstance(target, functools.partial) and target.func in (run_outliving_notice, run_with_lifeline)


def _resolve(target: str):
    module, _, path = target.partition(":")
    found = importlib.import_module(module)
    for name in path.split("."):
        found = getattr(found, name)
    if _ours(found):  # patched in the worker process too: the library's own function is gone
        raise RuntimeError(f"{target} is patched in the worker process itself; nothing left to run")
    return found


_SPAWNING = threading.local()


@functools.cache
def _install_spawn_hooks() -> None:
    for kind, spawned in ((multiprocessing.context.SpawnProcess, True),
                          (multiprocessing.context.ForkServerProcess, False)):
        kind._Popen = staticmethod(_hooked(kind.__dict__["_Popen"].__func__, spawned))


def _hooked(shipped, spawned: bool):
    """``_Popen`` of a process kind, for our targets: started ignoring SIGTERM (``spawned``: the rank's own
    fork and exec; a fork server's child is forked by the server, and ignores it from its first line of ours),
    and ended by a kill where multiprocessing would send SIGTERM."""
    def _popen(process_obj):
        target = getattr(process_obj, "_target", None)
        if getattr(_SPAWNING, "on", False) and not _ours(target):
            process_obj._target = functools.partial(run_with_lifeline, os.getpid(), target)
        elif not _ours(target):
            return shipped(process_obj)
        with _spawned_ignoring_term() if spawned else contextlib.nullcontext():
            popen = shipped(process_obj)
        popen.terminate = popen.kill  # SIGTERM is ignored: the rank's own request to end it is a kill
        return popen

    return _popen


# glibc's struct sigaction starts with the handler on these machines; elsewhere the worker is spawned as shipped
_SIGACTION_BYTES = 256  # more than any libc's struct sigaction
_SIG_IGN = 1


@contextlib.contextmanager
def _spawned_ignoring_term() -> Iterator[None]:
    """SIGTERM ignored in this whole process meanwhile, and its own disposition restored after. signal.signal works
    only in the main thread (the libraries spawn from their own), sigaction in any."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    saved = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if libc.sigaction(signal.SIGTERM, None, saved) != 0:
        yield
        return
    ignoring = ctypes.create_string_buffer(saved.raw, _SIGACTION_BYTES)
    ctypes.c_void_p.from_buffer(ignoring).value = _SIG_IGN
    libc.sigaction(signal.SIGTERM, ignoring, None)
    try:
        yield
    finally:
        libc.sigaction(signal.SIGTERM, saved, None)
