"""`plait checkpoint`: inspect and export sharded training checkpoints.

    plait checkpoint info RUN_OR_CHECKPOINT_DIR
    plait checkpoint export RUN_OR_CHECKPOINT_DIR --out model.safetensors [--format safetensors|torch]
    plait checkpoint export RUN_OR_CHECKPOINT_DIR --format hf --out DIR

A run directory stands for its newest complete checkpoint (newer partial or corrupt
ones are named on stderr and skipped). `info` verifies every file's size and sha256,
then prints the step, mesh, model and files; `export` writes the unsharded model
state dict (the model's own parameter names), loadable into plait.models.GPT (or the
--model hf: run's HF model) with strict=True; `--format hf` writes a directory
(config.json, model.safetensors, the run's tokenizer) that transformers'
AutoModelForCausalLM.from_pretrained(DIR) loads: a --model hf: run's model, or plait's
GPT as GPT2LMHeadModel (plait.train.export_hf).
A bad or corrupt checkpoint exits 2 with the reason, in one line: among them a step
directory (or checkpoints/) that is a symbolic link, a manifest whose step is not its
directory's or whose mesh, shapes or model are not its files', and a path longer than
the system takes (plait.train.checkpoint_checks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from plait.cli.output_paths import output_file, prepare_output_paths
from plait.train import checkpoint
from plait.train import export as export_file
from plait.train import export_hf


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("checkpoint", prog="plait checkpoint", help="inspect and export checkpoints",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = actions.add_parser("info", prog="plait checkpoint info",
                              help="verify a checkpoint and print its step, mesh, model and files")
    info.add_argument("path", metavar="PATH", help="a run directory (its latest complete checkpoint) or a "
                                                   "checkpoints/step_* directory")
    info.set_defaults(run=run_info)
    export = actions.add_parser("export", prog="plait checkpoint export",
                                help="write the unsharded model state dict (.safetensors or .pt), or a Hugging "
                                     "Face directory (--format hf)")
    export.add_argument("path", metavar="PATH", help="a run directory (its latest complete checkpoint) or a "
                                                     "checkpoints/step_* directory")
    export.add_argument("--out", required=True, metavar="FILE|DIR", help="output file: .safetensors or .pt; with "
                                                                        "--format hf a directory")
    export.add_argument("--format", choices=export_file.EXPORT_FORMATS, default=None,
                        help="default: from the --out suffix (.safetensors -> safetensors, .pt/.pth/.bin -> torch); "
                             "hf: a directory transformers' from_pretrained loads")
    export.set_defaults(run=run_export)
    return parser


def _note(line: str) -> None:
    print(f"plait checkpoint: {line}", file=sys.stderr)


def _nbytes_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def info_lines(directory: Path, manifest: dict) -> list[str]:
    """The human-readable summary `plait checkpoint info` prints."""
    mesh = manifest.get("mesh", {})
    model = manifest.get("model", {})
    created = manifest.get("created_unix_s")
    created_text = (time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(created))
                    if isinstance(created, (int, float)) else "unknown")
    files = manifest["files"]
    total = sum(entry["nbytes"] for entry in files.values())
    lines = [
        f"checkpoint {directory}: complete ({len(files)} files verified, sha256)",
        f"step {manifest.get('step')}, continue data from step {manifest.get('data_position')}, "
        f"created {created_text}",
        "mesh " + ", ".join(f"{axis}={mesh[axis]}" for axis in ("dp", "tp", "pp") if axis in mesh)
        + (f" (order {mesh['order']})" if "order" in mesh else ""),
        "model " + ", ".join(f"{key}={value}" for key, value in model.items()),
        f"config digest {manifest.get('config_digest')}, corpus digest {manifest.get('corpus_digest')}",
        f"files ({_nbytes_text(total)} total):",
    ]
    lines += [f"  {name:<16} {entry['nbytes']:>14,d} bytes  sha256 {entry['sha256'][:16]}"
              for name, entry in sorted(files.items())]
    return lines


def run_info(args: argparse.Namespace) -> int:
    directory, verified = checkpoint.resolve(args.path, log=_note, what="PATH")
    problems = [] if verified else checkpoint.verify(directory)
    if problems:
        raise ValueError(f"{directory} is not a complete checkpoint: {'; '.join(problems)}; use an older "
                         "step_* directory, or pass the run directory to pick the latest complete one")
    for line in info_lines(directory, checkpoint.read_manifest(directory)):
        print(line)
    return 0


def run_export(args: argparse.Namespace) -> int:
    if args.format == export_file.HF_FORMAT:
        return run_export_hf(args)
    fmt = export_file.export_format(args.out, args.format)  # a bad --out suffix fails before any reading
    export_file.check_out_path(args.out)  # an overlong name, too
    prepare_output_paths(output_file("--out", args.out))
    directory, verified = checkpoint.resolve(args.path, log=_note, what="PATH")
    out_path = export_file.export(directory, args.out, fmt, log=_note, check_files=not verified)
    manifest = checkpoint.read_manifest(directory)
    print(f"exported step {manifest.get('step')} of {directory} ({len(manifest['files'])} shards) to {out_path} "
          f"({fmt}, {_nbytes_text(out_path.stat().st_size)})")
    return 0


def run_export_hf(args: argparse.Namespace) -> int:
    export_hf.check_out_dir(args.out)  # a file, a link or a foreign directory fails before any reading
    directory, verified = checkpoint.resolve(args.path, log=_note, what="PATH")
    out_dir, written = export_hf.export_hf(directory, args.out, log=_note, check_files=not verified)
    tokenizer = ", ".join(written["tokenizer"]) or "no tokenizer (none saved with the run)"
    print(f"exported step {written['step']} of {directory} to {out_dir} as {written['architecture']} "
          f"({written['tensors']} tensors, {_nbytes_text((out_dir / export_hf.WEIGHTS_NAME).stat().st_size)}; "
          f"{tokenizer}): AutoModelForCausalLM.from_pretrained({str(out_dir)!r}) loads it")
    return 0
