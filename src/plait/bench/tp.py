"""`plait bench tp`: forward+backward time of a small GPT under Megatron tensor
parallelism, the share of it spent communicating, and the bytes one transformer
layer sends measured against the formula.

Every rank of a world of exactly tp processes runs ``run_tp_bench``:

1. Step time. ``warmup`` + ``steps`` forward+backward passes of ``GPT(config, tp)``
   (no optimizer; gradients zeroed each step) on token batches drawn before the
   clock starts from one seeded generator, the same on every rank. Each timed step
   starts after a barrier. comm = the step's increase of Σ_collectives
   ``plait.comm.stats()[c]["time_s"]``: the layers run their collectives inside
   forward and backward, synchronously but for the column-parallel layers' backward
   all-reduce of dX, which runs while dW is computed (plait.parallel.tensor.linear_ops);
   so comm is time on the critical path (waiting for a slower peer included; the comm
   layer's per-call argument check, when on, is not in it) plus the part of those
   backward all-reduces hidden behind dW, and compute = step - comm is a lower bound.
   Reported: the median over steps of step time, comm time and comm/step, each then
   averaged over ranks.
2. Bytes per layer. ``blocks[0]`` alone on a random (s, b, h) input ((s/p, b, h)
   under sequence parallelism): one forward, then one backward of a random output
   gradient, with the counters reset around each; calls and bytes sent per
   collective, mean over ranks. The formula (Megatron-LM; DESIGN §6), n = b·s·h:

       forward   2 all-reduces of n   (g after attention and after the MLP)
       backward  2 all-reduces of n   (f at their inputs)

   Under sequence parallelism each all-reduce becomes a reduce-scatter of n (the
   row-parallel output) + an all-gather of n (the next column-parallel input), both
   ways, and backward adds one all-reduce of the 6h LayerNorm and bias gradients
   (two LayerNorms' 4h + the two row-parallel biases' 2h) summed over the shard.
   What one call sends is read off the schedule of the algorithm that ran
   (``Schedule.sent_numel``, mean over ranks, times the element size e): e.g. ring
   or star 2(p-1)/p·n·e per all-reduce. So measured/formula is exactly 1 when the
   comm layer sends what its schedules say and the layer makes the calls Megatron
   prescribes. The payload, 4·n·e, is what the four all-reduces carry.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait import comm
from plait.comm.algorithms import DEFAULT_NAMES, TORCH, build_schedule, builder
from plait.comm.algorithms.hierarchical import parse_hierarchy
from plait.comm.choice import auto_algorithm
from plait.cost.alpha_beta import pipeline_segments
from plait.models.gpt import GPT, GPTConfig
from plait.parallel.tensor import new_tensor_parallel

# The collectives tensor parallelism makes; the counters are read in this order on every rank.
TP_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
COUNTED = TP_COLLECTIVES + tuple(c for c in comm.COLLECTIVES if c not in TP_COLLECTIVES)
PHASES = ("forward", "backward")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, kw_only=True)
class TpBenchConfig:
    """Flags of `plait bench tp` (one field per flag). ``tp``: the degrees to run,
    each in a fresh world of that many processes."""

    tp: tuple[int, ...] = (1, 2, 4)
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    seq_len: int = 128
    batch: int = 8
    vocab: int = 1001  # divisible by neither 2 nor 4: the vocabulary is padded
    dtype: str = "float32"
    steps: int = 10
    warmup: int = 2
    algorithm: str = "auto"
    sequence_parallel: bool = False
    check_args: bool = False
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        problems = []
        tp_ok = isinstance(self.tp, tuple) and len(self.tp) > 0 and all(map(_is_positive_int, self.tp))
        if not tp_ok:
            problems.append(f"tp={self.tp!r} must be a non-empty list of positive ints, e.g. --tp 1,2,4")
        elif len(set(self.tp)) != len(self.tp):
            problems.append(f"tp={','.join(map(str, self.tp))} lists a degree twice: give each once")
        for name in ("batch", "steps"):
            if not _is_positive_int(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)} must be an int >= 1")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            problems.append(f"warmup={self.warmup} must be an int >= 0")
        if not self.timeout_s > 0:
            problems.append(f"timeout_s={self.timeout_s} must be > 0")
        try:
            model = self.gpt_config()
        except ValueError as error:
            problems.append(str(error))
            model = None
        if model is not None and tp_ok:
            for degree in self.tp:
                try:
                    model.check_tensor_parallel(degree)
                except ValueError as error:
                    problems.append(str(error))
                if self.sequence_parallel and self.seq_len % degree:
                    multiple = math.lcm(*self.tp)
                    problems.append(f"sequence parallelism splits seq_len={self.seq_len} over tp={degree} ranks: "
                                    f"use a seq_len that is a multiple of {multiple}")
        if not isinstance(self.algorithm, str):
            problems.append(f"algorithm={self.algorithm!r} must be a name such as 'auto', 'ring' or 'torch'")
        elif self.algorithm not in DEFAULT_NAMES and self.algorithm != TORCH:
            for collective in self.collectives():
                try:
                    builder(collective, self.algorithm)
                except ValueError as error:
                    problems.append(f"algorithm={self.algorithm!r}: {error}")
                    break
        if problems:
            raise ValueError("; ".join(problems))

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(layers=self.layers, hidden=self.hidden, heads=self.heads, seq_len=self.seq_len,
                         vocab=self.vocab, dtype=self.dtype)

    def collectives(self) -> tuple[str, ...]:
        """The collectives the model runs with ``algorithm`` (all of them must have it)."""
        return TP_COLLECTIVES if self.sequence_parallel else ("all_reduce",)

    @property
    def layer_numel(self) -> int:
        """n = b·s·h: the elements of one layer's activation, what each all-reduce carries."""
        return self.batch * self.seq_len * self.hidden

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.gpt_config().torch_dtype).element_size()


