"""The in-memory strategy: shared-memory areas (commit protocol, double buffer, node wipe, cleanup) in process, and
real runs that recover from memory, from the peer copy, or from disk when both copies are gone -- bit-exact, with
no /dev/shm file left behind."""

from __future__ import annotations

import platform
import resource
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import run_experiment
from resilience.record.events import EventLog, read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState, state_sha256
from resilience.ckpt import node_memory, prefault, shm_store
from resilience.ckpt.digest import CURRENT
from resilience.strategies.inmemory import InMemoryCheckpoint
from resilience.ckpt.node_memory import NodeMemory
from resilience.ckpt.shm_store import Area
from resilience.workloads.gpt import GPTWorkload


def fill_with(value: int):
    def fill(buf: torch.Tensor) -> int:
        buf.fill_(value)
        running = CURRENT.new()
        running.update(memoryview(buf.numpy()))
        return running.value
    return fill


def read_back(area: Area, info) -> tuple[torch.Tensor, bool]:
    """The slot's data as a restarted rank reads it, and whether it matches its checksum."""
    dst, running = torch.empty(info.data_len, dtype=torch.uint8), CURRENT.new()
    area.read_into(info, 0, dst, running)
    return dst, running.value == info.checksum


# ---- areas ---------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_area_double_buffer_and_half_written_snapshot_never_used(tmp_path):
    area = Area.create(tmp_path / "area", 1 << 16)
    area.write(5, 0, 1000, b"meta5", fill_with(5))

    def crash():
        raise RuntimeError("killed before the commit word")

    with pytest.raises(RuntimeError):
        area.write(10, 0, 1000, b"meta10", fill_with(10), before_commit=crash)
    assert [s.step for s in area.slots()] == [5]  # the half-written step 10 is invisible; step 5 intact
    info = area.find(5)
    data, ok = read_back(area, info)
    assert ok and area.meta(info) == b"meta5" and bool((data == 5).all())
    area.write(15, 0, 1000, b"meta15", fill_with(15))  # goes into the uncommitted slot, keeping step 5
    assert [s.step for s in area.slots()] == [5, 15]
    area.write(20, 0, 1000, b"meta20", fill_with(20))  # overwrites the older one
    assert [s.step for s in area.slots()] == [15, 20]
    area.close()

    again = Area.open(tmp_path / "area")  # what a restarted process sees
    assert [s.step for s in again.slots()] == [15, 20]
    newest = again.find(20)
    view = again.view(shm_store.PAGE + newest.index * again.slot_cap + 7, 1)
    view.fill_(0)  # a flipped byte in the data
    del view
    assert not read_back(again, newest)[1] and read_back(again, again.find(15))[1]
    again._mm[shm_store.ALIGN * (1 + newest.index)] ^= 1  # a damaged header: the slot is not listed at all
    assert [s.step for s in again.slots()] == [15]
    assert again.invalidate_newer(10) == [15] and again.slots() == []
    again.close()


@pytest.mark.timeout(30)
def test_node_wipe_tombstone_and_cleanup(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_store, "SHM_DIR", tmp_path)
    rid = shm_store.run_id(tmp_path / "run")
    for node, holder, source in ((0, 0, 0), (0, 0, 1), (1, 1, 1), (1, 1, 0)):
        Area.create(shm_store.area_path(rid, node, holder, source), 4096).close()
    memory = NodeMemory(rid)
    wiped = memory.destroy(1)
    assert sorted(wiped) == [f"rbmem-{rid}-n1-r1-of0", f"rbmem-{rid}-n1-r1-of1"] and memory.lost(1)
    assert Area.open(shm_store.area_path(rid, 1, 1, 1)) is None
    assert Area.open(shm_store.area_path(rid, 0, 0, 1)) is not None  # the other node's memory is untouched
    memory.revive(1)
    assert not memory.lost(1)
    assert len(node_memory.cleanup(tmp_path / "run")) == 2 and list(tmp_path.glob("rbmem-*")) == []


