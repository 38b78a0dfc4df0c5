"""What the training's ranks and the gradient shadow (``strategy=shadow``) share: files in ``/dev/shm``.

The shadow is a process beside the supervisor (``resilience/ckpt/shadow_apply.py``, started by the strategy's
``agent_service``) that holds one replica of the parameters and the optimizer and applies every step's reduced
gradients to it, as Checkmate's CPU shadow does (arXiv:2507.13522). Everything it exchanges with the ranks lies in
files named ``rbmem-<run id>-shadow-*`` (``shm_store``'s prefix and run id: the run's clean-up removes them, and a
training node's loss, ``node_memory``, does not touch them: they stand for the shadow's own node).

* **The control block** (``Control``, ``-shadow-ctl``): int64 words, each one aligned store (a reader sees the old
  value or the new one). The supervisor creates it (with the shadow's pid); rank 0 posts requests to the shadow
  (initialise from a state, settle and dump, adopt a generation, a digest, stop) and waits for the answer; the
  shadow says which step its state holds (``APPLIED``); each rank marks the newest step whose own parts it has put
  (``mark``: generation and step in one word).
* **The gradient ring** (``GradRing``, ``-shadow-grads``): ``slots`` slots, one per step (``step % slots``), each
  the step's reduced gradients at fixed offsets and a small pickled record (each group's hyperparameters as the
  step used them, which parameters had a gradient). A slot's header and commit word are written last: a rank
  killed while it writes leaves the slot uncommitted, and the shadow never applies it.
* **The parts** (``put_parts``/``get_parts``, ``-shadow-parts-r<rank>-<k>``): each rank's own parts of the job's
  state at a step (its RNG streams and data loader's position; rank 0 also the job-wide parts, the model's buffers
  and the groups' hyperparameters after the step), ``slots + 1`` files per rank by step, each written whole beside
  its place and renamed into it, with an xxh3 sum. They are on no replica, so they live with the shadow.
* **A state file** (``write_state``/``read_state``, ``-shadow-init`` and ``-shadow-state``): a ``torch.save`` of
  parameters and optimizer with a header and a sum: rank 0's initial state for the shadow, the shadow's state for
  the ranks after a failure.

The ranks wait for the shadow (back-pressure) before they reuse a slot or a parts file whose step the shadow may still
need: the slot of step ``k`` holds step ``k - slots`` until it is applied, and a parts file is rewritten only once
the shadow's state is past the step it holds, so the parts of the shadow's step are always there.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import pickle
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from resilience.ckpt import sealed, shm_store
from resilience.proc import lifeline
from resilience.ckpt.shm_store import ALIGN, PAGE, PREFIX

# ---- names ------------------------------------------------------------------------------------------------------


def _name(rid: str, what: str) -> Path:
    return shm_store.SHM_DIR / f"{PREFIX}{rid}-shadow-{what}"


def ctl_path(rid: str) -> Path:
    return _name(rid, "ctl")


def ring_path(rid: str) -> Path:
    return _name(rid, "grads")


def parts_path(rid: str, rank: int, index: int) -> Path:
    return _name(rid, f"parts-r{rank}-{index}")


def init_path(rid: str) -> Path:
    return _name(rid, "init")


def dump_path(rid: str) -> Path:
    return _name(rid, "state")


# ---- the control block --------------------------------------------------------------------------------------------

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


# ---- the gradient ring --------------------------------------------------------------------------------------------

RING_MAGIC = b"RBSGRD01"
RING_HEAD = struct.Struct("<8sQQQQ")  # magic, slots, slot capacity, data length, meta capacity
# step, generation, meta length, flags, commit time (monotonic ns); the commit word follows
SLOT_HEAD = struct.Struct("<qqQQq")
COMMIT = struct.Struct("<Q")
COMMITTED = int.from_bytes(b"SHDWSTEP", "little")
STEPPED = 1  # flags: the optimizer stepped (fp16's scaler skips a step whose gradients overflowed)
META_CAP = 64 << 10


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Layout:
    """Where each parameter's gradient lies in a slot (the optimizer's order: its groups, then their params)."""

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    data_len: int

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> Layout:
        offsets, at = [], 0
        for p in params:
            offsets.append(at)
            at += _round(p.numel() * p.element_size(), ALIGN)
        return cls(tuple(p.dtype for p in params), tuple(tuple(p.shape) for p in params), tuple(offsets), at)


@dataclass(frozen=True)
class Slot:
    index: int
    step: int
    gen: int
    meta_len: int
    flags: int
    commit_ns: int


class GradRing:
    """The ring of gradient slots, mapped. Rank 0 writes, the shadow reads; a slot has one writer at a time."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, slots: int, slot_cap: int, layout: Layout) -> None:
        self.path, self._fd, self._mm, self.slots, self.slot_cap, self.layout = path, fd, mm, slots, slot_cap, layout
        self._views: list[list[torch.Tensor]] | None = None

    @staticmethod
    def _geometry(layout: Layout, slots: int) -> tuple[int, int]:
        slot_cap = _round(layout.data_len + META_CAP, PAGE)
        return slot_cap, PAGE + slots * slot_cap

    @classmethod
    def create(cls, path: Path, layout: Layout, slots: int) -> GradRing:
        """The ring at ``path`` for ``layout``: the one there if it has this geometry (its slots are another
        generation's, which the shadow never applies), else a new one."""
        slot_cap, size = cls._geometry(layout, slots)
        ring = cls.open(path, layout)
        if ring is not None and ring.slots == slots and ring.slot_cap == slot_cap:
            return ring
        if ring is not None:
            ring.close()
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # the RAM now: a full /dev/shm is an OSError here, not a SIGBUS later
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        RING_HEAD.pack_into(mm, 0, RING_MAGIC, slots, slot_cap, layout.data_len, META_CAP)
        return cls(path, fd, mm, slots, slot_cap, layout)

    @classmethod
    def open(cls, path: Path, layout: Layout) -> GradRing | None:
        """The ring at ``path`` if it is one laid out for ``layout`` (None: none, or another layout)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        size = os.fstat(fd).st_size
        if size < PAGE:
            os.close(fd)
            return None
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        magic, slots, slot_cap, data_len, meta_cap = RING_HEAD.unpack_from(mm, 0)
        if magic != RING_MAGIC or data_len != layout.data_len or meta_cap != META_CAP or \
                size < PAGE + slots * slot_cap or not slots:
            mm.close()
            os.close(fd)
            return None
        return cls(path, fd, mm, slots, slot_cap, layout)

    def _head_at(self, index: int) -> int:
        return ALIGN * (1 + index)

    def _base(self, index: int) -> int:
        return PAGE + index * self.slot_cap

    def views(self, index: int) -> list[torch.Tensor]:
        """Each parameter's gradient in slot ``index``, as tensors over the mapping (made once)."""
        if self._views is None:
            self._views = [[torch.frombuffer(self._mm, dtype=dt, count=_numel(shape), offset=self._base(i) + off)
                            .view(shape) if _numel(shape) else torch.empty(shape, dtype=dt)
                            for dt, shape, off in zip(self.layout.dtypes, self.layout.shapes, self.layout.offsets)]
                           for i in range(self.slots)]
        return self._views[index]

    def write(self, step: int, gen: int, grads: list[torch.Tensor | None] | None, meta: bytes,
              before_commit: Callable[[], None] | None = None) -> int:
        """Put step ``step``'s gradients (None: the optimizer did not step) into its slot; return the bytes copied.
        The slot counts only once its header and commit word are written, last."""
        if len(meta) > META_CAP:
            raise ValueError(f"strategy=shadow: a step's record of {len(meta)} B exceeds its {META_CAP} B")
        index = step % self.slots
        at, base = self._head_at(index), self._base(index)
        COMMIT.pack_into(self._mm, at + SLOT_HEAD.size, 0)  # from here on the slot holds no step
        copied = 0
        if grads is not None:
            for view, grad in zip(self.views(index), grads):
                if grad is not None:
                    view.copy_(grad.detach())
                    copied += grad.numel() * grad.element_size()
        meta_at = base + self.layout.data_len
        self._mm[meta_at:meta_at + len(meta)] = meta
        if before_commit is not None:
            before_commit()
        SLOT_HEAD.pack_into(self._mm, at, step, gen, len(meta), STEPPED if grads is not None else 0,
                            time.monotonic_ns())
        COMMIT.pack_into(self._mm, at + SLOT_HEAD.size, COMMITTED)
        return copied

    def slot(self, step: int) -> Slot | None:
        """The committed slot of ``step``, or None (not yet written, being written, or another step's)."""
        index = step % self.slots
        at = self._head_at(index)
        if COMMIT.unpack_from(self._mm, at + SLOT_HEAD.size)[0] != COMMITTED:
            return None
        got = Slot(index, *SLOT_HEAD.unpack_from(self._mm, at))
        return got if got.step == step else None

    def meta(self, slot: Slot) -> bytes:
        at = self._base(slot.index) + self.layout.data_len
        return bytes(self._mm[at:at + slot.meta_len])

    def still(self, slot: Slot) -> bool:
        """Whether ``slot`` still holds its step (read after copying it: a writer may not overtake the reader,
        but a restarted rank 0 of another generation could)."""
        now = self.slot(slot.step)
        return now is not None and now.gen == slot.gen and now.commit_ns == slot.commit_ns

    def close(self) -> None:
        self._views = None
        try:
            self._mm.close()
        except BufferError:  # a view is alive somewhere: the mapping goes with it
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- the parts, and whole state files -----------------------------------------------------------------------------

