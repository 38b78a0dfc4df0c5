"""Checkpoint checksums (``resilience/ckpt/digest.py``): xxh3_64 in new records and snapshot slots, and the CRC32
records written before the switch still verified -- each case with a flipped byte that only the checksum can see."""

from __future__ import annotations

import dataclasses
import json
import zlib

import pytest
import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from resilience.ckpt import shm_store
from resilience.ckpt.commit import COMMIT_MARKER, CheckpointDir
from resilience.ckpt.digest import CRC32, CURRENT, XXH3_64, for_record
from resilience.ckpt.shm_store import Area
from resilience.ckpt.verified import CorruptFile, read_verified
from resilience.record.events import read_events
from resilience.state.train import state_sha256
from resilience.strategies.sync import SyncCheckpoint
from test_inmemory import attached, one_rank, trained_state  # noqa: F401 - a fixture: one gloo rank


def flip(path, at: int | None = None) -> None:
    """One bit of ``path`` flipped, its size unchanged: sizes pass, only a checksum can tell."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(raw))


def as_old_record(entry_path) -> None:
    """Rewrite a commit record in the form written before the switch: ``"crc32": {file: zlib.crc32}``."""
    record = json.loads((entry_path / COMMIT_MARKER).read_text())
    del record["checksum"], record["sums"]
    record["crc32"] = {name: zlib.crc32((entry_path / name).read_bytes()) for name in record["files"]}
    (entry_path / COMMIT_MARKER).write_text(json.dumps(record))


def test_for_record_reads_both_forms_and_refuses_an_unknown_algorithm():
    assert for_record({"checksum": "xxh3_64", "sums": {"a": 1}}) == (XXH3_64, {"a": 1})
    assert for_record({"crc32": {"a": 2}}) == (CRC32, {"a": 2})
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md4'"):
        for_record({"checksum": "md4", "sums": {}})
    with pytest.raises(KeyError):
        for_record({"files": {}})
    running = CURRENT.new()
    running.update(b"ab")
    running.update(memoryview(b"cd"))  # fed in pieces: the same as one pass
    assert CURRENT is XXH3_64 and running.value == xxhash.xxh3_64_intdigest(b"abcd")


def test_a_new_record_is_xxh3_and_one_flipped_byte_is_rejected(tmp_path):
    dirs = CheckpointDir(tmp_path)
    path = dirs.prepare(5)
    data = bytes(range(256)) * 40
    (path / "__0_0.distcp").write_bytes(data)
    (path / ".metadata").write_bytes(b"m")
    dirs.commit(5)
    entry = dirs.newest_committed()
    record = dirs.manifest(entry)
    assert record["checksum"] == "xxh3_64" and "crc32" not in record
    assert record["sums"]["__0_0.distcp"] == xxhash.xxh3_64_intdigest(data)
    assert dirs.check(entry) is None
    assert bytes(read_verified(None, path / "__0_0.distcp", len(data), record["sums"]["__0_0.distcp"])) == data

    flip(path / "__0_0.distcp")
    assert dirs.check(entry, checksums=False) is None  # sizes and record are intact: skipping the sum passes it
    assert dirs.check(entry) == "checksum mismatch in __0_0.distcp"
    for fs in (None, FileSystem()):  # mapped, and through an I/O layer (a disk fault's)
        with pytest.raises(CorruptFile, match="checksum mismatch in __0_0.distcp"):
            read_verified(fs, path / "__0_0.distcp", len(data), record["sums"]["__0_0.distcp"])


def test_a_record_naming_an_unknown_algorithm_is_skipped_not_an_error(tmp_path):
    dirs = CheckpointDir(tmp_path)
    (dirs.prepare(5) / "__0_0.distcp").write_bytes(b"x" * 10)
    dirs.commit(5)
    entry = dirs.newest_committed()
    record = dirs.manifest(entry)
    (entry.path / COMMIT_MARKER).write_text(json.dumps({**record, "checksum": "sha3"}))
    assert "unknown checksum algorithm 'sha3'" in dirs.check(entry)


@pytest.mark.timeout(60)
def test_an_old_crc32_record_still_loads_through_sync_and_its_corruption_is_still_caught(one_rank):
    run_dir = one_rank
    state = trained_state(2)
    saver = attached(SyncCheckpoint(every=1, keep=2), run_dir, 0)
    saver.save(4, 10, state)
    saver.wait()
    saver.rt.events.close()
    expected = state_sha256(state.state_dict())
    dirs = CheckpointDir(run_dir / "ckpt")
    entry = dirs.newest_committed()
    as_old_record(entry.path)
    assert "checksum" not in dirs.manifest(entry) and dirs.check(entry) is None  # summed with zlib, not xxh3

    fresh = trained_state(0)
    loader = attached(SyncCheckpoint(every=1, keep=2), run_dir, 1)
    assert loader.load(fresh) == 4 and state_sha256(fresh.state_dict()) == expected
    loader.rt.events.close()

    data = dirs.data_files(entry)[0]
    flip(data)
    assert dirs.check(entry) == f"checksum mismatch in {data.name}"
    again = attached(SyncCheckpoint(every=1, keep=2), run_dir, 2)
    assert again.load(trained_state(0)) == 0  # the sync load verifies the old record's CRC32 as it reads
    again.rt.events.close()
    rejected = [e for e in read_events(run_dir) if e["kind"] == "ckpt_rejected"]
    assert [e["step"] for e in rejected] == [4] and "checksum mismatch" in rejected[0]["reason"]


def test_a_slot_header_fits_its_place_and_an_area_of_the_old_layout_is_not_read(tmp_path):
    assert shm_store.SLOT_HEAD.size + shm_store.COMMIT.size <= shm_store.ALIGN  # each header one ALIGN apart
    area = Area.create(tmp_path / "area", 1 << 16)
    area.write(5, 0, 1000, b"meta", lambda buf: None)
    area.close()
    with open(tmp_path / "area", "r+b") as f:
        f.write(b"RBMEM01\0")  # what the code before the switch wrote
    assert Area.open(tmp_path / "area") is None
    fresh = Area.create(tmp_path / "area", 1 << 16)  # replaced, not reused with its old slot headers
    assert fresh.slots() == []
    fresh.close()


def test_a_flipped_byte_in_a_slot_fails_its_checksum(tmp_path):
    area = Area.create(tmp_path / "area", 1 << 16)
    ranges = [(0, 1000), (1024, 500)]  # two tensors, an alignment gap between them that the sum does not cover
    def fill(buf: torch.Tensor) -> None:
        buf.copy_(torch.arange(1524) % 251)

    info = area.write(7, 0, 1524, b"meta", fill, commit=False)
    info = dataclasses.replace(info, checksum=area.checksum(info, ranges))  # as InMemoryCheckpoint._finish sums it
    area.commit(info)
    (info,) = area.slots()

    def read_all(area: Area, info) -> bool:
        running = CURRENT.new()
        for offset, nbytes in ranges:
            area.read_into(info, offset, torch.empty(nbytes, dtype=torch.uint8), running)
        return running.value == info.checksum

    assert info.checksum is not None and read_all(area, info)
    base = shm_store.PAGE + info.index * area.slot_cap
    area._mm[base + 1010] ^= 0x01  # in the gap: no tensor's byte, the sum still passes
    assert read_all(area, info)
    area._mm[base + 1200] ^= 0x01  # in the second tensor
    assert not read_all(area, info)
    area.close()
