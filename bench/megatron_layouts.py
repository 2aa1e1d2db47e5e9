"""Megatron-LM's published weak-scaling layouts priced by plait's planner: predicted vs
published TFLOP/s per GPU.

    .venv/bin/python bench/megatron_layouts.py [--cluster dgx-a100] [--device-profile PATH] [--json PATH]

Each published layout (tp, pp, dp = GPUs / (tp·pp), global batch) is priced with
``plait.plan.estimate_layout`` (no search) and compared with the throughput the paper
measured. Prints a markdown table, then the median and the largest absolute error.

Facts and where they come from
------------------------------
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21, arXiv:2104.04473), Table 1, as NVIDIA/Megatron-LM's README
reproduces it: the image images/cases_april2021.png added by commit 50a4b5fa02
(2021-04-08, "Release fixes"), read from the repository's history. Per model: hidden
size, layers, parameters (billions), model-parallel size, GPUs, batch size, achieved
teraFLOP/s per GPU, percent of theoretical peak:

    1.7B    2304   24    1.7     1    32   512  137  44%
    3.6B    3072   30    3.6     2    64   512  138  44%
    7.5B    4096   36    7.5     4   128   512  142  46%
    18B     6144   40   18.4     8   256  1024  135  43%
    39B     8192   48   39.1    16   512  1536  138  44%
    76B    10240   60   76.1    32  1024  1792  140  45%
    145B   12288   80  145.6    64  1536  2304  148  47%
    310B   16384   96  310.1   128  1920  2160  155  50%
    530B   20480  105  529.6   280  2520  2520  163  52%
    1T     25600  128 1008.0   512  3072  3072  163  52%

- The same README (all versions since 2021-04): vocabulary 51,200, sequence length 2048,
  NVIDIA Selene, up to 3,072 A100 GPUs; FLOPs "measured for end-to-end training, i.e.,
  includes all operations including data loading, optimization, and even logging".
- README commit 145d2eb947 (2022-01-26, Stas Bekman, NVIDIA/Megatron-LM PR #183):
  "Each cluster node has 8 NVIDIA 80GB A100 GPUs".
- README commit 2d767f4886 (2022-01-26, same PR): the model-parallel size column is
  tensor x pipeline; "For numbers larger than 8, typically tensor parallel of size 8 was
  used ... the 145B model reports the total model parallel size of 64, which means that
  this setup used TP=8 and PP=8". Hence tp = min(mp, 8), pp = mp / tp: tp 1, 2, 4, 8,
  8, 8, 8, 8, 8, 8 and pp 1, 1, 1, 1, 2, 4, 8, 16, 35, 64 (the paper's Table 1 lists the
  same two columns).
- GPT-3 175B (not a Table 1 row): README at 50a4b5fa02, "GPT-3 Example": 1,024 A100
  GPUs, "8-way and 16-way tensor and pipeline parallelism", global batch 1536, "each
  iteration takes around 32 seconds resulting in 138 teraFLOPs per GPU which is 44% of
  the theoretical peak FLOPs"; examples/pretrain_gpt3_175B.sh at that commit: 96 layers,
  hidden 12288, 96 heads, --micro-batch-size 1, --fp16, --checkpoint-activations, no
  virtual pipeline stages. The paper's own text gives ~140 TFLOP/s for this run (§5.1's
  training-time estimate); that figure could not be checked against a stored source,
  so the README's 138 is used.

Not verified against a stored source (searched for; the README image has no heads
column): the attention heads of 1.7B, 3.6B and 7.5B, 24, 32 and 32 as recalled from the
paper's Table 1, not re-read. Heads change no matmul FLOPs here, only the attention
core's memory traffic and activation bytes (the as²b terms), so the predicted FLOP/s of
those three rows depends on them only slightly. The heads of 18B ... 1T (48, 64, 80,
96, 128, 128, 160) are the existing presets'; the other shapes match the image exactly.

Assumptions (each one plait's, not the paper's, unless a source is named above)
-------------------------------------------------------------------------------
- Micro-batch size 1 for every row (Table 1 does not give it; the 175B script uses 1).
- Schedule 1F1B (non-interleaved) for every row with pp > 1: whether Table 1's runs used
  the interleaved schedule is not stated in the README and could not be checked; the
  175B example script does not interleave. pp = 1 rows run no pipeline.
- Full activation recomputation (the 175B script's --checkpoint-activations; Megatron-LM
  at the time recomputed whole layers), no sequence parallelism (it postdates Table 1),
  no ZeRO, dropout on.
- fp16 mixed precision with fp32 master weights in the optimizer (16 bytes per parameter,
  ZeRO's accounting); A100 peak 312 TFLOP/s dense fp16, the same as bf16.
- Activation memory and kernel traffic by the "megatron" accounting (fused kernels;
  Korthikanti et al. 2022).
- Cluster ``dgx-a100``: 8 A100 80 GB per node, NVLink within a node, InfiniBand between
  nodes at plait's preset link speeds; matmul efficiency 0.8 of peak (plait's assumption,
  not a calibration). tp groups are consecutive ranks (within a node), pp outermost.
- Predicted TFLOP/s is the estimate's ``tflops_per_gpu``: hardware FLOPs counting the
  recomputed forward (96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) per step, the paper's
  Equation 3) over the predicted step time, i.e. the convention of the published column.
- Memory is reported (in --json), not enforced: a layout predicted above the device's
  memory is still priced.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from plait.plan import Layout, cluster_preset, estimate_layout
from plait.plan.device import VENDOR_PRESETS, DeviceSpec
from plait.plan.device_profile import load_device_profile

SEQ_LEN = 2048
VOCAB = 51200
MICRO_BATCH = 1
PRECISION = "fp16-mixed"
TABLE_1 = "Narayanan et al. 2021 Table 1 (Megatron-LM README image, 50a4b5fa02)"
GPT3_EXAMPLE = "Megatron-LM README 'GPT-3 Example' and examples/pretrain_gpt3_175B.sh (50a4b5fa02)"

# (label, plait preset, GPUs, tp, pp, global batch, published TFLOP/s per GPU, published % of peak, source)
PUBLISHED = (
    ("1.7B", "gpt-1.7b", 32, 1, 1, 512, 137.0, 44.0, TABLE_1),
    ("3.6B", "gpt-3.6b", 64, 2, 1, 512, 138.0, 44.0, TABLE_1),
    ("7.5B", "gpt-7.5b", 128, 4, 1, 512, 142.0, 46.0, TABLE_1),
    ("18B", "gpt-18b", 256, 8, 1, 1024, 135.0, 43.0, TABLE_1),
    ("39B", "gpt-39b", 512, 8, 2, 1536, 138.0, 44.0, TABLE_1),
    ("76B", "gpt-76b", 1024, 8, 4, 1792, 140.0, 45.0, TABLE_1),
    ("145B", "gpt-145b", 1536, 8, 8, 2304, 148.0, 47.0, TABLE_1),
    ("310B", "gpt-310b", 1920, 8, 16, 2160, 155.0, 50.0, TABLE_1),
    ("530B", "gpt-530b", 2520, 8, 35, 2520, 163.0, 52.0, TABLE_1),
    ("1T", "gpt-1t", 3072, 8, 64, 3072, 163.0, 52.0, TABLE_1),
    ("175B (GPT-3)", "gpt-175b", 1024, 8, 16, 1536, 138.0, 44.0, GPT3_EXAMPLE),
)


def published_layout(gpus: int, tp: int, pp: int, global_batch: int) -> Layout:
    """The layout as Megatron-LM ran it, under this script's assumptions (module docstring)."""
    dp, rest = divmod(gpus, tp * pp)
    if rest:
        raise ValueError(f"{gpus} GPUs are not a whole number of tp({tp}) x pp({pp}) replicas")
    num_microbatches, rest = divmod(global_batch, dp * MICRO_BATCH)
    if rest:
        raise ValueError(f"global batch {global_batch} is not a whole number of dp({dp}) x micro-batch({MICRO_BATCH})")
    return Layout(tp=tp, pp=pp, dp=dp, micro_batch=MICRO_BATCH, num_microbatches=num_microbatches,
                  schedule="1f1b" if pp > 1 else "none", recompute="full", sequence_parallel=False, zero_stage=0)


