"""Silent data corruption: bits flipped in place in live tensors, or in the bytes of a committed checkpoint.

Stands for the "Silent data corruption" and memory faults of real fleets (6 of Llama 3 405B's 419 interruptions
were attributed to SDC; HBM3 and SRAM faults were another 91). ``fault.target`` picks where:

* ``weights``     a parameter of one rank (its replicas diverge)
* ``optimizer``   an Adam moment of one rank
* ``grads_post``  a gradient after the all-reduce, on one rank (before the optimizer step)
* ``grads_pre``   a gradient bucket before the all-reduce: the error is summed into every replica alike
* ``activations`` the output of one layer in one forward pass of one rank
* ``checkpoint``  a byte of the newest committed checkpoint's data file (found only when it is loaded)

The element is drawn from the fault's seed; ``fault.bit`` is an index or a class (sign, exponent, mantissa, random)
and ``fault.bits`` how many distinct bits flip (real corruptions are often multi-bit).
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from injectors.base import Injector
from resilience.settings.checks import require_int
from injectors.bits import BIT_CLASSES, choose_bits, flip_bits, pick_element
from resilience.runtime.reduce import reduce_hook_for
from resilience.state.train import TrainState
from resilience.ckpt.commit import CheckpointDir
from resilience.workloads.base import Workload, stream_seed

TARGETS = ("weights", "optimizer", "grads_post", "grads_pre", "activations", "checkpoint")
# The phase each in-step target acts at; grads_pre and activations act inside backward / forward.
TARGET_PHASE = {"weights": "before_forward", "optimizer": "before_forward", "grads_post": "before_optimizer_step",
                "grads_pre": "before_forward", "activations": "before_forward", "checkpoint": "before_forward"}


class BitFlip(Injector):

    # Its targets reach into DDP's module and reduction (grads_pre hooks it); target=checkpoint acts on a checkpoint.
    caps = replace(Injector.caps, reaches_into_ddp=True,
                   when={**Injector.caps.when, "target=checkpoint": {"needs_checkpoint": "fault.target=checkpoint"}})

    def __init__(self, target: str = "weights", bit: int | str = "exponent", bits: int = 1, **trigger: Any) -> None:
        if target not in TARGETS:
            raise ValueError(f"fault.target={target}: must be one of {', '.join(TARGETS)}")
        if trigger.get("phase") is None:
            trigger["phase"] = TARGET_PHASE[target]
        super().__init__(**trigger)
        if self.phase != TARGET_PHASE[target]:
            raise ValueError(f"fault.phase={self.phase}: fault.target={target} acts at {TARGET_PHASE[target]}")
        if not isinstance(bit, int) and bit not in BIT_CLASSES:
            raise ValueError(f"fault.bit={bit}: must be a bit index or one of {', '.join(BIT_CLASSES)}")
        self.target, self.bit, self.nbits = target, bit, require_int("fault.bits", bits, 1)
        self.hooks_reduction = target == "grads_pre"
        self.caps = self.caps.under(target=target)
        self._step: int | None = None
        self._handles: list[Any] = []

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if self.target == "optimizer" and self.at_step < 1:
            raise ValueError("fault.at_step=0: fault.target=optimizer needs at least one step (Adam has no state yet)")
        if self.target == "checkpoint" and ckpt_every is not None and self.at_step <= ckpt_every:
            raise ValueError(f"fault.at_step={self.at_step}: fault.target=checkpoint needs a committed checkpoint "
                             f"before it (at_step > checkpoint.every={ckpt_every})")

    def check_workload(self, workload: Workload) -> None:
        """``fault.bit`` and ``fault.bits`` fit the model's floating-point tensors (built on the meta device)."""
        with torch.device("meta"):
            dtypes = {p.dtype for p in workload.build_model().parameters() if p.is_floating_point()}
        for dtype in sorted(dtypes, key=str):
            choose_bits(dtype, self.bit, self.nbits, random.Random(0))

    def _rng(self, index: int) -> random.Random:
        return random.Random(stream_seed(self.seed, self.name, self.target, index))

    def hook_reduction(self, ddp: DistributedDataParallel) -> None:
        # On every rank, so that all reduce gradients the same way; the flip happens, then the run's own
        # reduction (resilience.runtime.reduce) takes over. The closure is unannotated: DDP inspects annotations.
        self._reduce = reduce_hook_for(self.rt.world_size)

        def hook(process_group, bucket):
            return self._comm_hook(process_group, bucket)

        ddp.register_comm_hook(None, hook)

    def arm(self, state: TrainState) -> None:
        self.state = state
        if not self._mine:
            return
        if self.target == "activations":
            layers = sorted((n, m) for n, m in state.model.named_modules() if isinstance(m, torch.nn.Linear))
            self._layer_name, layer = layers[self._rng(-1).randrange(len(layers))]
            self._handles.append(layer.register_forward_hook(self._forward_hook))

    def cleanup(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __call__(self, phase: str, step: int) -> None:
        if phase == "before_forward":
            self._step = step  # the in-pass targets fire inside this step's forward or backward
        if self.target not in ("grads_pre", "activations"):
            super().__call__(phase, step)

    def _due(self) -> int | None:
        """The plan index to fire now, from inside a forward or backward pass, or None."""
        index = self._steps.get(self._step)
        return None if index is None or index in self.fired else index

    def _flip(self, index: int, name: str, tensor: torch.Tensor, element: int) -> None:
        bits = choose_bits(tensor.dtype, self.bit, self.nbits, self._rng(index))
        self.fired.add(index)
        preview = flip_bits(tensor.detach().view(-1)[element:element + 1].clone(), 0, bits)  # on a copy
        self.record(self._step, index, {"target": self.target, "tensor": name, "element": element, "bits": bits,
                                        "old": preview.old, "new": preview.new})
        flip_bits(tensor, element, bits)

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {}

    def record(self, step: int, index: int, detail: dict[str, Any], fsync: bool = True) -> None:
        if detail:  # the base class calls this with an empty detail: _act writes the full record itself
            super().record(step, index, detail, fsync)

    def _act(self, step: int) -> None:
        index = self._steps[step]
        rng = self._rng(index)
        if self.target == "checkpoint":
            return self._flip_checkpoint(index, rng)
        if self.target == "weights":
            named = sorted(self.state.model.module.named_parameters())
        elif self.target == "grads_post":
            named = sorted((n, p.grad) for n, p in self.state.model.module.named_parameters() if p.grad is not None)
        else:  # optimizer: the Adam moments, named by parameter
            names = {id(p): n for n, p in self.state.model.module.named_parameters()}
            named = sorted((f"{names[id(p)]}.{k}", v) for p, s in self.state.optimizer.state.items()
                           for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
        name, tensor, element = pick_element(named, rng)
        self._flip(index, name, tensor, element)

    def _comm_hook(self, process_group: Any, bucket: Any) -> torch.futures.Future:
        index = self._due() if self._mine else None
        if index is not None:
            buf = bucket.buffer()
            element = self._rng(index).randrange(buf.numel())
            self._flip(index, f"grad_bucket{bucket.index()}", buf, element)
        return self._reduce(process_group, bucket)

    def _forward_hook(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        index = self._due()
        if index is not None and isinstance(output, torch.Tensor):
            element = self._rng(index).randrange(output.numel())
            with torch.no_grad():
                self._flip(index, f"{self._layer_name}.output", output, element)

    def _flip_checkpoint(self, index: int, rng: random.Random) -> None:
        dirs = CheckpointDir(self.rt.ckpt_dir)
        entry = dirs.newest_committed()
        files = dirs.data_files(entry)
        path = files[rng.randrange(len(files))]
        offset = rng.randrange(path.stat().st_size)
        bits = sorted(rng.sample(range(8), min(self.nbits, 8)))
        with open(path, "r+b") as f:
            f.seek(offset)
            old = f.read(1)[0]
            self.record(self._step, index, {"target": "checkpoint", "file": str(path), "offset": offset,
                                            "bits": bits, "old": old, "new": old ^ sum(1 << b for b in bits)})
            f.seek(offset)
            f.write(bytes([old ^ sum(1 << b for b in bits)]))
            f.flush()
            os.fsync(f.fileno())
