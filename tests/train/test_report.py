"""Run report (FLOPs, MFU, report files) and the progress display."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from plait.train.progress import format_duration, format_rate, Progress
from plait.train.flops import gpt_train_flops, measure_peak_flops, mlp_train_flops
from plait.train.report import summary_lines, write_report


# ---- FLOPs ----------------------------------------------------------------------------

def _hand_count(b, s, l, h, v, recompute=False):
    """Matmul FLOPs counted layer by layer: forward = per layer QKV 2bs·h·3h, scores
    2b·s·s·h, weighted sum 2b·s·s·h, projection 2bs·h·h, MLP 2·2bs·h·4h; logits 2bs·h·V.
    Backward = 2× forward; recomputation re-runs the layers' forward (not the logits)."""
    layer_forward = 2 * b * s * h * 3 * h + 2 * b * s * s * h * 2 + 2 * b * s * h * h + 2 * 2 * b * s * h * 4 * h
    logits_forward = 2 * b * s * h * v
    layer_passes = 4 if recompute else 3
    return l * layer_forward * layer_passes + logits_forward * 3


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("b,s,l,h,v", [(1, 1, 1, 1, 1), (2, 8, 3, 16, 50), (3, 5, 2, 12, 7)])
def test_gpt_flops_match_hand_count(b, s, l, h, v, recompute):
    assert gpt_train_flops(b, s, l, h, v, recompute=recompute) == _hand_count(b, s, l, h, v, recompute)


def test_gpt_flops_leading_term_is_six_flops_per_parameter_per_token():
    b, s, l, h = 4, 16, 3, 32
    layer_matmul_params = l * 12 * h * h  # QKV 3h², projection h², MLP 8h²
    leading = 72 * b * s * l * h * h
    assert leading == 6 * layer_matmul_params * b * s
    # the other two terms vanish as h grows (s ≪ 6h, V ≪ 12lh)
    assert gpt_train_flops(b, s, l, h, 1) == pytest.approx(leading * (1 + s / (6 * h) + 1 / (12 * l * h)))
    assert gpt_train_flops(b, s, l, h, 10, recompute=True) / gpt_train_flops(b, s, l, h, 10) == pytest.approx(
        (96 * (1 + s / (6 * h) + 10 / (16 * l * h))) / (72 * (1 + s / (6 * h) + 10 / (12 * l * h))))


class _TinyGPT(nn.Module):
    """Bare transformer with every matmul explicit; torch's FLOP counter is the oracle."""

    def __init__(self, l, h, v, heads=2):
        super().__init__()
        self.heads = heads
        self.layers = nn.ModuleList(nn.ModuleDict({
            "qkv": nn.Linear(h, 3 * h), "proj": nn.Linear(h, h),
            "up": nn.Linear(h, 4 * h), "down": nn.Linear(4 * h, h)}) for _ in range(l))
        self.head = nn.Linear(h, v, bias=False)

    def forward(self, x):  # x: (b, s, h)
        b, s, h = x.shape
        for layer in self.layers:
            q, k, v = layer["qkv"](x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # (b, heads, s, s)
            x = x + layer["proj"]((weights @ v).transpose(1, 2).reshape(b, s, h))
            x = x + layer["down"](torch.relu(layer["up"](x)))
        return self.head(x)


def test_gpt_flops_match_torch_flop_counter():
    b, s, l, h, v = 2, 6, 2, 8, 11
    model = _TinyGPT(l, h, v).double()
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)  # as if from an embedding
    with FlopCounterMode(display=False) as counter:
        model(x).square().mean().backward()
    assert counter.get_total_flops() == gpt_train_flops(b, s, l, h, v)


@pytest.mark.parametrize("tied_head", [True, False])
def test_gpt_flops_match_plait_gpt(tied_head):
    """The report's FLOPs are those of the model `plait train` runs (unsharded)."""
    from plait.models.gpt import GPT, GPTConfig

    b, s, l, h, v = 3, 8, 2, 16, 20
    model = GPT(GPTConfig(layers=l, hidden=h, heads=2, seq_len=s, vocab=v, tied_head=tied_head, dtype="float64"))
    tokens = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens, tokens).backward()
    assert counter.get_total_flops() == gpt_train_flops(b, s, l, h, v)


