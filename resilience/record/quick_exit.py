"""Leave a process as soon as its record is durable, without the interpreter's slow teardown.

After ``import torch`` (and DDP's ``torch._dynamo``, DCP's sympy), ``Py_Finalize`` spends 0.5 s on an idle core and
several seconds on a busy host freeing the module graph object by object (py-spy: the main thread busy with no
Python frame). A rank's exit is on the critical path of every cell (the supervisor waits for it) and so is the
supervisor's own. Here the process does what a normal exit does that anyone can observe: it waits for its
non-daemon threads, runs the ``atexit`` callbacks (logging's flush, ``multiprocessing``'s joins of its children,
``weakref.finalize`` callbacks), flushes stdio, then ends with ``os._exit``: only the freeing of memory the kernel
reclaims anyway is skipped.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_code(exc: SystemExit) -> int:
    """The status a ``SystemExit`` means (as the interpreter reads it): None 0, an int itself, else printed, 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` after everything a normal exit guarantees, minus the interpreter teardown."""
    for thread in threading.enumerate():  # the interpreter joins these before atexit: so do we
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 (CPython's own entry for these; they run once, as at a normal exit)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing left to flush to
            pass
    os._exit(code)
