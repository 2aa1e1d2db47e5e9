"""Hierarchy specs for the hierarchical algorithm."""

import pytest

from plait.comm.algorithms.hierarchical import parse_hierarchy


def test_specs():
    assert parse_hierarchy("2x3", 6) == ((0, 1, 2), (3, 4, 5))
    assert parse_hierarchy("2x2x2", 8) == (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    assert parse_hierarchy("3+2", 5) == ((0, 1, 2), (3, 4))
    assert parse_hierarchy([[0, 2], [1, 3]], 4) == ((0, 2), (1, 3))


def test_default_groups_the_ranks_per_host_the_caller_passes(monkeypatch):
    assert parse_hierarchy(None, 8, 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_hierarchy(None, 8, 3) == tuple(range(8))  # does not divide 8: one flat group
    assert parse_hierarchy(None, 5) == tuple(range(5))
    # the library never reads the launcher's variable: the CLI passes it down (CommConfig.local_world_size)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert parse_hierarchy(None, 8) == tuple(range(8))


def test_the_cli_passes_the_launchers_ranks_per_host_down(monkeypatch):
    from plait.cli.comm_config import config_from_environment
    from plait.comm.config import CommConfig

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert config_from_environment().local_world_size == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert config_from_environment().local_world_size is None
    with pytest.raises(ValueError, match="local_world_size=0"):
        CommConfig(local_world_size=0)


@pytest.mark.parametrize("spec,world,fragment", [
    ("2x3", 5, "missing []"),
    ("2x2", 5, "missing [4]"),
    ("a+b", 4, "is not understood"),
    ([[0, 1], [1, 2]], 3, "repeated [1]"),
    ([[0, 1], [2, [3]]], 4, "different depths"),
    ([[0, 1], []], 2, "empty group"),
])
def test_bad_specs_name_the_problem(spec, world, fragment):
    with pytest.raises(ValueError) as info:
        parse_hierarchy(spec, world)
    assert fragment in str(info.value)


def test_build_schedule_refuses_a_hierarchy_that_misses_ranks():
    from plait.comm.algorithms import build_schedule

    with pytest.raises(ValueError, match=r"missing \[4\]"):
        build_schedule("all_reduce", "hierarchical", 5, 10, hierarchy=((0, 1), (2, 3)))
    assert build_schedule("all_reduce", "hierarchical", 4, 8, hierarchy=[[0, 1], [2, 3]]).num_steps == 4


def test_commconfig_replace_changes_only_what_it_names():
    """configure() and its restore are gone (a frozen CommConfig per communicator);
    replace() must keep every field it is not given: all of them are compared."""
    import dataclasses

    from plait.comm import CommConfig
    from plait.comm.tuner import Tuner
    from plait.cost import LinkModel
    from plait.cost.presets import preset

    base = CommConfig(timeout_s=9.0, check="deep", segment_bytes=123, pipeline_segment_bytes=456, hierarchy="2x2",
                      local_world_size=2, topology=preset("local"), algorithms={"all_reduce": "ring"},
                      tuner=Tuner(LinkModel(1e-3, 1e-9)), transport="shm", shm_ring_bytes=8192, shm_spin_us=7.0,
                      shm_spin_max_us=99.0, shm_dir="/tmp")
    names = [field.name for field in dataclasses.fields(CommConfig)]
    assert len(names) == 14
    for name in names:
        changed = base.replace(**{name: getattr(CommConfig(), name)})
        for other in names:
            if other != name:
                assert getattr(changed, other) == getattr(base, other), (name, other)
