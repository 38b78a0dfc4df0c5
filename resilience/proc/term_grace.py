"""The launcher's SIGTERM held while a rank writes its state at a failure (``strategy=jit``): the grace period before
its SIGKILL goes to the write, and a rank with nothing to write ends within it."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Any, Callable


class TermGrace:
    """The launcher's SIGTERM, held while this rank writes its state at a failure.

    A watching thread hears the signal (``signal.set_wakeup_fd``: the C handler writes it to a pipe even while the
    main thread sits in a collective, where no Python handler runs). Writing: the signal waits for the write, after
    which the rank fails and ends anyway. Not writing: the rank ends at once if ``superseded()`` (a state at least as
    new as its own is committed), else it gives its own collective ``wait_s`` to fail and start the write, and ends
    when it does not (exit status 143, as a shell reports a SIGTERM).
    """

    def __init__(self, wait_s: float, superseded: Callable[[], bool]) -> None:
        self.wait_s, self.superseded = wait_s, superseded
        self._writing = threading.Event()
        self._r = self._w = -1
        self._previous: Any = None
        self._previous_fd = -1
        self.term_at: float | None = None

    def install(self) -> None:
        """From the main thread (where signal dispositions are set)."""
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._previous = signal.signal(signal.SIGTERM, lambda *_: None)  # noted by the watcher
        threading.Thread(target=self._watch, name="jit-term-grace", daemon=True).start()

    def writing(self) -> None:
        self._writing.set()

    def _watch(self) -> None:
        r = self._r
        while True:
            try:
                select.select([r], [], [])
                got = os.read(r, 64)
            except (OSError, ValueError):
                got = b""
            if not got:  # closed: the strategy is done with it
                with contextlib.suppress(OSError):
                    os.close(r)
                return
            if signal.SIGTERM in got and self.term_at is None:
                self.term_at = time.monotonic()
                if self._writing.is_set():
                    continue  # the write ends the rank
                if self.superseded() or not self._writing.wait(self.wait_s):
                    os._exit(128 + signal.SIGTERM)

    def close(self) -> None:
        """Give SIGTERM back; the watcher sees its pipe end and closes the other."""
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                signal.set_wakeup_fd(self._previous_fd)
                signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        if self._w >= 0:
            with contextlib.suppress(OSError):
                os.close(self._w)
        self._w = -1
