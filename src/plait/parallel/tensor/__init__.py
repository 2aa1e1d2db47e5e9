"""plait.parallel.tensor: Megatron-LM tensor parallelism (intra-operator) on plait.comm.

- ``group``: ``TensorParallel`` (group, algorithm, sequence_parallel) and
  ``new_tensor_parallel(tp)``.
- ``mappings``: the conjugate autograd mappings (f, g, scatter/gather, sequence
  reduce-scatter/all-gather).
- ``layers``: column/row-parallel linear, vocab-parallel embedding, parallel
  attention and MLP.
- ``layout``: the layout each layer's input must have (replicated, or sharded along
  the sequence under sequence parallelism), checked on its first forward.
- ``entry``: ``SequenceParallelEntry`` / ``SequenceParallelExit``, a replicated
  (b, s, h) or (s, b, h) into the layers' layout and back.
- ``cross_entropy``: the vocab-parallel loss that never gathers the logits.
- ``sharding``: which slice each parameter holds; unsharded state dicts in and out.
- ``dropout``: masks that are each rank's slice of the unsharded model's.
- ``plan`` / ``styles``: ``parallelize(model, tp, plan)``, a plan of module names to
  ColwiseParallel / RowwiseParallel / VocabParallel / SequenceParallel / Replicate,
  applied in place to any model's Linear, HF Conv1D and Embedding (``convert``,
  ``hooks``, ``native``); ``plans``: ready plans (HF GPT-2, plait's GPT) and ``plan_for``;
  ``llama``: the Llama-style decoders' plan.
"""

from plait.parallel.tensor.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from plait.parallel.tensor.dropout import ConsistentDropout
from plait.parallel.tensor.entry import SequenceParallelEntry, SequenceParallelExit
from plait.parallel.tensor.group import LOCAL, UNSHARDED, TensorParallel, new_tensor_parallel
from plait.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tp_divides,
    parallel_input,
    parallel_logits,
    parallel_output,
    valid_tp_sizes,
)
from plait.parallel.tensor.layout import LAYOUT_CHECKS, REPLICATED, SEQUENCE_SHARDED, check_layout
from plait.parallel.tensor.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    gather_to_replicated,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    scatter_to_sequence,
    sum_grads_in_backward,
)
from plait.parallel.tensor.llama import llama_plan
from plait.parallel.tensor.plan import ParallelPlan, check_plan, parallelize
from plait.parallel.tensor.plans import gpt2_plan, plait_gpt_plan, plan_for
from plait.parallel.tensor.sharding import (
    ShardSpec,
    gather_grads,
    gather_state_dict,
    init_from_full,
    shard_spec,
    shard_state_dict,
)
from plait.parallel.tensor.styles import ColwiseParallel, Replicate, RowwiseParallel, SequenceParallel, VocabParallel

__all__ = [
    "ColwiseParallel", "ParallelPlan", "Replicate", "RowwiseParallel", "SequenceParallel", "VocabParallel",
    "check_plan", "gpt2_plan", "llama_plan", "parallelize", "plait_gpt_plan", "plan_for",
    "ColumnParallelLinear", "ConsistentDropout", "LAYOUT_CHECKS", "LOCAL", "ParallelAttention", "ParallelMLP",
    "REPLICATED", "RowParallelLinear", "SEQUENCE_SHARDED", "SequenceParallelEntry", "SequenceParallelExit",
    "ShardSpec", "TensorParallel", "UNSHARDED", "VocabParallelEmbedding", "check_layout", "check_tp_divides",
    "copy_to_region", "gather_from_region", "gather_from_sequence", "gather_grads", "gather_logits",
    "gather_state_dict", "gather_to_replicated", "init_from_full", "new_tensor_parallel", "parallel_input",
    "parallel_logits", "parallel_output", "reduce_from_region", "reduce_scatter_to_sequence", "scatter_to_region",
    "scatter_to_sequence", "shard_spec", "shard_state_dict", "sum_grads_in_backward", "valid_tp_sizes",
    "vocab_parallel_cross_entropy",
]
