"""Parameters shared by pipeline stages that live on different ranks: found, checked, summed.

A weight used by two stages on different pipeline ranks (GPT-2's tied token embedding
and output head, Hugging Face's default) exists once per holding rank, and the whole
model's gradient of it is the sum of the holders' gradients. ``find_shared`` runs at
``PipelineEngine`` construction (collective over the pipeline group) and says which
parameters are one; ``SharedParameters.sum_gradients`` all-reduces (sums) each one's
gradient over the ranks holding it before the optimiser step (Megatron's "embedding
group"), so every copy steps with the gradient of the whole model.

Every rank describes each parameter its stages hold (its identity keys, shape, dtype
and a digest of its bytes) and all-gathers the descriptions; the decision
(``identify``) is then a pure function of what every rank sees, so a refusal is the
same ValueError on every rank and no rank is left waiting. A parameter's identity is:

- ``model=`` given (the whole model the stages were cut from, built alike on every
  rank): its name in the model (its first name when tied), so ties are found by object
  identity and nothing has to be declared;
- otherwise ``(stage, name)``, its qualified name in a stage module (every name: a tie
  inside one module has two), joined with the other keys of the same object on one rank
  (a parameter two chunks of one rank share) and with the groups ``tied=`` declares.
  The same key on two ranks is one parameter (Chimera's two replicas of a stage).

Without the model, a tie nobody declared is caught by its values: two parameters of
the same shape and dtype whose bytes are equal, held by different ranks, are one
parameter cut twice (every rank built the model from one seed, so the copies of a
tied weight start equal) unless the user says otherwise; construction refuses them,
naming both and the fixes (``model=``, ``tied=[...]``, or ``tied=()`` for none). A
value is no evidence of a tie when it is an initialisation pattern: a constant tensor
(zero biases, LayerNorm's ones), or a value that two distinct parameters of one rank
both hold (every block's identity or ``arange`` init) is ignored, so independent layers
built alike are not refused by mistake. Names are not used to find ties: a hand cut
restarts them per stage ("h.0.ln_1.weight" in both of GPT-2's halves names two
different blocks), and a weight tied across stages has a different name in each
("wte.weight", "lm_head.weight"). A tied weight that starts constant cannot be told
from independent ones by its values: declare it (or pass the model).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.comm.errors import CommError
from plait.parallel.pipeline.messages import PipelineError
from plait.parallel.pipeline.schedules import ALL_REDUCE, PipelineSchedule


@dataclass(frozen=True)
class Held:
    """One parameter as a rank describes it to the others."""

    keys: tuple  # its identity: (model name,) with model=, else every (stage, qualified name) it has here
    shape: tuple[int, ...]
    dtype: str
    digest: str | None  # blake2b of its bytes (None: not readable, e.g. on the meta device)
    pattern: bool  # constant, or equal to another distinct parameter of this rank: not a sign of a tie
    trainable: bool


@dataclass
class Identified:
    """What every rank concludes from every rank's ``Held`` lists."""

    holders: dict[str, tuple[int, ...]]  # parameter (class) name -> pipeline ranks holding it
    class_of: dict[object, str] = field(default_factory=dict)  # identity key -> its parameter's name


@dataclass
class SharedParameters:
    """The parameters this rank shares with other pipeline ranks, and their groups."""

    rank: int
    ranks_of: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> pipeline ranks holding it
    groups: list[tuple[tuple[int, ...], list[str], list[nn.Parameter], object]] = field(default_factory=list)
    replica_skip: set[int] = field(default_factory=set)  # ids Chimera's replica exchange leaves to a group

    def sum_gradients(self) -> None:
        """Each shared parameter's gradient := the sum of its holders' gradients (one
        all-reduce per holder set and dtype: 2(k-1)/k · n bytes per rank with a ring)."""
        for ranks, names, params, group in self.groups:
            trained = [param for param in params if param.requires_grad]  # a frozen one keeps grad None
            for dtype in sorted({param.dtype for param in trained}, key=str):
                chosen = [param for param in trained if param.dtype == dtype]
                flat = torch.cat([param.grad.reshape(-1) if param.grad is not None else
                                  torch.zeros(param.numel(), dtype=dtype, device=param.device) for param in chosen])
                try:
                    comm.all_reduce(flat, group=group)
                except CommError as error:
                    raise PipelineError(f"rank {self.rank}: summing the gradients of shared parameters {names} "
                                        f"over pipeline ranks {list(ranks)}: {error}") from error
                offset = 0
                for param in chosen:
                    param.grad = flat[offset:offset + param.numel()].view_as(param).clone()
                    offset += param.numel()