@pytest.mark.parametrize("sizes", [(64, 128, 128, 128, 10), (64, 10), (5, 3, 7)])
def test_mlp_flops_are_six_per_weight_and_sample_as_torch_counts_them(sizes):
    """plait train's MLP: torch's FlopCounterMode gives 6·B·Σ d_i·d_(i+1) when the input
    wants a gradient (every layer's dW and dX), and 2·B·d_0·d_1 less on a data batch
    (autograd skips the first layer's input gradient; the 6N rule counts it)."""
    from plait.models.mlp import MLP

    batch = 16
    model = MLP(sizes).double()
    weights = sum(module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear))
    assert mlp_train_flops(batch, sizes) == 6 * batch * weights
    for wants_grad, skipped in ((True, 0), (False, 2 * batch * sizes[0] * sizes[1])):
        x = torch.randn(batch, sizes[0], dtype=torch.float64, requires_grad=wants_grad)
        with FlopCounterMode(display=False) as counter:
            model(x).square().mean().backward()
        assert counter.get_total_flops() == mlp_train_flops(batch, sizes) - skipped
    with pytest.raises(ValueError, match=r"batch\(0\).*sizes\[1\]\(0\)"):
        mlp_train_flops(0, (4, 0))


def test_gpt_flops_reject_bad_sizes():
    with pytest.raises(ValueError, match=r"batch\(0\).*vocab\(2.5\)"):
        gpt_train_flops(0, 4, 2, 8, 2.5)


def test_measure_peak_flops_is_a_plausible_rate():
    rate = measure_peak_flops(size=64, seconds=0.02)
    assert 1e6 < rate < 1e14
    with pytest.raises(ValueError, match="size"):
        measure_peak_flops(size=0)


# ---- write_report on a synthetic run -----------------------------------------------------

TOKENS_PER_STEP = 500


def _synthetic_run():
    """10 steps on dp=2 × pp=2; step 1 is slow warm-up, later steps alternate 0.5 s / 0.25 s."""
    metrics, elapsed_s = [], 0.0
    for step in range(1, 11):
        step_s = 2.0 if step == 1 else (0.5 if step % 2 else 0.25)
        elapsed_s += step_s
        record = {"step": step, "loss": 5.0 - 0.3 * step, "lr": 1e-3, "tokens_per_s": TOKENS_PER_STEP / step_s,
                  "step_s": step_s, "elapsed_s": elapsed_s}
        if step in (5, 10):
            record["val_loss"] = 5.2 - 0.3 * step
        metrics.append(record)
    ranks = []
    for rank in range(4):
        dp, pp = rank % 2, rank // 2
        wall_s = 8.0 if rank == 3 else 7.0
        bubble_s = 1.0 + pp
        comm_s = 1.5
        other_s = 0.5
        ranks.append({
            "rank": rank, "coords": {"dp": dp, "tp": 0, "pp": pp}, "steps": 10, "wall_s": wall_s,
            "compute_s": wall_s - bubble_s - comm_s - other_s, "comm_s": comm_s, "bubble_s": bubble_s,
            "other_s": other_s,
            "collectives": {
                "dp.all_reduce": {"calls": 10, "bytes_sent": (rank + 1) * 3 * 2**20, "time_s": 1.0},
                "pp.send": {"calls": 40, "bytes_sent": 2**19 if pp == 0 else 0, "time_s": 0.25 * (1 - pp)},
            },
            "comm": {"config": "timeout 300s", "tuner": "none: the default table",
                     "transports": {"world": "shm with group ranks [0, 1, 2, 3] (4194304 B rings)",
                                    "dp": f"shm with group ranks {[pp * 2, pp * 2 + 1]} (4194304 B rings)"}}})
    run = {"config": {"model": "gpt", "dp": 2, "tp": 1, "pp": 2, "steps": 10}, "mesh": "dp=2 x tp=1 x pp=2\nrank 0: ...",
           "world_size": 4, "backend": "gloo", "device": "cpu", "tokens_per_step": TOKENS_PER_STEP,
           "flops_per_step": 1e9, "peak_flops_per_s": 2e10, "time_to_first_step_s": 2.5, "steps": 10,
           "start_step": 0, "samples": "once upon a time"}
    return metrics, ranks, run


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("report") / "run"
    metrics, ranks, run = _synthetic_run()
    report = write_report(out_dir, metrics=metrics, ranks=ranks, run=run)
    return out_dir, report


