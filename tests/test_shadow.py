"""strategy=shadow, per-step checkpointing through a gradient shadow (Checkmate): every step's reduced gradients go to a
process beside the supervisor that applies the optimizer to its own replica; a restart loads its state of the last
step every rank completed. End to end on 2 gloo ranks: kills before the forward pass, after the reduction and while a
step is being published, a node's loss, and a kill after fp16's scaler skipped a step each recover bit-exact against
the fault-free run (``reference.check=run``) with at most one step lost; the whole job's state (train=real) comes
back part by part; nothing is left behind (run_experiment). Without ranks: the shadow process steps its replica to
the training's bytes, waits for every rank's parts, skips a step the optimizer skipped, dumps what a restart loads; a
dead shadow is started anew; the table's refusals."""

from __future__ import annotations

import pickle
import signal
import time

import pytest
import torch

from conftest import exact, of_kind, refusal, run_experiment
from resilience.ckpt import shadow_control as sc, shadow_files as sf, shadow_ring as sr, shm_store
from resilience.ckpt.shadow_apply import init_state
from resilience.ckpt.shm_store import run_id
from resilience.record.events import read_events
from resilience.strategies.shadow import ShadowCheckpoint, ShadowService

COMMON = ("strategy=shadow", "workload=gpt_tiny", "steps=20", "world_size=2", "seed=0", "reference.check=run")

# (id, overrides, the step the restart loads from the shadow, the steps lost)
SCENARIOS = [
    ("kill-before-forward", ("fault=kill", "fault.rank=1", "fault.at_step=9"), 9, 0),
    # rank 0 dies after the reduction: rank 1 completes step 10, but rank 0 published nothing of it
    ("kill-after-reduce", ("fault=kill", "fault.rank=0", "fault.at_step=9", "fault.phase=before_optimizer_step"), 9, 0),
    # rank 0 dies while it copies step 10's gradients: that slot is never committed, the shadow holds step 9
    ("kill-while-publishing", ("fault=kill", "fault.rank=0", "fault.at_step=10", "fault.phase=during_checkpoint"),
     9, 1),
    # the lost node's memory goes with it (node_memory): the parts kept with the shadow, on its own node, do not
    ("node-loss", ("fault=node_loss", "fault.rank=1", "fault.at_step=9"), 9, 0),
]


def shadow_kept_up(ev: list[dict], steps: int) -> None:
    """The shadow ended on the training's state, bit for bit, and stopped with the run."""
    (verified,) = of_kind(ev, "shadow_verified")
    assert verified["step"] == steps and verified["matches"] is True and verified["sha256"] == verified["shadow_sha256"]
    (stopped,) = of_kind(ev, "shadow_stopped")
    assert stopped["step"] == steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides,loaded,lost", [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_a_kill_restarts_from_the_shadow_bit_exact_losing_at_most_one_step(tmp_path, overrides, loaded, lost):
    run = tmp_path / "run"
    result = run_experiment(run, *COMMON, *overrides, timeout=280)
    exact(result)
    ev = read_events(run)
    loads = of_kind(ev, "ckpt_loaded", attempt=1)
    assert sorted((e["rank"], e["step"], e["source"]) for e in loads) == [(0, loaded, "shadow"), (1, loaded, "shadow")]
    assert result["lost_steps"] == lost <= 1 and result["recovery_source"] == "shadow"
    (settled,) = [e for e in of_kind(ev, "shadow_settled") if e["step"] > 0]
    assert settled["step"] == loaded and settled["bytes"] > 0
    assert of_kind(ev, "shadow_fallback") == []
    shadow_kept_up(ev, 20)
    # every step paid its copy inside the stall, and rank 0's carried the gradients
    ends = of_kind(ev, "ckpt_stall_end", rank=0)
    assert len({e["step"] for e in ends}) == 20 and all(e["bytes"] > 1e6 and e["wait_s"] >= 0 for e in ends)
    assert of_kind(ev, "shadow_lag")


