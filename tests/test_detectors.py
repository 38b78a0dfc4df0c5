"""Each detector on a positive and a negative case, without processes where the logic allows."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from conftest import run_experiment
from resilience.detectors.ckpt_integrity import CkptIntegrity
from resilience.detectors.collective_timeout import CollectiveTimeout
from resilience.detectors.replica_fingerprint import bit_sum, odd_ranks
from resilience.detectors.gpu_health import GpuHealth
from resilience.detectors.heartbeat import Heartbeat
from resilience.detectors.nonfinite import Nonfinite
from resilience.detectors.process_exit import ProcessExit
from resilience.runtime.rank import RECOVERY_EXIT
from resilience.detectors.grad_norm import GradNorm
from resilience.detectors.loss_spike import LossSpike
from resilience.detectors.straggler import StragglerDetector as Straggler
from resilience.record.events import EventLog, read_events
from resilience.record.board import CKPT_IO, FORWARD_DONE, STEP_DONE, STEP_START
from resilience.runtime.rank import RankRuntime
from resilience.ckpt.commit import CheckpointDir
from resilience.strategies.sync import SyncCheckpoint


def rt(tmp_path, rank: int = 0) -> RankRuntime:
    return RankRuntime(rank=rank, world_size=3, device=torch.device("cpu"), run_dir=tmp_path,
                       ckpt_dir=tmp_path / "ckpt", events=EventLog(tmp_path, rank, 0))


def test_process_exit_blames_the_signalled_rank_and_ignores_requested_restarts():
    (d,) = ProcessExit().on_worker_failures({0: 1, 2: -9})
    assert d.rank == 2 and "SIGKILL" in d.verdict
    assert ProcessExit().on_worker_failures({0: RECOVERY_EXIT, 1: RECOVERY_EXIT}) == []


def test_heartbeat_names_the_rank_with_least_progress():
    hb = Heartbeat(heartbeat_s=2.0)
    now = 100.0
    # rank 1 stuck before its step-13 forward; ranks 0 and 2 got into step 13 and wait in the all-reduce
    board = [(13, FORWARD_DONE, now - 2.5, 0.02), (12, STEP_DONE, now - 2.6, 0.02), (13, FORWARD_DONE, now - 2.5, 0.02)]
    (d,) = hb.on_poll(board, now)
    assert d.rank == 1 and d.abort and d.value["stuck_ranks"] == [1]


def test_heartbeat_quiet_when_everyone_beats_or_someone_is_saving():
    hb = Heartbeat(heartbeat_s=2.0, ckpt_io_s=60.0)
    now = 100.0
    fresh = [(13, STEP_START, now - 0.1, 0.02)] * 3
    assert hb.on_poll(fresh, now) == []
    # rank 0 has been inside a 30-second save after step index 14; its peers wait in step 15: not a hang
    saving = [(14, CKPT_IO, now - 30, 0.02), (15, FORWARD_DONE, now - 29, 0.02), (15, FORWARD_DONE, now - 29, 0.02)]
    assert hb.on_poll(saving, now) == []
    too_slow = [(14, CKPT_IO, now - 61, 0.02), (15, FORWARD_DONE, now - 60, 0.02), (15, FORWARD_DONE, now - 60, 0.02)]
    assert [d.rank for d in hb.on_poll(too_slow, now)] == [0]
    starting = [(0, 0, 0.0, 0.0), (3, STEP_START, now - 50, 0.0), (3, STEP_START, now - 50, 0.0)]
    assert hb.on_poll(starting, now) == []  # a rank still starting: nothing to compare yet


def test_straggler_needs_a_sustained_ratio():
    det = Straggler(factor=2.0, patience=3)
    balanced = [(10, STEP_START, 1.0, 0.05), (10, STEP_START, 1.0, 0.06), (10, STEP_START, 1.0, 0.05)]
    skewed = [(10, STEP_START, 1.0, 0.05), (10, STEP_START, 1.0, 0.16), (10, STEP_START, 1.0, 0.05)]
    assert all(det.on_poll(balanced, 1.0) == [] for _ in range(5))
    assert det.on_poll(skewed, 1.0) == [] and det.on_poll(skewed, 1.0) == []
    (d,) = det.on_poll(skewed, 1.0)
    assert d.rank == 1 and d.value == pytest.approx(3.2) and not d.abort
    assert det.on_poll(skewed, 1.0) == []  # named once


def test_collective_timeout_records_the_waiting_rank_and_blames_nobody(tmp_path):
    det = CollectiveTimeout()
    det.attach(rt(tmp_path, rank=2), None)
    (d,) = det.on_exception(RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete"))
    assert d.rank is None and d.value["waiting_rank"] == 2 and d.value["collective"] == "recv"
    assert det.on_exception(RuntimeError("Connection closed by peer")) == []


def test_nonfinite(tmp_path):
    det = Nonfinite()
    det.attach(rt(tmp_path, rank=1), None)
    assert det.on_backward(3, 2.5, 1.0) == []
    (d,) = det.on_backward(4, math.nan, 1.0)
    assert d.rank == 1 and d.silent and d.rollback_to == 3
    grads_only = Nonfinite()
    grads_only.attach(rt(tmp_path, rank=0), None)
    assert grads_only.on_backward(4, 2.5, math.inf)[0].rank is None  # reduced gradients: no culprit


@pytest.mark.parametrize("cls", [LossSpike, GradNorm])
def test_robust_z_ignores_a_falling_loss_and_catches_a_spike(tmp_path, cls):
    det = cls(threshold=8.0, window=20, warmup=10)
    det.attach(rt(tmp_path), None)
    series = [5.0 * 0.97**i + 0.01 * ((-1) ** i) for i in range(40)]
    observe = (lambda s, x: det.on_backward(s, x, None)) if cls is LossSpike else (lambda s, x: det.on_backward(s, 0.0, x))
    assert [d for i, x in enumerate(series) for d in observe(i, x)] == []
    (d,) = observe(40, 50.0)
    assert d.silent and d.value["z"] > 8


def test_fingerprint_sees_any_single_bit_and_names_the_odd_rank():
    t = torch.randn(1000)
    before = bit_sum([t])
    t.view(torch.int32)[123] ^= 1  # the lowest mantissa bit
    assert bit_sum([t]) != before
    assert odd_ranks([(1, 2), (1, 3), (1, 2)]) == [1]
    assert odd_ranks([(1, 2), (1, 3)]) == []  # two replicas: no majority, nobody named


def test_gpu_health_reports_unavailable_without_a_gpu():
    det = GpuHealth()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this case is about CPU-only machines")
    assert det.start() is not None
    assert det.on_poll([], 1e9) == []


def test_ckpt_integrity_skips_a_corrupt_checkpoint_for_the_previous(tmp_path, runs_root, reference):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs_root / "reference" / "ckpt", ckpt)
    dirs = CheckpointDir(ckpt)
    newest = dirs.newest_committed()
    assert newest.step == 25 and dirs.manifest(newest)["sums"]
    det = CkptIntegrity()
    runtime = dataclasses.replace(rt(tmp_path), ckpt_rejected=det.rejection_report())  # the service it provides
    det.attach(runtime, None)
    strategy = SyncCheckpoint(every=5, keep=2)
    strategy.attach(runtime)
    assert strategy.choose().step == 25  # intact: the newest
    data = sorted(newest.path.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    assert strategy.choose().step == 20  # corrupt: skipped for the previous good one
    (event,) = [e for e in read_events(tmp_path) if e["kind"] == "fault_detected"]
    assert event["detector"] == "ckpt_integrity" and event["step"] == 25


@pytest.mark.timeout(240)
def test_rollback_after_an_exponent_flip_is_bit_exact(tmp_path):
    common = ("steps=20", "checkpoint.every=5", "world_size=3", "seed=0",
              "detector=[process_exit,heartbeat,nonfinite,replica_fingerprint,ckpt_integrity]")
    # its fault-free run: the same training without a checkpoint or a detector of its own to run (neither touches
    # the state; a second or so less than sync's saves and checks on 3 ranks)
    ref = run_experiment(tmp_path / "ref", "strategy=none", "fault=none", *common[:4], "detector=[process_exit]")
    hit = run_experiment(tmp_path / "hit", "fault=bitflip", "fault.target=weights", "fault.bit=exponent",
                         "fault.rank=1", "fault.at_step=12", "recovery=rollback",
                         "detectors.replica_fingerprint.every=1", *common)  # a check every step: the rollback's step
    assert hit["detected"] and hit["detector"] == "replica_fingerprint"
    assert hit["detected_rank"] == 1 and hit["detected_rank_correct"]
    # last full check passed at 12 - 3 (a quarter of the moments per check): the newest checkpoint <= 9 is 5
    assert hit["recovered"] and hit["lost_steps"] == 7
    assert hit["final_state_sha256"] == ref["final_state_sha256"]


@pytest.mark.timeout(240)
def test_a_slow_save_is_not_a_hang_but_a_stall_is(tmp_path):
    common = ("steps=12", "checkpoint.every=5", "world_size=2", "seed=0", "timeouts.heartbeat_s=1.5")
    slow = run_experiment(tmp_path / "slow", "fault=slow_disk", "fault.mbps=2", *common)  # ~3 s saves
    assert not [e for e in read_events(tmp_path / "slow") if e["kind"] == "fault_detected"]
    assert slow["ckpt_durable_s"] > 1.5 and slow["status"] == "ok"
    hang = run_experiment(tmp_path / "hang", "fault=hang", "fault.mode=stall", "fault.at_step=7", *common)
    assert hang["detector"] == "heartbeat" and hang["detected_rank"] == 1 and hang["recovered"]


def test_heartbeat_ignores_ranks_that_finished_training():
    from resilience.record.board import FINISHED

    hb = Heartbeat(heartbeat_s=1.0)
    assert hb.on_poll([(30, FINISHED, 10.0, 0.02), (30, FINISHED, 10.0, 0.02)], 100.0) == []


def _replicas(tmp_path, steps: int = 3):
    """Two replicas of a small sparse model (an embedding table with sparse gradients, a dense layer, Adagrad)
    trained alike, each with a fingerprint detector attached; the second detector saw the last step's touched rows."""
    from resilience.detectors.replica_fingerprint import ReplicaFingerprint
    from resilience.state.train import TrainState

    out = []
    for r in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(1000, 16, sparse=True), torch.nn.Linear(16, 1))
        state = TrainState(model, torch.optim.Adagrad(model.parameters(), lr=0.1))
        det = ReplicaFingerprint(every=1, slice_share=0.5, slice_min_mb=0.004)  # 4 kB slices of ~128 kB
        det.attach(rt(tmp_path, rank=r), state)
        for step in range(steps):
            ids = torch.tensor([[1, 5, 7], [5, 9, 2]]) + step
            model(ids).sum().backward()
            det.on_backward(step, 0.0, None)
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
        out.append((model, state, det))
    return out


