"""DLRover Flash Checkpoint (``dlrover.trainer.torch.flash_checkpoint.ddp.DdpCheckpointer``) as a strategy.

Every checkpoint goes to shared memory (``StorageType.MEMORY``, a copy by the node's first rank into a segment that
a saver process holds); every ``persist_every``-th one also to disk (``StorageType.DISK``: the saver writes the
segment to ``step_<n>/rank_0.pt`` in the background and records the step in ``dlrover_latest.txt``).

Sharded state (``parallel=fsdp|hsdp``): DLRover's FSDP engine, which we call ourselves because its wrapper calls
FSDP1 APIs (``dlrover_sharded.py``): every rank copies its own shards into a segment of its own, the saver writes
each as ``step_<n>/__<rank>_0.distcp`` beside rank 0's DCP ``.metadata``; the fingerprint is per rank. The engine
is chosen by the first load, which sees the state (attach does not).

Where the saver lives (``strategy.saver``): ``agent`` (the default) hosts it in the supervisor process, started and
reset exactly as ``dlrover-run``'s agent does (``ElasticTrainingAgent._invoke_run`` and ``_restart_workers``, DLRover
0.6.1), so the shared memory outlives the ranks and a restarted rank loads from it; ``rank`` leaves it to the
library, which then starts it as a child of the node's first rank (how DLRover runs without ``dlrover-run``): it
dies with that rank, and recovery reads the newest disk checkpoint. Either way the saver's class comes from the
ranks: the engine of local rank 0 sends it (``DdpCheckpointSaver``, or ``FsdpDcpSaver`` with one shard per local
rank) through the factory queue that ``AsyncCheckpointSaver.start_async_saving_ckpt`` serves.

Load: the library's own ``load_checkpoint`` (sharded: the engine's ``load``), which prefers the shared-memory copy
when one survived the crash (on every rank, at the same step) and reads the newest disk checkpoint otherwise. Both
are verified here as every load is: the disk checkpoint by our commit record (sizes, checksums, this run's identity)
before the library reads it; the loaded state by the CRC32 fingerprint taken of the same state when it was saved
(``fingerprints.json`` in the checkpoint directory; its time is in the stall and reported as ``fingerprint_s`` of
``ckpt_stall_end``). A state that does not match is rejected and the disk checkpoint loaded instead.

Workarounds (``strategy.patches``), each declared only where it matters: ``clone_loaded_state`` (DDP): a state
loaded from shared memory holds tensors that alias the library's segment (seen on torch 2.13, DLRover 0.6.1),
which the next memory save overwrites in place; the patch copies what was loaded. ``saver_by_forkserver``
(``saver=rank``). Sharded: ``rank_in_shard_config`` (``dlrover_sharded.py``), ``unsharded_on_rank0`` and
``twin_shards_apart`` (HSDP; ``dlrover_layout.py``). ``patches=none`` runs the library as shipped.

Leftovers scoped to the run (``TORCHELASTIC_RUN_ID``, recorded in ``dlrover_run_id``): the shared-memory segments
``/dev/shm/<run id>_*`` and the socket directory ``<tmp>/ckpt_sock/<run id>``; ``clean_up_run`` removes them, and
the supervisor kills the saver process once the run ends (``resilience.proc.orphans``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resilience.settings.checks import require_int
from resilience.ckpt.snapshot import is_sharded
from resilience.record.fsio import atomic_write_json
from resilience.record.torch_workarounds import declare
from resilience.runtime.rank import NodeMemory, RankRuntime
from resilience.state.train import TrainState, map_tensors, state_crc32, tensor_bytes
from resilience.strategies.background import BackgroundCheckpoint
from resilience.libs.dlrover_agent import AGENT_ROLE, POLL_S, AgentSaver
from resilience.libs.dlrover_layout import RANK0, RANK_IN_CONFIG, TWINS, has_twins
from resilience.libs.peer import Patch, PeerLibrary, PeerStrategy
from resilience.libs.worker_notice import start_outliving_notice
from resilience.workloads.base import Workload

RUN_ID_FILE = "dlrover_run_id"
FINGERPRINTS = "fingerprints.json"  # in the checkpoint directory: {step: CRC32 of the saved state}
FINGERPRINTS_KEPT = 8
TRACKER = "dlrover_latest.txt"
SAVERS = ("agent", "rank")
CLONE = "clone_loaded_state"
SHARDED_API = "FsdpCheckpointEngine (the engine; its wrapper FsdpShardCheckpointer calls FSDP1 APIs)"

def _saver_in_rank() -> bool:
    """The library starts its saver from the rank (no agent holds one: DLRover's engine looks at ``ROLE_NAME``)."""
    return os.environ.get("ROLE_NAME") != AGENT_ROLE


def _saver_by_forkserver() -> None:
    """The saver process is started from a copy of the rank's own Python (``fork``); forked from a rank whose
    threads (the heartbeat, the event log, gloo) may hold a lock at that moment, it can hang before serving its
    sockets. Started by ``forkserver`` it begins from a clean interpreter."""
    import multiprocessing

    import dlrover.trainer.torch.flash_checkpoint.engine as engine

    engine.Process = multiprocessing.get_context("forkserver").Process


def _saver_outlives_notice() -> None:
    import dlrover.trainer.torch.flash_checkpoint.engine as engine

    start_outliving_notice(engine, "start_async_save")


PATCHES = (
    Patch("saver_outlives_notice", "(saver=rank) a preemption's SIGTERM reaches the saver process the rank starts, "
          "which dies of it before a save on the notice is written; with its rank SIGKILLed it outlives the job",
          _saver_in_rank, _saver_outlives_notice,
          declare("dlrover_saver_target", "engine.start_async_save, the target of the saver process a rank starts, "
                  "is started through one that ignores SIGTERM and ends with its rank (libs/worker_notice.py)",
                  ("0.6.1",), __name__, package="dlrover")),
    Patch("clone_loaded_state", "a state loaded from shared memory aliases the library's segment, which the next "
          "memory save overwrites", lambda: True, lambda: None),
    Patch("saver_by_forkserver", "the saver process forked from a multi-threaded rank can hang before it serves its "
          "sockets (the rank waits 60 s and fails)", _saver_in_rank, _saver_by_forkserver),
    # Sharded state (dlrover_sharded.py, dlrover_layout.py): what we hand the FSDP engine, applied in our code.
    Patch(RANK_IN_CONFIG, "the FSDP engine records rank 0 for every shard, so the saver's commit never sees W done "
          "files and blocks for save_timeout", lambda: True, lambda: None),
    Patch(RANK0, "the FSDP engine's memory reader takes unsharded values from rank 0's copy, and DCP writes each on "
          "the least loaded rank: only rank 0 hands them over", lambda: True, lambda: None),
    Patch(TWINS, "HSDP: DCP writes a shard held in every replica group once, and each rank reads its own segment: "
          "each group's shards under keys of its own", lambda: True, lambda: None),
)
ONLY_FOR = {CLONE: "whole", RANK_IN_CONFIG: "sharded", RANK0: "sharded", TWINS: "twins"}  # where a patch matters
ENGINE_INTERNALS = declare(
    "dlrover_engine_internals", "the checkpointer's public API neither says where a load came from nor wipes a "
    "node's memory copy: its private _engine (get_state_dict_from_memory, close) and the engine's _shm_handler "
    "(dlrover_sharded.py too) do", ("0.6.1",), __name__, package="dlrover")


class DlroverFlashCheckpoint(PeerStrategy, BackgroundCheckpoint):

    library = PeerLibrary("dlrover.trainer.torch.flash_checkpoint.ddp", "dlrover", extra="dlrover")
    known_patches = PATCHES
    # Sharded state through DLRover's FSDP engine (dlrover_sharded.py), loaded from its own memory copy (not
    # resharded); with saver=agent the saver lives in the supervisor (its memory survives a rank restart).
    caps = replace(BackgroundCheckpoint.caps, family="in-memory", writes_through_checkpoint_fs=False,
                   shards_state=True, reshards_on_load=False, runs_in_supervisor=True,
                   when={"saver=rank": {"runs_in_supervisor": False}})

    def __init__(self, every: int, keep: int, persist_every: int = 2, timeout_s: float = 60.0,
                 patches: str | list[str] = "all", saver: str = "agent") -> None:
        super().__init__(every, keep, "wait", timeout_s)
        self.persist_every = require_int("strategy.persist_every", persist_every, 1)
        if saver not in SAVERS:
            raise ValueError(f"strategy.saver={saver}: allowed: {', '.join(SAVERS)}")
        self.saver = saver
        self.caps = self.caps.under(saver=saver)
        self.choose_patches(patches)
        self._fingerprints: dict[str, int] = {}

    def check_host(self, workload: Workload, world_size: int, shards: int = 1) -> None:
        super().check_host(workload, world_size, shards)
        ENGINE_INTERNALS.check()  # before launch, in one line, on a DLRover it was not checked on

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.library.load()
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if rt.rank == 0 and run_id and run_id not in _run_ids(rt.run_dir):
            # one line per job: a job that resumes the run has an id of its own, and the dead job's segments are
            # this run's to remove too (clean_up_run)
            with (rt.run_dir / RUN_ID_FILE).open("a") as f:
                f.write(run_id + "\n")
        self.checkpointer = self.sharded = None  # opened by the first load, which sees the state
        self._fingerprints = _read_fingerprints(rt.ckpt_dir)

    def load(self, state: TrainState) -> int:
        """Open DLRover's engine for the state it will hold (a sharded model: its FSDP engine), then load."""
        if self.checkpointer is None and self.sharded is None:
            self._open(state)
        return super().load(state)

    def _open(self, state: TrainState) -> None:
        lib = self.library.load()
        params = list(state.model.parameters())
        sharded = any(is_sharded(p) for p in params)
        # Declared where they matter: a sharded load copies into tensors of ours (nothing aliases the segment).
        kinds = {"whole": not sharded, "sharded": sharded, "twins": has_twins(params)}
        self.patches = [p for p in self.patches if kinds.get(ONLY_FOR.get(p.name), True)]
        self.applied = self.applied_patches()
        settings = {"persist_every": self.persist_every,
                    "saver": "supervisor, as dlrover-run's agent" if self.saver == "agent" else "rank's child process"}
        if sharded:
            settings["api"] = SHARDED_API
        self.declare(self.applied, **settings)
        self.storage_type = lib.StorageType
        ENGINE_INTERNALS.acted(self.rt.events)  # loads, node-loss wipes and close go through them from here
        if sharded:
            # imported where used: the supervisor's start (it builds this class) does not pay DCP's ~0.4 s
            from resilience.libs.dlrover_sharded import ShardedFlash

            self.sharded = ShardedFlash(self.rt.ckpt_dir, self.timeout_s, {p.name for p in self.applied})
        else:
            self.checkpointer = lib.DdpCheckpointer(str(self.rt.ckpt_dir), comm_backend="gloo")

    def _path(self, step: int) -> Path:
        return self.dirs.path_for(step) / "rank_0.pt"

    def _save(self, step: int, state: TrainState) -> None:
        self._reap()
        persist = self.on_notice or (step // self.every) % self.persist_every == 0  # the memory copy dies with the job
        if persist:
            self.wait()  # one disk write at a time, inside the stall (as ``when_busy=wait``)
            if self.rt.rank == 0 and self.sharded:
                self.sharded.clear(self.dirs.path_for(step))
            elif self.rt.rank == 0:
                self.dirs.prepare(step)
            dist.barrier()
        sd = {**state.state_dict(), "step": step}
        kind = self.storage_type.DISK if persist else self.storage_type.MEMORY
        t0 = time.monotonic()
        if self.sharded:  # every rank copies its shards into its own segment
            copied = {"copied": self.sharded.save(step, sd, self.dirs.path_for(step), persist)}
        else:
            self.checkpointer.save_checkpoint(step, sd, str(self._path(step)), storage_type=kind)
            copied = {}
        if self.rt.rank == 0:  # the node's first rank copies into the segment (DLRover may skip a busy one)
            self.rt.events.emit("ckpt_memory_saved", step=step, duration_s=time.monotonic() - t0, **copied)
        if not persist:  # the memory copy is made, our record of it not yet: the middle of this save
            self.rt.fault_hook("during_checkpoint", step)
        t0 = time.monotonic()
        # What a load of this step must reproduce: the state (DDP: every rank holds the same), or each rank's shards.
        fingerprint = self.sharded.fingerprint(sd) if self.sharded else state_crc32(sd) if self.rt.rank == 0 else None
        if self.rt.rank == 0:
            self._fingerprints = {**self._fingerprints, str(step): fingerprint}
            self._fingerprints = dict(list(self._fingerprints.items())[-FINGERPRINTS_KEPT:])
            atomic_write_json(self.rt.ckpt_dir / FINGERPRINTS, self._fingerprints)
        dist.barrier()  # the fingerprint is on disk before any rank goes on (and may die)
        # Ends the stall before the persist is handed on, with the fingerprint's cost and whether it persists.
        self.end_stall(step, fingerprint_s=time.monotonic() - t0, persist=persist)
        if persist:
            self._pending = self._persist(step)

    def _persist(self, step: int) -> Future:
        tracker, deadline = self.rt.ckpt_dir / TRACKER, time.monotonic() + self.timeout_s

        def written() -> None:  # DLRover's saver records the step once the file is on disk
            while not self._persisted(step, _tracked_step(tracker)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"DLRover's saver did not persist step {step} in {self.timeout_s} s")
                time.sleep(POLL_S)
            if self.sharded and self.rt.rank == 0:
                self.sharded.check_written(self.dirs.path_for(step))

        return self._commit_when_written(step, written)

    def _persisted(self, step: int, tracked: int | None) -> bool:
        return self.sharded.persisted(step, tracked) if self.sharded else tracked == step

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        if self.sharded:
            return self._load_shards(state)
        entry = self.agreed_entry()  # the newest disk checkpoint that passes our commit record's check
        step, sd = self._from_memory()
        source = "memory"
        if sd and (entry is not None and step < entry.step or not self._verified(step, sd)):
            sd = {}
        if not sd:
            if entry is None:
                return None
            sd, source = self.checkpointer.load_checkpoint(resume_path=str(self._path(entry.step))), "disk"
            if not self._verified(entry.step, sd):
                raise RuntimeError(f"step {entry.step}: DLRover loaded a state that differs from the one saved")
        elif any(p.name == CLONE for p in self.applied):
            sd = map_tensors(torch.Tensor.clone, sd)  # clone_loaded_state
        step = int(sd.pop("step"))
        state.load_state_dict(sd)
        return step, source, self.dirs.size(entry) if source == "disk" else tensor_bytes(sd)

    def _load_shards(self, state: TrainState) -> tuple[int, str, int] | None:
        """As ``_load``, each rank its own shards: the memory copy where every rank holds it and every rank's
        passes its fingerprint, else the newest committed disk checkpoint (each verified the same way)."""
        flash, entry = self.sharded, self.agreed_entry()
        if entry is None and not flash.memory_held():
            return None  # nothing to load: the fresh state stays untouched
        loaded = flash.load(state, entry.path if entry else self.rt.ckpt_dir / "no-committed-checkpoint")
        if loaded is None:
            return None
        source, sd = loaded
        if source == "memory" and (entry is not None and sd["step"] < entry.step
                                   or not self._verified(int(sd["step"]), sd)):
            if entry is None:  # nothing else to load (the base ``load`` puts the fresh state back)
                return None
            sd, source = flash.load_disk(state, entry.path), "disk"
        if source == "disk" and not self._verified(entry.step, sd):
            raise RuntimeError(f"step {entry.step}: DLRover loaded shards that differ from the ones saved")
        step = int(sd.pop("step"))
        nbytes = self.dirs.size(entry) if source == "disk" else flash.loaded_bytes(sd)
        state.load_state_dict(sd)
        return step, source, nbytes

    def _from_memory(self) -> tuple[int, dict]:
        """What the library's ``load_checkpoint`` takes first: the shared-memory copy, if one survived (its
        engine's own method, so that the source is known; every rank calls it, as the load does)."""
        step, held = self.checkpointer._engine.get_state_dict_from_memory()
        if not held:
            return 0, {}
        return step, next(iter(held.values()))  # keyed by the path it was saved for, as load_checkpoint unwraps

    def _verified(self, step: int, sd: dict[str, Any]) -> bool:
        """The state reproduces the fingerprint taken when ``step`` was saved, and lies within a rollback bound;
        otherwise the rejection is recorded."""
        bound = self.rt.load_max_step
        expected = _read_fingerprints(self.rt.ckpt_dir).get(str(step))
        reason = None
        if bound is not None and step > bound:
            reason = f"newer than the rollback bound (step {bound})"
        elif expected is None:
            reason = "no fingerprint was recorded for this step"
        elif not (self.sharded.matches(expected, sd) if self.sharded else state_crc32(sd) == expected):
            reason = "the loaded state differs from its fingerprint"
        if self.sharded and not self.sharded.agree(reason is None) and reason is None:
            reason = "another rank's shards differ from their fingerprint"  # all load the same copy, or none
        if reason is not None:
            self.rt.events.emit("ckpt_rejected", step=step, path="dlrover", reason=reason, fsync=True)
        return reason is None

    def node_memory(self, run_dir: Path) -> NodeMemory:
        """What node_loss wipes. DLRover keeps one copy per host; the simulated nodes of this host share it, and a
        real node's loss takes that node's copy: its replacement starts with none, DLRover's step check across the
        ranks then fails and every rank loads from disk. The victim leaves what a replacement would find: empty
        metadata and no segment. Sharded, each rank has a segment of its own and each victim wipes its own: the
        lost node's shards are then on disk only (FSDP holds each once; under HSDP their twins are in the other
        replica group's segments, which DLRover's reader does not read), and the same step check sends every rank
        to disk."""
        return _NodeCopy(self)

    def _forget_memory(self) -> None:
        # DDP: this node's shard 0, every local rank's; sharded: this rank's own segment (each victim wipes its own)
        handler = self.sharded.memory if self.sharded else self.checkpointer._engine._shm_handler
        handler.metadata.set({})
        if handler.shared_memory is None:
            handler.init_shared_memory(create=False)
        if handler.shared_memory is not None:
            handler.shared_memory.unlink()

    def agent_service(self) -> AgentSaver | None:
        return AgentSaver(self.timeout_s) if self.saver == "agent" else None

    @classmethod
    def clean_up_run(cls, run_dir: Path) -> None:
        for run_id in _run_ids(run_dir):
            for seg in Path("/dev/shm").glob(f"{run_id}_*"):
                seg.unlink(missing_ok=True)
            shutil.rmtree(Path(tempfile.gettempdir()) / "ckpt_sock" / run_id, ignore_errors=True)

    def close(self) -> None:
        super().close()
        if self.checkpointer is not None:
            self.checkpointer._engine.close()
        if self.sharded is not None:
            self.sharded.close()


def _run_ids(run_dir: Path) -> list[str]:
    """The DLRover run ids of the run's jobs (the agent's TORCHELASTIC_RUN_ID names its segments and sockets)."""
    path = run_dir / RUN_ID_FILE
    return [line.strip() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class _NodeCopy:
    def __init__(self, strategy: DlroverFlashCheckpoint) -> None:
        self.strategy = strategy

    def destroy(self, node: int) -> None:
        self.strategy._forget_memory()


def _read_fingerprints(ckpt_dir: Path) -> dict[str, int]:
    try:
        return json.loads((ckpt_dir / FINGERPRINTS).read_text())
    except (OSError, ValueError):
        return {}


def _tracked_step(tracker: Path) -> int | None:
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None