@pytest.mark.timeout(400)
def test_the_whole_job_state_comes_back_each_rank_s_parts_from_the_shadow(tmp_path):
    """train=real: RNG streams and data position per rank (dropout, a shuffled loader with workers), LR schedule,
    counters; a kill before a forward pass and one after the gradient reduction."""
    run = tmp_path / "run"
    result = run_experiment(run, *COMMON, "train=real", "workload.dropout=0.1", "fault=kill", "fault.rank=1",
                            "fault.at_step=[6,13]", "fault.phase=[before_forward,before_optimizer_step]", timeout=380)
    exact(result)
    parts = result["state_parts"]
    assert {"rng", "dataloader", "lr_scheduler", "model", "optimizer", "train_state"} <= set(parts)
    assert all(p["exact"] for p in parts.values()), parts
    ev = read_events(run)
    assert sorted(e["step"] for e in of_kind(ev, "ckpt_loaded", rank=1)) == [6, 13]
    assert result["faults_injected"] == result["recoveries"] == 2
    assert [f["lost_steps"] for f in result["faults"]] == [0, 0]
    shadow_kept_up(ev, 20)


@pytest.mark.timeout(300)
def test_a_step_the_scaler_skipped_is_a_step_of_the_shadow_too(tmp_path):
    """fp16 with a loss scale that overflows: the scaler skips the optimizer step and halves the scale; the shadow
    gets no gradients for that step and holds the state as it was, and the restart loads it bit-exact."""
    run = tmp_path / "run"
    result = run_experiment(run, *COMMON, "train.precision=fp16", "train.fp16_init_scale=1048576", "fault=kill",
                            "fault.rank=1", "fault.at_step=4", timeout=280)
    exact(result)
    ev = read_events(run)
    scales = [e["loss_scale"] for e in ev if e["kind"] == "step_end" and e["rank"] == 0 and e["attempt"] == 1]
    assert min(scales) < max(scales)  # at least one step overflowed and was skipped
    assert sorted(e["step"] for e in of_kind(ev, "ckpt_loaded")) == [4, 4]
    shadow_kept_up(ev, 20)


# ---- without ranks ------------------------------------------------------------------------------------------------