# ----- the formula ---------------------------------------------------------------------------
def layer_formula(config: TpBenchConfig, tp_size: int) -> dict[str, list[tuple[str, int]]]:
    """Per phase, the calls one transformer layer makes: (collective, elements of the
    collective's buffer: the all-reduced tensor, the all-gather's output, the
    reduce-scatter's input). None at tp = 1."""
    if tp_size == 1:
        return {phase: [] for phase in PHASES}
    n = config.layer_numel
    pair = [("all_gather", n), ("reduce_scatter", n)] if config.sequence_parallel else [("all_reduce", n)]
    # sequence parallel: the 4h LayerNorm + 2h bias gradients of the shard, one all-reduce
    extra = [("all_reduce", 6 * config.hidden)] if config.sequence_parallel else []
    return {"forward": pair * 2, "backward": pair * 2 + extra}


def call_bytes_sent(collective: str, algorithm: str, world_size: int, numel: int, itemsize: int) -> float:
    """Bytes one call sends per rank, mean over ranks, as plait.comm runs it: the
    schedule of ``algorithm`` (with the comm layer's pipelining segments),
    Σ_r sent_numel(r) / p · itemsize. torch reports no traffic: plait.comm counts its
    payload, numel · itemsize."""
    if world_size == 1:
        return 0.0
    nbytes = numel * itemsize
    if algorithm == TORCH:
        return float(nbytes)
    defaults = comm.CommConfig()  # the tensor-parallel group's communicator runs with these
    segments = pipeline_segments(nbytes, defaults.pipeline_segment_bytes)
    # as plait.comm.collectives does for a group that is not WORLD (a tensor-parallel group)
    hierarchy = parse_hierarchy(defaults.hierarchy, world_size, 1) if algorithm == "hierarchical" else None
    schedule = build_schedule(collective, algorithm, world_size, numel, None, segments, hierarchy)
    return sum(schedule.sent_numel(rank) for rank in range(world_size)) * itemsize / world_size


def predict_layer(config: TpBenchConfig, tp_size: int, ran: dict[str, dict]) -> dict[str, list[dict]]:
    """The formula's calls priced with the algorithm each collective ran in that phase
    (``ran[phase][collective]["algorithms"]``; what auto would pick if it did not run)."""
    result = {}
    for phase, calls in layer_formula(config, tp_size).items():
        priced = []
        for collective, numel in calls:
            counts = ran.get(phase, {}).get(collective, {}).get("algorithms") or {}
            algorithm = max(counts, key=counts.get) if counts else config.algorithm
            if algorithm in DEFAULT_NAMES:
                algorithm = auto_algorithm(collective, numel * config.itemsize, tp_size)
            priced.append({"collective": collective, "numel": numel, "algorithm": algorithm,
                           "bytes_sent": call_bytes_sent(collective, algorithm, tp_size, numel, config.itemsize)})
        result[phase] = priced
    return result


# ----- measurement (every rank) --------------------------------------------------------------
def _mean_over_ranks(values: list[float]) -> list[float]:
    """Bytes differ by rank (a star's root sends p-1 times what a leaf does)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def _counters() -> tuple[list[int], list[int], float]:
    """(calls per COUNTED collective, bytes sent per collective, Σ time_s) on this rank."""
    stats = comm.stats()
    calls = [stats.get(name, {}).get("calls", 0) for name in COUNTED]
    sent = [stats.get(name, {}).get("bytes_sent", 0) for name in COUNTED]
    return calls, sent, sum(entry["time_s"] for entry in stats.values())


def _token_batches(config: TpBenchConfig, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (tokens, next tokens) pairs of (b, s), the same on every rank."""
    generator = torch.Generator().manual_seed(config.seed)
    batches = []
    for _ in range(count):
        sequence = torch.randint(0, config.vocab, (config.batch, config.seq_len + 1), generator=generator)
        batches.append((sequence[:, :-1], sequence[:, 1:]))
    return batches


def _step(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens, targets)
    loss.backward()
    return loss.detach()


