"""`plait calibrate --compute`: this CPU's kernels, timed in every rank at once, as a device profile.

    plait calibrate --compute --nprocs 4 [--dtype float32 --kernel-reps 3 --kernel-budget 0.02 --output PATH --json]

Spawns N local workers (or, under torchrun without --nprocs, uses that world), each at
the threads plait train gives a rank (max(1, cores // N)), times the GEMMs the planner
prices for plait train's GPT (every micro-batch 1, 4, 16 and tensor-parallel degree 1,
2, 4, forward and backward) plus a spread of sizes, the attention's batched products,
the memory-bound kernels, AdamW, the per-kernel eager cost and the wait for the slowest
rank, all ranks at once (``plait.bench.compute_calibrate``), fits the device profile
(``plait.plan.cpu_profile``: the GPU's format, plait.device_profile/1) and saves it
where ``plait plan --cluster local --nprocs N`` reads it: the cache directory
($PLAIT_CACHE_DIR, else $XDG_CACHE_HOME/plait, else ~/.cache/plait) as
device-cpu-p{N}.json, the measured kernels beside it as device-cpu-p{N}.kernels.json.
A profile holds the sharing of N ranks: calibrate each N you plan for.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from plait.bench.compute_calibrate import (DTYPES, ComputeCalibrateConfig, gpt_adamw_tensors, planner_shapes,
                                          run_compute_calibration)
from plait.bench.launch import Job, WorkerError, in_torchrun, run_in_current_world, spawn_and_run
from plait.cli.environment import cache_dir
from plait.cli.local_ranks import check_spawn
from plait.cli.output_paths import output_file, prepare_output_paths
from plait.cli.plan import _train_vocab
from plait.plan.cpu_profile import compute_profile_path, fit_cpu_profile, threads_per_rank
from plait.plan.device_profile import efficiency, profile_device
from plait.plan.transformer import TransformerSpec
from plait.train.config import TrainConfig

__all__ = ["add_compute_arguments", "run_compute", "default_config"]

# the link calibration's flags, which --compute does not use: refused when given (never silently ignored)
LINK_ONLY = ("transport", "min_bytes", "max_bytes", "factor", "steps", "reps", "time_budget", "max_calls",
             "no_ping_pong", "no_calls")


def add_compute_arguments(parser) -> None:
    """--compute and its flags; call after the link's flags (it records their defaults)."""
    compute = parser.add_argument_group("--compute (this CPU's kernels into a device profile)")
    compute.add_argument("--compute", action="store_true",
                         help="measure this CPU's GEMM, attention and memory-bound kernels with all --nprocs ranks "
                              "at once into a device profile (device-cpu-pN.json) that plait plan --cluster local "
                              "--nprocs N prices with, instead of the link")
    compute.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                         help="(--compute) the dtype the kernels run in (default float32, plait train's on CPU)")
    compute.add_argument("--kernel-reps", type=int, default=3,
                         help="(--compute) timed windows per kernel; each kernel's time is their median (default 3)")
    compute.add_argument("--kernel-budget", type=float, default=0.02, metavar="SECONDS",
                         help="(--compute) each window calls the kernel back to back for this long (default 0.02)")
    compute.add_argument("--no-sync-wait", action="store_true",
                         help="(--compute) skip measuring the wait for the slowest rank (the profile's host section)")
    parser.set_defaults(link_only_defaults={dest: parser.get_default(dest) for dest in LINK_ONLY})


