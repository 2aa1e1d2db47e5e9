"""`plait train`: train a model with data, tensor and pipeline parallelism.

    plait train                                   # the default job: small GPT, dp=2 x pp=2, 4 processes
    plait train --tp 2 --pp 2 --dp 1 --steps 100  # any layout whose product is the process count
    plait train --config job.toml --lr 1e-3      # a TOML file, then flags (each flag is one config field)
    plait train --dry-run                         # which rank holds which stage and shard; no training
    plait train --dp 1 --pp 2 --stage-layers 3,1  # uneven stages: blocks of each pipeline chunk (Megatron-style)
    plait train --nnodes 2 --rdzv-endpoint HOST:PORT ...   # on each of 2 machines (same flags)

Outside a torchrun world it checks everything it can before any process starts (the
config, the data against the batch, memory per process, --out writable with room for
a checkpoint, what --resume would start from), locks --out for this run (a second
run on the same --out is refused), and starts dp*tp*pp processes through torch's
elastic agent with every listening socket on 127.0.0.1 (on several machines: on this
node's address). SIGINT, SIGTERM and SIGHUP stop every process of the run; so does
the launcher's death. `--max-restarts K` restarts the world after a failure, which
resumes from the newest complete checkpoint. Inside a torchrun world
(`torchrun ... -m plait train`) every process runs one rank. gloo on CPU, NCCL on
GPU. At the end rank 0 writes OUT/report.md, report.json, loss.png and
metrics.jsonl, and the launcher prints text sampled from the trained GPT.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

from plait.cli.environment import cache_dir
from plait.train import budget, checkpoint as ckpt, lifeline, runlock
from plait.train.agent import is_local_address, record_rank_error
from plait.train.atomic_files import atomic_write
from plait.train.run_links import check_run_links
from plait.train.config import add_config_arguments, config_from_args

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 5.0  # after forwarding a stop signal, how long the agent gets before SIGKILL
LOOPBACK = "127.0.0.1"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="train a model with dp x tp x pp parallelism",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="a TOML file of config fields (flags override it)")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="local processes to start (default dp*tp*pp / nnodes; must equal it)")
    parser.add_argument("--resume", default="auto", metavar="auto|never|DIR",
                        help="auto: continue from the newest complete checkpoint in --out; start fresh only if --out "
                             "holds no run (default); never: start fresh (refused if --out holds a run, unless "
                             "--force-fresh); DIR: a checkpoint directory (OUT/checkpoints/step_*), possibly saved with another "
                             "dp/tp/pp, or a run directory (its newest complete checkpoint)")
    parser.add_argument("--force-fresh", action="store_true",
                        help="with --resume never (or DIR): move an earlier run in --out to OUT/previous/<time>/ "
                             "and start over")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole world up to K times after a process fails (torchrun elastic); "
                             "each restart resumes from the newest complete checkpoint")
    parser.add_argument("--port", type=int, default=0,
                        help="rendezvous port on 127.0.0.1 (default: a free one; a busy one is replaced)")
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the run; start plait train on each")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="with --nnodes > 1: the first node's address and a port (its rendezvous store "
                             "listens there, and nowhere else)")
    parser.add_argument("--rdzv-id", default=None, metavar="ID",
                        help="with --nnodes > 1: a name for the run, the same on every node (default: from the "
                             "endpoint)")
    parser.add_argument("--local-addr", default=None, metavar="ADDR",
                        help="with --nnodes > 1: this node's address for the run's sockets (default: the one that "
                             "routes to the endpoint)")
    parser.add_argument("--dry-run", action="store_true", help="print the mesh and stage layout, then exit")
    parser.add_argument("--sample-chars", type=int, default=300,
                        help="characters of text to sample from the trained model at the end (0: none)")
    parser.add_argument("--prompt", default=None,
                        help="text the sample starts from (default: the start of the validation text)")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="train the model of a plan saved by plait plan --auto --module PKG.MOD:FUNCTION ... "
                             "--save FILE, sharded as the plan says, on its mesh's processes, with synthetic "
                             "batches shaped like the factory's inputs (--data digits: the digits, when the inputs "
                             "are (B, 64) features and (B,) labels; the optimizer, lr and run flags apply)")
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)  # the launcher's, passed to its ranks
    add_config_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def in_torchrun_world() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def run(args) -> int:
    config = config_from_args(args, args.config)
    if args.plan is not None:
        return _run_plan(args, config)
    if in_torchrun_world():
        return _run_rank(args, config)
    from plait.train.launch import check_comm_profile, check_output_dir, check_output_path, check_resume_choice, \
        describe_layout, prepare_data

    nprocs = _check_launcher_options(args, config)
    _check_comm_environment(config)
    check_comm_profile(config)
    out = Path(config.out)
    check_output_path(out)
    check_run_links(out)  # a link where the run writes, named before anything is written or started
    endpoint, local_addr, run_id = _rendezvous(args)
    if not args.dry_run:
        runlock.check_free(out, run_id)  # refuse at once, before minutes of data preparation
    data = prepare_data(config, cache_dir())
    if config.hf_source is None:  # plait's own models: their memory from their sizes (an hf model's: not yet)
        budget.check_fits(config, data, local_processes=nprocs,
                          gpu_memory_bytes=_gpu_memory_bytes(nprocs, config.backend))
    else:
        from plait.train import hf_layout

        hf_layout.check_model(config, data)  # the config read, vocabulary and positions checked, the plan found
    if args.dry_run:  # the resume choice is checked as the launch checks it (it changes nothing)
        check_resume_choice(config, args.resume, data, run_id=run_id, force_fresh=args.force_fresh)
        print(describe_layout(config, data) if config.hf_source is None else hf_layout.describe(config, data))
        return 0
    check_output_dir(out, budget.checkpoint_bytes(config, data) if config.hf_source is None
                     else hf_layout.checkpoint_bytes(config))
    with runlock.acquire(out, run_id) as lock:
        check_resume_choice(config, args.resume, data, run_id=run_id, force_fresh=args.force_fresh)
        what = f"dp={config.dp} x tp={config.tp} x pp={config.pp}"
        code = _launch(args, config, nprocs, what, (endpoint, local_addr, run_id), lock)
        if code != 0:
            return code
        if config.model != "mlp" and args.sample_chars and _hosts_endpoint(endpoint):
            prompt = _sample_prompt(data) if args.prompt is None else args.prompt
            if config.hf_source is None:
                from plait.train.generate import model_from_checkpoint, sample

                model, manifest = model_from_checkpoint(out)
                text = sample(model, data, prompt, chars=args.sample_chars, seed=config.seed)
            else:
                from plait.train.hf_generate import model_from_checkpoint, sample

                model, manifest = model_from_checkpoint(out)
                text = sample(model, data, prompt, chars=args.sample_chars, seed=config.seed, seq_len=config.seq_len)
            print(f"\nsample from the trained model (step {manifest['step']}, temperature 0.8, "
                  f"{args.sample_chars} characters after {prompt!r}):\n{'-' * 60}\n{text}\n{'-' * 60}")
        print(f"report: {out / 'report.md'}")
    return 0


def _launch(args, config, nprocs: int, what: str, rendezvous, lock, extra=()) -> int:
    """Start the ranks through torch's elastic agent (``plait.train.agent``) with
    ``config`` written to the run directory, wait for them; the exit code (0: done)."""
    endpoint, local_addr, run_id = rendezvous
    out = Path(config.out)
    # several nodes may share --out: each launcher writes its own copy of the config it launches with
    launch_config = out / ("launch-config.toml" if args.nnodes == 1
                           else f"launch-config.{socket.gethostname()}.{os.getpid()}.toml")
    atomic_write(launch_config, lambda temporary: Path(temporary).write_text(config.to_toml()))  # a link: replaced
    command = [sys.executable, "-m", "plait.train.agent", "--parent-pid", str(os.getpid()),
               "--nnodes", str(args.nnodes), "--nproc-per-node", str(nprocs),
               "--rdzv-backend", "plait-c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
               "--local-addr", local_addr, "--max-restarts", str(args.max_restarts), "--monitor-interval", "1",
               "-m", "plait", "train", "--config", str(launch_config), "--resume", args.resume,
               "--run-id", run_id] + (["--force-fresh"] if args.force_fresh else []) + list(extra)
    env = {**os.environ, "PLAIT_LAUNCH_TIME": repr(time.time()), "PYTHONUNBUFFERED": "1",
           **_socket_env(local_addr)}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"plait train: {nprocs} processes ({what}" + (f", node of {args.nnodes}" if args.nnodes > 1 else "")
          + f"), rendezvous {endpoint}, output {out} (locked for this run)", flush=True)
    code, stopped_by = _supervise(command, env, lock.fileno() if lock.owned else None)
    if stopped_by is not None:
        print(f"plait train: stopped by {signal.Signals(stopped_by).name}; every process of the run has "
              f"exited. {_resume_hint(out)}", file=sys.stderr)
        return 128 + stopped_by
    if code != 0:
        how = (f"the agent (torchrun) was killed by {signal.Signals(-code).name}, and its ranks with it"
               if code < 0 else f"the training processes failed (exit {code})")
        print(f"plait train: {how}. {_resume_hint(out)}", file=sys.stderr)
        return 128 - code if code < 0 else code
    return 0


def _run_plan(args, config) -> int:
    """plait train --plan FILE (plait.train.auto_run): in a rank, train; in the launcher,
    refuse the flags the plan fixes, build the model and check the plan against its
    trace before any process starts, then start the plan's mesh-size processes."""
    from plait.cli.factory import load_factory  # imports torch and the user's model: only for --plan
    from plait.train import auto_run  # the auto-parallel executor: only for --plan
    from plait.train.config import FIELD_NAMES, load_toml
    from plait.train.launch import check_output_path

    saved = auto_run.load(args.plan)
    if in_torchrun_world():
        model, inputs = auto_run.build_model(saved, load_factory)
        auto_run.train(config, saved, model, inputs)
        return 0
    given = {name for name in FIELD_NAMES if hasattr(args, name)} | set(load_toml(args.config) if args.config else {})
    problems = auto_run.given_fields_problems(sorted(given))
    if args.nprocs is not None and args.nprocs * args.nnodes != saved.mesh.size:
        problems.append(f"--nprocs {args.nprocs}" + (f" x --nnodes {args.nnodes}" if args.nnodes > 1 else "")
                        + f" with --plan: the plan's mesh {saved.mesh.text()} runs on {saved.mesh.size} processes; "
                        "leave --nprocs out")
    if args.resume not in ("auto", "never") or args.max_restarts:
        problems.append("--resume DIR and --max-restarts with --plan: a plan run writes no checkpoints yet; leave "
                        "them out")
    if problems:
        raise ValueError("; ".join(problems))
    model, inputs = auto_run.build_model(saved, load_factory)
    auto_run.traced_step(saved, model, inputs)  # the plan is of this model: refused here, not on every rank
    auto_run.batch_source(config, inputs)  # --data digits fits the inputs, or synthetic batches
    config = auto_run.plan_config(config, saved)
    nprocs = _check_launcher_options(args, config)
    out = Path(config.out)
    check_output_path(out)
    check_run_links(out)
    what = f"mesh {saved.mesh.text()} of plan {args.plan}"
    if args.dry_run:
        print(f"plait train --plan: {saved.source} on {what}: {nprocs} processes, {config.steps} steps of "
              f"synthetic batches shaped {[tuple(t.shape) for t in inputs]}, output {out}")
        return 0
    rendezvous = _rendezvous(args)
    with runlock.acquire(out, rendezvous[2]) as lock:
        code = _launch(args, config, nprocs, what, rendezvous, lock, ["--plan", str(Path(args.plan).resolve())])
    if code == 0:
        print(f"metrics: {out / 'metrics.jsonl'}, predicted vs measured step: {out / auto_run.RUN_RECORD}")
    return code