def compare(cluster_name: str = "dgx-a100", device: DeviceSpec | None = None) -> list[dict]:
    """Price every published layout on ``cluster_name`` (its preset device unless
    ``device`` is given); one row per layout, in PUBLISHED's order."""
    rows = []
    for label, preset, gpus, tp, pp, global_batch, published_tflops, published_pct, source in PUBLISHED:
        layout = published_layout(gpus, tp, pp, global_batch)
        cluster = cluster_preset(cluster_name, gpus=gpus, device=device)
        est = estimate_layout(preset, cluster, layout, precision=PRECISION, accounting="megatron")
        rows.append({
            "model": label, "preset": preset, "gpus": gpus, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
            "global_batch": global_batch, "micro_batch": layout.micro_batch,
            "num_microbatches": layout.num_microbatches, "schedule": layout.schedule,
            "published_tflops_per_gpu": published_tflops, "published_percent_of_peak": published_pct,
            "predicted_tflops_per_gpu": est.tflops_per_gpu, "predicted_percent_of_peak": est.percent_of_peak,
            "error_percent": (est.tflops_per_gpu - published_tflops) / published_tflops * 100.0,
            "step_time_s": est.step_time_s, "time_breakdown_s": dict(est.time_s),
            "memory_per_gpu_gib": est.memory_per_gpu_bytes / 2**30,
            "device_memory_gib": cluster.device.memory_bytes / 2**30,
            "device": cluster.device.name, "cluster": cluster_name, "source": source,
        })
    return rows


