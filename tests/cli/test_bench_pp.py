"""`plait bench pp` end to end on a spawned world of 2 ranks (a tiny MLP): one row
per schedule, the replay and formula bubbles, the measured peak activation bytes (live saved storages)
equal to the schedule's prediction; user errors. `--vs-torch`: a ratio row per schedule
with its spread and the losses agreeing (no timing asserted), plait over gloo and over shared
memory each its own rows, the summary's arithmetic."""

import io
import json
import os
from contextlib import redirect_stdout, redirect_stderr

import pytest

from plait.bench.pp import PpBenchConfig, formula_bubble
from plait.bench.pp_vs_torch import PpVsTorchConfig, summarise
from plait.cli.main import main

TINY = ["--stages", "2", "--layers", "4", "--width", "32", "--batch", "8", "--microbatches", "4", "--steps", "1",
        "--warmup", "0"]


def test_bench_pp_rows(tmp_path):
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["bench", "pp", *TINY, "--json", str(tmp_path / "pp.json"),
                       "--timeline-out", str(tmp_path / "timelines")])
    assert status == 0, out.getvalue()
    rows = {row["schedule"]: row for row in json.loads((tmp_path / "pp.json").read_text())["rows"]}
    assert sorted(rows) == ["1f1b", "chimera", "gpipe", "interleaved_1f1b", "zero_bubble"]
    for name, row in rows.items():
        assert row["bubble_unit_replay"] == pytest.approx(row["bubble_formula"], abs=1e-12)  # p = 2, m = 4
        assert row["measured_bytes"] == row["predicted_bytes"]  # live saved storages freed where the schedule says
        assert 0.0 <= row["bubble_measured"] < 1.0
        assert (tmp_path / "timelines" / f"{name}-p2.json").exists()
    assert rows["gpipe"]["in_flight"] == [4, 4] and rows["1f1b"]["in_flight"] == [2, 1]
    assert rows["1f1b"]["in_flight_formula"] == [2, 1]
    assert formula_bubble("1f1b", 2, 4, 1) == 1 / 5


def test_bench_pp_user_errors():
    with pytest.raises(ValueError, match=r"--stages 4: interleaved_1f1b needs microbatches \(m=6\)"):
        PpBenchConfig(stages=(4,), microbatches=6)
    with pytest.raises(ValueError, match=r"layers=4 cannot fill 4 stages x 2 virtual chunks: use --layers >= 8"):
        PpBenchConfig(stages=(4,), layers=4)
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["bench", "pp", "--schedules", "zb"]) == 2
    assert "schedules ['zb']: choose from" in err.getvalue()


# ----- plait bench pp --vs-torch ------------------------------------------------------------
def test_bench_pp_vs_torch_rows(tmp_path):
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["bench", "pp", "--vs-torch", *TINY, "--rounds", "2", "--busy-loop", "off",
                       "--json", str(tmp_path / "vs.json")])
    text = out.getvalue()
    assert status == 0, text
    rows = {(row["schedule"], row["transport"]): row for row in json.loads((tmp_path / "vs.json").read_text())["rows"]}
    # chimera has no torch twin; plait over gloo and over shared memory, each its own rows
    assert sorted(rows) == [(name, transport) for name in ["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"]
                            for transport in ("gloo", "shm")]
    assert rows[("zero_bubble", "shm")]["torch_schedule"] == "ScheduleInterleavedZeroBubble"
    for (name, transport), row in rows.items():
        assert not row["busy_loop"] and len(row["plait_compute_ms"]) == 2
        if os.cpu_count() >= 2:  # else no floor: a computation's wall time includes the other rank's turns
            assert row["ceiling"] == pytest.approx(row["torch_ms"] / row["compute_floor_ms"])
        else:
            assert row["ceiling"] is None and row["compute_floor_ms"] is None
        assert len(row["ratios"]) == 2 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert row["losses_agree"] and len(row["plait_losses"]) == len(row["torch_losses"]) == 0 + 2 * 1  # warm-up + rounds x steps
        assert row["plait_losses"][0] == row["torch_losses"][0]  # the same float32 forward: bitwise
        line = next(line for line in text.splitlines() if line.startswith(f" 2 {name:<17}{transport} "))
        assert f"{row['ratio']:.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})" in line and "agree" in line
    assert "# losses agree on every row" in text


def test_bench_pp_vs_torch_summary_and_errors():
    config = PpVsTorchConfig(stages=(2,), steps=2, rounds=3)
    # two ranks, 2 steps x 3 rounds per side; a step counts as its slowest rank
    plait = [[1.0, 3.0, 2.0, 2.0, 1.0, 1.0], [2.0, 1.0, 2.0, 4.0, 1.0, 3.0]]
    torch_times = [[3.0, 3.0, 4.0, 4.0, 2.0, 2.0], [3.0, 3.0, 4.0, 4.0, 2.0, 2.0]]
    row = summarise("gpipe", 2, config, [{"plait": p, "torch": t} for p, t in zip(plait, torch_times)],
                    [{"plait": [1.0, 0.5], "torch": [None, None]}, {"plait": [1.0, 0.5], "torch": [1.0, 0.5 + 4e-6]}])
    assert row["plait_ms_per_round"] == [2500.0, 3000.0, 2000.0]  # medians of (2, 3), (2, 4), (1, 3)
    assert row["ratios"] == [3.0 / 2.5, 4.0 / 3.0, 2.0 / 2.0]
    assert (row["ratio"], row["ratio_min"], row["ratio_max"]) == (1.2, 1.0, 4.0 / 3.0)
    assert row["loss_max_rel_diff"] == pytest.approx(4e-6 / (0.5 + 4e-6)) and row["losses_agree"]
    assert not summarise("gpipe", 2, config, [{"plait": p, "torch": t} for p, t in zip(plait, torch_times)],
                         [{"plait": [1.0], "torch": [1.0 + 2e-5]}, {"plait": [1.0], "torch": [None]}])["losses_agree"]
    with pytest.raises(ValueError, match=r"torch.distributed.pipelining has no counterpart of \['chimera'\]"):
        PpVsTorchConfig(schedules=("gpipe", "chimera"))
    with pytest.raises(ValueError, match=r"transports=\['nccl'\]: choose from \['gloo', 'shm'\]"):
        PpVsTorchConfig(transports=("nccl",))
    with pytest.raises(ValueError, match=r"rounds=0 must be an int >= 1"):
        PpVsTorchConfig(rounds=0)
    with pytest.raises(ValueError, match=r"no counterpart of \['chimera'\].*batch=7 does not split"):
        PpVsTorchConfig(schedules=("chimera",), batch=7)  # every problem at once
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["bench", "pp", "--vs-torch", "--schedules", "chimera"]) == 2
    assert "no counterpart of ['chimera']" in err.getvalue()
