"""What ``plait train`` checks before any process starts, so that every bad value is
named once, by the launcher, instead of by every rank after the world has started:
the data (enough text for the batch and the sequence length), what the run needs of
the machine (plait.train.budget), the output directory (a writable directory, room
for a checkpoint), the resume choice (plait.train.rundir), and which address each
listening socket binds.
"""

from __future__ import annotations

import errno
import fcntl
import shutil
import socket
import struct
import tempfile
import warnings
from pathlib import Path

from plait.cost.profile import ProfileMismatchWarning, load_profile

from plait.names.schedules import INTERLEAVED_1F1B
from plait.parallel.mesh import ParallelDims
from plait.parallel.pipeline import build
from plait.train import budget, checkpoint as ckpt, checkpoint_load, rundir
from plait.train.config import TrainConfig
from plait.train.corpus import CorpusTooSmall, min_characters, windows_per_epoch
from plait.train.build import load_data, model_description
from plait.train.checkpoint_checks import check_user_path

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


# ----------------------------------------------------------------------------- data

def prepare_data(config: TrainConfig, cache_dir=None):
    """Load (tokenise and cache under ``cache_dir``, the first time) the data once in the
    launcher, so the ranks only read the cache, and check it holds what the run reads: for the GPT,
    ``global_batch`` training windows of seq_len + 1 ids and (with evaluation) one
    validation window."""

    if config.model == "mlp":
        return load_data(config, cache_dir)
    if config.hf_source is not None and config.tokenizer:  # tokenized text (plait.train.text_data)
        return _checked_text_data(config, load_data(config, cache_dir))
    val_windows = 1 if config.eval_interval else 0
    needed = min_characters(config.global_batch, config.seq_len, config.val_fraction, val_windows=val_windows)
    fix = (f"plait train needs at least {needed:,} characters here (global_batch({config.global_batch}) windows of "
           f"seq_len({config.seq_len}) + 1 for training" + (", one for validation" if val_windows else "")
           + f", val_fraction {config.val_fraction}): give more text"
           + (f" (and --data-max-bytes >= {needed})" if config.data_max_bytes < needed else "")
           + ", or lower --global-batch / --seq-len")
    try:
        data = load_data(config, cache_dir)
    except CorpusTooSmall as error:
        raise ValueError(f"corpus {error.description} has {error.nchars:,} characters; {fix}") from None
    short = windows_per_epoch(data.train, config.seq_len) < config.global_batch or \
        (val_windows and windows_per_epoch(data.val, config.seq_len) < 1)
    if short:
        raise ValueError(f"corpus {data.source} has {data.nbytes:,} characters; {fix}")
    return data


def _checked_text_data(config: TrainConfig, data):
    """Tokenized text holds global_batch training windows of seq_len + 1 ids and (with
    evaluation) one validation window."""
    train, val = data.train_windows(config.seq_len), data.val_windows(config.seq_len)
    if train < config.global_batch or (config.eval_interval and val < 1):
        raise ValueError(f"data {data.source} gives {train:,} training and {val:,} validation windows of seq_len("
                         f"{config.seq_len}) + 1 tokens; plait train needs global_batch({config.global_batch}) for "
                         "training" + (" and one for validation" if config.eval_interval else "") + ": give more "
                         "text, or lower --global-batch / --seq-len" + (", or raise --val-fraction" if val < 1 else ""))
    return data


# ----------------------------------------------------------------------------- layout

def describe_layout(config: TrainConfig, data) -> str:
    """The mesh (which rank holds which stage and tp shard), the schedule and the
    batch arithmetic: what --dry-run prints."""

    dims = ParallelDims(dp=config.dp, tp=config.tp, pp=config.pp, order=config.mesh_order)
    virtual = config.virtual if config.schedule == INTERLEAVED_1F1B else 1
    vocab = data.vocab_size if config.model == "gpt" else 10
    counts = budget.layer_parameters(config, vocab)
    if config.model == "gpt":
        names = ["embedding"] + [f"block {i}" for i in range(config.layers)] + ["head"]
    else:
        names = [f"linear {i}" for i in range(len(counts))]
    bounds = budget.chunk_bounds(config, counts)
    chunk_text = [names[start] if end - start == 1 else f"{names[start]}..{names[end - 1]}"
                  for start, end in zip(bounds, bounds[1:])]

    # which chunks a rank holds does not depend on the number of micro-batches: a short schedule shows it
    schedule = build(config.schedule, config.pp, min(config.microbatches, 2 * config.pp),
                     virtual if virtual > 1 else None)
    stage_layers = {}
    for pp_rank in range(config.pp):
        held = [f"chunk {stage} [{chunk_text[stage]}]" + (" (replica)" if replica else "")
                for replica, stage in schedule.stages_of(pp_rank)]
        stage_layers[pp_rank] = ", ".join(held)
    lines = [dims.describe(stage_layers, " of every matrix" if config.model == "gpt" else ""), ""]
    model = (f"GPT layers={config.layers} hidden={config.hidden} heads={config.heads} seq_len={config.seq_len} "
             f"vocab={data.vocab_size}: {sum(counts):,} parameters" if config.model == "gpt"
             else f"MLP {[64, *config.mlp_hidden, 10]}: {sum(counts):,} parameters")
    lines += [f"model     {model}",
              f"pipeline  {config.pp * virtual} chunk(s) of " + _chunk_sizes(config, bounds, names),
              f"schedule  {config.schedule}" + (f" (virtual={virtual})" if virtual > 1 else "")
              + f", {config.microbatches} micro-batches of {config.micro_batch} per dp rank",
              f"batch     global {config.global_batch} = dp {config.dp} x per-rank {config.per_rank_batch}"
              + (f" sequences of {config.seq_len} tokens" if config.model == "gpt" else " samples"),
              f"data      {getattr(data, 'source', config.data)}",
              f"output    {config.out}"]
    return "\n".join(lines)


