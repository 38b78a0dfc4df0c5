"""Which options of conf/ the benches run: derived from the YAML files under conf/<group>/ and what each role
declares (its ``caps``; for a strategy, the library its class runs), so that an option added to conf/ joins the
benches that fit it without an edit here. Lists come out in conf/'s order, the group's default option first."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra.utils import get_class

from resilience import compat
from resilience.compat import Option
from resilience.libs.peer import PeerLibrary, PeerStrategy


def _default_first(group: str, names: list[str]) -> tuple[str, ...]:
    """``names`` with conf/config.yaml's option of ``group`` first (a bench's reference run)."""
    default = compat.defaults().names[group]
    return tuple(sorted(names, key=lambda name: name != default))


def library(option: Option) -> PeerLibrary | None:
    """The library the option's class runs (``PeerStrategy.library``), or None: the project's own."""
    cls = get_class(option.settings["_target_"])
    return cls.library if issubclass(cls, PeerStrategy) else None


def fits_the_defaults(option: Option) -> bool:
    """Whether the table allows ``option`` with conf/config.yaml's other roles (the benches' gpt_tiny): a strategy
    for another kind of model (``incremental``: embedding tables) is not a trial of the benches that train gpt_tiny."""
    return compat.refusal(compat.defaults().choosing(option)) is None


def checkpointing() -> tuple[str, ...]:
    """Every strategy that writes checkpoints, ours and the libraries', as the suite runs them: a library as shipped
    (``patches`` other than ``all``) is a finding of its own (docs/peers.md), not a trial of a bench."""
    return tuple(name for name, o in compat.options("strategy").items()  # a technique: of a family, not a
                 if o.caps.saves and o.caps.family and o.settings.get("patches", "all") == "all"  # negative control
                 and fits_the_defaults(o))


def libraries() -> tuple[str, ...]:
    """The strategies of ``checkpointing`` that run a library."""
    return tuple(name for name in checkpointing() if library(compat.options("strategy")[name]))


def with_a_spare() -> dict[str, tuple[str, list[str]]]:
    """``<name>_spare``: each strategy that recovers in place (the only ones a spare serves), with one warm spare."""
    return {f"{name}_spare": (name, ["supervisor.spares=1"]) for name, o in compat.options("strategy").items()
            if o.caps.recovers_in_place and o.option == o.name}


def own() -> tuple[str, ...]:
    """One strategy per role (no variant) that recovers from a failure, checkpointing or in place, and needs no
    extra installed (ours, and torch's own DCP), each followed by its row with a warm spare; the default first."""
    spares = with_a_spare()
    mine = [name for name, o in compat.options("strategy").items() if o.option == o.name
            and (o.caps.saves or o.caps.recovers_in_place) and not (library(o) and library(o).extra)
            and fits_the_defaults(o)]
    return tuple(row for name in _default_first("strategy", mine)
                 for row in (name, *(s for s, (base, _) in spares.items() if base == name)))


def detectors() -> tuple[str, ...]:
    """Every detector option."""
    return tuple(compat.options("detector"))


def faults() -> tuple[str, ...]:
    """Every fault after which the run still writes its record: not one that kills the supervisor with the job
    (its detectors die with it; resume= is another bench's); the default (no fault) first."""
    return _default_first("fault", [name for name, o in compat.options("fault").items() if not o.caps.ends_the_job])


def unknown_strategies(arg: str) -> str | None:
    """The one-line error for a bench's ``--strategies`` value naming an option conf/ lacks, or None."""
    unknown = sorted(set(arg.split(",")) - set(compat.options("strategy")))
    return (f"error: --strategies={arg}: {', '.join(unknown)} unknown; strategies from "
            f"{', '.join(compat.options('strategy'))}") if unknown else None


def bench_arguments(ap: argparse.ArgumentParser, strategies: list[str], out: str) -> None:
    """A bench's common arguments: ``--strategies`` (default ``strategies``), ``--out`` and Hydra overrides."""
    ap.add_argument("--strategies", default=",".join(strategies), help="comma-separated strategy options")
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides)")


def strategies_given(args: argparse.Namespace) -> list[str] | None:
    """The ``--strategies`` asked for, or None after printing the one-line error for an unknown one."""
    if (error := unknown_strategies(args.strategies)):
        print(error, file=sys.stderr)
        return None
    return args.strategies.split(",")