def measure_steps(model: GPT, config: TpBenchConfig) -> dict:
    """Median step / comm time and comm fraction over the timed steps (this rank), the
    calls and bytes per step per collective, and the first timed step's loss."""
    batches = _token_batches(config, config.warmup + config.steps)
    for tokens, targets in batches[: config.warmup]:
        _step(model, tokens, targets)
    step_s, comm_s, losses = [], [], []
    for tokens, targets in batches[config.warmup:]:
        dist.barrier()  # torch's own: not in plait.comm's counters
        calls_before, sent_before, comm_before_s = _counters()
        start_s = time.perf_counter()
        losses.append(_step(model, tokens, targets))
        step_s.append(time.perf_counter() - start_s)
        calls_after, sent_after, comm_after_s = _counters()
        comm_s.append(comm_after_s - comm_before_s)
    return {"step_s": statistics.median(step_s), "comm_s": statistics.median(comm_s),
            "fraction": statistics.median(c / s for c, s in zip(comm_s, step_s)),
            "calls": [a - b for a, b in zip(calls_after, calls_before)],
            "sent": [a - b for a, b in zip(sent_after, sent_before)],
            "loss": losses[0].item(), "step_s_all": step_s}


def measure_layer(model: GPT, config: TpBenchConfig) -> dict[str, tuple[list[int], list[int], dict]]:
    """blocks[0] alone: per phase (calls, bytes sent per COUNTED collective, this
    rank's plait.comm.stats())."""
    tp, block = model.tp, model.blocks[0]
    s, b, h = config.seq_len, config.batch, config.hidden
    generator = torch.Generator().manual_seed(config.seed + 1)
    dtype = config.gpt_config().torch_dtype
    x, grad = (torch.randn(s, b, h, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    if tp.sequence_parallel:  # this rank's (s/p, b, h) shard of the sequence
        rows = s // tp.size
        x, grad = x[tp.rank * rows:(tp.rank + 1) * rows], grad[tp.rank * rows:(tp.rank + 1) * rows]
    x = x.clone().requires_grad_()
    result = {}
    comm.reset_stats()
    out = block(x, s)
    result["forward"] = (*_counters()[:2], comm.stats())
    comm.reset_stats()
    out.backward(grad)
    result["backward"] = (*_counters()[:2], comm.stats())
    comm.reset_stats()
    block.zero_grad(set_to_none=True)
    return result


def _by_collective(values: list[float]) -> dict[str, float]:
    return {name: value for name, value in zip(COUNTED, values) if value}


def run_tp_bench(config: TpBenchConfig, *, device=None, emit=None) -> list[dict]:
    """Each rank's part at tp = world size; rank 0 emits ("row", dict) and returns it."""
    del device  # the GPT runs on the CPU here (gloo); a GPU run is left for later
    rank, tp_size = dist.get_rank(), dist.get_world_size()
    tp = new_tensor_parallel(tp_size, algorithm=config.algorithm, sequence_parallel=config.sequence_parallel,
                             check_args=config.check_args)
    model = GPT(config.gpt_config(), tp, seed=config.seed)
    steps = measure_steps(model, config)
    layer = measure_layer(model, config)
    k = len(COUNTED)
    means = _mean_over_ranks([steps["step_s"], steps["comm_s"], steps["fraction"], *steps["sent"],
                              *layer["forward"][1], *layer["backward"][1]])
    step_s, comm_s, fraction = means[:3]
    sent_per_step, layer_sent = means[3:3 + k], {"forward": means[3 + k:3 + 2 * k], "backward": means[3 + 2 * k:]}
    measured = {phase: {name: {"calls": calls, "bytes_sent": layer_sent[phase][i],
                               "algorithms": layer[phase][2].get(name, {}).get("algorithms", {})}
                        for i, (name, calls) in enumerate(zip(COUNTED, layer[phase][0])) if calls}
                for phase in PHASES}
    predicted = predict_layer(config, tp_size, measured)
    bytes_measured = sum(entry["bytes_sent"] for phase in PHASES for entry in measured[phase].values())
    bytes_formula = sum(call["bytes_sent"] for phase in PHASES for call in predicted[phase])
    row = {
        "tp": tp_size, "sequence_parallel": config.sequence_parallel, "check_args": config.check_args,
        "algorithm": config.algorithm,
        "step_ms": 1e3 * step_s, "comm_ms": 1e3 * comm_s, "compute_ms": 1e3 * (step_s - comm_s),
        "comm_fraction": fraction, "loss": steps["loss"],
        "rank0_step_ms": [1e3 * value for value in steps["step_s_all"]],
        "calls_per_step": _by_collective(steps["calls"]), "bytes_per_step": _by_collective(sent_per_step),
        "layer": measured, "layer_formula": predicted,
        "calls_per_layer": {phase: {name: entry["calls"] for name, entry in measured[phase].items()}
                            for phase in PHASES},
        "calls_per_layer_formula": {phase: _count(call["collective"] for call in predicted[phase])
                                    for phase in PHASES},
        "bytes_per_layer": bytes_measured, "bytes_per_layer_formula": bytes_formula,
        "bytes_ratio": bytes_measured / bytes_formula if bytes_formula else None,
        "payload_per_layer": 4 * config.layer_numel * config.itemsize if tp_size > 1 else 0,
    }
    if rank == 0 and emit:
        emit("row", row)
    return [row]


def _count(names) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts
