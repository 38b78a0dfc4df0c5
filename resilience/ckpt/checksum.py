"""Per-file CRC32 checksums of a checkpoint, computed as the bytes are written (no second read).

Each rank's writer records the checksums of the files it wrote in a sidecar ``.crc-rank<r>.json`` before its
write phase ends; rank 0 folds the sidecars (and the checksum of DCP's metadata) into ``COMMIT.json``. The
``ckpt_integrity`` detector recomputes them at load time.
"""

from __future__ import annotations

import json
import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint.filesystem import FileSystem

SIDECAR_GLOB = ".crc-rank*.json"


class _SummingStream:
    def __init__(self, raw: Any) -> None:
        self._raw, self.crc = raw, 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self._raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class ChecksumFileSystem(FileSystem):
    """A DCP file-system layer over ``inner`` that checksums every file written through it."""

    def __init__(self, inner: Any = None) -> None:
        super().__init__()
        self._inner = inner or FileSystem()
        self.checksums: dict[str, int] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _SummingStream(raw)
            yield stream
            self.checksums[Path(path).name] = stream.crc

    def write_sidecar(self, directory: Path, rank: int) -> None:
        path = Path(directory) / f".crc-rank{rank}.json"
        with open(path, "w") as f:
            json.dump(self.checksums, f)
            f.flush()
            os.fsync(f.fileno())


def file_crc32(path: Path, chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def collect_checksums(directory: Path) -> dict[str, int]:
    """The checksums of every file of a finished save: the ranks' sidecars plus what they did not cover."""
    sums: dict[str, int] = {}
    for sidecar in sorted(Path(directory).glob(SIDECAR_GLOB)):
        sums.update(json.loads(sidecar.read_text()))
    for f in sorted(Path(directory).rglob("*")):
        name = f.relative_to(directory).as_posix()
        if f.is_file() and not f.name.startswith(".crc-") and name not in sums:
            # DCP's .metadata, written after the ranks' write phase, and the files of a library that does its own
            # I/O: read back once, in the background persist
            sums[name] = file_crc32(f)
    return sums
