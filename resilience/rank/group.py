"""The rank's process group: formed once per process, or re-formed in place after a peer is lost.

Under the elastic agent (and torchrun) a process joins one group, through torchelastic's rendezvous, and a
failure ends it. Under the replacing supervisor (strategies that recover in place) the supervisor hosts a
``TCPStore`` and counts *generations*: each replacement of a failed rank opens a new one. A group is formed on
the keys of its generation (``gen<G>/``), so the survivors of generation G and the replacement form generation
G+1 without seeing a stale key of G; this is how torchft's managers re-form their groups around a lighthouse.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch.distributed as dist

STORE_ENV = "RB_STORE"  # host:port of the replacing supervisor's store; absent: torchelastic's env:// rendezvous
GENERATION_KEY = "generation"


def failed_key(generation: int) -> str:
    """The ranks a generation replaces (JSON list), set by the supervisor before it opens the generation."""
    return f"gen{generation}/failed"


def joining_key(generation: int, rank: int) -> str:
    """Set by a replacement just before it forms its generation's group: survivors training on at reduced width
    see that it is ready to heal."""
    return f"gen{generation}/joining/{rank}"


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
        if dist.is_initialized():
            # An in-process restart's earlier attempt whose abort left the default group registered (seen once in
            # CI: NVRx's next iteration then failed with "initialize the default process group twice"): drop it.
            dist.destroy_process_group()
        if self.solo:
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
        elif self.store is None:
            dist.init_process_group(self.backend, timeout=self.timeout)
        else:
            if self.generation > 0:
                self.store.set(joining_key(self.generation, self.rank), "1")
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{self.generation}/", self.store),
                                    rank=self.rank, world_size=self.world_size, timeout=self.timeout)

    def rejoin(self, error: BaseException, replace_timeout_s: float | None = None) -> int:
        """After ``error`` in a collective: wait for the supervisor to open a newer generation, form it, return it.

        Re-raises ``error`` when this process cannot stay (no replacing supervisor), or when no new generation
        opens within the collective timeout: then the error was not a lost peer, and this rank fails for real.
        With ``replace_timeout_s`` the wait for the replacements is a deadline of its own (``TimeoutError`` when
        they are not forming the group by then); the group then forms within the collective timeout.
        """
        self.generation = self._next_generation(error)
        if replace_timeout_s is not None:
            failed = json.loads(self.store.get(failed_key(self.generation)))
            deadline = time.monotonic() + replace_timeout_s
            while not self.replacements_ready(failed):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the replacement of rank(s) {failed} did not join generation "
                                       f"{self.generation} within {replace_timeout_s:.1f} s")
                time.sleep(0.02)
        self.join()
        return self.generation

    def shrink(self, error: BaseException) -> list[int]:
        """After ``error``: like ``rejoin``, but form a group of the survivors only (renumbered densely, in rank
        order) on the new generation's ``reduced/`` keys, to train on while the replacement starts; return the
        ranks being replaced. ``regrow`` later forms the generation's full group with the replacement."""
        self.generation = self._next_generation(error)
        failed = json.loads(self.store.get(failed_key(self.generation)))
        survivors = [r for r in range(self.world_size) if r not in failed]
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{self.generation}/reduced/", self.store),
                                rank=survivors.index(self.rank), world_size=len(survivors), timeout=self.timeout)
        return failed

    def replacements_ready(self, failed: list[int]) -> bool:
        """Whether every replacement of this generation is forming the full group (``join``)."""
        return self.store.check([joining_key(self.generation, r) for r in failed])

    def regrow(self) -> None:
        """Leave the survivors' group and form the generation's full group with the replacements."""
        dist.destroy_process_group()
        self.join()

    def _next_generation(self, error: BaseException) -> int:
        if self.store is None or self.solo:
            raise error
        dist.destroy_process_group()  # the broken group: its peers' sockets are gone
        deadline = time.monotonic() + self.timeout.total_seconds()
        while (latest := int(self.store.get(GENERATION_KEY))) <= self.generation:
            if time.monotonic() > deadline:
                raise error
            time.sleep(0.02)
        return latest
