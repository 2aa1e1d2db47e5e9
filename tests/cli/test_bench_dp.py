"""`plait bench dp` end to end on 2 spawned gloo ranks (tiny settings): the
throughput rows for plait and DDP, the compression table, JSON and the loss plot,
and user errors."""

import io
import json
import os
from contextlib import redirect_stdout

import pytest

from plait.cli.main import main

TINY = ["--nprocs", "2", "--model", "mlp", "--rounds", "2", "--steps", "2", "--warmup", "1",
        "--compression-steps", "12", "--timeout", "60"]


@pytest.mark.slow
def test_bench_dp_reports_throughput_and_compression(tmp_path):
    json_path, plot_path = tmp_path / "dp.json", tmp_path / "loss.png"
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["bench", "dp", *TINY, "--compression", "topk:0.1+ef,sign+ef", "--json", str(json_path),
                       "--plot", str(plot_path)])
    text = out.getvalue()
    assert status == 0, text
    assert "ratio plait/DDP" in text and "hidden behind backward" in text
    report = json.loads(json_path.read_text())
    throughput = [row for row in report["rows"] if row["kind"] == "throughput"]
    assert sorted(row["mode"] for row in throughput) == ["ddp", "ddp", "plait", "plait"]
    assert all(row["samples_per_s"] > 0 for row in throughput)
    plait_row = next(row for row in throughput if row["mode"] == "plait")
    assert 0.0 <= plait_row["hidden_fraction"] <= 1.0 and plait_row["bytes_per_step"] > 0
    compression = {row["compression"]: row for row in report["rows"] if row["kind"] == "compression"}
    assert list(compression) == ["none", "topk:0.1+ef", "sign+ef"]  # the baseline is added first
    none_bytes = compression["none"]["bytes_per_step"]
    # 85,002 float32 gradients: top-k 10% sends values + int32 indices (~20%), signs 1 bit (~3%)
    assert 0.15 < compression["topk:0.1+ef"]["bytes_per_step"] / none_bytes < 0.25
    assert 0.02 < compression["sign+ef"]["bytes_per_step"] / none_bytes < 0.05
    assert all(len(row["losses"]) == 12 for row in compression.values())
    assert os.path.getsize(plot_path) > 1000
    assert "topk(ratio=0.1)+ef" in text


@pytest.mark.parametrize("argv, message", [
    (["--nprocs", "1"], "data parallelism needs >= 2 processes"),
    (["--compression", "zip:3"], "zip:3"),
    (["--steps", "0"], "steps=0 must be >= 1"),
])
def test_bench_dp_user_errors(argv, message, capsys):
    assert main(["bench", "dp", *argv]) == 2
    assert message in capsys.readouterr().err
