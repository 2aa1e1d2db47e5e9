"""One unsharded model file from a sharded checkpoint: ``plait checkpoint export``.

The state dict has the unsharded model's parameter names (the GPT's, or a ``--model
hf:`` run's HF names) and contiguous tensors, as .safetensors (with the model
description and step as metadata) or a torch.save'd dict of tensors; a GPT's loads
into ``GPT(GPTConfig(**manifest["model"]))`` with strict=True. ``--format hf`` writes
a directory ``from_pretrained`` loads instead (plait.train.export_hf).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from plait.train.atomic_files import atomic_write, check_replaceable, torch_save
from plait.train.checkpoint import resolve
from plait.train.checkpoint_checks import check_user_path, cut, name_max
from plait.train.checkpoint_load import load_full

FILE_FORMATS = ("safetensors", "torch")
HF_FORMAT = "hf"  # a directory: plait.train.export_hf
EXPORT_FORMATS = (*FILE_FORMATS, HF_FORMAT)
# atomic_write fills ".NAME.XXXXXXXX.tmp" first (tempfile.mkstemp: 8 random characters): 14 bytes more than NAME
TEMPORARY_NAME_EXTRA_NBYTES = len("..") + 8 + len(".tmp")
_SUFFIX_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def export_format(out_path: str | os.PathLike, fmt: str | None = None) -> str:
    """"safetensors", "torch" or "hf": ``fmt`` if given, else from the file suffix
    (a directory, "hf", is only ever asked for by name)."""
    if fmt is not None:
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"format {fmt!r} is not one of {list(EXPORT_FORMATS)}")
        return fmt
    suffix = Path(out_path).suffix.lower()
    if suffix not in _SUFFIX_FORMATS:
        raise ValueError(f"cannot tell the format of {str(out_path)!r} from its suffix: name it .safetensors or "
                         ".pt, or give the format (--format safetensors|torch, or hf for a Hugging Face "
                         "directory)")
    return _SUFFIX_FORMATS[suffix]


def check_out_path(out_path: str | os.PathLike, what: str = "--out") -> Path:
    """``out_path`` as a Path, or ValueError in one line if the system would refuse it
    or its temporary name: a name longer than NAME_MAX - 14 bytes (atomic_write's
    temporary file is ".NAME.XXXXXXXX.tmp"), a path longer than PATH_MAX - 1, or
    something already there that is not a regular file: a device node, a FIFO, a
    socket, a directory (the file is renamed into place: it would replace them), or a
    symbolic link (neither written through nor replaced: name the file itself)."""
    out_path = check_user_path(out_path, what)
    if out_path.is_symlink():
        raise ValueError(f"{what} {cut(str(out_path))} is a symbolic link; export neither writes through one nor "
                         f"replaces it: give the file it points to ({cut(os.path.realpath(out_path))}) or another path")
    check_replaceable(out_path, what)
    longest = name_max(out_path.parent) - TEMPORARY_NAME_EXTRA_NBYTES  # 255 where the parent is not made yet
    nbytes = len(os.fsencode(out_path.name))
    if nbytes > longest:
        raise ValueError(f"{what} {cut(str(out_path))}: the file name is {nbytes:,} bytes; the longest this "
                         f"filesystem takes here is {longest} (NAME_MAX less {TEMPORARY_NAME_EXTRA_NBYTES} for the "
                         "temporary name it is written under first): give a shorter name")
    return out_path


def export(directory: str | os.PathLike, out_path: str | os.PathLike, fmt: str | None = None,
           log: Callable[[str], None] | None = print, *, check_files: bool = True) -> Path:
    """Write the unsharded model state dict (GPT names, contiguous tensors) of a
    checkpoint, or of a run directory's latest complete one, as .safetensors (with
    the GPTConfig and step as metadata) or a torch.save'd dict of tensors; both load
    into GPT(GPTConfig(**manifest["model"])) with strict=True. The checkpoint is
    verified first unless ``check_files`` is False (or it was found via a run dir)."""
    fmt = export_format(out_path, fmt)
    if fmt == HF_FORMAT:
        raise ValueError("format 'hf' writes a directory: use plait.train.export_hf.export_hf(checkpoint, out_dir)")
    out_path = check_out_path(out_path)
    directory, verified = resolve(directory, log=log)
    manifest, model, _, _ = load_full(directory, check_files=check_files and not verified)
    state = {name: tensor.contiguous() for name, tensor in model.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        metadata = {"format": "plait", "step": str(manifest.get("step")),
                    "model": json.dumps(manifest.get("model", {}), sort_keys=True)}
        atomic_write(out_path, lambda temp: save_file(state, temp, metadata=metadata))
    else:
        atomic_write(out_path, lambda temp: torch_save(state, temp))
    return out_path
