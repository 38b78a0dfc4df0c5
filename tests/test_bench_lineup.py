"""The benches' lists of options come from conf/ and what the roles declare (resilience/bench/lineup.py): an option
added to conf/ joins the benches it fits, and no bench keeps a name that conf/ has not."""

from __future__ import annotations

from resilience import compat
from resilience.bench import coverage, lineup


def test_the_comparison_rows_are_ours_with_the_default_first():
    own = lineup.own()
    strategies = compat.options("strategy")
    assert own[0] == compat.defaults().names["strategy"]  # the reference run
    for name in own:
        base, _ = lineup.with_a_spare().get(name, (name, []))
        option = strategies[base]
        assert option.option == option.name and not getattr(lineup.library(option), "extra", "")
        assert base == name or own[own.index(name) - 1] == base  # a spare's row right after its strategy's


def test_the_libraries_run_a_library_and_write_checkpoints():
    assert set(lineup.libraries()) <= set(lineup.checkpointing())
    assert all(lineup.library(compat.options("strategy")[name]) for name in lineup.libraries())


def test_coverage_runs_every_fault_that_leaves_a_record_and_sweeps_only_faults_of_conf():
    run = {overrides[0].partition("=")[2] for _, overrides, _ in coverage.scenarios()}
    faults = compat.options("fault")
    assert run == {name for name, o in faults.items() if not o.caps.ends_the_job}
    assert set(coverage.SETTINGS) <= set(faults), "a sweep of a fault that conf/fault no longer has"
    assert coverage.scenarios()[0][0] == compat.defaults().names["fault"]  # the fault-free run first
