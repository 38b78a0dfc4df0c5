"""The training loop: the only place that calls the roles, always in this order.

One attempt on one rank:

1. ``strategy.load`` restores the newest good checkpoint (or none: start at step 0);
2. for each step from there:
   ``strategy.before_step`` (``replica`` at reduced width takes the replacement in) -> ``control.begin`` (the
   step's position) -> ``fault_hook("before_forward")`` -> beat -> for each micro-batch (``recipe``: the
   ``train`` settings): batch -> forward -> beat -> backward (DDP all-reduces the gradients) -> beat ->
   ``fault_hook("before_optimizer_step")`` -> ``detectors.on_backward`` -> ``recipe.before_commit`` (unscale,
   clip) -> ``control.commit`` (the optimizer step) -> ``recipe.after_commit`` (LR schedule, counters, the
   ledger of samples) -> beat -> ``step_end`` event -> ``detectors.on_step_end`` -> at a checkpoint step the
   parts' hashes (train=real) -> ``strategy.save`` (beating ``CKPT_IO`` around it; it calls
   ``fault_hook("during_checkpoint")`` inside the write);
3. ``strategy.wait`` until every save is durable, then the parts' hashes and the final state hash (``run_end``;
   under a pipeline, ``parallel=pp``, the hash over every stage's).

Under a pipeline the step's micro-batches go through the stages under the parallelism's schedule (its
``StepRunner``, in the recipe) in place of the loop's own forward and backward; the order of calls is the same.

With ``fault=drain`` every step ends with the ranks agreeing which of them got their node's maintenance notice
(``resilience.rank.handover``): those end (``Drained``), the others ``strategy.hand_over`` the state to their
replacements. With ``checkpoint.on_notice=true`` every step ends with the ranks agreeing whether a preemption's notice came
(``resilience.rank.notice``); when it did, ``strategy.save_now`` (unless the step just saved) and
``strategy.wait``, then the rank ends (``NoticeHonoured``) and the run goes on in a new job.

When a step raises a ``RuntimeError`` (a collective failed: a peer died), ``strategy.recover`` either recovers in
place and names the step to go on from (``replica``), or re-raises and this process fails (every other strategy).

``control`` is the plain step, or the strategy's own when it owns the step (``OwnsStep``: torchft's quorum at
``begin``, which may move the position after a heal, and its commit vote, which may drop the step: then the same
step is trained again).

Beats go to the heartbeat board that the supervisor's hang and straggler detectors read.

Positions ("step" in events and in ``fault.at_step``) count completed optimizer steps, so a checkpoint at step
10 holds the state after 10 steps and a recovery from it replays from the 11th.
"""

from __future__ import annotations

import resource
import time

from omegaconf import DictConfig

from resilience.rank.detectors import RankDetectors
from resilience.rank.handover import Drained, MaintenanceNotice
from resilience.rank.notice import Notice, NoticeHonoured
from resilience.record.events import read_events
from resilience.record.board import BACKWARD_DONE, CKPT_IO, FINISHED, FORWARD_DONE, STEP_DONE, STEP_START, Beater
from resilience.runtime.pipeline import StepRunner, combined_sha256
from resilience.runtime.rank import RankRuntime
from resilience.settings.identity import job_first_attempt
from resilience.rank.recipe import Recipe
from resilience.ckpt.replica_shards import is_sharded
from resilience.state.train import TrainState, part_hashes, state_sha256
from resilience.strategies.base import CheckpointStrategy
from resilience.runtime.step import OwnsStep, StepControl
from resilience.workloads.base import Workload


