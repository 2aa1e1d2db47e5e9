"""The plan beside the measurement: price a run's own layout as ``plait plan --cluster
local`` does and set each step part's prediction beside what the run measured.

The plan side prices exactly the run's layout (dp, tp, pp, micro-batch, schedule,
virtual stages, recompute, ZeRO stage, sequence parallelism, precision, offload, mesh
order; plait's GPT of the run's shape and vocabulary) with the planner's own code path:
``plait.plan.search`` over a ``PlanRequest`` that fixes every choice, on the ``local``
cluster of the run's world size. It runs no benchmark: the device is the run's own
measured per-process matmul rate (``run.peak_flops_per_s``, measured by every rank at
once, so the sharing of the cores is in it) with the per-kernel cost and memory
bandwidth timed beside it (``plait.train.eager_costs``, ~50 ms); the link is the saved
``plait calibrate`` profile, or a placeholder when there is none. When `plait calibrate
--compute --nprocs N` has saved a compute profile for the run's N ranks, it prices the
compute instead (and its host section the wait for the slowest rank), exactly as
``plait plan --cluster local`` does. Which sources priced the plan is written next to it.

The comparison, per part p of ``plait.names.step_parts`` (ms per step):

    error_p = (measured_p - plan_p) / plan_p          (None where plan_p = 0)
    drift   = (measured step - plan step) / plan step

measured = the mean over ranks of their steady steps (``plait.train.step_breakdown``);
the plan prices neither data nor other (0). A drift beyond ``DRIFT_FLAG_FRACTION`` is
flagged with the part whose difference measured_p - plan_p is largest in the drift's
direction, and its share of the gap (diff_p / (measured step - plan step)).

A layout the planner cannot price (the MLP, a Hugging Face model, a model with no
transformer to trace) gets a one-line reason instead; the comparison never stops a run.
"""

from __future__ import annotations

import math
import os
import warnings

from plait.cost.presets import PLACEHOLDER_LOCAL_LINK
from plait.files import default_cache_dir
from plait.cost.profile import DEFAULT_PROFILE_BACKEND, load_profile, ProfileMismatchWarning
from plait.names.precision import FP32
from plait.names.recompute import NONE as NO_RECOMPUTE
from plait.names.schedules import INTERLEAVED_1F1B, NO_PIPELINE
from plait.names.step_parts import DRIFT_FLAG_FRACTION, PRICED_PARTS, STEP_PARTS
from plait.plan import cluster_preset, PlanRequest, search, TransformerModel, TransformerSpec
from plait.plan.cpu_profile import compute_profile_path, host_model_from_profile, load_compute_profile
from plait.plan.device_profile import profile_device
from plait.plan.device_spec import DeviceSpec
from plait.plan.search import PlanError


ASSUMED_KERNEL_S = 4e-6  # a CPU eager kernel's launch and dispatch, when the run measured none
ASSUMED_BANDWIDTH_BYTES_PER_S = 1e10  # one rank's memory bandwidth, when the run measured none


def assumed_eager_note() -> str:
    """The report's note when the run measured no eager kernel costs."""
    return (f"the run measured no eager kernel costs: the plan assumes {ASSUMED_KERNEL_S * 1e6:g} µs a kernel and "
            f"{ASSUMED_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s of memory bandwidth a rank")


def run_device(peak_flops_per_s: float, eager: tuple[float, float] | None, world_size: int) -> DeviceSpec:
    """One rank of the run as the planner's device: its measured matmul rate, per-kernel
    cost and bandwidth (float32: the planner's fp32 precision), η = 1 (rates achieved).
    Without ``eager`` (kernel seconds, bytes/s) the kernel cost and bandwidth are the
    ASSUMED_ ones (``price_run`` then says so in its notes)."""
    kernel_s, bandwidth = eager if eager else (ASSUMED_KERNEL_S, ASSUMED_BANDWIDTH_BYTES_PER_S)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(world_size, 1)
    return DeviceSpec(name="cpu (the run's measured rates)", peak_flops_per_s=(("float32", peak_flops_per_s),),
                      memory_bytes=float(memory), memory_bandwidth_bytes_per_s=bandwidth, matmul_efficiency=1.0,
                      memory_efficiency=1.0, kernel_overhead_s=kernel_s, eager=True,
                      source="the run's own rates: matmul (report peak_flops_per_s) and eager kernels, every "
                             "rank at once" + ("" if eager else "; kernel cost and bandwidth assumed"))


