"""torchft (Meta/PyTorch, 0.2.0) as a recovery peer of our ``replica``: each rank is a replica group of its own.

The library owns the step (``OwnsStep``). Before the forward pass ``torchft.Optimizer.zero_grad`` asks the
lighthouse (``torchft_lighthouse``) for this step's quorum: the replica groups alive now. A group that is behind
(a replacement) *heals* there, receiving model and optimizer state from a group that is up to date over torchft's
HTTP transport. ``torchft.DistributedDataParallel`` all-reduces the gradients over the quorum's gloo group, and
``torchft.Optimizer.step`` votes to commit: a step in which a peer failed is dropped, not raised, and trained again.
The batch is indexed by the manager's step, so a healed group trains the step its peers are at.

When a group dies the others do not wait for it: once its heartbeats stop the lighthouse forms the quorum without
it, and they train on at reduced width (``strategy.min_replicas`` groups at least) until the supervisor's
replacement heals into the quorum. The trajectory therefore differs from the fault-free run by design; what is
checked instead is that every replica holds the same state after the heal (``ft_state`` hashes) and at the end.
With ``min_replicas`` = every group no step commits without the dead one: the survivors wait for the replacement,
as our ``replica`` does, and the run ends bit-exact with the fault-free one.

Under ``parallel=hsdp`` a replica group is one replica of the shards, FSDP2 within it and torchft's all-reduce
across the groups (``torchft_hsdp``); a group heals shard by shard, and a dead rank's whole group is restarted.
"""

from __future__ import annotations

import faulthandler
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from resilience.caps import StrategyCaps
from resilience.settings.checks import require_int, require_number
from resilience.parallel.ddp import DataParallel
from resilience.record.events import read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState, map_tensors, state_sha256
from resilience.runtime.step import StepControl
from resilience.strategies.base import CheckpointStrategy
from resilience.libs.peer import Patch, PeerLibrary, PeerStrategy
from resilience.libs.torchft_hsdp import (GroupWorld, ReplicaGroups, load_local_shards, local_shards,
                                                set_all_reduce_hooks, shard_model)
from resilience.libs.torchft_lighthouse import Lighthouse

HEARTBEAT_INTERVAL_S = 0.1  # the Manager's default: how often a group tells the lighthouse it is alive


def _comm_hook_survives_a_failed_allreduce() -> None:
    """torchft 0.2.0's DDP hook asserts on a failed all-reduce: ``_ManagedWork.wait`` records the error but, the
    wait having raised first, never sets the future chain, and ``_comm_hook`` then asserts ``fut._fut`` (after a
    first error, ``allreduce`` returns a ``_DummyWork``, whose future has no ``_fut`` at all). The survivor of a peer
    that died mid all-reduce crashes instead of dropping the step. Here the hook hands back the bucket as it is: the
    manager has recorded the error, so the commit vote drops the step, which is what the library means to do."""
    from torchft import ddp

    def comm_hook(manager, bucket):  # unannotated: DDP refuses a hook whose bucket is annotated otherwise
        work = manager.allreduce(bucket.buffer())
        ok = work.wait()
        inner = getattr(work.get_future(), "_fut", None)
        if ok and inner is not None:
            return inner
        dropped: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        dropped.set_result(bucket.buffer())
        return dropped

    ddp.DistributedDataParallel._comm_hook = staticmethod(comm_hook)


PATCHES = (
    Patch("ddp_hook_after_failed_allreduce", "torchft.DistributedDataParallel's comm hook raises AssertionError when "
          "a peer dies during the all-reduce, so the survivor crashes instead of dropping the step", lambda: True,
          _comm_hook_survives_a_failed_allreduce),
)