def default_config(nprocs: int, *, dtype: str = "float32", reps: int = 3, time_budget_s: float = 0.02,
                   warmup: int = 1, sync_wait: bool = True, timeout_s: float = 120.0,
                   cores: int | None = None) -> ComputeCalibrateConfig:
    """The kernels of plait train's default GPT as the planner prices them, at the threads
    plait train gives each of ``nprocs`` ranks."""
    train = TrainConfig()
    spec = TransformerSpec(name="gpt", layers=train.layers, hidden=train.hidden, heads=train.heads,
                           seq_len=train.seq_len, vocab=_train_vocab(), ffn_hidden=train.ffn_hidden)
    gemms, attention = planner_shapes(spec)
    # the optimizer's steps over plait train's GPT at its hidden and twice it (the optimizer's size law)
    lists = tuple(gpt_adamw_tensors(layers=train.layers, hidden=h, ffn_hidden=train.ffn_hidden and train.ffn_hidden
                                    * h // train.hidden, vocab=spec.vocab, seq_len=train.seq_len,
                                    tied_head=train.tied_head) for h in (train.hidden, 2 * train.hidden))
    return ComputeCalibrateConfig(gemm_shapes=gemms, attention_cases=attention, adamw_lists=lists, dtype=dtype,
                                  reps=reps,
                                  time_budget_s=time_budget_s, warmup=warmup, sync_wait=sync_wait,
                                  timeout_s=timeout_s,
                                  threads_per_rank=threads_per_rank(nprocs, cores or os.cpu_count() or 1))


def _refused_flags(args) -> list[str]:
    defaults = getattr(args, "link_only_defaults", {})
    return [f"--{dest.replace('_', '-')}" for dest, default in defaults.items() if getattr(args, dest, default) != default]


def _fit_lines(name: str, fit: dict | None) -> list[str]:
    if fit is None:
        return [f"#   {name}: no rows"]
    residuals = fit["residuals"]
    return [f"#   {name}: peak x eta_max {fit['peak_flops_per_s'] * fit['eta_max'] / 1e9:.4g} GFLOP/s (eta_max "
            f"{fit['eta_max']:.4g}), m0 {fit['m0']:.4g}, n0 {fit['n0']:.4g}, k0 {fit['k0']:.4g}; {fit['rows']} rows, "
            f"|relative error| median {residuals['median_abs_relative'] * 100:.1f}%, max "
            f"{residuals['max_abs_relative'] * 100:.1f}%"]


def summary_lines(profile: dict, kernels: dict) -> list[str]:
    """The fitted numbers and the worst-fitted GEMM rows, for the terminal."""
    facts, launch, memory = profile["facts"], profile["launch"], profile["memory"]
    peak = profile["device"]["peak_flops_per_s"][profile["dtype"]]
    lines = [f"# {facts['nprocs']} ranks at once x {facts['threads_per_rank']} thread(s) on {facts['cores']} cores, "
             f"{profile['dtype']}; peak (best measured) {peak / 1e9:.4g} GFLOP/s",
             "# T = t_mm + count*2mnk / (peak * eta_max / (1 + m0/m + n0/n + k0/k))"]
    lines += _fit_lines("GEMM", profile["matmul"]) + _fit_lines("attention", profile["attention"])
    lines.append(f"#   per kernel: eager autograd {launch['eager_autograd_kernel_s'] * 1e6:.2f} us (used), dispatch "
                 f"{launch['dispatch_s'] * 1e6:.2f} us, mm {launch['matmul_s'] * 1e6:.2f} us")
    lines.append(f"#   memory-bound: bandwidth (best op) {memory['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s, eta_mem "
                 f"{memory['efficiency']:.3g} (harmonic mean over {', '.join(memory['efficiency_ops'])}); "
                 + ", ".join(f"{op} {entry['gbps']:.3g}" for op, entry in memory["per_op"].items()) + " GB/s")
    host = profile.get("host")
    if host is not None:
        lines.append(f"#   wait for the slowest rank: {host['sync_wait_s'] * 1e3:.3f} ms + "
                     f"{host['sync_wait_per_compute']:.4f} x compute per call (group of "
                     f"{host['sync_group_size'] or host['ranks']})")
    fit = profile["matmul"]
    errors = []
    for row in kernels["matmul"]:
        model_s = fit["t_launch_s"] + 2.0 * row["m"] * row["n"] * row["k"] / (
            peak * efficiency((fit["eta_max"], fit["m0"], fit["n0"], fit["k0"]), row["m"], row["n"], row["k"]))
        errors.append(((model_s - row["seconds"]) / row["seconds"], row, model_s))
    lines.append("#        m      n      k   measured(us)  max rank(us)   model(us)    err   (the worst fitted GEMMs)")
    for error, row, model_s in sorted(errors, key=lambda item: -abs(item[0]))[:8]:
        lines.append(f"#   {row['m']:6d} {row['n']:6d} {row['k']:6d} {row['seconds'] * 1e6:13.1f} "
                     f"{row['seconds_max'] * 1e6:13.1f} {model_s * 1e6:11.1f} {error * 100:+6.1f}%")
    return lines