def test_report_files_exist_and_json_equals_returned(written):
    out_dir, report = written
    for name in ("report.json", "report.md", "loss.png"):
        assert (out_dir / name).is_file()
    assert json.loads((out_dir / "report.json").read_text()) == report
    assert report["paths"]["markdown"] == str(out_dir / "report.md")


def test_report_numbers(written):
    _, report = written
    # MFU by hand: 1e9 FLOPs × 10 steps / (8 s slowest wall × 4 processes × 2e10 FLOP/s)
    assert report["mfu"]["value"] == pytest.approx(1e9 * 10 / (8.0 * 4 * 2e10))
    assert report["wall_s"] == 8.0 and report["slowest_rank"] == 3
    # steps 2..10: five of 0.25 s, four of 0.5 s, 500 tokens each; step 1 excluded
    mean_tokens_per_s = 9 * TOKENS_PER_STEP / (5 * 0.25 + 4 * 0.5)
    assert report["throughput"]["mean_tokens_per_s"] == pytest.approx(mean_tokens_per_s)
    assert report["throughput"]["steps_measured"] == 9
    assert report["mfu"]["steady_value"] == pytest.approx(
        1e9 * (mean_tokens_per_s / TOKENS_PER_STEP) / (4 * 2e10))
    loss = report["loss"]
    assert loss["final_train"] == pytest.approx(2.0) and loss["final_train_step"] == 10
    assert loss["final_val"] == pytest.approx(2.2) and loss["final_val_step"] == 10
    assert loss["best_val"] == pytest.approx(2.2)
    assert report["time_to_first_step_s"] == 2.5
    assert report["mesh_shape"] == {"dp": 2, "tp": 1, "pp": 2}


def test_report_time_split_and_axis_totals(written):
    _, report = written
    rank3 = report["ranks"][3]
    assert rank3["coords"] == {"dp": 1, "tp": 0, "pp": 1}
    assert rank3["bubble_s"] == 2.0 and rank3["bubble_pct"] == pytest.approx(25.0)
    assert rank3["compute_s"] == pytest.approx(4.0) and rank3["compute_pct"] == pytest.approx(50.0)
    for row in report["ranks"]:
        assert sum(row[f"{part}_pct"] for part in ("compute", "comm", "bubble", "other")) == pytest.approx(100.0)
    # only the axes with more than one coordinate; pp stage 1 idles 2 s per rank vs 1 s
    assert set(report["axis_totals"]) == {"dp", "pp"}
    stage1 = report["axis_totals"]["pp"]["1"]
    assert stage1["ranks"] == 2 and stage1["wall_s"] == 15.0 and stage1["bubble_s"] == 4.0
    assert stage1["bubble_pct"] == pytest.approx(100 * 4.0 / 15.0)
    assert report["time_totals"]["wall_s"] == 29.0


def test_report_collective_bytes(written):
    _, report = written
    total = report["collectives"]["total"]
    assert total["dp.all_reduce"] == {"calls": 40, "bytes_sent": (1 + 2 + 3 + 4) * 3 * 2**20, "time_s": 4.0,
                                      "ranks": 4, "algorithms": {}}
    assert total["pp.send"]["bytes_sent"] == 2 * 2**19 and total["pp.send"]["calls"] == 160
    assert report["collectives"]["per_rank"]["2"]["dp.all_reduce"]["bytes_sent"] == 9 * 2**20


def test_report_markdown(written):
    out_dir, report = written
    md = (out_dir / "report.md").read_text()
    assert "| 3 (slowest) | 1 | 0 | 1 | 10 | 8.000 | 4.000 (50.0%) | 1.500 (18.8%) | 2.000 (25.0%) | 0.500 (6.2%) |" in md
    assert "| dp.all_reduce | 4 | 40 | 30.000 | 4.000 |  |" in md  # 30 MiB summed over ranks
    assert "| 2 | dp.all_reduce | 10 | 9.000 | 1.000 |" in md
    assert "| 3 | dp | shm with group ranks [2, 3] (4194304 B rings) |" in md  # how each group moved its messages
    assert "MFU = flops_per_step × steps_run / (wall_s × world_size × peak_flops_per_s)" in md
    assert "= 1.56%" in md
    for word in ("**compute**", "**comm**", "**bubble**", "**other**", "![loss curve](loss.png)",
                 "once upon a time", "dp=2 x tp=1 x pp=2", '"model": "gpt"'):
        assert word in md


