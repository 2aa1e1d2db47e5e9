"""What a ``plait train`` run needs of the machine, known before any process starts.

Per process (a lower bound: what it cannot run without):

    base      interpreter + torch + gloo                         BASE_PROCESS_BYTES
    state     (weights + gradients + optimizer state) of the     e · P_rank · (2 + k)
              pipeline rank holding the most parameters           k = 2 AdamW, 1 SGD+momentum, 0 SGD
    one       the activations one micro-batch keeps for its       plait.plan's "plait" accounting
    micro-    backward in that rank's chunks (even 1F1B keeps     (the eager GPT's saved tensors)
    batch     at least one)
    batch     this rank's token ids, inputs and targets           2 · 8 · per_rank_batch · seq_len
    data      the corpus every rank holds                         train + val ids

P_rank counts the GPT's layers at this tensor-parallel degree as the planner does
(plait.plan.TransformerSpec: vocab-parallel embedding and head, block matrices split
t ways, LayerNorms replicated), split into pipeline chunks as plait train splits them.
On CPU every local process draws on the same memory: processes × need ≤ available.
On GPU state and activations must fit each device, the rest the host.

A checkpoint holds every parameter once and its optimizer state: e · P · (1 + k)
bytes (``checkpoint_bytes``); the launcher wants that much free disk under --out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from plait.names.schedules import INTERLEAVED_1F1B
from plait.parallel.pipeline import build
from plait.plan.transformer import TransformerSpec
from plait.train.config import TrainConfig

BASE_PROCESS_BYTES = 256 << 20  # measured: a gloo rank with torch and plait imported peaks at ~224 MiB
TOKEN_ID_BYTES = 8
ELEMENT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
GIB = float(1 << 30)


@dataclass(frozen=True)
class ProcessNeed:
    """Bytes one process needs (module docstring), for the rank with the most parameters."""

    parameters: int
    state_bytes: int
    activation_bytes: float
    batch_bytes: int
    data_bytes: int

    @property
    def device_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes + self.batch_bytes

    @property
    def host_bytes(self) -> float:
        return BASE_PROCESS_BYTES + self.data_bytes

    def describe(self) -> str:
        return (f"{self.parameters:,} parameters on the largest rank -> {_gib(self.state_bytes)} of weights, gradients "
                f"and optimizer state, {_gib(self.activation_bytes)} of activations for one micro-batch, "
                f"{_gib(self.batch_bytes)} of batch, {_gib(self.data_bytes)} of data, {_gib(BASE_PROCESS_BYTES)} "
                f"of runtime")


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB" if nbytes >= 1 << 26 else f"{nbytes / (1 << 20):.3g} MiB"


def optimizer_states(config: TrainConfig) -> int:
    """Tensors of optimizer state per parameter: AdamW's two moments, SGD's momentum."""
    if config.optimizer == "adamw":
        return 2
    return 1 if config.momentum > 0 else 0


def _spec(config: TrainConfig, vocab: int):
    return TransformerSpec(layers=config.layers, hidden=config.hidden, heads=config.heads, seq_len=config.seq_len,
                           vocab=vocab, ffn_hidden=config.ffn_hidden, tied_head=config.tied_head,
                           dropout=config.dropout > 0)


def layer_parameters(config: TrainConfig, vocab: int, tp: int = 1) -> list[int]:
    """Parameters of each sequential layer on one tensor-parallel rank (tp=1: the
    whole model): [embedding, block 0..l-1, head] for the GPT, the linears for the MLP."""
    if config.model == "mlp":
        sizes = [64, *config.mlp_hidden, 10]
        return [a * b + b for a, b in zip(sizes, sizes[1:])]
    spec = _spec(config, vocab)
    h = config.hidden
    vocab_rows = spec.padded_vocab(tp) // tp if tp > 1 else vocab
    embedding = vocab_rows * h + config.seq_len * h
    head = 2 * h + (0 if config.tied_head else vocab_rows * h)
    block = spec.block_parameters_per_rank(tp) if tp > 1 else spec.block_parameters()
    return [embedding] + [block] * config.layers + [head]


def chunk_layer_counts(config: TrainConfig) -> list[int] | None:
    """--stage-layers in the model's sequential layers (plait.parallel.pipeline's
    ``split_layers(balance=...)``): the GPT's layers are [embedding, block 0..l-1, head],
    so its first chunk takes one more (the embedding) and its last one more (the head);
    the MLP's are its linears. None: no stage_layers, or one chunk (nothing to choose)."""
    if len(config.stage_layers) < 2:
        return None
    sizes = list(config.stage_layers)
    if config.model == "gpt":
        sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] + 1
    return sizes


