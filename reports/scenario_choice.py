"""The pipeline's ``--config scenario=NAME``: the cluster the projection projects to (``conf/scenario/NAME.yaml``,
or the path of a scenario YAML of the user's own: GPUs, model and checkpoint size, storage bandwidth, failure
rate; docs/projection.md). Checked when Snakemake starts, in one line; handed to ``python -m resilience.projection``
as Hydra wants it: a name in its ``scenario`` group, a file of the user's through a search path of its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

SCENARIOS = Path(__file__).resolve().parent.parent / "conf" / "scenario"
DEFAULT = "llama3_405b"


class ScenarioError(ValueError):
    """A ``scenario`` setting that names no scenario; its text is the one line the pipeline prints."""


def known() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def chosen(value: object) -> str:
    """``value`` checked: a scenario's name, or the absolute path of a readable YAML mapping."""
    text = str(value)
    if (SCENARIOS / f"{text}.yaml").is_file():
        return text
    path = Path(text).expanduser()
    if path.suffix in (".yaml", ".yml") and path.is_file():
        try:
            spec = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ScenarioError(f"scenario={text}: not valid YAML ({str(exc).splitlines()[0]})") from exc
        if not isinstance(spec, dict) or "gpus" not in spec:
            raise ScenarioError(f"scenario={text}: a scenario YAML is a mapping with at least gpus (see "
                                f"conf/scenario/{DEFAULT}.yaml)")
        return str(path.resolve())
    raise ScenarioError(f"scenario={text}: must be one of {', '.join(known())} (conf/scenario/) or the path of a "
                        f"scenario YAML")


def overrides(scenario: str, work_dir: Path) -> list[str]:
    """The projection's command-line settings for ``scenario``: ``scenario=NAME``, or for a file of the user's,
    a copy of it in ``work_dir``'s search path under a name no built-in scenario has."""
    if not scenario.endswith((".yaml", ".yml")):
        return [f"scenario={scenario}"]
    group = work_dir / "scenario"
    group.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(scenario, group / "user_scenario.yaml")
    return [f"hydra.searchpath=[file://{work_dir.resolve()}]", "scenario=user_scenario"]