def _chunk_sizes(config: TrainConfig, bounds: list[int], names: list[str]) -> str:
    """The layers of each chunk and where the cut came from (--dry-run's pipeline line)."""
    what = "transformer blocks" if config.model == "gpt" else "linear layers"
    if config.model == "gpt":  # the embedding and the head are layers of their own: count the blocks
        sizes = [sum(name.startswith("block") for name in names[start:end]) for start, end in zip(bounds, bounds[1:])]
    else:
        sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    how = "--stage-layers" if config.stage_layers else "balanced by parameters (--stage-layers chooses)"
    return f"{','.join(map(str, sizes))} {what}, {how}"


# ----------------------------------------------------------------------------- output directory

def check_output_path(out: Path) -> None:
    """Without writing: --out is a path the system takes (no name over NAME_MAX, not
    over PATH_MAX), not a file, and no file stands where a parent must be."""
    check_user_path(out, "--out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory: give a directory for the run (it is created "
                         "if missing)")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {out}: {parent} is a file, so the run directory cannot be created under it")
            break


def check_output_dir(out: Path, checkpoint_nbytes: int) -> None:
    """--out can be created and written to, and has room for one checkpoint."""
    check_output_path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ValueError(f"--out {out} is not writable ({error.strerror}): choose a directory you can write "
                         "to") from None
    free = shutil.disk_usage(out).free
    if free < checkpoint_nbytes:
        raise ValueError(f"--out {out} has {free:,} bytes free but one checkpoint needs about {checkpoint_nbytes:,} "
                         "(every parameter and its optimizer state): free some space or choose another --out")


def check_resume_choice(config: TrainConfig, resume: str, data, *, run_id: str | None = None,
                        force_fresh: bool = False, log=print) -> rundir.ResumePlan:
    """Before any process starts: what the run will start from (rundir.decide, which
    refuses to start over an earlier run), said in one line, and that the checkpoint is
    of this model (the differing fields named). Changes nothing: rank 0 decides again
    under the run lock and carries the plan out."""

    plan = rundir.decide(Path(config.out), resume, run_id=run_id, force_fresh=force_fresh)
    if plan.checkpoint is not None:
        manifest = ckpt.read_manifest(plan.checkpoint)
        checkpoint_load.check_compatible(manifest, model_description(config, data))
        checkpoint_load.check_same_data(manifest, getattr(data, "digest", None))
    what = "; ".join((*plan.notes, f"resuming from {plan.checkpoint}" if plan.checkpoint is not None
                      else "starting at step 0"))
    if plan.move_aside_earlier_run:
        what += f"; the earlier run in {config.out} will be moved to {Path(config.out) / rundir.PREVIOUS_DIR}/"
    for state in plan.set_aside:
        what += f"; {state.describe()} is newer but not complete: it will be kept as {state.path.name}.{state.reason}"
    log(f"plait train: {what}")
    return plan


# ----------------------------------------------------------------------------- calibration profile

def check_comm_profile(config: TrainConfig) -> None:
    """Before any process starts: --comm-profile names a readable calibration profile
    (a regular JSON file of bounded size that parses), as each rank will load it. A
    FIFO or /dev/zero hung every rank, a directory failed after they started. Its
    machine-mismatch warning is left to the ranks (who use the profile)."""

    if not config.comm_profile:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileMismatchWarning)
        profile = load_profile(config.comm_profile)
    if profile is None:
        raise ValueError(f"--comm-profile {config.comm_profile!r}: no such file; run plait calibrate --output "
                         f"{config.comm_profile} first, or leave --comm-profile out for the default table")


# ----------------------------------------------------------------------------- addresses

def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP socket's source address
    after connect: no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError as error:
        raise ValueError(f"no route from this machine to the rendezvous host {host} ({error.strerror}): check "
                         "--rdzv-endpoint, or name this node's address with --local-addr") from None


def interface_with_address(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (Linux), or None."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError as error:
                if error.errno in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL):
                    continue
                raise
            if answer[20:24] == wanted:
                return name
    return None
