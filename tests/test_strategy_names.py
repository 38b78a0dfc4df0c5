"""One name per strategy: the projection's scenarios and the report use the harness's option names (conf/strategy/).

A scenario default named differently from the option it stands for (``in_memory`` for ``inmemory``) is a second
strategy to the projection: fitted costs land under one name, assumed costs stay under the other, and the
projection's plots and winner map compare the strategy with itself.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from reports import peers, recovery_peers, tables
from resilience.projection import fit_strategies
from resilience.projection.cli import load
from test_projection import REPO, composed

CONF = Path(__file__).resolve().parents[1] / "conf"
OPTIONS = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))
SCENARIOS = sorted(p.stem for p in (CONF / "scenario").glob("*.yaml"))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_strategy_is_a_harness_option(scenario: str) -> None:
    names = yaml.safe_load((CONF / "scenario" / f"{scenario}.yaml").read_text())["strategies"]
    assert sorted(set(names) - set(OPTIONS)) == [], f"conf/scenario/{scenario}.yaml: not in conf/strategy/"


def test_the_scenarios_project_replica() -> None:
    for scenario in SCENARIOS:
        assert "replica" in yaml.safe_load((CONF / "scenario" / f"{scenario}.yaml").read_text())["strategies"]


def test_every_strategy_the_report_names_is_a_harness_option() -> None:
    named = {tables.BASELINE, *peers.families(), *recovery_peers.STRATEGIES}
    assert sorted(named - set(OPTIONS)) == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_measured_strategies_replace_their_defaults_instead_of_adding_a_row(scenario: str) -> None:
    """Costs fitted from runs named as the harness names them leave one row per strategy."""
    _, scn, _ = load(composed(f"scenario={scenario}"), REPO)
    measured = pd.DataFrame({"strategy": ["sync", "inmemory", "replica"], "ckpt_bytes": [1e9, 1e9, 0.0],
                             "ckpt_stall_s": [2.0, 0.1, None]})
    fitted = fit_strategies(measured, scn.strategies)
    assert sorted(fitted) == sorted(scn.strategies)
    assert "fitted" in fitted["inmemory"].description and fitted["replica"] is scn.strategies["replica"]
