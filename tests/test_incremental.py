"""Check-N-Run's incremental and quantized checkpoints (strategy=incremental|quantized, resilience/ckpt/increments.py).

In process, on one gloo rank and a small dlrm_emb: a chain restores its newest link (or an older one, under a
rollback bound) bit for bit; an increment holds exactly the rows the steps since the previous link touched; a failed
save keeps its rows for the next; a missing, corrupt or garbled link makes the load fall back to the newest complete
chain; quantized rows come back within their bounds, the rest exactly. The table of rules refuses both strategies on
a model without embedding tables. End to end, two ranks killed after several increments recover bit-exact against
the fault-free reference, and a quantized recovery is reported as not bit-exact by design.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from conftest import run_experiment
from resilience import compat
from resilience.ckpt.commit import COMMIT_MARKER
from resilience.ckpt.increments import LINK_META, dequantize, quantize, rows_file
from resilience.record.events import EventLog, read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState, state_sha256
from resilience.strategies.incremental import IncrementalCheckpoint
from resilience.strategies.quantized import QuantizedCheckpoint
from resilience.workloads.dlrm import DLRMWorkload
from test_inmemory import one_rank  # noqa: F401 - a fixture: one gloo rank, no peers

CPU = torch.device("cpu")


def small() -> DLRMWorkload:
    return DLRMWorkload(seed=0, tables=3, rows=3000, dim=8, hidden=16, batch_size=64)


def fresh(wl: DLRMWorkload) -> TrainState:
    model = wl.build_model()
    return TrainState(model, wl.build_optimizer(model))


def native(state: TrainState) -> str:
    """Model and optimizer as they are (``TrainState.state_dict`` would step a fresh optimizer)."""
    return state_sha256({"model": state.model.state_dict(), "optim": state.optimizer.state_dict()})


def on_rank(strategy, run_dir: Path, attempt: int, **runtime):
    strategy.attach(RankRuntime(rank=0, world_size=1, device=CPU, run_dir=run_dir, ckpt_dir=run_dir / "ckpt",
                                events=EventLog(run_dir, 0, attempt), **runtime))
    return strategy


def done(strategy) -> None:
    strategy.close()
    strategy.rt.events.close()


def step(state: TrainState, wl: DLRMWorkload, n: int, touched: list[set[int]] | None = None) -> None:
    """One optimizer step on batch ``n``; ``touched`` gathers the rows each table's gradient names."""
    wl.loss(state.model, wl.batch(n, 0, CPU)).backward()
    if touched is not None:
        for rows, emb in zip(touched, state.model.emb):
            rows |= set(emb.weight.grad.coalesce().indices()[0].tolist())
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == kind]


def chain_run(run_dir: Path, wl: DLRMWorkload, saves: range, cls=IncrementalCheckpoint, **kw) -> dict[int, str]:
    """Train, saving at each step of ``saves`` (every 2 steps, a base every 3 links); the state's hash at each."""
    state = fresh(wl)
    saver = on_rank(cls(every=2, keep=kw.pop("keep", 3), base_every=3, **kw), run_dir, 0)
    assert saver.load(state) == 0
    hashes = {}
    for n in range(1, saves.stop):
        step(state, wl, n)
        if n in saves:
            saver.save(n, 100, state)
            hashes[n] = native(state)
    done(saver)
    return hashes


def load_fresh(run_dir: Path, wl: DLRMWorkload, attempt: int, cls=IncrementalCheckpoint, **runtime):
    state = fresh(wl)
    loader = on_rank(cls(every=2, keep=3, base_every=3), run_dir, attempt, **runtime)
    try:
        return loader.load(state), native(state), state
    finally:
        done(loader)


@pytest.mark.timeout(120)
def test_a_chain_restores_its_newest_link_bit_for_bit_and_holds_only_the_touched_rows(one_rank):
    run_dir, wl = one_rank, small()
    state = fresh(wl)
    saver = on_rank(IncrementalCheckpoint(every=2, keep=3, base_every=3), run_dir, 0)
    assert saver.load(state) == 0
    touched = [set() for _ in state.model.emb]
    hashes, expected_rows = {}, {}
    for n in range(1, 11):
        step(state, wl, n, touched)
        if n % 2 == 0:
            before = native(state)
            saver.save(n, 100, state)
            assert native(state) == before  # a save changes nothing in the live state
            hashes[n], expected_rows[n] = before, sum(len(t) for t in touched)
            touched = [set() for _ in state.model.emb]
    done(saver)

    durable = {e["step"]: e for e in events_of(run_dir, "ckpt_durable")}
    assert [durable[s]["link"] for s in (2, 4, 6, 8, 10)] == ["base", "increment", "increment", "base", "increment"]
    assert durable[2]["rows"] == durable[8]["rows"] == 3 * 3000  # a base: every row
    for s in (4, 6, 10):  # an increment: exactly the rows the steps since the previous link touched
        assert durable[s]["rows"] == expected_rows[s] and 0 < expected_rows[s] < 3 * 3000
        assert durable[s]["bytes"] < durable[2]["bytes"] / 2

    loaded, digest, _ = load_fresh(run_dir, wl, 1)
    assert loaded == 10 and digest == hashes[10]  # the base of step 8, then the increment of step 10
    loaded, digest, _ = load_fresh(run_dir, wl, 2, load_max_step=7)  # a rollback bound: base 2, increments 4, 6
    assert loaded == 6 and digest == hashes[6]
    assert [e["links"] for e in events_of(run_dir, "ckpt_read_verified")] == [2, 3]


def damage(run_dir: Path, step: int, how: str) -> None:
    path = run_dir / "ckpt" / f"step_{step:08d}"
    if how == "flip":  # a bit in the middle of the link's rank-0 rows
        victim = path / rows_file(0)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        victim.write_bytes(bytes(raw))
    elif how == "delete_metadata":
        (path / LINK_META).unlink()
    elif how == "garble_commit":
        victim = path / COMMIT_MARKER
        victim.write_bytes(victim.read_bytes()[:20])
    elif how == "delete_link":
        shutil.rmtree(path)


# (the link damaged, how, the rollback bound, the step loaded, the steps rejected), of the links 2 (base), 4, 6,
# 8 (base), 10
BROKEN = [
    (10, "flip", None, 8, [10]),  # the newest increment corrupt: its base alone
    (8, "flip", None, 6, [8, 10]),  # the newest chain's base corrupt: the older chain, whole
    (8, "delete_link", None, 6, [10]),  # its base gone: the increment after it cannot load
    (10, "garble_commit", None, 8, [10]),
    (4, "delete_metadata", 7, 2, [6, 4]),  # a middle link broken: every link after it in its chain is passed over
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damaged,how,bound,loaded,rejected", BROKEN, ids=[f"{d}-{h}" for d, h, *_ in BROKEN])
def test_a_broken_link_falls_back_to_the_newest_complete_chain(one_rank, damaged, how, bound, loaded, rejected):
    run_dir, wl = one_rank, small()
    hashes = chain_run(run_dir, wl, range(2, 11, 2))
    damage(run_dir, damaged, how)
    step_loaded, digest, _ = load_fresh(run_dir, wl, 1, load_max_step=bound)
    assert step_loaded == loaded and digest == hashes[loaded]
    assert [e["step"] for e in events_of(run_dir, "ckpt_rejected")] == rejected


@pytest.mark.timeout(120)
def test_every_link_broken_starts_afresh_with_the_state_untouched(one_rank):
    run_dir, wl = one_rank, small()
    chain_run(run_dir, wl, range(2, 7, 2), keep=1)
    damage(run_dir, 2, "flip")  # the base of the only chain kept
    state = fresh(wl)
    before = native(state)
    loader = on_rank(IncrementalCheckpoint(every=2, keep=1, base_every=3), run_dir, 1)
    assert loader.load(state) == 0 and native(state) == before
    done(loader)
    assert sorted(e["step"] for e in events_of(run_dir, "ckpt_rejected")) == [2, 4, 6]


class FullDisk(FileSystem):
    """DCP's file system, whose writes fail with ENOSPC while ``full``."""

    full = False

    @contextmanager
    def create_stream(self, path, mode):
        if self.full and "w" in mode:
            raise OSError(28, "No space left on device")
        with super().create_stream(path, mode) as stream:
            yield stream


@pytest.mark.timeout(120)
def test_a_failed_save_keeps_its_rows_for_the_next_link(one_rank):
    run_dir, wl = one_rank, small()
    disk = FullDisk()
    state = fresh(wl)
    saver = on_rank(IncrementalCheckpoint(every=2, keep=3, base_every=4), run_dir, 0, ckpt_fs=disk)
    assert saver.load(state) == 0
    touched = [set() for _ in state.model.emb]
    for n in range(1, 7):
        step(state, wl, n, touched)
        if n == 2:
            saver.save(n, 100, state)
            touched = [set() for _ in state.model.emb]
        if n == 4:
            disk.full = True
            saver.save(n, 100, state)
            disk.full = False
    saver.save(6, 100, state)
    done(saver)
    assert [e["step"] for e in events_of(run_dir, "ckpt_failed")] == [4]
    durable = {e["step"]: e for e in events_of(run_dir, "ckpt_durable")}
    assert sorted(durable) == [2, 6] and durable[6]["link"] == "increment"
    assert durable[6]["rows"] == sum(len(t) for t in touched)  # the rows of steps 3-6, not only 5-6
    loaded, digest, _ = load_fresh(run_dir, wl, 1)
    assert loaded == 6 and digest == native(state)


def test_quantized_rows_come_back_within_their_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 32, generator=g) * torch.logspace(-4, 2, 500)[:, None]
    x[0] = 0.25  # a constant row
    x[1, 7] = -3e4  # an outlier widens its row's scale only
    codec, parts = quantize(x, 8)
    assert codec == "q8" and sum(t.numel() * t.element_size() for t in parts.values()) == 500 * 32 + 500 * 8
    back = dequantize(codec, parts, torch.float32)
    lo, hi = x.amin(1), x.amax(1)
    bound = (hi - lo) / 255 / 2 + 2 ** -22 * torch.maximum(lo.abs(), hi.abs())
    err = (back - x).abs()
    assert (err <= bound[:, None]).all()
    assert err.max() > 0 and torch.equal(back[0], x[0])
    assert err[2:].amax(1).gt(0).float().mean() > 0.9  # not a copy: nearly every row is approximated

    codec, parts = quantize(x, 16)
    back = dequantize(codec, parts, torch.float32)
    assert codec == "f16" and parts["values"].dtype == torch.float16
    assert ((back - x).abs() <= 2 ** -11 * x.abs() + 2 ** -25).all()
    assert torch.equal(dequantize(*quantize(x, None), torch.float32), x)
    with pytest.raises(ValueError, match="bits=4"):
        quantize(x, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bits", [8, 16])
def test_a_quantized_chain_approximates_the_tables_and_restores_everything_else_exactly(one_rank, bits):
    run_dir, wl = one_rank, small()
    state = fresh(wl)
    saver = on_rank(QuantizedCheckpoint(every=2, keep=3, base_every=3, bits=bits), run_dir, 0)
    assert saver.load(state) == 0
    for n in range(1, 7):
        step(state, wl, n)
        if n % 2 == 0:
            before = native(state)
            saver.save(n, 100, state)
            assert native(state) == before  # a quantized save changes nothing in the live state
    done(saver)
    durable = {e["step"]: e for e in events_of(run_dir, "ckpt_durable")}
    (run_dir / "plain").mkdir()
    chain_run(run_dir / "plain", wl, range(2, 7, 2))
    plain = {e["step"]: e for e in events_of(run_dir / "plain", "ckpt_durable")}
    assert durable[2]["bytes"] < plain[2]["bytes"] * (0.8 if bits == 8 else 0.9)  # the tables' values in fewer bits

    loaded, digest, restored = load_fresh(run_dir, wl, 1, cls=QuantizedCheckpoint)
    assert loaded == 6 and digest != before
    for got, want in zip(restored.model.emb, state.model.emb):
        w, r = want.weight.detach(), got.weight.detach()
        if bits == 8:
            bound = (w.amax(1) - w.amin(1)) / 255 / 2 + 2 ** -22 * w.abs().amax(1)
            assert ((r - w).abs() <= bound[:, None]).all()
        else:
            assert ((r - w).abs() <= 2 ** -11 * w.abs() + 2 ** -25).all()
        assert torch.equal(restored.optimizer.state[got.weight]["sum"], state.optimizer.state[want.weight]["sum"])
    for (name, got), want in zip(restored.model.named_parameters(), state.model.parameters()):
        if not name.startswith("emb."):
            assert torch.equal(got, want), name
    inexact = events_of(run_dir, "ckpt_loaded_inexact")
    assert [e["step"] for e in inexact] == [6] and "strategy=quantized" in inexact[0]["why"]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="strategy.base_every=0"):
        IncrementalCheckpoint(every=2, keep=1, base_every=0)
    with pytest.raises(ValueError, match="strategy.bits=4: must be one of 8, 16"):
        QuantizedCheckpoint(every=2, keep=1, bits=4)


