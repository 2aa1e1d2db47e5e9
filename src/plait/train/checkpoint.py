"""Sharded training checkpoints: one file per (tp, pp) coordinate, a manifest as the
commit point, and resharding to another tensor-parallel degree on load.

Layout: ``RUN/checkpoints/step_00000100/{tp0-pp0.pt, ..., manifest.json}``. The
dp-rank-0 process of every (tp, pp) coordinate writes its shard (``write_shard``),
then global rank 0 writes ``manifest.json`` listing every file's size and sha256
(``write_manifest``). Every file is written to a temporary name, fsynced and renamed,
so a directory without a readable manifest is a partial checkpoint (a crash during
the save) and is skipped by ``latest_complete``.

A shard payload (``torch.save``; loads with ``weights_only=True``)::

    {"format": 1, "tp_rank", "tp_size", "pp_rank", "pp_size": int,
     "model": {name: this rank's slice}, "specs": {name: [dim, full_size] | None},
     "optimizer": {name: {key: tensor}}, "extra": {...}}

Names are those of the unsharded ``GPT``. A sharded tensor's slice on rank r of p is
rows [r*c, (r+1)*c) along ``dim`` of the full tensor zero-padded to p*c rows,
c = ceil(full_size / p) (``plait.parallel.tensor.sharding.shard_tensor``): loading
concatenates the p slices in rank order and drops the padding, so a checkpoint saved
at one tp loads at any other (``plait.train.checkpoint_load``: ``load_full`` then
``reshard``). Cost: a save writes
each parameter and its optimizer state once per (tp, pp) shard, about
3 x 4 bytes x parameters for fp32 AdamW; ``load_full`` holds every shard in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from plait.parallel.tensor.sharding import ShardSpec
from plait.train.atomic_files import atomic_write, torch_save

FORMAT = 1
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """RUN/checkpoints/step_{step:08d}."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def shard_name(tp_rank: int, pp_rank: int) -> str:
    """The file of tensor-parallel rank ``tp_rank`` of pipeline stage ``pp_rank``."""
    return f"tp{tp_rank}-pp{pp_rank}.pt"


# ----------------------------------------------------------------------------- writing

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


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _file_entry(path: Path) -> dict:
    return {"name": path.name, "nbytes": path.stat().st_size, "sha256": _sha256(path)}


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
    """None, ShardSpec, (dim, full_size) or [dim, full_size] -> [dim, full_size] | None."""
    if spec is None:
        return None
    if isinstance(spec, ShardSpec):
        return [spec.dim, spec.full_size]
    if isinstance(spec, (list, tuple)) and len(spec) == 2 and all(type(x) is int for x in spec):
        return [spec[0], spec[1]]
    raise ValueError(f"specs[{name!r}] = {spec!r}: use None (replicated) or [dim, full_size]")


def check_header(payload: dict, where: str) -> None:
    """The shard payload's format, coordinates and key sets (``where`` names the file)."""
    if not isinstance(payload, dict):
        raise ValueError(f"{where}: a shard payload is a dict, got {type(payload).__name__}")
    missing = [key for key in ("format", "tp_rank", "tp_size", "pp_rank", "pp_size", "model", "specs")
               if key not in payload]
    if missing:
        raise ValueError(f"{where}: shard payload lacks {missing}")
    if payload["format"] != FORMAT:
        raise ValueError(f"{where}: shard format {payload['format']!r} != {FORMAT}; this plait reads format "
                         f"{FORMAT} only")
    for axis in ("tp", "pp"):
        rank, size = payload[f"{axis}_rank"], payload[f"{axis}_size"]
        if not (type(rank) is int and type(size) is int and 0 <= rank < size):
            raise ValueError(f"{where}: {axis}_rank={rank!r}, {axis}_size={size!r}: need 0 <= rank < size")
    if set(payload["model"]) != set(payload["specs"]):
        raise ValueError(f"{where}: model and specs name different tensors: "
                         f"{sorted(set(payload['model']) ^ set(payload['specs']))}")
    extra = sorted(set(payload.get("optimizer", {})) - set(payload["model"]))
    if extra:
        raise ValueError(f"{where}: optimizer state for tensors not in model: {extra}")


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
    write_shard's results; with ``manifest["mesh"]`` they must be its tp x pp grid."""
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
    text = json.dumps(document, indent=2) + "\n"  # a TypeError here names the value that is not JSON
    path = directory / MANIFEST_NAME
    atomic_write(path, lambda temp: Path(temp).write_text(text), nbytes=len(text.encode()))
    return path


# ----------------------------------------------------------------------------- finding

def read_manifest(directory: str | os.PathLike) -> dict:
    """The parsed manifest.json of a checkpoint directory (ValueError if absent or bad)."""
    path = Path(directory) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path.parent} has no {MANIFEST_NAME}: it is a partial checkpoint (the save did not "
                         "finish) or not a checkpoint directory; use an older step_* directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is unreadable ({error}); use an older step_* directory") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"),
                                                                                             dict):
        raise ValueError(f"{path}: not a format-{FORMAT} plait manifest (need \"format\": {FORMAT} and \"files\")")
    outside = [name for name in manifest["files"] if not is_plain_name(name)]
    if outside:
        raise UnsafeManifest(path, outside)
    return manifest


class UnsafeManifest(ValueError):
    """A manifest that names files outside its checkpoint directory."""

    def __init__(self, path: Path, names: list):
        self.names = names
        super().__init__(f"{path} lists {', '.join(map(repr, names[:3]))}: a checkpoint's files are plain names "
                         "inside its directory (no '/', '..' or absolute paths); this checkpoint is not valid")


