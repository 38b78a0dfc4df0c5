"""The boundary log of Swift's logging recovery (``parallel/boundary_log.py``) and the replay of one stage alone from
its neighbour's log (``parallel/stage_replay.py``): docs/pipeline_parallel.md, "The boundary log and the replay"."""

from __future__ import annotations

import json

import boundary_log_ranks
import pytest
import torch
from sharded_ranks import spawn

from resilience.parallel.boundary_log import BACKWARD, FORWARD, BoundaryLog, DamagedLog, Key, sends_logged


def sends(n: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 16, 8, generator=g),) for _ in range(n)]  # 1 KiB each, as one activation send


def logged(log: BoundaryLog, steps: range, micro: int = 2, kind: str = FORWARD) -> dict[Key, tuple]:
    out = {}
    for step in steps:
        log.begin(step)
        for m, tensors in enumerate(sends(micro, seed=step)):
            log.record(kind, m, tensors)
            out[Key(step, kind, m)] = tensors
    return out


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_an_entry_is_a_copy_of_the_send_bit_for_bit_whatever_its_dtype():
    log = BoundaryLog()
    log.begin(5)
    sent = (torch.randn(3, 4), torch.randn(7).to(torch.bfloat16), torch.arange(6).reshape(2, 3))
    assert log.record(BACKWARD, 1, sent) == 48 + 14 + 48
    kept = tuple(t.clone() for t in sent)
    sent[0].add_(1.0)  # the send's buffer reused after it left: the log holds the bytes that crossed
    assert same(log.get(5, BACKWARD, 1), kept)
    assert log.bytes_by_step == {5: 110} and log.held_bytes == 110
    with pytest.raises(KeyError):
        log.get(5, FORWARD, 1)


def test_past_the_budget_the_oldest_entries_spill_to_sealed_files_and_read_back_exact(tmp_path):
    log = BoundaryLog(budget_bytes=3 * 1024, spill_dir=tmp_path)
    expected = logged(log, range(3))  # 6 entries of 1 KiB: the 3 oldest spill
    assert log.held_bytes == 3 * 1024 and len(list(tmp_path.glob("*.blog"))) == 3
    assert log.spilled_bytes > 3 * 1024  # each file: its header, the dtypes and shapes, the bytes
    assert all(same(log.get(*key), tensors) for key, tensors in expected.items())
    stats = log.stats()
    assert stats["entries"] == 6 and stats["last_step"] == 2 and stats["last_step_bytes"] == 2048
    everything = BoundaryLog(budget_bytes=0, spill_dir=tmp_path / "all")  # a budget of 0: every entry on disk
    logged(everything, range(1))
    assert everything.held_bytes == 0 and len(list((tmp_path / "all").iterdir())) == 2


def test_a_damaged_or_misplaced_spill_file_is_refused_never_replayed(tmp_path):
    log = BoundaryLog(budget_bytes=0, spill_dir=tmp_path)
    logged(log, range(2))
    path = tmp_path / "step0-fwd-mb0.blog"
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01  # one bit of the tensor's bytes
    path.write_bytes(bytes(blob))
    with pytest.raises(DamagedLog):
        log.get(0, FORWARD, 0)
    (tmp_path / "step0-fwd-mb1.blog").write_bytes(path.read_bytes()[:40])  # cut short
    with pytest.raises(DamagedLog):
        log.get(0, FORWARD, 1)
    (tmp_path / "step1-fwd-mb1.blog").replace(tmp_path / "step1-fwd-mb0.blog")  # whole, but another entry's
    with pytest.raises(DamagedLog):
        log.get(1, FORWARD, 0)


