"""`plait simulate`: tables, JSON, size sweeps, plots, topology files and errors."""

import json

import pytest

from plait.cli.main import main


@pytest.fixture(autouse=True)
def no_saved_profile(tmp_path, monkeypatch):
    # the 'local' preset reads the saved calibration profile; keep the tests off the user's
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))


def run_json(capsys, *argv) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_dgx_two_nodes_json(capsys):
    out = run_json(capsys, "--topology", "dgx-a100", "--nodes", "2", "--nbytes", "16MB",
                   "--algorithm", "ring,halving_doubling,hierarchical")
    assert out["world_size"] == 16 and out["collective"] == "all_reduce"
    rows = {r["algorithm"]: r for r in out["results"]}
    assert list(rows) == ["ring", "halving_doubling", "hierarchical"]
    assert rows["hierarchical"]["time_s"] < rows["ring"]["time_s"]
    for row in rows.values():
        assert row["nbytes"] == 16 << 20
        assert row["algbw_bytes_per_s"] == pytest.approx(row["nbytes"] / row["time_s"])
        assert row["busbw_bytes_per_s"] == pytest.approx(row["algbw_bytes_per_s"] * 2 * 15 / 16)
        assert 0 < row["busiest_utilisation"] <= 1 + 1e-9
        assert " -> " in row["busiest_link"] and "steps" in row["critical"]


def test_partial_allocation(capsys):
    out = run_json(capsys, "--topology", "dgx-a100", "--nodes", "2", "--allocation", "3+5",
                   "--nbytes", "1MB", "--algorithm", "hierarchical")
    assert out["world_size"] == 8
    assert out["hierarchy"] == [[0, 1, 2], [3, 4, 5, 6, 7]]


def test_table_output(capsys):
    assert main(["simulate", "--topology", "ring", "--nodes", "1", "--devices-per-node", "6",
                 "--nbytes", "64KB", "--algorithm", "ring,direct"]) == 0
    out = capsys.readouterr().out
    assert "algorithm" in out and "busiest link" in out and "critical path" in out
    assert out.count("\nring ") == 1 and out.count("\ndirect ") == 1


def test_size_sweep_and_plot(capsys, tmp_path):
    plot = tmp_path / "sizes.png"
    out = run_json(capsys, "--topology", "local", "--devices-per-node", "4", "--sizes", "1KB:64KB",
                   "--algorithm", "ring,recursive_doubling", "--plot", str(plot))
    assert [r["nbytes"] for r in out["results"]] == [1 << k for k in range(10, 17) for _ in range(2)]
    assert plot.stat().st_size > 1000


def test_utilisation_plot(capsys, tmp_path):
    plot = tmp_path / "links.png"
    assert main(["simulate", "--topology", "fat-tree", "--nodes", "4", "--devices-per-node", "2",
                 "--nbytes", "1MB", "--plot", str(plot)]) == 0
    assert "plot written to" in capsys.readouterr().out
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_save_and_load_topology(capsys, tmp_path, suffix):
    path = tmp_path / f"cluster{suffix}"
    first = run_json(capsys, "--topology", "dgx-h100", "--nodes", "2", "--allocation", "4+4",
                     "--nbytes", "4MB", "--save-topology", str(path))
    again = run_json(capsys, "--topology-file", str(path), "--nbytes", "4MB")
    assert [r["time_s"] for r in again["results"]] == [r["time_s"] for r in first["results"]]
    assert again["world_size"] == 8


def test_other_collectives(capsys):
    out = run_json(capsys, "--topology", "dgx-a100", "--nodes", "1", "--collective", "all-to-all",
                   "--nbytes", "64KB", "--algorithm", "direct,pairwise")
    assert [r["algorithm"] for r in out["results"]] == ["direct", "pairwise"]
    out = run_json(capsys, "--topology", "dgx-a100", "--nodes", "1", "--collective", "broadcast",
                   "--root", "3", "--nbytes", "1MB", "--algorithm", "all")
    assert len(out["results"]) >= 3


@pytest.mark.parametrize("argv, message", [
    (["--nbytes", "1e30"], "out of range"),
    (["--nbytes", "0"], "out of range"),
    (["--nbytes=-4KB"], "out of range"),
    (["--nbytes", "4XB"], "invalid size"),
    (["--nbytes", "10000000000000000000000000"], "out of range"),
    (["--nbytes", "lots"], "invalid size"),
    (["--sizes", "1KB"], "must be MIN:MAX"),
    (["--sizes", "1MB:1KB"], "is below MIN"),
    (["--topology", "dgx-z"], "unknown topology preset 'dgx-z'; valid: dgx-a100"),
    (["--algorithm", "ring,bogus"], "unknown algorithm"),
    (["--allocation", "9"], "has 8"),
    (["--topology-file", "nowhere.json"], "cannot read topology file"),
    (["--collective", "broadcast", "--root", "99"], "--root 99 must be in"),
])
def test_errors(capsys, argv, message):
    assert main(["simulate", "--nodes", "1", *argv]) == 2
    assert message in capsys.readouterr().err
