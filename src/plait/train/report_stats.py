"""The run report's loss and throughput summaries (plait.train.report): the final and
best losses, and the time-weighted mean rate over the steps after the first."""

from __future__ import annotations

import math

from plait.train.progress import rate_key

# Number of final train-loss records averaged into the smoothed final loss.
FINAL_LOSS_WINDOW = 10


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def loss_summary(metrics: list[dict]) -> dict:
    train = [(r["step"], float(r["loss"])) for r in metrics if _finite(r.get("loss"))]
    val = [(r["step"], float(r["val_loss"])) for r in metrics if _finite(r.get("val_loss"))]
    window = [loss for _, loss in train[-FINAL_LOSS_WINDOW:]]
    return {
        "first_train": train[0][1] if train else None,
        "final_train": train[-1][1] if train else None,
        "final_train_step": train[-1][0] if train else None,
        "final_train_mean": sum(window) / len(window) if window else None,
        "final_train_mean_over": len(window),
        "final_val": val[-1][1] if val else None,
        "final_val_step": val[-1][0] if val else None,
        "best_val": min(loss for _, loss in val) if val else None,
        "nonfinite_train_records": sum(1 for r in metrics if "loss" in r and not _finite(r.get("loss"))),
    }


def _rate(record: dict, unit: str):
    """A record's rate in ``unit``/s: its "samples_per_s" / "tokens_per_s"; plait train has
    written an MLP's samples/s as "tokens_per_s", which is read too."""
    value = record.get(rate_key(unit))
    return value if _finite(value) else record.get("tokens_per_s")


def throughput(metrics: list[dict], start_step: int, unit: str = "tokens") -> dict:
    """Time-weighted mean rate (``unit``/s: tokens or samples) over this run's recorded steps
    after its first (warm-up): Σ rate·step_s / Σ step_s, i.e. items / seconds when every step
    is recorded. This run's records are those with step >= start_step (a resumed run's
    metrics also hold the earlier run's steps, which the loss curve shows but the
    throughput skips). Keys: "unit", "mean_{unit}_per_s", "mean_step_s", ..."""
    timed = [r for r in metrics if _finite(_rate(r, unit)) and r["step"] >= start_step]
    timed.sort(key=lambda r: r["step"])
    measured = timed[1:] if len(timed) > 1 else timed
    weighted = [r for r in measured if _finite(r.get("step_s")) and r["step_s"] > 0]
    if measured and len(weighted) == len(measured):
        total_s = sum(r["step_s"] for r in weighted)
        rate_per_s = sum(_rate(r, unit) * r["step_s"] for r in weighted) / total_s
        mean_step_s = total_s / len(weighted)
    elif measured:  # no usable step times: plain mean of the rates
        rate_per_s = sum(_rate(r, unit) for r in measured) / len(measured)
        mean_step_s = None
    else:
        rate_per_s = mean_step_s = None
    return {"unit": unit, f"mean_{rate_key(unit)}": rate_per_s, "mean_step_s": mean_step_s,
            "steps_measured": len(measured), "first_step_excluded": len(timed) > 1}


def mean_rate(throughput: dict):
    return throughput[f"mean_{rate_key(throughput['unit'])}"]
