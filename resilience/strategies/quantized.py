"""Quantized incremental checkpoints (Check-N-Run, NSDI'22, its second technique): the chain of ``incremental``,
with the embedding rows' values stored in fewer bits.

``bits=8``: each row as its min (``lo``), ``scale = (max - min) / 255`` and one byte per element,
``round((x - lo) / scale)`` (per-row min/max affine quantization); ``bits=16``: fp16. Every element comes back within
``scale / 2`` of its value (8 bits) or fp16's rounding (16 bits): ``resilience.ckpt.increments.quantize``. The
optimizer's row state (Adagrad's ``sum``), the dense parameters and the job's parts are stored exactly, as in
``incremental``. Saving changes nothing in the live state: a run without a restore ends on the fault-free state bit
for bit, and is held to that check; a run that restored a quantized checkpoint trains on from the approximation and
is not, by design (``caps.inexact_restore``; its loads say so with ``ckpt_loaded_inexact``, and ``result.json``'s
``bit_exact`` with "not by design: ..."). What that costs in accuracy: ``python -m resilience.bench.convergence_gap``.
"""

from __future__ import annotations

from dataclasses import replace

from resilience.strategies.incremental import IncrementalCheckpoint

BITS = (8, 16)


class QuantizedCheckpoint(IncrementalCheckpoint):
    caps = replace(IncrementalCheckpoint.caps,
                   inexact_restore="strategy=quantized restores embedding rows stored in fewer bits (strategy.bits)")

    def __init__(self, every: int, keep: int, base_every: int = 4, bits: int = 8) -> None:
        super().__init__(every, keep, base_every)
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"strategy.bits={bits}: must be one of {', '.join(map(str, BITS))}")
        self.bits = bits
