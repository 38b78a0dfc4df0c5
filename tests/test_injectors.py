"""Injectors without processes: exact bits, one firing at the planned step, same plan on every rank, private
randomness, the record written before the action, and a disk that really is slow."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT
from injectors.bitflip import BitFlip
from injectors.bits import choose_bits, flip_bits
from injectors.kill import Kill
from injectors.node_loss import NodeLoss
from injectors.faulty_fs import FaultyStream
from injectors.slow_disk import SlowDisk
from resilience.record.events import EventLog, read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState


class Recorded(Kill):
    """A Kill whose action only notes what was on disk at the moment it would have struck."""

    def _act(self, step: int) -> None:
        self.seen_at_action = read_events(self.rt.run_dir)


def runtime(tmp_path, rank: int, attempt: int = 0) -> RankRuntime:
    return RankRuntime(rank=rank, world_size=2, device=torch.device("cpu"), run_dir=tmp_path,
                       ckpt_dir=tmp_path / "ckpt", events=EventLog(tmp_path, rank, attempt))


def armed(inj, tmp_path, rank: int, attempt: int = 0, steps: int = 30, every: int | None = 5):
    inj.validate(2, steps, every)
    inj.attach(runtime(tmp_path, rank, attempt))
    return inj


def test_fires_once_at_the_planned_point_after_writing_its_record(tmp_path):
    inj = armed(Recorded(rank=1, at_step=4, phase="before_optimizer_step"), tmp_path, rank=1)
    for step in range(10):
        for phase in ("before_forward", "before_optimizer_step", "during_checkpoint"):
            inj(phase, step)
    records = [e for e in read_events(tmp_path) if e["kind"] == "fault_injected"]
    assert len(records) == 1
    assert records[0]["step"] == 4 and records[0]["phase"] == "before_optimizer_step"
    assert records[0]["signal"] == "SIGKILL" and records[0]["rank"] == 1
    assert [e["kind"] for e in inj.seen_at_action] == ["fault_injected"]  # on disk before the action


def test_other_ranks_and_restarted_ranks_do_not_fire(tmp_path):
    armed(Recorded(rank=1, at_step=2), tmp_path, rank=0)("before_forward", 2)
    assert read_events(tmp_path) == []
    armed(Recorded(rank=1, at_step=2), tmp_path, rank=1)("before_forward", 2)
    armed(Recorded(rank=1, at_step=2), tmp_path, rank=1, attempt=1)("before_forward", 2)
    assert sum(e["kind"] == "fault_injected" for e in read_events(tmp_path)) == 1


def test_plans_are_the_same_on_every_rank_and_differ_by_seed(tmp_path):
    def plan(seed: int, rank: int) -> list[int]:
        inj = Kill(rank=0, at_step=2, probability=0.2, count=5, seed=seed)
        inj.validate(2, 200, 5)
        return inj.plan

    assert plan(7, 0) == plan(7, 1)
    assert len(plan(7, 0)) == 5 and all(s >= 2 for s in plan(7, 0))
    assert plan(7, 0) != plan(8, 0)


def test_arming_and_firing_leave_global_rngs_untouched(tmp_path):
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy())
    inj = armed(Recorded(rank=0, at_step=0, probability=0.5, count=3, seed=4), tmp_path, rank=0)
    for step in range(30):
        inj("before_forward", step)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


@pytest.mark.parametrize("dtype,bit,expected", [
    (torch.float32, 31, -1.5), (torch.float32, 23, 0.75), (torch.float64, 63, -1.5), (torch.bfloat16, 15, -1.5),
])
def test_flip_changes_exactly_the_named_bit(dtype, bit, expected):
    t = torch.tensor([0.0, 1.5, 2.0], dtype=dtype)
    flip = flip_bits(t, 1, [bit])
    assert (flip.old, flip.new) == (1.5, expected)
    assert t.tolist() == [0.0, expected, 2.0]
    flip_bits(t, 1, [bit])
    assert t.tolist() == [0.0, 1.5, 2.0]  # a second flip restores it


def test_bit_classes():
    rng = random.Random(0)
    assert choose_bits(torch.float32, "sign", 1, rng) == [31]
    assert all(23 <= b <= 30 for b in choose_bits(torch.float32, "exponent", 3, rng))
    assert all(b < 23 for b in choose_bits(torch.float32, "mantissa", 4, rng))
    with pytest.raises(ValueError, match="fault.bit=40"):
        choose_bits(torch.float32, 40, 1, rng)


def small_state():
    workload = instantiate(OmegaConf.load(ROOT / "conf" / "workload" / "gpt_tiny.yaml"), seed=0, n_layer=1)

    class Wrapped(torch.nn.Module):  # what the injector sees: a DDP-like wrapper with .module
        def __init__(self, m):
            super().__init__()
            self.module = m

    model = Wrapped(workload.build_model())
    return TrainState(model, workload.build_optimizer(model.module))


def test_weight_flip_records_tensor_element_bits_old_and_new(tmp_path):
    state = small_state()
    inj = armed(BitFlip(rank=1, at_step=3, target="weights", bit="sign", bits=1, seed=5), tmp_path, rank=1)
    inj.arm(state)
    before = {n: p.clone() for n, p in state.model.module.named_parameters()}
    inj("before_forward", 3)
    (record,) = [e for e in read_events(tmp_path) if e["kind"] == "fault_injected"]
    changed = [(n, i) for n, p in state.model.module.named_parameters()
               for i in torch.nonzero((p != before[n]).view(-1)).view(-1).tolist()]
    assert changed == [(record["tensor"], record["element"])]
    assert record["bits"] == [31] and record["new"] == -record["old"]
    assert state.model.module.get_parameter(record["tensor"]).view(-1)[record["element"]].item() == record["new"]


def test_node_loss_targets_the_whole_node():
    inj = NodeLoss(rank=3, ranks_per_node=2)
    inj.validate(4, 30, 5)
    assert inj.targets() == {2, 3}
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        NodeLoss(rank=0, ranks_per_node=3).validate(4, 30, 5)


def test_throttled_disk_writes_no_faster_than_the_cap(tmp_path):
    disk = armed(SlowDisk(rank=0, mbps=20.0), tmp_path, rank=0)
    disk.active = True
    data = b"x" * 1_000_000
    t0 = time.monotonic()
    with open(tmp_path / "f", "wb") as raw:
        stream = FaultyStream(raw, disk)
        for _ in range(4):
            stream.write(data)
    elapsed = time.monotonic() - t0
    assert elapsed >= 4 / 20 * 0.98  # 4 MB at 20 MB/s
    assert (tmp_path / "f").stat().st_size == 4_000_000


def test_enospc_after_budget(tmp_path):
    disk = armed(SlowDisk(rank=0, mode="enospc", budget_mb=1.5), tmp_path, rank=0)
    disk.active = True
    with open(tmp_path / "f", "wb") as raw:
        stream = FaultyStream(raw, disk)
        stream.write(b"x" * 1_000_000)
        with pytest.raises(OSError, match="No space left"):
            stream.write(b"x" * 1_000_000)


@pytest.mark.parametrize("cls,kwargs,message", [
    (Kill, {"signal": "SIGHUP"}, "fault.signal=SIGHUP"),
    (Kill, {"exit_code": 0, "signal": "exit"}, "fault.exit_code=0"),
    (Kill, {"phase": "later"}, "fault.phase=later"),
    (Kill, {"rank": -1}, "fault.rank=-1"),
    (Kill, {"probability": 1.5}, "fault.probability=1.5"),
    (BitFlip, {"target": "cache"}, "fault.target=cache"),
    (BitFlip, {"bit": "middle"}, "fault.bit=middle"),
    (BitFlip, {"target": "grads_post", "phase": "before_forward"}, "fault.phase=before_forward"),
    (SlowDisk, {"mode": "slow"}, "fault.mode=slow"),
    (SlowDisk, {"mbps": -1}, "fault.mbps=-1"),
])
def test_bad_settings_name_the_field(cls, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        cls(**kwargs)


def test_torn_last_line_is_skipped(tmp_path):
    ev = EventLog(tmp_path, 0, 0)
    ev.emit("step_end", step=1, loss=0.5, duration_s=0.1)
    ev.close()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"kind": "step_e')  # a process killed in the middle of a write
    assert [e["kind"] for e in read_events(tmp_path)] == ["step_end"]


def test_a_timed_sigstop_is_resumed_by_a_tracked_helper_that_is_reaped(tmp_path):
    """The waker of a timed SIGSTOP hang wakes its rank, is reaped by cleanup, and never outlives the rank."""
    code = textwrap.dedent("""
        import os, time
        from injectors.hang import Hang
        inj = Hang(mode="sigstop", duration_s=0.5, rank=0, at_step=0)
        t0 = time.monotonic()
        inj._act(0)
        waited = time.monotonic() - t0
        waker = inj._waker
        inj.cleanup()
        gone = not os.path.exists(f"/proc/{waker}")
        print(round(waited, 1) >= 0.4, gone, inj._waker is None)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["True", "True", "True"], done.stderr
