"""`plait bench tp` end to end on spawned gloo worlds of 1 and 2 ranks (a tiny GPT):
rows per tp, the measured bytes per layer equal to the schedule-priced formula, 2
all-reduces forward and 2 backward per layer; the formula itself; user errors."""

import io
import json
from contextlib import redirect_stdout

import pytest

from plait.bench.tp import TpBenchConfig, call_bytes_sent, layer_formula
from plait.cli.main import main

TINY = ["--layers", "1", "--hidden", "32", "--heads", "4", "--seq-len", "8", "--batch", "2", "--vocab", "67",
        "--steps", "2", "--warmup", "1", "--algorithm", "ring", "--timeout", "60"]


def _run(tmp_path, *argv):
    json_path = tmp_path / "tp.json"
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["bench", "tp", *TINY, *argv, "--json", str(json_path)])
    text = out.getvalue()
    assert status == 0, text
    return text, {row["tp"]: row for row in json.loads(json_path.read_text())["rows"]}


def test_bench_tp_bytes_per_layer_match_the_formula(tmp_path):
    text, rows = _run(tmp_path, "--tp", "1,2")
    assert sorted(rows) == [1, 2]
    assert "plait bench tp: GPT 1 layers" in text and "comm argument check off" in text
    one, two = rows[1], rows[2]
    assert one["comm_ms"] == 0.0 and one["bytes_per_layer"] == 0 and one["bytes_ratio"] is None
    assert two["calls_per_layer"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    assert two["calls_per_layer"] == two["calls_per_layer_formula"]
    # ring at p = 2 sends 2(p-1)/p n = n elements per all-reduce: 4 x 512 x 4 bytes per layer
    assert two["bytes_per_layer"] == two["bytes_per_layer_formula"] == 4 * 2 * 8 * 32 * 4
    assert two["bytes_ratio"] == 1.0 and two["payload_per_layer"] == 4 * 2 * 8 * 32 * 4
    assert two["layer"]["forward"]["all_reduce"]["algorithms"] == {"ring": 2}
    # per step: embedding + 2 per layer + 2 in the cross-entropy forward, 2 per layer + the logits' f backward
    assert two["calls_per_step"] == {"all_reduce": 8}
    assert 0.0 < two["comm_fraction"] < 1.0 and two["step_ms"] > two["comm_ms"] > 0
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)  # the same model at every tp
    assert two["speedup"] == pytest.approx(one["step_ms"] / two["step_ms"])
    assert "2AR | 2AR" in text and "all_reduce by ring" in text


def test_bench_tp_sequence_parallel_pairs(tmp_path):
    text, rows = _run(tmp_path, "--tp", "2", "--sequence-parallel", "--check-args")
    two = rows[2]
    assert two["calls_per_layer"] == {"forward": {"all_gather": 2, "reduce_scatter": 2},
                                      "backward": {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 2}}
    assert two["bytes_ratio"] == 1.0
    # ring all-gather and reduce-scatter each send (p-1)/p n: a pair costs one all-reduce
    pair_nbytes = 2 * 8 * 32 * 4
    assert two["bytes_per_layer_formula"] == 4 * pair_nbytes + 6 * 32 * 4
    assert "comm argument check on" in text


def test_formula_prices_each_call_with_its_schedule():
    n, itemsize = 1000, 4
    assert call_bytes_sent("all_reduce", "ring", 4, n, itemsize) == 2 * 3 / 4 * n * itemsize
    assert call_bytes_sent("all_gather", "ring", 4, n, itemsize) == 3 / 4 * n * itemsize
    assert call_bytes_sent("all_reduce", "torch", 4, n, itemsize) == n * itemsize
    assert call_bytes_sent("all_reduce", "ring", 1, n, itemsize) == 0.0
    config = TpBenchConfig(tp=(1, 2), layers=1, hidden=32, heads=4, seq_len=8, batch=2, vocab=67)
    assert layer_formula(config, 2) == {"forward": [("all_reduce", 512)] * 2, "backward": [("all_reduce", 512)] * 2}
    assert layer_formula(config, 1) == {"forward": [], "backward": []}


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "tp=3 does not divide heads=8"),
    (["--tp", "1,2,2"], "lists a degree twice"),
    (["--heads", "6"], "heads=6 does not divide hidden=256"),
    (["--steps", "0"], "steps=0 must be an int >= 1"),
    (["--warmup", "-1"], "warmup=-1 must be an int >= 0"),
    (["--tp", "1,4", "--sequence-parallel", "--seq-len", "6"], "use a seq_len that is a multiple of 4"),
    (["--algorithm", "nope"], "unknown algorithm 'nope'"),
    (["--algorithm", "bruck", "--sequence-parallel"], "does not implement all_reduce"),
    (["--dtype", "int8"], "dtype='int8'"),
])
def test_bench_tp_user_errors(argv, message, capsys):
    assert main(["bench", "tp", *argv]) == 2
    err = capsys.readouterr().err
    assert "plait bench tp: error:" in err and message in err


def test_bench_tp_bad_tp_list(capsys):
    assert main(["bench", "tp", "--tp", "1,two"]) == 2
    assert "invalid --tp '1,two'" in capsys.readouterr().err
