"""The control block of the gradient shadow (``strategy=shadow``): how rank 0 and the supervisor talk to the shadow's
process, and how the ranks tell it which steps they have published (the files it lies among: ``shadow_files``).

The block (``Control``, ``-shadow-ctl``) is int64 words, each one aligned store (a reader sees the old value or the
new one). The supervisor creates it (with the shadow's pid); rank 0 posts requests to the shadow (initialise from a
state, settle and dump, adopt a generation, a digest, stop) and waits for the answer; the shadow says which step its
state holds (``APPLIED``); each rank marks the newest step whose own parts it has put (``mark``: generation and step
in one word).
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from resilience.proc import lifeline
from resilience.ckpt.shm_store import PAGE

CTL_MAGIC = int.from_bytes(b"RBSHDW01", "little")
# The words of the control block, in order.
(MAGIC, PID, STATE, GEN, WORLD, APPLIED, APPLIED_NS, PUBLISHED, REQ_SEQ, REQ_KIND, REQ_GEN, REQ_WORLD, REQ_STEP,
 RESP_SEQ, RESP_STATUS, RESP_STEP, RESP_BYTES, RESP_NS, DIGEST) = range(19)
DIGEST_WORDS = 4  # a SHA-256, in 4 words from DIGEST on
MARKS = 32  # rank r's mark is word MARKS + r
MESSAGE_AT = PAGE  # the shadow's last error, as text, on the second page
MESSAGE_LEN = PAGE

# STATE: what the shadow process is doing
STARTING, EMPTY, HOLDING, FAILED, STOPPED = 0, 1, 2, 3, 4
# REQ_KIND: what rank 0 (or the supervisor) asks of it
INIT, SETTLE, ADOPT, DIGEST_AT, STOP = 1, 2, 3, 4, 5
GEN_SHIFT = 32  # a mark: generation << 32 | step


def mark_of(gen: int, step: int) -> int:
    return (gen << GEN_SHIFT) | step


def unmark(mark: int) -> tuple[int, int]:
    return mark >> GEN_SHIFT, mark & ((1 << GEN_SHIFT) - 1)


class ShadowGone(RuntimeError):
    """The shadow process ended, failed, or did not answer in time."""


class Control:
    """The control block, mapped; ``words`` is an int64 array over it (each element one aligned 8-byte store)."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, ranks: int) -> None:
        self.path, self._fd, self._mm, self.ranks = path, fd, mm, ranks
        self.words = np.ndarray((MESSAGE_AT // 8,), dtype=np.int64, buffer=mm)

    @staticmethod
    def size(ranks: int) -> int:
        return MESSAGE_AT + MESSAGE_LEN if MARKS + ranks <= MESSAGE_AT // 8 else 0

    @classmethod
    def create(cls, path: Path, ranks: int) -> Control:
        """A new block for ``ranks`` ranks at most (a run's ``world_size``), the shadow not yet started."""
        size = cls.size(ranks)
        if not size:
            raise ValueError(f"strategy=shadow: at most {MESSAGE_AT // 8 - MARKS} ranks (world_size={ranks})")
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        ctl = cls(path, fd, mm, ranks)
        ctl.words[APPLIED] = -1
        ctl.words[WORLD] = ranks
        ctl.words[MAGIC] = CTL_MAGIC
        return ctl

    @classmethod
    def open(cls, path: Path, wait_s: float = 0.0) -> Control:
        """The block at ``path``; waits up to ``wait_s`` for it to appear (the supervisor creates it)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise ShadowGone(f"strategy=shadow: no shadow control block at {path} (is the run's supervisor "
                                     f"the local one?)") from None
                time.sleep(0.05)
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        ranks = (MESSAGE_AT // 8) - MARKS
        ctl = cls(path, fd, mm, ranks)
        if int(ctl.words[MAGIC]) != CTL_MAGIC:
            ctl.close()
            raise ShadowGone(f"strategy=shadow: {path} is no shadow control block")
        return ctl

    def __getitem__(self, word: int) -> int:
        return int(self.words[word])

    def __setitem__(self, word: int, value: int) -> None:
        self.words[word] = value

    def mark(self, rank: int, gen: int, step: int) -> None:
        self.words[MARKS + rank] = mark_of(gen, step)

    def marked(self, rank: int) -> tuple[int, int]:
        return unmark(int(self.words[MARKS + rank]))

    @property
    def message(self) -> str:
        raw = self._mm[MESSAGE_AT:MESSAGE_AT + MESSAGE_LEN]
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    @message.setter
    def message(self, text: str) -> None:
        raw = text.encode()[:MESSAGE_LEN - 1]
        self._mm[MESSAGE_AT:MESSAGE_AT + MESSAGE_LEN] = raw + bytes(MESSAGE_LEN - len(raw))

    def digest(self) -> str:
        return self.words[DIGEST:DIGEST + DIGEST_WORDS].tobytes().hex()

    def set_digest(self, hexdigest: str) -> None:
        self.words[DIGEST:DIGEST + DIGEST_WORDS] = np.frombuffer(bytes.fromhex(hexdigest), dtype=np.int64)

    def alive(self) -> bool:
        """Whether the shadow process is there and has not failed."""
        pid = self[PID]
        if pid <= 0 or self[STATE] in (FAILED, STOPPED):
            return False
        return lifeline.alive(pid) and _not_zombie(pid)

    def request(self, kind: int, gen: int = 0, world: int = 0, step: int = 0, timeout_s: float = 60.0,
                poll_s: float = 0.0005) -> tuple[int, int, int]:
        """Post a request to the shadow and wait for its answer: (step, bytes, nanoseconds it took). One requester
        at a time: rank 0 while ranks run, the supervisor when none does."""
        seq = self[REQ_SEQ] + 1
        self[REQ_KIND], self[REQ_GEN], self[REQ_WORLD], self[REQ_STEP] = kind, gen, world, step
        self[REQ_SEQ] = seq  # last: the shadow reads the fields once it sees the new number
        self.wait(lambda: self[RESP_SEQ] == seq, timeout_s, poll_s, f"to answer request {kind}")
        if self[RESP_STATUS] != 0:
            raise ShadowGone(f"strategy=shadow: the shadow failed request {kind}: {self.message}")
        return self[RESP_STEP], self[RESP_BYTES], self[RESP_NS]

    def wait(self, done: Callable[[], bool], timeout_s: float, poll_s: float, what: str) -> float:
        """Poll ``done`` until it holds; the seconds waited. ``ShadowGone`` if the shadow ends or fails meanwhile, or
        ``timeout_s`` passes."""
        if done():
            return 0.0
        t0 = time.monotonic()
        deadline, nap, checked = t0 + timeout_s, poll_s, t0
        while not done():
            now = time.monotonic()
            if now - checked > 0.05:  # a liveness check costs a syscall or two: not every poll
                checked = now
                if not self.alive():
                    raise ShadowGone(f"strategy=shadow: the shadow process (pid {self[PID]}) is gone while waiting "
                                     f"{what}" + (f": {self.message}" if self.message else ""))
            if now >= deadline:
                raise ShadowGone(f"strategy=shadow: the shadow did not manage {what} within {timeout_s:g} s "
                                 f"(it holds step {self[APPLIED]})")
            time.sleep(nap)
            nap = min(nap * 2, 0.005)
        return time.monotonic() - t0

    def close(self) -> None:
        del self.words
        try:
            self._mm.close()
        except BufferError:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
