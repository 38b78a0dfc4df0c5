"""Per-step checkpointing through a gradient shadow, after Checkmate (Tiwari et al., arXiv:2507.13522, NSDI'26: the
reduced gradients multicast to CPU shadow nodes that apply the optimizer step, "5 to 34.5x more frequent
checkpointing", "80% to 97.1% reduction in repeated work").

**The shadow.** A process beside the supervisor (``agent_service``: started before the first ranks, stopped when the
run ends, so it outlives every restart of the ranks; ``resilience/ckpt/shadow_apply.py``) holds one replica of the
parameters and the optimizer. Rank 0 gives it its state once (the start, or any load that did not come from it):
the parameters, the optimizer's class, settings (``foreach``/``fused``), state and groups, and its CPU thread count.
After that the shadow never sees a model: it applies each step's reduced gradients with the same optimizer, so that
its parameters and optimizer state equal the training's bit for bit (checked at the end of every run:
``shadow_verified``).

**Every step** (``due`` holds at every step; ``checkpoint.every`` does not apply):

* where the gradients are final -- reduced by DDP (so the training's arithmetic is untouched: DDP's divisor and
  reduction order are its own), unscaled and clipped -- the optimizer's step post-hook (torch's public
  ``register_step_post_hook``) keeps rank 0's references to them and each group's hyperparameters as the step used
  them (the LR schedule moves the learning rate after the step);
* at the step's end (the base's ``save``, inside ``ckpt_begin`` .. ``ckpt_stall_end``: the per-step cost to training)
  rank 0 copies the gradients into a slot of a shared-memory ring (``shadow_ring.GradRing``, a copy after the
  reduction; a slot whose writer dies is never committed); every rank keeps its own parts of the job's state of
  that step (its RNG streams and data loader's position; rank 0 also the job-wide parts, the model's buffers and the
  groups' values after the step) in files with the shadow, which no training node's loss takes with it, and marks
  the step done. ``ckpt_stall_end`` carries ``wait_s`` (back-pressure), ``copy_s`` and ``bytes``.
* the shadow applies step ``k`` once its gradients and every rank's parts of it are there, in order. A bounded ring
  (``strategy.slots``) is the back-pressure: a rank waits before it reuses a slot or parts file of a step the shadow
  has not passed, so a slow shadow slows the training instead of losing steps. ``shadow_lag`` says how far behind
  it ran.

**After a failure** every rank restarts. Rank 0 asks the shadow to settle: it applies every step still complete (the
dead ranks published nothing more) and writes its state (``shadow_settled``); the ranks load it, with each rank's
own parts and rank 0's job-wide parts of that step (``ckpt_loaded`` source ``shadow``), and the shadow goes on with
the new generation of ranks. The step loaded is the last one every rank completed: the work lost is the step in
flight, at most one. Where the shadow holds nothing usable (the first start, a shadow that died and was started
anew, a rollback to a step before its state, a part missing) the ranks start from step 0 and say why
(``shadow_fallback``); nothing else is ever loaded.

Not here: sharded state (``parallel=fsdp|hsdp``), sparse gradients, CUDA (a CPU shadow's arithmetic is not a GPU's:
untested, refused), and anything that must outlive the job (``resume=``, ``checkpoint.on_notice``, a fault that ends
the job): the shadow is the job's own process and writes nothing to disk. The table of rules says so before launch.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resilience.caps import StrategyCaps
from resilience.ckpt import node_memory, shadow_control as sc, shadow_files as sf, shadow_ring as sr, shm_store
from resilience.ckpt.shadow_apply import init_state
from resilience.record import catalogue
from resilience.runtime.rank import RankRuntime
from resilience.settings.checks import require_bool, require_int, require_number
from resilience.state.train import TrainState
from resilience.strategies.base import CheckpointStrategy
from resilience.strategies.interval import AutoInterval
from resilience.workloads.base import Workload

SHADOW_INIT = "shadow_init"
SHADOW_FALLBACK = "shadow_fallback"
SHADOW_VERIFIED = "shadow_verified"
catalogue.register(SHADOW_INIT, ("strategy",), ("bytes", "duration_s"),
                   "strategy=shadow: rank 0 gave the shadow its state of `step` (the start, or a load from "
                   "elsewhere): from here on it applies every step")
catalogue.register(SHADOW_FALLBACK, ("strategy",), ("reason",),
                   "strategy=shadow: the shadow held no state the restart could use (why); the ranks go on from "
                   "`step`")
catalogue.register(SHADOW_VERIFIED, ("strategy",), ("matches", "sha256", "shadow_sha256", "caught_up_s"),
                   "strategy=shadow: at the run's end rank 0 compared the shadow's parameters and optimizer state "
                   "with its own at `step` (bit for bit); `caught_up_s`: how long the shadow took to get there")

CONNECT_WAIT_S = 30.0  # a rank waits this long for the supervisor's control block to appear


class ShadowService:
    """The shadow's process, run by the supervisor for the whole run (an ``AgentService``)."""

    role = None  # nothing reads the workers' role name

    def __init__(self, world_size: int, report_every: int, poll_s: float, stop_s: float) -> None:
        self.world_size, self.report_every, self.poll_s, self.stop_s = world_size, report_every, poll_s, stop_s
        self.proc: subprocess.Popen | None = None
        self.ctl: sc.Control | None = None

    def start(self, run_id: str, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.ctl = sc.Control.create(sf.ctl_path(shm_store.run_id(self.run_dir)), self.world_size)
        self._spawn()

    def _spawn(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "shadow.log", "ab") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "resilience.ckpt.shadow_apply", str(self.run_dir),
                 "--report-every", str(self.report_every), "--poll-s", str(self.poll_s)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.ctl[sc.STATE] = sc.STARTING
        self.ctl[sc.PID] = self.proc.pid

    def before_restart(self) -> None:
        """A shadow that died is started anew, empty: the restart then goes on from step 0 (``shadow_fallback``)."""
        if self.proc is not None and self.proc.poll() is not None:
            ctl = self.ctl
            ctl[sc.APPLIED], ctl[sc.GEN], ctl[sc.RESP_STATUS] = -1, -1, 0
            ctl[sc.RESP_SEQ] = ctl[sc.REQ_SEQ]
            ctl.message = ""
            self._spawn()

    def close(self) -> None:
        proc, ctl = self.proc, self.ctl
        if proc is not None and proc.poll() is None:
            try:
                ctl.request(sc.STOP, timeout_s=self.stop_s)
                proc.wait(timeout=self.stop_s)
            except (sc.ShadowGone, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if ctl is not None:
            ctl.close()
            self.ctl = None


class ShadowCheckpoint(CheckpointStrategy):
    """Every step's reduced gradients to a shadow process that applies the optimizer step; restarts load its state
    (see the module docstring)."""

    caps = StrategyCaps(family="gradient shadow", runs_in_supervisor=True, state_with_the_job=True,
                        dense_gradients=True,
                        sharded_refusal="its shadow steps one whole replica of the state with whole gradients")

    def __init__(self, every: Any, keep: int, slots: int = 4, timeout_s: float = 60.0, poll_s: float = 0.0005,
                 report_every: int = 10, verify_end: bool = True, world_size: int = 1,
                 device: str = "auto") -> None:
        super().__init__(every, keep)  # checkpoint.every does not apply: every step goes to the shadow
        if isinstance(self.interval, AutoInterval):
            raise ValueError("checkpoint.every=auto: strategy=shadow checkpoints every step through its shadow, so "
                             "there is no interval to choose; use a fixed checkpoint.every (it does not apply)")
        if str(device) == "cuda":
            raise ValueError("device=cuda: strategy=shadow applies the optimizer step on the CPU, whose arithmetic "
                             "is not the GPU's (untested, not bit-exact); use device=cpu")
        self.slots = require_int("strategy.slots", slots, 2)
        self.timeout_s = require_number("strategy.timeout_s", timeout_s, above=0)
        self.poll_s = require_number("strategy.poll_s", poll_s, above=0)
        self.report_every = require_int("strategy.report_every", report_every, 1)
        self.verify_end = require_bool("strategy.verify_end", verify_end)
        self.world_size = require_int("strategy.world_size", world_size, 1)
        self.ctl: sc.Control | None = None
        self.ring: sr.GradRing | None = None
        self._hook: Any = None
        self._captured: tuple[list[torch.Tensor | None], list[dict[str, Any]]] | None = None
        self._adopt_at: int | None = None  # the step a load took from the shadow (it goes on from there)
        self._published: int | None = None
        self.gen = 0

    # ---- roles' services ----------------------------------------------------------------------------------------
    def agent_service(self) -> ShadowService:
        return ShadowService(self.world_size, self.report_every, self.poll_s, stop_s=10.0)

    @classmethod
    def clean_up_run(cls, run_dir: Path) -> None:
        node_memory.cleanup(run_dir)  # the ring, the parts, the state files, the control block

    def check_host(self, workload: Workload, world_size: int, shards: int = 1) -> None:
        """Refuse a run whose shared memory does not fit: the ring's slots of gradients, the initial state and the
        shadow's dump (parameters and two optimizer tensors each, as Adam's), with room to write a file beside."""
        with torch.device("meta"):
            params = sum(p.numel() * p.element_size() for p in workload.build_model().parameters())
        need = (self.slots + 2 * 2 * 3) * params
        free = shm_store.free_bytes()
        if need > free:
            raise ValueError(f"strategy=shadow: its ring and state files need about {need / 1e6:,.0f} MB of "
                             f"{shm_store.SHM_DIR}, {free / 1e6:,.0f} MB is free; free some or use fewer "
                             f"strategy.slots")

    def due(self, step: int, total_steps: int) -> bool:
        return 0 < step <= total_steps  # every step, the last too (the end compares the shadow with the training)

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        if rt.device.type == "cuda":
            raise ValueError("device=cuda: strategy=shadow applies the optimizer step on the CPU, whose arithmetic "
                             "is not the GPU's (untested, not bit-exact); use device=cpu")
        self.rid = shm_store.run_id(rt.run_dir)
        if self.ctl is None:
            self.ctl = sc.Control.open(sf.ctl_path(self.rid), wait_s=CONNECT_WAIT_S)
        self.gen = rt.attempt

    # ---- load -------------------------------------------------------------------------------------------------
    def load(self, state: TrainState) -> int:
        self._adopt_at = None
        step = super().load(state)
        self._connect(state, step)
        return step

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        """The shadow's state of the last step it could apply, and every rank's parts of that step; nothing when it
        holds none (or one this restart may not use: said with ``shadow_fallback``)."""
        rt = self.rt
        choice: list[Any] = [None, None]
        if rt.rank == 0:
            choice = self._settle()
        dist.broadcast_object_list(choice, src=0)
        step, reason = choice
        if step is None:
            if reason is not None and rt.rank == 0:
                self._fall_back(reason)
            return None
        found, why = self._read(state, step)
        whys: list[Any] = [None] * rt.world_size
        dist.all_gather_object(whys, why)
        if any(whys):
            if rt.rank == 0:
                self._fall_back(f"the shadow's state of step {step} is not whole: "
                                + "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w))
            return None
        self._restore(state, found)
        self._adopt_at = step
        return step, "shadow", found["bytes"]

    def _settle(self) -> list[Any]:
        """Rank 0: the shadow applies what is complete and dumps its state; [step, None], or [None, why not]."""
        got, nbytes, _ = self.ctl.request(sc.SETTLE, timeout_s=self.timeout_s, poll_s=self.poll_s)
        bound = self.rt.load_max_step
        if got <= 0:
            return [None, "the shadow holds no state (a restarted shadow, or none applied yet)"
                    if self.rt.attempt > 0 else None]
        if bound is not None and got > bound:
            return [None, f"a rollback to step {bound} or earlier, and the shadow holds step {got} (it cannot go "
                          f"back)"]
        return [got, None]

    def _read(self, state: TrainState, step: int) -> tuple[dict[str, Any], str | None]:
        """Everything this rank loads, read and checked before any of it is written into the state."""
        rt, m = self.rt, self.slots + 1
        dumped = sf.read_state(sf.dump_path(self.rid))
        if dumped is None or dumped[0] != step:
            return {}, f"no intact dump of step {step} in {sf.dump_path(self.rid).name}"
        _, replica, nbytes = dumped
        params = _params(state.optimizer)
        if len(replica["params"]) != len(params) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(replica["params"], params)):
            return {}, "the shadow's parameters are not this model's"
        job = sf.get_parts(sf.parts_path(self.rid, 0, step % m), step)
        if job is None:
            return {}, f"rank 0's parts of step {step} are missing"
        own = job if rt.rank == 0 else None
        if state.parts.per_rank and rt.rank != 0:
            own = sf.get_parts(sf.parts_path(self.rid, rt.rank, step % m), step)
            if own is None:
                return {}, f"its own parts ({', '.join(state.parts.per_rank)}) of step {step} are missing"
        nbytes += job[1] + (own[1] if own is not None and rt.rank != 0 else 0)
        return {"replica": replica, "job": job[0], "own": own[0] if own else {}, "bytes": nbytes}, None

    def _restore(self, state: TrainState, found: dict[str, Any]) -> None:
        replica, job = found["replica"], found["job"]
        with torch.no_grad():
            for p, saved in zip(_params(state.optimizer), replica["params"]):
                p.copy_(saved)
        state.optimizer.load_state_dict(replica["optim"])
        for group, values in zip(state.optimizer.param_groups, job["groups"]):
            group.update(values)  # as after the step: the LR schedule has moved on since the shadow's step
        buffers = dict(state.model.named_buffers())
        with torch.no_grad():
            for name, saved in job["buffers"].items():
                buffers[name].copy_(saved)
        for name, part_state in job["job"].items():
            state.parts.job[name].load_state_dict(part_state)
        for name, part_state in found["own"].get("rank", {}).items():
            state.parts.per_rank[name].load_state_dict(part_state)

    def _fall_back(self, reason: str) -> None:
        self.rt.events.emit(SHADOW_FALLBACK, step=0, reason=reason, fsync=True)
        print(f"[rank 0 attempt {self.rt.attempt}] strategy=shadow: {reason}; going on from step 0", flush=True)

    def _connect(self, state: TrainState, step: int) -> None:
        """After the load: the shadow goes on from the state of ``step`` with this generation of ranks (its own
        state, or rank 0's sent now); rank 0 keeps the optimizer's gradients at each step from here on."""
        rt = self.rt
        self.gen = rt.attempt
        if rt.rank != 0:
            return
        opt = state.optimizer
        layout = sr.Layout.of(_params(opt))
        if self.ring is None or self.ring.layout != layout:
            if self.ring is not None:
                self.ring.close()
            self.ring = sr.GradRing.create(sf.ring_path(self.rid), layout, self.slots)
        if self._adopt_at == step:
            self.ctl.request(sc.ADOPT, gen=self.gen, world=rt.world_size, timeout_s=self.timeout_s,
                             poll_s=self.poll_s)
        else:
            t0 = time.monotonic()
            nbytes = sf.write_state(sf.init_path(self.rid), step, self.gen, init_state(opt, step))
            self.ctl.request(sc.INIT, gen=self.gen, world=rt.world_size, step=step, timeout_s=self.timeout_s,
                             poll_s=self.poll_s)
            os.unlink(sf.init_path(self.rid))  # read: its memory back
            rt.events.emit(SHADOW_INIT, step=step, bytes=nbytes, duration_s=time.monotonic() - t0)
        if self._hook is None:
            self._hook = opt.register_step_post_hook(self._keep)
            self._optimizer = opt

    def _keep(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer stepped: its gradients are the step's final ones (reduced, unscaled, clipped). Keep them
        (they outlive ``zero_grad``'s release) and each group's values as the step used them."""
        self._captured = ([p.grad for p in _params(optimizer)],
                          [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])

    # ---- every step -------------------------------------------------------------------------------------------
    def _save(self, step: int, state: TrainState) -> None:
        rt, ctl = self.rt, self.ctl
        waited = ctl.wait(lambda: ctl[sc.APPLIED] >= step - self.slots, self.timeout_s, self.poll_s,
                          f"to apply step {step - self.slots} (rank {rt.rank} at step {step})")
        t0 = time.monotonic()
        nbytes = 0
        if rt.rank == 0:
            captured, self._captured = self._captured, None
            grads, hyper = captured if captured is not None else (None, None)  # None: the scaler skipped the step
            meta = pickle.dumps((hyper, [g is not None for g in grads] if grads is not None else None),
                                protocol=pickle.HIGHEST_PROTOCOL)
            nbytes += self.ring.write(step, self.gen, grads, meta,
                                      before_commit=lambda: rt.fault_hook("during_checkpoint", step))
            ctl[sc.PUBLISHED] = step
            del captured, grads
        parts = self._parts(state)
        if parts is not None:
            nbytes += sf.put_parts(sf.parts_path(self.rid, rt.rank, step % (self.slots + 1)), step, self.gen, parts)
        if rt.rank != 0:
            rt.fault_hook("during_checkpoint", step)
        ctl.mark(rt.rank, self.gen, step)
        self._published = step
        self.end_stall(step, wait_s=waited, copy_s=time.monotonic() - t0, bytes=nbytes)

    def _parts(self, state: TrainState) -> dict[str, Any] | None:
        """This rank's own parts of the job's state as they stand after the step (rank 0: the job-wide ones too,
        the model's buffers and the groups' values); None where it has nothing to keep."""
        own = {name: part.state_dict() for name, part in state.parts.per_rank.items()}
        if self.rt.rank != 0:
            return {"rank": own} if own else None
        return {"rank": own, "job": {name: part.state_dict() for name, part in state.parts.job.items()},
                "buffers": {name: b.detach() for name, b in state.model.named_buffers()},
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups]}

    # ---- the end ----------------------------------------------------------------------------------------------
    def wait(self) -> None:
        """At the run's end rank 0 waits for the shadow to apply the last step and compares their states."""
        rt = self.rt
        if rt is None or rt.rank != 0 or not self.verify_end or self._published is None or self.ring is None:
            return
        opt = self._optimizer
        t0 = time.monotonic()
        self.ctl.request(sc.DIGEST_AT, step=self._published, timeout_s=self.timeout_s, poll_s=self.poll_s)
        caught_up = time.monotonic() - t0
        theirs = self.ctl.digest()
        mine = sf.replica_digest(_params(opt), opt.state_dict()["state"])
        rt.events.emit(SHADOW_VERIFIED, step=self._published, matches=mine == theirs, sha256=mine,
                       shadow_sha256=theirs, caught_up_s=caught_up, fsync=True)
        if mine != theirs:
            print(f"[rank 0 attempt {rt.attempt}] strategy=shadow: the shadow's state of step {self._published} "
                  f"differs from the training's: a restart from it would not be exact", flush=True)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its order (groups, then their params): how the ring and the shadow lay them."""
    return [p for g in optimizer.param_groups for p in g["params"]]
