"""A node's maintenance with notice (issue 30, item 4): ``fault=drain`` tells the node's ranks (SIGUSR2) that the
node goes in ``fault.notice_s``; at the end of the step the ranks agree who leaves, the leaving rank ends, a warm
spare takes its rank and heals from a live replica: no step rolled back, the run bit-exact with the fault-free one,
no restart budget spent and no failure detected. When the move cannot happen before the node goes, the run
recovers as from a node loss, still bit-exact."""

from __future__ import annotations

import pytest

from conftest import refusal, run_experiment
from resilience.bench.drain import stopped_s
from resilience.record.events import read_events
from resilience.record.metrics import _drain

COMMON = ("strategy=replica", "supervisor.spares=1", "fault=drain", "fault.rank=1", "fault.at_step=13",
          "steps=30", "checkpoint.every=5", "world_size=2", "seed=0", "recovery.max_restarts=0")


@pytest.mark.timeout(240)
def test_a_drained_rank_moves_to_a_spare_with_no_step_lost_and_ends_bit_exact(tmp_path, reference):
    run_dir = tmp_path / "run"
    # max_restarts=0: a planned move spends no restart budget (a failure would end this run)
    result = run_experiment(run_dir, *COMMON)
    assert result["status"] == "ok" and result["final_state_sha256"] == reference["final_state_sha256"]
    drain = result["drain"]
    assert drain["moved"] is True and drain["ranks"] == [1] and drain["step"] == 14  # the end of step 13's step
    assert drain["left_s"] < 30 and drain["stopped_s"] > 0
    assert result["lost_steps"] == 0 and result["replicas_consistent"] is True
    events = read_events(run_dir)
    assert not [e for e in events if e["kind"] == "fault_detected"], "a move is not a failure"
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["planned"] is True and restart["ranks"] == [1] and restart["from_spares"] == [1]
    assert [e["rank"] for e in events if e["kind"] == "handover"] == [0]
    heal = next(e for e in events if e["kind"] == "replica_heal")
    assert heal["rank"] == 1 and heal["step"] == 14 and heal["bytes"] > 0
    assert heal["uninitialised"] is False  # the warm spare built its state before it had a rank, initialised


@pytest.mark.timeout(240)
def test_a_notice_too_short_for_the_move_is_a_node_loss_recovered_bit_exact(tmp_path, reference):
    # the node goes 10 ms after its notice, mostly before the step ends (then the ranks never agree on a move and
    # the survivor's collective fails: a node loss); a step that ends first moves the rank. Either way the record
    # says which, and the run ends on the fault-free state.
    result = run_experiment(tmp_path / "run", *COMMON[:-1], "fault.notice_s=0.01")
    assert result["status"] == "ok" and result["final_state_sha256"] == reference["final_state_sha256"]
    assert result["lost_steps"] == 0
    if result["drain"]["moved"]:
        assert not result["detected"] and result["drain"]["ranks"] == [1]
    else:
        assert result["detected"] and result["detected_rank"] == 1


@pytest.mark.parametrize(("overrides", "said"), [
    (("strategy=sync", "supervisor.spares=0"), "fault=drain: moves the node's ranks to spares"),
    (("strategy=replica_torchft", "supervisor.spares=0"), "strategy=replica_torchft does not hand over"),
    (("strategy.while_replacing=continue",), "does not hand over"),
    (("fault.notice_s=0",), "fault.notice_s=0"),
    (("fault.at_step=[5,9]",), "fault=drain fires at one step"),
])
def test_what_a_drain_cannot_go_with_is_refused_in_one_line(tmp_path, overrides, said):
    assert said in refusal(tmp_path, (*COMMON, *overrides))


def _step(rank: int, end: float, duration: float) -> dict:
    return {"kind": "step_end", "rank": rank, "t_mono": end, "duration_s": duration}


def test_stopped_is_the_longest_time_no_rank_trained_after_the_fault():
    events = [_step(0, 1.0, 0.5), _step(1, 1.1, 0.5), _step(0, 2.0, 0.5), _step(1, 5.0, 0.5), _step(0, 5.1, 0.4)]
    assert stopped_s(events, 1.5) == pytest.approx(2.5)  # 2.0 -> 4.5: the hole after the fault
    assert stopped_s(events, 6.0) is None


def test_the_drain_record_says_whether_the_ranks_left_before_the_node_went():
    notice = {"kind": "fault_injected", "fault": "drain", "t_mono": 10.0, "notice_s": 5.0, "rank": 1}
    left = {"kind": "drained", "rank": 1, "t_mono": 10.3, "step": 8}
    handover = {"kind": "handover", "rank": 0, "t_mono": 10.3, "step": 8}
    said = _drain([notice, left, handover, _step(0, 11.5, 0.2)])
    assert said == {"notice_s": 5.0, "ranks": [1], "step": 8, "moved": True, "left_s": pytest.approx(0.3),
                    "stopped_s": pytest.approx(1.0)}
    assert _drain([notice, {**left, "t_mono": 16.0}])["moved"] is False
    assert _drain([notice])["moved"] is False and _drain([]) is None
