"""A file that holds one payload whole or not at all, behind a header: (magic, step, tag, length, xxh3_64).

The per-rank files a node's memory (tmpfs) keeps between a failure and the restart that reads them: ``jit``'s rank
parts, ``shadow``'s parts and states; the boundary log's spill files (``parallel/boundary_log.py``), which also travel
sealed between ranks (``unseal``). Each file is written beside its path and renamed into place, so a reader finds the
old file or the new one; a file of another kind, cut short or damaged (a node loss zeroes a file before it goes)
reads as None, never as a wrong payload.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import xxhash

from resilience.record.fsio import fsync_dir

HEAD = struct.Struct("<8sqqQQ")  # magic, step, tag (an attempt, a generation), payload length, xxh3_64 of the payload


def head(magic: bytes, step: int, tag: int, payload: bytes | memoryview) -> bytes:
    """The header that seals ``payload`` (computed once for a payload written to several places)."""
    return HEAD.pack(magic, step, tag, len(payload), xxhash.xxh3_64_intdigest(payload))


def write_whole(path: Path, sealed_head: bytes, payload: bytes | memoryview, fsync: bool = False) -> int:
    """``path`` holds the header and ``payload``, or what it held before; the bytes written. No fsync by default:
    tmpfs outlives the processes, not the machine, which is what these files are for; ``fsync`` for a file on disk
    that must outlive the machine's crash too."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for data in (sealed_head, payload):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
    return len(sealed_head) + len(payload)


def read(path: Path, magic: bytes) -> tuple[int, int, bytes] | None:
    """(step, tag, payload) of a file ``write_whole`` wrote with ``magic``, or None: none there, another kind, torn
    or damaged."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    found = unseal(blob, magic)
    return None if found is None else found[:3]


def unseal(blob: bytes | memoryview, magic: bytes, offset: int = 0) -> tuple[int, int, bytes, int] | None:
    """(step, tag, payload, end) of the sealed record at ``offset`` of ``blob`` (records laid end to end), or None:
    another kind, cut short or damaged."""
    if len(blob) - offset < HEAD.size:
        return None
    got, step, tag, length, digest = HEAD.unpack_from(blob, offset)
    start = offset + HEAD.size
    payload = bytes(blob[start:start + length])
    if got != magic or len(payload) != length or xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    return step, tag, payload, start + length
