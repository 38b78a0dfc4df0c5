"""A file that holds one payload whole or not at all, behind a header: (magic, step, tag, length, xxh3_64).

The per-rank files a node's memory (tmpfs) keeps between a failure and the restart that reads them: ``jit``'s rank
parts, ``shadow``'s parts and states. Each is written beside its path and renamed into place, so a reader finds the
old file or the new one; a file of another kind, cut short or damaged (a node loss zeroes a file before it goes)
reads as None, never as a wrong payload.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import xxhash

HEAD = struct.Struct("<8sqqQQ")  # magic, step, tag (an attempt, a generation), payload length, xxh3_64 of the payload


def head(magic: bytes, step: int, tag: int, payload: bytes | memoryview) -> bytes:
    """The header that seals ``payload`` (computed once for a payload written to several places)."""
    return HEAD.pack(magic, step, tag, len(payload), xxhash.xxh3_64_intdigest(payload))


def write_whole(path: Path, sealed_head: bytes, payload: bytes | memoryview) -> int:
    """``path`` holds the header and ``payload``, or what it held before (no fsync: tmpfs outlives the processes,
    not the machine, which is what these files are for); the bytes written."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for data in (sealed_head, payload):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return len(sealed_head) + len(payload)


def read(path: Path, magic: bytes) -> tuple[int, int, bytes] | None:
    """(step, tag, payload) of a file ``write_whole`` wrote with ``magic``, or None: none there, another kind, torn
    or damaged."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    if len(blob) < HEAD.size:
        return None
    got, step, tag, length, digest = HEAD.unpack_from(blob, 0)
    payload = blob[HEAD.size:HEAD.size + length]
    if got != magic or len(payload) != length or xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    return step, tag, payload
