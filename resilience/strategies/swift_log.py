"""Swift's logging-based recovery of a pipeline (Zhong et al., TPDS 2024): only the lost stage restarts.

Every stage saves as ``sync`` does, and keeps a ``BoundaryLog`` of what it sends its neighbours at every step (the
activations forward, the input gradients back: ``parallel/logged_stage.py``), dropped once a later checkpoint is
committed. When a stage's rank dies the replacing supervisor (``caps.recovers_in_place``) starts a replacement for
that rank alone. The surviving stage, freed from its receive by the broken connection, drops its partial step and
waits for the replacement in the next generation's group (``resilience.rank.group``). There every rank says where it
stands (``Standing``, gathered; ``plan`` decides the same on every rank): a survivor at the last step it applied, the
replacement at the checkpoint it loaded by itself (its own stage's files, no collective). Each survivor next to the
replacement sends it its log of the steps between (``stage_replay.send_entries``), the replacement replays them
alone (``StageReplay``: the same schedule, the receives filled from the logs), and every rank goes on from the
survivors' step. The survivors load nothing and step back nothing.

Bit-exact with the fault-free run: the replayed stage computes from the bytes that crossed, re-seeded per (seed,
step, rank) as the replayable loop does, in the same micro-batch order, and with ``train.clip_norm`` clips by every
stage's norm as logged, its own checked against the one it had (docs/pipeline_parallel.md).

A failure during the recovery (the replacement dies in its replay, the survivor before it has sent its log) opens
the next generation and the recovery starts again there: the checkpoint and the logs it replays from are not
consumed. When every stage restarted (no survivor), each loads the newest checkpoint, which is a restart of all.
What cannot be replayed exactly (a survivor's log that does not reach back to the checkpoint loaded, stages at
different steps, two neighbours lost while others live) is refused in one line (``ReplayRefused``: the run ends).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resilience.caps import StrategyCaps
from resilience.ckpt.replica_transfer import NothingToRecover
from resilience.parallel.boundary_log import BACKWARD, FORWARD, KINDS, BoundaryLog, sends_logged
from resilience.runtime.pipeline import StepRunner
from resilience.runtime.rank import REPLAY_PHASE
from resilience.settings.checks import require_int, require_number
from resilience.state.train import TrainState
from resilience.strategies.sync import SyncCheckpoint
from resilience.workloads.base import stream_seed


SPILL_DIR = "boundary_log"  # in the run directory: each rank's spilled log entries, one directory per process


class ReplayRefused(NothingToRecover):
    """The lost stage cannot be brought to the survivors' step exactly: every rank ends, saying why in one line."""


@dataclass(frozen=True)
class Standing:
    """Where a rank stands when the group re-forms: a survivor (``kept``) at position ``at``, its log holding every
    step from ``logs_from`` to ``at - 1``; or a replacement at the checkpoint it loaded (``at``; 0: none)."""

    kept: bool
    at: int
    logs_from: int


@dataclass(frozen=True)
class Plan:
    """What the ranks do, the same on each: ``replays`` each replacement's first step to replay (to ``position``),
    ``transfers`` the logs sent, ``(from, to, kind)``, in the order every rank takes them (none waits on another)."""

    position: int
    replays: dict[int, int]
    transfers: list[tuple[int, int, str]]


def plan(standings: list[Standing]) -> Plan:
    """The recovery, from every stage's standing (stage ``s`` is rank ``s``); ``ReplayRefused`` where it would not be
    exact."""
    stages = len(standings)
    kept = [r for r, s in enumerate(standings) if s.kept]
    lost = [r for r, s in enumerate(standings) if not s.kept]
    if not kept:  # every stage restarted: each loaded the newest checkpoint, as a restart of all does
        loaded = sorted({s.at for s in standings})
        if len(loaded) > 1:
            raise ReplayRefused(f"swift_log: the restarted stages loaded the checkpoints of different steps {loaded} "
                                f"(one failed its check on some stage)")
        return Plan(loaded[0], {}, [])
    at = sorted({standings[r].at for r in kept})
    if len(at) > 1:
        raise ReplayRefused(f"swift_log: the surviving stages stopped at different steps {at}, and a survivor does not "
                            f"step back")
    position, transfers = at[0], []
    for r in lost:
        start = standings[r].at
        if start > position:
            raise ReplayRefused(f"swift_log: stage {r} loaded the checkpoint of step {start}, past the survivors' step "
                                f"{position}")
        for n, kind in ((r - 1, FORWARD), (r + 1, BACKWARD)):  # what the neighbour sent stage r
            if not 0 <= n < stages:
                continue
            if n in lost:
                raise ReplayRefused(f"swift_log: stages {min(r, n)} and {max(r, n)} were lost together while others "
                                    f"live: the boundary between them is in neither's log (no group replay yet)")
            if standings[n].logs_from > start:
                raise ReplayRefused(f"swift_log: stage {n}'s log begins at step {standings[n].logs_from}, after the "
                                    f"checkpoint stage {r} loaded (step {start}): the steps between are in no log")
            transfers.append((n, r, kind))
    return Plan(position, {r: standings[r].at for r in lost}, transfers)


