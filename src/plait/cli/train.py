"""`plait train`: train a model with data, tensor and pipeline parallelism.

    plait train                                   # the default job: small GPT, dp=2 x pp=2, 4 processes
    plait train --tp 2 --pp 2 --dp 1 --steps 100  # any layout whose product is the process count
    plait train --config job.toml --lr 1e-3      # a TOML file, then flags (each flag is one config field)
    plait train --dry-run                         # which rank holds which stage and shard; no training
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m plait train ...

Outside a torchrun world it validates the config, prepares the data cache and
starts dp*tp*pp local processes through torch.distributed.run (c10d rendezvous on
127.0.0.1, a free port; `--max-restarts K` restarts the world after a failure,
which then resumes from the newest complete checkpoint). Inside a torchrun world
(multi-node) every process runs one rank. gloo on CPU, NCCL on GPU. At the end
rank 0 writes OUT/report.md, report.json, loss.png and metrics.jsonl, and the
launcher prints text sampled from the trained GPT.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

from plait.train.config import add_config_arguments, config_from_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="train a model with dp x tp x pp parallelism",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="a TOML file of config fields (flags override it)")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="local processes to start (default dp*tp*pp; must equal it)")
    parser.add_argument("--resume", default="auto", metavar="auto|never|DIR",
                        help="auto: continue from the newest complete checkpoint in --out if there is one "
                             "(default); never: start fresh (refused if --out holds checkpoints); "
                             "DIR: a checkpoint directory, possibly saved with another dp/tp/pp")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole world up to K times after a process fails (torchrun elastic); "
                             "each restart resumes from the newest complete checkpoint")
    parser.add_argument("--port", type=int, default=0,
                        help="rendezvous port on 127.0.0.1 (default: a free one; a busy one is replaced)")
    parser.add_argument("--dry-run", action="store_true", help="print the mesh and stage layout, then exit")
    parser.add_argument("--sample-chars", type=int, default=300,
                        help="characters of text to sample from the trained GPT at the end (0: none)")
    parser.add_argument("--prompt", default="def ", help="text the sample starts from")
    add_config_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def in_torchrun_world() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def run(args) -> int:
    config = config_from_args(args, args.config)
    if in_torchrun_world():
        from plait.train.loop import run as run_rank

        run_rank(config, resume=args.resume)
        return 0
    nprocs = config.world_size if args.nprocs is None else args.nprocs
    if nprocs != config.world_size:
        raise ValueError(f"--nprocs {nprocs} != dp({config.dp}) * tp({config.tp}) * pp({config.pp}) = "
                         f"{config.world_size}: pass --nprocs {config.world_size}, or change --dp/--tp/--pp so "
                         f"their product is {nprocs}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in 0..65535 (0: a free one)")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts} must be >= 0")
    if args.sample_chars < 0:
        raise ValueError(f"--sample-chars {args.sample_chars} must be >= 0")
    _warn_if_oversubscribed(nprocs)
    from plait.train.launch import check_resume_choice, describe_layout, prepare_data

    data = prepare_data(config)
    if args.dry_run:
        print(describe_layout(config, data))
        return 0
    check_resume_choice(config, args.resume, data)
    port = _free_port(args.port)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    launch_config = out / "launch-config.toml"
    launch_config.write_text(config.to_toml())
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nprocs),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"plait-{os.getpid()}-{int(time.time())}", "--max-restarts", str(args.max_restarts),
               "--monitor-interval", "1", "-m", "plait", "train", "--config", str(launch_config),
               "--resume", args.resume]
    env = {**os.environ, "PLAIT_LAUNCH_TIME": repr(time.time()), "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"plait train: {nprocs} processes (dp={config.dp} x tp={config.tp} x pp={config.pp}), "
          f"rendezvous 127.0.0.1:{port}, output {out}", flush=True)
    process = subprocess.Popen(command, env=env)
    try:
        code = process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait(timeout=30)
        raise
    if code != 0:
        print(f"plait train: the training processes failed (exit {code}); see the errors above", file=sys.stderr)
        return code
    if config.model == "gpt" and args.sample_chars:
        from plait.train.generate import model_from_checkpoint, sample

        model, manifest = model_from_checkpoint(out)
        text = sample(model, data, args.prompt, chars=args.sample_chars, seed=config.seed)
        print(f"\nsample from the trained model (step {manifest['step']}, temperature 0.8, "
              f"{args.sample_chars} characters after {args.prompt!r}):\n{'-' * 60}\n{text}\n{'-' * 60}")
    print(f"report: {out / 'report.md'}")
    return 0


def _warn_if_oversubscribed(nprocs: int) -> None:
    import torch

    if torch.cuda.is_available():
        if nprocs > torch.cuda.device_count():
            raise ValueError(f"{nprocs} processes but {torch.cuda.device_count()} GPUs on this machine: one process "
                             f"per GPU; use a layout with at most {torch.cuda.device_count()} processes here, or "
                             "launch on several nodes with torchrun")
        return
    cores = os.cpu_count() or 1
    if nprocs > 2 * cores:
        warnings.warn(f"{nprocs} processes on {cores} CPU cores: each gets a fraction of a core, so steps will be "
                      "slow; fine for checking a layout, not for timing it", stacklevel=2)
        print(f"plait train: warning: {nprocs} processes on {cores} CPU cores will be slow", file=sys.stderr)


def _free_port(wanted: int) -> int:
    """``wanted`` if it can be bound on 127.0.0.1, otherwise a free one (announced)."""
    if wanted:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", wanted))
                return wanted
            except OSError:
                print(f"plait train: port {wanted} is in use; using a free one instead", file=sys.stderr)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
