"""The kill injector without processes: plan, exactly-once firing, record before action, private randomness."""

from __future__ import annotations

import json
import random

import pytest
import torch

from injectors.kill import Kill
from resilience.events import EventLog, read_events
from resilience.runtime import RankRuntime


class Recorded(Kill):
    """A Kill whose action only notes what was on disk at the moment it would have struck."""

    def _act(self) -> None:
        self.seen_at_action = read_events(self.rt.run_dir)


def runtime(tmp_path, rank: int, attempt: int = 0) -> RankRuntime:
    return RankRuntime(rank=rank, world_size=2, attempt=attempt, device=torch.device("cpu"), run_dir=tmp_path,
                       ckpt_dir=tmp_path / "ckpt", events=EventLog(tmp_path, rank, attempt))


def test_fires_once_at_the_planned_point_after_writing_its_record(tmp_path):
    inj = Recorded(rank=1, at_step=4, phase="before_optimizer_step")
    inj.attach(runtime(tmp_path, rank=1))
    for step in range(10):
        for phase in ("before_forward", "before_optimizer_step", "during_checkpoint"):
            inj(phase, step)
    records = [e for e in read_events(tmp_path) if e["kind"] == "fault_injected"]
    assert len(records) == 1
    assert records[0]["step"] == 4 and records[0]["phase"] == "before_optimizer_step"
    assert records[0]["signal"] == "SIGKILL" and records[0]["rank"] == 1
    assert [e["kind"] for e in inj.seen_at_action] == ["fault_injected"]  # on disk before the action


def test_other_ranks_and_restarted_ranks_do_not_fire(tmp_path):
    bystander = Recorded(rank=1, at_step=2)
    bystander.attach(runtime(tmp_path, rank=0))
    bystander("before_forward", 2)
    assert read_events(tmp_path) == []
    victim = Recorded(rank=1, at_step=2)
    victim.attach(runtime(tmp_path, rank=1))
    victim("before_forward", 2)
    restarted = Recorded(rank=1, at_step=2)
    restarted.attach(runtime(tmp_path, rank=1, attempt=1))
    restarted("before_forward", 2)
    assert sum(e["kind"] == "fault_injected" for e in read_events(tmp_path)) == 1


def test_arming_and_firing_leave_global_rngs_untouched(tmp_path):
    torch.manual_seed(123)
    random.seed(123)
    before = (torch.get_rng_state().clone(), random.getstate())
    inj = Recorded(rank=0, at_step=0)
    inj.attach(runtime(tmp_path, rank=0))
    inj("before_forward", 0)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


@pytest.mark.parametrize("kwargs,message", [
    ({"signal": "SIGHUP"}, "fault.signal=SIGHUP"),
    ({"exit_code": 0, "signal": "exit"}, "fault.exit_code=0"),
    ({"phase": "later"}, "fault.phase=later"),
    ({"rank": -1}, "fault.rank=-1"),
])
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Kill(**kwargs)


def test_torn_last_line_is_skipped(tmp_path):
    ev = EventLog(tmp_path, 0, 0)
    ev.emit("step_end", step=1)
    ev.close()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"kind": "step_e')  # a process killed in the middle of a write
    assert [e["kind"] for e in read_events(tmp_path)] == ["step_end"]
    json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])
