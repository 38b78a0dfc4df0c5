"""Recovery from a live replica instead of a checkpoint, after Swift (Zhong et al., IEEE TPDS 2024) and torchft.

No checkpoint is ever written. In data-parallel training every rank holds a full replica of the model and the
optimizer, so when one rank dies the state is still in its peers' memory. The survivors keep running: their
collective fails, the supervisor starts a replacement for the dead rank (``resilience.supervise.replacing``), and
the replacement receives model and optimizer state from a healthy replica
(``resilience.ckpt.replica_transfer``: pipelined, bucketed). Nothing
is reloaded from disk and no step is lost. It cannot survive the loss of every replica at once (then the run
fails, and says so). What the survivors do while the replacement starts is ``strategy.while_replacing``:

* ``wait`` (Swift): they wait for it, re-form the group with it (``resilience.rank.group``), make the replicas
  consistent and go on. The cost is the replacement's start-up plus one state transfer; the run ends bit-exact
  with the fault-free one.
* ``continue`` (torchft): they form a group of their own at once and train on at reduced width; when the
  replacement is ready they take it in at the next step boundary and it heals from the most advanced replica. At
  reduced width each survivor trains its own shard of each step's data, ``batch(step, rank)`` as before, and the
  gradients are averaged over the survivors only: the global batch of those steps is smaller (the dead rank's
  shards are skipped, not redistributed), as in torchft. The trajectory therefore differs from the fault-free run
  by design (``bit_exact`` says so in ``result.json``); what is checked is that every replica ends in the same state.

How long the survivors wait for a replacement is a deadline of its own, ``strategy.replace_timeout_s``, not the
collective timeout: a replacement must start an interpreter, import torch and build its roles, which on a busy host
takes far longer than any collective should. ``auto`` sizes it from this run's own measured rank start
(the supervisor's ``launch`` -> the slowest first-generation ``run_start``: the same work, on the same host under the
same load, as the probe's ``rank_start_s``) times ``strategy.replace_start_factor``. A replacement that misses it
ends the survivor with a ``replacement_too_slow`` event naming the deadline and its basis.

Under ``parallel=hsdp`` (``wait`` only) the same happens per shard: the replacement receives its shard from the rank
holding the same shard in another replica group, and the survivors rebuild their sharded model over the re-formed
group from their own memory (``resilience.ckpt.replica_shards``). ``parallel=fsdp`` has no replica to take a
shard from and is refused.

Under ``parallel=pp_dp`` (``wait`` only) the same happens per pipeline stage: the replacement takes its stage from
the rank holding the same stage in another pipeline (its twin), and every survivor lets go of its stage's schedule
and groups before the world's group is re-formed (which frees a survivor still blocked on it), then forms every
pipeline's and stage's group again, in the one order every rank follows, and keeps its state
(docs/pipeline_parallel.md, "replica: a lost stage healed from its twin").
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from resilience.caps import StrategyCaps
from resilience.runtime.pipeline import StepRunner
from resilience.settings.checks import require_choice, require_number
from resilience.record.events import read_events
from resilience.state.train import TrainState
from resilience.strategies.base import CheckpointStrategy
from resilience.ckpt.replica_shards import Held, is_sharded, rebuild, release
from resilience.ckpt.replica_transfer import reconcile

MODES = ("wait", "continue")


class ReplicaRecovery(CheckpointStrategy):
    # A replacement's model and optimizer are built uninitialised (``resilience.state.uninitialised``): the heal
    # overwrites every byte of them, at any position (``reconcile(..., empty=True)``), so the initialisation would
    # be wasted work on its critical path.
    # With while_replacing=continue the survivors train on in a group of their own.
    caps = StrategyCaps(saves=False, recovers_in_place=True, overwrites_replacement_state=True, shards_state=True,
                        heals_stages=True,
                        when={"while_replacing=continue": {
                            "keeps_world_group": False, "shards_state": False, "heals_stages": False,
                            "sharded_refusal": "strategy.while_replacing=continue: the survivors alone cannot form "
                                               "HSDP's mesh, which while_replacing=wait keeps"}})

    def __init__(self, every: int, keep: int, while_replacing: str = "wait", replace_timeout_s: float | str = "auto",
                 replace_start_factor: float = 10.0) -> None:
        super().__init__(every, keep)
        self.while_replacing = require_choice("strategy.while_replacing", while_replacing, MODES)
        self.caps = self.caps.under(while_replacing=self.while_replacing)
        if replace_timeout_s != "auto":
            replace_timeout_s = require_number("strategy.replace_timeout_s", replace_timeout_s, above=0)
        self.replace_timeout_s = replace_timeout_s
        self.replace_start_factor = require_number("strategy.replace_start_factor", replace_start_factor, above=0)
        self._deadline: dict[str, Any] | None = None  # computed at the first fault
        self._replacing: list[int] | None = None  # at reduced width: the ranks being replaced
        self._state: TrainState | None = None
        self._held: Held | None = None  # sharded: a survivor's state while the group is re-formed
        self._runner: StepRunner | None = None  # a pipeline stage's (pp_dp): its groups are formed again in a heal

    def _save(self, step: int, state: TrainState) -> None:
        raise AssertionError("replica never saves")

    def attach_runner(self, runner: StepRunner | None) -> None:
        self._runner = runner

    def _stage(self) -> int | None:
        """The pipeline stage this rank holds (its replicas hold the same one), or None: not pipelined."""
        return None if self.rt.layout is None else self.rt.layout.stage

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        rt = self.rt
        if rt.attempt == 0:
            rt.events.emit("replica_mode", while_replacing=self.while_replacing)
            return None  # the first generation: every rank builds the same initial state from the seed
        # A replacement, in the group its survivors re-formed with it: take the state of a healthy replica.
        t0, built_empty = time.monotonic(), state.uninitialised
        done = reconcile(state, None, rt.device, empty=True, stage=self._stage())
        state.uninitialised = False  # every byte is the replica's now
        rt.events.emit("replica_heal", step=done.position, source=f"replica:{done.source}",
                       transfer_s=done.transfer_s, bytes=done.nbytes, heal_s=time.monotonic() - t0,
                       uninitialised=built_empty, stage=self._stage())
        return done.position, f"replica:{done.source}", done.nbytes

    def recover(self, state: TrainState, position: int, error: BaseException) -> int:
        """A survivor: re-form the group (with the replacement, or without it at reduced width), go on."""
        rt = self.rt
        t0 = time.monotonic()
        deadline = self.replace_deadline()
        rt.events.emit("peer_lost", step=position, error=f"{type(error).__name__}: {error}"[:300], fsync=True,
                       **deadline)
        if self.while_replacing == "continue" and self._replacing is None:
            self._replacing = rt.group.shrink(error)  # re-raises if no replacement comes: this rank fails too
            self._state = state
            rt.events.attempt = rt.group.generation
            self._rewrap(state)
            rt.events.emit("reduced_group", step=position, generation=rt.group.generation,
                           participants=rt.world_size - len(self._replacing), replacing=self._replacing,
                           duration_s=time.monotonic() - t0)
            return position
        # wait mode, or a collective failed at reduced width (a survivor or the replacement was lost): wait for the
        # next generation with all of them
        return self._with_replacements(state, position, t0, error)

    def hand_over(self, state: TrainState, position: int, leaving: list[int]) -> int:
        """Ranks ``leaving`` end on their node's maintenance notice (fault=drain): wait for their spares and heal
        them at this step boundary, as after a loss without notice but with no collective broken and no step cut
        short (in either mode: a planned move has nothing to train on at reduced width for)."""
        t0 = time.monotonic()
        self.rt.events.emit("handover", step=position, leaving=leaving, fsync=True, **self.replace_deadline())
        return self._with_replacements(state, position, t0,
                                       RuntimeError(f"rank(s) {leaving} left their node on a maintenance notice"))

    def _with_replacements(self, state: TrainState, position: int, t0: float, error: BaseException) -> int:
        """Wait for the next generation with every replacement in it, form its group, heal; the position."""
        rt = self.rt
        self._replacing = None
        if state.model is not None and is_sharded(state.model):  # let go of the broken groups before waiting
            self._held = release(state, error)
        if self._runner is not None:  # a pipeline stage: its schedule and groups too (their sockets then close)
            self._runner.release()
            if error.__traceback__ is not None:  # the failed step's frames hold the schedule, and so the groups
                traceback.clear_frames(error.__traceback__)
            gc.collect()
        try:  # re-raises if no new generation opens: then this rank fails too
            generation = rt.group.rejoin(error, self.replace_deadline()["replace_timeout_s"])
        except TimeoutError as exc:
            raise self._too_slow(position, t0, exc) from error
        t_joined = time.monotonic()
        rt.events.attempt = generation  # this process lives on into the new generation (rt.attempt follows)
        return self._heal(state, position, t0, t_joined)

    def before_step(self, state: TrainState, position: int) -> int:
        """At reduced width: take the replacements in once every one is ready (all survivors decide together)."""
        if self._replacing is None:
            return position
        self._state = state  # for ``wait``, at the end of the run
        ready = torch.tensor([int(self.rt.group.replacements_ready(self._replacing))], dtype=torch.int64,
                             device=self.rt.device)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # a survivor that has not seen them yet keeps the others
        if not ready.item():
            return position
        t0 = time.monotonic()
        self._replacing = None
        self.rt.group.regrow()
        return self._heal(state, position, t0, time.monotonic())

    def wait(self) -> None:
        """The end of the run at reduced width: the replacement heals into the final state before anyone leaves
        (else it would wait in vain for its group and the run could not end with every replica)."""
        if self._replacing is None:
            return
        t0 = time.monotonic()
        while not self.rt.group.replacements_ready(self._replacing):
            if time.monotonic() > t0 + self.replace_deadline()["replace_timeout_s"]:
                raise self._too_slow(self.rt.events.step, t0, TimeoutError(
                    f"the replacement of rank(s) {self._replacing} did not join at the end of the run"))
            time.sleep(0.02)
        t0 = time.monotonic()
        self._replacing = None
        self.rt.group.regrow()
        self._heal(self._state, self.rt.events.step, t0, time.monotonic())

    def replace_deadline(self) -> dict[str, Any]:
        """``replace_timeout_s`` in seconds, with its basis: the setting, or ``auto``'s measured rank start x factor."""
        if self._deadline is None:
            if self.replace_timeout_s != "auto":
                self._deadline = {"replace_timeout_s": self.replace_timeout_s, "replace_basis": "setting"}
            else:
                start = measured_rank_start_s(read_events(self.rt.run_dir))
                if start is None:  # no supervisor launch on record: the collective timeout, as before
                    self._deadline = {"replace_timeout_s": self.rt.group.timeout.total_seconds(),
                                      "replace_basis": "timeouts.collective_s (no measured rank start)"}
                else:
                    self._deadline = {"replace_timeout_s": self.replace_start_factor * start,
                                      "replace_basis": f"{self.replace_start_factor:g} x measured rank start "
                                                       f"{start:.2f} s", "rank_start_s": start}
        return self._deadline

    def _too_slow(self, position: int, t0: float, exc: BaseException) -> RuntimeError:
        """The recorded outcome of a replacement that missed the deadline; the survivor then fails."""
        deadline = self.replace_deadline()
        self.rt.events.emit("replacement_too_slow", step=position, waited_s=time.monotonic() - t0, fsync=True,
                            **deadline)
        return RuntimeError(f"replica: {exc} (strategy.replace_timeout_s: {deadline['replace_timeout_s']:.1f} s, "
                            f"{deadline['replace_basis']}); this survivor gives up")

    def _rewrap(self, state: TrainState) -> None:
        if self._held is not None:  # sharded: built again over the new group's mesh, from this rank's memory
            held, self._held = self._held, None
            rebuild(state, self.rt, held)
            return
        if self._runner is not None:  # a pipeline stage keeps its module: the groups and the schedule are new
            self._runner.regroup()
            state.optimizer.zero_grad(set_to_none=True)
            return
        state.model = self.rt.wrap_model(state.model.module)  # the old DDP is bound to the broken group
        state.optimizer.zero_grad(set_to_none=True)  # a backward cut short may have left partial gradients

    def _heal(self, state: TrainState, position: int, t0: float, t_joined: float) -> int:
        """In the full group again: every rank takes the most advanced replica's state (the replacement's heal)."""
        rt = self.rt
        self._rewrap(state)
        t_regrouped = time.monotonic()
        done = reconcile(state, position, rt.device, stage=self._stage())
        rt.events.emit("rejoined", step=done.position, generation=rt.group.generation, from_step=position,
                       source=f"replica:{done.source}", received=done.received, bytes=done.nbytes,
                       rejoin_s=t_joined - t0, duration_s=time.monotonic() - t0, stage=self._stage(),
                       regroup_s=t_regrouped - t_joined)
        if rt.rank == 0:
            whose = "state" if self._stage() is None else f"stage {self._stage()}'s state"
            print(f"[rank 0 attempt {rt.group.generation}] rejoined the group at step {done.position} "
                  f"({whose} from rank {done.source})", flush=True)
        return done.position


def measured_rank_start_s(events: list[dict]) -> float | None:
    """This run's cold rank start: the supervisor's ``launch`` -> the last first-generation ``run_start`` (every
    rank has then started an interpreter, imported torch, built its roles and formed the group). A first generation
    forked preloaded skipped the imports a replacement, always cold, pays: its zygote's import time (``preload_s``)
    is added, with the pipeline pool's imports its supervisor inherited (an over-estimate where the zygote imported
    while the supervisor was still starting, and by the supervisor's own imports the pool's include, as a deadline
    may be: without them a preloaded start of 0.16 s on a loaded host made a 1.6 s deadline a cold replacement
    missed, and in the pipeline matrix one of 0.38 s a 3.8 s deadline)."""
    launch = next((e for e in events if e["kind"] == "launch" and e["rank"] is None), None)
    starts = [e["t_mono"] + (e.get("preload_s") or 0.0) for e in events
              if e["kind"] == "run_start" and e["attempt"] == 0]
    return max(starts) - launch["t_mono"] if launch and starts else None
