"""Writing a sharded training checkpoint (the layout and payload are described in
plait.train.checkpoint): each (tp, pp) shard written atomically by its dp-rank-0
process (``write_shard``), then the manifest, the commit point, by global rank 0
(``write_manifest``), which refuses a manifest that ``verify`` would not believe."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from plait.parallel.tensor.sharding import ShardSpec
from plait.train.atomic_files import atomic_write, torch_save
from plait.train.checkpoint_checks import (FORMAT, MANIFEST_NAME, check_header, manifest_problems, problems_summary,
                                          shard_name)


class CheckpointNotWritten(OSError):
    """A save failed on some rank; every rank raises it, naming each failure."""

    def __init__(self, step: int, failures: list[str]):
        super().__init__(f"checkpoint at step {step} not written (the previous complete one stays): "
                         + "; ".join(failures))


def payload_nbytes(value) -> int:
    """Bytes of the tensors in a (nested) payload: about its size on disk."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(payload_nbytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(item) for item in value)
    return 0


def file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _file_entry(path: Path) -> dict:
    return {"name": path.name, "nbytes": path.stat().st_size, "sha256": file_sha256(path)}


def _check_loadable(value, where: str) -> None:
    """Raise unless ``value`` is built from what ``torch.load(weights_only=True)`` reads."""
    if isinstance(value, (torch.Tensor, int, float, bool, str, type(None))):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; use str or int keys")
            _check_loadable(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_loadable(item, f"{where}[{index}]")
        return
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which "
                    "torch.load(weights_only=True) cannot read back; store it as a tensor, int, float, str, "
                    "or a list/dict of those")


def _compact(value):
    """Views cloned to their own storage: torch.save writes a tensor's whole storage."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.untyped_storage().nbytes() != value.numel() * value.element_size() or not value.is_contiguous():
            value = value.clone(memory_format=torch.contiguous_format)
        return value.cpu()
    if isinstance(value, dict):
        return {key: _compact(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_compact(item) for item in value)
    return value


def _spec_entry(spec, name: str) -> list[int] | None:
    """None, ShardSpec, (dim, full_size) or [dim, full_size] -> [dim, full_size] | None;
    a fused layout's parts follow: [dim, full_size, *parts] (checkpoint_load puts them back)."""
    if spec is None:
        return None
    if isinstance(spec, ShardSpec):
        return [spec.dim, spec.full_size, *(spec.parts or ())]
    if isinstance(spec, (list, tuple)) and len(spec) >= 2 and all(type(x) is int for x in spec) and \
            (len(spec) == 2 or sum(spec[2:]) == spec[1]):
        return list(spec)
    raise ValueError(f"specs[{name!r}] = {spec!r}: use None (replicated), [dim, full_size] or [dim, full_size, "
                     "*parts] (a fused layout's parts, summing to full_size)")


def write_shard(directory: str | os.PathLike, name: str, payload: dict) -> dict:
    """Write one (tp, pp) shard atomically; returns {"name", "nbytes", "sha256"} for
    ``write_manifest``. Specs may be ShardSpec or (dim, full_size); views are cloned
    so the file holds only their elements. Cost: one write plus one read to hash."""
    directory = Path(directory)
    if not name or name != Path(name).name or name == MANIFEST_NAME:
        raise ValueError(f"shard name {name!r} must be a plain file name other than {MANIFEST_NAME}, "
                         "e.g. shard_name(tp_rank, pp_rank)")
    check_header(payload, name)
    if re.fullmatch(r"tp\d+-pp\d+\.pt", name) and name != shard_name(payload["tp_rank"], payload["pp_rank"]):
        raise ValueError(f"shard name {name!r} does not match tp_rank {payload['tp_rank']}, pp_rank "
                         f"{payload['pp_rank']}: use shard_name(tp_rank, pp_rank)")
    payload = dict(payload)
    payload["specs"] = {key: _spec_entry(spec, key) for key, spec in payload["specs"].items()}
    payload.setdefault("optimizer", {})
    payload.setdefault("extra", {})
    tp_size = payload["tp_size"]
    for key, tensor in payload["model"].items():
        spec = payload["specs"][key]
        if spec is not None and (spec[0] >= tensor.dim() or tensor.shape[spec[0]] != -(-spec[1] // tp_size)):
            raise ValueError(f"{name}: {key} has shape {tuple(tensor.shape)} but spec {spec} at tp_size "
                             f"{tp_size} means {-(-spec[1] // tp_size)} along dim {spec[0]}")
    _check_loadable(payload, "payload")
    payload = _compact(payload)
    path = directory / name
    atomic_write(path, lambda temp: torch_save(payload, temp), nbytes=payload_nbytes(payload) + (1 << 16))
    return _file_entry(path)


def write_manifest(directory: str | os.PathLike, manifest: dict, files: list[dict]) -> Path:
    """Commit the checkpoint: manifest.json (``manifest`` plus "format" and "files"
    {name: {nbytes, sha256}}) written atomically after every shard. ``files`` are
    write_shard's results, the tp x pp grid of ``manifest["mesh"]``; ``manifest``
    records "step" (its directory's) and "data_position" (the same), as verify requires."""
    directory = Path(directory)
    entries = {}
    for entry in files:
        if entry["name"] in entries:
            raise ValueError(f"{entry['name']} is listed twice in files")
        entries[entry["name"]] = {"nbytes": int(entry["nbytes"]), "sha256": str(entry["sha256"])}
    mesh = manifest.get("mesh")
    if mesh is not None:
        expected = {shard_name(tp, pp) for tp in range(mesh["tp"]) for pp in range(mesh["pp"])}
        if set(entries) != expected:
            raise ValueError(f"files do not match mesh tp={mesh['tp']} pp={mesh['pp']}: missing "
                             f"{sorted(expected - set(entries))}, unexpected {sorted(set(entries) - expected)}")
    for name, entry in entries.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry["nbytes"]:
            raise ValueError(f"{path} is missing or not {entry['nbytes']} bytes: write every shard (and wait for "
                             "all writers) before the manifest")
    document = {**manifest, "format": FORMAT, "files": entries}
    problems = manifest_problems(directory, document)  # what verify would refuse is never written
    if problems:
        raise ValueError(f"manifest not written to {directory}: {problems_summary(problems)}")
    text = json.dumps(document, indent=2) + "\n"  # a TypeError here names the value that is not JSON
    path = directory / MANIFEST_NAME
    atomic_write(path, lambda temp: Path(temp).write_text(text), nbytes=len(text.encode()))
    return path
