"""The gradient ring of the gradient shadow (``strategy=shadow``): rank 0 writes each step's reduced gradients into
it, the shadow's process reads them (the files it lies among: ``shadow_files``).

The ring (``GradRing``, ``-shadow-grads``) has ``slots`` slots, one per step (``step % slots``), each the step's
reduced gradients at fixed offsets (``Layout``) and a small pickled record (each group's hyperparameters as the step
used them, which parameters had a gradient). A slot's header and commit word are written last: a rank killed while it
writes leaves the slot uncommitted, and the shadow never applies it.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from resilience.ckpt.shm_store import ALIGN, PAGE

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
