"""The checksum of checkpoint bytes, in one place: which algorithm new records use, and how any record is read.

New checksums are xxh3_64 (the ``xxhash`` package): 33.4 GB/s on one core of this project's 2-core VM where
``zlib.crc32`` ran at 7.3 GB/s (512 MiB warm buffer, 2026-11-27; docs/loading.md), so a save's and a load's sums
keep pace with memory, not with the CRC. Its ``update`` releases the GIL for buffers over 64 KiB, as ``zlib.crc32``
does, so the sums may still run in helper threads beside the I/O.

A commit record of a disk checkpoint names its algorithm: ``{"checksum": "xxh3_64", "sums": {file: int}}``. A record
written before the switch has ``{"crc32": {file: int}}`` and no name; it is still verified, with ``zlib.crc32``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import xxhash


class Running(Protocol):
    """A sum over a stream of buffers, fed in order (a streaming hash does not chain like ``crc32(block, prev)``)."""

    def update(self, data: Any) -> None: ...

    @property
    def value(self) -> int: ...


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)


class _Xxh3:
    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: Any) -> None:
        self._h.update(data)

    @property
    def value(self) -> int:
        return self._h.intdigest()


@dataclass(frozen=True)
class Digest:
    """One checksum algorithm: its name in records and a fresh running sum (``new()``)."""

    name: str
    new: Callable[[], Running]

    def of_file(self, path: Path, chunk: int = 1 << 22) -> int:
        running = self.new()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                running.update(block)
        return running.value


XXH3_64 = Digest("xxh3_64", _Xxh3)
CRC32 = Digest("crc32", _Crc32)
CURRENT = XXH3_64  # what every new checksum uses (disk records and in-memory snapshot slots)
_BY_NAME = {d.name: d for d in (XXH3_64, CRC32)}


def record_fields(sums: dict[str, int]) -> dict[str, Any]:
    """The commit record's checksum fields for ``sums`` (summed with ``CURRENT``)."""
    return {"checksum": CURRENT.name, "sums": sums}


def for_record(record: dict[str, Any]) -> tuple[Digest, dict[str, int]]:
    """The algorithm and per-file sums of a commit record, new form or old (``"crc32"``); ``KeyError`` if it has
    neither, ``ValueError`` for an algorithm this code does not know."""
    if "checksum" not in record:
        return CRC32, record["crc32"]
    digest = _BY_NAME.get(record["checksum"])
    if digest is None:
        raise ValueError(f"unknown checksum algorithm {record['checksum']!r}")
    return digest, record["sums"]