def _device(world_size: int, peak_flops_per_s: float, eager, cache_dir) -> tuple[DeviceSpec, dict | None]:
    """As ``plait plan --cluster local``: the compute profile `plait calibrate --compute
    --nprocs N` saved for this many ranks (and its host section), else the run's own rates."""
    path = compute_profile_path(world_size, default_cache_dir() if cache_dir is None else cache_dir)
    compute, _ = load_compute_profile(path, nprocs=world_size, dtype="float32")
    if compute is not None:
        return profile_device(compute, where=str(path)), compute
    return run_device(peak_flops_per_s, eager, world_size), None


def _link(cache_dir) -> tuple[dict, str]:
    """As ``plait plan --cluster local``: the saved calibration profile's link, call costs
    and (format 2) transport model, as cluster_preset's keyword arguments, and their source."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileMismatchWarning)
        profile = load_profile(None, backend=DEFAULT_PROFILE_BACKEND, cache_dir=cache_dir)
    if profile is None:
        return ({"local_link": PLACEHOLDER_LOCAL_LINK, "call_overhead_s": 0.0},
                "none saved: a placeholder link (run `plait calibrate`)")
    return ({"local_link": profile.link, "call_overhead_s": profile.call_overhead_s,
             "p2p_call_s": profile.collective_call_s("p2p"), "transport": profile.transport_model},
            f"calibration profile (p={profile.world_size})")


def unpriceable(config: dict) -> str | None:
    """Why the planner cannot price this run's model, or None."""
    model = config.get("model", "gpt")
    if str(model).startswith("hf:") or config.get("hf_source"):
        return (f"model {model}: the run report prices plait's GPT only; price it with plait plan --model "
                f"{model} --cluster local")
    if model != "gpt":
        return f"model {model!r}: the planner prices transformers (plait's GPT); no plan to compare"
    return None


def price_run(config: dict, *, world_size: int, vocab: int, peak_flops_per_s: float,
              eager: tuple[float, float] | None, cache_dir=None):
    """The planner's Estimate of this run's layout and where its prices came from:
    (estimate, sources); raises ValueError/PlanError when it cannot be priced."""
    reason = unpriceable(config)
    if reason is not None:
        raise ValueError(reason)
    precision = config.get("precision", FP32)
    if precision != FP32:
        raise ValueError(f"precision={precision}: the run measured its float32 matmul rate only; price it with plait "
                         f"plan --cluster local --precision {precision}")
    if not (isinstance(peak_flops_per_s, (int, float)) and peak_flops_per_s > 0):
        raise ValueError(f"no measured matmul rate (peak_flops_per_s={peak_flops_per_s!r}) to price compute with")
    device, compute = _device(world_size, float(peak_flops_per_s), eager, cache_dir)
    link_prices, link_source = _link(cache_dir)
    host = host_model_from_profile(compute, nprocs=world_size)
    cluster = cluster_preset("local", nprocs=world_size, device=device, **link_prices, link_source=link_source,
                             host=host)
    pp = config["pp"]
    schedule = NO_PIPELINE if pp == 1 else config["schedule"]
    request = PlanRequest(
        global_batch=config["global_batch"], tp=config["tp"], pp=pp, dp=config["dp"],
        micro_batch=config["micro_batch"], schedule=schedule,
        virtual=config["virtual"] if schedule == INTERLEAVED_1F1B else None,
        recompute=config.get("recompute", NO_RECOMPUTE), zero_stage=config.get("zero_stage", 0),
        sequence_parallel=bool(config.get("sequence_parallel", False)) and config["tp"] > 1,
        precision=precision, accounting="plait",
        offload=bool(config.get("offload_activations", False)),
        offload_optimizer=config.get("offload", "none") == "optimizer",
        mesh_order=config.get("mesh_order", PlanRequest.mesh_order),
        memory_limit_bytes=float("inf"), top=1)  # the run fit: memory is not the question here
    spec = TransformerSpec(name="gpt", layers=config["layers"], hidden=config["hidden"], heads=config["heads"],
                           seq_len=config["seq_len"], vocab=vocab, ffn_hidden=config.get("ffn_hidden", 0),
                           tied_head=bool(config.get("tied_head", False)), dropout=config.get("dropout", 0.0) > 0)
    result = search(TransformerModel(spec), cluster, request, suggest=False)
    notes = []
    if compute is None and not eager:  # run_device's assumed kernel cost and bandwidth priced it
        notes.append(assumed_eager_note())
    if config.get("dtype", "float32") != "float32":
        notes.append(f"the run computes in {config['dtype']}; the plan prices the float32 matmul rate")
    if config.get("stage_layers"):
        notes.append(f"the run's stages (stage_layers={list(config['stage_layers'])}) are priced as the planner splits "
                     f"them ({plan_stage_text(result.best.stage_layers)})")
    if config.get("recompute_layers", -1) >= 0 and config.get("recompute", NO_RECOMPUTE) != NO_RECOMPUTE:
        notes.append(f"recompute_layers={config['recompute_layers']} is priced as recompute of every block")
    if config.get("compression", "none") not in ("", "none"):
        notes.append(f"compression={config['compression']} is priced as an uncompressed gradient all-reduce")
    sources = {"device": device.source, "link": link_source, "host": host.source,
               "cluster": result.cluster_description, "notes": notes}
    return result.best, sources