@pytest.mark.parametrize("strategy", ["incremental", "quantized"])
def test_the_table_refuses_a_model_without_embedding_tables(strategy):
    options = compat.options("strategy")
    assert options[strategy].caps.saves_touched_rows
    assert (options[strategy].caps.inexact_restore is not None) == (strategy == "quantized")
    workloads = compat.options("workload")
    for name, option in workloads.items():
        c = compat.defaults().choosing(workloads[name]).choosing(options[strategy])
        line = compat.refusal(c)
        if option.caps.sparse_gradients:
            assert line is None, line
        else:
            assert line.startswith(f"workload={name}: strategy={strategy} saves") and "\n" not in line
            assert "embedding table" in line and "workload=dlrm_emb" in line


# Two ranks, small tables: a base at 3, increments at 6, 9, 12, the kill at 14 (a base would come at 15)
E2E = ("workload=dlrm_emb", "workload.rows=4000", "workload.tables=4", "steps=20", "checkpoint.every=3",
       "strategy.base_every=4", "world_size=2", "seed=0", "detector=[process_exit]", "timeouts.collective_s=20",
       "fault=kill", "fault.rank=1", "fault.at_step=14")


@pytest.mark.timeout(400)
def test_two_ranks_killed_after_several_increments_recover_bit_exact_and_quantized_by_design_not(tmp_path):
    hit = run_experiment(tmp_path / "incremental", "strategy=incremental", *E2E, "reference.check=run",
                         timeout=300)
    assert hit["status"] == "ok" and hit["recovered"] and hit["lost_steps"] == 2
    assert hit["reference"]["matches"] is True  # against the fault-free run (strategy=none), bit for bit
    loaded = [e for e in events_of(tmp_path / "incremental", "ckpt_read_verified") if e["rank"] == 0]
    assert [(e["step"], e["links"]) for e in loaded] == [(12, 4)]  # the base and three increments replayed
    links = [e["link"] for e in events_of(tmp_path / "incremental", "ckpt_durable") if e["attempt"] == 0]
    assert links == ["base", "increment", "increment", "increment"]

    q = run_experiment(tmp_path / "quantized", "strategy=quantized", *E2E, "reference.check=auto", timeout=300)
    assert q["status"] == "ok" and q["recovered"] and q["lost_steps"] == 2
    assert q["bit_exact"].startswith("not by design: strategy=quantized")
    assert q["reference"]["matches"] is None and q["reference"]["why"].startswith("not by design")
    assert q["final_state_sha256"] != hit["final_state_sha256"]


def test_the_convergence_bench_spreads_its_kills_each_after_a_checkpoint():
    from resilience.bench.convergence_gap import kill_steps

    assert kill_steps(1, 60, 5) == [32]
    ten = kill_steps(10, 60, 5)
    assert len(ten) == 10 and ten == sorted(set(ten)) and all(k % 5 == 2 for k in ten) and ten[-1] < 60
    assert kill_steps(3, 20, 3) == [4, 10, 19]
    with pytest.raises(ValueError, match="--restores 10: the run has 6 checkpoints"):
        kill_steps(10, 20, 3)
