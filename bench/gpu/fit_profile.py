"""Fit the planner's compute model to measured kernels and write a device profile.

    .venv/bin/python bench/gpu/fit_profile.py KERNELS.json --name h100 --vendor h100-80gb \\
        --out src/plait/plan/profiles/h100.json

KERNELS.json is bench/gpu/kernels.py's output; ``--vendor`` names the DEVICE preset whose
vendor peaks and bandwidth the efficiencies are relative to (``plait.plan.device.
VENDOR_PRESETS``). The model and what the profile records: ``plait.plan.device_profile``.
Prints, per op class, the fitted parameters and the fit's residuals, and for a handful
of measured GEMM shapes the measured against the fitted TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from plait.plan.device import VENDOR_PRESETS
from plait.plan.device_profile import FIT_DTYPE, fit_profile, fitted_seconds, profile_device


def _fit_line(label: str, fit: dict | None) -> str:
    if fit is None:
        return f"{label:<10} (no rows)"
    residuals = fit["residuals"]
    return (f"{label:<10} eta_max {fit['eta_max']:.4g}  m0 {fit['m0']:8.4g}  n0 {fit['n0']:8.4g}  "
            f"k0 {fit['k0']:8.4g}  rows {fit['rows']:4d}  |rel err| median {100 * residuals['median_abs_relative']:.2f}% "
            f"max {100 * residuals['max_abs_relative']:.2f}%" + ("  (underdetermined: < 4 rows)"
                                                                 if fit["underdetermined"] else ""))


def _sample(rows: list[dict], count: int) -> list[dict]:
    """``count`` rows spread over the measured FLOPs, smallest to largest."""
    ordered = sorted(rows, key=lambda r: r["flops"] if "flops" in r else 2.0 * r["m"] * r["n"] * r["k"])
    if len(ordered) <= count:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / (count - 1))] for i in range(count)]


def report(profile: dict, kernels: dict, *, samples: int = 10) -> list[str]:
    lines = [f"profile {profile['name']} (vendor {profile['vendor']}) from {profile['source']}",
             _fit_line("gemm", profile["matmul"]), _fit_line("attention", profile["attention"])]
    memory = profile["memory"]
    lines.append(f"memory     efficiency {memory['efficiency']:.3f} (mean of {', '.join(memory['efficiency_ops'])}); "
                 f"optimizer ({memory['optimizer_op']}) {memory['optimizer_efficiency']:.3f}")
    for op, row in memory["per_op"].items():
        lines.append(f"  {op:<20} {row['gbps']:9.1f} GB/s at {row['numel']:>11,} elements = {row['efficiency']:.3f}")
    launch = profile["launch"]
    lines.append(f"launch     {launch['kernel_s'] * 1e6:.3g} us per kernel (used; eager autograd "
                 f"{(launch['eager_autograd_kernel_s'] or 0) * 1e6:.3g} us, dispatch {(launch['dispatch_s'] or 0) * 1e6:.3g} us)")
    for key, row in profile["copies"].items():
        lines.append(f"copies     {key:<14} {row['gbps']:.1f} GB/s at {row['bytes'] >> 20} MiB")
    peak = profile["device"]["peak_flops_per_s"][FIT_DTYPE]
    fit = tuple(profile["matmul"][key] for key in ("eta_max", "m0", "n0", "k0"))
    t_launch = profile["launch"]["kernel_overhead_s"]
    lines.append("")
    lines.append(f"{'op':<12} {'m':>7} {'n':>7} {'k':>7} {'measured TFLOP/s':>17} {'fitted TFLOP/s':>15} {'error':>7}")
    for row in _sample(kernels["matmul"], samples):
        flops = 2.0 * row["m"] * row["n"] * row["k"]
        fitted = fitted_seconds(fit, t_launch=t_launch, peak=peak, count=1, m=row["m"], n=row["n"], k=row["k"])
        lines.append(f"{row['op']:<12} {row['m']:>7} {row['n']:>7} {row['k']:>7} {flops / row['seconds'] / 1e12:17.1f} "
                     f"{flops / fitted / 1e12:15.1f} {100 * (row['seconds'] / fitted - 1):+6.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", help="bench/gpu/kernels.py's JSON")
    parser.add_argument("--name", required=True, help="the profile's name (e.g. h100)")
    parser.add_argument("--vendor", required=True, choices=tuple(VENDOR_PRESETS),
                        help="the device preset whose vendor peaks and bandwidth the efficiencies are relative to")
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    args = parser.parse_args(argv)
    with open(args.kernels) as handle:
        kernels = json.load(handle)
    try:
        profile = fit_profile(kernels, name=args.name, vendor=VENDOR_PRESETS[args.vendor],
                              source=os.path.basename(args.kernels))
        profile_device(profile)  # it must load as the planner will load it
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(report(profile, kernels)))
    directory = os.path.dirname(args.out)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(profile, handle, indent=1)
        handle.write("\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