def chunk_bounds(config: TrainConfig, counts: list[int]) -> list[int]:
    """Boundaries [0 = b_0 < ... < b_C = len(counts)] of the C = pp · virtual chunks over
    the sequential layers whose parameters are ``counts``: --stage-layers' when given,
    else balanced by parameters (the min-max split, partition.balanced_boundaries)."""
    from plait.parallel.pipeline.partition import balanced_boundaries

    virtual = config.virtual if config.schedule == INTERLEAVED_1F1B else 1
    sizes = chunk_layer_counts(config)
    if sizes is None:
        return balanced_boundaries([float(count) for count in counts], config.pp * virtual)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    assert bounds[-1] == len(counts), (sizes, len(counts))  # TrainConfig checked the sum
    return bounds


def chunks_of_ranks(config: TrainConfig, counts: list[int]) -> list[list[int]]:
    """For each pipeline rank, the layer indices of the chunks it holds (the split
    plait train makes: --stage-layers', or balanced by parameters into pp · virtual chunks)."""
    virtual = config.virtual if config.schedule == INTERLEAVED_1F1B else 1
    # which chunks a rank holds does not depend on the number of micro-batches: build a short schedule
    microbatches = min(config.microbatches, 2 * config.pp)
    schedule = build(config.schedule, config.pp, microbatches, virtual if virtual > 1 else None)
    bounds = chunk_bounds(config, counts)
    return [[index for _, stage in schedule.stages_of(rank) for index in range(bounds[stage], bounds[stage + 1])]
            for rank in range(config.pp)]


def process_need(config: TrainConfig, data) -> ProcessNeed:
    """The need of the process with the most parameters (module docstring)."""
    vocab = data.vocab_size if config.model == "gpt" else 10
    element = ELEMENT_BYTES[config.dtype]
    counts = layer_parameters(config, vocab, config.tp)
    per_rank = chunks_of_ranks(config, counts)
    parameters = max(sum(counts[index] for index in held) for held in per_rank)
    state = element * parameters * (2 + optimizer_states(config))
    activations = 0.0
    if config.model == "gpt":
        spec, mb, tp, sp = _spec(config, vocab), config.micro_batch, config.tp, config.sequence_parallel
        kwargs = dict(tp=tp, sequence_parallel=sp, element_bytes=element, accounting="plait")
        per_layer = ([spec.embedding_activation_bytes(mb, **kwargs)]
                     + [spec.block_activation_bytes(mb, **kwargs)] * config.layers
                     + [spec.head_activation_bytes(mb, **kwargs)])
        activations = max(sum(per_layer[index] for index in held) for held in per_rank)
        batch_bytes = 2 * TOKEN_ID_BYTES * config.per_rank_batch * config.seq_len
        data_bytes = (data.train.numel() + data.val.numel()) * data.train.element_size()
    else:
        widest = max([64, *config.mlp_hidden])
        activations = 2.0 * element * config.micro_batch * widest * (len(config.mlp_hidden) + 1)
        batch_bytes = element * config.per_rank_batch * 64
        data_bytes = sum(tensor.numel() * tensor.element_size() for split in data for tensor in (split.inputs, split.labels))
    return ProcessNeed(parameters=parameters, state_bytes=state, activation_bytes=activations,
                       batch_bytes=batch_bytes, data_bytes=data_bytes)


def checkpoint_bytes(config: TrainConfig, data) -> int:
    """Bytes of one checkpoint: every parameter once, with its optimizer state."""
    vocab = data.vocab_size if config.model == "gpt" else 10
    parameters = sum(layer_parameters(config, vocab))
    return ELEMENT_BYTES[config.dtype] * parameters * (1 + optimizer_states(config))


def available_memory_bytes() -> int:
    """Memory a new process can have: MemAvailable, or the cgroup's remaining limit if lower."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            usage = int(Path("/sys/fs/cgroup", usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            available = min(available, int(limit) - usage)
    return available


def check_fits(config: TrainConfig, data, *, local_processes: int, gpu_memory_bytes: int | None = None,
               available_bytes: int | None = None) -> ProcessNeed:
    """Raise ValueError, naming the need and the limit, if the run cannot fit this
    machine; returns the need. ``gpu_memory_bytes``: each device's memory (CUDA runs)."""
    need = process_need(config, data)
    available = available_memory_bytes() if available_bytes is None else available_bytes
    fixes = ("use a smaller model (--layers, --hidden, --seq-len) or micro-batch, split it over more pipeline or "
             "tensor-parallel ranks, or run on more machines")
    if gpu_memory_bytes is not None:
        if need.device_bytes > gpu_memory_bytes:
            raise ValueError(f"the model does not fit one GPU: it needs at least {_gib(need.device_bytes)} per "
                             f"device ({need.describe()}), the device has {_gib(gpu_memory_bytes)}; {fixes}")
        host = local_processes * need.host_bytes
    else:
        host = local_processes * (need.host_bytes + need.device_bytes)
    if host > available:
        raise ValueError(f"{local_processes} processes need at least {_gib(host)} of memory together but "
                         f"{_gib(available)} is available: each needs {_gib(host / local_processes)} "
                         f"({need.describe()}); {fixes}")
    return need
