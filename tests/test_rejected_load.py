"""A checkpoint rejected at load leaves no trace: the training state is what it was before the load.

Every strategy that writes checkpoints, ours and the libraries', on one gloo rank: save, damage what was saved,
then load into a fresh state (what a restarted rank holds). The load must pass over the damaged checkpoint, start
from step 0, and leave model and optimizer exactly as built: building a load target steps a fresh optimizer
(found by the torture bench: Adam's step count advanced by a rejected checkpoint, the run diverged after it).
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from conftest import ROOT, SHORT, run_experiment
from resilience.ckpt.commit import CheckpointDir
from resilience.record.events import read_events
from resilience.settings.schema import SCHEMA_NAME  # noqa: F401 - registers the settings' schema that config.yaml names
from resilience.state.train import RestorePoint, TrainState, state_sha256
from resilience.strategies.base import CheckpointStrategy
from test_inmemory import attached, one_rank, trained_state  # noqa: F401 - a fixture: one gloo rank, no peers

# every option of conf/strategy that saves to disk; dlrover_flash's saver runs in the rank here (no supervisor)
WRITERS = ("sync", "async", "dcp_async", "dcp_async_staged", "dcp_async_process", "torchsnapshot",
           "torch_checkpointing", "nvrx_async", "nvrx_async_dcp", "dlrover_flash_standalone", "inmemory")
# Check-N-Run's chains (strategy=incremental|quantized): on this model, without embedding tables, every link is dense
WRITERS += ("incremental", "quantized")
SAVED_AT = 4  # inmemory persists every 4th snapshot to disk


def build(strategy: str) -> CheckpointStrategy:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"strategy={strategy}", "world_size=1", "checkpoint.every=1"])
    return instantiate(cfg.strategy, every=1, keep=2)


def untouched_hash(state: TrainState) -> str:
    """Model and optimizer as they are (``TrainState.state_dict`` would step a fresh optimizer)."""
    return state_sha256({"model": state.model.state_dict(), "optim": state.optimizer.state_dict()})


def damage(ckpt_dir) -> int:
    """Flip a bit in the middle of every data file of every committed checkpoint (``fault.how=flip``); its
    metadata and commit record stay intact, so the load gets as far as reading the data; return how many."""
    dirs = CheckpointDir(ckpt_dir)
    files = [f for entry in dirs.entries() if entry.committed for f in dirs.data_files(entry)]
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    return len(files)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", WRITERS)
def test_a_rejected_checkpoint_leaves_the_state_as_it_was(one_rank, name):
    run_dir = one_rank
    # DLRover names its segments by TORCHELASTIC_RUN_ID: the session's (conftest), which a fork server keeps
    saver = attached(build(name), run_dir, 0)
    assert saver.load(trained_state(0)) == 0  # a run's first load: nothing there yet
    saver.save(SAVED_AT, 10, trained_state(2))
    saver.wait()
    saver.close()
    saver.rt.events.close()
    type(saver).clean_up_run(run_dir)  # what memory held is gone (a node lost): the load must read the damaged files
    assert damage(run_dir / "ckpt") > 0

    fresh = trained_state(0)
    before = untouched_hash(fresh)
    loader = attached(build(name), run_dir, 1)
    try:
        assert loader.load(fresh) == 0
    finally:
        loader.close()
        loader.rt.events.close()
        type(loader).clean_up_run(run_dir)
    assert [e["step"] for e in read_events(run_dir) if e["kind"] == "ckpt_rejected"] == [SAVED_AT]
    assert untouched_hash(fresh) == before and not fresh.optimizer.state


def test_the_restore_point_undoes_a_fresh_optimizers_initialisation():
    state = trained_state(0)
    before = untouched_hash(state)
    point = RestorePoint(state)
    state.state_dict()  # DCP's zero-learning-rate step: Adam now has state, its step count 1
    assert state.optimizer.state and untouched_hash(state) != before
    point.restore()
    assert untouched_hash(state) == before and not state.optimizer.state


@pytest.mark.timeout(180)
def test_the_torture_benchs_reproducer_ends_on_the_fault_free_state(tmp_path, fault_free_run):
    """A flipped bit in rank 1's step-4 checkpoint, then a kill at step 6: the checkpoint is rejected, training
    starts over from step 0, and ends bit for bit on the reference, which the run finds recorded and says it matches
    (before the fix: ``ok``, and a final state off the reference from step 2 on)."""
    # SHORT's training: its fault-free run, the session's (tests/test_jit.py's reference too), recorded itself as the
    # reference that reference.check=run finds, instead of running one of its own
    reference = fault_free_run(*SHORT)
    result = run_experiment(tmp_path / "run", "strategy=sync", "fault=ckpt_damage", "fault.how=flip", "fault.rank=1",
                            "fault.at_step=6", *SHORT, "timeouts.collective_s=10", "reference.check=run")
    rejected = [e for e in read_events(tmp_path / "run") if e["kind"] == "ckpt_rejected"]
    assert [e["step"] for e in rejected] == [4] and result["status"] == "ok"
    assert result["reference"]["matches"] is True and not (tmp_path / "run" / "reference").exists()
    assert result["final_state_sha256"] == result["reference"]["sha256"] == reference["final_state_sha256"]
