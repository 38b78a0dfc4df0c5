"""The gradient shadow of ``strategy=shadow``: ``python -m resilience.ckpt.shadow_apply RUN_DIR ...``.

One process beside the supervisor (its ``agent_service`` starts it before the first ranks and stops it when the run
ends), outliving every restart of the ranks. It holds one replica of the training's parameters and optimizer, built
from rank 0's state (``ShadowReplica``: the same optimizer class, hyperparameters, ``foreach``/``fused`` settings and
CPU thread count, so that the same step gives the same bits), and applies each step's reduced gradients to it, in
order, once every rank has kept its own parts of that step (``shadow_files``). So its state is always one that the
whole job can restart from: the step applied, with every rank's RNG streams and data position of that step.

Its loop answers rank 0's requests first (``INIT`` from a state file, ``SETTLE``: apply every complete step, then dump
the state for a restart, ``ADOPT`` a new generation of ranks, ``DIGEST_AT`` a step, ``STOP``), then applies the next
step if it is complete, else naps (0.5 ms, doubling to 5 ms while idle). It records how far behind the training it
runs (``shadow_lag``, every ``report_every`` steps) and what a restart took from it (``shadow_settled``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pickle
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from resilience.ckpt import shadow_control as sc, shadow_files as sf, shadow_ring as sr
from resilience.ckpt.shm_store import run_id
from resilience.proc.orphans import killed_with_parent
from resilience.record import catalogue
from resilience.record import torch_workarounds  # noqa: F401 - its kind first: the catalogue's order (plug-ins last)
from resilience.record.events import EventLog

# The kinds of event the shadow records, catalogued here since its process imports this module alone; the ranks'
# are beside the strategy's class (resilience/strategies/shadow.py).
STARTED = "shadow_started"
LAG = "shadow_lag"
SETTLED = "shadow_settled"
STOPPED = "shadow_stopped"
catalogue.register(STARTED, ("strategy",), ("pid", "threads"),
                   "strategy=shadow: the gradient shadow's process is up beside the supervisor (empty until rank 0 "
                   "sends it a state)")
catalogue.register(LAG, ("strategy",), ("steps", "lag_s_mean", "lag_s_max", "apply_s_mean", "lag_steps_max"),
                   "strategy=shadow: the shadow applied `steps` more steps up to `step`; how long after rank 0 "
                   "published each it was applied (`lag_s_*`), its optimizer step's time, how many published steps "
                   "it ran behind at most")
catalogue.register(SETTLED, ("strategy",), ("drained", "bytes", "duration_s"),
                   "strategy=shadow: after a failure the shadow applied the `drained` steps still complete and wrote "
                   "its state of `step` (`bytes`) for the restarted ranks (-1: it held none)")
catalogue.register(STOPPED, ("strategy",), ("applied",),
                   "strategy=shadow: the shadow's process ends with the run, at `step`, after `applied` steps")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    module, _, qualname = name.rpartition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def init_state(optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What the shadow is built from: rank 0's parameters (the optimizer's order) and optimizer at ``step``."""
    return {"step": step, "cls": class_name(optimizer), "defaults": dict(optimizer.defaults),
            "groups": [len(g["params"]) for g in optimizer.param_groups],
            "params": [p.detach().cpu() for g in optimizer.param_groups for p in g["params"]],
            "optim": optimizer.state_dict(), "threads": torch.get_num_threads()}


class ShadowReplica:
    """Parameters and optimizer of one replica, stepped with gradients handed in; no model, no forward pass."""

    def __init__(self, init: dict[str, Any]) -> None:
        torch.set_num_threads(int(init["threads"]))  # CPU kernels split work by thread count: the rank's
        self.params = [p.detach().clone() for p in init["params"]]
        it = iter(self.params)
        groups = [{"params": [next(it) for _ in range(n)]} for n in init["groups"]]
        cls = optimizer_class(init["cls"])
        takes = inspect.signature(cls.__init__).parameters
        self.optimizer = cls(groups, **{k: v for k, v in init["defaults"].items() if k in takes})
        self.optimizer.load_state_dict(init["optim"])  # every group's values and the state, as the rank's
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.step = int(init["step"])

    def apply(self, step: int, grads: list[torch.Tensor] | None, meta: bytes) -> None:
        """Step ``step``: each group's hyperparameters as the training's step used them, then the optimizer step with
        ``grads`` (copied in; None: the training's optimizer did not step, fp16's scaler skipped it)."""
        hyper, present = pickle.loads(meta)
        if grads is not None:
            for group, values in zip(self.optimizer.param_groups, hyper):
                group.update(values)
            for i, (p, src, has) in enumerate(zip(self.params, grads, present)):
                if has:
                    buf = self.grads[i]
                    if buf is None:
                        buf = self.grads[i] = torch.empty_like(p)
                    buf.copy_(src)
                    p.grad = buf
                else:
                    p.grad = None
            self.optimizer.step()
            for p in self.params:
                p.grad = None
        self.step = step

    def state(self) -> dict[str, Any]:
        return {"params": self.params, "optim": self.optimizer.state_dict()}

    def digest(self) -> str:
        return sf.replica_digest(self.params, self.optimizer.state_dict()["state"])


