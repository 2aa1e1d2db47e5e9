"""The tables of bench/plan_vs_train.py: per configuration, the median over the repeats
and its spread beside the plan (step time, ratio, error, ranks; Spearman over all, per
layout and per variant), the plan's parts beside the measured ones (ms per step), and
the memory per rank."""

from __future__ import annotations

import statistics

from plan_vs_train_stats import COARSE_PARTS, STEP_PARTS, compare, coarse_plan, Config, median_parts, summarize


def ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def summarize_configs(grid: list[Config], predictions: dict, runs: list[dict]) -> tuple[list[dict], dict]:
    """Per configuration: the median over repeats and its spread, the plan, the ratio; then compare()."""
    rows = []
    for config in grid:
        mine = [run for run in runs if run["config"] == config.label and "measured" in run]
        row = {"config": config.label, "layout": config.layout, "dp": config.dp, "tp": config.tp, "pp": config.pp,
               "recompute": config.recompute, "zero_stage": config.zero, "offload_optimizer": config.offload,
               "predicted": predictions.get(config.label), "repeats": len(mine),
               "errors": [run["error"] for run in runs if run["config"] == config.label and "error" in run]}
        if mine:
            row["measured_repeats_s"] = [run["measured"]["step_s"] for run in mine]
            row["measured_summary_s"] = summarize(row["measured_repeats_s"])
            row["measured_s"] = row["measured_summary_s"]["median"]
            row["measured_parts_ms"] = median_parts([run["measured"]["parts"]["parts_ms"] for run in mine])
            row["measured_parts_source"] = sorted({run["measured"]["parts"]["source"] for run in mine})
            row["measured_wall_ms"] = statistics.median([run["measured"]["parts"]["wall_ms"] for run in mine
                                                         if run["measured"]["parts"]["wall_ms"] is not None] or [0])
            row["memory_bytes"] = mine[0]["measured"]["memory_bytes"]
        if row["predicted"] and "step_s" in row["predicted"]:
            row["predicted_s"] = row["predicted"]["step_s"]
        rows.append(row)
    both = [row for row in rows if "predicted_s" in row and "measured_s" in row]
    groups: dict[str, list[int]] = {}
    for index, row in enumerate(both):
        groups.setdefault(f"layout {row['layout']}", []).append(index)
        variant = f"z{row['zero_stage']} {row['recompute']}" + (" offload" if row["offload_optimizer"] else "")
        groups.setdefault(f"variant {variant}", []).append(index)
    return rows, compare(both, groups)


def print_tables(rows: list[dict], stats: dict, args) -> None:
    print(f"{'configuration':<28}{'pred ms':>9}{'meas ms':>9}{'spread':>8}{'(min-max)':>16}{'meas/pred':>10}"
          f"{'error':>8}{'pred rk':>8}{'meas rk':>8}")
    for row in rows:
        p, s = row.get("predicted_s"), row.get("measured_summary_s")
        rng = f"({ms(s['min'])}-{ms(s['max'])})" if s else ""
        spread = f"{100 * s['spread']:.0f}%" if s and s["spread"] is not None else "-"
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        error = f"{100 * row['error']:+.0f}%" if "ratio" in row else "-"
        print(f"{row['config']:<28}{ms(p):>9}{ms(row.get('measured_s')):>9}{spread:>8}{rng:>16}{ratio:>10}"
              f"{error:>8}{format(row.get('predicted_rank', '-'), 'g') if 'ratio' in row else '-':>8}"
              f"{format(row.get('measured_rank', '-'), 'g') if 'ratio' in row else '-':>8}"
              + (f"  ({len(row['errors'])} failed)" if row["errors"] else ""))
    rho = stats["spearman"]
    print(f"Spearman (predicted vs measured step time, {stats['count']} configurations): "
          f"{'-' if rho is None else format(rho, '.3f')} (target >= 0.95)")
    for name, value in stats["spearman_per_group"].items():
        print(f"  Spearman {name}: {'-' if value is None else format(value, '.3f')}")
    if stats["count"]:
        print(f"geometric-mean measured/predicted: {stats['geomean_ratio']:.2f}x; largest |error| "
              f"{100 * stats['max_abs_error']:.0f}%; within 15%: {stats['within_15pct']} of {stats['count']}")
    print(f"(measured: median over {args.repeats_run} alternated repeat(s) of the median of rank 0's step times, first "
          f"{args.warmup} of {args.steps} steps excluded; spread = (max - min) / median over the repeats)")
    print()
    print("parts, ms per step: plan (exposed; 'hidden' = communication the plan hides under compute) / measured "
          "(mean over ranks, median over repeats; report.json's part breakdown, or the coarse split)")
    for row in rows:
        if "measured_parts_ms" not in row or not row.get("predicted"):
            continue
        plan_s, hidden_s = row["predicted"]["breakdown_s"], row["predicted"].get("hidden_s") or {}
        measured = row["measured_parts_ms"]
        fine = "compute" in measured and "tp_comm" in measured
        names = [*STEP_PARTS, *(["receive"] if "receive" in measured else [])] if fine else list(COARSE_PARTS)
        plan_ms = {part: 1e3 * plan_s.get(part, 0.0) for part in STEP_PARTS} if fine else coarse_plan(plan_s)
        print(f"{row['config']:<28}" + "".join(f"{name:>10}" for name in names) + f"{'sum':>10}")
        print(f"{'  plan':<28}" + "".join(f"{plan_ms.get(name, 0.0):>10.1f}" for name in names)
              + f"{sum(plan_ms.values()):>10.1f}")
        if hidden_s:
            hidden = {part: 1e3 * value for part, value in hidden_s.items()}
            print(f"{'  plan hidden':<28}" + "".join(f"{hidden.get(name, 0.0):>10.1f}" for name in names))
        print(f"{'  measured (' + '/'.join(row['measured_parts_source']) + ')':<28}"
              + "".join(f"{measured.get(name, 0.0):>10.1f}" for name in names)
              + f"{sum(measured.get(name, 0.0) for name in names):>10.1f}")
        ratios = [f"{measured.get(name, 0.0) / plan_ms[name]:.2f}x" if plan_ms.get(name, 0.0) > 0 else "-"
                  for name in names]
        total_ms = sum(plan_ms.values())
        print(f"{'  measured / plan':<28}" + "".join(f"{ratio:>10}" for ratio in ratios)
              + (f"{sum(measured.get(name, 0.0) for name in names) / total_ms:>9.2f}x" if total_ms > 0 else ""))
    print()
    print("memory per rank, MiB: predicted (the plan's worst pipeline rank) / measured (the largest over the ranks)")
    print(f"{'configuration':<28}{'activations':>20}{'params':>16}{'grads':>16}{'optimizer':>16}")
    for row in rows:
        if "memory_bytes" not in row or not row.get("predicted"):
            continue
        p, m = row["predicted"]["memory_bytes"], row["memory_bytes"]
        cells = [f"{p.get(key, 0) / 2 ** 20:.2f} / {m[key] / 2 ** 20:.2f}" if m.get(key) is not None else "-"
                 for key in ("activations", "parameters", "gradients", "optimizer")]
        print(f"{row['config']:<28}" + "".join(f"{cell:>{width}}" for cell, width in zip(cells, (20, 16, 16, 16))))