def test_a_run_that_cannot_fit_in_shared_memory_is_refused_naming_the_shortfall(monkeypatch):
    wl = GPTWorkload(seed=0, vocab=64, d_model=32, n_layer=1, n_head=2, seq_len=16, batch_size=2)
    strategy = InMemoryCheckpoint(every=5, keep=2)
    strategy.check_host(wl, 2)  # a tiny model fits
    monkeypatch.setattr(shm_store, "free_bytes", lambda: 1000)
    with pytest.raises(ValueError, match=r"strategy=inmemory: its snapshots need about .* MB of .*short by"):
        strategy.check_host(wl, 2)


def test_under_sharding_the_room_asked_for_is_a_ranks_shards_not_the_whole_model(monkeypatch):
    """parallel=fsdp (Parallelism.shards): each rank snapshots its shard of each parameter (FSDP2's dim-0 chunk,
    the last padded), so the check asks for about 1/shards of the whole-model room and refuses only past that."""
    wl = GPTWorkload(seed=0, vocab=64, d_model=32, n_layer=1, n_head=2, seq_len=16, batch_size=2)
    with torch.device("meta"):
        whole = sum(p.numel() * p.element_size() for p in wl.build_model().parameters())
    strategy = InMemoryCheckpoint(every=5, keep=2)
    monkeypatch.setattr(shm_store, "free_bytes", lambda: 18 * whole)  # 2 ranks x 2 copies x 2 slots x 3 tensors
    with pytest.raises(ValueError, match=r"short by"):
        strategy.check_host(wl, 2)  # whole copies: 24x the parameters' bytes
    strategy.check_host(wl, 2, shards=2)  # half of each parameter (rounded up): about 12x
    from resilience.parallel.ddp import DataParallel
    from resilience.parallel.fsdp import FullyShardedParallel
    from resilience.parallel.hsdp import HybridShardedParallel

    assert [DataParallel().shards(4), FullyShardedParallel().shards(4), HybridShardedParallel(2).shards(4)] == [1, 4, 2]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"strategy.persist_every=0: must be an integer >= 1"):
        InMemoryCheckpoint(every=5, keep=2, persist_every=0)
    with pytest.raises(ValueError, match=r"strategy.ranks_per_node=3: must divide world_size=2"):
        InMemoryCheckpoint(every=5, keep=2, ranks_per_node=3, world_size=2)


# ---- the strategy in one process (a world of one rank) ------------------------------------------------------------
@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()
        node_memory.cleanup(tmp_path)


def trained_state(steps: int) -> TrainState:
    wl = GPTWorkload(seed=0, vocab=64, d_model=32, n_layer=1, n_head=2, seq_len=16, batch_size=2,
                     lr=1e-3, weight_decay=0.01)
    model = wl.build_model()
    state = TrainState(model, wl.build_optimizer(model))
    for step in range(steps):
        wl.loss(model, wl.batch(step, 0, torch.device("cpu"))).backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    return state


def attached(strategy, run_dir: Path, attempt: int):
    """``strategy`` attached to rank 0 of a world of one, in ``attempt``."""
    strategy.attach(RankRuntime(rank=0, world_size=1, device=torch.device("cpu"), run_dir=run_dir,
                                ckpt_dir=run_dir / "ckpt", events=EventLog(run_dir, 0, attempt)))
    return strategy


def strategy_on(run_dir: Path, attempt: int, **kw) -> InMemoryCheckpoint:
    return attached(InMemoryCheckpoint(every=1, keep=2, **kw), run_dir, attempt)


