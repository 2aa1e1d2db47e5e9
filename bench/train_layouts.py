"""Tokens/s and the compute / communication / bubble split of `plait train` for
every (dp, tp, pp) layout of 4 processes, on the same model, data and global batch.

    .venv/bin/python bench/train_layouts.py [--steps 60] [--out bench-results/train-layouts]

Each layout is one `plait train` run (its own torchrun world, 4 local processes,
gloo on CPU); the numbers are read from the run's report.json: mean tokens/s
(first step excluded), time to the first step (from the command's start), and
the split summed over the 4 ranks. Ratios are against dp=4 measured in the same
invocation, so they compare layouts on this machine, not machines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="bench-results/train-layouts")
    parser.add_argument("extra", nargs="*", help="more plait train flags, after --")
    args = parser.parse_args()
    rows = []
    for dp, tp, pp in LAYOUTS:
        out = Path(args.out) / f"dp{dp}-tp{tp}-pp{pp}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        command = [sys.executable, "-m", "plait", "train", "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
                   "--steps", str(args.steps), "--eval-interval", "0", "--checkpoint-interval", "0",
                   "--sample-chars", "0", "--out", str(out), *args.extra]
        start_s = time.time()
        result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if result.returncode:
            print(result.stdout[-2000:], result.stderr[-2000:], file=sys.stderr)
            return result.returncode
        report = json.loads((out / "report.json").read_text())
        totals = report["time_totals"]
        rows.append({"dp": dp, "tp": tp, "pp": pp, "tokens_per_s": report["throughput"]["mean_tokens_per_s"],
                     "time_to_first_step_s": report["time_to_first_step_s"], "command_s": time.time() - start_s,
                     "compute_pct": totals["compute_pct"], "comm_pct": totals["comm_pct"],
                     "bubble_pct": totals["bubble_pct"], "other_pct": totals["other_pct"],
                     "mfu": report["mfu"]["steady_value"],
                     "collective_mib_per_step": sum(entry["bytes_sent"] for entry in
                                                    report["collectives"]["total"].values()) / 2 ** 20 / args.steps})
        print(f"dp{dp} tp{tp} pp{pp}: {rows[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    base = rows[0]["tokens_per_s"]
    print(f"{'layout':<14}{'tokens/s':>10}{'vs dp4':>8}{'compute':>9}{'comm':>7}{'bubble':>8}{'other':>7}"
          f"{'MFU':>7}{'1st step s':>11}{'MiB/step':>10}")
    for row in rows:
        print(f"{'dp%d tp%d pp%d' % (row['dp'], row['tp'], row['pp']):<14}{row['tokens_per_s']:>10.0f}"
              f"{row['tokens_per_s'] / base:>7.2f}x{row['compute_pct']:>8.0f}%{row['comm_pct']:>6.0f}%"
              f"{row['bubble_pct']:>7.0f}%{row['other_pct']:>6.0f}%{100 * row['mfu']:>6.1f}%"
              f"{row['time_to_first_step_s']:>11.1f}{row['collective_mib_per_step']:>10.1f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "layouts.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
