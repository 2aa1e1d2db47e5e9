"""Run report of `plait train`: report.json, report.md and loss.png, plus FLOP counts and MFU.

FLOPs of one training step of a GPT (Megatron-LM, Narayanan et al. 2021; DESIGN §6),
B batch, s sequence, l layers, h hidden, V vocab, FFN 4h:

    no recomputation:    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
    full recomputation:  96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))

A layer's forward does 24·B·s·h² matmul FLOPs (QKV 6, projection 2, MLP 16) plus
4·B·s²·h for the attention scores and their weighted sum; the logits 2·B·s·h·V.
Backward costs twice the forward; recomputation adds one more forward of the layers
(not of the logits).

The MLP (widths d_0 .. d_L, no sequence) does 2·B·Σ d_i·d_{i+1} matmul FLOPs forward and
twice that backward: 6·B·Σ d_i·d_{i+1}, the 6N model-FLOPs rule (N its weights).

MFU = flops_per_step × steps / (training wall time × world_size × peak_flops_per_s).
On CPU there is no datasheet peak, so ``plait.train.flops.measure_peak_flops`` times a square matmul in
this process and that achieved rate stands in for the peak of one process.

Throughput is in the unit the model trains on (``plait.train.progress.throughput_unit``
of the run's config): tokens/s for the GPT, samples/s for the MLP; report.json names it
(``throughput.unit``, ``throughput.mean_tokens_per_s`` or ``mean_samples_per_s``,
``run.tokens_per_step`` or ``run.samples_per_step``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from plait.names.axes import AXES
from plait.train.atomic_files import atomic_write
from plait.train.memory import memory_rows, render_memory
from plait.train.plan_compare import comparison_lines
from plait.train.report_stats import loss_summary, mean_rate, throughput as throughput_summary
from plait.train.progress import format_duration, format_rate, throughput_unit

TIME_PARTS = ("compute", "comm", "bubble", "other")
MIB = float(1 << 20)
RUN_KEYS = ("config", "mesh", "world_size", "backend", "device", "flops_per_step", "peak_flops_per_s",
            "time_to_first_step_s", "steps", "start_step")  # and the items per step: see _per_step
RANK_KEYS = ("rank", "coords", "wall_s", "compute_s", "comm_s", "bubble_s", "other_s")
TIME_DEFINITIONS = (
    "- **compute**: forward and backward time, minus the tensor-parallel collectives inside them.\n"
    "- **comm**: tensor-parallel collectives (inside forward and backward) and the data-parallel sync: "
    "gradient averaging or ZeRO's reduce-scatter and gather, the gradient-norm and loss sums.\n"
    "- **bubble**: pipeline messages: posting sends, and waiting in receives for an activation or "
    "gradient (a stage with no micro-batch to run, or one in flight; on one CPU machine a slow "
    "peer shows here too).\n"
    "- **other**: the rest of each step: optimiser step, data loading, bookkeeping.\n"
    "- **wall**: that rank's training steps (batch fetch included); compute + comm + bubble + other = wall.\n"
    "- **%**: share of that rank's wall time.")


# ---- FLOPs and peak -------------------------------------------------------------------

def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _percent(part_s: float, wall_s: float) -> float | None:
    return 100.0 * part_s / wall_s if wall_s > 0 else None


def _unit(run: dict) -> str:
    """The unit ("tokens" or "samples") the run's model counts: its config's "model" (gpt when absent)."""
    return throughput_unit((run.get("config") or {}).get("model", "gpt"))


def _per_step(run: dict, unit: str):
    """Items of ``unit`` per optimiser step: run["samples_per_step"] / ["tokens_per_step"]; plait
    train has passed the MLP's samples per step as "tokens_per_step", which is read too."""
    return run.get(f"{unit}_per_step", run.get("tokens_per_step"))