def _sample_prompt(data) -> str:
    """The closing sample's default prompt, from the data: the start of the first
    validation document (text data), or of the validation text's first full line (the
    char corpus), at most 32 characters."""
    if hasattr(data, "sample_prompt"):
        return data.sample_prompt()[:32]
    text = data.decode(data.val[:256])
    lines = text.split("\n")
    line = next((line for line in lines[1:] if line.strip()), lines[0])
    return line[:32] or "\n"


def _run_rank(args, config) -> int:
    """One rank of a torchrun world. Launched by plait train (--run-id given), errors go
    to torchrun's error file and the launcher's agent prints them once; under a user's
    own torchrun they are raised as usual."""
    from plait.cli.comm_config import config_from_environment
    from plait.train.loop import run as run_rank

    if "TORCHELASTIC_RUN_ID" in os.environ and lifeline.supported():
        try:
            lifeline.tie_to_parent(signal.SIGKILL)  # a rank whose agent is gone stops at once
        except lifeline.ParentGone as error:
            print(f"plait train: {error}: not starting", file=sys.stderr)
            return 1
    run_id = args.run_id or (f"torchrun:{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}@"
                             f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
    try:
        run_rank(config, run_id=run_id, resume=args.resume, force_fresh=args.force_fresh,
                 comm_environment=config_from_environment(), cache_dir=cache_dir())
    except Exception as error:
        if record_rank_error(error) and args.run_id is not None:
            return 1
        raise
    return 0


def _check_launcher_options(args, config) -> int:
    """The launcher's own flags; returns the local process count."""
    problems = []
    if args.nnodes < 1:
        problems.append(f"--nnodes {args.nnodes} must be >= 1")
    elif config.world_size % args.nnodes:
        problems.append(f"dp({config.dp}) * tp({config.tp}) * pp({config.pp}) = {config.world_size} processes do "
                        f"not split over --nnodes {args.nnodes}: use a node count that divides {config.world_size}")
    per_node = config.world_size // max(args.nnodes, 1)
    nprocs = per_node if args.nprocs is None else args.nprocs
    if nprocs < 1:
        problems.append(f"--nprocs {nprocs} must be >= 1 (processes on this node): pass --nprocs {per_node} "
                        f"(dp * tp * pp" + (" / nnodes" if args.nnodes > 1 else "") + "), or leave it out")
    elif nprocs != per_node and not problems:
        problems.append(f"--nprocs {nprocs} != dp({config.dp}) * tp({config.tp}) * pp({config.pp})"
                        + (f" / nnodes({args.nnodes})" if args.nnodes > 1 else "") + f" = {per_node}: pass "
                        f"--nprocs {per_node}, or change --dp/--tp/--pp so their product is "
                        f"{nprocs * max(args.nnodes, 1)}")
    if not 0 <= args.port <= 65535:
        problems.append(f"--port {args.port} must be in 0..65535 (0: a free one)")
    if args.max_restarts < 0:
        problems.append(f"--max-restarts {args.max_restarts} must be >= 0")
    if args.sample_chars < 0:
        problems.append(f"--sample-chars {args.sample_chars} must be >= 0")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        problems.append(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the first node's address and a "
                        "free port there), the same on every node")
    if args.nnodes == 1 and (args.rdzv_endpoint or args.local_addr or args.rdzv_id):
        problems.append("--rdzv-endpoint, --rdzv-id and --local-addr are for --nnodes > 1; one machine binds "
                        f"{LOOPBACK} (use --port to choose the port)")
    if args.rdzv_endpoint and args.port:
        problems.append("--port is for one machine; with --rdzv-endpoint the port is the endpoint's")
    if args.run_id is not None:
        problems.append("--run-id is set by plait train for its own processes; leave it out")
    if args.force_fresh and args.resume == "auto":
        problems.append("--force-fresh replaces an earlier run, but --resume auto continues it: use --resume never "
                        "--force-fresh to start over, or drop --force-fresh")
    if problems:
        raise ValueError("; ".join(problems))
    _warn_if_oversubscribed(nprocs, config.backend)
    return nprocs


def _check_comm_environment(config) -> None:
    """The PLAIT_* communicator settings against this run's layout (a hierarchy of the
    wrong size, ...), before any process starts and in --dry-run: plait.train.comm_environment."""
    from plait.cli.comm_config import config_from_environment
    from plait.train.comm_environment import comm_environment_problems, fault_kill_problems
    from plait.train.loop import FAULT_ENV

    problems, notes = comm_environment_problems(config, config_from_environment())
    problems += fault_kill_problems(os.environ.get(FAULT_ENV), config)
    if problems:
        raise ValueError("; ".join(problems))
    for note in notes:
        print(f"plait train: warning: {note}", file=sys.stderr)


def _rendezvous(args) -> tuple[str, str, str]:
    """(endpoint HOST:PORT, this node's address, run id)."""
    from plait.train.launch import local_address_towards

    if args.nnodes == 1:
        port = _free_port(args.port)
        return f"{LOOPBACK}:{port}", LOOPBACK, f"plait-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    host, _, port_text = args.rdzv_endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint!r} must be HOST:PORT with a port in 1..65535")
    local_addr = args.local_addr or local_address_towards(host)
    return args.rdzv_endpoint, local_addr, args.rdzv_id or f"plait-{host}:{port_text}"