def plan_stage_text(stage_layers) -> str:
    """The planner's split: layer groups per chunk, e.g. "[0, 1] [2, 3]"."""
    return " ".join(str(list(chunk)) for chunk in stage_layers)


def compare(plan, measured: dict, sources: dict) -> dict:
    """Per part: plan ms, measured mean and max-rank ms, error; the step; the drift flag."""
    parts_ms = measured["parts_ms"]
    plan_ms = {part: 1e3 * plan.time_s.get(part, 0.0) if part in PRICED_PARTS else 0.0 for part in STEP_PARTS}
    rows = {}
    for part in STEP_PARTS:
        mean_ms = parts_ms[part]["mean_ms"]
        rows[part] = {"plan_ms": plan_ms[part], "measured_ms": mean_ms, "max_ms": parts_ms[part]["max_ms"],
                      "max_rank": parts_ms[part]["max_rank"],
                      "error": (mean_ms - plan_ms[part]) / plan_ms[part] if plan_ms[part] > 0 else None}
    hidden = getattr(plan, "hidden_s", None) or {}
    for part, seconds in hidden.items():
        if part in rows:
            rows[part]["hidden_plan_ms"] = 1e3 * seconds
    plan_step_ms = 1e3 * plan.step_time_s
    step_ms = parts_ms["wall"]["mean_ms"]
    drift = (step_ms - plan_step_ms) / plan_step_ms if plan_step_ms > 0 else None
    flag = None
    if drift is not None and abs(drift) > DRIFT_FLAG_FRACTION:
        gap_ms = step_ms - plan_step_ms
        cause = max(STEP_PARTS, key=lambda part: math.copysign(1.0, gap_ms) * (rows[part]["measured_ms"]
                                                                              - rows[part]["plan_ms"]))
        difference_ms = rows[cause]["measured_ms"] - rows[cause]["plan_ms"]
        flag = {"drift": drift, "part": cause, "difference_ms": difference_ms, "share_of_gap": difference_ms / gap_ms}
    return {"parts": rows, "step": {"plan_ms": plan_step_ms, "measured_ms": step_ms,
                                    "max_ms": parts_ms["wall"]["max_ms"], "max_rank": parts_ms["wall"]["max_rank"],
                                    "error": drift},
            "flag": flag, "flag_fraction": DRIFT_FLAG_FRACTION, "sources": sources,
            "layout": plan.layout.as_dict()}