def _check_inputs(metrics: list[dict], ranks: list[dict], run: dict) -> None:
    problems = []
    missing = [key for key in RUN_KEYS if key not in run]
    if missing:
        problems.append(f"run lacks {missing}")
    try:
        unit = _unit(run)
    except ValueError as error:
        problems.append(f"run['config']: {error}")
    else:
        if _per_step(run, unit) is None:
            problems.append(f"run lacks '{unit}_per_step'")
    for index, record in enumerate(metrics):
        if "step" not in record:
            problems.append(f"metrics[{index}] lacks 'step'")
    seen = set()
    for index, rank in enumerate(ranks):
        lacking = [key for key in RANK_KEYS if key not in rank]
        if lacking:
            problems.append(f"ranks[{index}] lacks {lacking}")
        elif rank["rank"] in seen:
            problems.append(f"rank {rank['rank']} appears twice in ranks")
        else:
            seen.add(rank["rank"])
            lacking_axes = [axis for axis in AXES if axis not in rank["coords"]]
            if lacking_axes:
                problems.append(f"ranks[{index}]['coords'] lacks {lacking_axes}")
    if problems:
        raise ValueError("write_report: " + "; ".join(problems))


def _rank_rows(ranks: list[dict]) -> list[dict]:
    rows = []
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        wall_s = float(rank["wall_s"])
        row = {"rank": rank["rank"], "coords": {axis: rank["coords"][axis] for axis in AXES},
               "steps": rank.get("steps"), "wall_s": wall_s}
        for part in TIME_PARTS:
            row[f"{part}_s"] = float(rank[f"{part}_s"])
            row[f"{part}_pct"] = _percent(row[f"{part}_s"], wall_s)
        rows.append(row)
    return rows


def _time_totals(rows: list[dict]) -> dict:
    """Sum over the rows (rank-seconds) with each part's share of the summed wall."""
    wall_s = sum(row["wall_s"] for row in rows)
    totals = {"ranks": len(rows), "wall_s": wall_s}
    for part in TIME_PARTS:
        part_s = sum(row[f"{part}_s"] for row in rows)
        totals[f"{part}_s"] = part_s
        totals[f"{part}_pct"] = _percent(part_s, wall_s)
    return totals


def _axis_totals(rows: list[dict]) -> dict:
    """For each mesh axis with more than one coordinate: time totals per coordinate
    (e.g. per pipeline stage, where the bubble differs), summed over its ranks."""
    by_axis = {}
    for axis in AXES:
        values = sorted({row["coords"][axis] for row in rows})
        if len(values) > 1:
            by_axis[axis] = {str(value): _time_totals([row for row in rows if row["coords"][axis] == value])
                             for value in values}
    return by_axis


def _collectives(ranks: list[dict]) -> dict:
    total, per_rank = {}, {}
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        for name, stats in sorted((rank.get("collectives") or {}).items()):
            entry = {"calls": int(stats.get("calls", 0)), "bytes_sent": int(stats.get("bytes_sent", 0)),
                     "time_s": float(stats.get("time_s", 0.0)),
                     "algorithms": {str(k): int(v) for k, v in (stats.get("algorithms") or {}).items()}}
            per_rank.setdefault(str(rank["rank"]), {})[name] = entry
            summed = total.setdefault(name, {"calls": 0, "bytes_sent": 0, "time_s": 0.0, "ranks": 0,
                                             "algorithms": {}})
            for key in ("calls", "bytes_sent", "time_s"):
                summed[key] += entry[key]
            for algorithm, calls in entry["algorithms"].items():
                summed["algorithms"][algorithm] = summed["algorithms"].get(algorithm, 0) + calls
            summed["ranks"] += 1
    comm = next((rank.get("comm") for rank in ranks if rank.get("comm")), None)
    transports = {str(rank["rank"]): dict(rank["comm"].get("transports") or {}) for rank in ranks
                  if rank.get("comm")}
    return {"total": dict(sorted(total.items())), "per_rank": per_rank, "comm": comm, "transports": transports}


def _mesh_shape(ranks: list[dict], run: dict) -> dict:
    if ranks:
        return {axis: 1 + max(int(rank["coords"][axis]) for rank in ranks) for axis in AXES}
    config = run.get("config") or {}
    return {axis: int(config.get(axis, 1)) for axis in AXES}


