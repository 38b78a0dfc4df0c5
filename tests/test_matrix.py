"""Matrix expansion: every shipped matrix, exclusions, references, growth without renames, one-line errors."""

from __future__ import annotations

import copy
import re
import pytest

from reports.matrix import MatrixError, available, check_cells, expand, load_matrix

pytestmark = pytest.mark.timeout(60)
SAFE = re.compile(r"[A-Za-z0-9_.=-]+")
BASE = {
    "axes": {
        "workload": ["gpt_tiny"], "strategy": ["none", "sync"],
        "fault": ["none", {"name": "kill", "phase": "before_forward", "at_step": 13, "rank": 1},
                  {"name": "kill", "phase": "during_checkpoint", "at_step": 10, "rank": 1}],
        "detectors": [["process_exit"]], "checkpoint.every": [5], "seed": [0, 1], "world_size": [2], "steps": [30],
    },
    "exclude": [{"strategy": "none", "fault.phase": "during_checkpoint"}],
    "overrides": {"recovery": "restart"},
}


def spec(**changes) -> dict:
    out = copy.deepcopy(BASE)
    for key, value in changes.items():
        if key.startswith("axes."):
            out["axes"][key[5:]] = value
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("name", available())
def test_every_shipped_matrix_expands_to_safe_unique_names_with_one_reference_per_group(name):
    m = load_matrix(name)
    names = [c.name for c in m.cells]
    assert names and len(names) == len(set(names))
    assert all(SAFE.fullmatch(n) for n in names)
    groups = {}
    for c in m.cells:
        groups.setdefault(c.reference, []).append(c)
    for ref, cells in groups.items():
        (reference,) = [c for c in cells if c.is_reference]
        assert reference.name == ref and reference.values["fault"].name == "none"
        key = {k: reference.values[k] for k in ("workload", "world_size", "steps", "seed")}
        assert all({k: c.values[k] for k in key} == key for c in cells)


def test_shipped_matrices_expand_with_a_reference_and_smoke_stays_small():
    for name in ("smoke", "default", "full"):
        cells = load_matrix(name).cells
        assert cells and any(c.is_reference for c in cells), name
    assert len(load_matrix("smoke").cells) <= 6  # the CI end-to-end run must stay short


def test_exclusions_drop_meaningless_cells():
    cells = expand(spec()).cells
    assert len(cells) == 2 * (2 * 3 - 1)  # seeds x (strategies x faults - none/during_checkpoint)
    assert not any(c.values["strategy"] == "none" and c.values["fault"].params.get("phase") == "during_checkpoint"
                   for c in cells)


def test_reference_is_added_when_the_product_lacks_it_and_keeps_the_group_key():
    cells = expand(spec(**{"axes.strategy": ["sync"], "axes.seed": [0]})).cells
    refs = [c for c in cells if c.is_reference]
    assert len(refs) == 1 and refs[0].values["strategy"] == "none" and refs[0].values["fault"].name == "none"
    assert len(cells) == 4 and all(c.reference == refs[0].name for c in cells)


def test_overrides_of_a_cell_are_complete_and_ordered():
    cell = next(c for c in expand(spec()).cells if "during_checkpoint" in c.name)
    assert cell.overrides == (
        "workload=gpt_tiny", "strategy=sync", "fault=kill", "fault.phase=during_checkpoint", "fault.at_step=10",
        "fault.rank=1", "detector=[process_exit]", "checkpoint.every=5", "world_size=2", "steps=30", "seed=0",
        "recovery=restart")
    assert cell.columns()["cell.fault.phase"] == "during_checkpoint"
    assert '"reference"' not in cell.job_spec()  # a rerun trigger must not depend on the rest of the matrix


def test_a_fault_with_more_parameters_fits(tmp_path):
    conf = tmp_path / "conf"
    for group, options in {"workload": ["gpt_tiny"], "strategy": ["none", "sync"], "fault": ["none", "bitflip"],
                           "detector": ["process_exit", "heartbeat"]}.items():
        (conf / group).mkdir(parents=True)
        for o in options:
            (conf / group / f"{o}.yaml").write_text("_target_: x\nrank: 1\nat_step: 13\ntarget: weights\nbit: sign\n")
    s = spec(**{"axes.fault": ["none", {"name": "bitflip", "at_step": 13, "target": "weights", "bit": "exponent"},
                                {"name": "bitflip", "at_step": 13, "target": "grads", "bit": "sign",
                                 "label": "flip-g"}],
                "axes.detectors": [["process_exit"], ["process_exit", "heartbeat"]], "exclude": [
                    {"fault.target": "grads", "detectors": "heartbeat"}]})
    cells = expand(s, conf_dir=conf).cells
    flip = next(c for c in cells if "weights" in c.name and "heartbeat" in c.name)
    assert "fault.target=weights" in flip.overrides and "fault.bit=exponent" in flip.overrides
    assert "detector=[process_exit,heartbeat]" in flip.overrides
    assert "bitflip.at_step=13.target=weights.bit=exponent" in flip.name
    assert any("-flip-g-" in c.name for c in cells)
    assert not any("flip-g" in c.name and "heartbeat" in c.name for c in cells)


