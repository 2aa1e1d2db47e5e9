"""`plait bench hf`: tokens/s of training a Llama-style Hugging Face model
(``LlamaForCausalLM`` built from a ``LlamaConfig`` in code: RMSNorm, SwiGLU MLP, rotary
embeddings, grouped-query attention; float32; nothing downloaded) with plait against
torch's own stack, in one world of N gloo processes, on the same model and data.

Layouts and their sides (plait first, its torch peer second):

  dp     plait-dp     plait.parallel.DataParallel
         torch-ddp    torch.nn.parallel.DistributedDataParallel
  zero3  plait-zero3  plait.parallel.ZeRO stage 3, units: the embedding and each decoder layer
         torch-fsdp2  torch's fully_shard on the same units, then the root (reshard after forward)
  tp     plait-tp     plait.parallel.tensor.parallelize with the Llama plan (plait.parallel.tensor.llama)
         torch-tp     torch.distributed.tensor.parallel.parallelize_module over a 1-D DeviceMesh with
                      ColwiseParallel (q, k, v, gate, up) / RowwiseParallel (o, down): HF's own
                      base_model_tp_plan; and as plait's plan, the embedding vocabulary-parallel and
                      lm_head column-parallel with its logits gathered (torchtitan's styles for them)

Every side is a fresh model from the same seed (the same initial weights), AdamW with the
same lr, one step = forward (``model(ids).logits``), cross-entropy on the next token,
backward, optimizer step, zero_grad. The data is the same on every side: step k's global
batch is ``global_batch`` sequences of ``seq_len + 1`` tokens from a fixed seed
(arithmetic progressions mod the vocabulary with a random start and stride per row: a
model can learn them, so the loss visibly falls); under dp and zero3 rank r trains on its
1/N of the rows, under tp every rank on all of them (the ranks of one tp group see the
same tokens).

Timing. Per round each side runs ``warmup`` untimed steps, then a window of ``steps``
steps between two barriers; its time is the largest rank's. Tokens are counted from the
batches each rank really trained on in the window (``targets.numel()`` summed over the
ranks, divided by the ranks that share a batch: tp), so a side that skipped or repeated
work would show it. The order of the sides is rotated every round, so a slow spell of a
shared machine hits each side alike. Reported per side: tokens/s as the median over
rounds with its min-max; per layout, plait / peer per round (same round, same machine
state) and their median and spread (> 1: plait is faster).

Sanity: every side's loss at step 1 (before any update: the same weights and batch) must
agree within float32 round-off (``STEP1_LOSS_TOLERANCE``), and each side's loss must have
moved by the end of its steps (it trained).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from plait.parallel.data.data_parallel import DataParallel
from plait.parallel.tensor import parallelize
from plait.parallel.tensor.llama import llama_plan
from plait.parallel.zero.module import ZeRO

LAYOUTS = {"dp": ("plait-dp", "torch-ddp"), "zero3": ("plait-zero3", "torch-fsdp2"), "tp": ("plait-tp", "torch-tp")}
VARIANTS = tuple(side for pair in LAYOUTS.values() for side in pair)
LAYOUT_OF = {side: layout for layout, pair in LAYOUTS.items() for side in pair}
# float32 logits over the vocabulary, summed in another order by each side (all-reduces of
# row-parallel outputs under tp): ~1e-6 relative on a loss of ~ln(vocab); 1e-4 absolute is
# far below any real difference (another weight, token or mask moves it by > 1e-2).
STEP1_LOSS_TOLERANCE = 1e-4


@dataclass(frozen=True, kw_only=True)
class HfBenchConfig:
    """Flags of `plait bench hf` (one field per flag)."""

    nprocs: int = 2
    variants: tuple[str, ...] = VARIANTS
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 512
    vocab: int = 2048
    seq_len: int = 128
    global_batch: int = 8  # sequences per step over all ranks
    lr: float = 1e-3
    rounds: int = 3
    warmup: int = 2
    steps: int = 6
    seed: int = 0
    timeout_s: float = 600.0  # the world's silence limit

    def problems(self) -> list[str]:
        """Every bad value, with the fix."""
        found = []
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            found.append(f"--variants: unknown {', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                         f"{', '.join(VARIANTS)}")
        too_small = [f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1"
                     for name in ("nprocs", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab",
                                  "seq_len", "global_batch", "rounds", "steps", "warmup") if getattr(self, name) < 1]
        if too_small:  # the checks below divide by these
            return found + too_small
        if self.nprocs < 2:
            found.append(f"--nprocs {self.nprocs}: a comparison of parallel training needs at least 2 ranks")
        if self.global_batch % self.nprocs:
            found.append(f"--global-batch {self.global_batch} must be a multiple of --nprocs {self.nprocs} "
                         "(each dp rank trains on an equal share)")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            found.append(f"--hidden {self.hidden}, --heads {self.heads}, --kv-heads {self.kv_heads}: heads must "
                         "divide hidden and kv-heads must divide heads (grouped-query attention)")
        tp_sizes = {"kv-heads": self.kv_heads, "intermediate": self.intermediate, "vocab": self.vocab}
        undivided = [f"--{flag} {size}" for flag, size in tp_sizes.items() if size % self.nprocs]
        if undivided and any(LAYOUT_OF.get(variant) == "tp" for variant in self.variants):
            found.append(f"tp over --nprocs {self.nprocs} ranks must divide {', '.join(undivided)}: change them or "
                         "leave plait-tp,torch-tp out of --variants")
        if not self.lr > 0 or math.isinf(self.lr):
            found.append(f"--lr {self.lr} must be a finite number > 0")
        return found

    @property
    def tokens_per_step(self) -> int:
        """What the config says a step trains on (the report checks the counted tokens against it)."""
        return self.global_batch * self.seq_len


def llama_config(config: HfBenchConfig):
    """The LlamaConfig of the benchmark (no cache: training)."""
    # transformers is the optional `hf` extra and takes seconds to import: only the ranks need it
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=config.intermediate,
                       num_hidden_layers=config.layers, num_attention_heads=config.heads,
                       num_key_value_heads=config.kv_heads, max_position_embeddings=config.seq_len,
                       tie_word_embeddings=False, use_cache=False, attention_dropout=0.0)


def build_model(config: HfBenchConfig) -> nn.Module:
    """``LlamaForCausalLM`` from the config, float32, the same weights for one seed."""
    from transformers import LlamaForCausalLM  # the optional extra, as above

    torch.manual_seed(config.seed)
    return LlamaForCausalLM(llama_config(config)).float()


def global_batch(config: HfBenchConfig, step: int) -> torch.Tensor:
    """Step ``step``'s (global_batch, seq_len + 1) tokens: row i counts from a random start
    by a random stride, mod the vocabulary (learnable, so the loss falls)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    start = torch.randint(0, config.vocab, (config.global_batch, 1), generator=generator)
    stride = torch.randint(1, 8, (config.global_batch, 1), generator=generator)
    return (start + stride * torch.arange(config.seq_len + 1)) % config.vocab


