"""Shared-memory snapshot areas for in-memory checkpointing (DLRover Flash Checkpoint; Gemini, Wang et al. SOSP'23).

An *area* is a plain file under ``/dev/shm`` (tmpfs: RAM), memory-mapped by the rank that writes it. It outlives
that process -- unlike ``multiprocessing.shared_memory``, whose resource tracker unlinks a segment when its
creator dies -- so a restarted rank finds its snapshot again. Only ``node_memory`` removes areas (a simulated node
loss, the end of a run, a run whose supervisor died).

Names: ``rbmem-<run id>-n<node>-r<holder>-of<source>`` is the snapshot of rank ``source`` held in the memory of
rank ``holder`` on node ``node``: holder == source is the rank's own area, otherwise a peer copy (Gemini's replica
in another machine's CPU memory). ``<run id>`` is a hash of the run directory, unique per run.

Layout: page 0 holds a file header and two slot headers; two page-aligned slots follow (double buffering: the
previous snapshot stays valid while the next is written). A slot holds the tensor bytes, then the pickled
state-dict skeleton (``meta``). Writing a slot: clear its commit word, write data and meta, write the header
(step, sizes, optionally the data's checksum, ``digest.CURRENT``: xxh3_64; a CRC32 of the header's own bytes), and
only then the commit word. A writer that dies at any point leaves the slot uncommitted, and an uncommitted slot is
never read.

Reading copies straight from the file into the caller's tensors with ``pread`` (one kernel copy out of the page
cache), not through a mapping: mapping a freshly opened area would fault in every page of it first.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Callable

import torch

from resilience.ckpt.digest import CURRENT, Running

SHM_DIR = Path(os.environ.get("RESILIENCE_SHM_DIR", "/dev/shm"))
PREFIX = "rbmem-"
PAGE = mmap.PAGESIZE
SLOTS = 2
ALIGN = 64  # tensor offsets: aligned for every dtype and for vectorised copies
READ_BLOCK = 4 << 20  # a load reads and sums this much at a time (each block summed while in cache)
FILE_MAGIC = b"RBMEM02\0"  # 02: a 64-bit xxh3_64 of the data in the slot header (01: a CRC32)
FILE_HEAD = struct.Struct("<8sQQ")  # magic, slot capacity, number of slots
# step, attempt, data_len, meta_off, meta_len, checksum of the data (if HAS_SUM), flags, CRC32 of the fields before
# it (zlib: 52 bytes, where a 32-bit sum is enough). 56 bytes: with the commit word, one ALIGN apart per slot.
SLOT_HEAD = struct.Struct("<qqQQQQII")
COMMIT = struct.Struct("<Q")  # follows each slot header; written last
HAS_SUM = 1
COMMITTED = int.from_bytes(b"COMMITED", "little")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # a new area: fault its pages in now, not during a save


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def free_bytes() -> int:
    """Bytes free in the shared-memory file system, for an unprivileged writer."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def run_id(run_dir: str | Path) -> str:
    """The run's unique id in area names: a hash of its (resolved) run directory, the same on every node."""
    return sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def area_path(rid: str, node: int, holder: int, source: int) -> Path:
    return SHM_DIR / f"{PREFIX}{rid}-n{node}-r{holder}-of{source}"


@dataclass(frozen=True)
class SlotInfo:
    """A committed slot: where its snapshot lies and what it holds."""

    index: int
    step: int
    attempt: int
    data_len: int
    meta_off: int
    meta_len: int
    checksum: int | None  # of the tensor bytes (``digest.CURRENT``, in the writer's order); None: written without


class Area:
    """One double-buffered snapshot area (a mapped file). Not thread-safe; one writer per area."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, slot_cap: int) -> None:
        self.path, self._fd, self._mm, self.slot_cap = path, fd, mm, slot_cap

    @classmethod
    def open(cls, path: Path) -> Area | None:
        """The existing area at ``path``, or None (never written, or wiped with its node)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED) if size >= PAGE else None
        magic, cap, slots = FILE_HEAD.unpack_from(mm, 0) if mm is not None else (b"", 0, 0)
        if magic != FILE_MAGIC or slots != SLOTS or size < PAGE + SLOTS * cap:
            if mm is not None:
                mm.close()
            os.close(fd)
            return None
        return cls(path, fd, mm, cap)

    @classmethod
    def create(cls, path: Path, need: int, spare: int = 0) -> Area:
        """The area at ``path`` with slots of at least ``need`` bytes: an existing one that fits is kept as is (its
        slots still hold the snapshots of the previous attempt), else a new one with ``spare`` bytes more."""
        existing = cls.open(path)  # not populated: the next write faults in only the slot it writes
        if existing is not None and existing.slot_cap >= need:
            return existing
        if existing is not None:  # a larger state: a fresh area (whoever maps the old one keeps its pages)
            existing.close()
        # also a file that is no area of this layout (an older magic): reusing it would keep its old slot headers
        path.unlink(missing_ok=True)
        slot_cap = _round(need + spare, PAGE)
        size = PAGE + SLOTS * slot_cap
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve the RAM now: a full /dev/shm is an OSError, not a SIGBUS
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        FILE_HEAD.pack_into(mm, 0, FILE_MAGIC, slot_cap, SLOTS)
        return cls(path, fd, mm, slot_cap)

    def _head_at(self, index: int) -> int:
        return ALIGN * (1 + index)

    def _slot_at(self, index: int) -> int:
        return PAGE + index * self.slot_cap

    def slots(self) -> list[SlotInfo]:
        """The committed slots whose header is intact, oldest step first (their data is checked as it is read)."""
        found = []
        for i in range(SLOTS):
            at = self._head_at(i)
            if COMMIT.unpack_from(self._mm, at + SLOT_HEAD.size)[0] != COMMITTED:
                continue
            raw = self._mm[at:at + SLOT_HEAD.size]
            step, attempt, data_len, meta_off, meta_len, checksum, flags, head_crc = SLOT_HEAD.unpack(raw)
            if zlib.crc32(raw[:-4]) != head_crc or not data_len <= meta_off <= meta_off + meta_len <= self.slot_cap:
                continue
            found.append(SlotInfo(i, step, attempt, data_len, meta_off, meta_len,
                                  checksum if flags & HAS_SUM else None))
        return sorted(found, key=lambda s: (s.step, s.index))

    def find(self, step: int) -> SlotInfo | None:
        return next((s for s in reversed(self.slots()) if s.step == step), None)

    def write(self, step: int, attempt: int, data_len: int, meta: bytes,
              fill: Callable[[torch.Tensor], int | None], before_commit: Callable[[], None] | None = None,
              commit: bool = True) -> SlotInfo:
        """Write a snapshot into the slot not holding the newest one. ``fill(buf)`` writes ``data_len`` bytes into
        ``buf`` (a uint8 tensor over the slot) and returns their checksum, or None for none. ``before_commit`` runs
        when everything but the header and commit word is written (where a crash leaves a half-written snapshot).
        ``commit=False``: the slot stays uncommitted until ``commit(info)`` (e.g. once its checksum is summed after
        the stall); no other write may come in between."""
        meta_off = _round(data_len, ALIGN)
        if meta_off + len(meta) > self.slot_cap:
            raise ValueError(f"snapshot of {meta_off + len(meta)} B does not fit a slot of {self.slot_cap} B")
        valid = {s.index: s for s in self.slots()}
        index = min(range(SLOTS), key=lambda i: (i in valid, valid[i].step if i in valid else 0, i))
        at, base = self._head_at(index), self._slot_at(index)
        COMMIT.pack_into(self._mm, at + SLOT_HEAD.size, 0)  # from here on this slot is no snapshot
        buf = self.view(base, data_len)
        checksum = fill(buf)
        del buf  # no view may outlive the call (the mapping could not be closed)
        self._mm[base + meta_off:base + meta_off + len(meta)] = meta
        info = SlotInfo(index, step, attempt, data_len, meta_off, len(meta), checksum)
        if before_commit is not None:
            before_commit()
        if commit:
            self.commit(info)
        return info

    def commit(self, info: SlotInfo) -> None:
        """Write the slot's header (with ``info.checksum``, if any), then its commit word: only now does it count."""
        at = self._head_at(info.index)
        raw = SLOT_HEAD.pack(info.step, info.attempt, info.data_len, info.meta_off, info.meta_len, info.checksum or 0,
                             HAS_SUM if info.checksum is not None else 0, 0)[:-4]
        self._mm[at:at + SLOT_HEAD.size] = raw + struct.pack("<I", zlib.crc32(raw))
        COMMIT.pack_into(self._mm, at + SLOT_HEAD.size, COMMITTED)

    def checksum(self, info: SlotInfo, ranges: list[tuple[int, int]], block: int = 8 << 20) -> int:
        """The checksum (``digest.CURRENT``) of the slot's data at ``ranges`` ((offset, nbytes), in order), summed
        over the mapping (the GIL is released for each block over 64 KiB)."""
        running, base = CURRENT.new(), self._slot_at(info.index)
        with memoryview(self._mm) as mv:
            for offset, nbytes in ranges:
                for at in range(base + offset, base + offset + nbytes, block):
                    running.update(mv[at:min(at + block, base + offset + nbytes)])
        return running.value

    def view(self, offset: int, length: int) -> torch.Tensor:
        """A uint8 tensor over ``length`` bytes at ``offset`` (drop it before ``close``)."""
        if not length:  # frombuffer refuses an empty range
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=length, offset=offset)

    def data(self, info: SlotInfo) -> torch.Tensor:
        """A uint8 tensor over the slot's data (drop it before ``close``)."""
        return self.view(self._slot_at(info.index), info.data_len)

    def meta(self, info: SlotInfo) -> bytes:
        return os.pread(self._fd, info.meta_len, self._slot_at(info.index) + info.meta_off)

    def read_into(self, info: SlotInfo, offset: int, dst: torch.Tensor, running: Running | None = None) -> None:
        """Copy the bytes at ``offset`` of the slot's data into ``dst``, adding them to ``running`` (if any: a
        load's sum, fed in the order of ``checksum``'s ranges)."""
        direct = dst.device.type == "cpu" and dst.is_contiguous()
        target = dst if direct else torch.empty(dst.shape, dtype=dst.dtype)
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        base = self._slot_at(info.index) + offset
        # block by block, each summed while it is still in cache: a second pass over a large tensor (an embedding
        # table of hundreds of MB) would read it back from memory
        for at in range(0, view.nbytes, READ_BLOCK):
            block = view[at:at + READ_BLOCK]
            if os.preadv(self._fd, [block], base + at) != block.nbytes:
                raise OSError(f"{self.path}: short read at {offset + at}")
            if running is not None:
                running.update(block)
        if not direct:
            dst.copy_(target)

    def invalidate_newer(self, step: int) -> list[int]:
        """Uncommit every snapshot newer than ``step`` (an abandoned timeline); return their steps."""
        doomed = [s for s in self.slots() if s.step > step]
        for s in doomed:
            COMMIT.pack_into(self._mm, self._head_at(s.index) + SLOT_HEAD.size, 0)
        return [s.step for s in doomed]

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # a tensor view is still alive somewhere: the mapping goes with it
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