def test_adding_an_axis_value_never_renames_existing_cells():
    before = {c.name for c in expand(spec()).cells}
    faults = BASE["axes"]["fault"] + [{"name": "kill", "phase": "before_optimizer_step", "at_step": 7, "rank": 0}]
    grown = spec(**{"axes.fault": faults, "axes.checkpoint.every": [2, 5], "axes.seed": [0, 1, 2]})
    assert before <= {c.name for c in expand(grown).cells}


def test_launcher_and_spares_axes_name_and_override_only_what_is_not_the_default():
    cells = expand(spec(**{"axes.supervisor.launcher": ["local", "torchrun"], "axes.supervisor.spares": [0, 1],
                           "exclude": [{"supervisor.launcher": "torchrun", "supervisor.spares": 1}]})).cells
    before = {c.name for c in expand(spec(exclude=[])).cells}
    local = [c for c in cells if not any(o.startswith("supervisor.") for o in c.overrides)]
    assert {c.name for c in local} == before  # the default launcher and no spares: today's names
    torchrun = [c for c in cells if "supervisor.launcher=torchrun" in c.overrides]
    assert torchrun and all(c.name.endswith("-torchrun") for c in torchrun if not c.is_reference)
    assert not any("supervisor.spares=1" in c.overrides for c in torchrun)
    assert any(c.name.endswith("-spares1") for c in cells)


def test_repeat_axis_adds_rep_k_only_above_zero_keeps_the_run_and_one_reference_per_group():
    without = expand(spec()).cells
    cells = expand(spec(**{"axes.repeat": [0, 1, 2]})).cells
    by_name = {c.name: c for c in cells}
    assert len(cells) == 3 * len(without)
    assert {c.name for c in expand(spec(**{"axes.repeat": [0]})).cells} == {c.name for c in without}
    for c in without:  # repeat 0 is today's cell; repeats 1, 2 run the same overrides under their own name
        assert by_name[c.name].overrides == c.overrides
        for k in (1, 2):
            again = by_name[f"{c.name}-rep{k}"]
            assert again.overrides == c.overrides and again.values["repeat"] == k
            assert again.reference == c.reference  # the repeats share the cell's reference run
            assert again.job_spec() != c.job_spec()  # ... but not its run directory
    assert [c.name for c in cells if c.is_reference] == [c.name for c in without if c.is_reference]
    assert not any("repeat" in o for c in cells for o in c.overrides)
    # the reference strategy excluded: one added reference per group, still not one per repeat
    added = expand(spec(**{"axes.repeat": [0, 1], "axes.strategy": ["sync"]})).cells
    assert len([c for c in added if c.is_reference]) == 2 and not any(c.is_reference and "-rep" in c.name
                                                                      for c in added)


def test_repeat_is_an_axis_not_an_override():
    with pytest.raises(MatrixError, match=r"overrides.repeat: not a run setting"):
        expand(spec(overrides={"repeat": 1}))
    with pytest.raises(MatrixError, match=r"axes.repeat\[1\]=-1: must be an integer >= 0"):
        expand(spec(**{"axes.repeat": [0, -1]}))
    assert len(expand(spec(**{"axes.repeat": [0, 1], "exclude": [{"repeat": 1, "strategy": "none"}]})).cells) \
        == 2 * (2 * 3 + 3)  # seeds x (repeat 0: strategies x faults; repeat 1: sync's three faults)