class SwiftLog(SyncCheckpoint):
    # saves per stage as sync does; recovers in place: the supervisor replaces the lost rank alone
    caps = StrategyCaps(family="stage log replay", writes_through_checkpoint_fs=True, saves_stages=True,
                        recovers_in_place=True, replays_stage=True)

    def __init__(self, every: int, keep: int, budget_bytes: int | None = None,
                 replace_timeout_s: float = 120.0, log_every: int = 1) -> None:
        super().__init__(every, keep)
        # selective logging: boundary b is logged when b % log_every == 0 (boundary_log.sends_logged); on 2 stages
        # log_every=2 logs nothing, and a lost stage's group is the whole pipeline: every stage steps back in place
        self.log_every = require_int("strategy.log_every", log_every, 1)
        # the log's memory, the rest spilled to the run directory (None: all in memory)
        self.budget_bytes = None if budget_bytes is None else require_int("strategy.budget_bytes", budget_bytes, 0)
        self.replace_timeout_s = require_number("strategy.replace_timeout_s", replace_timeout_s, above=0)
        self.log: BoundaryLog | None = None
        self._runner: Any = None  # the pipeline's runner (``PipelineRunner``)
        self._kept_from = 0  # this rank's log holds every step from here to its position
        self._replayed: Standing | None = None  # a replacement that replayed: where it stands now

    @classmethod
    def clean_up_run(cls, run_dir: Path) -> None:
        """The spill files of every stage's log (``budget_bytes``), a killed rank's too: they serve this run only."""
        shutil.rmtree(run_dir / SPILL_DIR, ignore_errors=True)

    def attach_runner(self, runner: StepRunner | None) -> None:
        from resilience.parallel.pp_runner import PipelineRunner

        if not isinstance(runner, PipelineRunner):  # the table refuses it before launch (a_stage_to_replay)
            raise ValueError("strategy=swift_log: logs a pipeline stage's sends; use parallel=pp")
        rt, layout = self.rt, runner.layout
        spill = None if self.budget_bytes is None else rt.run_dir / SPILL_DIR / f"rank{rt.rank}-attempt{rt.attempt}"
        self.log = BoundaryLog(sends_logged(layout.stage, layout.stages, self.log_every), self.budget_bytes, spill)
        self._runner = runner
        runner.log = self.log
        runner.reset()  # a logging stage from the first step

    def _save(self, step: int, state: TrainState) -> None:
        super()._save(step, state)
        # once the checkpoint is committed the entries before it serve no replay: rank 0 committed it, or not
        committed = torch.tensor([int(self.rt.rank == 0 and self._committed(step))], dtype=torch.int64)
        dist.broadcast(committed, src=0)
        if committed.item():
            assert self.log is not None
            dropped = self.log.discard_before(step)
            self._kept_from = step
            self.rt.events.emit("log_discarded", step=step, dropped=dropped, **self.log.stats())

    def _committed(self, step: int) -> bool:
        return any(e.step == step and e.committed for e in self.dirs.entries())

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        if self.rt.attempt == 0:  # every stage starts together: the newest checkpoint (a new run: none)
            return super()._load(state)
        t0 = time.monotonic()  # a replacement: its own stage's checkpoint, then the replay
        while True:
            try:
                return self._replace(state, t0)
            except ReplayRefused:
                raise
            except RuntimeError as exc:  # another rank lost while this one recovered: again, in the next generation
                self._next_generation(exc)

    def recover(self, state: TrainState, position: int, error: BaseException) -> int:
        """A surviving stage: drop the step cut short, wait for the replacement, send it the log, go on from
        ``position`` (the last step this stage applied), its state and log kept."""
        rt, t0 = self.rt, time.monotonic()
        rt.events.emit("peer_lost", step=position, error=f"{type(error).__name__}: {error}"[:300], fsync=True)
        state.optimizer.zero_grad(set_to_none=True)  # the cut step's partial gradients
        while True:
            self._next_generation(error)
            try:
                mine = Standing(True, position, self._kept_from) if self.log.kinds else self._step_back(state, t0)
                return self._meet(state, mine, t0)[0]
            except ReplayRefused:
                raise
            except RuntimeError as exc:  # lost again while recovering (the replacement in its replay, say)
                error = exc

    def _step_back(self, state: TrainState, t0: float) -> Standing:
        """A survivor whose stage logs nothing (selective logging, ``log_every``): no neighbour can be replayed from
        it, so it stands as the replacement does, at the newest checkpoint loaded in place (its process and its
        memory kept), and the pipeline trains the steps since again: Swift's group restart, here of every stage."""
        start, nbytes = self._load_own(state)
        if start == 0:  # the state of step 0 is the seed's, which this rank no longer holds
            raise ReplayRefused(f"swift_log: strategy.log_every={self.log_every} logs none of stage "
                                f"{self._runner.layout.stage}'s sends and no checkpoint was committed to step back to")
        self._kept_from = start
        self.rt.events.emit("stage_loaded", step=start, bytes=nbytes, duration_s=time.monotonic() - t0)
        return Standing(False, start, start)

    def _next_generation(self, error: BaseException) -> None:
        """Form the next generation's group (re-raises ``error`` when none opens) and the stage over it."""
        try:
            generation = self.rt.group.rejoin(error, self.replace_timeout_s)
        except TimeoutError as exc:
            raise RuntimeError(f"swift_log: {exc} (strategy.replace_timeout_s={self.replace_timeout_s:g}); this rank "
                               f"gives up") from error
        self.rt.events.attempt = generation
        self._runner.reset()  # the schedule's runtime state and its group's ops: the broken group's

    def _replace(self, state: TrainState, t0: float) -> tuple[int, str, int] | None:
        """A replacement, in its generation's group: its checkpoint, alone (unless it already replayed), then the
        recovery with the others."""
        if self._replayed is not None:  # replayed, then lost a peer before all were back: a survivor now
            position, _, _ = self._meet(state, self._replayed, t0)
            return position, "log replay", 0
        start, nbytes = self._load_own(state)
        t_loaded = time.monotonic()
        self.rt.events.emit("stage_loaded", step=start, bytes=nbytes, duration_s=t_loaded - t0)
        position, source, received = self._meet(state, Standing(False, start, start), t_loaded)
        if position == 0:
            return None  # every stage restarted, and no checkpoint: the state built from the seed
        return position, source, nbytes + received

    def _load_own(self, state: TrainState) -> tuple[int, int]:
        """The newest committed checkpoint whose files this stage reads pass their checksums, loaded into this
        stage by this rank alone: its step and the bytes read ((0, 0): none, the state as built from the seed)."""
        from resilience.ckpt import dcp_files
        from resilience.ckpt.verified import CorruptFile

        for entry in reversed([e for e in self.dirs.entries() if e.committed and e.step not in self._rejected]):
            reason = self.dirs.check(entry, checksums=False)
            sd = state.state_dict(self.parts)
            if reason is None:
                try:
                    buffers = self.read_own(entry, sd, self.dirs.manifest(entry))
                except (OSError, KeyError, ValueError) as exc:
                    reason = str(exc) if isinstance(exc, CorruptFile) else f"{type(exc).__name__}: {exc}"[:300]
            if reason is not None:
                self._reject(entry, reason)
                continue
            nbytes = sum(len(b) for b in buffers.values())
            self.rt.events.emit("ckpt_read_verified", step=entry.step, files=len(buffers),
                                of_files=len(self.dirs.manifest(entry)["files"]), bytes=nbytes)
            dcp_files.load(sd, entry.path, buffers, alone=True)
            state.load_state_dict(sd)
            return entry.step, nbytes
        return 0, 0

    def _meet(self, state: TrainState, mine: Standing, t0: float) -> tuple[int, str, int]:
        """Collective, in the re-formed group: agree (``plan``), send and receive the logs, replay, wait for every
        replay to end. The position to go on from, where the state came from, the bytes of log received."""
        rt = self.rt
        gathered: list[Any] = [None] * rt.world_size
        dist.all_gather_object(gathered, asdict(mine))
        chosen = plan([Standing(**s) for s in gathered])
        source = "disk" if not mine.kept else "kept"
        received, sent = self._exchange(chosen)
        got = sum(received.bytes_by_step.values())
        if not mine.kept:
            self._kept_from = chosen.replays.get(rt.rank, chosen.position)  # the log is rebuilt from there
        if rt.rank in chosen.replays:
            start = chosen.replays[rt.rank]
            done = self._replay(state, received, range(start, chosen.position))  # logs this stage's sends again
            self._replayed = Standing(True, chosen.position, start)
            source = f"disk:{start}+log_replay"
            rt.events.emit("stage_replayed", step=chosen.position, from_step=start, steps=len(done.steps),
                           duration_s=done.duration_s, received_bytes=got,
                           sources=sorted(s for s, d, _ in chosen.transfers if d == rt.rank))
        dist.barrier()  # the survivors go on once every replay has ended
        rt.events.emit("stage_rejoined", step=chosen.position, generation=rt.group.generation,
                       replaced=sorted(chosen.replays), kept=mine.kept, sent_bytes=sent,
                       duration_s=time.monotonic() - t0)
        self._replayed = None
        if rt.rank == 0:
            print(f"[rank 0 attempt {rt.group.generation}] stage(s) {sorted(chosen.replays)} back at step "
                  f"{chosen.position}" + (" (replayed from the neighbours' logs)" if chosen.transfers else ""),
                  flush=True)
        return chosen.position, source, got

    def _exchange(self, chosen: Plan) -> tuple[BoundaryLog, int]:
        """The plan's transfers, each rank its part, in the plan's order: the log entries, then from the first
        neighbour of each replacement the stages' gradient norms of those steps (``train.clip_norm``). What this
        rank received, and the bytes of entries it sent."""
        from resilience.parallel.stage_replay import receive_entries, receive_norms, send_entries, send_norms

        rank, received, sent = self.rt.rank, BoundaryLog(KINDS), 0
        for src, dst, kind in chosen.transfers:
            steps = range(chosen.replays[dst], chosen.position)
            if rank == src:
                sent += send_entries(self.log, kind, steps, dst, None)
            elif rank == dst:
                receive_entries(received, src, None)
        for dst, start in sorted(chosen.replays.items()):
            src = next((s for s, d, _ in chosen.transfers if d == dst), None)
            if rank == src:
                send_norms(self.log, range(start, chosen.position), dst, None)
            elif rank == dst and src is not None:
                receive_norms(received, src, None)
        return received, sent

    def _clip_as_logged(self, state: TrainState, received: BoundaryLog, t: int) -> None:
        """``train.clip_norm`` in a replay: the clip by every stage's norm at step ``t`` as the neighbour logged them,
        this stage's own recomputed and checked against the one it had in training (a replay that is not exact
        stops here)."""
        stage = self._runner.layout.stage
        if t not in received.norms:
            raise ReplayRefused(f"swift_log: no stage norms logged for step {t}, which train.clip_norm clips by")
        params = list(state.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        own = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not torch.equal(own.cpu(), received.norms[t][stage]):
            raise ReplayRefused(f"swift_log: stage {stage}'s gradient norm replayed at step {t} is not the one it had "
                                f"in training: the replay is not exact")
        norms = [n.to(own.device) for n in received.norms[t].unbind()]
        assert self.log is not None and received.max_norm is not None
        self.log.record_norms(norms, received.max_norm)  # for a later replay of a neighbour
        torch.nn.utils.clip_grads_with_norm_(params, received.max_norm, torch.nn.utils.get_total_norm(norms))

    def _replay(self, state: TrainState, received: BoundaryLog, steps: range) -> Any:
        """This stage's steps ``steps`` alone, fed from ``received``, as the replayable loop trains them."""
        from resilience.parallel.stage_replay import StageReplay

        r, rt = self._runner, self.rt
        replay = StageReplay(r.module, r.layout, r.workload, r.device, r.n, r.schedule_name, received, self.log)

        def batch(t: int) -> tuple[torch.Tensor, ...]:  # the recipe's: re-seeded per (seed, step, rank)
            torch.manual_seed(stream_seed(r.workload.seed, t, rt.rank, "rng"))
            return r.workload.batch(t, r.layout.replica, r.device)

        def commit(t: int) -> None:  # the recipe's clip, then the plain step's (runtime.step.StepControl)
            rt.fault_hook(REPLAY_PHASE, t)
            if received.max_norm is not None:
                self._clip_as_logged(state, received, t)
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)

        return replay.run(steps, batch, commit)
