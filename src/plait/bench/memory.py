"""`plait bench memory`: every combination of recomputation x precision x activation
offload, run for real with `plait train`, measured against the formulas.

For each mesh (default dp2 x pp2 and tp2 x pp2, 4 processes) and each combination of
--recompute (none, selective, full) x --precision (fp32, bf16-mixed, fp16-mixed) x
offload (off, on), one `plait train` run of the default GPT at a sequence length where
activations dominate (default s = 512) under GPipe (every micro-batch in flight on the
first stage: the schedule where activation memory matters most, and where offload has
something to move). From the run's report.json and metrics.jsonl:

- **measured**: the peak bytes of live storages autograd holds for the backward, the
  largest over the ranks (plait.train.memory: weak references on what autograd keeps,
  independent of the schedule); the peak resident set; the median step time of rank 0
  (the first step excluded);
- **plait's formula**: plait plan's prediction for the same layout and options
  (``estimate_layout`` under the "plait" accounting: Korthikanti et al.'s per-layer
  count adapted to plait's eager GPT, see plait.plan.transformer), the largest over
  its pipeline ranks;
- **Korthikanti's formula as published**: per layer sbh(10 + 24/t + 5as/(ht)) without
  recomputation, sbh(10 + 24/t) selective, 2sbh full (16-bit activations, 1-byte
  masks, fused kernels; no embedding or head), times the layers and the micro-batches
  in flight on the worst rank. The adaptation (what plait's formula adds): plait's
  element size (4 bytes in fp32; under autocast a float32 residual stream, 16-bit
  matmul inputs and a 16-bit copy of every matmul weight per micro-batch), LayerNorm
  statistics, the s x s causal mask, the embedding and the head's float32 softmax,
  and offload's two resident micro-batches.

Then the peers, in a child process (plait.bench.memory_peers): plait's recomputation,
offload and fp16 loss scaling against torch.utils.checkpoint, save_on_cpu and
autocast + GradScaler on the same model. A PNG plots the memory-time frontier.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plait.cost import LinkModel
from plait.names.precision import PRECISIONS
from plait.names.recompute import RECOMPUTE_MODES
from plait.names.schedules import GPIPE, INTERLEAVED_1F1B, NO_PIPELINE, ONE_F_ONE_B, ZERO_BUBBLE
from plait.plan import Layout, cluster_preset, estimate_layout
from plait.plan.device import DeviceSpec
from plait.plan.estimate import in_flight
from plait.plan.precision import precision_for
from plait.plan.transformer import TransformerSpec

MESHES = ((2, 1, 2), (1, 2, 2))  # (dp, tp, pp)
BENCH_SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, ZERO_BUBBLE)  # plait.names.schedules; no chimera here

# estimate_layout prices time too; this bench reads only its memory, which no device
# speed enters: a nominal device and link
_MEMORY_ONLY_DEVICE = DeviceSpec(name="memory only", peak_flops_per_s=(("float32", 1e12), ("bfloat16", 1e12),
                                                                       ("float16", 1e12)), memory_bytes=2.0 ** 40,
                                  memory_bandwidth_bytes_per_s=1e11)
_MEMORY_ONLY_LINK = LinkModel(1e-6, 1e-9)


@dataclass(frozen=True, kw_only=True)
class MemoryBenchConfig:
    """Flags of `plait bench memory` (one field per flag)."""

    meshes: tuple[tuple[int, int, int], ...] = MESHES
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    precisions: tuple[str, ...] = PRECISIONS
    offload: tuple[bool, ...] = (False, True)
    seq_len: int = 512
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    global_batch: int = 16
    micro_batch: int = 2
    schedule: str = GPIPE
    steps: int = 4
    peer_rounds: int = 3
    peer_steps: int = 3
    peers: bool = True
    timeout_s: float = 900.0
    out: str = "bench-results/memory"
    extra: tuple[str, ...] = field(default_factory=tuple)

    def problems(self) -> list[str]:
        found = []
        for dp, tp, pp in self.meshes:
            if self.global_batch % (dp * self.micro_batch):
                found.append(f"global batch {self.global_batch} is not a multiple of dp({dp}) x micro-batch "
                             f"({self.micro_batch})")
        for name, values, valid in (("recompute", self.recompute, RECOMPUTE_MODES),
                                    ("precisions", self.precisions, PRECISIONS)):
            unknown = [v for v in values if v not in valid]
            if unknown or not values:
                found.append(f"--{name}: unknown {', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                             f"{', '.join(valid)}")
        if self.schedule not in BENCH_SCHEDULES:
            found.append(f"--schedule {self.schedule!r}: use one of {', '.join(BENCH_SCHEDULES)}")
        if self.steps < 2:
            found.append(f"--steps {self.steps}: at least 2 (the first step is excluded from the step time)")
        return found


def run_name(mesh: tuple[int, int, int], recompute: str, precision: str, offload: bool) -> str:
    dp, tp, pp = mesh
    return f"dp{dp}-tp{tp}-pp{pp}-{recompute}-{precision}{'-offload' if offload else ''}"


def train_command(config: MemoryBenchConfig, mesh, recompute: str, precision: str, offload: bool,
                  out: Path) -> list[str]:
    dp, tp, pp = mesh
    return [sys.executable, "-m", "plait", "train", "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
            "--layers", str(config.layers), "--hidden", str(config.hidden), "--heads", str(config.heads),
            "--seq-len", str(config.seq_len), "--global-batch", str(config.global_batch),
            "--micro-batch", str(config.micro_batch), "--schedule", config.schedule, "--recompute", recompute,
            "--precision", precision, "--offload-activations" if offload else "--no-offload-activations",
            "--steps", str(config.steps), "--eval-interval", "0", "--checkpoint-interval", "0",
            "--sample-chars", "0", "--resume", "never", "--force-fresh", "--out", str(out), *config.extra]


def measured_of(out: Path) -> dict:
    """What the run measured (report.json, metrics.jsonl): see the module docstring."""
    report = json.loads((out / "report.json").read_text())
    memory = report.get("memory") or []
    if not memory:
        raise RuntimeError(f"{out / 'report.json'} has no memory section")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [row["step_s"] for row in steps if "step_s" in row][1:]
    return {"device": report["run"]["device"],
            "activations_bytes": max(row["saved_activations_peak_bytes"] for row in memory),
            "activations_bytes_per_rank": [row["saved_activations_peak_bytes"] for row in memory],
            "resident_peak_bytes": max(row["resident_peak_bytes"] or 0 for row in memory),
            "model_state_bytes": max(row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"]
                                     for row in memory),
            "step_s": statistics.median(step_times), "step_s_all": step_times}


def gpt_spec(config: MemoryBenchConfig, vocab: int) -> TransformerSpec:
    """plait train's GPT at the bench's shape (untied head, no dropout: its defaults)."""
    return TransformerSpec(name="gpt", layers=config.layers, hidden=config.hidden, heads=config.heads,
                           seq_len=config.seq_len, vocab=vocab, tied_head=False)


def _layout(config: MemoryBenchConfig, mesh, recompute: str, offload: bool) -> Layout:
    dp, tp, pp = mesh
    return Layout(dp=dp, tp=tp, pp=pp, micro_batch=config.micro_batch,
                  num_microbatches=config.global_batch // (dp * config.micro_batch),
                  schedule=config.schedule if pp > 1 else NO_PIPELINE, recompute=recompute,
                  offload=offload)


def predicted_of(config: MemoryBenchConfig, spec: TransformerSpec, mesh, recompute: str, precision: str,
                 offload: bool, device_type: str = "cpu") -> dict:
    """plait plan's activation and model-state bytes, each the largest over the
    pipeline ranks, as measured (plait accounting, on ``device_type``'s autocast)."""
    layout = _layout(config, mesh, recompute, offload)
    cluster = cluster_preset("local", nprocs=layout.devices, device=_MEMORY_ONLY_DEVICE,
                             local_link=_MEMORY_ONLY_LINK)
    chosen = precision_for(precision, "plait", device_type)
    ranks = estimate_layout(spec, cluster, layout, precision=chosen, accounting="plait").rank_memory_bytes
    return {"activations_bytes": max(rank["activations"] for rank in ranks),
            "model_state_bytes": max(rank["parameters"] + rank["gradients"] + rank["optimizer"] for rank in ranks)}


def paper_formula_bytes(config: MemoryBenchConfig, spec: TransformerSpec, mesh, recompute: str) -> float:
    """Korthikanti et al.'s per-layer bytes as published (16-bit, fused kernels), times
    the layers of a stage and the micro-batches in flight on the fullest rank."""
    dp, tp, pp = mesh
    s, b, h, a, t = spec.seq_len, config.micro_batch, spec.hidden, spec.heads, tp
    sbh = s * b * h
    per_layer = {"none": sbh * (10 + 24 / t + 5 * a * s / (h * t)), "selective": sbh * (10 + 24 / t),
                 "full": 2.0 * sbh}[recompute]
    layout = _layout(config, mesh, recompute, False)
    most = max(in_flight(layout, rank) for rank in range(pp))
    return per_layer * (spec.layers / pp) * most


def run_sweep(config: MemoryBenchConfig, vocab: int, on_row=None) -> list[dict]:
    """One `plait train` per combination (see the module docstring); ``on_row(row)`` after each."""
    spec = gpt_spec(config, vocab)
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mesh in config.meshes:
        for recompute in config.recompute:
            for precision in config.precisions:
                for offload in config.offload:
                    name = run_name(mesh, recompute, precision, offload)
                    out = Path(config.out) / "runs" / name
                    command = train_command(config, mesh, recompute, precision, offload, out)
                    started = time.perf_counter()
                    try:
                        result = subprocess.run(command, env=env, capture_output=True, text=True,
                                                timeout=config.timeout_s)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(f"{name}: plait train ran past {config.timeout_s:.0f} s "
                                           f"(--timeout-s): {' '.join(command)}") from None
                    if result.returncode != 0:
                        raise RuntimeError(f"{name}: plait train exited with {result.returncode}: "
                                           f"{' '.join(command)}\n{(result.stdout + result.stderr)[-3000:]}")
                    dp, tp, pp = mesh
                    measured = measured_of(out)  # predicted for the device the run used (its autocast)
                    row = {"name": name, "dp": dp, "tp": tp, "pp": pp, "recompute": recompute,
                           "precision": precision, "offload": offload, "wall_s": time.perf_counter() - started,
                           "measured": measured,
                           "predicted": predicted_of(config, spec, mesh, recompute, precision, offload,
                                                     measured["device"].split(":")[0]),
                           "paper_bytes": paper_formula_bytes(config, spec, mesh, recompute)}
                    row["ratio"] = row["measured"]["activations_bytes"] / row["predicted"]["activations_bytes"]
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return rows


def run_peer_bench(config: MemoryBenchConfig, vocab: int) -> dict:
    """plait.bench.memory_peers in a child process (its allocator setting needs a fresh
    process); the same GPT, one micro-batch of the sweep's size per pipeline micro-batch."""
    path = Path(config.out) / "peers.json"
    command = [sys.executable, "-m", "plait.bench.memory_peers", "--seq-len", str(config.seq_len),
               "--layers", str(config.layers), "--hidden", str(config.hidden), "--heads", str(config.heads),
               "--batch", str(config.micro_batch), "--microbatches", "4", "--vocab", str(vocab),
               "--rounds", str(config.peer_rounds), "--steps", str(config.peer_steps), "--json", str(path)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=config.timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"the peer bench failed ({' '.join(command)}):\n{(result.stdout + result.stderr)[-3000:]}")
    return json.loads(path.read_text())


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better),
    in increasing first coordinate."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for index in order:
        if points[index][1] < best:
            front.append(index)
            best = points[index][1]
    return front


