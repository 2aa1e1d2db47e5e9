"""The user's optimizer param groups under ZeRO, shared by both fronts (the ``ZeRO``
module and plait train's ``ShardedOptimizer``): which parameters each flat unit holds,
and the optimizer that steps the shards.

A flat unit belongs to one param group, so that its shard goes into that group and is
stepped with that group's options (weight decay, lr, betas, ...): stepping a flat shard
equals stepping its parameters only when they share every option. So the parameters
are cut into units per group: at stages 1 and 2 each group's parameters are bucketed
apart (in the backward's order); at stage 3 a module whose parameters lie in two groups
(a Linear whose bias has no weight decay) gives two units, gathered together.

The optimizer is given as torch users build it, over the model's parameters
(``torch.optim.AdamW(groups, lr=...)``, groups as Hugging Face's trainer makes them), and
is moved onto the shards: the same class, the same options per group, a fresh state.
Refused by name: parameters that are not the model's, trainable parameters the
optimizer does not hold, a class whose update mixes elements (``check_elementwise``), and
an optimizer that has already stepped (its state is per parameter, not per shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from plait.parallel.zero.engine import buckets, check_elementwise


class PlannedUnit(NamedTuple):
    """One flat unit to build: its param group, its stage-3 owner module (an index into
    the wrapped modules; None: the root's, gathered for the whole step), the kind a
    front-end keys it by, and its (name, parameter) pairs."""
    group: int
    owner: int | None
    kind: object
    named: list


def plan_units(groups: list[list[tuple[str, nn.Parameter]]], stage: int, bucket_bytes: int,
               owners: dict[int, list[int]], kind: Callable[[nn.Parameter], object] = lambda param: None,
               backward_order: bool = False) -> list[PlannedUnit]:
    """The flat units of ``groups`` (one list of (name, parameter) per param group; no
    unit mixes groups, kinds or dtypes). Stages 1-2: each group's parameters of each kind
    bucketed (``backward_order``: in reverse registration order, as gradients arrive),
    group after group. Stage 3: one unit per (owner module, group, kind, dtype), owner
    after owner (the root's first): ``owners`` maps id(parameter) to the modules holding
    it, and a parameter of no single module is the root's."""
    planned: list[PlannedUnit] = []
    if stage < 3:
        for index, named in enumerate(groups):
            ordered = list(reversed(named)) if backward_order else list(named)
            kinds: dict[object, list] = {}
            for name, param in ordered:
                kinds.setdefault(kind(param), []).append((name, param))
            for key, chosen in kinds.items():
                planned += [PlannedUnit(index, None, key, bucket) for bucket in buckets(chosen, bucket_bytes)]
        return planned
    keyed: dict[tuple, list] = {}
    for index, named in enumerate(groups):
        for name, param in named:
            where = owners.get(id(param), [])
            owner = where[0] if len(where) == 1 else None
            keyed.setdefault((owner, index, kind(param), param.dtype), []).append((name, param))
    order = sorted(keyed, key=lambda key: (-1 if key[0] is None else key[0], key[1]))  # stable in kind, dtype
    return [PlannedUnit(key[1], key[0], key[2], keyed[key]) for key in order]


def group_options(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's options (every one torch filled in), without its parameters."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def check_fresh(optimizer: torch.optim.Optimizer, who: str) -> None:
    """Refuse an optimizer that has stepped: its state belongs to whole parameters.
    (Adagrad creates its state, at step 0, in its constructor: that one is fresh.)"""
    stepped = [state for state in optimizer.state.values()
               if state and ("step" not in state or float(state["step"]) != 0)]
    if stepped:
        raise ValueError(f"{who}: the optimizer has already stepped ({len(stepped)} parameters have state); give it "
                         "before its first step: ZeRO rebuilds its state on this rank's shards")


def model_param_groups(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[tuple[str, nn.Parameter]]]:
    """The optimizer's param groups as (name, parameter) lists of ``module``'s trainable
    parameters; refuses parameters not the module's and trainable ones no group holds."""
    check_elementwise(optimizer)
    check_fresh(optimizer, "ZeRO")
    names = {id(param): name for name, param in module.named_parameters()}
    foreign = [tuple(param.shape) for group in optimizer.param_groups for param in group["params"]
               if id(param) not in names]
    if foreign:
        raise ValueError(f"ZeRO: the optimizer holds {len(foreign)} tensors that are not the wrapped module's "
                         f"parameters (shapes {foreign[:4]}): build it over the model you wrap, e.g. "
                         "torch.optim.AdamW(model.parameters(), lr=3e-4)")
    groups = [[(names[id(param)], param) for param in group["params"] if param.requires_grad]
              for group in optimizer.param_groups]
    held = {id(param) for named in groups for _, param in named}
    left = [name for name, param in module.named_parameters() if param.requires_grad and id(param) not in held]
    if left:
        raise ValueError(f"ZeRO: the optimizer does not hold the trainable parameters {left[:6]}"
                         f"{' ...' if len(left) > 6 else ''}: add them to a param group, or set requires_grad=False")
    order = {id(param): slot for slot, (_, param) in enumerate(module.named_parameters())}
    return [sorted(named, key=lambda pair: order[id(pair[1])]) for named in groups]  # registration order


def build_over_shards(optimizer_class: type, options: list[dict], shards: list[list[nn.Parameter]]):
    """A new ``optimizer_class`` with ``options[g]`` over the shards ``shards[g]`` (groups
    with no shard left out): each group carries every option, so no default matters."""
    return optimizer_class([{**opts, "params": chosen} for opts, chosen in zip(options, shards) if chosen])


def move_onto_shards(optimizer: torch.optim.Optimizer, shards: list[list[nn.Parameter]]) -> None:
    """``optimizer`` itself made to step the shards: each param group keeps its dict (the
    options, what an lr scheduler built over it sets) and gets its shards; the state is a
    fresh one of the shards (built by the class, so Adagrad's initial sums too)."""
    fresh = build_over_shards(type(optimizer), group_options(optimizer), shards)
    for group, chosen in zip(optimizer.param_groups, shards):
        group["params"] = list(chosen)
    optimizer.state = fresh.state


__all__ = ["PlannedUnit", "build_over_shards", "check_fresh", "group_options", "model_param_groups",
           "move_onto_shards", "plan_units"]
