"""torch's ``PipelineStage`` with its boundary traffic logged (``LoggingStage``), and replayed alone from its
neighbours' logs (``ReplayStage``). Both run under torch's own schedules unchanged (``Schedule1F1B``,
``ScheduleGPipe``): the schedule asks the stage for its receive and send ops around each micro-batch's forward and
backward, which is where the log listens and, in a replay, where the logged bytes come back in.

Imported where a rank builds its stage (``pp_runner``): the command that only checks the settings does without
``torch.distributed.pipelining``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from resilience.parallel.boundary_log import BACKWARD, FORWARD, BoundaryLog
from resilience.record.torch_workarounds import declare

LOCAL_WARMUP = declare(
    "pipeline_stage_local_warmup", "a stage replayed alone has no neighbour to run the schedule's warm-up vote with: "
    "ReplayStage overrides PipelineStage's private _warmup_forward_vote and _warmup_backward_result (the schedule's "
    "first step calls them) to decide the static mode locally, its shapes given up front", ("2.13.0",), __name__)


class SendLog:
    """Records, per micro-batch, the tensors of the stage's send ops (in op order) into ``self.log``."""

    log: BoundaryLog

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)  # type: ignore[misc]
        self.log.record(FORWARD, fwd_chunk_id, [op.tensor for op in ops])
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)  # type: ignore[misc]
        self.log.record(BACKWARD, bwd_chunk_id, [op.tensor for op in ops])
        return ops


class LoggingStage(SendLog, PipelineStage):
    """A ``PipelineStage`` whose sends are also logged: the same ops, the same bytes sent, a copy kept."""

    def __init__(self, *args: Any, log: BoundaryLog, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log


class ReplayStage(SendLog, PipelineStage):
    """A stage run alone: each receive is filled from ``received`` (the neighbours' logs of what they sent it, for
    step ``self.step``), each send is logged into ``log`` (rebuilding what the stage's neighbours may need later)
    and never sent. The schedule sees the same ops' results in the same order, so it sums the same gradients."""

    def __init__(self, *args: Any, log: BoundaryLog, received: BoundaryLog, **kwargs: Any) -> None:
        if kwargs.get("input_args") is None or kwargs.get("output_args") is None:
            # the shapes would otherwise be inferred by a forward handed on from stage to stage: no neighbour here
            raise ValueError("a stage replayed alone needs its input and output shapes up front (input_args, "
                             "output_args)")
        LOCAL_WARMUP.acted()
        super().__init__(*args, **kwargs)
        self.log, self.received = log, received
        self.step: int | None = None

    def begin(self, step: int) -> None:
        """The receives and sends that follow are step ``step``'s."""
        self.step = step
        self.log.begin(step)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        buffers = [info.buffer for info in self.args_recv_info[fwd_chunk_id] if not info.is_root_arg]
        self._fill(buffers, FORWARD, fwd_chunk_id)
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_last:
            return []
        buffers = [info.buffer for info in self.grad_recv_info[bwd_chunk_id] if info.buffer is not None]
        self._fill(buffers, BACKWARD, bwd_chunk_id)
        return []

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        super().get_fwd_send_ops(fwd_chunk_id)
        return []

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        super().get_bwd_send_ops(bwd_chunk_id)  # pops the stage's input gradients, as a real send does
        return []

    def _fill(self, buffers: list[torch.Tensor], kind: str, micro: int) -> None:
        """Write the logged bytes where the receive would have written them (the same buffer, in place)."""
        if not buffers:
            return
        assert self.step is not None, "ReplayStage.begin(step) before the schedule's step"
        logged = self.received.get(self.step, kind, micro)
        if len(logged) != len(buffers):
            raise ValueError(f"stage {self.stage_index}: step {self.step} {kind} micro-batch {micro} logged "
                             f"{len(logged)} tensor(s) for {len(buffers)} receive(s)")
        with torch.no_grad():  # a receive buffer may be an autograd leaf that requires grad: the copy is no op of it
            for buffer, tensor in zip(buffers, logged):
                if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:  # copy_ would broadcast or cast
                    raise ValueError(f"stage {self.stage_index}: step {self.step} {kind} micro-batch {micro} logged "
                                     f"{tensor.dtype}{tuple(tensor.shape)} for a {buffer.dtype}"
                                     f"{tuple(buffer.shape)} receive")
                buffer.copy_(tensor)

    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32, device=self.device)  # static: the shapes were given (__init__)

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        return received_result if received_result is not None else torch.ones(1, dtype=torch.int32,
                                                                               device=self.device)