@pytest.mark.timeout(60)
def test_save_load_round_trip_through_memory_then_disk_after_a_wipe(one_rank):
    run_dir = one_rank
    state = trained_state(2)
    saver = strategy_on(run_dir, 0, persist_every=2)
    saver.save(2, 10, state)  # (2 // 1) % 2 == 0: also persisted to disk
    saver.save(3, 10, state)  # memory only
    expected = state_sha256(state.state_dict())
    saver.close()

    fresh = trained_state(0)  # a restarted rank: fresh model, fresh optimizer
    loader = strategy_on(run_dir, 1)
    assert loader.load(fresh) == 3
    assert state_sha256(fresh.state_dict()) == expected
    assert [s.step for s in loader.own.slots()] == [2, 3]  # the area reserved after the load is the same one
    assert loader.memory.rid == loader.node_memory(run_dir).rid  # the service node_loss receives: the same areas
    loader.close()
    loader.rt.events.close()

    loader.memory.destroy(0)  # the node is lost with its memory: only the disk copy of step 2 is left
    fresh = trained_state(0)
    again = strategy_on(run_dir, 2)
    assert again.load(fresh) == 2
    events = read_events(run_dir)
    loads = [(e["attempt"], e["source"], e["step"]) for e in events if e["kind"] == "ckpt_loaded"]
    assert loads == [(1, "memory", 3), (2, "disk", 2)]
    fallback = [e for e in events if e["kind"] == "ckpt_memory_fallback"]
    assert len(fallback) == 1 and "no snapshot in memory" in fallback[0]["reason"]
    again.close()
    for strategy in (saver, again):
        strategy.rt.events.close()


def test_a_new_tensor_for_a_load_has_its_pages_faulted_in_already():
    kernel = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    if prefault._MADVISE is None or kernel < (5, 14):
        pytest.skip("no MADV_POPULATE_WRITE (Linux 5.14+): the read faults the pages in, as before")
    t = prefault.new_tensor((1024, 2048), torch.float32)  # 8 MiB: 2048 pages
    assert t.shape == (1024, 2048) and t.dtype == torch.float32 and t.is_contiguous()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 64  # not one per page
    assert float(t.sum()) == 1024 * 2048


@pytest.mark.timeout(60)
def test_corrupt_snapshot_fails_its_checksum_and_disk_is_used(one_rank):
    run_dir = one_rank
    state = trained_state(2)
    saver = strategy_on(run_dir, 0, persist_every=2, verify=True)
    saver.save(2, 10, state)  # memory and disk
    saver.save(3, 10, state)  # memory only
    saver.wait()  # the snapshot's checksum and commit follow the stall
    expected = state_sha256(state.state_dict())
    info = saver.own.find(3)
    view = saver.own.view(shm_store.PAGE + info.index * saver.own.slot_cap + 100, 1)
    view.add_(1)  # one byte of step 3's data changes after its checksum was written
    del view
    saver.close()
    loader = strategy_on(run_dir, 1, verify=True)
    assert loader.load(trained_state(0)) == 2  # not step 3: the read is rejected, disk's step 2 restores all
    events = read_events(run_dir)
    assert [e["step"] for e in events if e["kind"] == "ckpt_memory_corrupt"] == [3]
    assert [e["source"] for e in events if e["kind"] == "ckpt_loaded"] == ["disk"]
    assert "checksum" in next(e["reason"] for e in events if e["kind"] == "ckpt_memory_fallback")
    area = Area.open(loader.own_path)
    assert [s.step for s in area.slots()] == [2]  # the bad one is gone for good
    area.close()
    fresh, again = trained_state(0), strategy_on(run_dir, 2)
    assert again.load(fresh) == 2 and state_sha256(fresh.state_dict()) == expected
    for strategy in (saver, loader, again):
        strategy.close()
        strategy.rt.events.close()


# ---- real runs ---------------------------------------------------------------------------------------------------
COMMON = ("workload=gpt_tiny", "strategy=inmemory", "steps=20", "checkpoint.every=2", "world_size=2", "seed=0",
          "detector=[process_exit]")


