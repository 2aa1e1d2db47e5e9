"""`plait bench zero` end to end on a tiny GPT in a fresh world of 2 gloo ranks: every
variant runs and is reported, the state a ZeRO-3 rank holds (live storages) is below
DataParallel's and near FSDP2's, and bad flags are named."""

import json

import pytest

from plait.cli.main import main

TINY = ["--nprocs", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--vocab", "64",
        "--batch", "2", "--rounds", "1", "--steps", "1"]


@pytest.mark.slow
def test_every_variant_runs_and_zero3_holds_less(tmp_path, capsys):
    assert main(["bench", "zero", *TINY, "--json", str(tmp_path / "zero.json")]) == 0
    out = capsys.readouterr().out
    assert "throughput zero3 / fsdp2" in out and "throughput zero1 / dataparallel" in out
    result = json.loads((tmp_path / "zero.json").read_text())
    state = {row["variant"]: row["state_bytes"] for row in result["variants"]}
    assert set(state) == {"dataparallel", "ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2-keep", "zero1-disk",
                          "zero2-disk", "zero3-disk"}
    # AdamW, N = 2: DataParallel keeps 16 bytes per parameter (+ its gradient buckets), ZeRO-3 ~16/N
    assert state["zero3"] < 0.6 * state["dataparallel"]
    assert state["zero1"] < state["dataparallel"]
    # offloaded: Adam's two moments (8 bytes per parameter, 1/N of them here) leave the process's memory
    for stage in (1, 2, 3):
        assert state[f"zero{stage}-disk"] < state[f"zero{stage}"]
    assert "throughput zero2-disk / zero2" in out
    # which transport each side used: plait's shared memory (2 ranks on this host), torch's gloo
    transports = {row["variant"]: row["transport"] for row in result["rows"]}
    assert transports["zero3"].startswith("plait.comm: shm "), transports
    assert transports["fsdp2"] == transports["ddp"] == "torch.distributed: gloo"
    assert "# zero3: collectives over plait.comm: " in out


@pytest.mark.parametrize("argv,message", [
    (["--variants", "zero4"], "--variants: unknown 'zero4'; valid: dataparallel"),
    (["--nprocs", "1"], "--nprocs 1: sharding needs at least 2 ranks"),
])
def test_bad_flags_are_named(capsys, argv, message):
    assert main(["bench", "zero", *argv]) == 2
    assert message in capsys.readouterr().err
