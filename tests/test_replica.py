"""The replica strategy: replicas made consistent by a real transfer, and in-place recovery end to end (the
survivors keep their processes, the replacement receives the state, the run ends bit-exact)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT, refusal, run_cli, run_experiment
from sharded_ranks import spawn
from resilience.record.events import read_events
from resilience.record.replicas import replacement_parts
from resilience.state.train import TrainState, state_sha256
from resilience.ckpt.transfer import replica_state
from resilience.ckpt import replica_transfer

COMMON = ("strategy=replica", "steps=30", "world_size=2", "seed=0")


def _replica_worker(rank: int, world: int, store: str, trained: list[int | None], out, bucket: int | None) -> None:
    """Train ``trained[rank]`` steps (None: a replacement that holds nothing), reconcile, report the outcome: the
    reconciled position, source, whether it received, the bytes, the state's hash after reconcile and before it."""
    if bucket is not None:  # small buckets: some tensors travel alone, the rest packed, more buckets than the window
        replica_transfer.BUCKET_BYTES = bucket
    torch.set_num_threads(1)  # three ranks on a small host: no oversubscription
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    wl = instantiate(OmegaConf.load(ROOT / "conf" / "workload" / "gpt_tiny.yaml"), seed=0)
    model = wl.build_model()
    state = TrainState(model, wl.build_optimizer(model))
    for step in range(trained[rank] or 0):
        torch.manual_seed(step)
        wl.loss(model, wl.batch(step, 0, torch.device("cpu"))).backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    before = state_sha256(replica_state(state))  # the plain state dicts: nothing initialised by looking
    done = replica_transfer.reconcile(state, trained[rank], torch.device("cpu"))
    out.put((rank, done.position, done.source, done.received, done.nbytes, state_sha256(replica_state(state)),
             before))
    dist.destroy_process_group()


def _replica_rank(rank: int, world: int, store: str, _folder: str, *args) -> None:
    """``_replica_worker`` as ``sharded_ranks.spawn`` calls a rank (``_folder``: where the store is)."""
    _replica_worker(rank, world, store, *args)