@pytest.fixture
def shadow(tmp_path, monkeypatch):
    """A shadow process as the supervisor runs it, its shared memory in a folder of the test's own."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("RESILIENCE_SHM_DIR", str(shm))  # the shadow's process reads it at import
    monkeypatch.setattr(shm_store, "SHM_DIR", shm)
    run = tmp_path / "run"
    run.mkdir()
    service = ShadowService(world_size=2, report_every=3, poll_s=0.0005, stop_s=10.0)
    service.start("test", run)
    ctl = sc.Control.open(sf.ctl_path(run_id(run)))
    yield service, ctl, run
    ctl.close()
    service.close()
    assert service.proc.poll() is not None
    assert list(shm.iterdir()) != []  # the run's clean-up removes them, not the service
    ShadowCheckpoint.clean_up_run(run)
    assert list(shm.iterdir()) == []


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


@pytest.mark.timeout(120)
def test_the_shadow_process_steps_its_replica_to_the_training_s_bytes(shadow):
    """The training here and the shadow's process apply the same steps: the same bytes, step for step, though the
    shadow never runs the model. A step waits for every rank's parts; one the optimizer skipped (fp16's scaler on an
    overflow) leaves the state as it was; a settle dumps what a restart loads."""
    service, ctl, run = shadow
    rid = run_id(run)
    model, opt, sched = tiny()
    params = params_of(opt)
    ring = sr.GradRing.create(sf.ring_path(rid), sr.Layout.of(params), slots=2)
    try:
        sf.write_state(sf.init_path(rid), 0, 5, init_state(opt, 0))
        assert ctl.request(sc.INIT, gen=5, world=2, step=0, timeout_s=60)[0] == 0
        for step in range(1, 8):
            ctl.wait(lambda: ctl[sc.APPLIED] >= step - 2, 30, 0.0005, "a free slot")
            model(torch.randn(5, 8)).square().mean().backward()
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            skipped = step == 4
            if not skipped:
                opt.step()
            ring.write(step, 5, None if skipped else [p.grad for p in params],
                       pickle.dumps((hyper, [True] * len(params))))
            opt.zero_grad(set_to_none=True)
            sched.step()
            ctl.mark(0, 5, step)
            if step == 1:  # rank 1 has not kept its parts of step 1: the shadow must not apply it yet
                time.sleep(0.3)
                assert ctl[sc.APPLIED] == 0
            ctl.mark(1, 5, step)
            ctl.wait(lambda: ctl[sc.APPLIED] == step, 30, 0.0005, f"step {step}")
            assert ctl.request(sc.DIGEST_AT, step=step, timeout_s=30)[0] == step
            assert ctl.digest() == sf.replica_digest(params, opt.state_dict()["state"]), f"step {step}"
        got, nbytes, _ = ctl.request(sc.SETTLE, timeout_s=30)
        assert got == 7 and nbytes > 0
        step, dumped, _ = sf.read_state(sf.dump_path(rid))
        assert step == 7 and all(same_bytes(a, b) for a, b in zip(dumped["params"], params))
        mine, theirs = opt.state_dict(), dumped["optim"]
        assert mine["state"].keys() == theirs["state"].keys()
        assert all(same_bytes(mine["state"][i][k], theirs["state"][i][k]) for i in mine["state"]
                   for k in mine["state"][i])
        assert float(mine["state"][0]["step"]) == 6  # 7 steps, one skipped
    finally:
        ring.close()
    ev = read_events(run)
    assert [e["step"] for e in of_kind(ev, "shadow_lag")][:2] == [3, 6]
    assert of_kind(ev, "shadow_settled")[-1]["step"] == 7


def test_a_slot_whose_writer_dies_before_its_commit_is_never_applied(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_store, "SHM_DIR", tmp_path)
    _, opt, _ = tiny()
    params = params_of(opt)
    ring = sr.GradRing.create(tmp_path / "ring", sr.Layout.of(params), slots=2)
    grads = [torch.ones_like(p) for p in params]

    def killed() -> None:
        raise KeyboardInterrupt  # stands for the SIGKILL that ends the writer here

    with pytest.raises(KeyboardInterrupt):
        ring.write(3, 0, grads, b"meta", before_commit=killed)
    assert ring.slot(3) is None
    ring.write(3, 0, grads, b"meta")
    slot = ring.slot(3)
    assert slot is not None and ring.meta(slot) == b"meta" and ring.slot(5) is None  # 5: the same slot, not its step
    assert all(torch.equal(v, g) for v, g in zip(ring.views(slot.index), grads))
    ring.close()


@pytest.mark.timeout(120)
def test_a_shadow_that_died_is_started_anew_and_holds_nothing(shadow):
    service, ctl, _ = shadow
    ctl.wait(lambda: ctl[sc.STATE] == sc.EMPTY, 60, 0.01, "to start")
    first = service.proc.pid
    service.proc.send_signal(signal.SIGKILL)
    service.proc.wait()
    assert not ctl.alive()
    with pytest.raises(sc.ShadowGone, match="is gone"):
        ctl.request(sc.SETTLE, timeout_s=30)
    service.before_restart()  # the supervisor, before the next ranks start
    assert service.proc.pid != first and ctl[sc.PID] == service.proc.pid
    assert ctl.request(sc.SETTLE, timeout_s=60)[0] == -1  # empty: the restart goes on from step 0


def test_the_table_refuses_what_the_shadow_cannot_do(tmp_path):
    said = refusal(tmp_path, ["strategy=shadow", "parallel=fsdp"])
    assert said.startswith("parallel=fsdp: strategy=shadow does not save sharded state"), said
    said = refusal(tmp_path, ["strategy=shadow", "fault=job_kill"])
    assert said.startswith("fault=job_kill: ends the whole job, and strategy=shadow keeps the state"), said
    said = refusal(tmp_path, ["strategy=shadow", "checkpoint.on_notice=true"])
    assert said.startswith("checkpoint.on_notice=true: strategy=shadow keeps the state"), said
    said = refusal(tmp_path, ["strategy=shadow", "workload=dlrm_emb"])
    assert said.startswith("workload=dlrm_emb: its embedding gradients are sparse"), said
    said = refusal(tmp_path, ["strategy=shadow", "checkpoint.every=auto", "checkpoint.auto.mtbf_s=3600"])
    assert said.startswith("checkpoint.every=auto: strategy=shadow checkpoints every step"), said
    said = refusal(tmp_path, ["strategy=shadow", "supervisor.launcher=external"])
    assert said.startswith("supervisor.launcher=external: shadow runs part of itself in the local supervisor"), said
    with pytest.raises(ValueError, match="device=cuda: strategy=shadow applies the optimizer step on the CPU"):
        ShadowCheckpoint(every=5, keep=2, device="cuda")  # this host has no CUDA device: refused before by config
