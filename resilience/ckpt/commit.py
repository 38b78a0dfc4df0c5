"""The on-disk layout of checkpoints and their atomic commit.

``<ckpt_dir>/step_00000010/`` holds one checkpoint in DCP's format (``.metadata`` and ``*.distcp``). It counts
only once ``COMMIT.json`` (step, file names, sizes and checksums, and the identity of the run that wrote it) has
been written, fsynced and renamed into place and the directory fsynced: a crash at any earlier point leaves a
directory without a marker, which is never loaded.

Before a load, ``check`` verifies a committed checkpoint: written by this run, every file present with its size
and checksum (``digest``: xxh3_64, or CRC32 in a record written before the switch), the record itself readable.
Anything missing, unreadable or malformed is a reason to skip it for the previous one, never an error: a restart
must not fail on a checkpoint it can pass over.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from resilience.ckpt.checksum import SIDECAR_PREFIX, collect_checksums
from resilience.ckpt.digest import for_record, record_fields
from resilience.settings.identity import RunIdentity
from resilience.record.fsio import atomic_write_json, fsync_dir

COMMIT_MARKER = "COMMIT.json"
METADATA_FILES = (".metadata", ".snapshot_metadata")  # DCP's and torchsnapshot's index of a checkpoint
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    path: Path
    committed: bool


class CheckpointDir:
    """Lists, commits, checks and prunes the checkpoints under one directory, on behalf of ``owner``."""

    def __init__(self, root: str | Path, owner: RunIdentity | None = None) -> None:
        self.root = Path(root)
        self.owner = owner

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def entries(self) -> list[CheckpointEntry]:
        """Every checkpoint directory, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and child.is_dir():
                found.append(CheckpointEntry(int(m.group(1)), child, (child / COMMIT_MARKER).is_file()))
        return sorted(found, key=lambda e: e.step)

    def newest_committed(self, max_step: int | None = None) -> CheckpointEntry | None:
        """The newest committed checkpoint, optionally no newer than ``max_step`` (a rollback bound)."""
        committed = [e for e in self.entries() if e.committed and (max_step is None or e.step <= max_step)]
        return committed[-1] if committed else None

    def manifest(self, entry: CheckpointEntry) -> dict:
        return json.loads((entry.path / COMMIT_MARKER).read_text())

    def incomplete_after(self, step: int) -> list[CheckpointEntry]:
        """Uncommitted checkpoints newer than ``step``: saves that a crash interrupted."""
        return [e for e in self.entries() if not e.committed and e.step > step]

    def data_files(self, entry: CheckpointEntry) -> list[Path]:
        """The files that hold tensor bytes: DCP's ``*.distcp`` shards, or else every file of the commit record
        but a library's metadata (what a checkpoint fault damages)."""
        shards = sorted(entry.path.glob("*.distcp"))
        if shards:
            return shards
        return [entry.path / name for name in sorted(self.manifest(entry)["files"]) if name not in METADATA_FILES]

    def size(self, entry: CheckpointEntry) -> int:
        """Bytes of a committed checkpoint's files, as its manifest lists them."""
        return sum(self.manifest(entry)["files"].values())

    def check(self, entry: CheckpointEntry, checksums: bool = True) -> str | None:
        """Why ``entry`` must not be loaded (None: it may): another run's, a file missing, cut short or changed
        (its checksum, one read of each file), or an unreadable or malformed commit record."""
        try:
            record = self.manifest(entry)
            files, (digest, sums) = record["files"], for_record(record)
            if not isinstance(files, dict) or not files or set(sums) != set(files):
                return "the commit record lists no files or not a checksum for each"
            if record.get("step") != entry.step:
                return f"the commit record is for step {record.get('step')}"
            if self.owner is not None and record.get("run") != self.owner.as_dict():
                return f"written by another run ({record.get('run')})"
            for name, size in files.items():
                actual = (entry.path / name).stat().st_size
                if actual != size:
                    return f"{name} has {actual} bytes, the commit record says {size}"
            if checksums:
                bad = sorted(name for name, value in sums.items() if digest.of_file(entry.path / name) != value)
                if bad:
                    return f"checksum mismatch in {', '.join(bad)}"
        except FileNotFoundError as exc:
            return f"missing file {Path(exc.filename or '?').name}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError is a ValueError
            return f"unreadable commit record or file: {type(exc).__name__}: {exc}"[:300]
        return None

    def prepare(self, step: int) -> Path:
        """An empty directory for ``step``; leftovers of an interrupted save of the same step are removed."""
        path = self.path_for(step)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        fsync_dir(self.root)
        return path

    def commit(self, step: int) -> int:
        """Make the checkpoint of ``step`` durable and visible; return its size in bytes."""
        path = self.path_for(step)
        sums = collect_checksums(path)
        files = {f.relative_to(path).as_posix(): f.stat().st_size for f in sorted(path.rglob("*"))
                 if f.is_file() and not f.name.startswith(SIDECAR_PREFIX)}  # a library may write sub-directories
        for name in files:  # DCP fsyncs its data files; the metadata, a library's files and the entries need it
            fd = os.open(path / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for sub in sorted({(path / name).parent for name in files}, reverse=True):
            fsync_dir(sub)
        fsync_dir(path)
        record = {"step": step, "files": files, **record_fields({k: v for k, v in sums.items() if k in files})}
        if self.owner is not None:
            record["run"] = self.owner.as_dict()
        atomic_write_json(path / COMMIT_MARKER, record)
        return sum(files.values())

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed checkpoints, and uncommitted ones older than those."""
        entries = self.entries()
        committed = [e for e in entries if e.committed]
        kept = committed[-keep:]
        if not kept:
            return []
        doomed = [e for e in entries if e.step < kept[0].step or (not e.committed and e.step < kept[-1].step)]
        for e in doomed:
            shutil.rmtree(e.path, ignore_errors=True)
        if doomed:
            fsync_dir(self.root)
        return [e.step for e in doomed]
