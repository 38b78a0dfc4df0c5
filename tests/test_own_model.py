"""Benchmark your own model (docs/own_model.md): a Hugging Face causal LM built from its config, and a plain
``nn.Module`` from a folder outside the project, each killed and recovered on 2 ranks bit for bit through one YAML,
and the user's model in a small pipeline matrix."""

from __future__ import annotations

import sys
import textwrap
import time
from importlib.util import find_spec
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import run_experiment, run_module

from reports.limits import PROBE_DIR
from reports.matrix import load_matrix
from resilience.record.reference import NOT_DETERMINISTIC, judge, said
from resilience.workloads.module import ModuleWorkload

MODEL = '''
    import torch
    from torch import nn


    class TinyLM(nn.Module):
        """Embedding, a causal depthwise convolution over the last 3 tokens, an MLP, the head."""

        def __init__(self, vocab: int, dim: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.conv = nn.Conv1d(dim, dim, kernel_size=3, groups=dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.head = nn.Linear(dim, vocab)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx).transpose(1, 2)
            x = self.conv(nn.functional.pad(x, (2, 0))).transpose(1, 2)  # left padding: causal
            return self.head(x + self.mlp(x))


    class StridedWindows(torch.utils.data.Dataset):
        """The user's own dataset: item i is the window at offset 7 * i * seq_len of the token file, with its id."""

        def __init__(self, path: str, seq_len: int, samples: int) -> None:
            self.data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8)
            self.seq_len, self.samples = seq_len, samples

        def __len__(self) -> int:
            return self.samples

        def __getitem__(self, i: int):
            start = (7 * i * self.seq_len) % (len(self.data) - self.seq_len - 1)
            window = self.data[start:start + self.seq_len + 1].long()
            return torch.tensor(i), window[:-1], window[1:]
    '''


def user_model(tmp_path: Path) -> tuple[Path, Path]:
    """``my_model.TinyLM`` in ``tmp_path/models`` and its one YAML in ``tmp_path/conf/workload/tiny_lm.yaml``."""
    models, conf = tmp_path / "models", tmp_path / "conf"
    models.mkdir()
    (models / "my_model.py").write_text(textwrap.dedent(MODEL))
    (conf / "workload").mkdir(parents=True)
    (conf / "workload" / "tiny_lm.yaml").write_text(textwrap.dedent(f"""\
        _target_: resilience.workloads.module.ModuleWorkload
        _recursive_: false
        python_path: {models}
        vocab: 256
        seq_len: 32
        batch_size: 8
        model:
          _target_: my_model.TinyLM
          vocab: ${{..vocab}}
          dim: 32
        scheduler:
          _target_: torch.optim.lr_scheduler.StepLR
          step_size: 3
          gamma: 0.5
        dataset:
          _target_: my_model.StridedWindows
        """))
    return models, conf


KILL = ("strategy=sync", "fault=kill", "fault.at_step=8", "steps=10", "checkpoint.every=3", "world_size=2",
        "seed=0", "detector=[process_exit]", "reference.check=run")


def recovered_bit_exact(result: dict) -> None:
    assert result["status"] == "ok" and result["recovered"] and result["attempts"] == 2, result.get("error")
    assert result["reference"]["matches"] is True, result["reference"]


def test_a_hugging_face_causal_lm_recovers_bit_exact(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed: "
                                               "pip install -c workflow/envs/constraints.txt -e '.[hf]'")
    started = time.monotonic()
    recovered_bit_exact(run_experiment(tmp_path / "run", "workload=hf_causal_lm", *KILL))
    print(f"hf_causal_lm, killed and checked (its reference run included): {time.monotonic() - started:.0f} s")


