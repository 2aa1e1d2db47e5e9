"""What makes a checkpoint directory valid beyond its files' sizes and hashes, and
which names plait accepts on the way to one (plait.train.checkpoint uses these).

A manifest (``manifest.json``, the commit point) is believed only where it agrees
with its directory and with its files (``manifest_problems``, ``shard_problems``):

- ``step`` is an int >= 0 equal to the directory's step (``step_00000200`` -> 200),
  and ``data_position`` equals it (plait saves at the step the data continues from);
- ``mesh`` gives dp, tp and pp as ints >= 1 (``config``, where it records them,
  agrees), and ``files`` are exactly the tp x pp grid of shard names, each with
  "nbytes" (an int >= 0) and "sha256" (64 hex digits);
- every shard holds the coordinates its name and the mesh give it; each tensor has
  the shape its spec gives at that tp, the same on every tp rank of its stage, in one
  stage only; optimizer state is shaped like its tensor or is a scalar; and the full
  tensors hold exactly the parameters of the model the manifest describes
  (``GPTConfig.num_parameters``, or the MLP's widths).

Names: a step directory is named ``step_`` and at least 8 ASCII digits exactly as
``checkpoint_dir`` writes it (``step_000000200`` or non-ASCII digits are no
checkpoint). A path given by a user is refused in one line when one of its names is
longer than the filesystem's NAME_MAX or the whole is longer than PATH_MAX - 1 bytes
(the kernel's limits, read with pathconf; 255 and 4096, Linux's, where it cannot say).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from pathlib import Path

import torch

from plait.models.gpt import GPTConfig
from plait.names.axes import AXES

FORMAT = 1
MANIFEST_NAME = "manifest.json"
SHARD_AXES = AXES[1:]  # a shard file is one (tp, pp) coordinate: every axis but data parallelism, AXES[0]
_STEP_DIR = re.compile(r"step_([0-9]{8,})", re.ASCII)
_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
DEFAULT_NAME_MAX = 255    # Linux's NAME_MAX, where pathconf cannot say
DEFAULT_PATH_MAX = 4096   # Linux's PATH_MAX (with the terminating NUL)
SHOWN_CHARS = 60          # a value longer than this is cut in messages, which stay one line


def shard_name(tp_rank: int, pp_rank: int) -> str:
    """The file of tensor-parallel rank ``tp_rank`` of pipeline stage ``pp_rank``."""
    return f"tp{tp_rank}-pp{pp_rank}.pt"


def step_of_name(name: str) -> int | None:
    """200 for "step_00000200"; None unless ``name`` is exactly what checkpoint_dir writes."""
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if name == f"step_{step:08d}" else None


def cut(text: str, chars: int = SHOWN_CHARS) -> str:
    """``text``, or its first ``chars`` characters and how long it was."""
    return text if len(text) <= chars else f"{text[:chars]}... ({len(text):,} characters)"


def shown(value) -> str:
    """``repr(value)`` for a message, cut to about SHOWN_CHARS characters."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    if isinstance(value, str):
        return f"{value[:SHOWN_CHARS - 20]!r}... ({len(value):,} characters)"
    return f"{text[:SHOWN_CHARS - 20]}... ({len(text):,} characters as text)"


def problems_summary(problems: list[str]) -> str:
    text = "; ".join(problems[:3])
    return text + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")


def _is_count(value, least: int = 0) -> bool:
    return type(value) is int and value >= least


# ----------------------------------------------------------------------------- user paths

def _nearest_directory(raw: bytes) -> bytes:
    while raw and not os.path.isdir(raw):
        parent = os.path.dirname(raw.rstrip(b"/"))
        if parent == raw:
            break
        raw = parent
    return raw or b"."