def _socket_env(local_addr: str) -> dict:
    """gloo and NCCL listen on the interface holding ``local_addr`` (loopback on one machine)."""
    from plait.train.launch import interface_with_address

    interface = interface_with_address(local_addr)
    if interface is None:
        print(f"plait train: warning: no network interface holds {local_addr}; gloo and NCCL choose their own",
              file=sys.stderr)
        return {}
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def _hosts_endpoint(endpoint: str) -> bool:
    return is_local_address(endpoint.rpartition(":")[0].strip("[]"))


def _supervise(command: list[str], env: dict, lock_fd: int | None) -> tuple[int, int | None]:
    """Run the agent to the end; (exit code, the stop signal received or None).

    The agent runs in a session of its own, so a terminal's Ctrl-C or hang-up reaches
    the launcher alone, which stops the run in order: a stop signal is forwarded to the
    agent as SIGTERM (torchrun then stops its ranks), and after GRACE_S the agent's
    process group gets SIGKILL (each rank has PR_SET_PDEATHSIG and follows). The run
    lock's descriptor is passed on, so the directory stays locked while the agent lives."""
    received: list[int] = []
    previous = {number: signal.signal(number, lambda signum, frame: received.append(signum))
                for number in STOP_SIGNALS}
    try:
        process = subprocess.Popen(command, env=env, start_new_session=True,
                                   pass_fds=() if lock_fd is None else (lock_fd,))
        deadline = None
        while True:
            try:
                return process.wait(timeout=0.2), (received[0] if received else None)
            except subprocess.TimeoutExpired:
                pass
            if received and deadline is None:
                print(f"plait train: {signal.Signals(received[0]).name} received: stopping every process of the "
                      "run", file=sys.stderr, flush=True)
                process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + GRACE_S
            elif deadline is not None and time.monotonic() > deadline:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = float("inf")
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _resume_hint(out: Path) -> str:
    newest = ckpt.latest_complete(out, log=None) if out.is_dir() else None
    if newest is None:
        return "No complete checkpoint was written."
    return f"The newest complete checkpoint is {newest}; run the same command again to continue from it."


def _gpu_memory_bytes(nprocs: int, backend: str = "auto") -> int | None:
    """Each process's share of its GPU's memory (None without CUDA): a whole GPU each,
    or under gloo, where processes share GPUs round-robin, the GPU over its processes."""
    import torch

    if not torch.cuda.is_available():
        return None
    gpus = torch.cuda.device_count()
    sharing = math.ceil(nprocs / gpus) if backend == "gloo" else 1
    return min(torch.cuda.get_device_properties(index).total_memory
               for index in range(min(nprocs, gpus))) // sharing


def _warn_if_oversubscribed(nprocs: int, backend: str = "auto") -> None:
    import torch

    if torch.cuda.is_available():
        if nprocs > torch.cuda.device_count() and backend != "gloo":
            raise ValueError(f"{nprocs} processes but {torch.cuda.device_count()} GPUs on this machine: one process "
                             f"per GPU with nccl; use a layout with at most {torch.cuda.device_count()} processes "
                             "here, launch on several nodes (--nnodes), or share the GPUs over gloo (--backend "
                             "gloo)")
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
                probe.bind((LOOPBACK, wanted))
                return wanted
            except OSError:
                print(f"plait train: port {wanted} is in use; using a free one instead", file=sys.stderr)
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]