def test_report_png(written):
    out_dir, _ = written
    data = (out_dir / "loss.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_summary_lines(written):
    _, report = written
    lines = summary_lines(report)
    assert 4 <= len(lines) <= 8
    text = "\n".join(lines)
    assert "train 2.0000" in text and "val 2.2000" in text
    assert "slowest rank 3 (dp1 tp0 pp1)" in text and "bubble 25%" in text
    assert "MFU: 1.6%" in text and report["paths"]["markdown"] in text
    assert "1.38k tokens/s" in text  # 4500 tokens / 3.25 s


def test_report_without_losses_ranks_or_peak(tmp_path):
    _, _, run = _synthetic_run()
    run = dict(run, peak_flops_per_s=None)
    metrics = [{"step": 1, "loss": float("nan"), "lr": 0.1, "tokens_per_s": 10.0, "step_s": 1.0, "elapsed_s": 1.0}]
    report = write_report(tmp_path, metrics=metrics, ranks=[], run=run)
    assert report["mfu"]["value"] is None and report["loss"]["final_train"] is None
    assert report["loss"]["nonfinite_train_records"] == 1
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "MFU: n/a" in summary_lines(report)
    json.loads((tmp_path / "report.json").read_text())  # strict JSON: no NaN


def test_report_throughput_of_resumed_run_skips_earlier_steps(tmp_path):
    """Resumed at step 6: the loss curve shows steps 0..9, throughput only 7..9 (6 is warm-up)."""
    _, ranks, run = _synthetic_run()
    run = dict(run, start_step=6)
    metrics = [{"step": step, "loss": 3.0, "lr": 0.1, "tokens_per_s": 100.0 * (step + 1), "step_s": 1.0,
                "elapsed_s": 1.0} for step in range(10)]
    report = write_report(tmp_path, metrics=metrics, ranks=[dict(rank, steps=4) for rank in ranks], run=run)
    assert report["throughput"]["steps_measured"] == 3
    assert report["throughput"]["mean_tokens_per_s"] == pytest.approx((800 + 900 + 1000) / 3)
    assert report["mfu"]["steps_run"] == 4


def test_report_rejects_missing_keys(tmp_path):
    metrics, ranks, run = _synthetic_run()
    del run["peak_flops_per_s"], ranks[1]["bubble_s"]
    with pytest.raises(ValueError, match=r"peak_flops_per_s.*ranks\[1\] lacks \['bubble_s'\]"):
        write_report(tmp_path, metrics=metrics, ranks=ranks, run=run)


# ---- progress ---------------------------------------------------------------------------

class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


class _Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self):
        return self.now_s