def _mfu(run: dict, rows: list[dict], throughput: dict) -> dict:
    wall_s = max((row["wall_s"] for row in rows), default=None)
    rank_steps = {row["steps"] for row in rows if row["steps"] is not None}
    steps_run = max(rank_steps) if rank_steps else int(run["steps"]) - int(run["start_step"])
    flops_per_step, peak, world_size = run["flops_per_step"], run["peak_flops_per_s"], run["world_size"]
    usable = _finite(flops_per_step) and _finite(peak) and peak > 0 and wall_s and wall_s > 0
    value = flops_per_step * steps_run / (wall_s * world_size * peak) if usable else None
    # Same ratio at the steady-state rate (first step excluded): steps/s = rate ÷ items per step
    # (tokens or samples, as the model counts).
    steady = None
    per_step = _per_step(run, throughput["unit"])
    if usable and _finite(mean_rate(throughput)) and _finite(per_step) and per_step > 0:
        steps_per_s = mean_rate(throughput) / per_step
        steady = flops_per_step * steps_per_s / (world_size * peak)
    return {"value": value, "steady_value": steady, "flops_per_step": flops_per_step, "steps_run": steps_run,
            "wall_s": wall_s, "world_size": world_size, "peak_flops_per_s": peak,
            "rank_steps_disagree": len(rank_steps) > 1,
            "formula": "MFU = flops_per_step × steps_run / (wall_s × world_size × peak_flops_per_s)"}


def _json_safe(value):
    """NaN/inf -> None (strict JSON), tuples -> lists, unknown objects -> str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


# ---- the report -----------------------------------------------------------------------

def write_report(out_dir, *, metrics: list[dict], ranks: list[dict], run: dict,
                 log_y: bool | None = None, step_parts: dict | None = None) -> dict:
    """Write out_dir/report.json, report.md and loss.png (each by a temporary file
    renamed over it: a symbolic link there is replaced, never written through); return
    the report dict.

    ``metrics``: rank 0's per-step records; ``ranks``: one time split per global rank;
    ``run``: the run's description (keys RUN_KEYS, optional "samples"). ``run["steps"]``
    is the run's total step count, ``run["start_step"]`` the steps done before this
    process (resume); a record's "step" is the 0-based index, so this process ran steps
    start_step .. steps-1. MFU uses the ranks' own "steps" (steps run inside their
    ``wall_s``) when given, else steps - start_step.
    ``flops_per_step`` counts the whole global batch (all data-parallel replicas).
    ``log_y`` None: log scale when the train loss spans more than 10×.
    ``step_parts``: the measured step parts beside the plan's
    (``plait.train.plan_compare.step_parts_section``), or None."""
    _check_inputs(metrics, ranks, run)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out_dir / "report.json"), "markdown": str(out_dir / "report.md"),
             "loss_png": str(out_dir / "loss.png")}
    metrics = sorted(metrics, key=lambda r: r["step"])
    rows = _rank_rows(ranks)
    unit = _unit(run)
    throughput = throughput_summary(metrics, int(run["start_step"]), unit)
    slowest = max(rows, key=lambda row: row["wall_s"]) if rows else None
    report = {
        "run": {**{key: run[key] for key in RUN_KEYS}, "unit": unit, f"{unit}_per_step": _per_step(run, unit)},
        "mesh_shape": _mesh_shape(ranks, run),
        "loss": loss_summary(metrics),
        "throughput": throughput,
        "time_to_first_step_s": run["time_to_first_step_s"],
        "wall_s": max((row["wall_s"] for row in rows), default=None),
        "mfu": _mfu(run, rows, throughput),
        "ranks": rows,
        "ranks_reported": len(rows),
        "slowest_rank": slowest["rank"] if slowest else None,
        "time_totals": _time_totals(rows) if rows else None,
        "axis_totals": _axis_totals(rows),
        "collectives": _collectives(ranks),
        "memory": memory_rows(ranks),
        "samples": run.get("samples"),
        "step_parts": step_parts,
        "paths": paths,
    }
    report = _json_safe(report)
    _plot_loss(metrics, Path(paths["loss_png"]), report["mesh_shape"], log_y)
    _write_text(Path(paths["json"]), json.dumps(report, indent=2, allow_nan=False) + "\n")
    _write_text(Path(paths["markdown"]), render_markdown(report))
    return report


def _write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` by a temporary file renamed over it: a symbolic link there
    is replaced itself, never written through."""
    atomic_write(path, lambda temporary: Path(temporary).write_text(text), nbytes=len(text.encode()))


