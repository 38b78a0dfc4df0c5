"""A checkpointing library that users adopt, run as a strategy beside our own implementations.

A peer strategy imports its library only when it is built (the library lives in an optional extra), records the
library's name and version and the workarounds it applied (``peer_library`` event, then ``result.json``'s
``peer`` and ``peer_patches``), and refuses before launch, in one line, when its extra is not installed.

A workaround is a :class:`Patch`: named, described, applied in one place, and only where the library needs it to
run here. ``strategy.patches`` chooses them: ``all`` (the default), ``none`` (the library as shipped, so that the
report can show what it does without help) or a list of patch names.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Sequence

from resilience.record.torch_workarounds import TorchWorkaround
from resilience.runtime.rank import RankRuntime
from resilience.workloads.base import Workload


@dataclass(frozen=True)
class Patch:
    """One workaround: ``applies()`` says whether this host needs it, ``apply()`` installs it (idempotent).
    ``internals``: where it reaches into the library's private names, the record that says on which releases it was
    checked (refused before launch on another, and declared where it acts)."""

    name: str
    why: str
    applies: Callable[[], bool]
    apply: Callable[[], None]
    internals: TorchWorkaround | None = None


@dataclass(frozen=True)
class PeerLibrary:
    """A library as installed: the module to import, its distribution (for the version) and our extra."""

    module: str
    distribution: str
    extra: str

    def installed(self) -> bool:
        try:
            importlib.import_module(self.module)
        except ImportError:
            return False
        return True

    def load(self) -> ModuleType:
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:
            raise ValueError(f"{self.distribution} is not installed ({exc}); install the extra: "
                             f"pip install -e '.[{self.extra}]' (or .[peers] for every library)") from None

    def version(self) -> str:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


class PeerStrategy:
    """Mixin of a strategy that runs a peer library: its ``library``, its ``known_patches``, the chosen ones. It
    comes first among the bases of a ``CheckpointStrategy`` subclass (``class X(PeerStrategy, SyncCheckpoint)``),
    whose ``name`` and ``rt`` it uses; it derives from none, so that the adapters' room does not import the options'."""

    library: PeerLibrary
    known_patches: tuple[Patch, ...] = ()
    name: str
    rt: RankRuntime | None

    def choose_patches(self, patches: str | list[str]) -> None:
        names = [p.name for p in self.known_patches]
        if isinstance(patches, str) and patches in ("all", "none"):
            chosen = names if patches == "all" else []
        elif isinstance(patches, Sequence) and not isinstance(patches, str) and all(p in names for p in patches):
            chosen = list(patches)  # a list from the command line arrives as an OmegaConf ListConfig (a Sequence)
        else:
            shown = f"[{','.join(map(str, patches))}]" if isinstance(patches, Sequence) and not isinstance(
                patches, str) else patches
            raise ValueError(f"strategy.patches={shown}: allowed: all, none, or a list of "
                             f"{', '.join(names) if names else '(no patches for this library)'}")
        self.patches = [p for p in self.known_patches if p.name in chosen]

    def check_host(self, workload: Workload, world_size: int, shards: int = 1) -> None:
        """The library must be importable where the ranks start, and the chosen patches checked on its release: one
        line otherwise."""
        try:
            self.library.load()
        except ValueError as exc:
            raise ValueError(f"strategy={self.name}: {exc}") from None
        for patch in self.patches:
            if patch.internals is not None:
                patch.internals.check()

    def applied_patches(self) -> list[Patch]:
        """Install the chosen patches this host needs; the list is what ``result.json`` declares."""
        applied = [p for p in self.patches if p.applies()]
        for patch in applied:
            if patch.internals is not None:
                patch.internals.acted()  # declared by the rank before its event log closes
            patch.apply()
        return applied

    def declare(self, applied: list[Patch], **settings: object) -> None:
        """Record the library, its version, the settings that make this row and the workarounds in force (rank 0,
        once per attempt)."""
        if self.rt.rank == 0:
            self.rt.events.emit("peer_library", library=self.library.distribution, version=self.library.version(),
                                settings=settings, patches=[{"name": p.name, "why": p.why} for p in applied])
