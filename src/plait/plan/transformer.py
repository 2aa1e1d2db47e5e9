"""An analytic GPT: FLOPs, parameters, activation memory and communication per layer.

Shapes: l layers, h hidden, a heads, s sequence, V vocabulary (padded to V' = t·ceil(V/t)
under t-way tensor parallelism), f the MLP width (4h by default), b the micro-batch.

FLOPs (matmuls, 2·m·n·k each; DESIGN §6). Forward of one block:

    QKV 6bsh² + QKᵀ 2bs²h + PV 2bs²h + proj 2bsh² + MLP 4bshf  = 24bsh² + 4bs²h  (f = 4h)

the head 2bshV, the embedding none. Each block and the head also carry these
products' shapes (``TransformerSpec.block_matmuls``; the head (bs, V'/t, h)), which a
device calibrated per shape prices one by one. The backward costs twice the forward (input and
weight gradients), full recomputation one more block forward, so one step on B
sequences is 72·B·s·l·h²·(1 + s/(6h) + V/(12lh)) without recomputation and
96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with it.

Activation memory of one block for one micro-batch (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4, generalised): with e bytes
per activation element, m bytes per dropout-mask element and d = 1 when dropout is on,

    sbh·(4e [LN inputs and outputs] + 12e/t [QKV 3, context 1, MLP 4 + 4] + 2dm [residual
    dropout masks]) + as²b·(e + dm + de)/t [softmax output, its dropout mask and output]

The "megatron" accounting (fused kernels, 1-byte masks, sequence-parallel linears that
keep their input sharded) has e = 2, m = 1: 34sbh + 5as²b at t = 1, sbh(10 + 24/t) +
5as²b/t with tensor parallelism and (34sbh + 5as²b)/t with sequence parallelism, the
paper's Table 2. The "plait" accounting is what plait.models.GPT keeps in eager PyTorch:
masks in the activation dtype (m = e), and under sequence parallelism a column-parallel
linear keeps the all-gathered (full-sequence) input it multiplied, so the two LayerNorm
outputs stay sbh each; it also keeps LayerNorm statistics (2 sb float32 per norm) and
the s² boolean causal mask. Full recomputation keeps only each block's input (sbh·e, /t
with sequence parallelism) plus, during the backward, one block's full activations.

Mixed precision as plait train runs it (``torch.autocast``, fp32 weights) keeps two
element sizes: the residual stream stays float32 (r = 4 bytes: the LayerNorm inputs,
each block's input and output, what a pipeline boundary sends and full recomputation
keeps), while what a matmul saves is the 16-bit cast it multiplied (e = 2: the
LayerNorm outputs, QKV, context, the MLP's two 4h tensors, the softmax output). Each
forward also keeps the 16-bit copy of every weight its matmuls used (w = 2 bytes per
weight element, per micro-batch in flight: autocast's cast cache lives for one
forward): w·(4h² + 2hf)/t per block and w·hV'/t for the head.
On a GPU, CUDA's autocast runs softmax in float32 (the CPU's runs it in bf16): the
attention keeps the float32 probabilities and the 16-bit copy the PV matmul saved,
4 + 2 bytes per element instead of e (``softmax_bytes``, plait.plan.precision).

Communication under tensor parallelism (DESIGN §6): per block two all-reduces of sbh·e
bytes forward and two backward (under sequence parallelism each becomes a
reduce-scatter plus an all-gather, the same ring cost), two more forward with
recomputation; the vocab-parallel embedding one forward, the head one backward (the
input gradient of its column-parallel matmul) plus the cross-entropy's max and sums
(3 floats per token). A pipeline boundary sends sbh·e bytes per micro-batch forward and
as many backward (sbh·e/t under sequence parallelism).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from plait.names.recompute import FULL, SELECTIVE
from plait.plan.layers import LayerCost, check_recompute

__all__ = ["TransformerSpec", "MODEL_PRESETS", "model_preset", "ACCOUNTINGS", "TensorParallelComm"]

ACCOUNTINGS = ("megatron", "plait")
LAYER_NORM_STAT_BYTES = 8  # mean and 1/std, float32, per row
TOKEN_BYTES = 8            # int64 token ids
# a block's parameter tensors: LayerNorm 1 and 2 (weight, bias), QKV, proj, fc1, fc2 (weight, bias);
# the 4 weights are matrices
BLOCK_TENSORS, BLOCK_MATRICES = 12, 4

# Kernel counts and non-matmul traffic of one block's forward, in units of e·sbh and
# e·as²b bytes read plus written (backward: about twice). "plait": eager PyTorch ops of
# plait.models.GPT (LayerNorm, bias adds, residual adds, the head permute copy, GeLU, scale,
# causal fill, softmax); "megatron": fused LayerNorm, bias-GeLU, bias-dropout-add and
# scale-mask-softmax kernels.
_BLOCK_FORWARD = {"plait": {"kernels": 17, "sbh": 24.0, "as2b": 6.0, "dropout_sbh": 6.0, "dropout_as2b": 3.0},
                  "megatron": {"kernels": 11, "sbh": 18.0, "as2b": 2.0, "dropout_sbh": 0.0, "dropout_as2b": 3.0}}


@dataclass(frozen=True, kw_only=True)
class TensorParallelComm:
    """Collective calls one layer makes per micro-batch under tensor parallelism, as
    (collective, bytes) lists for the forward, the backward and a recomputed forward."""

    forward: tuple[tuple[str, float], ...] = ()
    backward: tuple[tuple[str, float], ...] = ()
    recompute: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class TransformerSpec:
    """A GPT's shape (plait.models.GPT's: pre-LayerNorm blocks, learned positions,
    vocab-parallel embedding and head). ``ffn_hidden`` 0 means 4·hidden."""

    name: str = "gpt"
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int = 0
    tied_head: bool = True
    dropout: bool = False

    def __post_init__(self) -> None:
        problems = []
        for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key}={value!r} must be a whole number >= 1")
        if isinstance(self.ffn_hidden, bool) or not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 0:
            problems.append(f"ffn_hidden={self.ffn_hidden!r} must be a whole number >= 0 (0 = 4*hidden)")
        if not problems and self.hidden % self.heads:
            valid = [d for d in range(1, min(self.hidden, 256) + 1) if self.hidden % d == 0]
            problems.append(f"heads={self.heads} does not divide hidden={self.hidden}; valid heads: "
                            + ", ".join(map(str, valid[-8:])))
        if problems:
            raise ValueError(f"invalid model {self.name!r}: " + "; ".join(problems))

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def describe(self) -> str:
        return (f"{self.name}: {self.num_parameters() / 1e9:.3g}B parameters, {self.layers} layers, hidden "
                f"{self.hidden}, {self.heads} heads, seq {self.seq_len}, vocab {self.vocab}")

    def as_dict(self) -> dict:
        return asdict(self)

    # ----- parallel degrees --------------------------------------------------------------------
    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why ``tp`` cannot split this model (heads and the MLP width must divide), or None."""
        bad = [f"{key}={value}" for key, value in (("heads", self.heads), ("ffn_hidden", self.ffn)) if value % tp]
        if not bad:
            return None
        common = math.gcd(self.heads, self.ffn)
        valid = [d for d in range(1, common + 1) if common % d == 0]
        return f"tp={tp} does not divide {' and '.join(bad)} (valid tp: {', '.join(map(str, valid))})"

    def padded_vocab(self, tp: int) -> int:
        return tp * -(-self.vocab // tp)

    # ----- parameters and FLOPs ----------------------------------------------------------------
    def block_parameters(self) -> int:
        h, f = self.hidden, self.ffn
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # attention, MLP, two LayerNorms

    def block_parameters_per_rank(self, tp: int) -> int:
        """One tensor-parallel rank's share of a block: the QKV, fc1 (weights and biases)
        and the proj, fc2 weights split t ways; proj and fc2 biases and LayerNorms replicated."""
        h, f = self.hidden, self.ffn
        return (4 * h * h + 3 * h + 2 * h * f + f) // tp + 6 * h

    def num_parameters(self) -> int:
        """Every parameter once (the vocabulary unpadded): V·h + s·h (+ V·h untied) +
        l·(12h² + 13h) + 2h with f = 4h, as plait.models.GPTConfig counts."""
        h, v = self.hidden, self.vocab
        return v * h + self.seq_len * h + (0 if self.tied_head else v * h) + self.layers * self.block_parameters() + 2 * h

    def block_forward_flops(self, batch: int) -> float:
        """24bsh² + 4bs²h for f = 4h (8bsh² + 4bshf + 4bs²h in general)."""
        b, s, h = batch, self.seq_len, self.hidden
        return 8.0 * b * s * h * h + 4.0 * b * s * h * self.ffn + 4.0 * b * s * s * h

    def head_forward_flops(self, batch: int) -> float:
        return 2.0 * batch * self.seq_len * self.hidden * self.vocab

    def forward_flops(self, batch: int) -> float:
        return self.layers * self.block_forward_flops(batch) + self.head_forward_flops(batch)

    def attention_core_forward_flops(self, batch: int) -> float:
        """QKᵀ and probabilities·V: 4bs²h (what selective recomputation re-runs)."""
        return 4.0 * batch * self.seq_len * self.seq_len * self.hidden

    def training_flops(self, batch: int, *, recompute: str = "none") -> float:
        """Matmul FLOPs of one step on ``batch`` sequences: 3x the forward, plus one more
        forward of every block with full recomputation, of every block's attention core
        with selective (the head is not recomputed)."""
        check_recompute(recompute)
        flops = 3.0 * self.forward_flops(batch)
        if recompute == FULL:
            return flops + self.layers * self.block_forward_flops(batch)
        if recompute == SELECTIVE:
            return flops + self.layers * self.attention_core_forward_flops(batch)
        return flops

    def block_matmuls(self, micro_batch: int, *, tp: int = 1) -> tuple:
        """One block's forward matmuls on one of t tensor-parallel ranks, as (kind, count,
        m, n, k) with C[m, n] = A[m, k]·B[k, n] and T = b·s tokens: QKV (T, 3h/t, h),
        proj (T, h, h/t), fc1 (T, f/t, h), fc2 (T, h, f/t), and the attention core's
        b·a/t batched QKᵀ (s, s, d) and PV (s, d, s) with d = h/a. Σ count·2mnk is
        ``block_forward_flops / t``."""
        b, s, h, t, f = micro_batch, self.seq_len, self.hidden, tp, self.ffn
        tokens, d, count = b * s, h // self.heads, b * self.heads // t
        return (("gemm", 1, tokens, 3 * h // t, h), ("gemm", 1, tokens, h, h // t),
                ("gemm", 1, tokens, f // t, h), ("gemm", 1, tokens, h, f // t),
                ("bmm", count, s, s, d), ("bmm", count, s, d, s))

    # ----- activations --------------------------------------------------------------------------
    def block_activation_bytes(self, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False,
                               element_bytes: int = 2, accounting: str = "megatron", residual_bytes: int | None = None,
                               weight_copy_bytes: int = 0, softmax_bytes: int | None = None) -> float:
        """Bytes one block keeps for its backward (the formula in the module docstring;
        ``residual_bytes`` r, default e, ``weight_copy_bytes`` w and ``softmax_bytes``
        (per attention probability, default e): its mixed precision)."""
        _check_accounting(accounting)
        s, b, h, t, e = self.seq_len, micro_batch, self.hidden, tp, element_bytes
        r = e if residual_bytes is None else residual_bytes
        d = 1 if self.dropout else 0
        mask = 1 if accounting == "megatron" else e
        sp = sequence_parallel and t > 1
        sbh = s * b * h
        # LN1 input, LN2 input (the residual stream) and the two LN outputs the QKV and fc1 matmuls keep
        residual = 2 * r * sbh / (t if sp else 1)
        ln_outputs = 2 * e * sbh / (t if sp and accounting == "megatron" else 1)
        sharded = 12 * e * sbh / t
        masks = 2 * d * mask * sbh / (t if sp else 1)
        weights = weight_copy_bytes * (4 * h * h + 2 * h * self.ffn) / t  # 16-bit casts of QKV, proj, fc1, fc2
        total = residual + ln_outputs + sharded + masks + weights + self.attention_core_bytes(
            micro_batch, tp=tp, element_bytes=element_bytes, accounting=accounting, softmax_bytes=softmax_bytes)
        if accounting == "plait":
            total += 2 * LAYER_NORM_STAT_BYTES * s * b / (t if sp else 1)  # LN statistics
        return total

    def attention_core_bytes(self, micro_batch: int, *, tp: int = 1, element_bytes: int = 2,
                             accounting: str = "megatron", softmax_bytes: int | None = None) -> float:
        """What a block's attention core keeps (the softmax output, dropout mask and
        dropped-out probabilities, a·s²·b each per rank; plait's eager GPT also its s·s
        causal mask): what selective recomputation frees, and re-creates while the
        block's backward runs. Its input, QKV, is kept either way. ``softmax_bytes``: what
        the softmax output costs per element (default e; CUDA autocast keeps it in
        float32 and its 16-bit copy: plait.plan.precision.CUDA_AUTOCAST_SOFTMAX_BYTES)."""
        _check_accounting(accounting)
        s, b, t, e = self.seq_len, micro_batch, tp, element_bytes
        d = 1 if self.dropout else 0
        mask = 1 if accounting == "megatron" else e
        probabilities = e if softmax_bytes is None else softmax_bytes
        attention = (probabilities + d * (mask + e)) * self.heads * s * s * b / t
        return attention + (s * s if accounting == "plait" else 0.0)

    def post_core_bytes(self, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False,
                        element_bytes: int = 2, accounting: str = "megatron", residual_bytes: int | None = None,
                        weight_copy_bytes: int = 0) -> float:
        """What a block keeps for the part of its forward after the attention core (the
        projection's input, the second LayerNorm, the MLP, both residual dropout masks,
        their weight copies): the backward frees it before it reaches the core, so a
        selective recompute's regenerated core replaces it."""
        _check_accounting(accounting)
        s, b, h, t, e = self.seq_len, micro_batch, self.hidden, tp, element_bytes
        r = e if residual_bytes is None else residual_bytes
        d = 1 if self.dropout else 0
        mask = 1 if accounting == "megatron" else e
        sp = sequence_parallel and t > 1
        sbh = s * b * h
        ln = (r + e) * sbh / (t if sp else 1) if accounting == "megatron" else r * sbh / (t if sp else 1) + e * sbh
        stats = LAYER_NORM_STAT_BYTES * s * b / (t if sp else 1) if accounting == "plait" else 0.0
        sharded = 9 * e * sbh / t  # the context the projection multiplies, the MLP's two 4h tensors
        weights = weight_copy_bytes * (h * h + 2 * h * self.ffn) / t
        return ln + stats + sharded + 2 * d * mask * sbh / (t if sp else 1) + weights

    def block_input_bytes(self, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False,
                          element_bytes: int = 2) -> float:
        """The (s, b, h) activation entering a block (what recomputation keeps and a
        pipeline boundary sends): sbh·e, /t under sequence parallelism."""
        return self.seq_len * micro_batch * self.hidden * element_bytes / (tp if sequence_parallel and tp > 1 else 1)

    def embedding_activation_bytes(self, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False,
                                   element_bytes: int = 2, accounting: str = "megatron") -> float:
        """Token ids (int64) and the out-of-slice mask the vocab-parallel lookup keeps,
        plus the embedding dropout mask."""
        _check_accounting(accounting)
        sb = self.seq_len * micro_batch
        mask = 1 if accounting == "megatron" else element_bytes
        dropout = mask * self.block_input_bytes(micro_batch, tp=tp, sequence_parallel=sequence_parallel,
                                                element_bytes=1) if self.dropout else 0.0
        return sb * (TOKEN_BYTES + 1) + dropout

    def head_activation_bytes(self, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False,
                              element_bytes: int = 2, accounting: str = "megatron", residual_bytes: int | None = None,
                              weight_copy_bytes: int = 0) -> float:
        """Final LayerNorm input (r bytes an element) and output, the cross-entropy's
        float32 softmax of this rank's vocabulary slice (sbV'/t · 4) with its target
        index and mask, and under autocast the head weight's 16-bit copy."""
        _check_accounting(accounting)
        s, b, h, t = self.seq_len, micro_batch, self.hidden, tp
        sp = sequence_parallel and t > 1
        r = element_bytes if residual_bytes is None else residual_bytes
        ln_in = s * b * h * r / (t if sp else 1)
        ln_out = s * b * h * element_bytes / (t if sp and accounting == "megatron" else 1)
        softmax = 4.0 * s * b * self.padded_vocab(t) / t
        stats = LAYER_NORM_STAT_BYTES * s * b / (t if sp else 1) if accounting == "plait" else 0.0
        weights = weight_copy_bytes * h * self.padded_vocab(t) / t
        return ln_in + ln_out + softmax + s * b * (TOKEN_BYTES + 1) + stats + weights

    # ----- per-layer costs for the planner ------------------------------------------------------
    def layer_costs(self, micro_batch: int, *, tp: int = 1, sequence_parallel: bool = False, element_bytes: int = 2,
                    accounting: str = "megatron", residual_bytes: int | None = None,
                    weight_copy_bytes: int = 0, softmax_bytes: int | None = None) -> list[LayerCost]:
        """[embedding, block 0 .. block l-1, head]: one micro-batch on one device of a
        t-way tensor-parallel group (``residual_bytes``, ``weight_copy_bytes``: mixed
        precision, see the module docstring)."""
        _check_accounting(accounting)
        problem = self.tensor_parallel_problem(tp)
        if problem:
            raise ValueError(problem)
        s, b, h, a, t, e = self.seq_len, micro_batch, self.hidden, self.heads, tp, element_bytes
        sp = sequence_parallel and t > 1
        shape = dict(tp=tp, sequence_parallel=sequence_parallel, element_bytes=e)
        mixed = dict(residual_bytes=residual_bytes, weight_copy_bytes=weight_copy_bytes)
        boundary = self.block_input_bytes(b, tp=tp, sequence_parallel=sequence_parallel,
                                          element_bytes=e if residual_bytes is None else residual_bytes)
        d = 1 if self.dropout else 0
        k = _BLOCK_FORWARD[accounting]
        sbh, as2b = s * b * h, a * s * s * b
        block_bytes = e * ((k["sbh"] + d * k["dropout_sbh"]) * sbh / (t if sp else 1)
                           + (k["as2b"] + d * k["dropout_as2b"]) * as2b / t)
        block_flops = self.block_forward_flops(b) / t
        block = LayerCost(forward_matmuls=self.block_matmuls(b, tp=t),name="block", params=self.block_parameters_per_rank(t),
                          forward_flops=block_flops, backward_flops=2 * block_flops,
                          forward_kernels=k["kernels"], backward_kernels=2 * k["kernels"],
                          forward_bytes=block_bytes, backward_bytes=2 * block_bytes,
                          activation_bytes=self.block_activation_bytes(b, accounting=accounting, softmax_bytes=softmax_bytes,
                                                                       **shape, **mixed),
                          input_bytes=boundary, output_bytes=boundary,
                          core_activation_bytes=self.attention_core_bytes(b, tp=t, element_bytes=e,
                                                                          accounting=accounting,
                                                                          softmax_bytes=softmax_bytes),
                          post_core_bytes=self.post_core_bytes(b, accounting=accounting, **shape, **mixed),
                          core_forward_flops=self.attention_core_forward_flops(b) / t,
                          core_forward_bytes=e * (k["as2b"] + d * k["dropout_as2b"]) * as2b / t,
                          param_tensors=BLOCK_TENSORS, matrix_tensors=BLOCK_MATRICES)
        v_local = self.padded_vocab(t) // t
        embedding = LayerCost(
            name="embedding", params=v_local * h + s * h,
            forward_kernels=6, backward_kernels=3,
            forward_bytes=e * (3 * sbh / (t if sp else 1)) + (TOKEN_BYTES + 1) * s * b,
            backward_bytes=e * 3 * sbh / (t if sp else 1),
            activation_bytes=self.embedding_activation_bytes(b, accounting=accounting, **shape),
            input_bytes=TOKEN_BYTES * s * b, output_bytes=boundary,
            param_tensors=2, matrix_tensors=2)  # token and position tables
        head_flops = 2.0 * b * s * h * v_local
        softmax_bytes = 4.0 * s * b * v_local
        head = LayerCost(
            name="head", params=(0 if self.tied_head else v_local * h) + 2 * h,
            forward_flops=head_flops, backward_flops=2 * head_flops,
            forward_kernels=12, backward_kernels=10,
            forward_bytes=e * 2 * sbh / (t if sp else 1) + 6 * softmax_bytes,
            backward_bytes=e * 2 * sbh / (t if sp else 1) + 4 * softmax_bytes,
            activation_bytes=self.head_activation_bytes(b, accounting=accounting, **shape, **mixed),
            input_bytes=boundary, output_bytes=4.0 * b, forward_matmuls=(("gemm", 1, s * b, v_local, h),),
            param_tensors=2 + (0 if self.tied_head else 1), matrix_tensors=0 if self.tied_head else 1)  # LayerNorm, head
        blocks = [replace(block, name=f"block{i}") for i in range(self.layers)]
        # a tied head's weight lives with the embedding (the first stage); a pipeline
        # then also keeps a copy on the last stage, which the planner adds there
        return [embedding, *blocks, head]

    def tensor_parallel_comm(self, micro_batch: int, *, tp: int, sequence_parallel: bool = False,
                             element_bytes: int = 2) -> dict[str, TensorParallelComm]:
        """The collectives of the embedding, of one block and of the head per micro-batch
        (keys "embedding", "block", "head"); all empty at tp = 1."""
        if tp == 1:
            return {"embedding": TensorParallelComm(), "block": TensorParallelComm(), "head": TensorParallelComm()}
        full = self.seq_len * micro_batch * self.hidden * element_bytes
        sp = sequence_parallel
        # under sequence parallelism a sum becomes reduce-scatter + all-gather of the same bytes
        pair = (("reduce_scatter", full), ("all_gather", full)) if sp else (("all_reduce", full),)
        block_forward = pair * 2
        cross_entropy = (("all_reduce", 4.0 * self.seq_len * micro_batch), ("all_reduce", 8.0 * self.seq_len * micro_batch))
        return {
            "embedding": TensorParallelComm(forward=(("reduce_scatter", full),) if sp else (("all_reduce", full),),
                                            backward=(("all_gather", full),) if sp else ()),
            "block": TensorParallelComm(forward=block_forward, backward=block_forward, recompute=block_forward),
            "head": TensorParallelComm(forward=((("all_gather", full),) if sp else ()) + cross_entropy,
                                       backward=(("reduce_scatter", full),) if sp else (("all_reduce", full),)),
        }


def _check_accounting(accounting: str) -> None:
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting={accounting!r} must be one of {', '.join(ACCOUNTINGS)}")


def _gpt(name: str, layers: int, hidden: int, heads: int, seq_len: int = 2048, vocab: int = 51200) -> TransformerSpec:
    return TransformerSpec(name=name, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab,
                           dropout=True)


# GPT-3 (Brown et al. 2020, Table 2.1: the 1.3B model listed with 24 heads of 128 is
# run here with 16, as 24 does not divide 2048) and the Megatron-LM scaling series
# (Narayanan et al. 2021, Table 1), vocabulary padded to 51,200 and dropout on, as
# Megatron-LM does.
MODEL_PRESETS = {
    "gpt-125m": _gpt("gpt-125m", 12, 768, 12),
    "gpt-350m": _gpt("gpt-350m", 24, 1024, 16),
    "gpt-760m": _gpt("gpt-760m", 24, 1536, 16),
    "gpt-1.3b": _gpt("gpt-1.3b", 24, 2048, 16),
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-2.7b": _gpt("gpt-2.7b", 32, 2560, 32),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-6.7b": _gpt("gpt-6.7b", 32, 4096, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-13b": _gpt("gpt-13b", 40, 5120, 40),
    "gpt-18b": _gpt("gpt-18b", 40, 6144, 48),
    "gpt-39b": _gpt("gpt-39b", 48, 8192, 64),
    "gpt-76b": _gpt("gpt-76b", 60, 10240, 80),
    "gpt-145b": _gpt("gpt-145b", 80, 12288, 96),
    "gpt-175b": _gpt("gpt-175b", 96, 12288, 96),
    "gpt-310b": _gpt("gpt-310b", 96, 16384, 128),
    "gpt-530b": _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
}


def model_preset(name: str) -> TransformerSpec:
    """The preset ``name`` (see MODEL_PRESETS)."""
    spec = MODEL_PRESETS.get(name)
    if spec is None:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(MODEL_PRESETS)} "
                         "(or --model gpt with --layers --hidden --heads --seq --vocab)")
    return spec
