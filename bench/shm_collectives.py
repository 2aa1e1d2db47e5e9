"""plait's collectives through its shared-memory transport against torch's gloo and
plait on gloo, every size, in one run per (collective, p).

    .venv/bin/python bench/shm_collectives.py [--nprocs 2,4] [--rounds 3] [--out bench-results/shm]

For each collective (all_reduce, all_gather, reduce_scatter, broadcast: plait
bench's single-tensor forms) and each p, one ``plait bench COLLECTIVE -n p -a
torch,auto,auto@gloo --rounds R`` (sizes 1 KB..64 MB, size-major, the three sides back
to back at each size, the whole sweep repeated R times, median round reported), so
"auto" (shared memory), "auto@gloo" (the same algorithms over gloo's TCP messages)
and torch's gloo are measured under the same conditions. Prints, per size, each
time and the ratios auto/torch and auto/auto@gloo (< 1: plait on shared memory is
faster), and each side's best bus bandwidth against the one-core memcpy bandwidth
measured in the same run. The raw rows are kept as JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def run_one(collective: str, nprocs: int, rounds: int, out: Path, extra: list[str]) -> tuple[list[dict], str]:
    rows_path = out / f"{collective}-p{nprocs}.json"
    command = [sys.executable, "-m", "plait", "bench", collective, "-n", str(nprocs), "-a", "torch,auto,auto@gloo",
               "--rounds", str(rounds), "--json", str(rows_path), *extra]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    (out / f"{collective}-p{nprocs}.txt").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    memcpy = next((line for line in result.stdout.splitlines() if line.startswith("# memcpy")), "")
    return json.loads(rows_path.read_text()), memcpy


def table(rows: list[dict]) -> list[str]:
    by_size: dict[int, dict[str, float]] = {}
    for row in rows:
        if row.get("time_us"):
            by_size.setdefault(row["size_bytes"], {})[row["algorithm"]] = row["time_us"]
    lines = [f"{'size B':>10} {'torch us':>10} {'auto us':>10} {'auto@gloo us':>13} {'auto/torch':>11} "
             f"{'auto/auto@gloo':>15}"]
    for size, times in sorted(by_size.items()):
        torch_us, auto_us, gloo_us = times.get("torch"), times.get("auto"), times.get("auto@gloo")
        lines.append(f"{size:>10} {torch_us:>10.0f} {auto_us:>10.0f} {gloo_us:>13.0f} {auto_us / torch_us:>11.2f} "
                     f"{auto_us / gloo_us:>15.2f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--out", default="bench-results/shm")
    parser.add_argument("extra", nargs="*", help="more plait bench flags, after --")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for nprocs in (int(text) for text in args.nprocs.split(",")):
        for collective in args.collectives.split(","):
            rows, memcpy = run_one(collective, nprocs, args.rounds, out, args.extra)
            print(f"## {collective}, p = {nprocs} (median of {args.rounds} rounds)")
            print("\n".join(table(rows)))
            print(memcpy)
            text = (out / f"{collective}-p{nprocs}.txt").read_text().splitlines()
            print("\n".join(line for line in text if "% of memcpy" in line))
            print(flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