PARTS_MAGIC = b"RBSPRT01"
STATE_MAGIC = b"RBSSTA01"


def put_parts(path: Path, step: int, gen: int, parts: dict[str, Any]) -> int:
    """Keep ``parts`` (plain state dicts, pickled as they are) of ``step`` at ``path``; the bytes written."""
    payload = pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)
    return sealed.write_whole(path, sealed.head(PARTS_MAGIC, step, gen, payload), payload)


def get_parts(path: Path, step: int) -> tuple[dict[str, Any], int] | None:
    """The parts of ``step`` kept at ``path``, and their size in bytes; None if that file holds no intact parts of
    that step."""
    found = sealed.read(path, PARTS_MAGIC)
    if found is None or found[0] != step:
        return None
    return pickle.loads(found[2]), sealed.HEAD.size + len(found[2])


def write_state(path: Path, step: int, gen: int, state: dict[str, Any]) -> int:
    """``state`` (tensors and plain values) of ``step``, ``torch.save``d with a header and a sum; the bytes written."""
    buf = io.BytesIO()
    torch.save(state, buf)
    view = buf.getbuffer()
    try:
        return sealed.write_whole(path, sealed.head(STATE_MAGIC, step, gen, view), view)
    finally:
        del view


def read_state(path: Path) -> tuple[int, dict[str, Any], int] | None:
    """(step, state, bytes) of a state file, or None: none there, or it fails its sum."""
    found = sealed.read(path, STATE_MAGIC)
    if found is None:
        return None
    step, _, payload = found
    return step, torch.load(io.BytesIO(payload), weights_only=False), sealed.HEAD.size + len(payload)


def replica_digest(params: list[torch.Tensor], optim_state: dict[int, dict[str, Any]]) -> str:
    """SHA-256 over a replica's parameters (the optimizer's order) and the optimizer's per-parameter state: what the
    shadow and the training must hold alike, bit for bit, at the same step (the groups' hyperparameters are not in
    it: the training's have moved on to the next step's learning rate)."""
    h = hashlib.sha256()
    for i, p in enumerate(params):
        _feed(h, f"param.{i}", p)
    for i in sorted(optim_state):
        for key in sorted(optim_state[i]):
            _feed(h, f"state.{i}.{key}", optim_state[i][key])
    return h.hexdigest()


def _feed(h: Any, key: str, value: Any) -> None:
    h.update(key.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())