def _adamw(params, config: HfBenchConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.lr)


def torch_tp_plan() -> dict:
    """HF's own base_model_tp_plan for Llama in torch's styles (prefixed with ``model.``),
    plus what plait's Llama plan shards too, as torchtitan writes it: the embedding
    vocabulary-parallel (RowwiseParallel of a replicated input) and lm_head
    column-parallel over the vocabulary, its logits gathered (output Replicate)."""
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for layer_module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        plan[f"model.layers.*.{layer_module}"] = ColwiseParallel()
    for layer_module in ("self_attn.o_proj", "mlp.down_proj"):
        plan[f"model.layers.*.{layer_module}"] = RowwiseParallel()
    return plan


class Side:
    """One side of a layout: the wrapped model, its step, the tokens it trained on."""

    def __init__(self, variant: str, config: HfBenchConfig):
        self.variant, self.config = variant, config
        self.layout = LAYOUT_OF[variant]
        world_size = dist.get_world_size()
        # ranks sharing one batch: tp's group sees the same rows; dp and zero3 split them
        self.replicas = world_size if self.layout == "tp" else 1
        model = build_model(config)
        self.zero = None
        if variant == "plait-dp":
            self.wrapped = DataParallel(model)
        elif variant == "torch-ddp":
            self.wrapped = torch.nn.parallel.DistributedDataParallel(model)
        elif variant == "plait-zero3":
            self.zero = self.wrapped = ZeRO(model, _adamw(model.parameters(), config), stage=3,
                                            wrap=lambda llama: [llama.model.embed_tokens, *llama.model.layers])
        elif variant == "torch-fsdp2":
            mesh = init_device_mesh("cpu", (world_size,))
            for unit in (model.model.embed_tokens, *model.model.layers):
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.wrapped = model
        elif variant == "torch-tp":
            mesh = init_device_mesh("cpu", (world_size,))
            self.wrapped = parallelize_module(model, mesh, torch_tp_plan())
        else:  # plait-tp
            self.wrapped = parallelize(model, dist.group.WORLD, llama_plan(model))
        self.optimizer = None if self.zero is not None else _adamw(self.wrapped.parameters(), config)
        self.losses: list[torch.Tensor] = []
        self.tokens_seen = 0

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global batch."""
        if self.replicas > 1:
            return tokens
        rank, world_size = dist.get_rank(), dist.get_world_size()
        share = tokens.shape[0] // world_size
        return tokens[rank * share:(rank + 1) * share]

    def step(self, step_index: int) -> None:
        tokens = self.rows(global_batch(self.config, step_index))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = self.wrapped(inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if self.zero is not None:
            self.zero.step()
            self.zero.zero_grad()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())
        self.tokens_seen += targets.numel()


def _sum_over_ranks(value: float, op=dist.ReduceOp.SUM) -> float:
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return float(tensor)


def measure(variant: str, config: HfBenchConfig, round_index: int) -> dict:
    """One side, one round: warm-up, then the timed window of ``config.steps`` steps."""
    side = Side(variant, config)
    for step_index in range(config.warmup):
        side.step(step_index)
    side.tokens_seen = 0
    dist.barrier()
    start_s = time.perf_counter()
    for step_index in range(config.warmup, config.warmup + config.steps):
        side.step(step_index)
    dist.barrier()
    window_s = _sum_over_ranks(time.perf_counter() - start_s, dist.ReduceOp.MAX)
    tokens = _sum_over_ranks(side.tokens_seen) / side.replicas
    # the curve of the global batch's loss: dp ranks' means averaged (equal shares); tp ranks agree
    losses = torch.stack(side.losses).double()
    dist.all_reduce(losses)
    losses /= dist.get_world_size()
    return {"round": round_index, "variant": variant, "layout": side.layout, "window_s": window_s,
            "window_steps": config.steps, "tokens": tokens, "tokens_per_s": tokens / window_s,
            "losses": losses.tolist()}


def run_hf_bench(config: HfBenchConfig, *, device=None, emit=None) -> list[dict]:
    """Every variant, ``config.rounds`` rounds, order rotated per round; rank 0 emits
    ("row", dict) per variant per round and returns the rows."""
    del device  # CPU / gloo here
    torch.set_num_threads(1)
    rows = []
    variants = tuple(config.variants)
    for round_index in range(config.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            row = measure(variant, config, round_index)
            rows.append(row)
            if dist.get_rank() == 0 and emit:
                emit("row", row)
    return rows


def summarize(rows: list[dict], config: HfBenchConfig) -> dict:
    """Per side: tokens/s median [min-max] over rounds, the tokens it counted, step-1 and
    last losses; per layout: plait / peer tokens/s per round, median and spread; the
    step-1 loss check across every side."""
    by_variant = {variant: [row for row in rows if row["variant"] == variant] for variant in config.variants}
    table = []
    for variant, mine in by_variant.items():
        if not mine:
            continue
        speeds = [row["tokens_per_s"] for row in mine]
        first = mine[0]["losses"]
        table.append({"variant": variant, "layout": LAYOUT_OF[variant], "rounds": len(mine),
                      "tokens_per_s": statistics.median(speeds), "tokens_per_s_min": min(speeds),
                      "tokens_per_s_max": max(speeds), "tokens_per_window": mine[0]["tokens"],
                      "tokens_per_window_expected": config.tokens_per_step * config.steps,
                      "loss_step1": first[0], "loss_last": first[-1], "trained": first[-1] != first[0]})
    pairs = []
    for layout, (plait_side, peer) in LAYOUTS.items():
        if by_variant.get(plait_side) and by_variant.get(peer):
            peer_by_round = {row["round"]: row["tokens_per_s"] for row in by_variant[peer]}
            ratios = [row["tokens_per_s"] / peer_by_round[row["round"]] for row in by_variant[plait_side]
                      if row["round"] in peer_by_round]
            curves = zip(by_variant[plait_side][0]["losses"], by_variant[peer][0]["losses"])
            pairs.append({"layout": layout, "plait": plait_side, "peer": peer, "ratios": ratios,
                          "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                          "max_loss_difference": max(abs(mine - theirs) for mine, theirs in curves)})
    step1 = [row["losses"][0] for row in rows]
    spread = max(step1) - min(step1) if step1 else math.nan
    return {"variants": table, "pairs": pairs, "step1_loss_spread": spread,
            "step1_loss_tolerance": STEP1_LOSS_TOLERANCE, "step1_losses_agree": spread <= STEP1_LOSS_TOLERANCE,
            "all_trained": all(entry["trained"] for entry in table)}