def reconcile_in_processes(tmp_path, trained: list[int | None], bucket: int | None = None) -> dict[int, tuple]:
    """Each rank's outcome, its ranks forked from one process that imports this module once (sharded_ranks.spawn);
    fails if a rank fails. The outcomes are a few hundred bytes: the queue's pipe holds them until the ranks end."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = mp.get_context("spawn").Queue()
    spawn(_replica_rank, len(trained), str(tmp_path), trained, out, bucket)
    results = {}
    while len(results) < len(trained):
        rank, *rest = out.get(timeout=30)
        results[rank] = tuple(rest)
    return results


@pytest.mark.timeout(400)
@pytest.mark.parametrize("bucket", [None, 64 << 10])
def test_reconcile_redoes_the_step_and_fills_a_replacement(tmp_path, bucket):
    # Rank 1 applied step 4 before the failure, rank 0 did not, rank 2 is a replacement with nothing: all end
    # with rank 1's state, the lagging survivor received in place, the replacement into new optimizer buffers.
    got = reconcile_in_processes(tmp_path, [3, 4, None], bucket)
    assert {r: g[:3] for r, g in got.items()} == {0: (4, 1, True), 1: (4, 1, False), 2: (4, 1, True)}
    assert len({g[4] for g in got.values()}) == 1, "replicas differ after reconcile"
    # Model + AdamW's two moments: ~3 x the parameter bytes went to each rank behind, and twice out of rank 1.
    assert got[0][3] == got[2][3] > 0 and got[1][3] == 2 * got[0][3]
    # ... and that state is the one rank 1 trained, its bits untouched by sending it (its hash before reconcile: its
    # 4 steps are local, the process group joined only to reconcile, so a rank of 4 steps alone holds the same
    # bits; once a second spawn of its own, ~4 s)
    assert got[1][5] == got[1][4]


@pytest.mark.timeout(180)
def test_reconcile_at_step_zero_moves_nothing(tmp_path):
    got = reconcile_in_processes(tmp_path, [0, None])
    assert [g[2:4] for g in got.values()] == [(False, 0), (False, 0)]
    assert got[0][4] == got[1][4]  # the replacement built the same initial state from the seed


def _pids_by_rank(run_dir) -> dict[int, set[int]]:
    pids: dict[int, set[int]] = {}
    for e in read_events(run_dir):
        if e["kind"] == "run_start":
            pids.setdefault(e["rank"], set()).add(e["pid"])
    return pids


# (description, overrides): every scenario must end bit-exact with only the failed rank restarted.
SCENARIOS = [
    ("rank 0 killed between backward and optimizer step: its peer is one step ahead",
     ("fault=kill", "fault.rank=0", "fault.at_step=7", "fault.phase=before_optimizer_step")),
    ("rank 1 hangs; the heartbeat names it and it is killed",
     ("fault=hang", "fault.rank=1", "fault.at_step=9", "timeouts.heartbeat_s=2")),
    ("rank 1 killed; a warm spare takes its place", ("fault=kill", "fault.rank=1", "fault.at_step=13",
                                                      "supervisor.spares=1")),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("description,overrides", SCENARIOS, ids=["kill-0-mid-step", "hang-1", "spare"])
def test_survivors_keep_running_and_end_bit_exact(tmp_path, reference, description, overrides):
    run_dir = tmp_path / "run"
    result = run_experiment(run_dir, *COMMON, *overrides)
    assert result["status"] == "ok" and result["recovered"], description
    assert result["final_state_sha256"] == reference["final_state_sha256"], description
    assert result["replicas_agree"] and result["lost_steps"] == 0
    failed = result["fault_rank"]
    assert result["detected_rank"] == failed
    assert result["recovery_source"] == f"replica:{1 - failed}" and result["recovery_bytes"] > 0
    assert result["survivors_restarted"] is False
    pids = _pids_by_rank(run_dir)
    assert len(pids[1 - failed]) == 1, "the survivor was restarted"
    assert len(pids[failed]) == 2
    events = read_events(run_dir)
    restarts = [e for e in events if e["kind"] == "restart"]
    assert [e["ranks"] for e in restarts] == [[failed]]
    assert restarts[0]["from_spares"] == ([failed] if "supervisor.spares=1" in overrides else [])
    # a cold replacement starts while the incident settles (before the event); a warm spare is not started
    assert (restarts[0]["spawned_s_before"] > 0) == ("supervisor.spares=1" not in overrides)
    assert len([e for e in events if e["kind"] == "fault_detected"]) == 1  # a heartbeat kill is no second fault
    # the replacement's state was built without values (a spare's before it had a rank, initialised), then healed
    heals = [e for e in events if e["kind"] == "replica_heal"]
    assert [e["uninitialised"] for e in heals] == ["supervisor.spares=1" not in overrides]
    rejoined = [e for e in events if e["kind"] == "rejoined"]
    assert [e["rank"] for e in rejoined] == [1 - failed] and rejoined[0]["generation"] == 1
    # torchft's measures, under the same names (issue 14): the survivors waited, so no step ran at reduced width.
    assert result["while_replacing"] == "wait" and result["reduced_width_steps"] == 0 and result["bit_exact"] is None
    assert result["replicas_consistent"] is True and result["quorum_detection_s"] is None
    assert result["heal_bytes"] == result["recovery_bytes"] and 0 < result["heal_transfer_s"] <= result["heal_s"]
    assert 0 < result["replacement_start_s"] < result["survivors_stall_s"]
    # its start in parts (speed issue, item 3): they add up to it (the process's age is known to 10 ms)
    parts = replacement_parts(events)
    assert parts["join_s"] > 0 and parts["process_s"] > 0
    assert sum(parts.values()) == pytest.approx(result["replacement_start_s"], abs=0.03)


@pytest.mark.timeout(300)
def test_a_dlrm_replacement_built_uninitialised_ends_bit_exact(tmp_path):
    """Adagrad's sums (made when the optimizer is built) and the model's index pairs (a plain attribute, which no
    heal carries) through the replacement's uninitialised build and its heal."""
    small = ("workload=dlrm_emb", "workload.rows=3000", "workload.tables=3")
    reference = run_experiment(tmp_path / "reference", *COMMON, *small, "fault=none")
    result = run_experiment(tmp_path / "run", *COMMON, *small, "fault=kill", "fault.rank=1", "fault.at_step=13")
    assert result["status"] == "ok" and result["recovered"] and result["survivors_restarted"] is False
    assert result["final_state_sha256"] == reference["final_state_sha256"]
    assert [e["uninitialised"] for e in read_events(tmp_path / "run") if e["kind"] == "replica_heal"] == [True]