def _mesh_title(shape: dict) -> str:
    return " × ".join(f"{axis}={shape[axis]}" for axis in AXES)


def _plot_loss(metrics: list[dict], path: Path, shape: dict, log_y: bool | None) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg

    train = [(r["step"], r["loss"]) for r in metrics if _finite(r.get("loss"))]
    val = [(r["step"], r["val_loss"]) for r in metrics if _finite(r.get("val_loss"))]
    fig = Figure(figsize=(7.0, 4.2), dpi=110)
    ax = fig.add_subplot()
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], color="#3f7fd0", linewidth=1.2, label="train loss")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o", color="#e0772e", markersize=5, label="val loss")
    positive = [v for _, v in train + val if v > 0]
    if log_y is None:
        log_y = bool(positive) and len(positive) == len(train) + len(val) and max(positive) > 10 * min(positive)
    if log_y and positive:
        ax.set_yscale("log")
    if not train and not val:
        ax.text(0.5, 0.5, "no finite loss recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy)" + (", log scale" if log_y and positive else ""))
    ax.set_title(f"plait train loss: mesh {_mesh_title(shape)} (world {shape['dp'] * shape['tp'] * shape['pp']})")
    ax.grid(True, alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda temporary: fig.savefig(temporary, format="png"))  # a link at loss.png: replaced itself


# ---- markdown -------------------------------------------------------------------------

def _num(value, fmt: str = ".3f", missing: str = "n/a") -> str:
    return missing if value is None else format(value, fmt)


def _pct(fraction, fmt: str = ".2f") -> str:
    return _num(None if fraction is None else 100.0 * fraction, fmt)


def _split(row: dict) -> str:
    return " | ".join(f"{row[f'{part}_s']:.3f} ({_num(row[f'{part}_pct'], '.1f', '-')}%)" for part in TIME_PARTS)


def _flops_rate(value) -> str:
    return "n/a" if value is None else f"{value / 1e9:.3g} GFLOP/s"


