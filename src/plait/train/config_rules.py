"""The rules a TrainConfig keeps beyond its fields' types: ranges, choices, and the
cross-field ones (the batch arithmetic, what a pipeline schedule needs of the
micro-batches, what tensor parallelism needs of the model's sizes, which algorithms
implement every collective the run calls). Each broken rule is one line naming the
values and a fix; TrainConfig reports them all at once."""

from __future__ import annotations

import dataclasses
import difflib
import math
import threading
from typing import TYPE_CHECKING

from plait.names.schedules import CHIMERA, INTERLEAVED_1F1B
from plait.names.axes import AXES
from plait.names.precision import PRECISION_FOR_REDUCE_DTYPE

MODELS = ("gpt", "mlp")  # plait's own; hf:CONFIG names a Hugging Face causal LM (TrainConfig.hf_source)

if TYPE_CHECKING:
    from plait.train.config import TrainConfig

# A step's schedule is built, replayed and held as data every step (O(microbatches · pp)
# actions); past this many micro-batches per step a run is a typo, not a plan.
MAX_MICROBATCHES = 4096
ALGORITHM_DEFAULTS = ("auto", "default", "torch")  # names every collective accepts
# The shortest deadline a run can meet: every rank's process-group set-up waits timeout_s for the others, which
# start about a second apart (each imports torch); below 1 ms torch's millisecond deadline is 0.
MIN_TIMEOUT_S = 1.0
# the comm thread waits with threading's timeouts: plait.comm.settings.MAX_TIMEOUT_S (comm is not imported here:
# it loads torch, and TrainConfig parses flags without it)
MAX_TIMEOUT_S = threading.TIMEOUT_MAX
# torch's generators take seeds below 2**64 ("Overflow when unpacking long long" past it), and the data order
# seeds one per epoch with seed * DATA_SEED_STRIDE + epoch (plait.train.data, plait.train.corpus): seeds up to
# MAX_SEED leave room for 2**63 epochs.
DATA_SEED_STRIDE = 1_000_003
MAX_SEED = (2**63 - 1) // DATA_SEED_STRIDE