def test_fingerprint_reads_the_touched_rows_now_and_every_byte_within_its_coverage(tmp_path):
    (m0, _, d0), (m1, _, d1) = _replicas(tmp_path)
    # the table, its Adagrad sums and the dense layer's (16 + 1 floats), 4000 bytes per check
    assert d0.coverage_checks() == math.ceil((2 * 1000 * 16 + 17) * 4 / 4000) == 33
    position = 3
    assert torch.equal(d0.fingerprint(position), d1.fingerprint(position))
    # A flip in a row the last step touched (row 11 = 9 + 2): found by the first number at once.
    _, (m1, _, d1) = _replicas(tmp_path)
    _, _, d0 = _replicas(tmp_path)[0]
    m1[0].weight.data.view(torch.int32)[11, 3] ^= 1 << 27
    a, b = d0.fingerprint(position), d1.fingerprint(position)
    assert a[0] != b[0]
    # A flip in a row no step touched: the changed part agrees, and the rotating slice finds it within coverage.
    (m0, _, d0), (m1, _, d1) = _replicas(tmp_path)
    m1[0].weight.data.view(torch.int32)[700, 3] ^= 1 << 27
    found = [p for p in range(position, position + d0.coverage_checks())
             if not torch.equal(d0.fingerprint(p), d1.fingerprint(p))]
    assert len(found) == 1 and d0.fingerprint(found[0])[0] == d1.fingerprint(found[0])[0]


