"""``parallelize(model, tp, plan)``: shard a model's modules in place by name, torch's
``parallelize_module`` for any model plait can split (nn.Linear, HF's Conv1D,
nn.Embedding, plait's own layers).

A plan maps module names to styles (plait.parallel.tensor.styles). Names are
matched component by component with fnmatch: ``"transformer.h.*.mlp.c_fc"`` matches
``transformer.h.0.mlp.c_fc``, ``*`` standing for one dotted component. Every entry
must match a module, and no module two entries. ``ParallelPlan`` adds what a dict
cannot say: sequence parallelism, the sequence dim of the model's activations
(1 for Hugging Face's batch-first (b, s, h)) and the architecture's adapter.

The adapter is what the attention modules must learn after their projections are
sharded (an HF GPT2Attention splits its fused output by ``split_size``, which must
become the local width): an object with

    name: str                                  # for messages
    check(model, styles, tp_size) -> None      # refuse, by module name, what tp cannot split
                                               # (styles: module name -> the plan's style)
    localize(model, tp) -> None                # set the local sizes after sharding
    claimed_parameters(model) -> set[str]      # (optional) parameters whose sequence-parallel
                                               # gradient sum the model's own code does

Everything is validated before anything changes, so a refused plan leaves the model
as it was. Then one all-gather over the group checks that every rank holds the same
weights and plan (a rank seeded differently would keep slices of another model), and
each matched module is replaced by its sharded form (plait.parallel.tensor.convert),
keeping parameter names: ``sharding.gather_state_dict(model, tp)`` returns the
original state dict and ``shard_state_dict`` loads one.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Mapping

import torch
from torch import nn

from plait.parallel.tensor.convert import ColwiseLinear, RowwiseLinear, VocabEmbedding, is_conv1d, linear_sizes
from plait.parallel.tensor.group import TensorParallel, check_agreement
from plait.parallel.tensor.hooks import add_sequence_hooks
from plait.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, valid_tp_sizes
from plait.parallel.tensor.layout import REPLICATED, SEQUENCE_SHARDED
from plait.parallel.tensor.native import convert_native
from plait.parallel.tensor.styles import (
    COLWISE,
    ROWWISE,
    SEQUENCE,
    VOCAB,
    ColwiseParallel,
    RowwiseParallel,
    VocabParallel,
    as_style,
)

SHARDING_KINDS = (COLWISE, ROWWISE, VOCAB)
NATIVE = {COLWISE: ColumnParallelLinear, ROWWISE: RowParallelLinear, VOCAB: VocabParallelEmbedding}
CONVERTED = (ColwiseLinear, RowwiseLinear, VocabEmbedding)


@dataclass(frozen=True)
class ParallelPlan:
    """Styles by module name, plus: ``sequence_parallel`` (norms and dropout run on
    the sequence shard between the plan's SequenceParallel entry and exit),
    ``seq_dim`` (where the sequence is in the activations: 1 for batch-first
    (b, s, h), 0 for (s, b, h)) and the architecture's ``adapter`` (None: none)."""

    styles: Mapping = field(default_factory=dict)
    sequence_parallel: bool = False
    seq_dim: int = 1
    adapter: object = None

    def __post_init__(self):
        if not isinstance(self.styles, Mapping):
            raise TypeError(f"ParallelPlan: styles must be a dict of module name -> style, got "
                            f"{type(self.styles).__name__}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"ParallelPlan: sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if isinstance(self.seq_dim, bool) or not isinstance(self.seq_dim, int) or self.seq_dim < 0:
            raise TypeError(f"ParallelPlan: seq_dim must be the sequence's dim (1 for batch-first (b, s, h), 0 for "
                            f"(s, b, h)), got {self.seq_dim!r}")
        object.__setattr__(self, "styles", {pattern: as_style(style, pattern)
                                            for pattern, style in self.styles.items()})

    def describe(self) -> str:
        entries = ", ".join(f"{pattern}: {style}" for pattern, style in self.styles.items())
        adapter = getattr(self.adapter, "name", None)
        return f"sequence_parallel={self.sequence_parallel}, seq_dim={self.seq_dim}, adapter={adapter}; {entries}"


def name_matches(pattern: str, name: str) -> bool:
    """fnmatch per dotted component: "h.*.mlp" matches "h.0.mlp", not "h.0.x.mlp"."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(fnmatchcase(part, glob) for part, glob in zip(have, want))


def match_plan(model: nn.Module, styles: Mapping, missing_ok: bool = False) -> list[tuple[str, nn.Module, object]]:
    """(module name, module, style) for every module a plan entry matches, in the
    model's order; refuses a module matched twice, and an entry matching nothing
    unless ``missing_ok`` (a pipeline stage holds only some of the model's modules)."""
    names = [(name, module) for name, module in model.named_modules() if name]
    matched, by_name = [], {}
    for pattern, style in styles.items():
        hits = [(name, module) for name, module in names if name_matches(pattern, name)]
        if not hits and not missing_ok:
            example = ", ".join(repr(name) for name, _ in names[:4])
            raise ValueError(f"plan entry {pattern!r} matches no module of {type(model).__name__} (its modules are "
                             f"named like {example}, ...; '*' matches one dotted component): fix the name or drop "
                             f"the entry (a pipeline stage holding part of the model: missing_ok=True)")
        for name, module in hits:
            if name in by_name:
                raise ValueError(f"module {name!r} is matched by two plan entries, {by_name[name]!r} and {pattern!r}: "
                                 f"make the patterns disjoint")
            by_name[name] = pattern
            matched.append((name, module, style))
    order = {name: index for index, (name, _) in enumerate(names)}
    return sorted(matched, key=lambda item: order[item[0]])


def _refuse_type(name: str, module: nn.Module, style, takes: str) -> None:
    raise TypeError(f"plan entry for {name!r}: {type(style).__name__} takes {takes}, but {name!r} is a "
                    f"{type(module).__name__}: map the pattern to the layers inside it, or give this module "
                    f"Replicate() / write an adapter for it")


def _check_divides(name: str, what: str, size: int, tp_size: int, fix: str) -> None:
    if size % tp_size:
        valid = ", ".join(map(str, valid_tp_sizes(size=size)))
        raise ValueError(f"{name}: {what}={size} is not divisible by tp={tp_size} ({fix}; tp values that divide "
                         f"it: {valid})")


def check_module(name: str, module: nn.Module, style, tp_size: int, sequence_parallel: bool) -> None:
    """Refuse, by name, a module its style cannot split at this tp."""
    kind = style.kind
    if isinstance(module, CONVERTED):
        raise ValueError(f"{name!r} is already tensor-parallel ({type(module).__name__}): parallelize a model once")
    if kind in SHARDING_KINDS and isinstance(module, NATIVE[kind]):
        return  # plait's own layer: checked by convert_native
    if kind in SHARDING_KINDS and isinstance(module, tuple(NATIVE.values())):
        _refuse_type(name, module, style, f"plait's {NATIVE[kind].__name__}")
    layout_names = {"input_layout": getattr(style, "input_layout", None),
                    "output_layout": getattr(style, "output_layout", None)}
    if not sequence_parallel and SEQUENCE_SHARDED in layout_names.values():
        raise ValueError(f"plan entry for {name!r}: {style} uses a sequence-sharded layout but the plan has "
                         f"sequence_parallel=False: build the plan with sequence_parallel=True")
    if kind in (COLWISE, ROWWISE):
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            _refuse_type(name, module, style, "an nn.Linear or Hugging Face's Conv1D")
        in_features, out_features, _ = linear_sizes(module)
        if kind == ROWWISE:
            _check_divides(name, "in_features", in_features, tp_size, "RowwiseParallel splits the input features")
            return
        parts = style.parts(out_features)
        for index, part in enumerate(parts or ()):
            _check_divides(name, f"fused part {index} size", part, tp_size, "each rank keeps 1/tp of every part")
        for index, part in enumerate(parts or (out_features,)):
            if style.head_dim is not None and (part // tp_size) % style.head_dim:
                raise ValueError(f"{name}: part {index} of {part} columns gives each of tp={tp_size} ranks "
                                 f"{part // tp_size}, not whole heads of head_dim={style.head_dim}: use a tp that "
                                 f"divides the number of heads ({part // style.head_dim})")
        if parts is None and not style.pad:
            _check_divides(name, "out_features", out_features, tp_size,
                           "ColwiseParallel splits the output features; a vocabulary head may use pad=True")
    elif kind == VOCAB:
        if not isinstance(module, nn.Embedding):
            _refuse_type(name, module, style, "an nn.Embedding")
        unsupported = [flag for flag in ("max_norm", "sparse", "scale_grad_by_freq") if getattr(module, flag)]
        if unsupported:
            raise ValueError(f"{name}: VocabParallel does not split an nn.Embedding with {', '.join(unsupported)} "
                             f"set (each rank sees only its rows): build the embedding without it")


def _claimed(model: nn.Module, matched, adapter) -> set[str]:
    """Parameter names some plan entry (or the adapter) takes responsibility for."""
    names = set()
    for name, module, style in matched:
        recurse = style.kind != SEQUENCE  # a SequenceParallel module answers for its own parameters only
        names.update(f"{name}.{local}" for local, _ in module.named_parameters(recurse=recurse,
                                                                               remove_duplicate=False))
    claimed = getattr(adapter, "claimed_parameters", None)
    if claimed is not None:
        names.update(claimed(model))
    return names


def _check_sequence_claims(model: nn.Module, matched, adapter) -> None:
    """Under sequence parallelism a parameter no entry names could be running on the
    sequence shard, where its gradient would be a partial sum: refuse it by name."""
    claimed = _claimed(model, matched, adapter)
    loose = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in claimed]
    if loose:
        listed = ", ".join(repr(name) for name in loose[:4]) + (", ..." if len(loose) > 4 else "")
        raise ValueError(f"sequence parallelism: parameters {listed} are in no plan entry; say where each runs: "
                         f"Replicate() for a module on replicated activations (before the entry, after the exit), "
                         f"SequenceParallel() for one on the sequence shard (its gradient is then summed over tp)")


def _check_ties(model: nn.Module, matched) -> None:
    """A parameter shared between a sharded module and one the plan leaves whole would
    be sliced in one and kept whole in the other: refuse it, naming both."""
    owners = {}
    for name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((name, f"{name}.{local}" if name else local))
    sharded = {name for name, _, style in matched if style.kind in SHARDING_KINDS}
    for holders in owners.values():
        split = [full for name, full in holders if name in sharded]
        whole = [full for name, full in holders if name not in sharded]
        if split and whole:
            raise ValueError(f"{whole[0]!r} is the same Parameter as {split[0]!r}, which the plan shards: give "
                             f"its module a sharding entry too (a tied head: ColwiseParallel(pad=True)), or untie it")


def resolve_tp(tp, sequence_parallel: bool) -> TensorParallel:
    """A TensorParallel from a TensorParallel, a ProcessGroup or a 1-D DeviceMesh."""
    if isinstance(tp, TensorParallel):
        if tp.sequence_parallel != sequence_parallel:
            raise ValueError(f"the TensorParallel has sequence_parallel={tp.sequence_parallel} but the plan has "
                             f"sequence_parallel={sequence_parallel}: make them agree (e.g. gpt2_plan(model, "
                             f"sequence_parallel={tp.sequence_parallel}))")
        return tp
    return TensorParallel(group=tp, sequence_parallel=sequence_parallel)


def _weights_code(model: nn.Module) -> int:
    """A checksum of every parameter's values: equal on ranks holding the same weights."""
    sums = [torch.stack([param.detach().double().sum(), param.detach().double().square().sum()]).cpu()
            for param in model.parameters()]
    packed = b"".join(struct.pack("<2d", *values.tolist()) for values in sums)
    return zlib.crc32(packed) & 0x7FFFFFFF


def as_plan(plan, sequence_parallel: bool = False) -> ParallelPlan:
    """A ParallelPlan from a ParallelPlan or a dict of patterns to styles."""
    if isinstance(plan, Mapping):
        plan = ParallelPlan(styles=plan, sequence_parallel=sequence_parallel)
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan or a dict of module-name patterns to styles, got "
                        f"{type(plan).__name__}")
    return plan


def check_plan(model: nn.Module, plan, tp_size: int, *, adapter=None,
               missing_ok: bool = False) -> list[tuple[str, nn.Module, object]]:
    """Everything ``parallelize`` refuses, without a process group (the planner and a
    launcher check a plan at a tp before any process starts): returns the matched
    (module name, module, style) in the model's order."""
    plan = as_plan(plan)
    adapter = plan.adapter if adapter is None else adapter
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a whole number >= 1")
    matched = match_plan(model, plan.styles, missing_ok)
    if adapter is not None:  # first: "num_heads=6 is not divisible by tp=4" says more than a layer's width
        adapter.check(model, {name: style for name, _, style in matched}, tp_size)
    for name, module, style in matched:
        check_module(name, module, style, tp_size, plan.sequence_parallel)
    if plan.sequence_parallel:
        _check_sequence_claims(model, matched, adapter)
    _check_ties(model, matched)
    return matched


def _rng_code(model: nn.Module) -> int:
    """A checksum of the random state dropout draws from (0 when the model has no
    active dropout): tp ranks must drop the same elements of replicated activations."""
    if not any(isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 for module in model.modules()):
        return 0
    states = [torch.get_rng_state()]
    devices = {param.device for param in model.parameters() if param.device.type == "cuda"}
    states += [torch.cuda.get_rng_state(device) for device in sorted(devices, key=str)]
    return zlib.crc32(b"".join(bytes(state.numpy()) for state in states)) & 0x7FFFFFFF


def parallelize(model: nn.Module, tp, plan, *, adapter=None, missing_ok: bool = False) -> nn.Module:
    """Shard ``model`` in place over ``tp`` (a TensorParallel, a ProcessGroup or a 1-D
    DeviceMesh) by ``plan`` (a ParallelPlan, or a dict of module-name patterns to
    styles); returns ``model``. Every rank of the group calls it with the same model
    weights and plan. ``adapter`` overrides the plan's. ``missing_ok=True`` lets plan
    entries match nothing: a pipeline stage (plait.parallel.pipeline.split keeps the
    model's names) takes the whole model's plan and shards the modules it holds."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize takes an nn.Module, got {type(model).__name__}")
    plan = as_plan(plan, tp.sequence_parallel if isinstance(tp, TensorParallel) else False)
    adapter = plan.adapter if adapter is None else adapter
    tp = resolve_tp(tp, plan.sequence_parallel)
    matched = check_plan(model, plan, tp.size, adapter=adapter, missing_ok=missing_ok)
    if tp.size > 1:
        fields = {"plan": zlib.crc32(plan.describe().encode()) & 0x7FFFFFFF, "weight checksum": _weights_code(model),
                  "dropout random state": _rng_code(model), **tp.agreement_fields()}
        check_agreement(fields, tp.group, "parallelize: every rank of the tensor-parallel group must give the same "
                        "model weights and plan, and with dropout the same random state (torch.manual_seed(seed) on "
                        "every rank alike, or load one checkpoint, before parallelize)",
                        f"this rank {tp.rank}: {type(model).__name__}, {plan.describe()}")
    shared = {}
    modules = dict(model.named_modules())
    for name, module, style in matched:
        if style.kind in SHARDING_KINDS:
            if isinstance(module, NATIVE[style.kind]):
                convert_native(name, module, style, tp, shared)
            else:
                _replace(modules, name, _sharded(name, module, style, tp, plan, shared))
        elif style.kind == SEQUENCE and plan.sequence_parallel:
            add_sequence_hooks(name, module, style, tp, plan.seq_dim)
    if adapter is not None:
        adapter.localize(model, tp)
    return model


def _sharded(name: str, module: nn.Module, style, tp: TensorParallel, plan: ParallelPlan, shared: dict) -> nn.Module:
    sequence = SEQUENCE_SHARDED if plan.sequence_parallel else REPLICATED
    if isinstance(style, ColwiseParallel):
        return ColwiseLinear(module, tp, gather_output=style.gather_output, parts=style.parts(linear_sizes(module)[1]),
                             input_layout=style.input_layout or sequence, seq_dim=plan.seq_dim, name=name,
                             shared=shared)
    if isinstance(style, RowwiseParallel):
        return RowwiseLinear(module, tp, input_is_parallel=style.input_is_parallel,
                             output_layout=style.output_layout or sequence, seq_dim=plan.seq_dim, name=name,
                             shared=shared)
    assert isinstance(style, VocabParallel)
    return VocabEmbedding(module, tp, output_layout=style.output_layout, seq_dim=plan.seq_dim, name=name,
                          shared=shared)


def _replace(modules: dict, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    new.train(modules[name].training)
    setattr(modules[parent_name], child, new)