class Trainer:
    """Runs one attempt of training on one rank (see the module docstring for the order of calls)."""

    def __init__(self, cfg: DictConfig, rt: RankRuntime, workload: Workload, state: TrainState,
                 strategy: CheckpointStrategy, detectors: RankDetectors, beater: Beater,
                 runner: StepRunner | None = None) -> None:
        self.cfg, self.rt, self.workload, self.state, self.strategy = cfg, rt, workload, state, strategy
        self.detectors, self.beater = detectors, beater
        # a strategy that owns the step may build the optimizer anew: the recipe's LR schedule follows it (fp16's
        # scaler never meets such a strategy: resilience.compat)
        control = strategy.step_control(state) if isinstance(strategy, OwnsStep) else None
        self.recipe = Recipe(cfg, rt, workload, state, runner)
        self.control = control or StepControl(state.optimizer, self.recipe.scaler)
        # where the real loop hashes its parts (the reference's at the same steps): every step where the
        # checkpoint steps are chosen as the run goes (checkpoint.every=auto)
        self.every = 1 if cfg.checkpoint.every == "auto" else int(cfg.checkpoint.every)
        self.steps = int(cfg.steps)
        self.log_every = int(cfg.log_every)
        # Where the previous attempt was hit: reaching it again marks the end of the recovery.
        faults = [e["step"] for e in read_events(rt.run_dir) if e["kind"] == "fault_injected"]
        self.resume_at = faults[-1] if faults and rt.attempt > 0 else None
        self.notice = Notice(rt.device) if cfg.checkpoint.on_notice else None
        # a job listens for a node's maintenance notice where one is announced (fault=drain)
        self.maintenance = MaintenanceNotice(rt.rank, rt.world_size, rt.device) \
            if rt.fault_hook.caps.hands_over else None

    def run(self) -> str:
        """Train to ``steps``; return the SHA-256 of the final model and optimizer state."""
        rt, ev = self.rt, self.rt.events
        start = self.strategy.load(self.state)
        ev.step = self.position = start
        if rt.rank == 0 and rt.attempt == job_first_attempt(self.cfg) > 0:  # a new job goes on with the run (resume=)
            print(f"resumed from step {start}", flush=True)
        self._check_resumed(start)
        if start > 0:
            self._hash_parts(start, "loaded")
        last_t, last_step = time.monotonic(), start
        step = start
        while step < self.steps:
            try:
                # the end of the previous step: inside the try, since a peer may die in the agreement (its node
                # went before the move); after the move every rank starts the next iteration with the agreement,
                # as the replacements do
                if self.maintenance is not None and (leaving := self.maintenance.leaving()):
                    step = ev.step = self.position = self._hand_over(step, leaving)
                    continue
                step = ev.step = self.position = self.strategy.before_step(self.state, step)
                step = ev.step = self.position = self.control.begin(step)
                if step >= self.steps:
                    self._check_resumed(step)
                    break  # healed into the final state: no step left to train
                loss_value = self._step(step)
            except RuntimeError as exc:  # a collective failed (torch's DistError is a RuntimeError): a peer died
                step = self.strategy.recover(self.state, self.position, exc)
                ev.step = step
                self._hash_parts(step, "recovered", collective=False)  # the survivors alone recover
                continue
            if loss_value is None:
                continue  # the step was dropped: train it again
            step += 1
            if self.notice is not None and step < self.steps and self.notice.agreed():
                self._save_on_notice(step)
            if rt.rank == 0 and (step % self.log_every == 0 or step == self.steps):
                now = time.monotonic()
                rate = (step - last_step) / max(now - last_t, 1e-9)
                print(f"[rank 0 attempt {rt.attempt}] step {step}/{self.steps}  loss {loss_value:.4f}  "
                      f"{rate:.1f} steps/s", flush=True)
                last_t, last_step = now, step
        self.beater.beat(self.steps, FINISHED)
        self.strategy.wait()
        self._hash_parts(self.steps, "end")  # the loader's state as it stands, before its workers are let go
        self.recipe.close()
        digest = state_sha256(self.state.full_state_dict())
        if rt.layout is not None:  # a stage's state is part of the whole: the hash of every stage's, on every rank
            digest = combined_sha256(digest, rt.layout)
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        ev.emit("run_end", step=self.steps, final_state_sha256=digest, peak_rss_mb=peak_rss_mb, fsync=True)
        return digest

    def _step(self, step: int) -> float | None:
        """One training step and what follows it (None: the step was dropped); ``self.position`` counts the
        optimizer steps applied so far."""
        rt, ev = self.rt, self.rt.events
        t0 = time.monotonic()
        rt.fault_hook("before_forward", step)
        self.beater.beat(step, STEP_START)
        loss, ids = self.recipe.forward_backward(step, lambda: self.beater.beat(step, FORWARD_DONE))
        self.beater.beat(step, BACKWARD_DONE)
        rt.fault_hook("before_optimizer_step", step)
        loss_value = loss.item()
        self.detectors.on_backward(step, loss_value)
        self.recipe.before_commit()
        if not self.control.commit():
            return None
        self.recipe.after_commit(step, ids)
        self.position = step + 1
        self.beater.beat(step, STEP_DONE)
        ev.step = step + 1
        ev.emit("step_end", loss=loss_value, duration_s=time.monotonic() - t0, **self.recipe.step_facts())
        self.detectors.on_step_end(step)
        if (step + 1) % self.every == 0 and step + 1 < self.steps:
            self._hash_parts(step + 1, "checkpoint step")
        if self.strategy.due(step + 1, self.steps):
            self.beater.beat(step, CKPT_IO)  # a slow save is not a hang: the longer deadline applies
            self.strategy.save(step + 1, self.steps, self.state)
            self.beater.beat(step, STEP_DONE)
        self._check_resumed(step + 1)
        return loss_value

    def _save_on_notice(self, step: int) -> None:
        """Save the state after ``step`` (unless that step's save just ran), wait until it is durable, end."""
        assert self.notice is not None and self.notice.at is not None
        self.rt.events.emit("notice", step=step, noticed_s=time.monotonic() - self.notice.at)
        if not self.strategy.due(step, self.steps):
            self._hash_parts(step, "checkpoint step")
            self.beater.beat(step, CKPT_IO)
            self.strategy.save_now(step, self.state)
        self.strategy.wait()
        self.rt.events.emit("notice_saved", step=step, saved_s=time.monotonic() - self.notice.at, fsync=True)
        if self.rt.rank == 0:
            print(f"[rank 0 attempt {self.rt.attempt}] saved step {step} on the preemption's notice; the run goes "
                  f"on with resume=", flush=True)
        raise NoticeHonoured(step)

    def _hand_over(self, step: int, leaving: list[int]) -> int:
        """The ranks in ``leaving`` got their node's maintenance notice: they end here; the others take their
        replacements into a new group and give them the state after ``step`` (nothing is rolled back)."""
        rt = self.rt
        if rt.rank in leaving:
            assert self.maintenance is not None and self.maintenance.at is not None
            rt.events.emit("drained", step=step, noticed_s=time.monotonic() - self.maintenance.at, fsync=True)
            raise Drained(step)
        if rt.rank == 0:
            print(f"[rank 0 attempt {rt.attempt}] rank(s) {leaving} leave their node on its maintenance notice: "
                  f"handing over at step {step}", flush=True)
        step = rt.events.step = self.strategy.hand_over(self.state, step, leaving)
        self._hash_parts(step, "recovered", collective=False)
        return step

    def _hash_parts(self, position: int, why: str, collective: bool = True) -> None:
        """The real loop's checked points (train=real): each part's hash, for the run's ``state_parts``. Where not
        every rank comes by (``collective=False``), a sharded model's parts, which gathering would need every rank
        for, are left to the next checked point."""
        if self.state.parts:
            parts = part_hashes(self.state, whole=collective or not is_sharded(self.state.model))
            self.rt.events.emit("parts_hashed", step=position, parts=parts, why=why)

    def _check_resumed(self, position: int) -> None:
        if self.resume_at is not None and position >= self.resume_at:
            self.rt.events.emit("resumed", step=position, fault_step=self.resume_at)
            if self.rt.rank == 0:
                print(f"[rank 0 attempt {self.rt.attempt}] back at step {self.resume_at}, where the fault hit",
                      flush=True)
            self.resume_at = None