@pytest.mark.parametrize("seconds,text", [(0.0, "0.0s"), (12.44, "12.4s"), (59.94, "59.9s"), (59.96, "1m00s"),
                                          (185, "3m05s"), (3599.4, "59m59s"), (3720, "1h02m"),
                                          (90000, "25h00m"), (float("nan"), "--")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_format_rate():
    assert [format_rate(x) for x in (850, 12345, 1.5e6, 2.5e9)] == ["850", "12.3k", "1.50M", "2.50G"]


def test_progress_plain_lines_are_rate_limited_and_end_with_last_step():
    stream, clock = io.StringIO(), _Clock()
    progress = Progress(300, stream=stream, interval_s=5.0, clock=clock)
    clock.now_s += 3.0  # first step: 3 s of warm-up, ignored by the ETA
    progress.update(1, 2.5, 12345.0)
    for step in range(2, 301):
        clock.now_s += 1.0
        progress.update(step, 2.0, 1000.0, extra="lr 1e-3" if step == 300 else "")
        if step == 121:
            progress.log("eval: val loss 2.1")
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].startswith("step 1/300") and "12.3k tok/s" in lines[0] and "ETA --" in lines[0]
    # every 5 s of fake time: steps 1, 6, 11, ..., 296, the log line and the last step
    assert len(lines) == 1 + 59 + 1 + 1
    assert "eval: val loss 2.1" in lines
    assert "step 121/300 (40%)" in text and "ETA 2m59s" in text  # 179 steps left × 1 s
    assert lines[-1].startswith("step 300/300 (100%)") and "done in 5m02s" in lines[-1] and "lr 1e-3" in lines[-1]


def test_progress_close_prints_held_back_last_update():
    stream, clock = io.StringIO(), _Clock()
    progress = Progress(10, start_step=4, stream=stream, interval_s=60.0, clock=clock)
    for step in (5, 6, 7):
        clock.now_s += 1.0
        progress.update(step, 1.0, 10.0)
    progress.close()
    progress.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["5/10", "7/10"]
    assert "ETA 3.0s" in lines[1]  # 1 s per step after the first, 3 steps left


def test_progress_tty_rewrites_one_line():
    stream, clock = _FakeTTY(), _Clock()
    progress = Progress(4, stream=stream, clock=clock, columns=200)
    for step in range(1, 5):
        clock.now_s += 2.0
        progress.update(step, 3.0 - step * 0.1, 500.0)
        if step == 2:
            progress.log("checkpoint saved")
    progress.close()
    text = stream.getvalue()
    assert text.count("\r") >= 4 and text.endswith("\n")
    assert "checkpoint saved\n" in text
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("[########################] step 4/4") and "loss 2.600" in last
    assert "done in 8.0s" in last
    assert "step 2/4" in text and "ETA 4.0s" in text  # 2 s per step, 2 left
    # the line drawn after the log message is the bar again, not a newline-terminated line
    assert "checkpoint saved\n\r[" in text or "checkpoint saved\n[" in text


def test_progress_tty_line_fits_columns():
    stream = _FakeTTY()
    progress = Progress(10, stream=stream, columns=40)
    progress.update(1, 1.0, 1.0, extra="x" * 100)
    assert max(len(part) for part in stream.getvalue().split("\r")) <= 39


def test_progress_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"start_step\(5\) > total_steps\(3\).*interval_s\(-1\)"):
        Progress(3, start_step=5, interval_s=-1)


# ---- units: an MLP trains on samples ----------------------------------------------------

def test_every_model_has_a_throughput_unit():
    from plait.train.config import MODELS
    from plait.train.progress import rate_key, throughput_unit

    assert {model: throughput_unit(model) for model in MODELS} == {"gpt": "tokens", "mlp": "samples"}
    assert rate_key("samples") == "samples_per_s" and rate_key("tokens") == "tokens_per_s"
    with pytest.raises(ValueError, match="model='cnn' has no throughput unit"):
        throughput_unit("cnn")


def test_progress_of_an_mlp_says_samples_per_s():
    from plait.train.progress import throughput_unit

    stream, clock = io.StringIO(), _Clock()
    progress = Progress(3, stream=stream, interval_s=0.0, clock=clock, unit=throughput_unit("mlp"))
    for step in (1, 2, 3):
        clock.now_s += 1.0
        progress.update(step, 2.0, 1234.0)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and all("1.23k samples/s" in line and "tok" not in line for line in lines)
    with pytest.raises(ValueError, match="unit\\('words'\\) must be one of tokens, samples"):
        Progress(3, unit="words")


MLP_SAMPLES_PER_STEP = 16
MLP_FLOPS_PER_STEP = 6 * MLP_SAMPLES_PER_STEP * (64 * 128 + 2 * 128 * 128 + 128 * 10)  # widths 64, 128 ×3, 10


