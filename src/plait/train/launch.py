"""What `plait train` does before starting processes: data cache, layout, resume check."""

from __future__ import annotations

from pathlib import Path

from plait.parallel.mesh import ParallelDims
from plait.train.config import TrainConfig


def prepare_data(config: TrainConfig):
    """Load (tokenise and cache, the first time) the data once in the launcher, so
    the ranks only read the cache; errors about the data path surface here."""
    from plait.train.loop import load_data

    return load_data(config)


def layer_parameter_counts(config: TrainConfig, data) -> tuple[list[str], list[int]]:
    """Names and parameter counts of the model's sequential layers, from the config
    alone (nothing is built): what split_layers(balance="params") balances."""
    if config.model == "gpt":
        h, v, ffn = config.hidden, data.vocab_size, config.ffn
        block = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h
        names = ["embedding"] + [f"block {i}" for i in range(config.layers)] + ["head"]
        head = 2 * h + (0 if config.tied_head else v * h)  # final LayerNorm (+ the untied head matrix)
        return names, [v * h + config.seq_len * h] + [block] * config.layers + [head]
    sizes = [64, *config.mlp_hidden, 10]
    return [f"linear {i}" for i in range(len(sizes) - 1)], [a * b + b for a, b in zip(sizes, sizes[1:])]


def describe_layout(config: TrainConfig, data) -> str:
    """The mesh (which rank holds which stage and tp shard), the schedule and the
    batch arithmetic: what --dry-run prints."""
    from plait.parallel.pipeline import build
    from plait.parallel.pipeline.partition import balanced_boundaries

    dims = ParallelDims(dp=config.dp, tp=config.tp, pp=config.pp, order=config.mesh_order)
    virtual = config.virtual if config.schedule == "interleaved_1f1b" else 1
    schedule = build(config.schedule, config.pp, config.microbatches,
                     virtual if config.schedule == "interleaved_1f1b" else None)
    names, counts = layer_parameter_counts(config, data)
    bounds = balanced_boundaries([float(c) for c in counts], config.pp * virtual)
    chunk_text = []
    for start, end in zip(bounds, bounds[1:]):
        chunk_text.append(names[start] if end - start == 1 else f"{names[start]}..{names[end - 1]}")
    stage_layers = {}
    for pp_rank in range(config.pp):
        held = [f"chunk {stage} [{chunk_text[stage]}]" + (" (replica)" if replica else "")
                for replica, stage in schedule.stages_of(pp_rank)]
        stage_layers[pp_rank] = ", ".join(held)
    lines = [dims.describe(stage_layers, " of every matrix" if config.model == "gpt" else ""), ""]
    model = (f"GPT layers={config.layers} hidden={config.hidden} heads={config.heads} seq_len={config.seq_len} "
             f"vocab={data.vocab_size}: {sum(counts):,} parameters" if config.model == "gpt"
             else f"MLP {[64, *config.mlp_hidden, 10]}: {sum(counts):,} parameters")
    lines += [f"model     {model}",
              f"schedule  {config.schedule}" + (f" (virtual={virtual})" if virtual > 1 else "")
              + f", {config.microbatches} micro-batches of {config.micro_batch} per dp rank",
              f"batch     global {config.global_batch} = dp {config.dp} x per-rank {config.per_rank_batch}"
              + (f" sequences of {config.seq_len} tokens" if config.model == "gpt" else " samples"),
              f"data      {getattr(data, 'source', config.data)}",
              f"output    {config.out}"]
    return "\n".join(lines)


def check_resume_choice(config: TrainConfig, resume: str, data) -> None:
    """Before any process starts: --resume never into a directory that already
    holds checkpoints would mix two runs' (refused); the checkpoint a run would
    resume from must verify and be of the same model (the differing fields named)."""
    from plait.train import checkpoint as ckpt
    from plait.train.loop import model_description

    out = Path(config.out)
    if resume == "never":
        if out.exists() and ckpt.list_checkpoints(out):
            raise ValueError(f"--resume never but {out} already holds checkpoints: choose a new --out, delete "
                             f"{out / 'checkpoints'}, or use --resume auto to continue")
        return
    if resume == "auto":
        path = ckpt.latest_complete(out) if out.exists() else None
        if path is None:
            return
    else:
        path = Path(resume)
        problems = ckpt.verify(path)
        if problems:
            raise ValueError(f"--resume {resume}: " + "; ".join(problems))
    ckpt.check_compatible(ckpt.read_manifest(path), model_description(config, data))
