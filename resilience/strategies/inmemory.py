"""In-memory checkpointing after DLRover Flash Checkpoint and Gemini (Wang et al., SOSP'23).

Every ``checkpoint.every`` steps each rank copies its model and optimizer state (its own shards under
``parallel=fsdp|hsdp``) into its own shared-memory area on its node (``shm_store``: a ``/dev/shm`` file that
survives the restart of the rank process, as DLRover's agent-owned shared memory does) and into a *peer copy* held
in the memory of rank ``(r + ranks_per_node) % world_size``, on the next node (Gemini's replica in a remote
machine's CPU memory); under HSDP, of the rank that holds the same shard in the next replica group. On one host the writing rank
maps the peer's file itself; on a real cluster that copy would cross the network to the peer node's agent. Only
one copy is inside the stall (the state straight into the own slot); the slot's checksum and commit, and the peer
copy (a copy of that slot), run in a thread beside the next step and are complete before the step after it begins
(``before_step``): a failure in between finds the previous snapshot, as a crash during the copy would.
Every ``persist_every``-th snapshot is also saved to disk exactly as ``sync`` does (DCP + atomic commit), for
the failures that take every copy with them.

Recovery (every rank restarts): each rank lists the snapshots it can reach -- its own area, else its peer copy --
and the ranks all-gather those steps. If every rank holds the newest common step, and no committed disk
checkpoint is newer, every rank reads it from memory straight into its tensors (``ckpt_loaded`` source ``memory``
or ``peer_memory``; the data's checksum is checked too, unless ``strategy.verify=false``); otherwise all fall back to
``sync``'s disk load and record why (``ckpt_memory_fallback``). Snapshots newer than the step loaded belong to
an abandoned timeline and are dropped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resilience.settings.checks import require_bool, require_int
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState
from resilience.workloads.base import Workload
from resilience.ckpt import node_memory, shm_store
from resilience.ckpt.codec import StateCodec, TensorRef, snapshot_state, restore, tensor_leaves
from resilience.ckpt.digest import CURRENT, Running
from resilience.ckpt.node_memory import NodeMemory
from resilience.ckpt.shm_store import ALIGN, Area, SlotInfo
from resilience.ckpt.snapshot import is_sharded, local_part
from resilience.strategies.sync import SyncCheckpoint


class InMemoryCheckpoint(SyncCheckpoint):
    """Snapshots to shared memory (own area + one peer copy), persisting every ``persist_every``-th to disk."""

    # each rank snapshots its own shards (codec.snapshot_state) and loads exactly those back: not resharded
    caps = dataclasses.replace(SyncCheckpoint.caps, family="in-memory", reshards_on_load=False,
                               saves_stages=False)

    def __init__(self, every: int, keep: int, persist_every: int = 4, ranks_per_node: int = 1,
                 verify: bool = True, world_size: int | None = None) -> None:
        super().__init__(every, keep)
        self.persist_every = require_int("strategy.persist_every", persist_every, 1)
        self.ranks_per_node = require_int("strategy.ranks_per_node", ranks_per_node, 1)
        self.verify = require_bool("strategy.verify", verify)
        if world_size is not None:
            self._check_world(world_size)
        self.codec = StateCodec()
        self.own: Area | None = None
        self.peer: Area | None = None
        self.peer_lost = False
        self._finishing: tuple[int, threading.Thread] | None = None  # (step, thread) of the snapshot in flight

    def _check_world(self, world_size: int) -> None:
        if world_size % self.ranks_per_node:
            raise ValueError(f"strategy.ranks_per_node={self.ranks_per_node}: must divide world_size={world_size}")

    def node_memory(self, run_dir: Path) -> NodeMemory:
        """What node_loss wipes: the areas of this run's nodes."""
        return NodeMemory(shm_store.run_id(run_dir))

    @classmethod
    def clean_up_run(cls, run_dir: Path) -> None:
        node_memory.cleanup(run_dir)

    def check_host(self, workload: Workload, world_size: int, shards: int = 1) -> None:
        """Refuse a run whose snapshots cannot fit in this host's free ``/dev/shm``: every rank here holds two slots
        of its own area and, with more than one node, two of a peer's copy (its parameters, whole or its shard of
        each, plus two optimizer tensors per parameter, as ``_capacity`` assumes). Built on the meta device:
        nothing is allocated."""
        with torch.device("meta"):
            params = sum(_shard_bytes(p, shards) for p in workload.build_model().parameters())
        copies = 2 if world_size // self.ranks_per_node > 1 else 1
        need = world_size * copies * 2 * 3 * params
        free = shm_store.free_bytes()
        if need > free:
            raise ValueError(f"strategy=inmemory: its snapshots need about {need / 1e6:,.0f} MB of "
                             f"{shm_store.SHM_DIR} for {world_size} ranks, {free / 1e6:,.0f} MB is free (short by "
                             f"{(need - free) / 1e6:,.0f} MB); free some, or use fewer ranks or strategy=sync")

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self._check_world(rt.world_size)
        self.rid = shm_store.run_id(rt.run_dir)
        self.memory = NodeMemory(self.rid)  # the same areas as the runtime's service: a NodeMemory is its run id
        r, rpn = rt.rank, self.ranks_per_node
        self.node = r // rpn
        self.own_path = shm_store.area_path(self.rid, self.node, r, r)
        self._place_peer((r + rpn) % rt.world_size)

    def _place_peer(self, holder: int) -> None:
        """The rank whose node holds our peer copy; none when it is on our own node (one node only: no other
        machine to hold a copy; the snapshot survives process restarts, not the node)."""
        rpn = self.ranks_per_node
        self.holder = holder if holder // rpn != self.node else None
        self.peer_path = (shm_store.area_path(self.rid, holder // rpn, holder, self.rt.rank)
                          if self.holder is not None else None)

    def load(self, state: TrainState) -> int:
        """Load, then create (or map) the areas now, so that no checkpoint pays for reserving their RAM. Under
        HSDP the peer copy goes to the rank that holds the same shard in the next replica group, where it is
        on another node (``replica_peer``)."""
        holder = replica_peer(state)
        if holder is not None and holder // self.ranks_per_node != self.node:
            self._place_peer(holder)
        step = super().load(state)
        dist.barrier()  # reserve only once every rank has loaded: a rank still reading must not compete with it
        t0 = time.monotonic()
        try:
            cap = self._capacity(state)
            areas = [self._area("own", cap)] + ([self._area("peer", cap)] if self.peer_path is not None else [])
            self.rt.events.emit("snapshot_reserved", bytes=sum(2 * a.slot_cap for a in areas if a is not None),
                                duration_s=time.monotonic() - t0)
        except OSError:
            pass  # e.g. /dev/shm too small: the first snapshot will try again, and record why it fails
        return step

    def _capacity(self, state: TrainState) -> int:
        """Slot size ``state``'s snapshots need. An optimizer that creates its state at its first step is assumed
        to hold two tensors and a step per parameter, like Adam (a snapshot that needs more grows the area)."""
        data, meta, _ = self.codec.encode(snapshot_state(state), checksum=False)  # the layout only: nothing is copied
        if not state.optimizer.state:
            params = [local_part(p) for p in state.model.parameters() if p.requires_grad]
            data += sum(2 * -(-p.numel() * p.element_size() // ALIGN) * ALIGN + ALIGN for p in params)
        return data + ALIGN + 3 * len(meta)  # meta: room for the optimizer's entries too

    def persist_due(self, step: int) -> bool:
        """Whether the snapshot of ``step`` also goes to disk: every ``persist_every``-th, counted from step 0, and a
        save on a preemption's notice (the job's supervisor removes the snapshots on its way out)."""
        return self.on_notice or (step // self.every) % self.persist_every == 0

    # ---- save -------------------------------------------------------------------------------------------------
    def _save(self, step: int, state: TrainState) -> None:
        """One copy inside the stall: the state straight into our own slot, left uncommitted. Its checksum, its commit
        and the peer copy (a copy of that slot) follow in a thread, beside the next step (``_finish``)."""
        rt, t0 = self.rt, time.monotonic()
        self._join_finish()  # never two at once: each area has one writer
        try:
            data_len, meta, fill = self.codec.encode(snapshot_state(state), checksum=False)
            need = data_len + ALIGN + len(meta)
            own = self._area("own", need)
            info = own.write(step, rt.attempt, data_len, meta, fill,
                             before_commit=lambda: rt.fault_hook("during_checkpoint", step), commit=False)
            peer = self._area("peer", need) if self.peer_path is not None else None
            self._finishing = (step, threading.Thread(target=self._finish, args=(step, own, info, peer, meta, t0),
                                                      name=f"snapshot-{step}", daemon=True))
            self._finishing[1].start()  # daemon: a dying rank does not wait for it (the slots stay uncommitted)
        except (OSError, ValueError) as exc:  # e.g. /dev/shm full: no snapshot this time, training goes on
            rt.events.emit("ckpt_failed", step=step, error=f"memory: {type(exc).__name__}: {exc}"[:500], fsync=True)
        if self.persist_due(step):
            super()._save(step, state)  # and ckpt_durable on rank 0

    def _finish(self, step: int, own: Area, info: SlotInfo, peer: Area | None, meta: bytes, t0: float) -> None:
        """After the stall: sum our slot's checksum (``strategy.verify``) and commit it, then copy it to the peer
        (the same bytes and checksum, no second encode). Our slot is not rewritten meanwhile: the next snapshot goes
        to the other slot, and joins this first."""
        rt = self.rt
        try:
            checksum = own.checksum(info, self.codec.ranges(meta)) if self.verify else None
            info = dataclasses.replace(info, checksum=checksum)
            own.commit(info)
            rt.events.emit("ckpt_memory_saved", step=step, bytes=info.data_len + info.meta_len, slot=info.index,
                           peer_rank=self.holder if peer is not None else None, duration_s=time.monotonic() - t0)
            if peer is not None:
                t1 = time.monotonic()
                peer.write(step, rt.attempt, info.data_len, meta, lambda buf: self._copy(buf, own, info))
                rt.events.emit("ckpt_peer_copied", step=step, peer_rank=self.holder, duration_s=time.monotonic() - t1)
        except (OSError, ValueError) as exc:
            rt.events.emit("ckpt_failed", step=step, error=f"memory: {type(exc).__name__}: {exc}"[:500], fsync=True)

    def before_step(self, state: TrainState, position: int) -> int:
        """A snapshot's checksum, commit and peer copy have the step after it to run beside; they are complete before
        the one after that starts (so a fault planned for that point finds them, whatever the machine's load)."""
        if self._finishing is not None and position > self._finishing[0]:
            self._join_finish()
        return position

    def _join_finish(self) -> None:
        if self._finishing is not None:
            self._finishing[1].join()
            self._finishing = None

    def wait(self) -> None:
        self._join_finish()
        super().wait()

    @staticmethod
    def _copy(buf: torch.Tensor, area: Area, info: SlotInfo) -> int | None:
        src = area.data(info)
        buf.copy_(src)
        del src
        return info.checksum

    def _area(self, which: str, need: int) -> Area | None:
        """Our own area or the peer copy, mapped once per attempt (writes into a mapping whose node was wiped since
        go nowhere, as they would on a dead machine); None once the peer's node is lost in this attempt."""
        area: Area | None = getattr(self, which)
        if (area is not None and area.slot_cap >= need) or (which == "peer" and self.peer_lost):
            return area
        if area is not None:
            area.close()
        path = self.own_path if which == "own" else self.peer_path
        area = Area.create(path, need, spare=max(need // 64, 1 << 20))  # room for meta that grows (lr schedules)
        if which == "peer" and self.memory.lost(self.holder // self.ranks_per_node):
            area.close()  # the peer's node died while we created the area: it holds nothing until it rejoins
            path.unlink(missing_ok=True)
            area, self.peer_lost = None, True
        setattr(self, which, area)
        return area

    # ---- load -------------------------------------------------------------------------------------------------
    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        """The ranks agree on the newest step every one of them can reach in memory; if no disk checkpoint is newer,
        all read it from memory, else (or if a read fails its check on any rank) all fall back to the disk."""
        rt, t0 = self.rt, time.monotonic()
        self.memory.revive(self.node)  # a new attempt: this node is back, with whatever its memory still holds
        own, peer = Area.open(self.own_path), Area.open(self.peer_path) if self.peer_path else None
        try:
            reach = self._reachable(own, peer)
            views = self._views(reach)
            step, reason = self._memory_step(views)
            if step is not None:
                t_agreed = time.monotonic()
                loaded = self._load_memory(state, step, own, peer)
                if loaded is not None:
                    self._drop_newer(step, own, peer)
                    # where a load from memory spends its time (ckpt_loaded has the total)
                    rt.events.emit("ckpt_memory_loaded", step=step, source=loaded[1], agree_s=t_agreed - t0,
                                   read_s=self._read_s, restore_s=time.monotonic() - t_agreed - self._read_s)
                    return loaded
                reason = f"the snapshot of step {step} failed its checksum on some rank"
            return self._load_disk(state, reason, reach, views, corrupt_step=step, own=own, peer=peer)
        finally:
            for area in (own, peer):
                if area is not None:
                    area.close()

    def _reachable(self, own: Area | None, peer: Area | None) -> dict[int, str]:
        """Step -> where this rank holds its snapshot (own memory over the peer copy), within a rollback bound."""
        bound = self.rt.load_max_step
        reach = {s.step: "peer_memory" for s in (peer.slots() if peer else []) if bound is None or s.step <= bound}
        reach.update({s.step: "memory" for s in (own.slots() if own else []) if bound is None or s.step <= bound})
        return reach

    def _views(self, reach: dict[int, str]) -> list[dict[str, Any]]:
        """Every rank's reachable steps, and (from rank 0) the newest committed disk checkpoint."""
        newest_disk = self.dirs.newest_committed(self.rt.load_max_step) if self.rt.rank == 0 else None
        views: list[Any] = [None] * self.rt.world_size
        dist.all_gather_object(views, {"steps": sorted(reach), "disk": newest_disk.step if newest_disk else None})
        return views

    @staticmethod
    def _memory_step(views: list[dict[str, Any]]) -> tuple[int | None, str | None]:
        """The step to read from memory, or None and why the disk is used instead."""
        common = set.intersection(*(set(v["steps"]) for v in views))
        disk_step = views[0]["disk"]
        if common and (disk_step is None or max(common) >= disk_step):
            return max(common), None
        if common:
            return None, f"disk checkpoint of step {disk_step} is newer than memory's step {max(common)}"
        missing = [r for r, v in enumerate(views) if not v["steps"]]
        return None, (f"no snapshot in memory on rank(s) {missing}" if missing
                      else "no step is held in memory by every rank")

    def _load_disk(self, state: TrainState, reason: str, reach: dict[int, str], views: list[dict[str, Any]],
                   corrupt_step: int | None, own: Area | None, peer: Area | None) -> tuple[int, str, int] | None:
        """``sync``'s load, recording why memory was not used when there was something to recover."""
        if any(v["steps"] for v in views) or views[0]["disk"] is not None:
            self.rt.events.emit("ckpt_memory_fallback", reason=reason, memory_steps=sorted(reach), fsync=True)
        loaded = super()._load(state)
        if loaded is None and corrupt_step is not None:  # partly overwritten by the failed read, nothing to restore
            raise RuntimeError(f"in-memory snapshot of step {corrupt_step} is corrupt and there is no disk checkpoint")
        self._drop_newer(loaded[0] if loaded else 0, own, peer)
        return loaded

    def _load_memory(self, state: TrainState, step: int, own: Area | None,
                     peer: Area | None) -> tuple[int, str, int] | None:
        """Load ``step`` from our own area, else from the peer copy; every rank succeeds, or none uses memory.

        Bytes go straight from the area into the model's and optimizer's own tensors (into new ones where the
        optimizer has none yet), so a checksum mismatch (``strategy.verify``) is seen only after the read: a rank whose
        copies all fail has a half-overwritten state (see ``_load``).
        """
        t0 = time.monotonic()
        if not state.optimizer.state and any(is_sharded(p) for p in state.model.parameters()):
            state.state_dict()  # creates the optimizer's sharded state (as sync's load does), to read shards into
        live = tensor_leaves(snapshot_state(state))  # read in place: their pages are already faulted in
        done = None
        for area, source in ((own, "memory"), (peer, "peer_memory")):
            info = area.find(step) if area is not None else None
            if info is None:
                continue
            running = CURRENT.new() if info.checksum is not None else None

            def read(ref: TensorRef, dst: torch.Tensor, area: Area = area, info: SlotInfo = info,
                     running: Running | None = running) -> None:
                area.read_into(info, ref.offset, dst, running)

            restored = self.codec.decode(area.meta(info), read, live)
            if running is None or running.value == info.checksum:
                done = (restored, source, info.data_len + info.meta_len)
                break
            self.rt.events.emit("ckpt_memory_corrupt", step=step, source=source, area=area.path.name, fsync=True)
            area.invalidate_newer(step - 1)  # never again: a later attempt must not pick it either
        self._read_s = time.monotonic() - t0
        ok = torch.tensor([int(done is not None)], dtype=torch.int64, device=self.rt.device)  # nccl: on device
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # all load from memory, or none does
        if not ok.item():
            return None
        restored, source, nbytes = done
        restore(state, restored)
        return step, source, nbytes

    def _drop_newer(self, step: int, own: Area | None, peer: Area | None) -> None:
        """Snapshots newer than the step training resumes from are an abandoned timeline: never load them."""
        for area in (own, peer):
            if area is not None:
                area.invalidate_newer(step)

    def close(self) -> None:
        self._join_finish()
        for which in ("own", "peer"):
            area = getattr(self, which)
            if area is not None:
                area.close()
            setattr(self, which, None)


def replica_peer(state: TrainState) -> int | None:
    """Under HSDP (a ``replicate x shard`` mesh): the rank holding this rank's shard in the next replica group,
    whose own state is the same shard; None for any other parallelism."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in state.model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None or mesh.ndim != 2 or mesh.mesh_dim_names[0] != "replicate":
        return None
    replica, shard = mesh.get_coordinate()
    return int(mesh.mesh[(replica + 1) % mesh.size(0), shard])


def _shard_bytes(param: torch.Tensor, shards: int) -> int:
    """The bytes of the largest of a parameter's ``shards`` shards: FSDP2 splits dim 0 into ``shards`` chunks of
    ceil(rows / shards) rows, the last padded."""
    if param.dim() == 0 or shards == 1:
        return param.numel() * param.element_size()
    rows = -(-param.shape[0] // shards)
    return rows * (param.numel() // max(param.shape[0], 1)) * param.element_size()
