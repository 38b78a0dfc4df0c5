"""Per-file checksums of a checkpoint (``digest.CURRENT``), computed as the bytes are written (no second read).

Each rank's writer records the checksums of the files it wrote in a sidecar ``.sums-rank<r>.json`` before its
write phase ends; rank 0 folds the sidecars (and the checksum of DCP's metadata) into ``COMMIT.json``. A load
verifies them as it reads (``verified_read``), in the same pass over the bytes that feeds the load.

The sum of a large write runs in a helper thread *while* the write itself runs (xxh3's ``update`` and the write
both release the GIL), so the checksum costs the save no time of its own where a core is free: a profile of a
``dlrm_emb`` save that summed its CRC32 serially after each write put the sum at ~6-14% of the save. With xxh3 the
thread still pays, if little: 256 MiB written in 8 MiB blocks (page cache, no fsync) took 62.5 ms summed in the
thread, 66.5-68.5 ms summed in line and 64.6-65.7 ms not summed (best of 5, 2026-11-27, this 2-core VM).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint.filesystem import FileSystem

from resilience.ckpt.digest import CURRENT

SIDECAR_PREFIX = ".sums-"  # a rank's sums in the save's directory: folded into the record, never listed in it
PARALLEL_MIN = 1 << 20  # a smaller write is summed in line: handing it to a thread costs more than the sum


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


def collect_checksums(directory: Path) -> dict[str, int]:
    """The checksums (``CURRENT``) of every file of a finished save: the ranks' sidecars plus what they did not
    cover."""
    sums: dict[str, int] = {}
    for sidecar in sorted(Path(directory).glob(f"{SIDECAR_PREFIX}rank*.json")):
        sums.update(json.loads(sidecar.read_text()))
    for f in sorted(Path(directory).rglob("*")):
        name = f.relative_to(directory).as_posix()
        if f.is_file() and not f.name.startswith(SIDECAR_PREFIX) and name not in sums:
            # DCP's .metadata, written after the ranks' write phase, and the files of a library that does its own
            # I/O: read back once, in the background persist
            sums[name] = CURRENT.of_file(f)
    return sums