def summary(rows: list[dict]) -> tuple[float, float]:
    """(median, max) of the absolute error in percent."""
    errors = [abs(row["error_percent"]) for row in rows]
    return statistics.median(errors), max(errors)


def markdown(rows: list[dict]) -> str:
    lines = ["| model | GPUs | tp | pp | dp | batch | published TFLOP/s | predicted TFLOP/s | error % |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['gpus']} | {row['tp']} | {row['pp']} | {row['dp']} | "
                     f"{row['global_batch']} | {row['published_tflops_per_gpu']:.0f} | "
                     f"{row['predicted_tflops_per_gpu']:.1f} | {row['error_percent']:+.1f} |")
    median_pct, max_pct = summary(rows)
    lines.append("")
    lines.append(f"median |error| {median_pct:.1f}%, max |error| {max_pct:.1f}% over {len(rows)} layouts")
    over = [row["model"] for row in rows if row["memory_per_gpu_gib"] > row["device_memory_gib"]]
    if over:
        lines.append(f"predicted above the device's memory (priced anyway): {', '.join(over)}")
    return "\n".join(lines)


def load_device(path: str) -> DeviceSpec:
    """The DeviceSpec in the JSON device profile at ``path`` (bench/gpu/fit_profile.py's
    output), by plait's own loader (``plait.plan.device_profile.load_device_profile``):
    its fitted GEMM and attention efficiency curves, memory efficiencies and launch cost,
    at the profile's own vendor peaks. To price the A100 rows with an H100 profile's
    curves at the A100's peaks, ``plait.plan.device_profile.profile_device(profile,
    vendor=...)`` derives the device (the dgx-a100 preset does so itself once
    plait/plan/profiles/h100.json is checked in)."""
    device = load_device_profile(path)
    if not isinstance(device, DeviceSpec):
        raise TypeError(f"load_device_profile({path!r}) returned {type(device).__name__}, not a DeviceSpec")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="dgx-a100", help="plait cluster preset (default dgx-a100)")
    parser.add_argument("--device-profile", metavar="PATH", help="a JSON device profile replacing the preset's device")
    parser.add_argument("--vendor", action="store_true",
                        help="price with the preset's uncalibrated vendor device (peaks and an assumed eta), as "
                             "before the GPU calibration")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    if args.vendor and args.device_profile:
        print("error: --vendor and --device-profile both choose the device: give one", file=sys.stderr)
        return 2
    try:
        device = load_device(args.device_profile) if args.device_profile else None
        if args.vendor:
            device = VENDOR_PRESETS[cluster_preset(args.cluster, gpus=8).device.name]
    except (RuntimeError, TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = compare(args.cluster, device)
    bad = [row["model"] for row in rows if not math.isfinite(row["predicted_tflops_per_gpu"])]
    if bad:
        print(f"not priced: {', '.join(bad)}", file=sys.stderr)
    print(f"cluster {args.cluster}, device {rows[0]['device']}, {PRECISION}, micro-batch {MICRO_BATCH}, "
          f"full recomputation, 1F1B, no sequence parallelism")
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