def is_plain_name(name) -> bool:
    """A file name that stays in its directory: no separators, not '.' or '..', not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST_NAME) and "/" not in name
            and "\\" not in name and "\x00" not in name and Path(name).name == name)


def verify(directory: str | os.PathLike, *, check_sha256: bool = True) -> list[str]:
    """Why ``directory`` is not a complete checkpoint; [] if it is. Reads every file
    to hash it (``check_sha256=False``: sizes only, no reads)."""
    directory = Path(directory)
    if not (directory / MANIFEST_NAME).exists():
        return [f"no {MANIFEST_NAME} (partial: the save did not finish)"]
    if (directory / MANIFEST_NAME).is_symlink():
        return [f"{MANIFEST_NAME} is a symbolic link (a checkpoint's files are regular files inside it)"]
    try:
        manifest = read_manifest(directory)
    except UnsafeManifest as error:
        return [f"{MANIFEST_NAME} lists files outside the checkpoint directory: "
                f"{', '.join(map(repr, error.names[:3]))} (not valid)"]
    except ValueError:
        return [f"{MANIFEST_NAME} unreadable"]
    problems = []
    for name, entry in manifest["files"].items():
        path = directory / name
        if path.is_symlink():
            problems.append(f"{name} is a symbolic link (a checkpoint's files are regular files inside it)")
        elif not path.is_file():
            problems.append(f"{name} missing")
        elif (nbytes := path.stat().st_size) != entry.get("nbytes"):
            problems.append(f"{name} is {nbytes} bytes, manifest says {entry.get('nbytes')} (truncated or "
                            "overwritten)")
        elif check_sha256 and _sha256(path) != entry.get("sha256"):
            problems.append(f"{name} sha256 mismatch (corrupt)")
    return problems


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every RUN/checkpoints/step_* directory, oldest (lowest step) first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in root.iterdir()
             if path.is_dir() and (match := _STEP_DIR.match(path.name))]
    return [path for _, path in sorted(found)]


def problems_summary(problems: list[str]) -> str:
    shown = "; ".join(problems[:3])
    return shown + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")


def latest_complete(run_dir: str | os.PathLike, log: Callable[[str], None] | None = print) -> Path | None:
    """The newest checkpoint that verifies (None if none does); logs one line per newer
    one skipped: "step_00000200: tp0-pp1.pt sha256 mismatch (corrupt): using step_00000100"."""
    skipped = []
    chosen = None
    for path in reversed(list_checkpoints(run_dir)):
        problems = verify(path)
        if not problems:
            chosen = path
            break
        skipped.append((path, problems))
    using = f"using {chosen.name}" if chosen is not None else "no complete checkpoint left"
    for path, problems in skipped:
        if log is not None:
            log(f"{path.name}: {problems_summary(problems)}: {using}")
    return chosen


def resolve(path: str | os.PathLike, log: Callable[[str], None] | None = print) -> tuple[Path, bool]:
    """(checkpoint directory, verified): ``path`` itself if it is a checkpoint
    directory (not yet verified), or a run directory's latest complete checkpoint
    (verified by ``latest_complete``, which logs what it skipped)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist: pass a run directory (with checkpoints/) or a checkpoint "
                         "directory (checkpoints/step_*)")
    if (path / MANIFEST_NAME).exists() or _STEP_DIR.match(path.name):
        return path, False
    if (path / "checkpoints").is_dir():
        chosen = latest_complete(path, log=log)
        if chosen is None:
            raise ValueError(f"{path} has no complete checkpoint (none of {len(list_checkpoints(path))} step_* "
                             "directories under checkpoints/ verifies)")
        return chosen, True
    raise ValueError(f"{path} is neither a checkpoint directory (no {MANIFEST_NAME}) nor a run directory (no "
                     "checkpoints/)")


def prune(run_dir: str | os.PathLike, keep: int, *, check_sha256: bool = False,
          log: Callable[[str], None] | None = print) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and partial ones (no
    manifest: a save that never finished) older than the newest complete; returns the
    deleted directories. Complete means the manifest is readable and every file has
    its size (``check_sha256``: also hashed). A corrupt checkpoint (a manifest whose
    files do not match it) is never deleted as if it were old: it is renamed
    ``step_N.corrupt`` (out of rotation) and logged."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be an int >= 1 (the newest complete checkpoint is never deleted)")
    paths = list_checkpoints(run_dir)
    problems = {path: verify(path, check_sha256=check_sha256) for path in paths}
    complete = [path for path in paths if not problems[path]]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = paths.index(complete[-1])
    doomed = []
    for path in paths[:newest]:
        if path in kept:
            continue
        if problems[path] and (path / MANIFEST_NAME).exists():
            target = set_aside(path, "corrupt")
            if log is not None:
                log(f"{path.name}: {problems_summary(problems[path])}: kept as {target.name}, not pruned")
            continue
        doomed.append(path)
    for path in doomed:
        # The manifest first: a half-deleted directory then reads as partial, not corrupt.
        (path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(path)
    return doomed


def set_aside(path: Path, reason: str) -> Path:
    """Rename checkpoint directory ``path`` to ``step_N.<reason>`` (or ``.<reason>.K``
    if taken): kept on disk, out of list_checkpoints, so never resumed from or pruned."""
    target = path.with_name(f"{path.name}.{reason}")
    index = 0
    while target.exists():
        index += 1
        target = path.with_name(f"{path.name}.{reason}.{index}")
    path.rename(target)
    return target