CONTINUE = [
    # a replacement started from scratch (cold, as in production, whatever the suite's RB_RESTARTS)
    ("the survivor trains alone until the end; the replacement heals into the final state",
     ("supervisor.restarts=cold",)),
    # the ranks start cold too, as in production: a spare started beside them is ready when they have trained a few
    # steps (beside ranks forked preloaded, it raced the survivor's last steps and could lose on a busy host)
    ("a warm spare is ready mid-run: it heals at a step boundary and both train on",
     ("supervisor.spares=1", "supervisor.first_start=cold")),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("description,overrides", CONTINUE, ids=["late", "spare"])
def test_while_replacing_continue_trains_at_reduced_width_and_heals_consistent(tmp_path, reference, description,
                                                                                overrides):
    run_dir = tmp_path / "run"
    result = run_experiment(run_dir, *COMMON, "strategy.while_replacing=continue", "fault=kill", "fault.rank=1",
                            "fault.at_step=13", *overrides)
    assert result["status"] == "ok" and result["recovered"] and result["steps_completed"] == 30, description
    assert result["survivors_restarted"] is False and result["lost_steps"] == 0
    assert len(_pids_by_rank(run_dir)[0]) == 1, "the survivor was restarted"
    assert result["while_replacing"] == "continue" and result["replicas_consistent"] is True
    assert result["replicas_agree"] and result["quorum_detection_s"] > 0 and result["replacement_start_s"] > 0
    assert result["heal_bytes"] > 1_000_000 and result["heal_transfer_s"] > 0
    healed_at = [e["step"] for e in read_events(run_dir) if e["kind"] == "replica_heal"]
    assert len(healed_at) == 1 and 13 <= healed_at[0] <= 30
    assert result["reduced_width_steps"] == healed_at[0] - 13
    if result["reduced_width_steps"]:  # another trajectory by design: what applies is the replicas' agreement
        assert result["bit_exact"] == "not by design"
        assert result["final_state_sha256"] != reference["final_state_sha256"]
    else:  # a spare ready at the survivors' first step boundary: nothing ran at reduced width, so bit-exact
        assert result["bit_exact"] is None and result["final_state_sha256"] == reference["final_state_sha256"]
    if "supervisor.spares=1" in overrides:  # the spare was ready long before the end: both trained after the heal
        assert healed_at[0] < 30
    else:  # a replacement started from scratch takes longer than the 17 steps the survivor has left
        assert result["reduced_width_steps"] >= 1
        assert result["quorum_detection_s"] < result["survivors_stall_s"] < result["replacement_start_s"]


@pytest.mark.timeout(240)
def test_out_of_budget_is_unrecovered_and_leaves_nothing(tmp_path):
    result = run_experiment(tmp_path / "run", *COMMON, "fault=kill", "fault.rank=1", "fault.at_step=5",
                            "recovery=fail")  # run_experiment also checks that no rank process is left
    assert result["status"] == "unrecovered" and result["detected"] and not result["recovered"]


@pytest.mark.timeout(240)
def test_every_replica_lost_at_once_ends_the_run_without_spending_the_budget(tmp_path):
    """The node of both ranks is lost: no rank holds the state, the replacements say so (exit 76) and the
    supervisor ends the run there (one restart, not the budget's three), with the reason in result.json."""
    result = run_experiment(tmp_path / "run", *COMMON, "fault=node_loss", "ranks_per_node=2", "fault.rank=1",
                            "fault.at_step=5")
    assert result["status"] == "unrecovered" and result["attempts"] == 2
    assert result["unrecoverable"] == "no rank holds the training state (every replica was lost at once)"


def test_ranks_that_fail_together_are_one_incident_however_far_apart_the_polls_see_them():
    """A node's ranks exit a few milliseconds apart: a poll between the two exits must still take them for one
    incident (one generation, one restart of the budget), and a rank that fails well after is a new one."""
    import subprocess
    import sys
    from resilience.supervise.replacing import SETTLE_S, ReplacingSupervisor
    supervisor = ReplacingSupervisor.__new__(ReplacingSupervisor)
    supervisor.cfg = OmegaConf.create({"supervisor": {"monitor_interval_s": 0.1}})
    exits = {0: 0.0, 1: 0.1, 2: SETTLE_S + 2.0}  # rank -> seconds before it exits with code 3
    supervisor._procs = {r: subprocess.Popen([sys.executable, "-c", f"import time, os; time.sleep({s}); os._exit(3)"])
                         for r, s in exits.items()}
    try:
        supervisor._procs[0].wait()
        assert supervisor._settle({0: 3}) == {1: 3}
        assert supervisor._procs[2].poll() is None  # the settle did not wait for it
    finally:
        for p in supervisor._procs.values():
            p.kill()
            p.wait()


BAD = [
    (("recovery=rollback",), "recovery=rollback", "recovery=restart"),
    (("fault=kill", "fault.phase=during_checkpoint", "fault.at_step=10"), "fault.phase=during_checkpoint",
     "never checkpoints"),
    (("supervisor.launcher=external",), "supervisor.launcher=external", "replaces failed ranks"),
    (("strategy.while_replacing=later",), "strategy.while_replacing=later", "wait, continue"),
]


@pytest.mark.parametrize("overrides,setting,why", BAD, ids=[b[1] for b in BAD])
def test_settings_replica_cannot_honour_are_refused(tmp_path, overrides, setting, why):
    error = refusal(tmp_path, ["strategy=replica", *overrides])
    assert setting in error and why in error


@pytest.mark.timeout(120)
def test_a_refused_setting_is_one_line_exit_2(tmp_path):
    """The command's own exit for the checks above (one case: each costs an interpreter and Hydra)."""
    overrides, setting, why = BAD[0]
    done = run_cli("strategy=replica", *overrides, f"hydra.run.dir={tmp_path / 'run'}", timeout=100)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and setting in done.stderr and why in done.stderr


def test_replace_deadline_is_its_own_setting_or_a_multiple_of_the_measured_rank_start():
    from resilience.strategies.replica import ReplicaRecovery, measured_rank_start_s

    events = [{"kind": "launch", "rank": None, "t_mono": 100.0, "attempt": 0},
              {"kind": "run_start", "rank": 0, "t_mono": 103.0, "attempt": 0},
              {"kind": "run_start", "rank": 1, "t_mono": 104.5, "attempt": 0},
              {"kind": "run_start", "rank": 1, "t_mono": 190.0, "attempt": 1}]  # a replacement: not the start
    assert measured_rank_start_s(events) == 4.5
    assert measured_rank_start_s(events[1:]) is None  # no supervisor launch on record
    # a first generation forked from the zygote skipped its imports, which a replacement (cold) pays: added
    forked = [{**e, "preload_s": 1.25} if e["kind"] == "run_start" and e["attempt"] == 0 else e for e in events]
    assert measured_rank_start_s(forked) == 5.75
    assert ReplicaRecovery(1, 1, replace_timeout_s=30).replace_deadline() == {"replace_timeout_s": 30.0,
                                                                              "replace_basis": "setting"}
    with pytest.raises(ValueError, match="strategy.replace_timeout_s=-1"):
        ReplicaRecovery(1, 1, replace_timeout_s=-1)
    with pytest.raises(ValueError, match="strategy.replace_start_factor=0"):
        ReplicaRecovery(1, 1, replace_start_factor=0)
