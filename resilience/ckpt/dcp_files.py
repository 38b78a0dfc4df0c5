"""DCP's side of a checkpoint's files: the file-system layers DCP writes and reads through, the writer that
calls the save's phase hook, and the save and the verified load that ``sync`` and its kin make with them.

Only ranks import this module (on their first save or load). Importing DCP costs 0.4-0.8 s on this 2-core VM
(DTensor, sympy: ``python -X importtime``), which the supervisor, building every role of a run to validate it,
would pay before its first rank starts; a strategy module that imported DCP at its top put it there.

The sum of a large write runs in a helper thread *while* the write itself runs (xxh3's ``update`` and the write
both release the GIL), so the checksum costs the save no time of its own where a core is free: a profile of a
``dlrm_emb`` save that summed its CRC32 serially after each write put the sum at ~6-14% of the save. With xxh3 the
thread still pays, if little: 256 MiB written in 8 MiB blocks (page cache, no fsync) took 62.5 ms summed in the
thread, 66.5-68.5 ms summed in line and 64.6-65.7 ms not summed (best of 5, 2026-11-27, this 2-core VM).
"""

from __future__ import annotations

import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from resilience.ckpt.checksum import SIDECAR_PREFIX
from resilience.ckpt.digest import CURRENT
from resilience.runtime.rank import PhaseHook

PARALLEL_MIN = 1 << 20  # a smaller write is summed in line: handing it to a thread costs more than the sum
WRITE_THREADS = 2  # files per rank, written at once: this host's disk took 2-3x more with 2-4 streams than with 1
SAVE_ERRORS = (OSError, CheckpointException)  # a save that failed on some rank: lost, not corrupt (DCP gathers)


class _SummingStream:
    """A write stream that keeps the running sum of everything written, summing large writes beside them.

    The sum of a write is joined before ``write`` returns: the caller's buffer is valid only during the call,
    and the sum must see the writes in order."""

    def __init__(self, raw: Any, helper: ThreadPoolExecutor | None) -> None:
        self._raw, self._helper, self.running = raw, helper, CURRENT.new()

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if self._helper is None or view.nbytes < PARALLEL_MIN:
            self.running.update(view)
            return self._raw.write(data)
        summing = self._helper.submit(self.running.update, view)
        try:
            return self._raw.write(data)
        finally:
            summing.result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class ChecksumFileSystem(FileSystem):
    """A DCP file-system layer over ``inner`` that checksums every file written through it (streams may be
    written from several threads at once: DCP's ``thread_count``)."""

    def __init__(self, inner: Any = None, parallel: bool = True) -> None:
        super().__init__()
        self._inner, self._parallel = inner or FileSystem(), parallel
        self.checksums: dict[str, int] = {}
        self._helper: ThreadPoolExecutor | None = None

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            if self._helper is None and self._parallel:
                self._helper = ThreadPoolExecutor(max_workers=4, thread_name_prefix="checksum")
            stream = _SummingStream(raw, self._helper)
            yield stream
            self.checksums[Path(path).name] = stream.running.value  # one key per stream: safe across writer threads

    def write_sidecar(self, directory: Path, rank: int) -> None:
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None
        path = Path(directory) / f"{SIDECAR_PREFIX}rank{rank}.json"
        with open(path, "w") as f:
            json.dump(self.checksums, f)
            f.flush()
            os.fsync(f.fileno())


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a buffer: ``readinto`` copies once, into the caller's memory."""

    def __init__(self, buf: memoryview) -> None:
        super().__init__()
        self._buf, self._pos = buf, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._buf) - self._pos))
        out[:n] = self._buf[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class MemoryFiles(FileSystem):
    """DCP's file system for reading a checkpoint whose files are already in memory (name relative to ``root``)."""

    def __init__(self, root: Path, buffers: dict[str, memoryview]) -> None:
        super().__init__()
        self._root, self._buffers = Path(root), buffers

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" not in mode or "+" in mode:
            raise OSError(f"{path}: a verified checkpoint in memory is read-only")
        yield _MemoryFile(self._buffers[Path(path).relative_to(self._root).as_posix()])


class HookedWriter(FileSystemWriter):
    """DCP's file writer, calling the ``during_checkpoint`` phase hook once this rank's shard is written.

    At that point the shard is on disk but the checkpoint is not committed and peers may still be writing:
    the moment a crash in the middle of a save is most likely to leave a half-written checkpoint behind.
    Each rank writes its share as ``threads`` files in parallel (DCP's ``thread_count``, size-balanced).
    """

    def __init__(self, path, hook: PhaseHook, step: int, fs: Any = None, threads: int = WRITE_THREADS,
                 on_written: Callable[[], None] | None = None) -> None:
        super().__init__(path, sync_files=True, thread_count=threads)
        self._hook, self._step, self._on_written = hook, step, on_written
        self.fs = ChecksumFileSystem(fs)  # over a disk fault's I/O layer, if any

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        self.fs.write_sidecar(self.path, dist.get_rank() if dist.is_initialized() else 0)
        if self._on_written is not None:
            self._on_written()
        self._hook("during_checkpoint", self._step)
        return future


def save(state_dict: dict, writer: FileSystemWriter, group: dist.ProcessGroup | None = None) -> None:
    dcp.save(state_dict, storage_writer=writer, process_group=group)


def load(state_dict: dict, root: Path, buffers: dict[str, memoryview], alone: bool = False) -> None:
    """``state_dict`` loaded in place from the checkpoint at ``root`` whose files are already read and verified;
    ``alone``: by this rank only, no collective (a pipeline's restarted stage, while the others keep theirs)."""
    dcp.load(state_dict, storage_reader=_reader(root, buffers), no_dist=alone)


def planned_files(root: Path, buffers: dict[str, memoryview], state_dict: dict) -> set[str]:
    """The data files that hold what loading ``state_dict`` asks for: the plan of DCP's default load planner (the
    one ``dcp.load`` then makes), over the metadata already verified in ``buffers``."""
    reader = _reader(root, buffers)
    metadata = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def _reader(root: Path, buffers: dict[str, memoryview]) -> FileSystemReader:
    reader = FileSystemReader(root)
    reader.fs = MemoryFiles(root, buffers)
    return reader