def save_json(data: dict, path: Path) -> Path:
    """Write ``data`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as stream:
        json.dump(data, stream, indent=1)
        stream.write("\n")
    os.replace(temporary, path)
    return path


def run_compute(args) -> int:
    refused = _refused_flags(args)
    if refused:
        raise ValueError(f"{', '.join(refused)}: link calibration flags, not used by --compute (which times kernels: "
                         "--kernel-reps, --kernel-budget); drop them or run without --compute")
    use_world = args.nprocs is None and in_torchrun()
    nprocs = int(os.environ["WORLD_SIZE"]) if use_world else (args.nprocs or 4)
    is_reporter = not use_world or int(os.environ.get("RANK", "0")) == 0
    if args.backend == "nccl":
        raise ValueError("--compute measures this CPU (gloo ranks): drop --backend nccl")
    if args.kernel_reps < 1 or not args.kernel_budget > 0:
        raise ValueError(f"--kernel-reps {args.kernel_reps} must be >= 1 and --kernel-budget {args.kernel_budget} > 0")
    out = sys.stderr if args.json else sys.stdout
    path = Path(args.output) if args.output is not None else compute_profile_path(nprocs, cache_dir())
    if is_reporter:
        prepare_output_paths(output_file("--output" if args.output else "--output (default)", str(path)))
    if not use_world:
        check_spawn(nprocs, allow_oversubscribe=args.allow_oversubscribe)
    config = default_config(nprocs, dtype=args.dtype, reps=args.kernel_reps, time_budget_s=args.kernel_budget,
                            warmup=args.warmup, sync_wait=not args.no_sync_wait, timeout_s=args.timeout)
    if is_reporter:
        print(f"# plait calibrate --compute: nprocs {nprocs} at once, {config.threads_per_rank} thread(s) each, "
              f"{args.dtype}; {len(config.gemm_shapes)} GEMM shapes, {len(config.attention_cases)} attention "
              f"products, {len(config.memory_numels)} memory sizes, {config.reps} windows of "
              f"{config.time_budget_s * 1e3:g} ms per kernel", file=out, flush=True)

    def on_event(kind: str, payload) -> None:
        if kind == "progress":
            print(f"# measuring: {payload}", file=sys.stderr, flush=True)

    start_s = time.monotonic()
    job = Job(run_compute_calibration, config)
    try:
        rows = (run_in_current_world(job, "gloo", on_event) if use_world
                else spawn_and_run(job, nprocs, "gloo", on_event, label="plait calibrate --compute"))
    except WorkerError as error:
        print(str(error), file=sys.stderr)
        return 1
    if not is_reporter:
        return 0
    kernels = rows[0]
    kernels_path = path.with_name(path.name.removesuffix(".json") + ".kernels.json")
    profile = fit_cpu_profile(kernels, name=f"cpu-p{nprocs}", source=kernels_path.name)
    profile_device(profile)  # the planner can read it: refuse to save one it could not
    save_json(kernels, kernels_path)
    save_json(profile, path)
    for line in summary_lines(profile, kernels):
        print(line, file=out)
    print(f"# measured in {time.monotonic() - start_s:.1f} s; profile saved to {path} (kernels: {kernels_path})",
          file=out, flush=True)
    default = compute_profile_path(nprocs, cache_dir())
    hint = ("read by default: plait plan --cluster local --nprocs " + str(nprocs) if path == default
            else f"plait plan --cluster local reads {default}; copy it there to use it")
    print(f"# {hint}", file=out, flush=True)
    if args.json:
        json.dump(profile, sys.stdout, indent=1)
        print()
    return 0