def no_segments_left(run_dir: Path) -> bool:
    return list(shm_store.SHM_DIR.glob(f"rbmem-{shm_store.run_id(run_dir)}*")) == []


def loads_of(run_dir: Path) -> dict[int, tuple[str, int]]:
    return {e["rank"]: (e["source"], e["step"]) for e in read_events(run_dir)
            if e["kind"] == "ckpt_loaded" and e["attempt"] > 0}


@pytest.fixture(scope="module")
def memory_reference(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("inmemory") / "reference"
    result = run_experiment(run_dir, *COMMON, "fault=none", timeout=120)
    assert result["status"] == "ok" and no_segments_left(run_dir)
    saved = [e for e in read_events(run_dir) if e["kind"] == "ckpt_memory_saved"]
    assert len(saved) == 2 * 9 and {e["peer_rank"] for e in saved} == {0, 1}  # steps 2..18, each with a peer copy
    return result


CASES = [  # (id, overrides, {rank: (source, step)}, memory fallback expected)
    ("kill", ("fault=kill", "fault.rank=1", "fault.at_step=13"), {0: ("memory", 12), 1: ("memory", 12)}, False),
    ("kill-mid-snapshot", ("fault=kill", "fault.rank=1", "fault.at_step=12", "fault.phase=during_checkpoint"),
     {0: ("memory", 10), 1: ("memory", 10)}, False),  # rank 1's step-12 slot is half-written: both load step 10
    ("node-loss-peer-copy", ("fault=node_loss", "fault.rank=1", "fault.at_step=13"),
     {0: ("memory", 12), 1: ("peer_memory", 12)}, False),
    ("whole-world-one-node", ("fault=node_loss", "ranks_per_node=2", "fault.rank=1", "fault.at_step=13",
                              "strategy.persist_every=4"), {0: ("disk", 8), 1: ("disk", 8)}, True),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("overrides,expected,fallback", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_recovery_source_and_bit_exact(tmp_path, memory_reference, overrides, expected, fallback):
    run_dir = tmp_path / "run"
    result = run_experiment(run_dir, *COMMON, *overrides, timeout=120)
    assert result["status"] == "ok" and result["recovered"]
    assert result["final_state_sha256"] == memory_reference["final_state_sha256"]
    assert loads_of(run_dir) == expected
    fallbacks = [e for e in read_events(run_dir) if e["kind"] == "ckpt_memory_fallback"]
    assert bool(fallbacks) == fallback
    assert no_segments_left(run_dir)


@pytest.mark.timeout(120)
def test_unrecovered_run_leaves_no_segment(tmp_path):
    run_dir = tmp_path / "run"
    result = run_experiment(run_dir, *COMMON[:2], "steps=8", "checkpoint.every=2", "world_size=2", "seed=0",
                            "fault=kill", "fault.rank=1", "fault.at_step=5", "recovery=fail", timeout=100)
    assert result["status"] == "unrecovered"
    assert any(e["kind"] == "ckpt_memory_saved" for e in read_events(run_dir))  # there were segments to remove
    assert no_segments_left(run_dir)


@pytest.mark.timeout(60)
def test_only_the_copy_is_inside_the_stall_the_checksum_and_commit_follow_it(one_rank, monkeypatch):
    import threading

    release = threading.Event()
    real = Area.checksum

    def held(self, *args, **kwargs):
        assert release.wait(30), "the test never released the checksum"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Area, "checksum", held)
    saver = strategy_on(one_rank, 0, persist_every=1000)
    saver.save(2, 10, trained_state(2))  # returns: the stall is over
    assert saver.own.slots() == []  # the slot is written but neither summed nor committed yet
    assert [e["kind"] for e in read_events(one_rank)][-1] == "ckpt_stall_end"
    release.set()
    saver.wait()
    assert [s.step for s in saver.own.slots()] == [2] and saver.own.find(2).checksum is not None
    saver.close()
    saver.rt.events.close()