class ReplicaTorchft(PeerStrategy, CheckpointStrategy, StepControl):
    # The supervisor replaces only the dead group; the others never stop. Each rank, or each replica of the shards
    # (hsdp), is its own replica group, healed by its own shard (``torchft_hsdp``); the lighthouse runs in the
    # supervisor.
    caps = StrategyCaps(saves=False, recovers_in_place=True, keeps_world_group=False, shards_state=True, owns_step=True,
                        runs_in_supervisor=True, min_replica_groups=1,
                        of_setting={"min_replica_groups": "min_replicas"})
    library = PeerLibrary("torchft", "torchft", extra="torchft")
    known_patches = PATCHES

    def __init__(self, every: int, keep: int, min_replicas: int = 1, heartbeat_timeout_s: float = 1.0,
                 join_timeout_s: float = 60.0, quorum_timeout_s: float = 60.0, timeout_s: float = 60.0,
                 patches: str | list[str] = "all") -> None:
        super().__init__(every, keep)
        self.min_replicas = require_int("strategy.min_replicas", min_replicas, 1)
        self.caps = self.caps.under(min_replicas=self.min_replicas)
        self.heartbeat_timeout_s = require_number("strategy.heartbeat_timeout_s", heartbeat_timeout_s,
                                                  above=2 * HEARTBEAT_INTERVAL_S)
        self.join_timeout_s = require_number("strategy.join_timeout_s", join_timeout_s, above=0)
        self.quorum_timeout_s = require_number("strategy.quorum_timeout_s", quorum_timeout_s, above=0)
        self.timeout_s = require_number("strategy.timeout_s", timeout_s, above=0)
        self.choose_patches(patches)
        self.manager: Any = None  # torchft.Manager, built at attach (the library is imported there)

    def agent_service(self) -> Lighthouse:
        return Lighthouse(self.min_replicas, round(self.heartbeat_timeout_s * 1000),
                          round(self.join_timeout_s * 1000), quorum_tick_ms=100)

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.ft = self.library.load()
        # The parallel setting and the workload come from the run's configuration: under hsdp this strategy
        # shards the model over its own replica group and builds the optimizer over the shards.
        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        # A native crash in the library (seen once under hsdp: a survivor's SIGSEGV right after serving a heal)
        # then leaves every thread's Python stack in the rank's log.
        faulthandler.enable()
        cfg = OmegaConf.load(rt.run_dir / "config.yaml")
        self.parallel = instantiate(cfg.parallel) if "parallel" in cfg else DataParallel()
        self.workload = instantiate(cfg.workload, seed=cfg.seed)
        self.groups = ReplicaGroups.of(self.parallel, rt.rank, rt.world_size)  # min_replicas fits: resilience.compat
        # Under hsdp torchft's DDP is not used (FSDP's all-reduce hook calls the Manager): its hook patch would act
        # on nothing, so it is neither installed nor declared.
        applied = self.applied_patches() if self.groups.shard == 1 else []
        self.declare(applied, min_replicas=self.min_replicas,
                     heartbeat_timeout_s=self.heartbeat_timeout_s,
                     replica_groups=f"{self.groups.count} x {self.groups.shard} process"
                                    f"{'es' if self.groups.shard > 1 else ''}",
                     transport="http", async_quorum=False)

    def step_control(self, state: TrainState) -> StepControl:
        """The Manager of this rank's replica group, torchft's DDP around the bare model, its Optimizer around ours."""
        ft, rt, groups = self.ft, self.rt, self.groups
        self.state, self.module = state, state.model
        timeout = timedelta(seconds=self.timeout_s)
        if groups.shard > 1:  # hsdp: the group's own world, the model sharded over it, the optimizer over the shards
            world = GroupWorld(groups, rt.group.store, rt.group.backend, timeout)
            world.join()
            store_port = world.manager_store_port()
            self._store = world
            self.module = state.model = shard_model(state.model, self.parallel, rt.device, groups.shard)
            state.optimizer = self.workload.build_optimizer(self.module)
        else:
            # The Manager needs its group's own store (a group of one process here), which other groups also reach
            # to form the quorum's process group.
            self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
            store_port = self._store.port
        self.transport = _measured_transport(ft, timeout)
        # Synchronous quorum: the heal is applied before the forward pass, so the step (and the batch) is the one
        # the healed state belongs to. Every rank builds the same initial state from the seed: no sync at step 0.
        self.manager = ft.Manager(
            pg=ft.ProcessGroupGloo(timeout=timeout), load_state_dict=self._load_user_state,
            state_dict=self._user_state, min_replica_size=self.min_replicas, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=self.quorum_timeout_s), connect_timeout=timeout,
            rank=groups.local, world_size=groups.shard, store_addr="127.0.0.1", store_port=store_port,
            replica_id=f"replica_{groups.group}", heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
            checkpoint_transport=self.transport, init_sync=False)
        if groups.shard > 1:
            set_all_reduce_hooks(self.module, self.manager)
        else:
            state.model = ft.DistributedDataParallel(self.manager, self.module)
        self.optimizer = ft.Optimizer(self.manager, state.optimizer)
        self._width, self._hash_next, self._dropped = 0, False, False
        if rt.attempt == 0:
            self._meet_first_members()
        return self

    def _meet_first_members(self) -> None:
        """The first generation starts together: the lighthouse forms a first quorum with the groups that heartbeat,
        and ``min_replicas`` lets it form one with the first group alone, which would start a fault-free run at
        reduced width. So each group heartbeats first, then waits (on files in the run directory) for the others."""
        rt = self.rt
        ready = rt.run_dir / "torchft_ready"
        ready.mkdir(exist_ok=True)
        time.sleep(2 * HEARTBEAT_INTERVAL_S)  # this group's first heartbeat has reached the lighthouse
        (ready / str(rt.rank)).touch()
        deadline = time.monotonic() + self.quorum_timeout_s
        while len(list(ready.iterdir())) < rt.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica_torchft: the other replica groups did not start within "
                                   f"{self.quorum_timeout_s:.0f} s (strategy.quorum_timeout_s)")
            time.sleep(0.02)

    def _user_state(self) -> dict[str, Any]:
        return local_shards({"model": self.module.state_dict(), "optim": self.state.optimizer.state_dict()})

    def _load_user_state(self, sd: dict[str, Any]) -> None:
        if self.groups.shard > 1:
            load_local_shards(self.module, self.state.optimizer, sd)
            return
        self.module.load_state_dict(sd["model"])
        self.state.optimizer.load_state_dict(sd["optim"])

    def begin(self, position: int) -> int:
        """The quorum (and the heal of a group that is behind); the step to train is the manager's."""
        rt, manager = self.rt, self.manager
        behind = manager.current_step()
        t0 = time.monotonic()
        self.optimizer.zero_grad()
        took = time.monotonic() - t0
        step, width = manager.current_step(), manager.num_participants()
        if self.transport.received is not None:  # this group healed: it holds a replica's state now
            transfer_s, nbytes = self.transport.received
            self.transport.received = None
            rt.events.emit("ckpt_loaded", step=step, source="replica:torchft", bytes=nbytes, duration_s=took)
            rt.events.emit("ft_heal", step=step, from_step=behind, transfer_s=transfer_s, bytes=nbytes, heal_s=took)
        if width != self._width or self._dropped:  # a new quorum (a dropped step: its members may have changed)
            if rt.attempt < (generation := _generation(rt.run_dir)):
                rt.events.attempt = generation  # a survivor lives on into the generation of the replacement
            shard = self.groups.shard  # participants: the ranks of the quorum's groups
            rt.events.emit("ft_quorum", step=step, participants=width * shard, previous=self._width * shard,
                           groups=width, wait_s=took)
            self._width, self._hash_next, self._dropped = width, True, False
        return step

    def commit(self) -> bool:
        """torchft's vote: AdamW steps only if every group of the quorum reduced its gradients without error."""
        before = self.manager.current_step()
        self.optimizer.step()
        committed = self.manager.current_step() > before
        self._dropped = not committed
        step = self.manager.current_step()
        ranks = self._width * self.groups.shard
        self.rt.events.emit("ft_step", step=step, participants=ranks, committed=committed)
        if committed and self._hash_next:  # the first state of a new quorum: every member must hold the same
            self._hash_next = False  # (the whole state: under hsdp gathered within the group, a collective of it)
            self.rt.events.emit("ft_state", step=step, participants=ranks,
                                sha256=state_sha256(self.state.full_state_dict()))
        return committed

    def wait(self) -> None:
        """The end of the run: a group replaced late heals into the final state before anyone leaves, so the run
        ends with every replica, not only the survivors, holding it (a real job would just finish without it)."""
        rt = self.rt
        deadline = time.monotonic() + self.quorum_timeout_s
        while self._width < self.groups.count and time.monotonic() < deadline:
            self.begin(self.manager.current_step())  # a quorum without a step: the late group heals in it
            time.sleep(0.05)  # each quorum with the same members returns at once: do not spin on the lighthouse
        if self._width < self.groups.count:
            rt.events.emit("ft_incomplete", step=self.manager.current_step(),
                           participants=self._width * self.groups.shard)
            return
        # Nobody leaves before every group holds the final state (and the last transfer has been served).
        self.manager.allreduce(torch.zeros(1)).wait()

    def _save(self, step: int, state: TrainState) -> None:
        raise AssertionError("replica_torchft never saves")

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        return None  # a replacement heals at its first quorum (``begin``), not here

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)  # its server, the HTTP transport, the quorum thread


def _generation(run_dir) -> int:
    """The supervisor's newest generation (its events carry it as their attempt)."""
    return max((e["attempt"] for e in read_events(run_dir) if e["rank"] is None), default=0)


def _measured_transport(ft: Any, timeout: timedelta) -> Any:
    """torchft's own HTTP transport, timing each state it receives and counting its bytes (``received``)."""

    class MeasuredHTTPTransport(ft.checkpointing.HTTPTransport):  # a subclass here: torchft is imported lazily
        received: tuple[float, int] | None = None

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            t0 = time.monotonic()
            sd = super().recv_checkpoint(src_rank, metadata, step, timeout)
            sizes: list[int] = []
            map_tensors(lambda t: sizes.append(t.nbytes) or t, sd)
            self.received = (time.monotonic() - t0, sum(sizes))
            return sd

    return MeasuredHTTPTransport(timeout=timeout, num_chunks=0)
