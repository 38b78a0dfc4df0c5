"""Configuration: the composed defaults, and one clear line for every bad value (no traceback)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import ROOT, run_cli, run_module
from resilience.__main__ import precheck
from resilience.settings.command_line import CommandLineError
from resilience.config import ConfigError, check_group_choices, resolve
from resilience.projection.cli import precheck as projection_precheck
from resilience.projection.validation import ConfigError as ProjectionConfigError
from resilience.settings.schema import SCHEMA_NAME, Experiment

CONTRACT_KEYS = ("seed", "steps", "world_size", "device", "backend", "checkpoint.every", "checkpoint.keep",
                 "checkpoint.dir", "timeouts.collective_s", "timeouts.heartbeat_s", "fault.rank", "fault.at_step",
                 "fault.phase")


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=False)


def test_contract_keys_exist_for_every_fault():
    for fault in ("none", "kill"):
        cfg = composed(f"fault={fault}")
        for key in CONTRACT_KEYS:
            assert key.split(".")[0] in cfg, key
            node = cfg
            for part in key.split("."):
                assert part in node, f"{key} missing with fault={fault}"
                node = node[part]


def test_resolve_fills_auto_values(tmp_path):
    cfg = resolve(composed("world_size=2"), tmp_path, {"strategy": "sync"})
    assert cfg.device == "cpu" and cfg.backend == "gloo"
    assert cfg.threads_per_rank >= 1
    assert Path(cfg.checkpoint.dir) == (tmp_path / "ckpt").resolve()
    assert "${" not in str(cfg)  # fully resolved: rank processes have no Hydra context


def test_the_schema_keeps_every_value_as_written(tmp_path):
    """base_config types the settings but changes none: the resolved config is the one composed without it."""
    from hydra.core.config_store import ConfigStore

    plain = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", plain)
    text = (plain / "config.yaml").read_text()
    assert "  - base_config" in text
    (plain / "config.yaml").write_text(text.replace("  - base_config", "", 1))
    with initialize_config_dir(config_dir=str(plain), version_base="1.3"):
        untyped = compose(config_name="config", overrides=["strategy=dcp_async", "fault=kill"])
    typed = composed("strategy=dcp_async", "fault=kill")
    assert OmegaConf.get_type(typed) is Experiment and OmegaConf.get_type(untyped) is dict
    assert ConfigStore.instance().load(f"{SCHEMA_NAME}.yaml") is not None
    as_written = OmegaConf.to_container(untyped, resolve=True)
    assert OmegaConf.to_container(typed, resolve=True, enum_to_str=True) == as_written
    assert resolve(typed, tmp_path, {}) == resolve(untyped, tmp_path, {})  # what the ranks receive


def test_resolve_rejects_during_checkpoint_without_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="fault.phase=during_checkpoint"):
        resolve(composed("strategy=none", "fault=kill", "fault.phase=during_checkpoint", "fault.at_step=10"),
                tmp_path, {})


def test_ranks_per_node_is_the_runs_and_fault_ranks_per_node_sets_it(tmp_path):
    """The node fault, the in-memory peer copy and the shrink read one run-wide setting; the name it had when the
    fault owned it (fault.ranks_per_node, in older command lines and in conf/matrix/sharded.yaml) still sets it."""
    base = ("fault=node_loss", "fault.rank=1", "world_size=4", "strategy=inmemory", "recovery=shrink")
    new, old = (resolve(composed(*base, setting), tmp_path, {}) for setting in ("ranks_per_node=2",
                                                                               "fault.ranks_per_node=2"))
    assert new == old
    assert {new.ranks_per_node, new.fault.ranks_per_node, new.strategy.ranks_per_node,
            new.recovery.ranks_per_node} == {2}


BAD = [
    (("strategy=nope",), "strategy=nope", "allowed: "),
    (("steps=0",), "steps=0", ">= 1"),
    (("world_size=0",), "world_size=0", ">= 1"),
    (("ranks_per_node=0",), "ranks_per_node=0", ">= 1"),
    (("world_size=4", "ranks_per_node=3"), "ranks_per_node=3", "must divide world_size=4"),
    (("fault=node_loss", "world_size=4", "ranks_per_node=2", "fault.ranks_per_node=4"), "fault.ranks_per_node=4",
     "give ranks_per_node alone"),
    (("fault=kill", "fault.at_step=500", "steps=30"), "fault.at_step=500", "[0, 29]"),
    (("fault=kill", "fault.rank=5", "world_size=2"), "fault.rank=5", "[0, 1]"),
    (("checkpoint.every=-1",), "checkpoint.every=-1", ">= 1"),
    (("fault=kill", "fault.signal=SIGHUP"), "fault.signal=SIGHUP", "SIGKILL"),
    (("backend=nccl", "device=cpu"), "backend=nccl", "device=cuda"),
    (("strategy=sync", "supervisor.spares=1"), "supervisor.spares=1", "strategy=replica"),
    (("stratgy=sync",), "stratgy=sync", "did you mean strategy"),
    (("checkpoint.evry=3",), "checkpoint.evry=3", "checkpoint.every"),
    (("world_size=100000",), "world_size=100000", "supervisor.max_local_ranks"),
    (("checkpoint.dir=/etc/hostname",), "checkpoint.dir=/etc/hostname", "not a directory"),
    (("checkpoint.dir=/etc/hostname/ckpt",), "checkpoint.dir=/etc/hostname/ckpt", "is a file"),
    (("checkpoint.dir=/proc/ckpt",), "checkpoint.dir=/proc/ckpt", "not writable"),
    (("fault=ckpt_damage", "fault.how=melt"), "fault.how=melt", "garble_commit"),
    (("strategy=sync,async",), "strategy=sync,async", "needs --multirun"),
    (("-m", "strategy=sync,nope"), "strategy=nope", "allowed: "),
    (("-m", "strategy=sync,async", "steps=0"), "steps=0", ">= 1"),
    (("seed=${nope}",), "seed", "Interpolation key 'nope' not found"),
    (("strategy=nvrx_async", "strategy.patches=[x]"), "strategy.patches=[x]", "cuda_synchronize"),
    (("strategy=dcp_async", "strategy.executor=fork"), "strategy.executor=fork", "process"),
    (("strategy=torchsnapshot", "fault=slow_disk"), "fault=slow_disk", "not applicable to strategy=torchsnapshot"),
    (("strategy=dcp_async_process", "fault=slow_disk"), "fault=slow_disk", "not applicable to strategy=dcp_async"),
    (("detector=[nvrx_heartbeat]", "supervisor.launcher=external"), "supervisor.launcher=external",
     "nvrx_heartbeat runs part of itself"),
    (("strategy=replica", "supervisor.launcher=torchrun"), "supervisor.launcher=torchrun", "local supervisor"),
    (("strategy=dlrover_flash", "supervisor.launcher=torchrun"), "supervisor.launcher=torchrun",
     "supervisor.launcher=local"),
    (("supervisor.launcher=slurm",), "supervisor.launcher=slurm", "torchrun"),
    (("strategy=replica", "strategy.while_replacing=continue", "detector=[replica_fingerprint]"),
     "detector=replica_fingerprint", "does not keep"),
    (("strategy=replica_torchft", "detector=[process_exit,replica_fingerprint]"), "detector=replica_fingerprint",
     "does not keep"),
    (("supervisor.memory_sample_s=0",), "supervisor.memory_sample_s=0", "> 0"),
    (("strategy=dlrover_flash", "strategy.saver=node"), "strategy.saver=node", "agent, rank"),
    (("strategy=dlrover_flash", "supervisor.launcher=external"), "supervisor.launcher=external",
     "supervisor.launcher=local"),
    # Types and choices from the structured config (resilience/settings/schema.py), while Hydra composes; bounds after.
    (("steps=abc",), "steps=abc", "must be an integer >= 1"),
    (("steps=2.5",), "steps=2.5", "must be an integer >= 1"),
    (("seed=-1",), "seed=-1", "must be an integer >= 0"),
    (("device=gpu",), "device=gpu", "must be one of auto, cpu, cuda"),
    (("timeouts.collective_s=true",), "timeouts.collective_s=true", "must be a number > 0"),
    (("timeouts.ckpt_io_s=-5",), "timeouts.ckpt_io_s=-5", "must be a number > 0"),
    (("validity.max_steal=-0.1",), "validity.max_steal=-0.1", "must be a number >= 0"),
    (("checkpoint.keep=0",), "checkpoint.keep=0", "must be an integer >= 1"),
    (("steps=${seed}", "seed=abc"), "seed=abc", "must be an integer >= 0"),
    (("-m", "steps=10,abc"), "steps=abc", "must be an integer >= 1"),
    (("reference.check=maybe",), "reference.check=maybe", "must be one of auto, run, none"),
    # Found by trying the command as a new user would (issue "job resume", item 7): each trained, or failed late.
    (("+foo=1",), "+foo=1", "unknown setting"),
    (("+checkpoint.foo=1",), "+checkpoint.foo=1", "unknown setting"),
    (("world_size=1", "strategy=replica"), "world_size=1", "twin replica"),
    (("fault=bitflip", "fault.bit=99"), "fault.bit=99", "[0, 31]"),
    (("detector=[heartbeat,heartbeat]",), "detector=[heartbeat,heartbeat]", "more than once"),
    # the training loop (train=, docs/job_state.md)
    (("train=real", "train.clip_norm=0"), "train.clip_norm=0", "must be a number > 0"),
    (("train=real", "train.precision=fp32x"), "train.precision=fp32x", "fp32, bf16, fp16"),
    (("train=real", "recovery=shrink", "fault=node_loss", "ranks_per_node=1"), "recovery=shrink", "per-rank state"),
    (("workload=dlrm_emb", "train.precision=bf16"), "train.precision=bf16", "sparse embedding gradients"),
    (("workload=dlrm_emb", "train.clip_norm=1.0"), "train.clip_norm=1.0", "clip_grad_norm_ cannot norm"),
    (("strategy=sync_no_rng", "strategy.parts=[rngs]"), "strategy.parts=['rngs']", "must be all, or a list"),
    # several faults in one run (fault.at_step=[...]): tests/test_multi_fault.py runs them
    (("fault=kill", "fault.at_step=[7,13,22]", "fault.phase=[before_forward,during_checkpoint,before_optimizer_step]"),
     "fault.at_step=[7,13,22]",
     "checkpoint.every=5"),
    (("fault=kill", "fault.at_step=[5,12]", "fault.phase=during_checkpoint"), "fault.phase=during_checkpoint",
     "checkpoint.every=5"),
    (("fault=kill", "fault.at_step=[15,7]"), "fault.at_step=[15,7]", "strictly increasing"),
    (("fault=kill", "fault.at_step=[0,7]"), "fault.at_step=[0,7]", "integers >= 1"),
    (("fault=kill", "fault.at_step=[]"), "fault.at_step=[]", "non-empty list"),
    (("fault=kill", "fault.at_step=[7,30]", "steps=30"), "fault.at_step=[7,30]", "[1, 29]"),
    (("fault=kill", "fault.at_step=[7,15]", "fault.phase=[before_forward]"), "fault.phase=[before_forward]",
     "one per step"),
    (("fault=kill", "fault.at_step=7", "fault.phase=[before_forward,during_checkpoint]"),
     "fault.phase=[before_forward,during_checkpoint]", "needs a list of steps"),
    (("fault=kill", "fault.at_step=[7,15]", "fault.phase=[before_forward,mid_step]"),
     "fault.phase=[before_forward,mid_step]", "before_optimizer_step"),
    (("fault=kill", "fault.at_step=[7,15]", "fault.probability=0.2"), "fault.probability=0.2",
     "fault.probability=null"),
    (("fault=kill", "fault.signal=exception", "fault.at_step=[7,15]", "fault.phase=[before_forward,during_checkpoint]"),
     "fault.phase=during_checkpoint", "before_optimizer_step"),
    (("fault=hang", "fault.at_step=[7,15]"), "fault.at_step=[7,15]", "fault=kill and fault=node_loss"),
    (("fault=bitflip", "fault.at_step=[7,15]"), "fault.at_step=[7,15]", "give one integer"),
    (("fault=node_loss", "fault.at_step=[7,15]", "fault.return_after_s=5"), "fault.return_after_s=5",
     "fault.return_after_s=null"),
    (("strategy=none", "fault=kill", "fault.at_step=[7,15]", "fault.phase=[before_forward,during_checkpoint]"),
     "fault.phase=during_checkpoint", "never checkpoints"),
    (("checkpoint.every=auto",), "checkpoint.every=auto", "checkpoint.auto.mtbf_s or checkpoint.auto.mtbf_steps"),
    (("checkpoint.every=auto", "checkpoint.auto.mtbf_s=60", "fault=kill", "fault.phase=during_checkpoint"),
     "fault.phase=during_checkpoint", "needs a fixed checkpoint.every"),
    (("checkpoint.every=often",), "checkpoint.every=often", "must be an integer >= 1, or auto"),
    (("strategy=incremental", "workload=gpt_tiny"), "workload=gpt_tiny: strategy=incremental saves",
     "workload=dlrm_emb"),
]


@pytest.mark.parametrize("overrides,setting,allowed", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_one_clear_line(tmp_path, overrides, setting, allowed):
    """The command's whole validation, which runs before Hydra creates anything (in process: fast)."""
    argv = [*overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises((ConfigError, CommandLineError)) as info:
        check_group_choices(argv)
        precheck(argv)
    line = str(info.value)
    assert "\n" not in line and setting in line and allowed in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,setting", [(("stratgy=sync",), "did you mean strategy"),
                                               (("fault=kill", "fault.rank=5"), "fault.rank=5"),
                                               (("world_size=two",), "world_size=two: must be an integer >= 1")])
