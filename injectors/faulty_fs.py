"""The disk fault's I/O layer: each stream of DCP's local file system routed through a ``SlowDisk`` (``FaultyStream``).

Apart from ``slow_disk`` because it subclasses DCP's ``FileSystem``: only a rank builds it (``checkpoint_fs``), and
the supervisor, which builds the injector to validate the run, need not import DCP (``resilience.ckpt.dcp_files``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

from torch.distributed.checkpoint.filesystem import FileSystem

from injectors.kill import die



class Disk(Protocol):
    """What the I/O layer asks of the disk fault (``SlowDisk``)."""

    active: bool

    def before_write(self, file_offset: int, nbytes: int) -> int | None:
        """Where to cut a write of ``nbytes`` at ``file_offset`` (a torn write), or None to write it whole."""

    def throttle(self, nbytes: int) -> None:
        ...

    def latency(self) -> None:
        ...


class FaultyStream:
    """A file stream whose writes and reads pass through the disk fault."""

    def __init__(self, raw: Any, disk: Disk) -> None:
        self._raw, self._disk, self._written = raw, disk, 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        cut = self._disk.before_write(self._written, n)
        if cut is not None:  # torn write: only the first part reaches the disk, then the process dies
            self._raw.write(memoryview(data).cast("B")[:cut])
            self._raw.flush()
            os.fsync(self._raw.fileno())
            die("SIGKILL")
        written = self._raw.write(data)
        self._written += n
        self._disk.throttle(n)
        return written

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._disk.throttle(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer)
        self._disk.throttle(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:  # seek, tell, flush, fileno, ...: the real file's
        return getattr(self._raw, name)


class FaultyFileSystem(FileSystem):
    """DCP's local file system with every stream routed through a ``SlowDisk``."""

    def __init__(self, disk: Disk) -> None:
        super().__init__()
        self._disk = disk

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if not self._disk.active:
                yield raw
                return
            self._disk.latency()
            yield FaultyStream(raw, self._disk)
