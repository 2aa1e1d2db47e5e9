"""A plan applied to plait's own tensor-parallel layers (ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding) built unsharded: they already know how to
run at any tp, so converting one keeps the module, replaces each marked parameter
(``tp_shard``) by this rank's slice and hands it the group. The model's containers
(plait's GPT, its blocks, attention and MLP) learn the group from their adapter
(plait.parallel.tensor.plans.PlaitGPTAdapter)."""

from __future__ import annotations

from torch import nn

from plait.parallel.tensor.convert import shared_or_new
from plait.parallel.tensor.group import TensorParallel
from plait.parallel.tensor.layers import ColumnParallelLinear, VocabParallelEmbedding
from plait.parallel.tensor.layout import column_input_check
from plait.parallel.tensor.sharding import shard_spec


def reshard_marked(module: nn.Module, tp: TensorParallel, shared: dict, name: str) -> None:
    """Replace each of ``module``'s own marked parameters by this rank's slice."""
    for local, param in list(module.named_parameters(recurse=False)):
        spec = shard_spec(param)
        if spec is not None:
            setattr(module, local, shared_or_new(shared, param, spec, tp, f"{name}.{local}" if name else local))


def convert_native(name: str, module: nn.Module, style, tp: TensorParallel, shared: dict) -> None:
    """Shard one of plait's layers built unsharded (the style's kind matches its class)."""
    if module.tp.size != 1:
        raise ValueError(f"{name!r} ({type(module).__name__}) is already sharded ({module.tp.describe()}): "
                         "parallelize a model built unsharded")
    if style != type(style)():
        raise ValueError(f"{name!r} is plait's {type(module).__name__}, configured by its own arguments: give it "
                         f"{type(style).__name__}() without options")
    reshard_marked(module, tp, shared, name)
    module.tp = tp
    if isinstance(module, ColumnParallelLinear):
        owner = module.layout_check.owner
        module.layout_check = column_input_check(owner, tp)
    if isinstance(module, VocabParallelEmbedding):
        module.vocab_start = tp.rank * module.weight.shape[0]
