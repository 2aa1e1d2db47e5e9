"""One vocabulary of schedule names and one replay (issue 32): every layer's schedule
names are plait.names.schedules' (the builders, the planner, plait train's config, the
CLI's flags, the benchmarks), no module re-types one as a literal, the planner prices
pipelines with the library's replay (the one the engine's tests check real runs
against), and the pipeline modules depend one way: replay -> schedules -> actions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from plait.bench.memory import BENCH_SCHEDULES
from plait.bench.pp import SCHEDULE_NAMES as BENCH_PP_SCHEDULES
from plait.bench.pp_vs_torch import VS_TORCH_SCHEDULES
from plait.cli.main import build_parser
from plait.names.schedules import INTERLEAVED_1F1B, NO_PIPELINE, PIPELINE_SCHEDULES, ZERO_BUBBLE
from plait.parallel.pipeline import draw
from plait.parallel.pipeline.replay import peak_in_flight, peak_in_flight_per_chunk, replay
from plait.parallel.pipeline.schedules import SCHEDULES as BUILDERS, build
from plait.plan import layout as plan_layout, pipeline as plan_pipeline
from plait.plan.pipeline import RATIO_STEPS, _replay
from plait.train.config import FIELD_CHOICES, SCHEDULES as CONFIG_SCHEDULES

SRC = Path(__file__).resolve().parents[2] / "src" / "plait"
# the one module that spells the names, and the CLI's documented old spelling of interleaved_1f1b
SPELLERS = {"names/schedules.py"}
ALIASES = {("cli/plan.py", "interleaved")}
SPELLINGS = set(PIPELINE_SCHEDULES) | {"interleaved"}


def _flag_choices(command: str, flag: str):
    subparsers = next(a for a in build_parser(command)._actions if a.dest == "command")
    action = next(a for a in subparsers.choices[command]._actions if flag in a.option_strings)
    return action


def test_every_layer_names_the_schedules_from_names_schedules():
    assert tuple(BUILDERS) == PIPELINE_SCHEDULES  # the engine's builders
    assert plan_layout.SCHEDULES == (NO_PIPELINE, *PIPELINE_SCHEDULES)  # the planner
    assert CONFIG_SCHEDULES == PIPELINE_SCHEDULES == FIELD_CHOICES["schedule"]  # plait train's config
    assert tuple(_flag_choices("plan", "--schedule").choices) == (NO_PIPELINE, *PIPELINE_SCHEDULES)
    assert BENCH_PP_SCHEDULES == PIPELINE_SCHEDULES
    assert set(VS_TORCH_SCHEDULES) <= set(PIPELINE_SCHEDULES) and set(BENCH_SCHEDULES) <= set(PIPELINE_SCHEDULES)
    for name in PIPELINE_SCHEDULES:  # the closed forms and the planner's rules know every name
        assert draw.theory(name, 4, 8, 2 if name == INTERLEAVED_1F1B else 1)["schedule"] == name
        assert plan_pipeline.schedule_problem(name, 4, 8, 2 if name == INTERLEAVED_1F1B else 1) is None


def test_plait_plan_still_takes_the_old_spelling_of_interleaved():
    parser = build_parser("plan")
    base = ["plan", "--model", "gpt-1.3b", "--cluster", "dgx-a100", "--gpus", "16", "--global-batch", "64"]
    assert parser.parse_args(base + ["--schedule", "interleaved"]).schedule == INTERLEAVED_1F1B
    assert parser.parse_args(base + ["--schedule", INTERLEAVED_1F1B]).schedule == INTERLEAVED_1F1B
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--schedule", "interleaved_1f1"])


def _schedule_literals() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where in SPELLERS:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        exported = {id(node) for assign in ast.walk(tree) if isinstance(assign, ast.Assign)
                    and any(isinstance(target, ast.Name) and target.id == "__all__" for target in assign.targets)
                    for node in ast.walk(assign.value)}  # __all__ lists functions such as gpipe()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in SPELLINGS and id(node) not in exported
                    and (where, node.value) not in ALIASES):
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_retypes_a_schedule_name():
    """DESIGN.md 2: a name two layers share is defined once and imported."""
    assert _schedule_literals() == []


def test_the_planner_prices_with_the_librarys_replay():
    assert plan_pipeline.replay is replay
    assert not hasattr(plan_pipeline, "BUILDER_NAMES")  # no translation table


CASES = [(name, p, m, v) for p, m in ((2, 4), (4, 8), (4, 12)) for name, v in
         (("gpipe", 1), ("1f1b", 1), (INTERLEAVED_1F1B, 2), ("chimera", 1), (ZERO_BUBBLE, 1))]


@pytest.mark.parametrize("name,p,m,v", CASES)
@pytest.mark.parametrize("units", [(8, 16, 0), (5, 19, 0), (9, 10, 5), (6, 9, 9)])
def test_the_planners_numbers_are_the_replays_timeline(name, p, m, v, units):
    """The planner's makespan and peaks are the engine-checked replay's, at any cost
    split (a split backward: B b and W w, unequal too)."""
    if name != ZERO_BUBBLE:
        units = (units[0], RATIO_STEPS - units[0], 0)
    f, b, w = units
    makespan, peaks, per_chunk = _replay(name, p, m, v, units)
    schedule = build(name, p, m, v if v > 1 else None)
    timeline = replay(schedule, forward=f / RATIO_STEPS, backward=(b + w) / RATIO_STEPS,
                      weight=w / RATIO_STEPS)
    assert makespan == pytest.approx(timeline.makespan_s, rel=1e-12)
    assert list(peaks) == peak_in_flight(schedule)
    assert list(per_chunk) == peak_in_flight_per_chunk(schedule)
    assert all(max(row) <= peak <= sum(row) for row, peak in zip(per_chunk, peaks))


def _imports(module: str) -> set[str]:
    tree = ast.parse((SRC / "parallel" / "pipeline" / f"{module}.py").read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_pipeline_modules_depend_one_way():
    """replay -> schedules -> actions, nowhere back (not even inside a function)."""
    assert "plait.parallel.pipeline.replay" not in _imports("schedules")
    assert not {"plait.parallel.pipeline.replay", "plait.parallel.pipeline.schedules"} & _imports("actions")


@pytest.mark.parametrize("package", ["parallel/pipeline", "parallel/tensor", "plan", "names"])
def test_no_private_name_is_imported_from_another_module(package):
    bad = []
    for path in sorted((SRC / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait"):
                bad += [f"{path.relative_to(SRC)}:{node.lineno}: {node.module}.{alias.name}" for alias in node.names
                        if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert bad == []
