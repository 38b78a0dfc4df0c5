"""Just-in-time checkpointing after Gupta et al., "Just-In-Time Checkpointing: Low Cost Error Recovery from Deep
Learning Training Failures" (EuroSys'24): no periodic checkpoint; the state is written when a failure is detected.

**At a failure.** A rank's death, a hang made a death by the heartbeat, or a collective timeout surfaces in every
surviving rank as a failed collective (the training loop hands the error to ``recover``). Model and optimizer are
then still the state after the last completed optimizer step: the step in flight failed in its gradient reduction,
before its optimizer step, and its partial gradients are simply not applied. Data-parallel replicas are identical by
construction, so the survivor writes its own replica at once (``jit_files``: one shard file, each tensor streamed
from its memory, summed as written), without a collective (the group is broken), and commits it with this project's
commit record (``commit.CheckpointDir``: files, sizes, checksums, the run's identity) before it re-raises the error
and ends. Under HSDP a survivor holds one shard, which every replica group holds too: each survivor writes its own
shard, and whoever completes the set of shards commits it. Several survivors with the same shard at the same step:
the first to claim it writes it, the others wait for it (and write it themselves if it does not come). Survivors one
step apart (an all-reduce that completed on some ranks and not on others) each write their own step; the restart
loads the newest complete one. Each rank loads its own shard back: the world keeps its size and shape.

**The time to write.** The launcher stops the survivors with SIGTERM, then SIGKILL after its grace period
(``timeouts.shutdown_s``, which ``strategy.grace_s`` follows): the same grace ``checkpoint.on_notice`` saves in. A
rank of this strategy holds SIGTERM (``TermGrace``): while it writes, the signal waits for the write; before it
writes, it waits up to ``strategy.failure_wait_s`` for its own collective to fail (a dead peer's sockets close within
milliseconds; the step's compute before its next collective bounds it), and ends at once if a state at least as new
as its own is already committed (the hung rank of a collective timeout, whose peer wrote before exiting). A signal
is noted by a watching thread, not a Python handler, since the main thread may sit in a collective.

**The whole job's state.** Job-wide parts (LR schedule, scaler, counters) are the same on every replica and go into
the file. A rank's own parts (its RNG streams, its data loader's position: ``train=real``) are on no replica, so
every rank keeps them in its node's shared memory, with a copy on the next node (``jit_files.RankParts``), as they
stand at the boundary of the step it trains (before each step, and again after the step's last forward pass: by
then the step has drawn its random numbers and its batches, so that is the state at the next boundary, which a
survivor one step ahead writes). A restarted rank takes its own parts at the loaded step from there; a rank whose
parts are in no memory any more (its node and the next one lost) starts them over, recorded (``jit_parts_lost``).

**No healthy replica.** When every rank died at once (``world_size=1``, a node loss of the whole world, a lost job),
nobody writes: the restart says so (``jit_no_replica``: the step the failed attempt reached, the step it goes on
from, the steps lost) and goes on from the newest state written at an earlier failure, or from the start. It never
waits for a replica that is gone: every wait above is bounded.

Steady state: nothing but a per-step write of a few KB of per-rank parts to shared memory, and only where the loop has
such parts (``train=real``); ``python -m resilience.bench.jit_overhead`` measures it against ``strategy=none``.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from resilience.caps import StrategyCaps
from resilience.ckpt import node_memory, shm_store
from resilience.ckpt.checksum import SIDECAR_PREFIX
from resilience.ckpt.codec import restore, snapshot_state, tensor_leaves
from resilience.ckpt.commit import COMMIT_MARKER, CheckpointDir, CheckpointEntry
from resilience.ckpt.digest import for_record
from resilience.ckpt.jit_files import RankParts, read_shard, shard_name, write_shard
from resilience.ckpt.node_memory import NodeMemory
from resilience.ckpt.snapshot import is_sharded, local_part
from resilience.ckpt.verified import CorruptFile, read_verified
from resilience.record.events import read_events
from resilience.record.fsio import fsync_dir
from resilience.runtime.rank import RankRuntime
from resilience.settings.checks import require_int, require_number
from resilience.state.train import TrainState, map_tensors
from resilience.strategies.base import CheckpointStrategy

WAIT_POLL_S = 0.02  # a survivor waiting for the shard another one claimed looks this often


class JitCheckpoint(CheckpointStrategy):
    """Writes the last completed step's state from a surviving replica when a collective fails; never before."""

    # under HSDP each survivor writes its own shard (one survivor per shard suffices: the replica groups hold the same
    # shards); each rank loads its shard back, so the world must not change its size or shape in between
    caps = StrategyCaps(family="just-in-time", saves=False, writes_at_failure=True, writes_through_checkpoint_fs=True,
                        shards_state=True, reshards_on_load=False)

    def __init__(self, every: Any, keep: int, grace_s: float = 5.0, failure_wait_s: float = 2.0,
                 ranks_per_node: int = 1) -> None:
        super().__init__(every, keep)  # checkpoint.every does not apply: nothing is saved on an interval
        self.grace_s = require_number("strategy.grace_s", grace_s, above=0)
        self.failure_wait_s = require_number("strategy.failure_wait_s", failure_wait_s, at_least=0)
        if self.failure_wait_s >= self.grace_s:
            raise ValueError(f"strategy.failure_wait_s={failure_wait_s}: must be below strategy.grace_s={grace_s} "
                             f"(timeouts.shutdown_s), or nothing is left of the grace period to write in")
        self.ranks_per_node = require_int("strategy.ranks_per_node", ranks_per_node, 1)
        self._armed = False
        self._grace: TermGrace | None = None
        self._hook: Any = None
        self._parts: RankParts | None = None
        self._captured: int | None = None  # the step whose boundary the own parts were last kept at
        self._training: int | None = None  # the step in flight (its position), between before_step and the next
        self._position = 0  # completed optimizer steps, as the loop last said
        self._loaded = 0  # the step this attempt started from
        self._shard = (0, 1)  # (which shard of the state this rank holds, of how many): (0, 1) but under HSDP
        self._kept, self._kept_s, self._kept_bytes = 0, 0.0, 0  # own parts kept this attempt: times, seconds, size
        self._kept_failed = False  # a keep failed (said once)
        self._forwards = 0  # forward passes in the step in flight
        self._per_step: int | None = None  # forward passes a step makes (None: not learnt yet; 0: it varies)

    # ---- roles' services ----------------------------------------------------------------------------------------
    def node_memory(self, run_dir: Path) -> NodeMemory:
        """What node_loss wipes: the per-rank parts this run's nodes hold."""
        return NodeMemory(shm_store.run_id(run_dir))

    @classmethod
    def clean_up_run(cls, run_dir: Path) -> None:
        node_memory.cleanup(run_dir)

    def due(self, step: int, total_steps: int) -> bool:
        return False  # no periodic checkpoint: the state is written at a failure (recover)

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        import resilience.ckpt.dcp_files  # noqa: F401  (its imports now, not in the save at a failure: sync's attach)
        if rt.world_size % self.ranks_per_node:
            raise ValueError(f"strategy.ranks_per_node={self.ranks_per_node}: must divide world_size={rt.world_size}")
        self.dirs = CheckpointDir(rt.ckpt_dir, owner=rt.identity)
        rid = shm_store.run_id(rt.run_dir)
        self.memory = NodeMemory(rid)
        self.node = rt.rank // self.ranks_per_node
        self._rank_parts = RankParts(rid, rt.rank, rt.world_size, self.ranks_per_node, self.memory)

    # ---- steady state -------------------------------------------------------------------------------------------
    def before_step(self, state: TrainState, position: int) -> int:
        """Arm once (in the main thread: the SIGTERM grace, the forward hook), then keep this rank's own parts as they
        stand at this step's boundary, unless the last forward pass kept them already."""
        if not self._armed:
            self._arm(state)
        if self._forwards:  # the step before ran this many forward passes: the last one is where to keep the parts
            self._per_step = self._forwards if self._per_step in (None, self._forwards) else 0  # 0: it varies
        self._position, self._training, self._forwards = position, position, 0
        if self._parts is not None and self._captured != position:
            self._keep_parts(state, position)
        return position

    def _arm(self, state: TrainState) -> None:
        self._armed = True
        self._shard = shard_of(state)
        if self.rt.world_size > 1:  # alone, no collective of this rank can fail: nothing to hold SIGTERM for
            self._grace = TermGrace(self.failure_wait_s, self._superseded)
            self._grace.install()
        if state.parts.per_rank:  # the replayable loop has none: nothing to keep, nothing to hook
            self._parts = self._rank_parts
            self._hook = state.model.register_forward_hook(lambda *_: self._after_forward(state))

    def _after_forward(self, state: TrainState) -> None:
        """After the step's last forward pass its batches are drawn and its random numbers used: the parts are those
        of the next boundary. Which pass is the last is learnt from the step before (micro-batches: one per pass);
        until then, or where the count varies, the parts are kept after every pass (the last one stays)."""
        if self._training is None:
            return
        self._forwards += 1
        if not self._per_step or self._forwards == self._per_step:
            self._keep_parts(state, self._training + 1)

    def _keep_parts(self, state: TrainState, step: int) -> None:
        t0 = time.perf_counter()
        mine = {name: part.state_dict() for name, part in state.parts.per_rank.items()}
        try:
            self._kept_bytes = self._rank_parts.put(step, self.rt.attempt, mine)
            self._captured = step
            self._kept += 1
            self._kept_s += time.perf_counter() - t0
        except OSError as exc:  # /dev/shm full: training goes on, a recovery will say what it lacks (said once)
            if not self._kept_failed:
                self._kept_failed = True
                why = f"per-rank parts: {type(exc).__name__}: {exc}"[:300]
                self.rt.events.emit("jit_unsaved", step=step, reason=why)

    def _superseded(self) -> bool:
        """Whether a state at least as new as this rank's is committed (a SIGTERM then ends it at once)."""
        with contextlib.suppress(OSError):
            newest = self.dirs.newest_committed()
            return newest is not None and newest.step >= self._position
        return False

    def close(self) -> None:
        if self._kept:  # the steady state's one cost: what keeping the own parts took this attempt
            self.rt.events.emit("jit_parts_kept", count=self._kept, duration_s=self._kept_s, bytes=self._kept_bytes)
            self._kept, self._kept_s = 0, 0.0
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._grace is not None:
            self._grace.close()
            self._grace = None
        self._armed = False

    def _save(self, step: int, state: TrainState) -> None:
        raise AssertionError("strategy=jit saves only at a failure (recover), never on an interval")

    # ---- at a failure ---------------------------------------------------------------------------------------------
    def recover(self, state: TrainState, position: int, error: BaseException) -> int:
        """A collective failed after ``position`` completed steps: write this replica's state of that step, commit
        it, then fail as every restarting strategy does (re-raise ``error``)."""
        t0 = time.monotonic()
        if self._grace is not None:
            self._grace.writing()  # the launcher's SIGTERM waits for the write from here on
        self._training = None
        try:
            self._write_at_failure(state, position, error, t0)
        except Exception as exc:  # never hide the collective's error behind the write's
            self.rt.events.emit("jit_unsaved", step=position, reason=f"{type(exc).__name__}: {exc}"[:500], fsync=True)
        raise error

    def _write_at_failure(self, state: TrainState, position: int, error: BaseException, t0: float) -> None:
        rt = self.rt
        if position <= self._loaded:
            rt.events.emit("jit_unsaved", step=position, reason=f"nothing trained since step {self._loaded} was "
                           f"{'loaded' if self._loaded else 'the start'}", fsync=True)
            return
        shard, shards = self._shard
        step_dir = self.dirs.path_for(position)
        final = step_dir / shard_name(shard, shards)
        if not self._claim(position, shard):
            waited = self._wait_for(final, self.grace_s - self.failure_wait_s)
            if waited:
                rt.events.emit("jit_unsaved", step=position, reason="another survivor wrote this step's shard",
                               fsync=True)
                return
        staging = rt.ckpt_dir / f".jit-r{rt.rank}-a{rt.attempt}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            tmp = staging / final.name
            from resilience.ckpt.dcp_files import ChecksumFileSystem  # on a rank only (dcp_files: why)

            fs = ChecksumFileSystem(rt.ckpt_fs)
            with fs.create_stream(tmp, "wb") as stream:
                nbytes = write_shard(stream, self._replica_state(state))
                stream.flush()
                os.fsync(stream.fileno())
            fs.write_sidecar(staging, shard)
            step_dir.mkdir(parents=True, exist_ok=True)
            sidecar = staging / f"{SIDECAR_PREFIX}rank{shard}.json"
            os.replace(sidecar, step_dir / sidecar.name)
            try:
                os.link(tmp, final)  # never over another survivor's: the first complete shard stays
            except FileExistsError:
                pass
            fsync_dir(step_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        committed = self._commit_if_whole(position, shards)
        rt.events.emit("jit_saved", step=position, bytes=nbytes, duration_s=time.monotonic() - t0, shard=shard,
                       shards=shards, path=str(step_dir), committed=committed,
                       error=f"{type(error).__name__}: {error}"[:300], fsync=True)
        if committed:
            for pruned in self.dirs.prune(self.keep):
                rt.events.emit("ckpt_pruned", step=pruned)
        print(f"[rank {rt.rank} attempt {rt.attempt}] a collective failed: wrote the state of step {position} "
              f"({nbytes / 1e6:.1f} MB) in {time.monotonic() - t0:.3f} s", flush=True)

    def _replica_state(self, state: TrainState) -> dict[str, Any]:
        """Model and optimizer as they stand (the last completed step's: the failed step applied nothing), and the
        job-wide parts; a rank's own parts stay in its node's memory (the live ones are the failed step's)."""
        sd = {"model": state.model.state_dict(), "optim": state.optimizer.state_dict(),
              **state.parts.state_dict(list(state.parts.job))}
        return map_tensors(local_part, sd)

    def _claim(self, step: int, what: int | str) -> bool:
        """Whether this survivor is the first to claim ``what`` of ``step`` (a shard to write, or the commit): an
        exclusive file on the shared disk."""
        claims = self.rt.ckpt_dir / ".jit-claims"
        claims.mkdir(parents=True, exist_ok=True)
        try:
            # the attempt in the name: survivors of one failure share it, a later timeline at the same step does not
            name = f"step_{step:08d}-attempt{self.rt.attempt}-{what}"
            fd = os.open(claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.write(fd, f"{self.rt.rank} {os.getpid()}\n".encode())
        os.close(fd)
        return True

    @staticmethod
    def _wait_for(path: Path, seconds: float) -> bool:
        deadline = time.monotonic() + max(0.0, seconds)
        while not path.exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_POLL_S)
        return True

    def _commit_if_whole(self, step: int, shards: int) -> bool:
        """Commit the checkpoint of ``step`` once all its shards are there: whoever sees the set complete first (each
        writer looks after linking its own shard, so the last one to link sees it); True once committed."""
        step_dir = self.dirs.path_for(step)
        if (step_dir / COMMIT_MARKER).exists():
            return True
        if any(not (step_dir / shard_name(k, shards)).exists() for k in range(shards)):
            return False
        if self._claim(step, "commit"):  # one committer: a second would list the first one's record as a file
            self.dirs.commit(step)
            fsync_dir(self.rt.ckpt_dir)
        return (step_dir / COMMIT_MARKER).exists()

    # ---- after a restart ----------------------------------------------------------------------------------------
    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        """The newest committed state written at a failure that every rank reads intact (rank 0 picks, all verify,
        all agree before any tensor is touched); then each rank's own parts from its node's memory."""
        rt = self.rt
        self.memory.revive(self.node)  # a new attempt: this node is back, with whatever its memory still holds
        rejected: set[int] = set()
        loaded = None
        while (entry := self._agreed_entry(rejected)) is not None:
            buf, reason = None, None
            try:
                buf = self._read_verified(entry, state)
            except (OSError, KeyError, ValueError) as exc:
                reason = str(exc) if isinstance(exc, CorruptFile) else f"{type(exc).__name__}: {exc}"[:300]
            reasons: list[Any] = [None] * rt.world_size
            dist.all_gather_object(reasons, reason)
            bad = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
            if bad:
                rejected.add(entry.step)
                if rt.rank == 0:
                    self._reject(entry, "; ".join(bad))
                continue
            if not state.optimizer.state and any(is_sharded(p) for p in state.model.parameters()):
                state.state_dict()  # creates the optimizer's sharded state (as sync's load does), to read shards into
            live = tensor_leaves(snapshot_state(state))  # read in place where the model already holds the tensor
            restore(state, read_shard(buf, live))
            loaded = (entry.step, "jit", len(buf))
            del buf
            break
        step = loaded[0] if loaded else 0
        self._take_own_parts(state, step)
        if rt.rank == 0:
            self._drop_newer(step)
            self._say_what_was_lost(step)
        self._loaded = self._position = step
        return loaded

    def _agreed_entry(self, rejected: set[int]) -> CheckpointEntry | None:
        choice: list[Any] = [None]
        if self.rt.rank == 0:
            bound = self.rt.load_max_step
            for entry in reversed(self.dirs.entries()):
                if not entry.committed or entry.step in rejected or (bound is not None and entry.step > bound):
                    continue
                reason = self.dirs.check(entry, checksums=False)  # the sums are checked as the ranks read
                if reason is None:
                    choice = [entry.step]
                    break
                rejected.add(entry.step)
                self._reject(entry, reason)
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        return CheckpointEntry(choice[0], self.dirs.path_for(choice[0]), True)

    def _read_verified(self, entry: CheckpointEntry, state: TrainState) -> memoryview:
        """This rank's shard file, checked against the commit record on the way in."""
        record = self.dirs.manifest(entry)
        digest, sums = for_record(record)
        name = shard_name(*shard_of(state))
        return read_verified(self.rt.ckpt_fs, entry.path / name, record["files"][name], sums[name], digest)

    def _take_own_parts(self, state: TrainState, step: int) -> None:
        """This rank's RNG streams and data position at ``step``, from its node's memory (or the next node's copy);
        the ranks that found none are named once (``jit_parts_lost``) and start theirs over."""
        if not state.parts.per_rank or step == 0:
            return  # nothing per rank, or the start: the fresh parts are the start's
        found = self._rank_parts.get(step)
        if found is not None:
            for name, part_state in found[0].items():
                state.parts.per_rank[name].load_state_dict(part_state)
        lost: list[Any] = [None] * self.rt.world_size
        dist.all_gather_object(lost, None if found is not None else sorted(state.parts.per_rank))
        if self.rt.rank == 0 and any(lost):
            missing = {r: parts for r, parts in enumerate(lost) if parts}
            self.rt.events.emit("jit_parts_lost", step=step, ranks=sorted(missing),
                                parts=sorted({p for ps in missing.values() for p in ps}), fsync=True)
            print(f"[rank 0 attempt {self.rt.attempt}] the own parts of rank(s) {sorted(missing)} at step {step} "
                  f"are in no node's memory: they start over (this recovery is not exact)", flush=True)

    def _drop_newer(self, step: int) -> None:
        """States newer than the one training goes on from belong to an abandoned timeline (a rollback's bound)."""
        for entry in self.dirs.entries():
            if entry.step > step:
                shutil.rmtree(entry.path, ignore_errors=True)
                self.rt.events.emit("ckpt_pruned", step=entry.step)

    def _say_what_was_lost(self, step: int) -> None:
        """Rank 0, after a restart: when the failed attempt got further than the state loaded and no survivor
        committed its last step (or the one before: the step in flight), no healthy replica was left: say so (the
        steps are lost, the run goes on from ``step``)."""
        rt = self.rt
        if rt.load_max_step is not None:
            return  # a rollback's bound: going back is what was asked
        ranks = [e for e in read_events(rt.run_dir) if e.get("rank") is not None and e["attempt"] < rt.attempt]
        if not ranks:
            return
        last = max(e["attempt"] for e in ranks)
        mine = [e for e in ranks if e["attempt"] == last]
        reached = max((e["step"] for e in mine if e["kind"] in ("step_end", "ckpt_loaded")), default=0)
        committed = [e["step"] for e in mine if e["kind"] == "jit_saved" and e.get("committed")]
        if reached <= step or any(w >= reached - 1 for w in committed):
            return  # nothing lost, or a survivor committed it (a load that passed over it says why: ckpt_rejected)
        why = ("one rank alone has no replica to write it (world_size=1)" if rt.world_size == 1 else
               "no survivor committed it: every replica was lost at once, or a write was cut short by the launcher's "
               "grace (timeouts.shutdown_s)")
        rt.events.emit("jit_no_replica", step=step, reached=reached, lost_steps=reached - step, reason=why, fsync=True)
        print(f"[rank 0 attempt {rt.attempt}] no healthy replica wrote the state of step {reached}: {why}; going on "
              f"from step {step} ({reached - step} steps lost)", flush=True)


def shard_of(state: TrainState) -> tuple[int, int]:
    """Which shard of the training state this rank holds, and of how many: (0, 1) where every rank holds all of it
    (DDP); under HSDP its coordinate on the mesh's shard dimension (the ranks with the same one, one per replica
    group, hold the same shard: ``replica_shards.shard_key``)."""
    from torch.distributed.tensor import DTensor

    p = next(iter(state.model.parameters()))
    if not isinstance(p, DTensor):
        return 0, 1
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or ()
    if "shard" in names:
        return mesh.get_local_rank("shard"), mesh.size(names.index("shard"))
    return mesh.get_rank(), mesh.size()  # each shard held once (fsdp): the table refuses it, no survivor holds it


class TermGrace:
    """The launcher's SIGTERM, held while this rank writes its state at a failure.

    A watching thread hears the signal (``signal.set_wakeup_fd``: the C handler writes it to a pipe even while the
    main thread sits in a collective, where no Python handler runs). Writing: the signal waits for the write, after
    which the rank fails and ends anyway. Not writing: the rank ends at once if ``superseded()`` (a state at least as
    new as its own is committed), else it gives its own collective ``wait_s`` to fail and start the write, and ends
    when it does not (exit status 143, as a shell reports a SIGTERM).
    """

    def __init__(self, wait_s: float, superseded: Callable[[], bool]) -> None:
        self.wait_s, self.superseded = wait_s, superseded
        self._writing = threading.Event()
        self._r = self._w = -1
        self._previous: Any = None
        self._previous_fd = -1
        self.term_at: float | None = None

    def install(self) -> None:
        """From the main thread (where signal dispositions are set)."""
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._previous = signal.signal(signal.SIGTERM, lambda *_: None)  # noted by the watcher
        threading.Thread(target=self._watch, name="jit-term-grace", daemon=True).start()

    def writing(self) -> None:
        self._writing.set()

    def _watch(self) -> None:
        r = self._r
        while True:
            try:
                select.select([r], [], [])
                got = os.read(r, 64)
            except (OSError, ValueError):
                got = b""
            if not got:  # closed: the strategy is done with it
                with contextlib.suppress(OSError):
                    os.close(r)
                return
            if signal.SIGTERM in got and self.term_at is None:
                self.term_at = time.monotonic()
                if self._writing.is_set():
                    continue  # the write ends the rank
                if self.superseded() or not self._writing.wait(self.wait_s):
                    os._exit(128 + signal.SIGTERM)

    def close(self) -> None:
        """Give SIGTERM back; the watcher sees its pipe end and closes the other."""
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                signal.set_wakeup_fd(self._previous_fd)
                signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        if self._w >= 0:
            with contextlib.suppress(OSError):
                os.close(self._w)
        self._w = -1