def render_markdown(report: dict) -> str:
    """The report as markdown, readable on its own (columns and formulas explained)."""
    run, loss, throughput, mfu = report["run"], report["loss"], report["throughput"], report["mfu"]
    unit = throughput["unit"]
    shape = report["mesh_shape"]
    lines = ["# plait training report", ""]
    val_text = (f"{loss['final_val']:.4f} (step {loss['final_val_step']}, best {loss['best_val']:.4f})"
                if loss["final_val"] is not None else "n/a (no evaluation)")
    train_text = (f"{loss['final_train']:.4f} (step {loss['final_train_step']}; mean of last "
                  f"{loss['final_train_mean_over']}: {loss['final_train_mean']:.4f})"
                  if loss["final_train"] is not None else "n/a")
    rate_text = (f"{format_rate(mean_rate(throughput))} {unit}/s over {throughput['steps_measured']} "
                 f"recorded steps" + (" (first step excluded)" if throughput["first_step_excluded"] else "")
                 if mean_rate(throughput) is not None else "n/a")
    lines += [
        f"- mesh: {_mesh_title(shape)}, world size {run['world_size']}, backend {run['backend']}, "
        f"device {run['device']}",
        f"- steps: {run['start_step']} -> {run['steps']} ({mfu['steps_run']} run), "
        f"{run[f'{unit}_per_step']} {unit} per step",
        f"- final train loss: {train_text}",
        f"- final val loss: {val_text}",
        f"- mean throughput: {rate_text}",
        f"- time to first step: {_num(report['time_to_first_step_s'], '.2f')} s; training wall time "
        f"(slowest rank): {_num(report['wall_s'], '.2f')} s",
        f"- MFU: {_pct(mfu['value'])}% (steady state, first step excluded: {_pct(mfu['steady_value'])}%)",
    ]
    if loss["nonfinite_train_records"]:
        lines.append(f"- WARNING: {loss['nonfinite_train_records']} records have a non-finite train loss")
    lines += ["", "## Loss", "", "![loss curve](loss.png)", ""]
    if report.get("step_parts"):
        lines += ["## Plan vs measured", "", "Each part of a step (plait.names.step_parts) as the planner prices "
                  "this layout and as timers around the real calls measured it; error = (measured - plan) / plan.",
                  "", "```", *comparison_lines(report["step_parts"]), "```", ""]

    lines += ["## Time per rank", "", "Seconds over the whole training loop, and % of that rank's wall time.", "",
              TIME_DEFINITIONS, ""]
    if report["ranks"]:
        lines += ["| rank | dp | tp | pp | steps | wall s | compute s (%) | comm s (%) | bubble s (%) | other s (%) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in report["ranks"]:
            coords = row["coords"]
            marker = " (slowest)" if row["rank"] == report["slowest_rank"] else ""
            lines.append(f"| {row['rank']}{marker} | {coords['dp']} | {coords['tp']} | {coords['pp']} | "
                         f"{_num(row['steps'], 'd', '-')} | {row['wall_s']:.3f} | {_split(row)} |")
        totals = report["time_totals"]
        lines.append(f"| all ({totals['ranks']}) | | | | | {totals['wall_s']:.3f} | {_split(totals)} |")
        if report["ranks_reported"] != run["world_size"]:
            lines += ["", f"Only {report['ranks_reported']} of {run['world_size']} ranks reported."]
    else:
        lines.append("No per-rank timings were reported.")
    lines.append("")
    for axis, by_value in report["axis_totals"].items():
        lines += [f"### Per {axis} coordinate", "",
                  f"Summed over the ranks sharing each {axis} coordinate (rank-seconds; % of their summed wall).", "",
                  f"| {axis} | ranks | wall s | compute s (%) | comm s (%) | bubble s (%) | other s (%) |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for value, totals in by_value.items():
            lines.append(f"| {value} | {totals['ranks']} | {totals['wall_s']:.3f} | {_split(totals)} |")
        lines.append("")

    lines += ["## Collectives", "",
              "Calls, data sent (MiB = 2^20 bytes) and time inside each plait collective. "
              "Summed over ranks: a collective that every rank joins is counted once per rank.", ""]
    collectives = report["collectives"]
    comm = collectives.get("comm")
    if comm:
        lines += [f"Communicators: {comm['config']}; algorithm=auto chosen by: {comm['tuner']}.", ""]
    if any(collectives.get("transports", {}).values()):
        lines += ["How each rank's groups move their messages:", "", "| rank | group | transport |", "|---:|---|---|"]
        for rank, by_group in collectives["transports"].items():
            lines += [f"| {rank} | {group} | {description} |" for group, description in by_group.items()]
        lines.append("")
    if collectives["total"]:
        lines += ["| collective | ranks | calls | MiB sent | time s | algorithms (calls) |",
                  "|---|---:|---:|---:|---:|---|"]
        for name, stats in collectives["total"].items():
            algorithms = ", ".join(f"{k} {v}" for k, v in sorted(stats.get("algorithms", {}).items()))
            lines.append(f"| {name} | {stats['ranks']} | {stats['calls']} | {stats['bytes_sent'] / MIB:.3f} | "
                         f"{stats['time_s']:.3f} | {algorithms} |")
        lines += ["", "Per rank:", "", "| rank | collective | calls | MiB sent | time s |",
                  "|---:|---|---:|---:|---:|"]
        for rank, by_name in collectives["per_rank"].items():
            for name, stats in by_name.items():
                lines.append(f"| {rank} | {name} | {stats['calls']} | {stats['bytes_sent'] / MIB:.3f} | "
                             f"{stats['time_s']:.3f} |")
    else:
        lines.append("No collectives were recorded.")
    lines.append("")

    lines += ["## Model FLOPs utilisation", "", f"    {mfu['formula']}", ""]
    if mfu["value"] is not None:
        lines.append(f"    = {mfu['flops_per_step']:.4g} × {mfu['steps_run']} / ({mfu['wall_s']:.3f} s × "
                     f"{mfu['world_size']} × {mfu['peak_flops_per_s']:.4g} FLOP/s) = {100 * mfu['value']:.2f}%")
    else:
        lines.append("    not available (no FLOP count, peak or wall time)")
    model = (run.get("config") or {}).get("model", "gpt")
    formula = {"gpt": "72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) for a GPT (96·… with recomputation)",
               "mlp": "6·B·Σ d_i·d_(i+1) for the MLP of widths d_0 .. d_L (B samples; 2 FLOPs per weight and "
                      "sample forward, 4 backward: the 6N rule)"}.get(
        model, "(6·N + 12·l·h·s)·B·s for a Hugging Face causal LM (N every parameter: PaLM's count)")
    lines += ["",
              f"flops_per_step is the model FLOPs of one optimiser step over the global batch, {formula}; "
              "wall_s is the slowest rank's training loop, first step included. "
              f"peak_flops_per_s ({_flops_rate(mfu['peak_flops_per_s'])}) is the matmul rate one process "
              "achieved on this machine (measured, not a datasheet peak). The steady-state MFU uses the mean "
              f"{unit}/s without the first step instead of steps_run / wall_s.", ""]
    lines += render_memory(report.get("memory") or [])
    lines += ["## Mesh", "", "```", str(run["mesh"]).rstrip(), "```", "",
              "## Config", "", "```json", json.dumps(run["config"], indent=2, sort_keys=True), "```", ""]
    if report.get("samples"):
        lines += ["## Samples", "", "```", str(report["samples"]).rstrip(), "```", ""]
    return "\n".join(lines)


def summary_lines(report: dict) -> list[str]:
    """A few console lines for rank 0 at the end of training."""
    loss, throughput, mfu = report["loss"], report["throughput"], report["mfu"]
    val = f", val {loss['final_val']:.4f}" if loss["final_val"] is not None else ""
    train = f"{loss['final_train']:.4f} (step {loss['final_train_step']})" if loss["final_train"] is not None else "n/a"
    lines = [f"loss: train {train}{val}"]
    first_s = report["time_to_first_step_s"]
    lines.append(f"throughput: {format_rate(mean_rate(throughput))} {throughput['unit']}/s (first step excluded); "
                 f"first step after {format_duration(first_s) if _finite(first_s) else 'n/a'}")
    slowest = next((row for row in report["ranks"] if row["rank"] == report["slowest_rank"]), None)
    if slowest is not None:
        coords = " ".join(f"{axis}{slowest['coords'][axis]}" for axis in AXES)
        split = ", ".join(f"{part} {_num(slowest[f'{part}_pct'], '.0f', '-')}%" for part in TIME_PARTS)
        lines.append(f"slowest rank {slowest['rank']} ({coords}): {format_duration(slowest['wall_s'])} = {split}")
    if mfu["value"] is not None:
        steady = "" if mfu["steady_value"] is None else f"; steady state {_pct(mfu['steady_value'], '.1f')}%"
        lines.append(f"MFU: {_pct(mfu['value'], '.1f')}% of {_flops_rate(mfu['peak_flops_per_s'])} per process "
                     f"(measured matmul rate){steady}")
    else:
        lines.append("MFU: n/a")
    lines += comparison_lines(report.get("step_parts"))
    lines.append(f"report: {report['paths']['markdown']} (+ report.json, loss.png)")
    return lines
