"""Several faults in one run (issue 29, item 4): ``fault.at_step=[7,15,22]`` with one phase per fault. Each planned
point fires once, in whichever attempt reaches it first, so one run meets K successive failures and recoveries,
one of them during a save, and must still end on the fault-free run's state bit for bit. Its refusals are in
tests/test_config.py's BAD list."""

from __future__ import annotations

import pytest
import torch

from conftest import run_experiment
from injectors.kill import Kill
from resilience.record.events import EventLog, read_events
from resilience.record.query import injected
from resilience.runtime.rank import RankRuntime

STEPS = [7, 15, 22]  # 15 is a checkpoint step (checkpoint.every=5): its fault strikes inside that save
PHASES = ["before_forward", "during_checkpoint", "before_optimizer_step"]
SCHEDULE = (f"fault.at_step=[{','.join(map(str, STEPS))}]", f"fault.phase=[{','.join(PHASES)}]")


class Noted(Kill):
    """A Kill that only notes where it would have struck (the process lives on)."""

    def _act(self, step: int) -> None:
        self.struck = step


def attempt(tmp_path, number: int, start: int, end: int) -> list[int]:
    """Rank 1 of attempt ``number`` passes every phase of steps [start, end): where the schedule strikes."""
    inj = Noted(rank=1, at_step=STEPS, phase=PHASES)
    inj.validate(2, 30, 5)
    inj.attach(RankRuntime(rank=1, world_size=2, device=torch.device("cpu"), run_dir=tmp_path,
                           ckpt_dir=tmp_path / "ckpt", events=EventLog(tmp_path, 1, number)))
    struck = []
    for step in range(start, end):
        for phase in ("before_forward", "before_optimizer_step", "during_checkpoint"):
            inj.struck = None
            inj(phase, step)
            if inj.struck is not None:
                struck.append((step, phase))
                return struck  # the process would be dead now
    return struck


def test_each_planned_fault_fires_once_in_the_first_attempt_that_reaches_it(tmp_path):
    # each attempt replays from the checkpoint before its predecessor's fault: 0 -> 7, 5 -> 15, 10 -> 22, 20 -> end
    struck = [attempt(tmp_path, n, start, 30) for n, start in enumerate((0, 5, 10, 20))]
    assert struck == [[(7, "before_forward")], [(15, "during_checkpoint")], [(22, "before_optimizer_step")], []]
    records = [e for e in read_events(tmp_path) if e["kind"] == "fault_injected"]
    assert [(e["step"], e["phase"], e["plan_index"], e["attempt"]) for e in records] == [
        (7, "before_forward", 0, 0), (15, "during_checkpoint", 1, 1), (22, "before_optimizer_step", 2, 2)]


def test_one_phase_serves_every_listed_step(tmp_path):
    inj = Noted(rank=1, at_step=[5, 10], phase="during_checkpoint")
    inj.validate(2, 30, 5)
    assert inj.plan == [5, 10] and inj.phases == ["during_checkpoint"] * 2
    assert inj.caps.needs_checkpoint == "fault.phase=during_checkpoint"


def test_a_lost_nodes_ranks_each_record_a_loss_and_it_counts_once():
    records = [{"kind": "fault_injected", "fault": "node_loss", "rank": rank, "step": step, "plan_index": index}
               for step, index in ((7, 0), (12, 1)) for rank in (1, 0)]
    assert [(e["step"], e["rank"]) for e in injected(records)] == [(7, 1), (12, 1)]


# (overrides, the setting the line names, what it says is allowed)


@pytest.mark.timeout(240)
def test_three_kills_one_during_a_save_are_each_recovered_and_the_run_ends_bit_exact(tmp_path):
    """Rank 1 dies before step 7's forward pass, inside step 15's save, and before step 22's optimizer step: three
    restarts from the checkpoints of steps 5, 10 and 20; the run checks itself against the fault-free run."""
    run = tmp_path / "run"
    result = run_experiment(run, "strategy=sync", "fault=kill", "fault.rank=1", *SCHEDULE, "workload=gpt_tiny",
                            "steps=25", "checkpoint.every=5", "world_size=2", "seed=0", "detector=[process_exit]",
                            "timeouts.collective_s=10", "reference.check=run", timeout=200)
    assert result["status"] == "ok" and result["attempts"] == 4
    assert result["faults_injected"] == 3 and result["recoveries"] == 3
    assert [(f["step"], f["phase"], f["rank"]) for f in result["faults"]] == list(zip(STEPS, PHASES, [1, 1, 1]))
    assert [f["lost_steps"] for f in result["faults"]] == [2, 5, 2]  # step 15's checkpoint never committed
    events = read_events(run)
    assert sum(e["kind"] == "restart" for e in events) == 3
    assert sorted(e["plan_index"] for e in events if e["kind"] == "fault_injected") == [0, 1, 2]  # none again
    assert result["reference"]["matches"] is True, result["reference"]  # the fault-free run's final state