def name_max(directory: str | os.PathLike | bytes) -> int:
    """The longest file name (bytes) the filesystem holding ``directory`` takes."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return DEFAULT_NAME_MAX


def path_max() -> int:
    """The longest path (bytes, with the terminating NUL) a system call takes."""
    try:
        return os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError):
        return DEFAULT_PATH_MAX


def check_user_path(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a Path, or ValueError in one line (naming ``what``, e.g. "--resume")
    if the system would refuse it: empty, a NUL byte, longer than PATH_MAX - 1 bytes
    or a name in it longer than its filesystem's NAME_MAX."""
    text = os.fspath(path)
    raw = os.fsencode(text)
    if not raw:
        raise ValueError(f"{what} '': give a path")
    if b"\x00" in raw:
        raise ValueError(f"{what} {shown(text)}: a path cannot contain a NUL byte")
    longest_path = path_max() - 1
    if len(raw) > longest_path:
        raise ValueError(f"{what} {shown(text)}: the path is {len(raw):,} bytes, longer than PATH_MAX - 1 = "
                         f"{longest_path:,}; give a shorter path")
    longest_name = name_max(_nearest_directory(raw))
    for part in raw.split(b"/"):
        if len(part) > longest_name:
            raise ValueError(f"{what} {shown(text)}: the name {shown(os.fsdecode(part))} is {len(part):,} bytes, "
                             f"longer than this filesystem's NAME_MAX {longest_name}; give a shorter name")
    return Path(text)


# ----------------------------------------------------------------------------- the manifest

class UnsafeManifest(ValueError):
    """A manifest that names files outside its checkpoint directory."""

    def __init__(self, path: Path, names: list):
        self.names = names
        super().__init__(f"{path} lists {', '.join(map(shown, names[:3]))}: a checkpoint's files are plain names "
                         "inside its directory (no '/', '..' or absolute paths); this checkpoint is not valid")