def test_the_command_prints_one_line_exits_2_and_creates_nothing(tmp_path, overrides, setting):
    done = run_cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}", timeout=100)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and setting in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_a_used_run_directory_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("{}\n")
    done = run_cli(f"hydra.run.dir={run_dir}", timeout=100)
    assert done.returncode == 2 and "already holds a run" in done.stderr
    assert (run_dir / "events.jsonl").read_text() == "{}\n"  # nothing lost


@pytest.mark.timeout(120)
def test_a_rejected_configuration_without_a_run_dir_creates_no_timestamped_one(tmp_path):
    done = run_module("resilience", "steps=0", timeout=100, cwd=tmp_path)
    assert done.returncode == 2 and not (tmp_path / "results").exists() and not (tmp_path / "outputs").exists()


PROJECTION_BAD = [
    (("scenario=nope",), "scenario=nope", "allowed: generic_100k"),
    (("monte_carlo.trialz=3",), "monte_carlo.trialz=3", "did you mean monte_carlo.trials"),
    (("monte_carlo.trials=0",), "monte_carlo.trials=0", ">= 1"),
]


@pytest.mark.parametrize("overrides,setting,allowed", PROJECTION_BAD, ids=[b[1] for b in PROJECTION_BAD])
def test_projection_bad_input_is_one_clear_line(tmp_path, overrides, setting, allowed):
    """The projection's validation before Hydra (its command prints the line, exit 2: test_projection.py)."""
    with pytest.raises((ProjectionConfigError, CommandLineError)) as info:
        projection_precheck([*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    line = str(info.value)
    assert "\n" not in line and setting in line and allowed in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(10)
def test_explaining_an_error_whose_contexts_loop_ends():
    """An error raised while handling another that holds it makes a loop of contexts (the matrix check met one and
    spun until its cell timed out)."""
    from resilience.settings.schema import explain

    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert explain(a) is None