def find_shared(stages: dict[int, nn.Module], schedule: PipelineSchedule, rank: int, group, *,
                model: nn.Module | None = None, tied=None) -> SharedParameters:
    """The parameters of ``stages`` (this rank's) that other pipeline ranks hold too,
    with one process group per set of holders (see the module docstring). Collective
    over ``group`` (the pipeline's process group; None: the world) when the pipeline has
    more than one rank or ``model``/``tied`` is given, and over the world too when
    ``group`` is a subgroup and ``model``/``tied`` is given (``new_group`` is collective
    over the world: every rank makes every pipeline's groups, in one order)."""
    declared = model is not None or tied is not None
    if schedule.ranks == 1 and not declared:
        return SharedParameters(rank)  # one rank: nothing is held twice
    described, params = describe(stages, rank, model, tied)
    everyone: list = [None] * schedule.ranks
    dist.all_gather_object(everyone, described, group=group)
    identified = identify(everyone, schedule, by_model=model is not None, tied=tied)
    held = {identified.class_of[entry.keys[0]]: param for entry, param in zip(described[0], params)}
    shared = {name: ranks for name, ranks in identified.holders.items() if len(ranks) > 1}
    partner = schedule.ranks - 1 - rank
    replica_pair = tuple(sorted({rank, partner}))
    chimera = any(action.kind == ALL_REDUCE for action in schedule.actions[rank])
    # Chimera's replica exchange already sums a parameter held by exactly this rank and its partner
    summed_elsewhere = {name for name, ranks in shared.items() if chimera and ranks == replica_pair}
    found = SharedParameters(rank, {name: ranks for name, ranks in shared.items() if name not in summed_elsewhere})
    found.replica_skip = {id(held[name]) for name in found.ranks_of if name in held}
    needed = sorted(set(found.ranks_of.values()))
    # (undeclared, only a Chimera stage's two replicas share keys, and their exchange sums them: nothing is needed)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    wanted = sorted({tuple(to_global(r) for r in ranks) for ranks in needed})
    if declared and group is not None and dist.get_world_size() > schedule.ranks:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, wanted)
        wanted = sorted({ranks for groups in every for ranks in groups})
    made = {ranks: dist.new_group(list(ranks)) for ranks in wanted}
    for ranks in needed:
        if rank in ranks:
            names = sorted(name for name, holder in found.ranks_of.items() if holder == ranks)
            found.groups.append((ranks, names, [held[name] for name in names], made[tuple(map(to_global, ranks))]))
    return found


def describe(stages: dict[int, nn.Module], rank: int, model: nn.Module | None, tied):
    """((this rank's Held list, its errors), the parameters in the same order): every
    parameter of ``stages`` once, keyed by its model name or its (stage, name) pairs."""
    errors: list[str] = []
    name_of = {} if model is None else {id(param): name for name, param in model.named_parameters()}
    keys: dict[int, list] = {}
    params: dict[int, nn.Parameter] = {}
    for stage, module in sorted(stages.items()):
        for name, param in module.named_parameters(remove_duplicate=False):
            params.setdefault(id(param), param)
            if model is None:
                keys.setdefault(id(param), []).append((stage, name))
            elif id(param) not in name_of:
                errors.append(f"stage {stage} on pipeline rank {rank} holds {name} {tuple(param.shape)}, which is "
                              "not a parameter of the model given as model=: pass the model the stage modules "
                              "were cut from")
            else:
                keys[id(param)] = [name_of[id(param)]]
    if tied is not None:
        for group in tied:
            for stage, name in group:
                if stage in stages and not any((stage, name) in found for found in keys.values()):
                    known = ", ".join(repr(known) for known, _ in stages[stage].named_parameters())
                    errors.append(f"tied= names parameter {name!r} of stage {stage}, which stage {stage} on pipeline "
                                  f"rank {rank} does not have (its parameters: {known:.200})")
    ordered = [param for pid, param in params.items() if pid in keys]
    digests = [_digest(param) for param in ordered]
    repeated = {}
    for param, digest in zip(ordered, digests):
        signature = (tuple(param.shape), str(param.dtype), digest)
        repeated[signature] = repeated.get(signature, 0) + 1
    held = [Held(keys=tuple(keys[id(param)]), shape=tuple(param.shape), dtype=str(param.dtype), digest=digest,
                 pattern=digest is None or _constant(param) or repeated[(tuple(param.shape), str(param.dtype),
                                                                          digest)] > 1,
                 trainable=param.requires_grad)
            for param, digest in zip(ordered, digests)]
    return (held, errors), ordered


def identify(everyone: list, schedule: PipelineSchedule, *, by_model: bool, tied=None) -> Identified:
    """Which parameters are one, from every rank's ``describe`` (the same answer, or the
    same ValueError, on every rank). ``everyone[r]`` = (Held list, errors) of pipeline
    rank r."""
    errors = [error for _, rank_errors in everyone for error in rank_errors]
    if errors:
        raise ValueError("PipelineEngine: " + "; ".join(errors))
    parent: dict = {}

    def find(key):
        parent.setdefault(key, key)
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    def union(a, b):
        a, b = find(a), find(b)
        if a != b:
            parent[max(a, b, key=_order)] = min(a, b, key=_order)  # the smallest key names the parameter

    for described, _ in everyone:
        for entry in described:
            for key in entry.keys:
                union(entry.keys[0], key)
    for group in tied or ():
        for pair in group:
            union(tuple(group[0]), tuple(pair))
    members: dict = {}  # root -> [(rank, Held)]
    for rank, (described, _) in enumerate(everyone):
        for entry in described:
            members.setdefault(find(entry.keys[0]), []).append((rank, entry))
    for root, entries in members.items():
        _check_one(root, entries, by_model)
    if not by_model and tied is None:
        _refuse_look_alikes(members)
    identified = Identified({_label(root): tuple(sorted({rank for rank, _ in entries}))
                             for root, entries in members.items()})
    identified.class_of = {key: _label(find(key)) for key in parent}
    return identified


