"""Uses of private torch internals, each a declared workaround: what it does, why, the versions it was checked on.

A private name (``torch.cuda._sleep``, a ``_fully_shard`` module, an agent's ``_monitor_workers``) may change in
any release, so each use is a :class:`TorchWorkaround` declared once, at module level, in the module that makes it
(as a peer library's ``Patch``). On a version not in ``checked_on`` it is refused in one line (``ValueError``):
before launch where a role's validation decides that it will act (``check``), else where it acts (``acted``). What
acted is declared in the event log (``torch_workaround``) and ``result.json`` lists it (``torch_workarounds``). A
process without its event log at hand records the act here; the rank declares it before its log closes
(``declare_acted``). ``docs/architecture.md`` lists every record (``markdown``).
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resilience.record import catalogue

if TYPE_CHECKING:
    from resilience.record.events import EventLog

EVENT = "torch_workaround"
catalogue.register(EVENT, ("supervisor", "rank", "strategy", "injector"), ("name", "version"),
                   "a declared use of private torch (or torch library) internals acts in this process")


@dataclass(frozen=True)
class TorchWorkaround:
    """One use of private internals of ``package``: ``where`` it is made, ``why``, the releases it was checked on."""

    name: str
    why: str
    checked_on: tuple[str, ...]
    where: str
    package: str = "torch"

    def check(self) -> None:
        """Refuse, in one line, a release of ``package`` this workaround was not checked on."""
        version = installed_version(self.package)
        # a local label ("+cpu", "+cu124") is the same release
        if version.split("+")[0] not in self.checked_on and not unchecked_allowed():
            raise ValueError(f"{self.package} {version}: the workaround {self.name} ({self.where}) reaches into its "
                             f"private internals and was checked on {self.package} {', '.join(self.checked_on)} only; "
                             f"check it on {version} and add the release to its checked_on")

    def acted(self, events: EventLog | None = None) -> None:
        """It acts in this process: refused on an unchecked release, else declared in ``events`` (or, without one,
        by the process's ``declare_acted``)."""
        if self.name not in _ACTED:  # checked once per process: some act on every save
            self.check()
            _ACTED[self.name] = self
        if events is not None:
            declare_acted(events)


def unchecked_allowed() -> bool:
    """``RESILIENCE_UNCHECKED_RELEASES=1``: run the workarounds on releases they were not checked on (a GPU machine's
    own torch, ``make gpu-check``); the event and ``result.json`` still name each with the version it ran on."""
    return os.environ.get("RESILIENCE_UNCHECKED_RELEASES") == "1"


_REGISTRY: dict[str, TorchWorkaround] = {}
_ACTED: dict[str, TorchWorkaround] = {}  # in this process, in the order they first acted
_DECLARED: set[tuple[str, str]] = set()  # (event log, name): one event per run and process


def declare(name: str, why: str, checked_on: tuple[str, ...], where: str, package: str = "torch") -> TorchWorkaround:
    """Register a workaround (at its module's import): the same record again is a no-op, another of its name refused."""
    record = TorchWorkaround(name, why, tuple(checked_on), where, package)
    known = _REGISTRY.setdefault(name, record)
    if known != record:
        raise ValueError(f"torch workaround {name!r} is already declared differently: {known}")
    return record


def registered() -> list[TorchWorkaround]:
    """Every workaround declared by a module imported so far."""
    return list(_REGISTRY.values())


def declare_acted(events: EventLog) -> None:
    """Emit ``torch_workaround`` for each workaround that acted in this process and is not yet in this log."""
    for record in _ACTED.values():
        if (str(events.path), record.name) not in _DECLARED:
            _DECLARED.add((str(events.path), record.name))
            events.emit(EVENT, name=record.name, version=installed_version(record.package))


def installed_version(package: str) -> str:
    if package == "python":  # the interpreter's own internals (multiprocessing)
        import platform

        return platform.python_version()
    if package == "torch":
        import torch

        return str(torch.__version__)
    return importlib.metadata.version(package)


def markdown(records: list[TorchWorkaround]) -> str:
    """The records as a Markdown table (the section of ``docs/architecture.md``)."""
    rows = [f"| `{r.name}` | `{r.where}` | {r.package} {', '.join(r.checked_on)} | {r.why} |" for r in records]
    return "\n".join(["| workaround | where | checked on | why |", "|---|---|---|---|", *rows])