def test_a_module_from_a_folder_outside_the_project_recovers_bit_exact(tmp_path):
    _, conf = user_model(tmp_path)
    started = time.monotonic()
    # the real loop: the user's dataset through the loader, the user's LR scheduler; each a part that must come back
    result = run_experiment(tmp_path / "run", "workload=tiny_lm", f"hydra.searchpath=[file://{conf}]", *KILL,
                            "train=real", "train.lr_schedule=constant")
    recovered_bit_exact(result)
    assert result["workload"] == "tiny_lm"
    assert {p for p, v in result["state_parts"].items() if v["exact"]} >= {"lr_scheduler", "dataloader", "rng"}
    assert result["ledger"]["exactly_once"] is True
    print(f"tiny_lm, killed and checked (its reference run included): {time.monotonic() - started:.0f} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_own_models_run_in_a_pipeline_matrix(tmp_path):
    """The user's module (its options found through the matrix's searchpath) and, where the hf extra is installed,
    the Hugging Face model: a reference and a recovered kill each."""
    _, conf = user_model(tmp_path)
    workloads = ["tiny_lm"] + (["hf_causal_lm"] if find_spec("transformers") else [])
    matrix = tmp_path / "own.yaml"
    matrix.write_text("searchpath: [conf]\n"  # relative to the matrix file
                      f"axes:\n  workload: [{', '.join(workloads)}]\n  strategy: [sync]\n"
                      "  fault: [none, {name: kill, at_step: 8}]\n  detectors: [[process_exit]]\n"
                      "  checkpoint.every: [3]\n  seed: [0]\n  world_size: [2]\n  steps: [10]\n"
                      "reference: {strategy: sync}\n")
    assert len(load_matrix(str(matrix), check=True).cells) == 2 * len(workloads)  # the Snakefile's check passes
    results = tmp_path / "results"
    snapshot = results / PROBE_DIR / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # reused: no probe
    snapshot.mkdir(parents=True)
    (snapshot / "limits.json").write_text('{"probed": false, "reason": "a test"}')
    (snapshot / "environment.json").write_text("{}")
    started = time.monotonic()
    done = run_module("snakemake", "--until", "aggregate", "--config", f"matrix={matrix}", f"results={results}",
                      "probe_max_age_h=1", timeout=270, merge_stderr=True)
    assert done.returncode == 0, done.stdout[-5000:]
    summary = pd.read_csv(results / "summary.csv")
    assert set(summary["state"]) <= {"ok", "noisy"}, summary[["cell", "state", "error"]]
    assert sorted(summary["workload"]) == sorted(workloads * 2) and summary["matches_reference"].all()
    assert summary["recovered"].sum() == len(workloads)
    print(f"pipeline, {len(summary)} cells ({', '.join(workloads)}): {time.monotonic() - started:.0f} s")


@pytest.fixture
def own_sys_path(monkeypatch):
    """What the in-process tests put on sys.path and import leaves with them."""
    monkeypatch.setattr("sys.path", list(sys.path))
    yield
    sys.modules.pop("my_model", None)


def test_the_model_is_built_under_the_private_seed_from_the_named_folder(tmp_path, own_sys_path):
    models, _ = user_model(tmp_path)
    spec = {"_target_": "my_model.TinyLM", "vocab": 256, "dim": 8}
    workload = ModuleWorkload(0, model=spec, python_path=str(models), seq_len=16, batch_size=2)
    before = torch.get_rng_state()
    first, second = workload.build_model(), workload.build_model()
    assert torch.equal(torch.get_rng_state(), before)  # the run's global generator is untouched
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert workload.loss(first, workload.batch(0, 0, torch.device("cpu"))).ndim == 0


@pytest.mark.parametrize(("settings", "expected"), [
    ({"python_path": "models"}, "workload.python_path=models: must be an absolute path (e.g. $PWD/models)"),
    ({"python_path": "/no/such/folder"}, "workload.python_path=/no/such/folder: no such folder"),
    ({"model": {"vocab": 256}}, "workload.model={'vocab': 256}: must be a mapping with _target_ (a class or "
                                "function to call)"),
])
def test_a_bad_setting_is_one_line_naming_it(settings, expected):
    with pytest.raises(ValueError) as info:
        ModuleWorkload(0, **{"model": {"_target_": "my_model.TinyLM"}, **settings})
    assert str(info.value) == expected


def test_a_model_that_cannot_be_imported_or_returns_the_wrong_shape_says_so_in_one_line(tmp_path, own_sys_path):
    missing = ModuleWorkload(0, model={"_target_": "not_there.TinyLM"}, python_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"^workload\.model\._target_=not_there\.TinyLM: cannot be imported \(.*"
                                         rf"workload\.python_path=\['{tmp_path}'\]\)$"):
        missing.build_model()
    wrong = ModuleWorkload(0, model={"_target_": "torch.nn.Embedding", "num_embeddings": 256, "embedding_dim": 4},
                           seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match=r"^workload\.model: forward returned \(2, 8, 4\); must be logits of shape "
                                         r"\(2, 8, >= workload\.vocab=256\)$"):
        wrong.loss(wrong.build_model(), wrong.batch(0, 0, torch.device("cpu")))


def test_a_model_that_is_not_deterministic_is_reported_as_such_never_as_a_strategys_fault(tmp_path):
    """Two fault-free runs that differ: the second says why, and a later recovered run is not judged (a NO would
    blame its strategy for the model's own noise)."""
    from test_reference import config, result

    cfg = config(tmp_path)
    judge(cfg, tmp_path / "ref", result("none", "none", "a" * 64), [])
    again = judge(cfg, tmp_path / "ref2", result("none", "none", "c" * 64), [])
    assert again["matches"] is False and said(again).endswith(": " + NOT_DETERMINISTIC)
    later = judge(cfg, tmp_path / "k", result("sync", "kill", "a" * 64), [])
    assert later["matches"] is None and said(later) == (
        f"  ended on the fault-free reference's state: not checked ({NOT_DETERMINISTIC} ({tmp_path / 'ref'} and "
        f"{tmp_path / 'ref2'}); no run of it is judged)")
