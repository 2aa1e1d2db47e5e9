"""The PLAIT_* environment, checked by every plait command before it does anything:
an unknown name is refused with the closest known one; what PLAIT_HIERARCHY,
PLAIT_ALGORITHMS and PLAIT_COMM_TIMEOUT_S mean for one plait train run is checked
against its layout before any process starts, --dry-run included. One line, exit 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import plait
from plait.cli.main import main

SOURCES = Path(plait.__file__).resolve().parent


def _one_line_error(capsys, status: int) -> str:
    captured = capsys.readouterr()
    assert status == 2, captured.out + captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize("argv, prog", [(["cost", "--help"], "plait cost"), (["--help"], "plait"),
                                        (["train", "--dry-run"], "plait train")])
def test_a_misspelt_variable_is_named_with_the_closest_known_one(argv, prog, monkeypatch, capsys):
    """Before: PLAIT_COMM_TIMEOUTS=5 was silently ignored (the deadline stayed 300 s)."""
    monkeypatch.setenv("PLAIT_COMM_TIMEOUTS", "5")
    line = _one_line_error(capsys, main(argv))
    assert line.startswith(f"{prog}: error: unknown environment variable PLAIT_COMM_TIMEOUTS (did you mean "
                           "PLAIT_COMM_TIMEOUT_S?)"), line


def test_the_closest_known_name_ignores_case(monkeypatch, capsys):
    """Before: PLAIT_comm_timeout_s was refused with no suggestion (difflib compares case)."""
    monkeypatch.setenv("PLAIT_comm_timeout_s", "5")
    line = _one_line_error(capsys, main(["cost", "--help"]))
    assert "unknown environment variable PLAIT_comm_timeout_s (did you mean PLAIT_COMM_TIMEOUT_S?)" in line, line


def test_every_unknown_variable_is_named_at_once(monkeypatch, capsys):
    monkeypatch.setenv("PLAIT_HIERACHY", "2x2")
    monkeypatch.setenv("PLAIT_XYZZY", "1")
    line = _one_line_error(capsys, main(["cost", "--help"]))
    assert "PLAIT_HIERACHY (did you mean PLAIT_HIERARCHY?), PLAIT_XYZZY:" in line, line


def test_the_variables_plait_sets_for_its_own_processes_are_known(monkeypatch, capsys):
    """plait train's ranks and plait testbed run's ranks run `plait` with these set."""
    for name, value in (("PLAIT_LAUNCH_TIME", "1.0"), ("PLAIT_TESTBED_HOST", "0"), ("PLAIT_FAULT_KILL", "1:3"),
                        ("PLAIT_TEST_MAX_WORKERS", "4"), ("PLAIT_CACHE_DIR", "/tmp")):
        monkeypatch.setenv(name, value)
    assert main(["cost", "--help"]) == 0
    assert "error" not in capsys.readouterr().err


def test_every_plait_variable_in_the_sources_is_known():
    """Each PLAIT_* name plait's sources spell out (read or set) is in the table the
    check uses: a new variable cannot be refused by plait itself."""
    from plait.cli.environment import KNOWN_VARIABLES

    spelled = set()
    for path in SOURCES.rglob("*.py"):
        if path == SOURCES / "cli" / "environment.py":  # the table itself; its docstring spells a misspelt name
            continue
        spelled |= set(re.findall(r"\bPLAIT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    spelled -= {"PLAIT_COMM"}  # the prefix, in prose ("PLAIT_COMM_*")
    assert spelled and spelled <= set(KNOWN_VARIABLES), sorted(spelled - set(KNOWN_VARIABLES))


# ----------------------------------------------------------------------------- plait train's layout
@pytest.mark.parametrize("variables, flags, expected", [
    # before: passed --dry-run; the run failed after its 4 ranks started
    (dict(PLAIT_HIERARCHY="foo"), ["--algorithm", "hierarchical"],
     "plait train: error: PLAIT_HIERARCHY='foo': a hierarchy is sizes like '2x4'"),
    (dict(PLAIT_HIERARCHY="2x0"), [], "plait train: error: PLAIT_HIERARCHY='2x0': a hierarchy is sizes like"),
    # valid syntax, wrong product: the default layout's dp groups have 2 ranks
    (dict(PLAIT_HIERARCHY="3x3"), ["--algorithm", "hierarchical"],
     "plait train: error: PLAIT_HIERARCHY='3x3' names 9 ranks, but the hierarchical algorithm runs on the dp "
     "groups (dp=2) of 2 ranks; set PLAIT_HIERARCHY to a hierarchy of 2 ranks"),
    (dict(PLAIT_HIERARCHY="2", PLAIT_ALGORITHMS="all_reduce=hierarchical"), [],
     "plait train: error: PLAIT_HIERARCHY='2' names 2 ranks, but the hierarchical algorithm runs on the world of 4 "
     "ranks; no one hierarchy fits groups of 2 and 4 ranks: unset PLAIT_HIERARCHY"),
    # before: accepted; every rank failed at its first all-reduce (no topology in plait train)
    (dict(PLAIT_ALGORITHMS="all_reduce=blink"), [],
     "plait train: error: PLAIT_ALGORITHMS: all_reduce=blink is built from the cluster's topology"),
    # before: silently ignored (the run's collectives wait --timeout-s)
    (dict(PLAIT_COMM_TIMEOUT_S="5"), [],
     "plait train: error: PLAIT_COMM_TIMEOUT_S=5 would be ignored: plait train's collectives wait timeout_s "
     "(--timeout-s, now 300); pass --timeout-s 5"),
    # before (issue 31's review): the 4 ranks started, then "ValueError: invalid literal for int()" naming no
    # variable; a rank the run does not have never fired
    (dict(PLAIT_FAULT_KILL="garbage"), [],
     "plait train: error: PLAIT_FAULT_KILL='garbage' must be RANK:STEP, two ints"),
    (dict(PLAIT_FAULT_KILL="9:3"), [],
     "plait train: error: PLAIT_FAULT_KILL='9:3' names rank 9, but this run has ranks 0..3"),
    # before: accepted, the later algorithm silently won
    (dict(PLAIT_ALGORITHMS="all_reduce=ring,all_reduce=tree"), [],
     "plait train: error: PLAIT_ALGORITHMS='all_reduce=ring,all_reduce=tree': all_reduce named more than once"),
])
def test_comm_variables_are_checked_against_the_run_in_dry_run(variables, flags, expected, monkeypatch, capsys,
                                                                tmp_path):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    line = _one_line_error(capsys, main(["train", "--dry-run", "--out", str(tmp_path / "run"), *flags]))
    assert line.startswith(expected), line


def test_a_hierarchy_that_fits_every_group_is_taken(monkeypatch, capsys, tmp_path):
    """dp=4: the dp groups are the world, so '2x2' fits; the check refuses nothing valid."""
    monkeypatch.setenv("PLAIT_HIERARCHY", "2x2")
    monkeypatch.setenv("PLAIT_COMM_TIMEOUT_S", "60")
    status = main(["train", "--dry-run", "--out", str(tmp_path / "run"), "--algorithm", "hierarchical",
                   "--dp", "4", "--pp", "1", "--timeout-s", "60", "--data-max-bytes", "100000"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "error" not in captured.err