def _mlp_run(keys: str):
    """The synthetic run as plait train's MLP (digits, global batch 16): ``keys`` "legacy" are
    the names plait train wrote for every model (tokens_per_s, tokens_per_step), "samples" the
    MLP's own (samples_per_s, samples_per_step)."""
    metrics, ranks, run = _synthetic_run()
    rate, per_step = ("tokens_per_s", "tokens_per_step") if keys == "legacy" else ("samples_per_s", "samples_per_step")
    for record in metrics:
        del record["tokens_per_s"]
        record[rate] = MLP_SAMPLES_PER_STEP / record["step_s"]
    del run["tokens_per_step"]
    config = {"model": "mlp", "data": "digits", "mlp_hidden": [128, 128, 128], "dp": 2, "tp": 1, "pp": 2, "steps": 10}
    run = dict(run, config=config, flops_per_step=MLP_FLOPS_PER_STEP, **{per_step: MLP_SAMPLES_PER_STEP})
    return metrics, ranks, run


@pytest.mark.parametrize("keys", ["legacy", "samples"])
def test_an_mlp_report_counts_samples_not_tokens(tmp_path, keys):
    metrics, ranks, run = _mlp_run(keys)
    report = write_report(tmp_path, metrics=metrics, ranks=ranks, run=run)
    # steps 2..10 (step 1 excluded): 9 steps of 16 samples in 5 × 0.25 s + 4 × 0.5 s
    mean_samples_per_s = 9 * MLP_SAMPLES_PER_STEP / (5 * 0.25 + 4 * 0.5)
    throughput = report["throughput"]
    assert throughput["unit"] == "samples" and "mean_tokens_per_s" not in throughput
    assert throughput["mean_samples_per_s"] == pytest.approx(mean_samples_per_s)
    assert report["run"]["unit"] == "samples" and report["run"]["samples_per_step"] == MLP_SAMPLES_PER_STEP
    assert "tokens_per_step" not in report["run"]
    assert json.loads((tmp_path / "report.json").read_text())["throughput"]["unit"] == "samples"
    # MFU from the MLP's FLOPs per sample; the steady state at samples/s ÷ samples per step
    assert report["mfu"]["flops_per_step"] == MLP_FLOPS_PER_STEP
    assert report["mfu"]["steady_value"] == pytest.approx(
        MLP_FLOPS_PER_STEP * (mean_samples_per_s / MLP_SAMPLES_PER_STEP) / (4 * 2e10))
    markdown = (tmp_path / "report.md").read_text()
    assert f"{MLP_SAMPLES_PER_STEP} samples per step" in markdown
    assert f"- mean throughput: {format_rate(mean_samples_per_s)} samples/s over 9 recorded steps" in markdown
    assert "6·B·Σ d_i·d_(i+1) for the MLP" in markdown and "mean samples/s without the first step" in markdown
    assert "token" not in markdown.lower()
    summary = "\n".join(summary_lines(report))
    assert f"throughput: {format_rate(mean_samples_per_s)} samples/s" in summary and "token" not in summary


def test_a_gpt_report_keeps_its_token_keys(written):
    _, report = written
    assert report["throughput"]["unit"] == "tokens" and report["run"]["tokens_per_step"] == TOKENS_PER_STEP


def _train_mlp(rank, world_size, out):
    from plait.train.config import TrainConfig
    from plait.train.loop import Trainer

    lines = []
    config = TrainConfig(model="mlp", data="digits", mlp_hidden=(32,), global_batch=16, micro_batch=16, steps=3,
                         dp=1, tp=1, pp=1, eval_interval=0, checkpoint_interval=0, out=str(out), timeout_s=60.0)
    Trainer(config, log=lines.append).train()
    return lines


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_mlp_run_reports_samples_per_s(tmp_path):
    """plait train --model mlp --data digits, 3 steps on one rank: its report and summary count samples."""
    from plait.testing import run_distributed

    out = tmp_path / "mlp"
    [lines] = run_distributed(_train_mlp, 1, out, timeout_s=100.0)
    report = json.loads((out / "report.json").read_text())
    assert report["throughput"]["unit"] == "samples" and report["run"]["samples_per_step"] == 16
    assert report["mfu"]["flops_per_step"] == 6 * 16 * (64 * 32 + 32 * 10)  # the MLP's 6N per sample
    markdown = (out / "report.md").read_text()
    assert "16 samples per step" in markdown and " samples/s over 2 recorded steps" in markdown
    assert "token" not in markdown.split("## Config")[0].lower()
    assert any(line.startswith("throughput: ") and " samples/s " in line for line in lines), lines
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert steps and all("samples_per_s" in record and "tokens_per_s" not in record for record in steps), steps
