"""The collective cost model against `plait bench`: per transport, p and size class.

    .venv/bin/python bench/collective_model.py [--quick] [--nprocs 2,3,4] [--transports shm,gloo]
        [--rounds 3] [--out bench-results/collective-model] [--lock /tmp/plait-bench.lock]

For each transport (shm: plait's shared memory; gloo: its TCP messages) and each p:

1. ``plait calibrate --nprocs p --transport T --output DIR/profile-T-pP.json`` (the
   model's parameters are fitted on these calibration samples only), in the first
   round just before that (T, p)'s benchmarks, so the two see the same machine;
2. in each of ``--rounds`` rounds (rounds outermost, so every (T, p, collective)
   is measured once per round, alternating, and the machine's slow phases spread
   over all of them): ``plait bench C -n p --transport T -a auto --predict --profile
   PROFILE`` for C in all_reduce, all_gather, reduce_scatter, broadcast, and a p2p
   measurement (every rank ``isend``s n bytes to rank+1 and ``irecv``s from rank-1
   through the group's plait transport, as a pipeline's steady state does; time per
   exchange, max over ranks), priced by the profile's p2p model;
3. the measured time of each (T, p, C, size) is the median over rounds, and so is the
   prediction (it is the same every round).

Every row is priced twice on the same measurement: ``pred`` by the tree's model (with a
format-2 profile: ``plait.cost.transport_model``, call cost per kind and beta(n)), and
``base`` as plait priced it before the transport model (issue 36): the plain link and
the ring shift's call overhead c refitted from the same profile's shift samples
(``plait.cost.calibration.fit_link``, unchanged), the same schedule terms (the tuner's
shared-host pricing), and for p2p alpha + n beta + c, the planner's price of a
pipeline message. The algorithm priced is the one the row ran (auto: the tuner's pick).

Printed: one table row per (T, p, size class) with the MAPE of each collective and of
all of them (|pred - time| / time, averaged over sizes), the classes being sizes below
1 MiB and sizes >= 1 MiB; then overall per transport and size class. ``--json`` (default
DIR/collective_model.json) keeps every row.

Run against another tree with PYTHONPATH=that/src (e.g. the code before a change): the
p2p prediction then falls back to the planner's price of that tree (alpha + n beta +
the call overhead) when its profile has no p2p model. ``--lock PATH`` holds ``flock
PATH`` over each (T, p) block of a round (calibration and benchmarks together: a shared
machine); ``--quick`` measures sizes x4 apart with one round. ``--reprice JSON`` prices
an earlier run's rows again with this tree's model (no measuring).

The full sweep (default: 2 x 3 calibrations, 5 kinds x 17 sizes x 6 (T, p) x 3 rounds)
takes about 30-40 minutes on the 2-core machine; --quick about 15-20.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
P2P = "p2p"
LARGE_NBYTES = 1 << 20


@dataclass(frozen=True)
class P2PConfig:
    """The p2p measurement's settings (a Job config: it needs ``timeout_s``)."""

    sizes_nbytes: tuple[int, ...]
    transport: str
    time_budget_s: float
    max_calls: int
    timeout_s: float = 120.0