def plot_frontier(rows: list[dict], path: Path) -> None:
    """Step time against measured peak activation bytes, one panel per mesh, the
    frontier (nothing both faster and smaller) joined."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg
    from matplotlib.lines import Line2D

    meshes = list(dict.fromkeys((row["dp"], row["tp"], row["pp"]) for row in rows))
    fig = Figure(figsize=(6.5 * len(meshes), 5.2))
    colors = {"none": "tab:blue", "selective": "tab:orange", "full": "tab:green"}
    markers = {"fp32": "o", "bf16-mixed": "s", "fp16-mixed": "^"}
    for panel, mesh in enumerate(meshes):
        ax = fig.add_subplot(1, len(meshes), panel + 1)
        mine = [row for row in rows if (row["dp"], row["tp"], row["pp"]) == mesh]
        points = [(row["measured"]["step_s"], row["measured"]["activations_bytes"] / 2 ** 20) for row in mine]
        for row, (x, y) in zip(mine, points):
            ax.scatter([x], [y], marker=markers[row["precision"]], s=60,
                       facecolors="none" if row["offload"] else colors[row["recompute"]],
                       edgecolors=colors[row["recompute"]], linewidths=1.5)
        front = pareto(points)
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], color="0.4", linestyle="--",
                linewidth=1, zorder=0)
        for i in front:
            row = mine[i]
            label = f"{row['recompute']}, {row['precision']}{', offload' if row['offload'] else ''}"
            ax.annotate(label, points[i], textcoords="offset points", xytext=(6, 4), fontsize=7)
        ax.set_xscale("log")  # fp16 on a CPU without fp16 matmuls is ~10x slower than the rest
        ax.set_xlabel("step time, s (rank 0, median; log scale)")
        ax.set_ylabel("peak saved activations, MiB (largest rank, measured)")
        ax.set_title(f"dp{mesh[0]} x tp{mesh[1]} x pp{mesh[2]}")
        ax.grid(True, alpha=0.3)
    handles = ([Line2D([], [], color=c, marker="o", linestyle="", label=f"recompute {k}") for k, c in colors.items()]
               + [Line2D([], [], color="0.3", marker=m, linestyle="", label=k) for k, m in markers.items()]
               + [Line2D([], [], color="0.3", marker="o", markerfacecolor="none", linestyle="", label="offload"),
                  Line2D([], [], color="0.4", linestyle="--", label="frontier")])
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.subplots_adjust(bottom=0.18, wspace=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)


def summary(config: MemoryBenchConfig, rows: list[dict], peers: dict | None) -> dict:
    ratios = [row["ratio"] for row in rows]
    return {"config": {**asdict(config), "meshes": [list(m) for m in config.meshes]}, "rows": rows, "peers": peers,
            "within_10_percent": sum(abs(r - 1) <= 0.10 for r in ratios), "runs": len(rows)}
