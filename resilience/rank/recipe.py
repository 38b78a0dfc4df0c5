"""What one optimizer step does under ``train`` (conf/train/*.yaml), and the parts of the job's state it keeps.

The replayable loop (``train=replayable``) re-seeds the global RNG from (seed, step, rank) before every step and
takes the batch that is a function of (seed, step, rank): nothing but model and optimizer is state. The real loop
(``train=real``) keeps the RNG streams, an LR schedule, a gradient scaler, a data loader's position and the job's
counters as named parts (``resilience.state.parts``), which every checkpoint must carry and every recovery
restore; the trainer hashes each part at the checked points so that a lost one is named (``state_parts``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from resilience.runtime.pipeline import StepRunner
from resilience.runtime.rank import RankRuntime
from resilience.state.parts import Counters, JobParts, RngState
from resilience.state.train import TrainState
from resilience.workloads.base import Workload, stream_seed

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class WarmupCosine:
    """The LR factor at an optimizer step: linear warm-up over ``warmup`` steps, then a cosine decay to
    ``min_ratio`` at ``total``. A class, not a lambda: LambdaLR's state dict keeps a callable object's fields."""

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        done = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * done))


class Recipe:
    """Micro-batches, autocast, scaler, clipping and schedule of one step; builds ``state.parts``."""

    def __init__(self, cfg: DictConfig, rt: RankRuntime, workload: Workload, state: TrainState,
                 runner: StepRunner | None = None) -> None:
        t = cfg.train
        self.rt, self.workload, self.state, self.runner = rt, workload, state, runner
        # whose batch a rank trains on, and how many batches a step takes: under a pipeline each stage of one
        # pipeline sees its pipeline's batch (the first stage its inputs, the last its targets)
        layout = rt.layout
        self.data_rank, self.replicas = (layout.replica, layout.replicas) if layout else (rt.rank, rt.world_size)
        self.reseed = str(t.rng) == "reseed"
        self.accum = int(t.grad_accum)
        self.clip = None if t.clip_norm is None else float(t.clip_norm)  # > 0 (settings.schema)
        precision = str(t.precision)
        self.autocast = AUTOCAST.get(precision)  # which workloads and strategies allow it: resilience.compat
        job: dict[str, Any] = {}
        per_rank: dict[str, Any] = {}
        if not self.reseed:
            per_rank["rng"] = RngState(stream_seed(workload.seed, rt.rank, "rng"))
        own = workload.build_scheduler(state.optimizer)  # one schedule or the other (resilience.compat)
        if own is not None:
            job["lr_scheduler"] = own
        elif str(t.lr_schedule) == "warmup_cosine":
            shape = WarmupCosine(int(t.warmup_steps), int(cfg.steps), float(t.min_lr_ratio))
            job["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(state.optimizer, shape)
        self.scaler = torch.amp.GradScaler(rt.device.type, init_scale=float(t.fp16_init_scale)) \
            if precision == "fp16" else None
        if self.scaler is not None:
            job["scaler"] = self.scaler
        self.data = self.ledger = None
        if str(t.data) == "loader":
            self.data, self.ledger = self._loader(t.loader, int(cfg.world_size))
            per_rank["dataloader"] = self.data
        self.counters = Counters() if job or per_rank else None
        if self.counters is not None:
            job["train_state"] = self.counters
        state.parts = JobParts(rt.rank, job, per_rank)

    def _loader(self, settings: DictConfig, world_size: int) -> tuple[Any, Any]:
        if self.workload.vocab < 256:
            raise ValueError(f"train.data=loader: a byte is a token, so workload.vocab={self.workload.vocab} "
                             f"must be >= 256")
        from resilience.data.dataset import TokenWindows
        from resilience.data.ledger import LedgerWriter
        from resilience.data.loader import LoaderData
        from resilience.data.tokens import prepare_tokens

        tokens = prepare_tokens(Path(str(settings.dir)))
        windows = self.workload.build_dataset(tokens, int(settings.samples)) or TokenWindows(
            tokens, self.workload.seq_len, int(settings.samples))
        data = LoaderData(windows, rank=self.rt.rank, world_size=world_size, batch_size=self.workload.batch_size,
                          seed=stream_seed(self.workload.seed, "data") % 2**32, shuffle=bool(settings.shuffle),
                          num_workers=int(settings.workers))
        return data, LedgerWriter(self.rt.run_dir, self.rt.rank, self.rt.events.attempt)

    def forward_backward(self, step: int, on_forward: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's micro-batches through forward and backward; the mean loss and the sample ids trained on."""
        if self.reseed:  # anything stochastic replays identically after a restart
            torch.manual_seed(stream_seed(self.workload.seed, step, self.rt.rank, "rng"))
        if self.runner is not None:  # a pipeline's schedule cuts the batch into micro-batches (fp32: resilience.compat)
            loss = self.runner.forward_backward(self._batch(step, 0, []), step)  # the step keys a log
            on_forward()
            return loss, None
        total, ids = None, []
        for micro in range(self.accum):
            batch = self._batch(step, micro, ids)
            with torch.autocast(self.rt.device.type, dtype=self.autocast) if self.autocast else nullcontext():
                loss = self.workload.loss(self.state.model, batch)
            on_forward()
            scaled = loss / self.accum if self.accum > 1 else loss  # one micro-batch: the loss itself, bit for bit
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total = scaled.detach() if total is None else total + scaled.detach()
        return total, torch.cat(ids) if ids else None

    def _batch(self, step: int, micro: int, ids: list) -> tuple[torch.Tensor, ...]:
        if self.data is None:  # one micro-batch: the batch of the step, as the replayable loop always had
            return self.workload.batch(step * self.accum + micro, self.data_rank, self.rt.device)
        sample_ids, x, y = self.data.next_batch(self.rt.device)
        ids.append(sample_ids.cpu())
        return x, y

    def before_commit(self) -> None:
        """Unscale (fp16) and clip the summed gradients before the optimizer step."""
        if self.scaler is not None:
            self.scaler.unscale_(self.state.optimizer)
        if self.clip is not None and self.runner is not None:  # a pipeline's: the norm over every stage's gradients
            self.runner.clip_(list(self.state.model.parameters()), self.clip)
        elif self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.state.model.parameters(), self.clip)

    def after_commit(self, step: int, ids: torch.Tensor | None) -> None:
        """The step was applied: advance the schedule and the counters, and record the samples it trained on."""
        scheduler = self.state.parts.job.get("lr_scheduler")
        if scheduler is not None:
            scheduler.step()
        if self.counters is not None:
            samples = self.workload.batch_size * self.accum * self.replicas
            epoch = self.data.epoch if self.data is not None else 0
            self.counters.advance(samples, samples * self.workload.tokens_per_sample, epoch)
        if self.ledger is not None and ids is not None:
            self.ledger.record(step + 1, ids)

    def step_facts(self) -> dict[str, float]:
        """What the ``step_end`` event adds: the learning rate applied next, and fp16's loss scale (it halves at a
        step whose gradients overflowed: that step was skipped)."""
        facts = {"lr": self.state.optimizer.param_groups[0]["lr"]} if "lr_scheduler" in self.state.parts.job else {}
        if self.scaler is not None:
            facts["loss_scale"] = float(self.scaler.get_scale())
        return facts

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        if self.data is not None:
            self.data.close()