def p2p_job(config: P2PConfig, *, device=None, emit=None) -> None:
    """Every rank sends n bytes to rank+1 and receives n from rank-1 through the world's
    plait Communicator (its transport), waits both; time per exchange, max over ranks.
    Rank 0 emits ("row", {"nbytes", "time_us", "calls"}) per size."""
    # imported here: this function runs in the spawned workers (torch, plait.comm)
    import torch
    import torch.distributed as dist

    import plait.comm as comm
    from plait.comm.communicator import init_communicator
    from plait.comm.config import CommConfig

    link = init_communicator(None, CommConfig(transport=config.transport, timeout_s=config.timeout_s))
    rank, size = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % size, (rank - 1) % size

    def exchange(send_buffer, recv_buffer):
        outgoing = comm.isend(send_buffer, nxt, group=link, tag=7)
        incoming = comm.irecv(recv_buffer, prv, group=link, tag=7)
        incoming.wait()
        outgoing.wait()

    for nbytes in config.sizes_nbytes:
        numel = max(1, nbytes // 4)
        send_buffer, recv_buffer = torch.zeros(numel), torch.zeros(numel)
        for _ in range(2):
            exchange(send_buffer, recv_buffer)
        dist.barrier()
        start_s = time.perf_counter()
        exchange(send_buffer, recv_buffer)
        probe = torch.tensor([time.perf_counter() - start_s], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        calls = max(1, min(config.max_calls, int(config.time_budget_s / max(probe.item(), 1e-9))))
        dist.barrier()
        start_s = time.perf_counter()
        for _ in range(calls):
            exchange(send_buffer, recv_buffer)
        elapsed = torch.tensor([(time.perf_counter() - start_s) / calls], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if emit is not None:
            emit("row", {"nbytes": nbytes, "time_us": elapsed.item() * 1e6, "calls": calls})


def p2p_predict_us(profile, nbytes: int) -> float:
    """The profile's p2p price: its own p2p model when it has one, else what the
    planner of that tree charges a pipeline message (alpha + n beta + call overhead)."""
    model = getattr(profile, "p2p_time_s", None)
    if callable(model):
        return 1e6 * model(nbytes)
    link = profile.link
    return 1e6 * (link.alpha_s + nbytes * link.beta_s_per_byte + profile.call_overhead_s)


def baseline_pricer(profile):
    """(collective row -> us, p2p bytes -> us) as plait priced them before the transport
    model: plain link + the shift's c, on the tuner's schedule terms."""
    from plait.comm.tuner import Tuner
    from plait.cost.calibration import fit_link

    link, overhead_s, _ = fit_link(profile.samples)
    tuner = Tuner(link, call_overhead_s=overhead_s,
                  shared_host_ranks=profile.world_size if profile.device == "cpu" else None)

    def collective_us(row: dict) -> float:
        algorithm = row.get("auto_choice") or row["algorithm"]
        return 1e6 * tuner.predict_s(row["collective"], algorithm, row["size_bytes"], row["nprocs"])

    def p2p_us(nbytes: int) -> float:
        return 1e6 * (link.alpha_s + nbytes * link.beta_s_per_byte + overhead_s)

    return collective_us, p2p_us


def reprice(rows: list[dict], profile_dir: Path) -> list[dict]:
    """The rows of an earlier run priced again by this tree's model on their profiles
    (no measuring): for a model change, on the same measurements."""
    from plait.bench.collectives import BenchRow
    from plait.bench.predict import Predictor
    from plait.cost.profile import load_profile

    priced = []
    for row in rows:
        profile_path = profile_dir / f"profile-{row['transport']}-p{row['nprocs']}.json"
        profile = load_profile(profile_path)
        collective_us, p2p_us = baseline_pricer(profile)
        if row["collective"] == P2P:
            priced.append({**row, "predicted_us": p2p_predict_us(profile, row["size_bytes"]),
                           "baseline_us": p2p_us(row["size_bytes"])})
            continue
        bench_row = BenchRow(collective=row["collective"], algorithm=row.get("auto_choice") or row["algorithm"],
                             nprocs=row["nprocs"], size_bytes=row["size_bytes"], count=row.get("count", 0),
                             dtype=row.get("dtype", "float32"), op=row.get("op", "sum"), root=row.get("root", 0),
                             time_us=row["time_us"])
        predictor = Predictor(profile, world_size=row["nprocs"], source=str(profile_path))
        priced.append({**row, "predicted_us": predictor.predict_us(bench_row), "baseline_us": collective_us(row)})
    return priced


def run_command(command: list[str], log: Path) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    with open(log, "a") as stream:
        stream.write("$ " + " ".join(command) + "\n" + result.stdout + result.stderr + "\n")
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (rc {result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout


def calibrate(transport: str, nprocs: int, path: Path, args, log: Path) -> None:
    command = [sys.executable, "-m", "plait", "calibrate", "--nprocs", str(nprocs), "--transport", transport,
               "--output", str(path), "--max-bytes", args.max_bytes, "--min-bytes", args.min_bytes,
               "--factor", str(args.factor), *args.calibrate_args.split()]
    run_command(command, log)


def bench_collective(collective: str, transport: str, nprocs: int, profile: Path, args, scratch: Path,
                     log: Path) -> list[dict]:
    rows_path = scratch / f"{collective}-{transport}-p{nprocs}.json"
    command = [sys.executable, "-m", "plait", "bench", collective, "-n", str(nprocs), "--transport", transport,
               "-a", args.algorithms, "--predict", "--profile", str(profile), "--min-bytes", args.min_bytes,
               "--max-bytes", args.max_bytes, "--factor", str(args.factor), "--time-budget",
               str(args.time_budget), "--json", str(rows_path)]
    run_command(command, log)
    from plait.cost.profile import load_profile

    collective_us, _ = baseline_pricer(load_profile(profile))
    rows = [row for row in json.loads(rows_path.read_text()) if row.get("predicted_us") is not None]
    return [{**row, "baseline_us": collective_us(row)} for row in rows]


def bench_p2p(transport: str, nprocs: int, profile_path: Path, args, sizes: list[int], log: Path) -> list[dict]:
    """The p2p rows in a spawned world."""
    from plait.bench.launch import Job, spawn_and_run
    from plait.cost.profile import load_profile

    config = P2PConfig(sizes_nbytes=tuple(sizes), transport=transport, time_budget_s=args.time_budget,
                       max_calls=200)
    rows = spawn_and_run(Job(p2p_job, config), nprocs, "gloo", lambda kind, payload: None, label="p2p")
    profile = load_profile(profile_path)
    _, baseline_p2p_us = baseline_pricer(profile)
    with open(log, "a") as stream:
        stream.write(f"# p2p {transport} p{nprocs}: {rows}\n")
    return [{"collective": P2P, "algorithm": "isend/irecv", "nprocs": nprocs, "size_bytes": row["nbytes"],
             "time_us": row["time_us"], "predicted_us": p2p_predict_us(profile, row["nbytes"]),
             "baseline_us": baseline_p2p_us(row["nbytes"])} for row in rows]


class _flock:
    """``flock PATH`` for the duration of a with-block (no-op without a path)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.stream = path, None

    def __enter__(self):
        if self.path:
            import fcntl  # POSIX only, like flock(1)

            self.stream = open(self.path, "a")
            fcntl.flock(self.stream, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            self.stream.close()


def sizes_of(args) -> list[int]:
    from plait.cli.bench import parse_nbytes

    lo, hi = parse_nbytes(args.min_bytes), parse_nbytes(args.max_bytes)
    sizes = []
    while lo <= hi:
        sizes.append(lo)
        lo *= args.factor
    return sizes


def error_pct(row: dict, field: str = "predicted_us") -> float:
    return 100.0 * (row[field] - row["time_us"]) / row["time_us"]


def mape(rows: list[dict], field: str = "predicted_us") -> float | None:
    return statistics.fmean(abs(error_pct(r, field)) for r in rows) if rows else None


def size_class(nbytes: int) -> str:
    return ">=1M" if nbytes >= LARGE_NBYTES else "<1M"


def table(rows: list[dict], kinds: list[str], field: str = "predicted_us") -> list[str]:
    """MAPE of ``field`` (predicted_us: the model; baseline_us: before it) per (T, p, size
    class) and collective; bias = mean signed error."""
    def cell(value):
        return f"{value:7.1f}%" if value is not None else f"{'-':>8}"

    rows = [r for r in rows if r.get(field) is not None]
    lines = [f"# {'the model (pred)' if field == 'predicted_us' else 'before the transport model (base)'}",
             f"{'transport':<9} {'p':>2} {'sizes':<5} " + " ".join(f"{k[:14]:>14}" for k in kinds)
             + f" {'all':>8} {'bias':>7}"]
    keys = sorted({(r["transport"], r["nprocs"]) for r in rows})
    for transport, p in keys:
        for klass in ("<1M", ">=1M"):
            subset = [r for r in rows if r["transport"] == transport and r["nprocs"] == p
                      and size_class(r["size_bytes"]) == klass]
            per_kind = [cell(mape([r for r in subset if r["collective"] == k], field)) for k in kinds]
            bias = statistics.fmean(error_pct(r, field) for r in subset) if subset else 0.0
            lines.append(f"{transport:<9} {p:>2} {klass:<5} " + " ".join(f"{c:>14}" for c in per_kind)
                         + f" {cell(mape(subset, field))} {bias:+6.1f}%")
    lines.append("overall (mean |error| over every row of the class):")
    for transport in sorted({r["transport"] for r in rows}):
        for klass in ("<1M", ">=1M"):
            subset = [r for r in rows if r["transport"] == transport and size_class(r["size_bytes"]) == klass]
            if subset:
                lines.append(f"  {transport:<5} {klass:<5} MAPE {mape(subset, field):6.1f}% ({len(subset)} rows)")
    return lines


def detail(rows: list[dict]) -> list[str]:
    lines = [f"{'transport':<9} {'p':>2} {'collective':<15} {'algorithm':<18} {'size':>10} {'time(us)':>11} "
             f"{'pred(us)':>11} {'err':>8} {'base(us)':>11} {'err':>8}"]
    for r in sorted(rows, key=lambda r: (r["transport"], r["nprocs"], r["collective"], r["size_bytes"])):
        lines.append(f"{r['transport']:<9} {r['nprocs']:>2} {r['collective']:<15} {r.get('ran', r['algorithm']):<18} "
                     f"{r['size_bytes']:>10} {r['time_us']:11.1f} {r['predicted_us']:11.1f} {error_pct(r):+7.1f}% "
                     f"{r['baseline_us']:11.1f} {error_pct(r, 'baseline_us'):+7.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes x4 apart, one round (a smoke run)")
    parser.add_argument("--nprocs", default="2,3,4")
    parser.add_argument("--transports", default="shm,gloo")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES + (P2P,)))
    parser.add_argument("--algorithms", default="auto", help="plait bench -a (default auto: the tuner's pick)")
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--factor", type=int, default=None, help="size multiplier (default 2; --quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; --quick 1)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds per timed loop (default 0.3; --quick 0.15)")
    parser.add_argument("--calibrate-args", default="", help="extra plait calibrate flags, e.g. '--reps 5'")
    parser.add_argument("--out", default="bench-results/collective-model")
    parser.add_argument("--json", default=None, help="rows and summary (default OUT/collective_model.json)")
    parser.add_argument("--lock", default=None, help="wrap each timing run in flock PATH")
    parser.add_argument("--reprice", default=None, metavar="JSON",
                        help="price the rows of an earlier run's JSON again (its profiles: --profiles, default "
                             "the JSON's directory) with this tree's model; measures nothing")
    parser.add_argument("--profiles", default=None,
                        help="directory of profiles from an earlier run (profile-T-pP.json): skip calibrating")
    args = parser.parse_args(argv)
    args.factor = args.factor or (4 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.time_budget = args.time_budget if args.time_budget is not None else (0.15 if args.quick else 0.3)
    if args.quick and not args.calibrate_args:
        args.calibrate_args = "--reps 3"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "collective_model.log"
    transports = [t for t in args.transports.split(",") if t]
    nprocs_list = [int(p) for p in args.nprocs.split(",") if p]
    kinds = [k for k in args.collectives.split(",") if k]
    sizes = sizes_of(args)
    started_s = time.monotonic()
    profile_dir = Path(args.profiles) if args.profiles else out
    if args.reprice:
        profile_dir = Path(args.profiles) if args.profiles else Path(args.reprice).parent
        rows = reprice(json.loads(Path(args.reprice).read_text())["rows"], profile_dir)
        kinds = [k for k in kinds if any(r["collective"] == k for r in rows)]
        lines = detail(rows) + [""] + table(rows, kinds, "baseline_us") + [""] + table(rows, kinds)
        print("\n".join(lines))
        return 0
    measured: dict[tuple, list[dict]] = {}

    def measure_block(transport: str, p: int, round_index: int, scratch: Path) -> None:
        """One (T, p) of one round: its calibration (first round) and every kind's rows."""
        path = profile_dir / f"profile-{transport}-p{p}.json"
        if round_index == 0 and args.profiles is None:
            t0 = time.monotonic()
            calibrate(transport, p, path, args, log)
            print(f"# calibrated {transport} p={p} in {time.monotonic() - t0:.0f} s -> {path}", flush=True)
        for kind in kinds:
            if kind == P2P:
                rows = bench_p2p(transport, p, path, args, sizes, log)
            else:
                rows = bench_collective(kind, transport, p, path, args, scratch, log)
            for row in rows:
                key = (transport, p, kind, row["algorithm"], row["size_bytes"])
                measured.setdefault(key, []).append({**row, "transport": transport})

    with tempfile.TemporaryDirectory(prefix="plait-collective-model-") as scratch:
        for round_index in range(args.rounds):
            for transport in transports:
                for p in nprocs_list:
                    with _flock(args.lock):
                        measure_block(transport, p, round_index, Path(scratch))
            print(f"# round {round_index + 1}/{args.rounds} done at {time.monotonic() - started_s:.0f} s", flush=True)
    rows = []
    for (transport, p, kind, algorithm, nbytes), reps in measured.items():
        row = dict(reps[0])
        row["time_us"] = statistics.median(r["time_us"] for r in reps)
        row["round_times_us"] = [r["time_us"] for r in reps]
        row["ran"] = reps[0].get("auto_choice") or algorithm
        rows.append(row)
    elapsed_s = time.monotonic() - started_s
    lines = detail(rows) + [""] + table(rows, kinds, "baseline_us") + [""] + table(rows, kinds)
    lines.append(f"# {len(rows)} rows; {args.rounds} round(s); sizes {sizes[0]}..{sizes[-1]} x{args.factor}; "
                 f"took {elapsed_s:.0f} s ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)")
    print("\n".join(lines))
    summary = {field: {f"{t}/p{p}/{klass}": mape([r for r in rows if r["transport"] == t and r["nprocs"] == p
                                                  and size_class(r["size_bytes"]) == klass], field)
                       for t in transports for p in nprocs_list for klass in ("<1M", ">=1M")}
               for field in ("predicted_us", "baseline_us")}
    document = {"argv": sys.argv, "rows": rows, "mape_pct": summary, "elapsed_s": elapsed_s}
    Path(args.json or out / "collective_model.json").write_text(json.dumps(document, indent=1) + "\n")
    (out / "collective_model.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