@pytest.mark.parametrize("changes,key,allowed", [
    ({"axes.supervisor.launcher": ["local", "slurm"]}, "axes.supervisor.launcher[1]=slurm", "allowed: local, torchrun"),
    ({"axes.sped": [0]}, "axes.sped", "allowed: workload, strategy"),
    ({"axes.seed": []}, "axes.seed", "non-empty list"),
    ({"axes.workload": ["gpt tiny"]}, "axes.workload[0]", "A-Z a-z 0-9 _ . = -"),
    ({"axes.strategy": ["none", "asyn"]}, "axes.strategy[1]=asyn", "unknown option; allowed:"),
    ({"axes.seed": [0, "one"]}, "axes.seed[1]=one", "integer >= 0"),
    ({"axes.checkpoint.every": [4, "fast"]}, "axes.checkpoint.every[1]=fast", "integer >= 1"),
    ({"axes.fault": [{"name": "kill", "at_step": 3}]}, "axes.fault", "must include none"),
    ({"axes.fault": ["none", {"name": "kill", "phase": "before forward"}]}, "axes.fault[1].phase", "A-Z a-z"),
    ({"exclude": [{"strategy": "none", "fault.phse": "x"}]}, "exclude[0].fault.phse", "allowed:"),
    ({"axes.fault": ["none", {"name": "kill", "phse": "x"}]}, "axes.fault[1].phse", "not a parameter of fault kill"),
    ({"exclude": [{"strategy": "nonee"}]}, "exclude[0].strategy=nonee", "unknown option; allowed:"),
    ({"exclude": [{"seed": [0, -1]}]}, "exclude[0].seed[1]=-1", "integer >= 0"),
    ({"overrides": {"seed": 3}}, "overrides.seed", "set by the axes"),
    ({"colour": "red"}, "colour", "allowed: description"),
    ({"reference": {"strategy": "asyn"}}, "reference.strategy=asyn", "unknown option; allowed:"),
])
def test_bad_matrix_entries_give_one_line_naming_the_key(changes, key, allowed):
    with pytest.raises(MatrixError) as err:
        expand(spec(**changes), name="bad")
    message = str(err.value)
    assert "\n" not in message and message.startswith("matrix bad: ")
    assert key in message and allowed in message


def test_unknown_matrix_name_lists_the_choices():
    with pytest.raises(MatrixError, match=r"matrix=nope: no such matrix; allowed: .*default.*smoke"):
        load_matrix("nope")


@pytest.mark.parametrize("fault,expected", [
    ({"name": "kill", "rank": 5}, r"cell .*: fault.rank=5: must be in \[0, 1\] for world_size=2"),
    ({"name": "kill", "phase": "sideways"}, r"cell .*: fault.phase=sideways: must be one of before_forward"),
    ({"name": "slow_disk", "mode": "melt"}, r"cell .*: fault.mode=melt: must be one of throttle"),
], ids=["rank", "phase", "mode"])
def test_every_cell_is_checked_as_the_command_checks_it(fault, expected):
    matrix = expand(spec(axes={**spec()["axes"], "fault": ["none", fault]}), name="bad")
    with pytest.raises(MatrixError, match=expected):
        check_cells(matrix)


def test_a_wrong_type_in_the_overrides_is_the_command_s_one_line():
    matrix = expand(spec(overrides={"timeouts.collective_s": "fast"}), name="bad")
    with pytest.raises(MatrixError, match=r"cell .*: timeouts.collective_s=fast: must be a number"):
        check_cells(matrix)


# Every shipped matrix passing the check is tests/test_pipeline.py's dry run of each (the Snakefile checks every
# cell before planning): not repeated here (15 s of the suite).


def test_blocks_are_the_union_of_their_products_with_the_base_axes_they_do_not_name():
    kill = {"name": "kill", "phase": "before_forward", "at_step": 13, "rank": 1}
    blocks = [{"axes": {"strategy": ["none", "sync"], "fault": ["none", kill], "repeat": [0, 1]},
               "exclude": [{"strategy": "none", "fault": "kill"}]},
              {"axes": {"fault": [kill], "checkpoint.every": [2]}},
              {"axes": {"strategy": ["sync"], "fault": [kill]}}]   # repeats a cell of the first block
    m = expand(spec(blocks=blocks, **{"axes.seed": [0], "axes.strategy": ["sync"], "axes.fault": ["none"]}))
    got = sorted((c.values["strategy"], c.values["fault"].name, c.values["checkpoint.every"],
                  c.values["repeat"] or 0) for c in m.cells)
    assert got == sorted([("none", "none", 5, 0), ("none", "none", 5, 1), ("sync", "none", 5, 0),
                          ("sync", "none", 5, 1), ("sync", "kill", 5, 0), ("sync", "kill", 5, 1),
                          ("sync", "kill", 2, 0)])
    assert {c.reference for c in m.cells} == {m.cells[0].name} and m.cells[0].values["strategy"] == "none"
    with pytest.raises(MatrixError, match=r"blocks\[0\]: colour: unknown key; allowed: axes, exclude"):
        expand(spec(blocks=[{"colour": 1}]))
