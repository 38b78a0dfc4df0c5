"""A checkpoint read once: every file into memory with its checksum checked on the way, then decoded from there.

Before, rank 0 read the whole checkpoint to check its checksums and then DCP read it again from the files. Now every
rank maps each file of the commit record and sums it over the mapping (the one pass over the bytes); the ranks
agree that every file passed before DCP touches a tensor, and DCP then decodes from the mappings (``MemoryFiles``):
its copies come out of the page cache the sum just filled, with no second read of the files. A corrupt file thus
never leaves half a checkpoint in the live state. Through a disk fault's I/O layer the files are read into buffers
instead (the fault must see every read), with the sum taken beside the reads. The algorithm is the record's
(``digest.for_record``): xxh3_64, or CRC32 in a record written before the switch.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from resilience.ckpt.digest import CURRENT, Digest

BLOCK = 8 << 20


class CorruptFile(OSError):
    """A file of a committed checkpoint is missing, cut short, longer than recorded, or fails its checksum."""


def read_verified(fs: Any, path: Path, size: int, expected: int, digest: Digest = CURRENT) -> memoryview:
    """The ``size`` bytes of ``path``, or ``CorruptFile`` saying why not; ``expected``: the commit record's sum of
    the file, by ``digest`` (the record's algorithm, ``digest.for_record``).

    ``fs`` None: the file is mapped (read-only) and summed in place: one pass over the bytes, no copy and no
    fresh memory (the mapping shares the page cache; first-touch faults on a new buffer cost more than the copy).
    Otherwise (a disk fault's I/O layer) it is read through ``fs`` into a buffer, each block summed in a helper
    thread while the next block is read (both release the GIL)."""
    if fs is None:
        return _mapped(path, size, expected, digest)
    buf = memoryview(bytearray(size))
    running = digest.new()
    # one worker: the blocks are summed in order
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum") as helper, fs.create_stream(path, "rb") as f:
        done, pending = 0, None
        while done < size:
            n = f.readinto(buf[done:done + BLOCK])
            if not n:
                raise CorruptFile(f"{path.name} has {done} bytes, the commit record says {size}")
            pending = helper.submit(running.update, buf[done:done + n])
            done += n
        if f.read(1):
            raise CorruptFile(f"{path.name} is longer than the {size} bytes the commit record says")
        if pending is not None:
            pending.result()
    if running.value != expected:
        raise CorruptFile(f"checksum mismatch in {path.name}")
    return buf


def _mapped(path: Path, size: int, expected: int, digest: Digest) -> memoryview:
    with open(path, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise CorruptFile(f"{path.name} has {actual} bytes, the commit record says {size}")
        if not size:
            view = memoryview(b"")
        else:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_WILLNEED)  # a cold file: read ahead of the sum
            view = memoryview(mm)
    running = digest.new()
    for at in range(0, size, BLOCK):
        running.update(view[at:at + BLOCK])
    if running.value != expected:
        raise CorruptFile(f"checksum mismatch in {path.name}")
    return view