def test_fingerprint_every_auto_decides_alike_everywhere_and_a_later_rank_takes_the_decision(tmp_path):
    """every=auto: the interval from the slowest rank's check over the fastest rank's step, within the budget; the
    steps checked and the slices read are functions of the step and the decision, and a rank attached later (a
    restart, a replacement) reads the decision rank 0 recorded."""
    from resilience.detectors.replica_fingerprint import ReplicaFingerprint
    from resilience.state.train import TrainState

    model = torch.nn.Linear(4, 4)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    first = ReplicaFingerprint(budget=0.015, calibration=5)
    first.attach(rt(tmp_path, rank=0), state)
    assert [p for p in range(1, 6) if first.due(p)] == [1, 2, 3, 4, 5]  # calibrating: every step
    first._decide(5, [[3000, 60000], [2000, 50000], [1000, 55000]])  # 3 ms over 1.5% of 50 ms: every 4
    assert first.every == 4 and first.anchor == 5
    assert [p for p in range(6, 20) if first.due(p)] == [9, 13, 17]
    assert [first.check_number(p) for p in (5, 9, 13)] == [5, 6, 7]  # each check the next slice
    later = ReplicaFingerprint()
    later.attach(rt(tmp_path, rank=2), state)
    assert (later.every, later.anchor) == (4, 5) and later.due(13) and not later.due(12)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "events.jsonl").touch()  # a run that has decided nothing yet
    cheap = ReplicaFingerprint(budget=0.015)
    cheap.attach(rt(tmp_path / "other", rank=1), state)
    cheap._decide(5, [[100, 50000], [120, 50000]])  # 0.12 ms < 0.75 ms: every step
    assert cheap.every == 1


def test_fingerprint_every_is_auto_or_a_positive_integer():
    from resilience.detectors.replica_fingerprint import ReplicaFingerprint

    for bad in ("fast", 0, 1.5):
        with pytest.raises(ValueError, match=r"detectors.replica_fingerprint.every="):
            ReplicaFingerprint(every=bad)