def test_selective_logging_keeps_every_kth_stage_boundary_and_each_stage_logs_its_sends_across_it():
    assert [sends_logged(s, 2) for s in range(2)] == [{FORWARD}, {BACKWARD}]
    assert [sends_logged(s, 4) for s in range(4)] == [{FORWARD}, {FORWARD, BACKWARD}, {FORWARD, BACKWARD},
                                                      {BACKWARD}]
    # every=2 on 4 stages: only boundary 2 (stages 1 | 2) is logged; stages 0-1 and 2-3 replay as groups
    assert [sends_logged(s, 4, every=2) for s in range(4)] == [set(), {FORWARD}, {BACKWARD}, set()]
    assert [sends_logged(s, 2, every=2) for s in range(2)] == [set(), set()]  # no boundary: restart-all
    with pytest.raises(ValueError, match="swift_log.every=0"):
        sends_logged(0, 2, every=0)
    log = BoundaryLog(kinds=sends_logged(0, 2))
    log.begin(0)
    assert log.record(BACKWARD, 0, sends(1)[0]) == 0 and log.keys() == []


def test_discard_before_drops_what_a_checkpoint_replaced_memory_and_disk(tmp_path):
    log = BoundaryLog(budget_bytes=2 * 1024, spill_dir=tmp_path)
    expected = logged(log, range(5))
    assert log.discard_before(3) == 6
    assert {k.step for k in log.keys()} == {3, 4} and set(log.bytes_by_step) == {3, 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step3-fwd-mb0.blog", "step3-fwd-mb1.blog"]
    assert all(same(log.get(*k), expected[k]) for k in log.keys())
    with pytest.raises(KeyError):
        log.get(2, FORWARD, 0)


def test_entries_travel_sealed_and_a_damaged_record_is_refused(tmp_path):
    log = BoundaryLog(budget_bytes=1024, spill_dir=tmp_path)
    expected = logged(log, range(4), kind=BACKWARD)
    blob = log.export(1, 2, BACKWARD)
    into = BoundaryLog()
    assert into.adopt(blob) == 4 and into.keys() == [k for k in sorted(expected) if 1 <= k.step <= 2]
    assert all(same(into.get(*k), expected[k]) for k in into.keys())
    assert log.export(1, 2, FORWARD) == b""
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0x10
    with pytest.raises(DamagedLog):
        BoundaryLog().adopt(bytes(damaged))


def test_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="swift_log.budget_bytes=1024: a budget needs a spill directory"):
        BoundaryLog(budget_bytes=1024)
    with pytest.raises(ValueError, match="swift_log.budget_bytes=-1"):
        BoundaryLog(budget_bytes=-1)
    with pytest.raises(RuntimeError, match="before begin"):
        BoundaryLog().record(FORWARD, 0, sends(1)[0])


# Two spawned stages of a 3-block GPT with dropout (the RNG replays too): 6 steps, the state at 2 kept; 1F1B in CI.
REPLAYS = [("1f1b", "1f1b", 4096), ("gpipe", "1f1b", 0)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("train,replay,budget", REPLAYS, ids=["1f1b-spilling", "gpipe-trained-1f1b-replayed-on-disk"])
def test_each_stage_replayed_alone_from_its_neighbours_log_ends_on_its_fault_free_state(tmp_path, train, replay,
                                                                                          budget):
    """Logging leaves the training's bits alone; stage 1 replayed from stage 0's logged activations, and stage 0
    from stage 1's logged gradients, each end on their fault-free state at step 6 bit for bit, and send what they
    sent (the last stage: the same losses). Under a budget part of the log (or all of it) comes back from disk."""
    spawn(boundary_log_ranks.replay_rank, 2, str(tmp_path), train, replay, budget)
    figures = [json.loads((tmp_path / f"figures{r}.json").read_text()) for r in range(2)]
    per_step = 4 * 2 * 16 * 32 * 4  # micro-batches x (2 samples x 16 tokens x 32 features) x 4 bytes
    assert all(set(f["bytes_by_step"].values()) == {per_step} for f in figures)
    assert figures[0]["sent_bytes_0"] > per_step * (boundary_log_ranks.K - boundary_log_ranks.C)
    if budget is not None:
        assert all(f["stats"]["held_bytes"] <= budget and f["stats"]["spilled_total"] > 0 for f in figures)