def step_parts_section(config: dict, measured: dict | None, inputs: dict, cache_dir=None) -> dict:
    """report.json's "step_parts": the measured breakdown, the inputs to re-price it
    (``plait plan --explain-run``), and the comparison or why there is none. Never raises
    for a layout the planner refuses: the reason is kept instead."""
    section = {"measured": measured, "inputs": inputs, "comparison": None, "not_priced": None}
    if measured is None:
        section["not_priced"] = "no rank reported its step parts"
        return section
    try:
        plan, sources = price_run(config, world_size=inputs["world_size"], vocab=inputs.get("vocab"),
                                  peak_flops_per_s=inputs.get("peak_flops_per_s"), eager=inputs.get("eager"),
                                  cache_dir=cache_dir)
        section["comparison"] = compare(plan, measured, sources)
    except (ValueError, TypeError, KeyError, PlanError) as error:
        section["not_priced"] = f"the plan could not price this run: {error}"
    except Exception as error:  # a comparison never stops a finished run: it is reported by name instead
        section["not_priced"] = f"the comparison failed: {type(error).__name__}: {error}"
    return section


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _error(value) -> str:
    return "-" if value is None else f"{100 * value:+.0f}%"


def comparison_lines(section: dict | None) -> list[str]:
    """The plan-vs-measured table as plain lines (console and markdown code block)."""
    if not section:
        return []
    measured, comparison = section.get("measured"), section.get("comparison")
    if comparison is None:
        lines = ["plan vs measured: not priced: " + (section.get("not_priced") or "no plan")]
        if measured:
            lines += [f"measured ms/step (mean over ranks): " + ", ".join(
                f"{part} {measured['parts_ms'][part]['mean_ms']:.2f}" for part in STEP_PARTS)]
        return lines
    steps = sorted(set(measured["steps"].values()))
    lines = [f"step parts, ms per step: plan (plait plan --cluster local, this layout) vs measured (mean over "
             f"{len(measured['steps'])} ranks; {'/'.join(map(str, steps))} steps"
             f"{', first excluded' if measured.get('first_step_excluded') else ''})",
             f"{'part':<10}{'plan':>9}{'measured':>10}{'max rank':>14}{'error':>8}"]
    for part, row in comparison["parts"].items():
        lines.append(f"{part:<10}{_ms(row['plan_ms']):>9}{_ms(row['measured_ms']):>10}"
                     f"{_ms(row['max_ms']) + ' (r' + str(row['max_rank']) + ')':>14}{_error(row['error']):>8}")
    step = comparison["step"]
    lines.append(f"{'step':<10}{_ms(step['plan_ms']):>9}{_ms(step['measured_ms']):>10}"
                 f"{_ms(step['max_ms']) + ' (r' + str(step['max_rank']) + ')':>14}{_error(step['error']):>8}")
    stages = measured.get("stage_compute_ms") or {}
    if len(stages) > 1:
        lines.append("compute per pipeline stage (measured, mean over its ranks): "
                     + ", ".join(f"stage {stage} {value:.2f}" for stage, value in stages.items()))
    hidden = {part: row["hidden_plan_ms"] for part, row in comparison["parts"].items() if row.get("hidden_plan_ms")}
    if hidden:
        lines.append("the plan hides under compute (not in its parts above): "
                     + ", ".join(f"{part} {value:.2f}" for part, value in hidden.items()))
    flag = comparison["flag"]
    if flag is not None:
        lines.append(f"DRIFT: measured step {step['measured_ms']:.2f} ms is {100 * flag['drift']:+.0f}% off the "
                     f"plan's {step['plan_ms']:.2f} ms (beyond {100 * comparison['flag_fraction']:.0f}%); largest "
                     f"difference: {flag['part']} {flag['difference_ms']:+.2f} ms "
                     f"({100 * flag['share_of_gap']:.0f}% of the gap)")
    sources = comparison["sources"]
    lines.append(f"plan priced with: device {sources['device']}; link {sources['link']}"
                 + (f"; host {sources['host']}" if sources.get("host") else ""))
    lines += [f"note: {note}" for note in sources.get("notes", [])]
    lines.append(f"pipeline receive waits: {measured.get('receive_split')}")
    if measured.get("closing_split"):
        lines.append(f"pipeline closing waits: {measured['closing_split']}")
    return lines