def is_plain_name(name) -> bool:
    """A file name that stays in its directory: no separators, not '.' or '..', not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST_NAME) and "/" not in name
            and "\\" not in name and "\x00" not in name and Path(name).name == name)


class ManifestUnreadable(ValueError):
    """A manifest.json that cannot be read as a plait manifest; ``reason`` says why."""

    def __init__(self, path: Path, reason: str, fix: str = "use an older step_* directory"):
        self.reason = reason
        super().__init__(f"{path} is unreadable ({reason}); {fix}")


# a manifest is ~4 KB of config and model plus one files entry (name, nbytes, sha256) of ~120 bytes per shard;
# 64 MiB holds over 500,000 shards (tp x pp), far past any mesh plait trains, and is read in well under a second
MANIFEST_ENTRY_NBYTES = 128
MANIFEST_LIMIT_NBYTES = 64 << 20


def read_manifest(directory: str | os.PathLike) -> dict:
    """The parsed manifest.json of a checkpoint directory (ValueError if absent, not a
    regular file, a link, or not a format-1 manifest of plain file names)."""
    path = Path(directory) / MANIFEST_NAME
    try:  # O_NOFOLLOW: never read through a link; O_NONBLOCK: a FIFO named manifest.json does not hang
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{path.parent} has no {MANIFEST_NAME}: it is a partial checkpoint (the save did not "
                         "finish) or not a checkpoint directory; use an older step_* directory") from None
    except OSError as error:
        raise ManifestUnreadable(path, "a symbolic link" if error.errno == errno.ELOOP else error.strerror) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ManifestUnreadable(path, "not a regular file")
        with os.fdopen(fd, "rb") as file:
            text = file.read(MANIFEST_LIMIT_NBYTES + 1)
        if len(text) > MANIFEST_LIMIT_NBYTES:
            raise ManifestUnreadable(path, f"larger than {MANIFEST_LIMIT_NBYTES:,} bytes, the most a manifest of "
                                           f"{MANIFEST_LIMIT_NBYTES // MANIFEST_ENTRY_NBYTES:,} shards takes")
        manifest = json.loads(text)
    except ManifestUnreadable:
        raise
    except (OSError, ValueError, RecursionError) as error:  # ValueError: bad JSON, UTF-8 or a huge int
        raise ManifestUnreadable(path, cut(f"{type(error).__name__}: {error}", 2 * SHOWN_CHARS)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"),
                                                                                             dict):
        raise ManifestUnreadable(path, f"not a format-{FORMAT} plait manifest: need a JSON object with "
                                       f"\"format\": {FORMAT} and \"files\"")
    outside = [name for name in manifest["files"] if not is_plain_name(name)]
    if outside:
        raise UnsafeManifest(path, outside)
    return manifest


def manifest_problems(directory: str | os.PathLike, manifest: dict) -> list[str]:
    """Why ``manifest`` (read_manifest's) disagrees with its directory or with itself;
    [] if it does not. Reads no shard."""
    directory = Path(directory)
    problems = []
    step, position = manifest.get("step"), manifest.get("data_position")
    named = step_of_name(directory.name)
    if not _is_count(step):
        problems.append(f"manifest step {shown(step)} is not an int >= 0")
    elif named is not None and step != named:
        problems.append(f"manifest step {step} != {named}, the step of its directory {directory.name} (not valid)")
    if not _is_count(position) or position != step:
        problems.append(f"manifest data_position {shown(position)} != step {shown(step)} (a checkpoint continues "
                        "the data at its own step)")
    mesh = manifest.get("mesh")
    if not isinstance(mesh, dict) or not all(_is_count(mesh.get(axis), 1) for axis in AXES):
        problems.append(f"manifest mesh {shown(mesh)} does not give dp, tp and pp as ints >= 1")
        mesh = None
    config = manifest.get("config")
    if mesh is not None and isinstance(config, dict):
        differing = [f"{axis}={shown(config[axis])}" for axis in AXES if axis in config and config[axis] != mesh[axis]]
        if differing:
            problems.append(f"manifest config says {', '.join(differing)} but its mesh says "
                            + ", ".join(f"{axis}={mesh[axis]}" for axis in AXES))
    files = manifest["files"]
    longest = name_max(directory)
    overlong = [name for name in files if len(os.fsencode(name)) > longest]
    if overlong:
        problems.append(f"manifest lists a {len(os.fsencode(overlong[0])):,}-byte file name {shown(overlong[0])}, "
                        f"longer than NAME_MAX {longest} (not valid)")
    if mesh is not None:
        # the grid is built only when it is about the size of files: a forged tp=10**9 costs nothing
        count = mesh["tp"] * mesh["pp"]
        grid = (sorted(shard_name(tp, pp) for pp in range(mesh["pp"]) for tp in range(mesh["tp"]))
                if count <= len(files) + SHOWN_CHARS else None)
        if grid is None or set(files) != set(grid):
            needs = f"the files {shown(grid)}" if grid is not None else f"{count:,} shard files"
            problems.append(f"manifest mesh tp={mesh['tp']} pp={mesh['pp']} needs {needs}, but it lists "
                            f"{shown(sorted(files))} (not valid)")
    bad = [name for name, entry in files.items()
           if not (isinstance(entry, dict) and _is_count(entry.get("nbytes"))
                   and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"]))]
    if bad:
        problems.append(f"manifest entry of {shown(bad[0])} is {shown(files[bad[0]])}: need "
                        "{\"nbytes\": int >= 0, \"sha256\": 64 hex digits}")
    return problems + described_problems(manifest)


# What `plait checkpoint info` prints of a manifest besides its files: each field checked for type and range, so
# that a forged one is named (field and file) instead of crashing the printout (created_unix_s 1e300 was an
# OverflowError in time.localtime, NaN "Invalid value NaN") or printing lines of its own (a newline in a string).
MAX_UNIX_S = 253_402_300_799  # 9999-12-31 23:59:59 UTC: the last second time.strftime prints as a 4-digit year
TEXT_CHARS = 64               # a dtype, a model kind, a key: a few characters; 64 is ample and one line
DIGEST_CHARS = 128            # a sha256 hex digest is 64
MODEL_ITEMS = 64              # a model description has ~10 fields (GPTConfig's), an MLP's sizes a few layers


def _text_problem(value, chars: int) -> str | None:
    if not isinstance(value, str):
        return f"is {type(value).__name__}, not a string"
    if len(value) > chars:
        return f"is {len(value):,} characters, more than {chars}"
    if not value.isprintable():
        return "holds a control character (a newline, a tab, ...)"
    return None


def _model_value_ok(value) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) < 2 ** 63
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return _text_problem(value, TEXT_CHARS) is None
    return isinstance(value, list) and len(value) <= MODEL_ITEMS and all(
        type(item) is int and abs(item) < 2 ** 63 for item in value)


def described_problems(manifest: dict) -> list[str]:
    """Why the descriptive fields of ``manifest`` are not what plait writes: created_unix_s
    a finite time in 0..MAX_UNIX_S, mesh order a permutation of dp,tp,pp, model a flat
    mapping of at most MODEL_ITEMS short keys to numbers, short strings or lists of ints,
    the digests short strings (or null), config a mapping. Each message names the field."""
    where = MANIFEST_NAME
    problems = []
    if "created_unix_s" in manifest:
        created = manifest["created_unix_s"]
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not (
                math.isfinite(created) and 0 <= created <= MAX_UNIX_S):
            problems.append(f"{where} created_unix_s {shown(created)} is not a time: need a finite number of "
                            f"seconds since 1970 in 0..{MAX_UNIX_S:,} (year 9999) (not valid)")
    mesh = manifest.get("mesh")
    if isinstance(mesh, dict) and "order" in mesh:
        order = mesh["order"]
        if not isinstance(order, str) or sorted(re.split("[,-]", order)) != sorted(AXES):
            problems.append(f"{where} mesh order {shown(order)} is not the axes {','.join(AXES)} in some order, "
                            "e.g. 'tp,dp,pp' (not valid)")
    if "model" in manifest:
        model = manifest["model"]
        if not isinstance(model, dict) or len(model) > MODEL_ITEMS:
            problems.append(f"{where} model {shown(model)} is not a mapping of at most {MODEL_ITEMS} fields "
                            "(not valid)")
        else:
            bad_keys = [key for key in model if _text_problem(key, TEXT_CHARS) is not None]
            bad = [key for key, value in model.items() if key not in bad_keys and not _model_value_ok(value)]
            if bad_keys:
                problems.append(f"{where} model field name {shown(bad_keys[0])} "
                                f"{_text_problem(bad_keys[0], TEXT_CHARS)} (not valid)")
            if bad:
                problems.append(f"{where} model {bad[0]}={shown(model[bad[0]])}: need a number, a string of at most "
                                f"{TEXT_CHARS} printable characters, or a list of ints (not valid)")
    for key in ("config_digest", "corpus_digest"):
        if manifest.get(key) is not None and (problem := _text_problem(manifest[key], DIGEST_CHARS)) is not None:
            problems.append(f"{where} {key} {shown(manifest[key])} {problem}: need a digest string or null "
                            "(not valid)")
    if "config" in manifest and not isinstance(manifest["config"], dict):
        problems.append(f"{where} config {shown(manifest['config'])} is not a mapping of TrainConfig fields "
                        "(not valid)")
    return problems


# ----------------------------------------------------------------------------- the shards

def check_header(payload: dict, where: str) -> None:
    """The shard payload's format, coordinates and key sets (``where`` names the file)."""
    if not isinstance(payload, dict):
        raise ValueError(f"{where}: a shard payload is a dict, got {type(payload).__name__}")
    missing = [key for key in ("format", "tp_rank", "tp_size", "pp_rank", "pp_size", "model", "specs")
               if key not in payload]
    if missing:
        raise ValueError(f"{where}: shard payload lacks {missing}")
    if payload["format"] != FORMAT:
        raise ValueError(f"{where}: shard format {shown(payload['format'])} != {FORMAT}; this plait reads format "
                         f"{FORMAT} only")
    for axis in SHARD_AXES:
        rank, size = payload[f"{axis}_rank"], payload[f"{axis}_size"]
        if not (type(rank) is int and type(size) is int and 0 <= rank < size):
            raise ValueError(f"{where}: {axis}_rank={shown(rank)}, {axis}_size={shown(size)}: need 0 <= rank < size")
    if not (isinstance(payload["model"], dict) and isinstance(payload["specs"], dict)
            and isinstance(payload.get("optimizer", {}), dict)):
        raise ValueError(f"{where}: model, specs and optimizer must be dicts")
    if set(payload["model"]) != set(payload["specs"]):
        raise ValueError(f"{where}: model and specs name different tensors: "
                         f"{shown(sorted(map(str, set(payload['model']) ^ set(payload['specs']))))}")
    extra = sorted(map(str, set(payload.get("optimizer", {})) - set(payload["model"])))
    if extra:
        raise ValueError(f"{where}: optimizer state for tensors not in model: {shown(extra)}")


def model_parameters(model) -> int | None:
    """Parameters of the model a manifest describes ({"kind": "gpt", GPTConfig's
    fields}, {"kind": "mlp", "sizes": [...]} or {"kind": "hf", ..., "parameters": N});
    None when it records none.
    ValueError if it describes no model plait builds."""
    if model is None:
        return None
    if not isinstance(model, dict):
        raise ValueError(f"manifest model {shown(model)} is not a dict")
    kind = model.get("kind", "gpt")
    if kind == "gpt":
        try:
            return GPTConfig(**{key: value for key, value in model.items() if key != "kind"}).num_parameters()
        except (TypeError, ValueError) as error:
            raise ValueError(f"manifest model is not a GPT plait builds ({cut(str(error), 2 * SHOWN_CHARS)})") from None
    if kind == "mlp":
        sizes = model.get("sizes")
        if not (isinstance(sizes, list) and len(sizes) >= 2 and all(_is_count(size, 1) for size in sizes)):
            raise ValueError(f"manifest model mlp sizes {shown(sizes)} are not >= 2 widths >= 1")
        return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(sizes[:-1], sizes[1:]))
    if kind == "hf":  # a Hugging Face model (plait.train.hf_model.description): its count is recorded
        count = model.get("parameters")
        if not _is_count(count, 1):
            raise ValueError(f"manifest model hf parameters {shown(count)} is not a count >= 1")
        return count
    raise ValueError(f"manifest model kind {shown(kind)} is neither 'gpt', 'mlp' nor 'hf'")