class Shadow:
    """The process's loop over the control block (see the module docstring)."""

    def __init__(self, run_dir: Path, report_every: int, poll_s: float) -> None:
        self.run_dir, self.report_every, self.poll_s = run_dir, report_every, poll_s
        self.rid = run_id(run_dir)
        self.ctl = sc.Control.open(sf.ctl_path(self.rid), wait_s=10.0)
        self.events = EventLog(run_dir, rank=None, attempt=0)
        self.replica: ShadowReplica | None = None
        self.ring: sr.GradRing | None = None
        self.layout: sr.Layout | None = None
        self.gen = -1  # the generation of ranks whose steps it applies
        self.base = 0  # the step it held when that generation began
        self.world = 1
        self.pending_digest = 0  # the request number of a digest not yet answered (its step not yet applied)
        self._window: list[tuple[float, float, int]] = []  # (lag_s, apply_s, lag_steps) since the last report
        self.applied = 0

    # ---- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        ctl = self.ctl
        ctl[sc.STATE] = sc.EMPTY
        self.events.emit(STARTED, pid=os.getpid(), threads=torch.get_num_threads())
        nap = self.poll_s
        while True:
            seq = ctl[sc.REQ_SEQ]
            if seq != ctl[sc.RESP_SEQ] and seq != self.pending_digest:
                self.pending_digest = 0  # a newer request: whoever waited for the digest is gone
                kind = ctl[sc.REQ_KIND]
                if kind == sc.STOP:
                    self._answer(0, 0, 0)
                    break
                self._handle(kind)
                nap = self.poll_s
                continue
            if self._apply_next():
                nap = self.poll_s
                continue
            if self.pending_digest and self._digest_ready():
                continue
            time.sleep(nap)
            nap = min(nap * 2, 0.005)
        self._report(force=True)
        self.events.emit(STOPPED, step=self.replica.step if self.replica else 0, applied=self.applied)
        ctl[sc.STATE] = sc.STOPPED

    def _handle(self, kind: int) -> None:
        ctl, t0 = self.ctl, time.monotonic_ns()
        try:
            if kind == sc.INIT:
                self._init(ctl[sc.REQ_GEN], ctl[sc.REQ_WORLD], ctl[sc.REQ_STEP])
                self._answer(self.replica.step, 0, time.monotonic_ns() - t0)
            elif kind == sc.SETTLE:
                step, nbytes, drained = self._settle()
                self._answer(step, nbytes, time.monotonic_ns() - t0)
                self.events.emit(SETTLED, step=step, drained=drained, bytes=nbytes,
                                 duration_s=(time.monotonic_ns() - t0) / 1e9)
            elif kind == sc.ADOPT:
                self._adopt(ctl[sc.REQ_GEN], ctl[sc.REQ_WORLD])
                self._answer(self.replica.step, 0, time.monotonic_ns() - t0)
            elif kind == sc.DIGEST_AT:
                self.pending_digest = ctl[sc.REQ_SEQ]  # answered once the step is applied (_digest_ready)
                self._digest_t0 = t0
            else:
                raise ValueError(f"unknown request {kind}")
        except Exception as exc:
            traceback.print_exc()
            ctl.message = f"{type(exc).__name__}: {exc}"
            ctl[sc.RESP_STATUS] = 1
            ctl[sc.RESP_SEQ] = ctl[sc.REQ_SEQ]

    def _answer(self, step: int, nbytes: int, ns: int) -> None:
        ctl = self.ctl
        ctl[sc.RESP_STEP], ctl[sc.RESP_BYTES], ctl[sc.RESP_NS], ctl[sc.RESP_STATUS] = step, nbytes, ns, 0
        ctl[sc.RESP_SEQ] = ctl[sc.REQ_SEQ]

    # ---- requests -----------------------------------------------------------------------------------------------
    def _init(self, gen: int, world: int, step: int) -> None:
        """Rank 0's state of ``step`` (after a fresh start, or a load from elsewhere) replaces whatever was held."""
        found = sf.read_state(sf.init_path(self.rid))
        if found is None or found[0] != step:
            raise ValueError(f"no intact initial state of step {step} at {sf.init_path(self.rid)}")
        self.replica = ShadowReplica(found[1])
        del found
        self._open_ring()
        self._adopt(gen, world)
        self.ctl[sc.STATE] = sc.HOLDING

    def _open_ring(self) -> None:
        layout = sr.Layout.of(self.replica.params)
        if self.ring is not None:
            self.ring.close()
        self.ring = sr.GradRing.open(sf.ring_path(self.rid), layout)
        if self.ring is None:
            raise ValueError(f"no gradient ring for this model at {sf.ring_path(self.rid)}")

    def _adopt(self, gen: int, world: int) -> None:
        """From now on apply the steps of generation ``gen`` of ``world`` ranks, from the step held."""
        if self.replica is None:
            raise ValueError("holds no state to go on from")
        self.gen, self.world, self.base = gen, world, self.replica.step
        self.events.attempt = gen
        self.ctl[sc.GEN], self.ctl[sc.WORLD] = gen, world
        self.ctl[sc.APPLIED] = self.replica.step
        if self.ring is None:
            self._open_ring()

    def _settle(self) -> tuple[int, int, int]:
        """The ranks are gone: apply every step that is complete, then dump the state for the next ones. (-1, 0, 0)
        when nothing is held."""
        if self.replica is None:
            return -1, 0, 0
        drained = 0
        while self._apply_next():
            drained += 1
        self._report(force=True)
        nbytes = sf.write_state(sf.dump_path(self.rid), self.replica.step, self.gen, self.replica.state())
        return self.replica.step, nbytes, drained

    def _digest_ready(self) -> bool:
        ctl = self.ctl
        if self.replica is None or self.replica.step < ctl[sc.REQ_STEP]:
            return False
        self.pending_digest = 0
        ctl.set_digest(self.replica.digest())
        self._answer(self.replica.step, 0, time.monotonic_ns() - self._digest_t0)
        return True

    # ---- steps --------------------------------------------------------------------------------------------------
    def _complete(self, step: int) -> sr.Slot | None:
        """The slot of ``step`` if every rank of the generation has kept its parts of it too."""
        if self.ring is None:
            return None
        slot = self.ring.slot(step)
        if slot is None or slot.gen != self.gen:
            return None
        for rank in range(self.world):
            gen, marked = self.ctl.marked(rank)
            if gen != self.gen or marked < step:
                return None
        return slot

    def _apply_next(self) -> bool:
        if self.replica is None or self.gen < 0:
            return False
        step = self.replica.step + 1
        slot = self._complete(step)
        if slot is None:
            return False
        t0 = time.monotonic_ns()
        meta = self.ring.meta(slot)
        grads = self.ring.views(slot.index) if slot.flags & sr.STEPPED else None
        self.replica.apply(step, grads, meta)
        if not self.ring.still(slot):  # overwritten while read: never, while rank 0 waits for this step's apply
            raise RuntimeError(f"the slot of step {step} was overwritten while it was applied")
        done = time.monotonic_ns()
        self.ctl[sc.APPLIED_NS] = done
        self.ctl[sc.APPLIED] = step
        self.applied += 1
        self._window.append(((done - slot.commit_ns) / 1e9, (done - t0) / 1e9, self.ctl[sc.PUBLISHED] - step))
        self._report()
        return True

    def _report(self, force: bool = False) -> None:
        if not self._window or (len(self._window) < self.report_every and not force):
            return
        lags = [w[0] for w in self._window]
        self.events.emit(LAG, step=self.replica.step, steps=len(lags), lag_s_mean=sum(lags) / len(lags),
                         lag_s_max=max(lags), apply_s_mean=sum(w[1] for w in self._window) / len(lags),
                         lag_steps_max=max(w[2] for w in self._window))
        self._window = []

    def close(self) -> None:
        self.events.close()
        if self.ring is not None:
            self.ring.close()
        self.ctl.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m resilience.ckpt.shadow_apply")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--poll-s", type=float, default=0.0005)
    args = parser.parse_args(argv)
    killed_with_parent()  # never outlive the supervisor that started it, however it ends
    torch.use_deterministic_algorithms(True)
    shadow = Shadow(args.run_dir, args.report_every, args.poll_s)
    try:
        shadow.run()
    except BaseException as exc:
        traceback.print_exc()
        shadow.ctl.message = f"{type(exc).__name__}: {exc}"[:500]
        shadow.ctl[sc.STATE] = sc.FAILED
        raise
    finally:
        shadow.close()


if __name__ == "__main__":
    main(sys.argv[1:])