def _default(config: TrainConfig, name: str):
    return next(spec.default for spec in dataclasses.fields(config) if spec.name == name)


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending: O(sqrt n), and [] above 10^14 (a message would not list them)."""
    if n < 1 or n > 10**14:
        return []
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def listed(values) -> str:
    return ", ".join(map(str, values))


def value_problems(config: TrainConfig, typed: set[str]) -> list[str]:
    """Range and cross-field checks; a field with a type problem is left out."""
    problems: list[str] = []
    c = config

    def ok(*names: str) -> bool:
        return all(name in typed for name in names)

    def at_least(name: str, low: int, meaning: str = "") -> None:
        if ok(name) and getattr(c, name) < low:
            problems.append(f"{name}={getattr(c, name)} must be >= {low}{meaning}")

    def fraction(name: str, meaning: str) -> None:
        if ok(name) and not 0.0 <= getattr(c, name) < 1.0:
            problems.append(f"{name}={getattr(c, name)} must be in [0, 1) ({meaning}), e.g. {_default(c, name)}")

    for name, choices in ((spec.name, spec.metadata["choices"]) for spec in dataclasses.fields(c)):
        if choices and ok(name) and getattr(c, name) not in choices:
            close = difflib.get_close_matches(getattr(c, name), choices, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"{name}={getattr(c, name)!r} is not valid: {hint}use one of {listed(choices)}")
            typed.discard(name)  # cross checks below assume a valid choice
    if ok("model") and c.model not in MODELS and c.hf_source is None:
        close = difflib.get_close_matches(c.model, MODELS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.append(f"model={c.model!r} is not valid: {hint}use one of {listed(MODELS)}, or hf:CONFIG (a Hugging "
                        "Face config.json or a directory holding one)")
        typed.discard("model")
    elif ok("model") and c.hf_source is not None and not c.hf_source.strip():
        problems.append("model='hf:' names no config: give hf:PATH, a Hugging Face config.json or a directory "
                        "holding one, e.g. model='hf:configs/gpt2-small'")
        typed.discard("model")
    if ok("tokenizer", "model") and c.tokenizer and c.hf_source is None:
        problems.append(f"tokenizer={c.tokenizer!r} with model={c.model!r}: tokenizers are for hf:CONFIG models "
                        "(the gpt model reads characters); leave tokenizer empty or use model=hf:CONFIG")
    # ----- single fields -----
    for name in ("layers", "hidden", "heads", "seq_len", "data_max_bytes", "global_batch", "micro_batch",
                 "dp", "tp", "pp", "virtual", "steps", "eval_batches", "log_interval"):
        at_least(name, 1)
    at_least("ffn_hidden", 0, " (0 means 4*hidden)")
    at_least("warmup_steps", 0, " (0 = no warmup)")
    at_least("eval_interval", 0, " (0 = no evaluation)")
    at_least("checkpoint_interval", 0, " (0 = checkpoint only at the end)")
    at_least("keep_checkpoints", 0, " (0 = keep all)")
    at_least("seed", 0)
    if ok("seed") and c.seed > MAX_SEED:
        problems.append(f"seed={c.seed} must be <= {MAX_SEED:,} (torch's generators take seeds below 2**64 and "
                        f"the data order uses seed * {DATA_SEED_STRIDE:,} + epoch), e.g. seed={_default(c, 'seed')}")
    fraction("dropout", "a probability")
    fraction("val_fraction", "the held-out share of the data")
    fraction("beta1", "adamw's first-moment decay")
    fraction("beta2", "adamw's second-moment decay")
    fraction("momentum", "sgd's momentum")
    if ok("mlp_hidden") and any(width < 1 for width in c.mlp_hidden):
        problems.append(f"mlp_hidden={list(c.mlp_hidden)} widths must all be >= 1, e.g. mlp_hidden=128,128,128")
    for name, what in (("data", "stdlib, digits or a path"), ("algorithm", "auto or an algorithm name"),
                       ("out", "a run directory")):
        if ok(name) and not getattr(c, name).strip():
            problems.append(f"{name}={getattr(c, name)!r} is empty: give {what}, e.g. {name}={_default(c, name)!r}")
    if ok("mesh_order") and sorted(c.mesh_order.split(",")) != sorted(AXES):
        problems.append(f"mesh_order={c.mesh_order!r} must list tp, dp and pp once each, innermost first, "
                        f"e.g. 'tp,dp,pp'")
    if ok("lr") and c.lr <= 0:
        problems.append(f"lr={c.lr} must be > 0, e.g. lr={_default(c, 'lr')}")
    if ok("min_lr") and c.min_lr < 0:
        problems.append(f"min_lr={c.min_lr} must be >= 0")
    elif ok("lr", "min_lr") and c.lr > 0 and c.min_lr > c.lr:
        problems.append(f"min_lr({c.min_lr}) > lr({c.lr}): the schedule decays from lr down to min_lr; "
                        f"use min_lr <= {c.lr} (e.g. {c.lr / 10:g})")
    for name in ("weight_decay", "grad_clip"):
        if ok(name) and getattr(c, name) < 0:
            problems.append(f"{name}={getattr(c, name)} must be >= 0" + (" (0 = off)" if name == "grad_clip" else ""))
    if ok("timeout_s") and c.timeout_s > MAX_TIMEOUT_S:
        problems.append(f"timeout_s={c.timeout_s:g} must be <= {MAX_TIMEOUT_S:.0f} seconds (the longest wait of the "
                        f"communicator's thread, threading.TIMEOUT_MAX), e.g. timeout_s={_default(c, 'timeout_s')}")
    if ok("timeout_s") and c.timeout_s < MIN_TIMEOUT_S:
        problems.append(f"timeout_s={c.timeout_s} must be >= {MIN_TIMEOUT_S:g} second (every rank's process-group "
                        f"set-up waits this long for the others, which start about a second apart: each imports "
                        f"torch; below 1 ms torch's deadline is 0 ms), e.g. timeout_s={_default(c, 'timeout_s')}")
    if ok("eval_interval", "val_fraction") and c.eval_interval > 0 and c.val_fraction == 0:
        problems.append(f"eval_interval={c.eval_interval} needs held-out data but val_fraction=0: set "
                        f"val_fraction > 0 (e.g. 0.05) or eval_interval=0")
    compressor = None
    if ok("compression") and c.compression != "none":
        from plait.compress.spec import from_spec  # imports torch; only when asked for

        try:
            compressor = from_spec(c.compression)
        except ValueError as error:
            problems.append(f"compression={c.compression!r}: {error}")
            typed.discard("compression")
        else:
            if compressor is not None and ok("dp") and c.dp == 1:
                problems.append(f"compression={c.compression!r} compresses the dp gradient all-reduce, but dp=1 "
                                f"has none: set compression=none or dp >= 2")
    if ok("algorithm", "tp", "sequence_parallel", "compression") and c.algorithm.strip() \
            and c.algorithm not in ALGORITHM_DEFAULTS:
        problems += _algorithm_problems(c, compressor)
    problems += _batch_problems(c, ok)
    problems += _model_problems(c, ok)
    return problems


def _algorithm_problems(c: TrainConfig, compressor) -> list[str]:
    """``algorithm`` must implement every collective the run calls with it: the dp
    gradient all-reduce (or the compressor's collective), and under tensor parallelism
    the all-reduces (and with sequence parallelism the all-gathers and reduce-scatters)."""
    from plait.comm.algorithms import ALGORITHMS, algorithms_for  # imports torch; only when asked for

    if c.algorithm not in ALGORITHMS:
        close = difflib.get_close_matches(c.algorithm, [*ALGORITHMS, *ALGORITHM_DEFAULTS], n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        valid = algorithms_for("all_reduce")
        return [f"algorithm={c.algorithm!r} is not a plait algorithm: {hint}use auto, torch or one of "
                f"{listed(valid)}"]
    needed = {"all_reduce": "the dp gradient all-reduce"} if compressor is None else \
        {name: f"compression={c.compression!r}" for name in compressor.collectives}
    if c.tp > 1:
        needed.setdefault("all_reduce", "tensor parallelism")
        if c.sequence_parallel:
            needed.update(all_gather="sequence parallelism", reduce_scatter="sequence parallelism")
    missing = [name for name in needed if c.algorithm not in algorithms_for(name)]
    if not missing:
        return []
    usable = [name for name in ALGORITHMS if all(name in algorithms_for(collective) for collective in needed)]
    return [f"algorithm={c.algorithm!r} has no {', '.join(missing)} (needed by "
            f"{', '.join(sorted({needed[name] for name in missing}))}): use auto, torch"
            + (f" or one of {listed(usable)}" if usable else "")]


def _batch_problems(c: TrainConfig, ok) -> list[str]:
    """global_batch / dp / micro_batch divisibility, then what the schedule needs of them."""
    if not ok("global_batch", "micro_batch", "dp") or min(c.global_batch, c.micro_batch, c.dp) < 1:
        return []
    if c.global_batch % c.dp:
        below, above = c.global_batch // c.dp * c.dp, (c.global_batch // c.dp + 1) * c.dp
        batches = listed(b for b in (below, above) if b >= 1)
        return [f"global_batch({c.global_batch}) % dp({c.dp}) = {c.global_batch % c.dp}: the dp ranks split the "
                f"global batch evenly; use global_batch in {{{batches}}} or dp in "
                f"{{{listed(divisors(c.global_batch))}}}"]
    per_rank = c.per_rank_batch
    if per_rank % c.micro_batch:
        return [f"per_rank_batch = global_batch({c.global_batch}) / dp({c.dp}) = {per_rank} is not a multiple of "
                f"micro_batch({c.micro_batch}): use micro_batch in {{{listed(divisors(per_rank))}}}"]
    if not ok("pp", "virtual", "schedule") or min(c.pp, c.virtual) < 1:
        return []
    problems = []
    m = c.microbatches
    derivation = f"microbatches = global_batch({c.global_batch}) / dp({c.dp}) / micro_batch({c.micro_batch}) = {m}"
    if m > MAX_MICROBATCHES:
        low = -(-per_rank // MAX_MICROBATCHES)
        smallest = next((d for d in divisors(per_rank) if d >= low), low)
        return [f"{derivation} exceeds the limit of {MAX_MICROBATCHES} micro-batches per step (each step builds "
                f"and runs a schedule of that length): use micro_batch >= {smallest} (a divisor of "
                f"per_rank_batch {per_rank}), or a smaller global_batch"]

    def micro_batches_where(good) -> str:
        valid = [d for d in divisors(per_rank) if good(per_rank // d)]
        return (f"use micro_batch in {{{listed(valid)}}}" if valid
                else f"no micro_batch works with per_rank_batch={per_rank}; raise global_batch")

    if c.virtual > 1 and c.schedule != INTERLEAVED_1F1B:
        problems.append(f"virtual={c.virtual} model chunks per rank apply to schedule={INTERLEAVED_1F1B!r} only, not "
                        f"{c.schedule!r}: set virtual=1 or schedule={INTERLEAVED_1F1B}")
    if c.schedule == INTERLEAVED_1F1B:
        if c.virtual < 2:
            problems.append(f"schedule={INTERLEAVED_1F1B!r} needs virtual >= 2 model chunks per pipeline rank, got "
                            f"virtual={c.virtual}: set virtual=2 (or schedule=1f1b)")
        if m % c.pp:
            problems.append(f"schedule={INTERLEAVED_1F1B!r} needs microbatches to be a multiple of pp({c.pp}), but "
                            f"{derivation}: {micro_batches_where(lambda k: k % c.pp == 0)}")
    if c.schedule == CHIMERA:
        if c.pp % 2:
            problems.append(f"schedule='chimera' runs two pipelines in opposite directions and needs an even pp, "
                            f"got pp={c.pp}: use pp={c.pp + 1 if c.pp > 1 else 2} or another schedule")
        if m % 2:
            problems.append(f"schedule='chimera' splits the micro-batches between its two pipelines and needs an "
                            f"even number, but {derivation}: {micro_batches_where(lambda k: k % 2 == 0)}")
    return problems


def example_split(total: int, chunks: int) -> str:
    """An even split of ``total`` layers into ``chunks`` counts (the earlier ones one larger), as a flag value."""
    return ",".join(str(total // chunks + (index < total % chunks)) for index in range(chunks))


def stage_layer_total(c: TrainConfig, total: int, chunks: int, what: str, source: str) -> list[str]:
    """stage_layers' count and sum against ``chunks`` = pp · virtual and the model's ``total`` layers."""
    given = ",".join(map(str, c.stage_layers))
    fix = f"e.g. stage_layers={example_split(total, chunks)}" if total >= chunks else \
        f"or fewer chunks ({total} {what} fill at most {total})"
    problems = []
    if len(c.stage_layers) != chunks:
        problems.append(f"stage_layers={given} gives {len(c.stage_layers)} pipeline chunks but pp({c.pp}) * "
                        f"virtual({c.virtual}) = {chunks}: give one count per chunk, {fix}")
    elif sum(c.stage_layers) != total:
        problems.append(f"stage_layers={given} sums to {sum(c.stage_layers)} {what} but {source} has {total}: make "
                        f"the counts add up to {total}, {fix}")
    return problems


def stage_layers_problems(c: TrainConfig, ok) -> list[str]:
    """Uneven stages: one count >= 1 per pipeline chunk (pp · virtual), summing to the
    model's layers (gpt: blocks, mlp: linears; an hf model's blocks are counted when
    its config is read: plait.train.hf_layout)."""
    if not ok("stage_layers") or not c.stage_layers:
        return []
    given = ",".join(map(str, c.stage_layers))
    small = [f"stage_layers[{index}]={count}" for index, count in enumerate(c.stage_layers) if count < 1]
    if small:
        return [f"stage_layers={given}: {', '.join(small)}; every pipeline chunk needs at least one layer "
                "(leave stage_layers empty for the balanced split)"]
    if not ok("pp", "virtual", "model") or min(c.pp, c.virtual) < 1:
        return []
    chunks = c.pp * c.virtual
    if c.model == "gpt" and ok("layers"):
        return stage_layer_total(c, c.layers, chunks, "transformer blocks", f"layers={c.layers}")
    if c.model == "mlp" and ok("mlp_hidden"):
        return stage_layer_total(c, len(c.mlp_hidden) + 1, chunks, "linear layers",
                                 f"mlp_hidden={','.join(map(str, c.mlp_hidden))}")
    if len(c.stage_layers) != chunks:  # hf: the sum is checked against its decoder blocks when its config is read
        return [f"stage_layers={given} gives {len(c.stage_layers)} pipeline chunks but pp({c.pp}) * "
                f"virtual({c.virtual}) = {chunks}: give one count of decoder blocks per chunk"]
    return []


def _model_problems(c: TrainConfig, ok) -> list[str]:
    """What the chosen model needs of tp, pp and the data."""
    problems = []
    if not ok("model"):
        return problems
    if ok("pp", "virtual") and min(c.pp, c.virtual) >= 1:
        chunks = c.pp * c.virtual
        if c.model == "gpt" and ok("layers") and c.layers < chunks:
            problems.append(f"layers({c.layers}) < pp({c.pp}) * virtual({c.virtual}) = {chunks} pipeline chunks, "
                            f"each needing at least one block: use layers >= {chunks} or fewer stages")
        linear_layers = len(c.mlp_hidden) + 1 if ok("mlp_hidden") else chunks
        if c.model == "mlp" and linear_layers < chunks:
            problems.append(f"mlp_hidden={list(c.mlp_hidden)} gives {linear_layers} linear layers < pp({c.pp}) * "
                            f"virtual({c.virtual}) = {chunks} pipeline chunks: give mlp_hidden >= {chunks - 1} "
                            f"widths or fewer stages")
    problems += stage_layers_problems(c, ok)
    if ok("precision", "dtype") and c.precision != "fp32" and c.dtype != "float32":
        problems.append(f"precision={c.precision!r} with dtype={c.dtype!r}: mixed precision keeps fp32 master "
                        "weights; set dtype=float32 (the parameters' type) or precision=fp32")
    if ok("precision", "grad_reduce_dtype") and c.grad_reduce_dtype != "fp32" and \
            c.precision != PRECISION_FOR_REDUCE_DTYPE[c.grad_reduce_dtype]:
        wanted = PRECISION_FOR_REDUCE_DTYPE[c.grad_reduce_dtype]
        problems.append(f"grad_reduce_dtype={c.grad_reduce_dtype!r} with precision={c.precision!r}: gradients are "
                        f"reduced in the compute dtype only; use precision={wanted} or grad_reduce_dtype=fp32")
    if ok("grad_reduce_dtype", "compression") and c.grad_reduce_dtype != "fp32" and c.compression != "none":
        problems.append(f"grad_reduce_dtype={c.grad_reduce_dtype!r} with compression={c.compression!r}: the "
                        "compressor decides what is sent; leave grad_reduce_dtype=fp32")
    if ok("zero_stage"):
        z = c.zero_stage
        if z not in (0, 1, 2, 3):
            problems.append(f"zero_stage={z} is not valid: 0 (off), 1, 2 or 3")
        elif z == 3 and ok("pp") and c.pp > 1:
            problems.append(f"zero_stage=3 with pp={c.pp}: stage 3 gathers each block's parameters around its "
                            "forward and backward and drops its gradients inside the backward, but a pipeline sums "
                            "the gradients of parameters its stages share after the backward; use pp=1 with "
                            "zero_stage=3, or zero_stage <= 2 with a pipeline")
        elif z == 3 and ok("offload_activations") and c.offload_activations:
            problems.append("zero_stage=3 with offload_activations=true: the activation offloader would move the "
                            "gathered parameters autograd keeps for the backward to files; use one of the two")
        if z in (1, 2, 3):
            if ok("schedule") and c.schedule == CHIMERA:
                problems.append(f"zero_stage={z} with schedule='chimera': Chimera keeps two replicas of every stage, "
                                "summed outside the dp group; use another schedule or zero_stage=0")
            if ok("compression") and c.compression != "none":
                problems.append(f"zero_stage={z} with compression={c.compression!r}: ZeRO reduce-scatters the exact "
                                "gradients; set compression=none or zero_stage=0")
            if ok("grad_reduce_dtype") and c.grad_reduce_dtype != "fp32":
                problems.append(f"zero_stage={z} with grad_reduce_dtype={c.grad_reduce_dtype!r}: ZeRO reduces in the "
                                "parameters' dtype; set grad_reduce_dtype=fp32")
        if ok("offload") and c.offload == "optimizer" and z == 0:
            problems.append("offload='optimizer' with zero_stage=0: the offloaded state is ZeRO's shards; set "
                            "zero_stage 1, 2 or 3 (or offload=none)")
    if ok("recompute_layers") and c.recompute_layers < -1:
        problems.append(f"recompute_layers={c.recompute_layers}: give a block count >= 0, or -1 for every block")
    if c.model == "mlp":
        if ok("recompute") and c.recompute != "none":
            problems.append(f"recompute={c.recompute!r} with model='mlp': recomputation re-runs the GPT's "
                            "transformer blocks and the MLP has none; set recompute=none (or model=gpt)")
        if ok("tp") and c.tp != 1:
            problems.append(f"tp={c.tp} with model='mlp': tensor parallelism is for the GPT; set tp=1 or model=gpt")
        if ok("sequence_parallel") and c.sequence_parallel:
            problems.append("sequence_parallel=true with model='mlp': sequence parallelism is for the GPT; "
                            "set sequence_parallel=false")
        if ok("data") and c.data != "digits":
            problems.append(f"data={c.data!r} with model='mlp': the MLP trains on scikit-learn's digits; "
                            f"set data=digits (or model=gpt)")
        return problems
    if c.hf_source is not None:  # its sizes are the HF config's: checked when it is read (plait.train.hf_model)
        if ok("data") and c.data == "digits":
            problems.append(f"data='digits' with model={c.model!r}: digits is the MLP's image data set; give text "
                            "(a file or directory, JSONL, Parquet, Arrow) or stdlib")
        if ok("tied_head") and c.tied_head:
            problems.append(f"tied_head=true with model={c.model!r}: a HF model's tying is its config's "
                            "tie_word_embeddings; leave tied_head=false")
        fixed = [name for name in ("layers", "hidden", "heads", "ffn_hidden", "dropout", "mlp_hidden")
                 if ok(name) and getattr(c, name) != _default(c, name)]
        if fixed:
            problems.append(f"{', '.join(f'{name}={getattr(c, name)!r}' for name in fixed)} with model={c.model!r}: "
                            "the HF config fixes the architecture (its sizes and dropouts); edit its config.json "
                            "and leave these at their defaults")
        if ok("pp", "sequence_parallel") and c.pp > 1 and c.sequence_parallel:
            problems.append(f"sequence_parallel=true with model={c.model!r} and pp={c.pp}: the automatic split "
                            "traces the model once, and sequence parallelism's scatter and gather run between its "
                            "calls (they would be fixed into the graph); use sequence_parallel with pp=1, or pp "
                            "without it")
        if ok("pp", "eval_interval") and c.pp > 1 and c.eval_interval > 0:
            problems.append(f"eval_interval={c.eval_interval} with model={c.model!r} and pp={c.pp}: the automatic "
                            "split's stages are traced for the training micro-batch and mode, and evaluation runs "
                            "the whole batch in eval mode; set eval_interval=0 (or pp=1)")
        return problems
    # ----- gpt -----
    if ok("data") and c.data == "digits":
        problems.append("data='digits' with model='gpt': digits is the MLP's image data set; use data=stdlib, a "
                        "text file or directory, or model=mlp")
    if ok("tied_head", "pp") and c.tied_head and c.pp > 1:
        problems.append(f"tied_head=true with pp({c.pp}) > 1: the embedding (first stage) and the head (last "
                        f"stage) would live on different stages; set tied_head=false (or pp=1)")
    if not ok("hidden", "heads", "ffn_hidden", "tp", "seq_len", "sequence_parallel") or min(
            c.hidden, c.heads, c.tp, c.seq_len) < 1 or c.ffn_hidden < 0:
        return problems
    if c.hidden % c.heads:
        problems.append(f"hidden({c.hidden}) % heads({c.heads}) = {c.hidden % c.heads}: each head takes "
                        f"hidden/heads channels; use heads in {{{listed(divisors(c.hidden)[:8])}}}"
                        f"{', ...' if len(divisors(c.hidden)) > 8 else ''} or hidden a multiple of {c.heads}")
    sizes = {"heads": c.heads, "ffn": c.ffn} | ({"seq_len": c.seq_len} if c.sequence_parallel else {})
    valid_tp = listed(divisors(math.gcd(*sizes.values())))
    why = {"heads": "attention heads are split across tp ranks",
           "ffn": "the MLP's inner width (ffn_hidden, 0 = 4*hidden) is split across tp ranks",
           "seq_len": "sequence parallelism splits the sequence across tp ranks"}
    for name, size in sizes.items():
        if size % c.tp:
            problems.append(f"{name}({size}) % tp({c.tp}) = {size % c.tp}: {why[name]}; use tp in {{{valid_tp}}}")
    return problems