def _check_one(root, entries, by_model: bool) -> None:
    """Every copy of one parameter has one shape, dtype and initial value, and one rank
    holds it as one tensor."""
    what = f"parameter {root}" if by_model else f"parameter {_pair(root)} (tied=)"
    ranks = [rank for rank, _ in entries]
    twice = sorted({rank for rank in ranks if ranks.count(rank) > 1})
    if twice:
        keys = [_pair(key) for rank, entry in entries if rank == twice[0] for key in entry.keys]
        raise ValueError(f"PipelineEngine: tied= makes {', '.join(keys)} one parameter, but pipeline rank "
                         f"{twice[0]} holds them as different tensors: a weight shared within one rank must be one "
                         "nn.Parameter (assign the same object to both modules)")
    first_rank, first = entries[0]
    for rank, entry in entries[1:]:
        if (entry.shape, entry.dtype) != (first.shape, first.dtype):
            raise ValueError(f"PipelineEngine: {what} is {first.shape} {first.dtype} on pipeline rank {first_rank} "
                             f"but {entry.shape} {entry.dtype} on pipeline rank {rank}: build every rank's model alike")
        if None not in (entry.digest, first.digest) and entry.digest != first.digest:
            raise ValueError(f"PipelineEngine: {what} held by pipeline ranks {first_rank} and {rank} starts with "
                             "different values: build every rank's model from the same seed")


def _refuse_look_alikes(members: dict) -> None:
    """Two parameters of equal shape, dtype and bytes on different ranks, neither an
    initialisation pattern, that nothing declared one or independent: refused."""
    # a value that is a pattern on any rank is no evidence anywhere (one block per rank has no twin to show it)
    patterns = {(entry.shape, entry.dtype, entry.digest) for entries in members.values() for _, entry in entries
                if entry.pattern}
    alike: dict = {}  # (shape, dtype, digest) -> [(root, rank, key)]
    for root, entries in sorted(members.items(), key=lambda item: _order(item[0])):
        for rank, entry in entries:
            signature = (entry.shape, entry.dtype, entry.digest)
            if entry.trainable and signature not in patterns:
                alike.setdefault(signature, []).append((root, rank, entry.keys[0]))
    pairs = []
    for (shape, dtype, _), found in alike.items():
        pair = next(((a, b) for index, a in enumerate(found) for b in found[index + 1:]
                     if a[0] != b[0] and a[1] != b[1]), None)
        if pair is not None:
            pairs.append((pair, shape, dtype))
    if not pairs:
        return
    pairs.sort(key=lambda item: (_order(item[0][0][2]), _order(item[0][1][2])))
    named = "; ".join(f"stage {key_a[0]} {key_a[1]!r} on pipeline rank {rank_a} and stage {key_b[0]} {key_b[1]!r} "
                      f"on pipeline rank {rank_b} ({shape} {dtype})"
                      for ((_, rank_a, key_a), (_, rank_b, key_b)), shape, dtype in pairs)
    groups = ", ".join(f"[{_pair(key_a)}, {_pair(key_b)}]" for ((_, _, key_a), (_, _, key_b)), _, _ in pairs)
    raise ValueError(f"PipelineEngine: {named} look like {'one shared weight' if len(pairs) == 1 else 'shared weights'}"
                     " (the same shape, dtype and initial values on two ranks, as a tied embedding and output head "
                     "have) but nothing says whether they are: pass model= (the whole model the stages were cut "
                     f"from) so ties are found by identity, or tied=[{groups}] for those that are one parameter "
                     "(their gradients are then summed), or tied=() if they are independent")


def _digest(param: torch.Tensor) -> str | None:
    local = param.to_local() if hasattr(param, "to_local") else param  # a DTensor: this rank's shard
    if local.device.type == "meta":
        return None
    data = local.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def _constant(param: torch.Tensor) -> bool:
    flat = (param.to_local() if hasattr(param, "to_local") else param).detach().reshape(-1)
    return flat.numel() == 0 or bool((flat == flat[0]).all())


def _order(key):
    """Keys sort as (stage, name) pairs or model names; never compare the two kinds."""
    return (0, key, "") if isinstance(key, tuple) else (1, 0, key)


def _pair(key) -> str:
    return repr(tuple(key)) if isinstance(key, tuple) else str(key)


def _label(root) -> str:
    """A parameter's name: its model name, or 'stage s: name' (its smallest key)."""
    return f"stage {root[0]}: {root[1]}" if isinstance(root, tuple) else root
