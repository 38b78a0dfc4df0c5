"""The baseline users have today: the process group's own timeout (``timeouts.collective_s``) on a collective.

It fires in the ranks that *wait*, not in the one that hangs, so it cannot name the culprit: the verdict records
the rank that timed out and the collective it was in, and blames nobody.
"""

from __future__ import annotations

import re

from resilience.detectors.base import Detection, Detector
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState

_TIMEOUT = re.compile(r"time[d ]?\s*out|timeout|deadline", re.IGNORECASE)
_COLLECTIVE = re.compile(r"(allreduce|all_reduce|allgather|all_gather|broadcast|barrier|reduce_scatter|recv|send)",
                         re.IGNORECASE)


class CollectiveTimeout(Detector):

    def attach(self, rt: RankRuntime, state: TrainState) -> None:
        self.rt = rt

    def on_exception(self, exc: BaseException) -> list[Detection]:
        text = str(exc)
        if not _TIMEOUT.search(text):
            return []
        op = _COLLECTIVE.search(text)
        return [Detection(self.name, None, f"rank {self.rt.rank} timed out in {op.group(1) if op else 'a collective'}",
                          {"waiting_rank": self.rt.rank, "collective": op.group(1) if op else None,
                           "error": text[:300]})]
