"""Loading a sharded training checkpoint (plait.train.checkpoint writes them): every
(tp, pp) shard read and checked against its manifest, the tp slices joined into full
tensors (``load_full``), then cut again for this rank's tensor-parallel degree
(``reshard``), so a checkpoint saved at one tp loads at any other; and the checks
that a checkpoint belongs to this model and this data before a run resumes from it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from plait.parallel.tensor.sharding import ShardSpec, fused_gather_index, shard_tensor
from plait.train.checkpoint import problems_summary, verify
from plait.train.checkpoint_checks import check_header, read_manifest, shard_name


def _agree(values: list, what: str) -> object:
    """values[0] after checking every tp rank's copy equals it."""
    first = values[0]
    for tp_rank, value in enumerate(values[1:], start=1):
        if isinstance(first, torch.Tensor):
            same = (isinstance(value, torch.Tensor) and value.shape == first.shape and value.dtype == first.dtype
                    and torch.equal(value, first))
        else:
            same = value == first
        if not same:
            raise ValueError(f"{what} differs between tp rank 0 and tp rank {tp_rank} though it is replicated; the "
                             "checkpoint is inconsistent (pass check_replicas=False to take tp rank 0's copy)")
    return first


def _concat(pieces: list[torch.Tensor], spec: list[int], what: str) -> torch.Tensor:
    """The unsharded tensor: the tp slices concatenated along dim, padding dropped; a
    fused layout's parts ([dim, full_size, *parts]: each rank holds its 1/tp of every
    part) put back in the unsharded order."""
    dim, full_size, *parts = spec
    size = -(-full_size // len(pieces))
    for tp_rank, piece in enumerate(pieces):
        if piece.dim() <= dim or piece.shape[dim] != size or piece.shape != pieces[0].shape:
            raise ValueError(f"{what} on tp rank {tp_rank} has shape {tuple(piece.shape)}; spec {spec} at tp_size "
                             f"{len(pieces)} needs {size} along dim {dim}, the same on every rank")
    full = torch.cat(pieces, dim=dim)
    if parts:
        return full.index_select(dim, fused_gather_index(tuple(parts), len(pieces)))
    return full.narrow(dim, 0, full_size).clone() if full.shape[dim] != full_size else full


def _load_grid(directory: Path, manifest: dict) -> dict[tuple[int, int], dict]:
    """{(tp_rank, pp_rank): payload}, checked to be the complete tp x pp grid."""
    grid, sizes = {}, set()
    for name in manifest["files"]:
        try:  # O_NOFOLLOW: a shard replaced by a link since it was verified is not read through it
            with os.fdopen(os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as file:
                payload = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises several types for a damaged zip
            raise ValueError(f"{directory / name} cannot be loaded ({type(error).__name__}: {error}); run "
                             "`plait checkpoint info` on the directory") from None
        check_header(payload, str(directory / name))
        coordinate = (payload["tp_rank"], payload["pp_rank"])
        if name != shard_name(*coordinate) or coordinate in grid:
            raise ValueError(f"{directory / name} holds tp_rank {coordinate[0]}, pp_rank {coordinate[1]}, which "
                             "does not match its name or repeats another file's")
        grid[coordinate] = payload
        sizes.add((payload["tp_size"], payload["pp_size"]))
    mesh = manifest.get("mesh", {})
    if len(sizes) != 1 or (mesh and {(mesh["tp"], mesh["pp"])} != sizes):
        raise ValueError(f"{directory}: shards disagree on (tp_size, pp_size): {sorted(sizes)}, manifest mesh "
                         f"{mesh}")
    tp_size, pp_size = sizes.pop()
    missing = [shard_name(tp, pp) for pp in range(pp_size) for tp in range(tp_size) if (tp, pp) not in grid]
    if missing:
        raise ValueError(f"{directory} is incomplete for tp_size {tp_size}, pp_size {pp_size}: missing {missing}")
    return grid


def load_full(directory: str | os.PathLike, *, check_files: bool = True, check_replicas: bool = True,
              manifest: dict | None = None) -> tuple[dict, dict, dict, dict]:
    """(manifest, model {name: unsharded tensor}, optimizer {name: {key: value}},
    specs {name: [dim, full_size] | None}) from every shard of a checkpoint.
    Sharded tensors (and optimizer state shaped like their shard) are concatenated
    in tp-rank order and trimmed to full_size; replicated ones and other state (e.g.
    0-dim step) come from tp rank 0, checked equal on the others. ``check_files``
    verifies sizes and sha256 first (skip it right after ``latest_complete``).
    ``manifest``: the one about to be written (its "files" and "mesh"), to read a
    checkpoint's shards before its commit point (plait.train.checkpoint_dcp)."""
    directory = Path(directory)
    problems = verify(directory) if check_files and manifest is None else []
    if problems:
        raise ValueError(f"{directory} is not a complete checkpoint: {problems_summary(problems)}; resume from an older "
                         "one (latest_complete picks it)")
    manifest = read_manifest(directory) if manifest is None else manifest
    grid = _load_grid(directory, manifest)
    tp_size = 1 + max(tp for tp, _ in grid)
    pp_size = 1 + max(pp for _, pp in grid)
    model, optimizer, specs, stage_of = {}, {}, {}, {}
    for pp in range(pp_size):
        shards = [grid[(tp, pp)] for tp in range(tp_size)]
        for tp, shard in enumerate(shards):
            if set(shard["model"]) != set(shards[0]["model"]) or shard["specs"] != shards[0]["specs"]:
                raise ValueError(f"{shard_name(tp, pp)} and {shard_name(0, pp)} hold different tensors or specs")
        for name, spec in shards[0]["specs"].items():
            if name in stage_of:
                raise ValueError(f"{name} is in pipeline stages {stage_of[name]} and {pp}; each parameter belongs "
                                 "to one stage")
            stage_of[name] = pp
            what = f"{name} (pp {pp})"
            pieces = [shard["model"][name] for shard in shards]
            specs[name] = spec
            if spec is None:
                model[name] = _agree(pieces, what) if check_replicas else pieces[0]
            else:
                model[name] = _concat(pieces, spec, what)
            states = [shard.get("optimizer", {}).get(name) for shard in shards]
            if all(state is None for state in states):
                continue
            if any(state is None or set(state) != set(states[0]) for state in states):
                raise ValueError(f"optimizer state of {what} has different keys on different tp ranks")
            optimizer[name] = {}
            for key in states[0]:
                values = [state[key] for state in states]
                shaped = all(isinstance(value, torch.Tensor) and value.shape == piece.shape
                             for value, piece in zip(values, pieces))
                if spec is not None and shaped:
                    optimizer[name][key] = _concat(values, spec, f"{what} optimizer {key!r}")
                else:
                    optimizer[name][key] = _agree(values, f"{what} optimizer {key!r}") if check_replicas \
                        else values[0]
    return manifest, model, optimizer, specs


def reshard(full_model: dict, full_optimizer: dict, specs: dict, tp_rank: int, tp_size: int,
            names) -> tuple[dict, dict]:
    """(model shard, optimizer shard) of tp rank ``tp_rank`` of ``tp_size`` for the
    parameters ``names`` (this rank's stages): each sharded tensor, and optimizer
    state of its full shape, sliced by shard_tensor (zero rows for vocab padding)."""
    if not (type(tp_rank) is int and type(tp_size) is int and 0 <= tp_rank < tp_size):
        raise ValueError(f"tp_rank={tp_rank!r}, tp_size={tp_size!r}: need 0 <= tp_rank < tp_size")
    names = list(names)
    missing = [name for name in names if name not in full_model or name not in specs]
    if missing:
        raise ValueError(f"the checkpoint has no parameter {missing}; it was saved for a different model (compare "
                         "with check_compatible) or start a new run")
    model_shard, optimizer_shard = {}, {}
    for name in names:
        full = full_model[name]
        dim, full_size, *parts = specs[name] or (0, 0)
        spec = None if specs[name] is None else ShardSpec(dim, full_size, tuple(parts) or None)
        model_shard[name] = shard_tensor(full, spec, tp_rank, tp_size).clone()
        if name in full_optimizer:
            optimizer_shard[name] = {
                key: shard_tensor(value, spec, tp_rank, tp_size).clone()
                if isinstance(value, torch.Tensor) and value.shape == full.shape
                else (value.clone() if isinstance(value, torch.Tensor) else value)
                for key, value in full_optimizer[name].items()}
    return model_shard, optimizer_shard


def check_compatible(manifest: dict, model: dict, what: str = "checkpoint") -> None:
    """Raise ValueError naming every field where the checkpoint's model (GPTConfig
    dict, saved value first) differs from ``model``."""
    saved = manifest.get("model", {})
    differing = [f"{key} {saved.get(key, '<absent>')} != {model.get(key, '<absent>')}"
                 for key in list(saved) + [key for key in model if key not in saved]
                 if saved.get(key, "<absent>") != model.get(key, "<absent>")]
    if differing:
        step = manifest.get("step")
        label = f"step_{step:08d}" if isinstance(step, int) else "(unknown step)"
        raise ValueError(f"{what} {label} was saved for a different model: {', '.join(differing)}; train with the "
                         "same model settings or start a new --out directory")


def check_same_data(manifest: dict, corpus_digest: str | None) -> None:
    """Raise ValueError unless the checkpoint was trained on the data of ``corpus_digest``."""
    if manifest.get("corpus_digest") != corpus_digest:
        step = manifest.get("step")
        label = f"step_{step:08d}" if isinstance(step, int) else "(unknown step)"
        raise ValueError(f"checkpoint {label} was trained on different data ({manifest.get('corpus_digest')} != "
                         f"{corpus_digest}): resume with the same --data, --data-max-bytes and --val-fraction, or "
                         "start a new --out directory")
