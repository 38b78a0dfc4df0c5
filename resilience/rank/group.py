"""The rank's process group: formed once per process, or re-formed in place after a peer is lost.

Under the elastic agent (and torchrun) a process joins one group, through torchelastic's rendezvous, and a
failure ends it. Under the replacing supervisor (strategies that recover in place) the supervisor hosts a
``TCPStore`` and counts *generations*: each replacement of a failed rank opens a new one. A group is formed on
the keys of its generation (``gen<G>/``), so the survivors of generation G and the replacement form generation
G+1 without seeing a stale key of G; this is how torchft's managers re-form their groups around a lighthouse.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

STORE_ENV = "RB_STORE"  # host:port of the replacing supervisor's store; absent: torchelastic's env:// rendezvous
GENERATION_KEY = "generation"


class RankGroup:
    """Forms (``join``) and re-forms (``rejoin``) the default process group of one rank."""

    def __init__(self, backend: str, rank: int, world_size: int, timeout_s: float, solo: bool = False) -> None:
        self.backend, self.rank, self.world_size = backend, rank, world_size
        # Solo: this rank is a group of one; a strategy that owns the step forms the groups across ranks itself.
        self.solo = solo
        self.timeout = timedelta(seconds=timeout_s)
        where = os.environ.get(STORE_ENV)
        self.store = None
        if where:
            host, port = where.rsplit(":", 1)
            self.store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        self.generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    @property
    def in_place(self) -> bool:
        """True when a lost peer is replaced and this process stays (the replacing supervisor runs the ranks)."""
        return self.store is not None

    def join(self) -> None:
        """Form the group of this process's generation."""
        if self.solo:
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
        elif self.store is None:
            dist.init_process_group(self.backend, timeout=self.timeout)
        else:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{self.generation}/", self.store),
                                    rank=self.rank, world_size=self.world_size, timeout=self.timeout)

    def rejoin(self, error: BaseException) -> int:
        """After ``error`` in a collective: wait for the supervisor to open a newer generation, form it, return it.

        Re-raises ``error`` when this process cannot stay (no replacing supervisor), or when no new generation
        opens within the collective timeout: then the error was not a lost peer, and this rank fails for real.
        """
        if self.store is None or self.solo:
            raise error
        dist.destroy_process_group()  # the broken group: its peers' sockets are gone
        deadline = time.monotonic() + self.timeout.total_seconds()
        while (latest := int(self.store.get(GENERATION_KEY))) <= self.generation:
            if time.monotonic() > deadline:
                raise error
            time.sleep(0.02)
        self.generation = latest
        self.join()
        return latest
