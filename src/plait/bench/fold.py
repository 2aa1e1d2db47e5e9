"""`plait bench fold`: FoldedCNN's throughput against the unfolded CNN across batch sizes,
with each model's arithmetic intensity (analytic) and accuracy (held out).

Steps: generate the red-square task (plait.graph.folded_data), train the unfolded CNN on
hard labels, fold it for each f and train each folded network by distillation from it;
then, per batch size (images), time every model in rounds, the order rotated each round:
a warm-up call, then calls until ``min_time_s`` has passed; images/s = images × calls /
time, median over rounds with the spread (min–max). Batches that are not a multiple of f
are padded (marked * in the table; only real images count).

Plateau batch: the smallest batch where the unfolded model reaches 90 % of its best
throughput; the speedup of each folded model is taken there. A speedup at a batch is the
median over rounds of (folded / unfolded images/s in the same round): both timed seconds
apart, so a burst of load from other processes hits both sides of a ratio. Arithmetic
intensity I(B) = FLOPs / bytes moved (plait.graph.fold.ModelCost). The machine balance is
measured: peak FLOP/s of a 2048² float32 matmul over the bandwidth of a 128 MiB copy (bytes read + written per second); a model whose I(B) is below the balance
is memory-bound at B, where the extra intensity of a fold can buy throughput, above it
compute-bound, where only a higher achieved FLOP rate can (FLOPs per image are the same or
a few percent more): the report gives each model's achieved GFLOP/s at the plateau batch
(images/s × FLOPs per image) as a fraction of the matmul peak, which is what widening
narrow layers (16–64 channels) raises on a CPU whose kernels run narrow convolutions far
below peak.

Where a fold pays in eager PyTorch: BatchNorm, ReLU and pooling do no FLOPs worth counting
and only stream their activations, whose bytes per image a fold divides by ≈ √f (exactly 2
at f = 4); convs and the Linear keep their FLOPs per image (+2–4 %). With the unfolded
model's time per image split layer by layer at the plateau batch into t_conv and t_elem,

    predicted speedup = (t_conv + t_elem) / (t_conv · FLOPs ratio + t_elem · elementwise-bytes ratio),

at most 1 / (share_conv + share_elem / √f): the fold can beat 1.3× only where the memory-bound
layers take a large enough share of the time (≥ 50 % at f = 4, ≥ 57 % at f = 3, ≥ 80 % at f = 2
with the FLOPs ratios of plait.graph.fold) or where widened convs run faster per FLOP.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
from matplotlib.figure import Figure  # drawn without pyplot: no global backend state

from plait.graph.fold import chain_layers, check_factor, fold, model_cost
from plait.graph.folded_data import IMAGE_SHAPE, accuracy, red_square_cnn, red_square_dataset, train

PLATEAU_FRACTION = 0.9
TARGET_SPEEDUP = 1.3
TARGET_ACCURACY_POINTS = 2.0


@dataclass(frozen=True, kw_only=True)
class FoldBenchConfig:
    """Flags of `plait bench fold` (one field per flag)."""

    factors: tuple[int, ...] = (2, 3, 4)
    batches: tuple[int, ...] = tuple(2 ** k for k in range(11))  # 1 … 1024 images
    rounds: int = 7
    min_time_s: float = 0.08
    train_images: int = 4800
    test_images: int = 2000
    epochs: int = 3
    distill_epochs: int = 6
    seed: int = 0
    out: str = "bench-results/fold"
    progress: bool = field(default=True, compare=False)

    def problems(self) -> list[str]:
        found = []
        for f in self.factors:
            try:
                check_factor(f)
            except ValueError as error:
                found.append(f"--factors: {error}")
        if not self.factors:
            found.append("--factors: give at least one fold factor, e.g. 2,3,4")
        bad = [b for b in self.batches if b < 1]
        if bad or not self.batches:
            found.append(f"--batches {', '.join(map(str, bad)) or '(none)'}: batch sizes must be >= 1 images")
        for name in ("rounds", "train_images", "test_images", "epochs", "distill_epochs"):
            if getattr(self, name) < 1:
                found.append(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.min_time_s <= 0:
            found.append(f"--min-time-s {self.min_time_s} must be > 0")
        step_images = max((step_batch(f) for f in self.factors if isinstance(f, int) and f >= 1), default=96)
        if self.train_images < step_images:
            found.append(f"--train-images {self.train_images} must be >= {step_images} (one training step)")
        return found


def step_batch(f: int) -> int:
    """Images per training step: 96 (a multiple of 1, 2, 3 and 4) rounded up to a multiple of f."""
    return f * -(-96 // f)


QUICK = dict(factors=(2,), batches=(1, 8, 64), rounds=1, min_time_s=0.005, train_images=192, test_images=96,
             epochs=1, distill_epochs=1)


def measure_machine_balance() -> dict:
    """Peak FLOP/s (a 2048² float32 matmul), copy bandwidth (bytes read + written per s of
    a 128 MiB copy) and their ratio, the balance point in FLOPs per byte; each the best of
    5 (the least disturbed run on a shared machine: a peak, not a typical rate); run_bench
    measures before training and after the sweep and keeps the better of each."""
    size = 2048
    left, right = torch.randn(size, size), torch.randn(size, size)
    source = torch.empty(32 * 2 ** 20)  # 128 MiB of float32
    destination = torch.empty_like(source)
    flop_rates, byte_rates = [], []
    torch.mm(left, right)
    destination.copy_(source)
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(left, right)
        flop_rates.append(2.0 * size ** 3 / (time.perf_counter() - start))
        start = time.perf_counter()
        destination.copy_(source)
        byte_rates.append(2.0 * source.numel() * source.element_size() / (time.perf_counter() - start))
    flops_per_s, bytes_per_s = max(flop_rates), max(byte_rates)
    return {"peak_flops_per_s": flops_per_s, "copy_bytes_per_s": bytes_per_s,
            "balance_flops_per_byte": flops_per_s / bytes_per_s, "load_average_1min": os.getloadavg()[0]}


def train_models(config: FoldBenchConfig, log) -> tuple[dict, dict, tuple]:
    """The unfolded CNN and one FoldedCNN per factor, trained; their held-out accuracy and
    training time; and the test images. Names: "unfolded", "f=2", …"""
    images, labels = red_square_dataset(config.train_images, config.seed)
    test_images, test_labels = red_square_dataset(config.test_images, config.seed + 1)
    torch.manual_seed(config.seed)
    models, facts = {}, {}
    teacher = red_square_cnn()
    start = time.perf_counter()
    train(teacher, images, labels, epochs=config.epochs, seed=config.seed)
    models["unfolded"] = teacher
    facts["unfolded"] = {"train_s": time.perf_counter() - start, "f": 1}
    log(f"# trained unfolded in {facts['unfolded']['train_s']:.1f} s")
    for f in config.factors:
        torch.manual_seed(config.seed + f)
        student = fold(teacher, f)
        start = time.perf_counter()
        train(student, images, labels, epochs=config.distill_epochs, seed=config.seed + f, teacher=teacher,
              batch_size=step_batch(f))
        models[f"f={f}"] = student
        facts[f"f={f}"] = {"train_s": time.perf_counter() - start, "f": f}
        log(f"# distilled f={f} in {facts[f'f={f}']['train_s']:.1f} s")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the last test chunk may be padded: only real images are scored
        for name, model in models.items():
            facts[name]["accuracy"] = accuracy(model, test_images, test_labels)
    return models, facts, (test_images, test_labels)


def time_model(model: torch.nn.Module, images: torch.Tensor, min_time_s: float) -> float:
    """Images per second of ``model`` on ``images`` (one warm-up call first)."""
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # padding to a multiple of f: reported in the table instead
        model(images)
        calls, start = 0, time.perf_counter()
        while True:
            model(images)
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time_s:
                return images.shape[0] * calls / elapsed


def throughput_sweep(models: dict, config: FoldBenchConfig, log) -> dict:
    """{name: {batch: [images/s of round 0, 1, ...]}}, models alternated in rotated order."""
    for model in models.values():
        model.eval()
    names = list(models)
    samples = {name: {batch: [] for batch in config.batches} for name in names}
    generator = torch.Generator().manual_seed(config.seed)
    for batch in config.batches:
        images = torch.rand((batch, *IMAGE_SHAPE), generator=generator)
        for round_index in range(config.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name][batch].append(time_model(models[name], images, config.min_time_s))
        log(f"# batch {batch}: " + ", ".join(f"{name} {statistics.median(samples[name][batch]):,.0f}"
                                               for name in names) + " images/s")
    return samples


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def time_split(model: torch.nn.Module, batch: int, config: FoldBenchConfig) -> dict:
    """Seconds per image the unfolded model spends in its layers with FLOPs (conv, linear)
    and in the rest (BatchNorm, ReLU, pools: pure memory traffic in eager PyTorch), timed
    layer by layer at ``batch`` (median of config.rounds)."""
    layers = chain_layers(model)
    weighted_s, elementwise_s = [], []
    images = torch.rand((batch, *IMAGE_SHAPE), generator=torch.Generator().manual_seed(config.seed))
    with torch.inference_mode():
        for _ in range(config.rounds):
            activation, split = images, [0.0, 0.0]
            for layer in layers:
                layer.eval()
                output = layer(activation)  # warm-up
                calls, start = 0, time.perf_counter()
                while time.perf_counter() - start < config.min_time_s / len(layers):
                    output = layer(activation)
                    calls += 1
                split[0 if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)) else 1] += \
                    (time.perf_counter() - start) / calls / batch
                activation = output
            weighted_s.append(split[0])
            elementwise_s.append(split[1])
    return {"batch": batch, "weighted_s_per_image": statistics.median(weighted_s),
            "elementwise_s_per_image": statistics.median(elementwise_s)}


def predicted_speedup(split: dict, base, cost) -> float:
    """Two-term model: a folded image costs the conv/linear time × its FLOPs ratio plus the
    elementwise time × its elementwise-bytes ratio (each at the unfolded model's rates)."""
    weighted, elementwise = split["weighted_s_per_image"], split["elementwise_s_per_image"]
    folded = (weighted * cost.flops_per_image / base.flops_per_image +
              elementwise * cost.elementwise_bytes_per_image / base.elementwise_bytes_per_image)
    return (weighted + elementwise) / folded


def plateau_batch(throughput: dict[int, dict]) -> int:
    """Smallest batch reaching PLATEAU_FRACTION of the best median throughput."""
    best = max(cell["median"] for cell in throughput.values())
    return min(batch for batch, cell in throughput.items() if cell["median"] >= PLATEAU_FRACTION * best)


def run_bench(config: FoldBenchConfig, log=print) -> dict:
    """Train, measure and analyse; returns the JSON-ready summary."""
    machine = measure_machine_balance()
    log(f"# machine: {machine['peak_flops_per_s'] / 1e9:.1f} GFLOP/s (matmul), {machine['copy_bytes_per_s'] / 1e9:.1f}"
        f" GB/s (copy), balance {machine['balance_flops_per_byte']:.1f} FLOPs/byte; {torch.get_num_threads()} threads; "
        f"load average {machine['load_average_1min']:.2f} (other processes share these cores: see the spread)")
    models, facts, _ = train_models(config, log)
    costs = {name: model_cost(model, IMAGE_SHAPE) for name, model in models.items()}
    load_before_s = os.getloadavg()[0]
    samples = throughput_sweep(models, config, log)
    throughput = {name: {batch: summarise(values) for batch, values in per_batch.items()}
                  for name, per_batch in samples.items()}
    speedup = {name: {batch: summarise([mine / base for mine, base in zip(values, samples["unfolded"][batch])])
                      for batch, values in per_batch.items()} for name, per_batch in samples.items()}
    machine["load_average_during_sweep"] = (load_before_s, os.getloadavg()[0])
    again = measure_machine_balance()  # the best of before and after: a peak, less hostage to a burst of load
    for key in ("peak_flops_per_s", "copy_bytes_per_s"):
        machine[key] = max(machine[key], again[key])
    machine["balance_flops_per_byte"] = machine["peak_flops_per_s"] / machine["copy_bytes_per_s"]
    plateau = plateau_batch(throughput["unfolded"])
    base = costs["unfolded"]
    split = time_split(models["unfolded"], plateau, config)
    rows = []
    for name, model in models.items():
        f = facts[name]["f"]
        cost = costs[name]
        rows.append({
            "model": name, "f": f, "accuracy": facts[name]["accuracy"], "train_s": facts[name]["train_s"],
            "flops_per_image": cost.flops_per_image, "flops_vs_unfolded": cost.flops_per_image / base.flops_per_image,
            "weight_bytes": cost.weight_bytes, "activation_bytes_per_image": cost.activation_bytes_per_image,
            "throughput": {str(b): cell for b, cell in throughput[name].items()},
            "padded_batches": [b for b in config.batches if b % f],
            "intensity": {str(b): cost.arithmetic_intensity(b) for b in config.batches},
            "intensity_limit": cost.flops_per_image / cost.activation_bytes_per_image,
            "speedup": {str(b): cell for b, cell in speedup[name].items()},
            "speedup_at_plateau": speedup[name][plateau]["median"],
            "predicted_speedup_at_plateau": predicted_speedup(split, base, cost),
            "elementwise_bytes_per_image": cost.elementwise_bytes_per_image,
            "faster_from_batch": next((b for b in config.batches
                                       if all(speedup[name][c]["median"] > 1 for c in config.batches if c >= b)), None),
            "samples": {str(b): values for b, values in samples[name].items()},
            "achieved_flops_per_s_at_plateau": throughput[name][plateau]["median"] * cost.flops_per_image,
            "best_throughput": max(cell["median"] for cell in throughput[name].values()),
            "accuracy_points_vs_unfolded": 100 * (facts[name]["accuracy"] - facts["unfolded"]["accuracy"]),
        })
    best_unfolded = rows[0]["best_throughput"]
    for row in rows:
        row["best_vs_best_unfolded"] = row["best_throughput"] / best_unfolded
        row["intensity_crossover_batch"] = _crossover(costs["unfolded"], costs[row["model"]], config.batches)
        row["compute_bound_from_batch"] = next(
            (b for b in config.batches if costs[row["model"]].arithmetic_intensity(b) >= machine["balance_flops_per_byte"]),
            None)
    folded = [row for row in rows if row["f"] > 1]
    return {"config": {k: v for k, v in asdict(config).items() if k != "progress"}, "machine": machine,
            "unfolded_time_split": split,
            "threads": torch.get_num_threads(), "plateau_batch": plateau, "models": rows,
            "target_met": bool(folded) and all(row["speedup_at_plateau"] >= TARGET_SPEEDUP and
                                               abs(row["accuracy_points_vs_unfolded"]) <= TARGET_ACCURACY_POINTS
                                               for row in folded),
            "any_target_met": any(row["speedup_at_plateau"] >= TARGET_SPEEDUP and
                                  abs(row["accuracy_points_vs_unfolded"]) <= TARGET_ACCURACY_POINTS for row in folded)}


def _crossover(base, other, batches) -> int | None:
    """Smallest batch from which ``other``'s intensity exceeds ``base``'s, or None."""
    return next((b for b in batches if other.arithmetic_intensity(b) > base.arithmetic_intensity(b)), None)


def render(result: dict) -> list[str]:
    """The text report: throughput table, then per model FLOPs, intensity, accuracy, speedup."""
    batches = [int(b) for b in result["models"][0]["throughput"]]
    lines = [f"# images/s (median of {result['config']['rounds']} rounds, spread min-max in the JSON; * = batch "
             f"padded to a multiple of f); {result['threads']} threads",
             f"{'batch':>6}" + "".join(f"{row['model']:>14}" for row in result["models"])]
    for batch in batches:
        cells = []
        for row in result["models"]:
            mark = "*" if batch in row["padded_batches"] else " "
            cells.append(f"{row['throughput'][str(batch)]['median']:>13,.0f}{mark}")
        lines.append(f"{batch:>6}" + "".join(cells))
    folded = [row for row in result["models"] if row["f"] > 1]
    lines.append("# speedup over unfolded (median over rounds of the per-round ratio; spread min-max)")
    lines.append(f"{'batch':>6}" + "".join(f"{row['model']:>20}" for row in folded))
    for batch in batches:
        lines.append(f"{batch:>6}" + "".join(
            f"{row['speedup'][str(batch)]['median']:>7.2f}x ({row['speedup'][str(batch)]['min']:.2f}-"
            f"{row['speedup'][str(batch)]['max']:.2f})" for row in folded))
    machine = result["machine"]
    lines.append(f"# arithmetic intensity (FLOPs/byte, analytic); machine balance "
                 f"{machine['balance_flops_per_byte']:.1f} = {machine['peak_flops_per_s'] / 1e9:.1f} GFLOP/s / "
                 f"{machine['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    lines.append(f"{'batch':>6}" + "".join(f"{row['model']:>14}" for row in result["models"]))
    for batch in batches:
        lines.append(f"{batch:>6}" + "".join(f"{row['intensity'][str(batch)]:>14.2f}" for row in result["models"]))
    before, after = machine.get("load_average_during_sweep", (float("nan"), float("nan")))
    lines.append(f"# 1-min load average before / after the sweep: {before:.2f} / {after:.2f} on "
                 f"{os.cpu_count()} CPUs (above ~0.5 per CPU other processes were competing)")
    lines.append(f"# plateau batch of the unfolded model ({PLATEAU_FRACTION:.0%} of its best): {result['plateau_batch']}")
    split = result["unfolded_time_split"]
    total = split["weighted_s_per_image"] + split["elementwise_s_per_image"]
    lines.append(f"# unfolded at batch {split['batch']}, layer by layer: conv/linear "
                 f"{1e6 * split['weighted_s_per_image']:.1f} us/image, BN/ReLU/pool "
                 f"{1e6 * split['elementwise_s_per_image']:.1f} us/image "
                 f"({split['elementwise_s_per_image'] / total:.0%}: bytes, no FLOPs); predicted speedup = 1 / "
                 f"(conv share x FLOPs ratio + elementwise share x elementwise-bytes ratio)")
    lines.append(f"{'model':<10}{'MFLOP/img':>10}{'vs unf.':>9}{'weights KiB':>12}{'act KiB/img':>12}"
                 f"{'I limit':>9}{'I > unf. from B':>16}{'faster from B':>14}{'compute-bound from B':>21}{'accuracy':>10}{'points':>8}"
                 f"{'elem KiB/img':>13}{'predicted':>10}{'speedup@plateau':>16}{'best/best':>10}{'GFLOP/s@plateau':>16}{'of peak':>8}")
    for row in result["models"]:
        lines.append(f"{row['model']:<10}{row['flops_per_image'] / 1e6:>10.3f}{row['flops_vs_unfolded']:>9.3f}"
                     f"{row['weight_bytes'] / 1024:>12.1f}{row['activation_bytes_per_image'] / 1024:>12.1f}"
                     f"{row['intensity_limit']:>9.2f}{_or_dash(row['intensity_crossover_batch']):>16}"
                     f"{_or_dash(row['faster_from_batch'] if row['f'] > 1 else None):>14}"
                     f"{_or_dash(row['compute_bound_from_batch']):>21}{100 * row['accuracy']:>9.2f}%"
                     f"{row['accuracy_points_vs_unfolded']:>+8.2f}{row['elementwise_bytes_per_image'] / 1024:>13.1f}"
                     f"{row['predicted_speedup_at_plateau']:>9.2f}x{row['speedup_at_plateau']:>15.2f}x"
                     f"{row['best_vs_best_unfolded']:>9.2f}x{row['achieved_flops_per_s_at_plateau'] / 1e9:>16.1f}"
                     f"{row['achieved_flops_per_s_at_plateau'] / machine['peak_flops_per_s']:>8.0%}")
    verdict = "met" if result["target_met"] else ("met by some f" if result["any_target_met"] else "NOT met")
    lines.append(f"# target (every folded model >= {TARGET_SPEEDUP}x at the plateau batch, accuracy within "
                 f"{TARGET_ACCURACY_POINTS:.0f} points): {verdict}")
    return lines


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def plot(result: dict, path: str) -> None:
    """Throughput vs batch (left) and arithmetic intensity vs batch with the balance (right)."""
    figure = Figure(figsize=(12, 4.5))
    left, right = figure.subplots(1, 2)
    for row in result["models"]:
        batches = [int(b) for b in row["throughput"]]
        medians = [row["throughput"][str(b)]["median"] for b in batches]
        low = [row["throughput"][str(b)]["min"] for b in batches]
        high = [row["throughput"][str(b)]["max"] for b in batches]
        line, = left.plot(batches, medians, marker="o", label=row["model"])
        left.fill_between(batches, low, high, color=line.get_color(), alpha=0.2)
        right.plot(batches, [row["intensity"][str(b)] for b in batches], marker="o", label=row["model"])
    left.axvline(result["plateau_batch"], color="grey", linestyle=":", label="unfolded plateau")
    right.axhline(result["machine"]["balance_flops_per_byte"], color="black", linestyle="--",
                  label="machine balance")
    for axes, title, ylabel in ((left, "throughput (median, min-max band)", "images/s"),
                                (right, "arithmetic intensity (analytic)", "FLOPs / byte")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("batch size (images)")
        axes.set_ylabel(ylabel)
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.suptitle("FoldedCNN on the red-square task, " + f"{result['threads']} CPU threads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
