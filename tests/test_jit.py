"""strategy=jit, just-in-time checkpointing: the state is written by a survivor when a failure is detected, never on an
interval. End to end on 2 gloo ranks: a kill, a hang (the heartbeat kills it) and a collective timeout each recover
bit-exact against the fault-free run (``reference.check=run``) with at most the step in flight replayed; the whole
job's state (train=real) comes back part by part; losing every replica at once ends in a recorded outcome. Without
processes: the shard file, the per-rank parts in node memory, the SIGTERM grace, the table's refusals."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SHORT, SHORT_REAL, exact, of_kind, refusal, run_experiment
from resilience.ckpt.codec import restore, snapshot_state, tensor_leaves
from resilience.ckpt.jit_files import read_shard, write_shard
from resilience.ckpt.jit_parts import RankParts
from resilience.ckpt.node_memory import NodeMemory, cleanup
from resilience.ckpt.shm_store import run_id
from resilience.record.events import read_events
from resilience.state.train import TrainState, state_sha256

COMMON = ("strategy=jit", "workload=gpt_tiny", "steps=12", "world_size=2", "seed=0", "reference.check=run")


@pytest.fixture
def short_reference(fault_free_run) -> None:
    """COMMON's training is SHORT's: its fault-free run, once for the session (tests/test_job_resume.py's too), is the
    reference that reference.check=run finds, instead of running one in a test's first run."""
    fault_free_run(*SHORT)


@pytest.fixture
def short_real_reference(fault_free_run) -> None:
    """The same with train=real (SHORT_REAL's, whose parts are hashed at every step: each point a run checks)."""
    fault_free_run(*SHORT_REAL)

# (id, overrides, the detector that sees it first, the steps the survivor may write and the restart load)
SCENARIOS = [
    ("kill", ("fault=kill", "fault.rank=1", "fault.at_step=5"), "process_exit", {5}),
    # rank 1 dies after its gradients went into the all-reduce: the survivor completes step 6 and writes that (or,
    # where the dying rank's last bytes never reached it, fails that reduction and writes step 5)
    ("kill-after-reduce", ("fault=kill", "fault.rank=1", "fault.at_step=5", "fault.phase=before_optimizer_step"),
     "process_exit", {5, 6}),
    ("hang", ("fault=hang", "fault.rank=1", "fault.at_step=5", "timeouts.heartbeat_s=2"), "heartbeat", {5}),
    ("collective-timeout", ("fault=hang", "fault.rank=1", "fault.at_step=5", "timeouts.collective_s=3",
                            "detector=[process_exit,collective_timeout]"), "collective_timeout", {5}),
]


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("short_reference")
@pytest.mark.parametrize("overrides,detector,steps", [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_a_survivor_writes_the_last_step_and_the_restart_replays_at_most_the_one_in_flight(tmp_path, overrides,
                                                                                           detector, steps):
    run = tmp_path / "run"
    result = run_experiment(run, *COMMON, *overrides, timeout=280)
    exact(result)
    ev = read_events(run)
    assert result["detector"] == detector
    assert of_kind(ev, "ckpt_begin") == []  # nothing saved on an interval
    # the survivor's last completed step: what it must have written
    written = max(e["step"] for e in of_kind(ev, "step_end", rank=0, attempt=0))
    assert written in steps
    saved = of_kind(ev, "jit_saved", attempt=0)
    assert [(e["rank"], e["step"], e["committed"]) for e in saved] == [(0, written, True)]
    assert saved[0]["duration_s"] < 5.0  # inside the launcher's grace (timeouts.shutdown_s)
    loads = of_kind(ev, "ckpt_loaded", attempt=1)
    assert sorted((e["rank"], e["step"], e["source"]) for e in loads) == [(0, written, "jit"), (1, written, "jit")]
    fault_step = result["fault_step"]
    assert fault_step - written <= 1 and result["lost_steps"] == 0  # at most the step in flight is trained again
    assert result["recovery_source"] == "jit"
    # every step of the run trained once, but for that one: nothing trained before the failure was lost
    trained = [e["step"] for e in ev if e["kind"] == "step_end" and e["rank"] == 0]
    assert len(trained) - result["steps_completed"] <= 1
    assert of_kind(ev, "jit_no_replica") == []


@pytest.mark.timeout(400)
@pytest.mark.usefixtures("short_real_reference")
def test_the_whole_job_state_comes_back_each_rank_s_own_parts_from_node_memory(tmp_path):
    """train=real: RNG streams and data position per rank (dropout, a shuffled loader with workers), LR schedule,
    counters; a kill before a forward pass and one after the gradient reduction (the dead rank had drawn the step's
    batches: its parts of the next boundary, kept after its last forward pass, are the ones the restart needs)."""
    run = tmp_path / "run"
    result = run_experiment(run, *COMMON, "train=real", "workload.dropout=0.1", "fault=kill", "fault.rank=1",
                            "fault.at_step=[4,8]", "fault.phase=[before_forward,before_optimizer_step]", timeout=380)
    exact(result)
    parts = result["state_parts"]
    assert {"rng", "dataloader", "lr_scheduler", "model", "optimizer", "train_state"} <= set(parts)
    assert all(p["exact"] for p in parts.values()), parts
    ev = read_events(run)
    assert [e["step"] for e in of_kind(ev, "jit_saved", rank=0)] == [4, 9]
    assert of_kind(ev, "jit_parts_lost") == []
    assert result["faults_injected"] == result["recoveries"] == 2


@pytest.mark.timeout(400)
def test_under_hsdp_each_shard_is_written_by_one_survivor_and_the_set_is_committed(tmp_path):
    """2 replica groups x 2 shards: rank 1 (shard 1 of group 0) dies; its shard lives on in rank 3, shard 0 in ranks 0
    and 2 (one of them writes it); the restart loads each rank's own shard."""
    run = tmp_path / "run"
    result = run_experiment(run, *COMMON, "parallel=hsdp", "world_size=4", "steps=10", "detector=[process_exit]",
                            "fault=kill", "fault.rank=1", "fault.at_step=5", timeout=380)
    exact(result)
    ev = read_events(run)
    saved = of_kind(ev, "jit_saved", attempt=0)
    assert sorted((e["shard"], e["shards"], e["step"]) for e in saved) == [(0, 2, 5), (1, 2, 5)]
    assert [e["rank"] for e in saved if e["shard"] == 1] == [3] and sum(e["committed"] for e in saved) >= 1
    # shard 0: rank 0 or 2 wrote it; the other found it written, or was stopped once the set was committed
    assert len([e for e in saved if e["shard"] == 0]) == 1 and {e["rank"] for e in saved if e["shard"] == 0} <= {0, 2}
    loads = of_kind(ev, "ckpt_loaded", attempt=1)
    assert sorted(e["rank"] for e in loads if e["step"] == 5 and e["source"] == "jit") == [0, 1, 2, 3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides,world", [
    (("world_size=1", "fault=kill", "fault.rank=0", "fault.at_step=5"), 1),
    (("fault=node_loss", "ranks_per_node=2", "fault.rank=0", "fault.at_step=5"), 2),
], ids=["world_size=1", "node-loss-of-the-world"])
def test_no_healthy_replica_left_is_said_and_the_run_goes_on_from_what_there_is(tmp_path, overrides, world):
    run = tmp_path / "run"
    result = run_experiment(run, *COMMON, *overrides, timeout=280)
    exact(result)  # from the start again: still the fault-free run's state
    ev = read_events(run)
    assert of_kind(ev, "jit_saved") == []
    (said,) = of_kind(ev, "jit_no_replica")
    assert (said["rank"], said["step"], said["reached"], said["lost_steps"]) == (0, 0, 5, 5)
    assert ("world_size=1" if world == 1 else "every replica was lost at once") in said["reason"]
    assert result["lost_steps"] == 5 and result["recovery_source"] == "none"


# ---- without processes --------------------------------------------------------------------------------------------

def trained(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return TrainState(model, opt)


def whole(state: TrainState) -> str:
    return state_sha256({"model": state.model.state_dict(), "optim": state.optimizer.state_dict()})


def test_a_shard_file_reads_back_into_a_fresh_model_bit_for_bit():
    saved = trained(0)
    buf = io.BytesIO()
    length = write_shard(buf, {"model": saved.model.state_dict(), "optim": saved.optimizer.state_dict()})
    assert length == len(buf.getvalue())
    fresh = trained(1)
    fresh.optimizer.state.clear()  # as a restarted rank's: the optimizer adopts what it reads
    assert whole(fresh) != whole(saved)
    restore(fresh, read_shard(memoryview(buf.getvalue()), tensor_leaves(snapshot_state(fresh))))
    assert whole(fresh) == whole(saved)
    damaged = bytearray(buf.getvalue())
    damaged[:8] = b"NOTAJIT!"
    with pytest.raises(OSError, match="not a just-in-time shard"):
        read_shard(memoryview(bytes(damaged)), {})


def test_per_rank_parts_keep_two_steps_and_a_copy_on_the_next_node(tmp_path):
    rid = run_id(tmp_path)
    memory = NodeMemory(rid)
    try:
        mine = RankParts(rid, rank=0, world_size=2, ranks_per_node=1, memory=memory)
        for step in (3, 4, 5):
            mine.put(step, 0, {"rng": {"step": step}})
        assert mine.get(3) is None  # two slots: 4 and 5
        assert mine.get(4) == ({"rng": {"step": 4}}, "memory")
        memory.destroy(0)  # rank 0's node is lost: the copy on node 1 is left
        assert mine.get(5) == ({"rng": {"step": 5}}, "peer_memory")
        memory.destroy(1)
        assert mine.get(5) is None
        alone = RankParts(rid, rank=0, world_size=2, ranks_per_node=2, memory=memory)  # one node: no copy elsewhere
        memory.revive(0)
        alone.put(6, 1, {"rng": 6})
        memory.destroy(0)
        assert alone.get(6) is None
    finally:
        cleanup(tmp_path)


GRACE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from resilience.proc.term_grace import TermGrace
    mode, flag, done = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    grace = TermGrace(0.6, lambda: flag.exists())
    grace.install()
    if mode == "writing":
        grace.writing()
    print("ready", flush=True)
    if mode == "late":
        time.sleep(0.25)
        grace.writing()
    r, _ = os.pipe()
    if mode in ("idle", "superseded"):
        os.read(r, 1)  # blocked in a C call, as in a collective: no Python code runs
    time.sleep(1.0)  # the write
    done.write_text("written")
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,code,written,at_least,below", [
    ("writing", 0, True, 0.9, 4.0),  # SIGTERM waits for the write
    ("late", 0, True, 0.9, 4.0),  # the collective fails within the wait: the write begins, SIGTERM waits for it
    ("idle", 143, False, 0.5, 3.0),  # nothing to write: the wait passes, the rank ends
    ("superseded", 143, False, 0.0, 0.45),  # a state at least as new is committed: it ends at once
])
def test_sigterm_waits_for_a_write_at_a_failure_and_only_for_one(tmp_path, mode, code, written, at_least, below):
    flag, done = tmp_path / "committed", tmp_path / "done"
    if mode == "superseded":
        flag.touch()
    proc = subprocess.Popen([sys.executable, "-c", GRACE, mode, str(flag), str(done)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, proc.stderr.read()
    assert done.exists() == written
    assert at_least <= took < below, took


def test_the_table_refuses_what_jit_cannot_do(tmp_path):
    said = refusal(tmp_path, ["strategy=jit", "parallel=fsdp", "world_size=2"])
    assert said.startswith("parallel=fsdp: strategy=jit writes a failed rank's state at the failure from a surviving")
    assert said.endswith("use parallel=ddp")  # hsdp needs 4 ranks here
    said = refusal(tmp_path, ["strategy=jit", "recovery=nvrx_inprocess"])
    assert said.startswith("recovery=nvrx_inprocess: interrupts every rank's training") and "recovery=restart" in said
    said = refusal(tmp_path, ["strategy=jit", "fault=kill", "fault.phase=during_checkpoint"])
    assert said.startswith("fault.phase=during_checkpoint: acts on a checkpoint, and strategy=jit never")
    said = refusal(tmp_path, ["strategy=jit", "timeouts.shutdown_s=2", "strategy.failure_wait_s=3"])
    assert "strategy.failure_wait_s=3" in said and "grace" in said
