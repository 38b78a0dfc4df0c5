"""Per-file checksums of a checkpoint (``digest.CURRENT``), computed as the bytes are written (no second read).

Each rank's writer records the checksums of the files it wrote in a sidecar ``.sums-rank<r>.json`` before its
write phase ends; rank 0 folds the sidecars (and the checksum of DCP's metadata) into ``COMMIT.json``. A load
verifies them as it reads (``verified_read``), in the same pass over the bytes that feeds the load.

The sums are taken as the bytes are written, by the file-system layer DCP writes through
(``dcp_files.ChecksumFileSystem``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from resilience.ckpt.digest import CURRENT

SIDECAR_PREFIX = ".sums-"  # a rank's sums in the save's directory: folded into the record, never listed in it


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