def _tensor_problems(name: str, payload: dict, tp_size: int, full_shapes: dict) -> list[str]:
    """One shard's tensors against their specs at ``tp_size``; records each tensor's
    full (unsharded) shape in ``full_shapes``."""
    problems = []
    for key, tensor in payload["model"].items():
        where = f"{name}: {shown(key)}"
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{where} is a {type(tensor).__name__}, not a tensor")
            continue
        spec = payload["specs"][key]
        shape = list(tensor.shape)
        if spec is not None:
            # [dim, full_size], or [dim, full_size, *parts] for a fused layout (parts summing to full_size)
            if not (isinstance(spec, (list, tuple)) and len(spec) >= 2 and all(type(x) is int for x in spec)
                    and 0 <= spec[0] < tensor.dim() and spec[1] >= 1
                    and (len(spec) == 2 or (sum(spec[2:]) == spec[1] and all(x % tp_size == 0 for x in spec[2:])))):
                problems.append(f"{where} has spec {shown(spec)}: need None, [dim, full_size] or [dim, full_size, "
                                f"*parts] (fused parts each divisible by tp_size {tp_size}), 0 <= dim < {tensor.dim()}")
                continue
            dim, full_size = spec[:2]
            if shape[dim] != -(-full_size // tp_size):
                problems.append(f"{where} has shape {tuple(shape)}, but spec {list(spec)} at tp {tp_size} gives "
                                f"{-(-full_size // tp_size)} along dim {dim}")
                continue
            shape[dim] = full_size
        if full_shapes.setdefault(key, tuple(shape)) != tuple(shape):
            problems.append(f"{where} is {tuple(shape)} unsharded, another shard says {full_shapes[key]}")
        state = payload.get("optimizer", {}).get(key, {})
        if not isinstance(state, dict):
            problems.append(f"{where}: optimizer state is a {type(state).__name__}, not a dict")
            continue
        for state_key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != tensor.shape:
                problems.append(f"{where}: optimizer {shown(state_key)} has shape {tuple(value.shape)}, the tensor "
                                f"{tuple(tensor.shape)}")
    return problems


def _load_shard(path: Path) -> dict:
    """torch.load(weights_only=True, mmap=True) of the regular file at ``path``, opened
    without following a link; loaded through /proc/self/fd where there is one (the file
    opened is the file read, and torch need not encode a name that is not UTF-8)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        opened = f"/proc/self/fd/{fd}"
        return torch.load(opened if os.path.exists(opened) else path, map_location="cpu", weights_only=True,
                          mmap=True)
    finally:
        os.close(fd)


def shard_problems(directory: str | os.PathLike, manifest: dict) -> list[str]:
    """Why the shard files disagree with ``manifest`` (one that manifest_problems
    accepts) or with each other; [] if they agree. Loads each shard with
    weights_only=True, memory-mapped: the tensors' bytes are not read."""
    directory = Path(directory)
    tp_size, pp_size = manifest["mesh"]["tp"], manifest["mesh"]["pp"]
    problems, specs_of, stage_of, full_shapes = [], {}, {}, {}
    for name in sorted(manifest["files"]):
        try:
            payload = _load_shard(directory / name)
        except Exception as error:  # torch raises several types for a damaged or hostile file
            problems.append(f"{name} cannot be loaded ({cut(f'{type(error).__name__}: {error}', 2 * SHOWN_CHARS)})")
            continue
        try:
            check_header(payload, name)
        except ValueError as error:
            problems.append(str(error))
            continue
        held = (payload["tp_rank"], payload["tp_size"], payload["pp_rank"], payload["pp_size"])
        match = re.fullmatch(r"tp([0-9]+)-pp([0-9]+)\.pt", name)
        said = (int(match.group(1)), tp_size, int(match.group(2)), pp_size)
        if held != said:
            problems.append(f"{name} holds tp_rank {held[0]} of tp_size {held[1]}, pp_rank {held[2]} of pp_size "
                            f"{held[3]}; its name and the manifest's mesh say tp_rank {said[0]} of {said[1]}, "
                            f"pp_rank {said[2]} of {said[3]} (not valid)")
            continue
        problems += _tensor_problems(name, payload, tp_size, full_shapes)
        specs = {key: None if spec is None else list(spec) for key, spec in payload["specs"].items()}
        first = specs_of.setdefault(held[2], (name, specs))
        if first[1] != specs:
            problems.append(f"{name} and {first[0]} hold different tensors or specs (one stage, two tp ranks)")
        for key in specs:
            if stage_of.setdefault(key, held[2]) != held[2]:
                problems.append(f"{shown(key)} is in pipeline stages {stage_of[key]} and {held[2]}; each tensor "
                                "belongs to one stage")
    if problems:
        return list(dict.fromkeys(problems))  # a problem of a stage is found once per tp rank: said once
    try:
        expected = model_parameters(manifest.get("model"))
    except ValueError as error:
        return [str(error)]
    held_parameters = sum(math.prod(shape) for shape in full_shapes.values())
    if expected is not None and held_parameters != expected:
        return [f"the shards hold {held_parameters:,} parameters, but the manifest's model has {expected:,}: the "
                "manifest does not describe these files (not valid)"]
    return []
