"""`plait plan`: how to train this model on these devices.

    plait plan --model gpt-175b --cluster dgx-a100 --gpus 1024 --global-batch 1536
    plait plan --model gpt --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 51200 \\
               --cluster dgx-h100 --gpus 64 --global-batch 512 --tp 4 --json
    plait plan --cluster local --nprocs 4 --global-batch 16        # plait train's GPT here
    plait plan --model gpt-175b --cluster dgx-h100 --gpus 1024 --global-batch 1536 \\
               --device-profile h100.json     # GPUs priced by a measured device profile
    plait plan --model hf:config.json --gpus 8 --global-batch 64 --seq 1024   # a HF model, its tp plan priced
    plait plan --module my_pkg.models:build --tp-plan my_pkg.models:PLAN --gpus 8 --global-batch 64

Without degrees it searches every layout and prints the best ones, the winner's time
and memory and, per choice, why; any of --tp --pp --dp --micro-batch --schedule
--virtual --recompute --zero-stage --sequence-parallel fixes that choice and the rest
are searched. ``--json`` prints the ranked list (keys in the README) and nothing else
on stdout. The search prices at most ``--max-layouts`` layouts; when that budget cuts
it, the last line (on stderr with --json) says what was thinned and how many layouts
were not priced.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import replace

from plait.cli.environment import cache_dir
from plait.cost.presets import PLACEHOLDER_LOCAL_LINK
from plait.cost.profile import DEFAULT_PROFILE_BACKEND, load_profile, ProfileMismatchWarning
from plait.plan import (
    cluster_preset,
    CLUSTER_PRESETS,
    explain,
    model_preset,
    MODEL_PRESETS,
    PlanRequest,
    PRECISIONS,
    precision_for,
    search,
    table,
    TransformerModel,
    TransformerSpec,
)
from plait.cost.topology_io import load_topology
from plait.plan.cluster import check_count, MAX_DEVICES, topology_cluster
from plait.plan.layout import MESH_ORDERS
from plait.names.precision import AUTOCAST_DTYPE_NAMES
from plait.names.schedules import INTERLEAVED_1F1B, NO_PIPELINE, PIPELINE_SCHEDULES
from plait.plan.cpu_profile import compute_profile_path, host_model_from_profile, load_compute_profile
from plait.plan.device import load_device_profile, measure_device
from plait.plan.device_profile import profile_device
from plait.plan.grid import DEFAULT_MAX_LAYOUTS
from plait.plan.layers import RECOMPUTE_MODES
from plait.cli.plan_auto import add_auto_arguments, auto_flags_without_auto, run_auto
from plait.cli.explain_run import add_arguments as add_explain_run_arguments, run_explain
from plait.cli.plan_model import HF_PREFIX, hf_model, module_model
from plait.plan.tp_plan import PlannedModel, plan_lines

GIB = 1 << 30
_TRAIN_DEFAULT = dict(layers=4, hidden=128, heads=4, seq=64)  # plait train's GPT
# plait plan spelt interleaved 1F1B "interleaved" before plait.names.schedules gave every layer one
# spelling (interleaved_1f1b); the flag still takes the old one
OLD_INTERLEAVED = "interleaved"


def _schedule_name(text: str) -> str:
    """--schedule's value in plait.names.schedules' spelling (argparse then checks choices)."""
    return INTERLEAVED_1F1B if text == OLD_INTERLEAVED else text


def _bool_flag(parser, name: str, help: str) -> None:
    parser.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction,
                        default=None, help=help + " (default: searched)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="choose dp, tp, pp, micro-batching, schedule and memory options for a model on a cluster",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help=f"gpt (give the shape below), a preset: {', '.join(MODEL_PRESETS)} "
                            "(default: gpt-1.3b, or plait train's GPT with --cluster local), or hf:CONFIG, a Hugging "
                            "Face causal LM from a local config.json or a directory holding one (plait train --model "
                            "hf:CONFIG's model, built on the meta device: no weights, no memory; --seq: its sequence "
                            "length, default the config's positions), priced under its tensor-parallel plan")
    model.add_argument("--module", default=None, metavar="PKG.MOD:FUNCTION",
                       help="trace a real nn.Module instead (plait optimize's factory): FUNCTION is a function "
                            "called with no arguments that returns (module, example_inputs): an nn.Module "
                            "instance and one tensor, or a tuple of one, whose first dimension is the batch")
    model.add_argument("--tp-plan", default=None, metavar="PKG.MOD:NAME",
                       help="the tensor-parallel plan to price (--module or --model hf:): NAME is a plan dict "
                            "({'h.*.mlp.c_fc': ColwiseParallel(), ...}, what plait.parallel.tensor.parallelize "
                            "takes) or a function of the model returning one (default: plan_for(model) when plait "
                            "has a plan for the model; else --module prices tp=1 only)")
    for flag, help in (("layers", "transformer blocks"), ("hidden", "model width h"), ("heads", "attention heads"),
                       ("seq", "sequence length"), ("vocab", "vocabulary size"),
                       ("ffn-hidden", "MLP width (default 4h)")):
        model.add_argument(f"--{flag}", type=int, default=None, help=help)
    model.add_argument("--untied-head", action="store_true", help="a separate output head (default: tied)")
    model.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                       help="dropout on (its masks cost memory; presets: on)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--cluster", default="dgx-a100", help=f"{', '.join(CLUSTER_PRESETS)} (default dgx-a100)")
    cluster.add_argument("--gpus", type=int, default=None, help="devices (a multiple of 8 for DGX clusters)")
    cluster.add_argument("--nodes", type=int, default=None, help="nodes (instead of --gpus)")
    cluster.add_argument("--nprocs", type=int, default=None, help="local: processes on this machine")
    cluster.add_argument("--profile", default=None, help="local: calibration profile for the link "
                                                         "(default: the one plait calibrate saved)")
    cluster.add_argument("--topology", default=None, metavar="FILE",
                         help="local: the links between this machine's ranks from a topology file (e.g. plait "
                              "testbed probe's: its hosts become nodes, their ranks devices); the calibration "
                              "profile's link stays the one within a host")
    cluster.add_argument("--device-profile", default=None, metavar="PATH",
                         help="price the cluster's devices with this device profile (a JSON that bench/gpu/"
                              "fit_profile.py writes from measured kernels) instead of the preset's device")
    cluster.add_argument("--memory-limit-gib", type=float, default=None,
                         help="usable memory per device (default: the device's)")
    layout = parser.add_argument_group("layout (each fixes that choice; the rest are searched)")
    layout.add_argument("--global-batch", type=int, default=None,
                        help="sequences (samples) per optimizer step (required; with --auto: default the example "
                             "inputs' batch)")
    for flag in ("tp", "pp", "dp", "micro-batch", "virtual", "zero-stage"):
        layout.add_argument(f"--{flag}", type=int, default=None)
    layout.add_argument("--mesh-order", default="tp,dp,pp", choices=MESH_ORDERS,
                        help="plait train's --mesh-order (axes innermost first): tp,pp,dp puts each pipeline on "
                             "consecutive ranks, so dp groups span the hosts (default tp,dp,pp)")
    layout.add_argument("--schedule", default=None, type=_schedule_name, choices=(NO_PIPELINE, *PIPELINE_SCHEDULES),
                        help="the pipeline schedule, as plait train --schedule spells it (none: pp=1); the old "
                             f"spelling {OLD_INTERLEAVED} is still accepted for {INTERLEAVED_1F1B}")
    layout.add_argument("--recompute", default=None, choices=RECOMPUTE_MODES,
                        help="activation recomputation, as plait train --recompute runs it: none, selective (the "
                             "attention core) or full (each block keeps its input) (default: searched)")
    layout.add_argument("--no-recompute", dest="recompute", action="store_const", const="none",
                        help="the same as --recompute none")
    _bool_flag(layout, "sequence-parallel", "sequence parallelism (tp > 1)")
    layout.add_argument("--precision", default=None, choices=tuple(PRECISIONS),
                        help="bf16-mixed (default on GPUs), fp16-mixed or fp32 (default on --cluster local); under "
                             "the plait accounting a mixed precision is plait train's: autocast over fp32 weights")
    layout.add_argument("--offload-activations", action="store_true",
                        help="price plait train --offload-activations: at most two micro-batches' saved "
                             "activations in memory per rank (the running backward's and the prefetched next)")
    layout.add_argument("--offload-optimizer", action="store_true",
                        help="price plait train --offload optimizer: ZeRO's optimizer state (zero stage 1-3) in "
                             "memory-mapped files, not in memory (its disk time is not priced)")
    layout.add_argument("--accounting", default=None, choices=("megatron", "plait"),
                        help="activation accounting: megatron's fused kernels (default on GPUs) or plait's "
                             "eager GPT (default local)")
    layout.add_argument("--max-micro-batch", type=int, default=32, help="largest micro-batch searched")
    layout.add_argument("--max-layouts", type=int, default=DEFAULT_MAX_LAYOUTS, metavar="N",
                        help=f"search budget: price at most N layouts (default {DEFAULT_MAX_LAYOUTS:,}, every preset "
                             "search in full); beyond it the micro-batch sizes and pp degrees, then the tp degrees, "
                             "are thinned to geometric ladders and the output says what was not priced")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=5, help="plans to list")
    out.add_argument("--json", action="store_true", help="print the ranked plans as JSON only")
    add_auto_arguments(parser)
    add_explain_run_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _transformer(args):
    shape = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq_len": args.seq,
             "vocab": args.vocab, "ffn_hidden": args.ffn_hidden}
    name = args.model or ("gpt" if args.cluster == "local" else "gpt-1.3b")
    if name == "gpt":
        if args.cluster == "local":
            for key, value in _TRAIN_DEFAULT.items():
                shape["seq_len" if key == "seq" else key] = shape["seq_len" if key == "seq" else key] or value
            shape["vocab"] = shape["vocab"] or _train_vocab()
        missing = [f"--{k.replace('_len', '').replace('_', '-')}" for k, v in shape.items()
                   if v is None and k != "ffn_hidden"]
        if missing:
            raise ValueError(f"--model gpt needs {' '.join(missing)} (or name a preset with --model)")
        # plait train's GPT has an untied head by default (a tied one cannot be pipelined there)
        tied = not args.untied_head and (args.cluster != "local" or _train_tied_head())
        return TransformerSpec(name="gpt", ffn_hidden=shape.pop("ffn_hidden") or 0, tied_head=tied,
                               dropout=bool(args.dropout), **{k: v for k, v in shape.items() if k != "ffn_hidden"})
    spec = model_preset(name)
    overrides = {k: v for k, v in shape.items() if v is not None}
    if args.untied_head:
        overrides["tied_head"] = False
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    if overrides:
        spec = replace(spec, **overrides)
    return spec


def _train_tied_head() -> bool:
    from plait.train.config import TrainConfig

    return TrainConfig().tied_head


def _train_vocab() -> int:
    """The vocabulary of plait train's default corpus (characters of Python's sources)."""
    from plait.train.config import TrainConfig
    from plait.train.corpus import load_corpus

    config = TrainConfig()
    return load_corpus(config.data, max_bytes=config.data_max_bytes, val_fraction=config.val_fraction,
                       cache_dir=cache_dir()).vocab_size


def _model_matmul_shapes(model) -> list[tuple[int, int, int]] | None:
    """The (m, n, k) products of a transformer's forward at micro-batches 1, 4 and 16:
    QKV, proj, fc1, fc2 and the head over b·s tokens, and the attention products."""
    spec = getattr(model, "spec", None)
    if spec is None:
        return None
    h, f, s, head_dim = spec.hidden, spec.ffn, spec.seq_len, spec.hidden // spec.heads
    shapes = []
    for batch in (1, 4, 16):
        tokens = batch * s
        shapes += [(tokens, 3 * h, h), (tokens, h, h), (tokens, f, h), (tokens, h, f), (tokens, spec.vocab, h)]
    shapes += [(s, s, head_dim), (s, head_dim, s)]
    return shapes


def _local_cluster(args, precision_name: str, emit, model=None, dtype: str | None = None, *,
                   cache_directory=None):
    """This machine as a cluster of ``--nprocs`` ranks. Compute: the profile `plait calibrate
    --compute --nprocs N` saved in ``cache_directory`` (default the CLI's cache_dir()) when
    it is for N ranks, this dtype and this machine; else measured now (one process alone,
    scaled by cores/processes: an assumption), the line saying why. The host: how the N
    ranks share the cores, with the profile's measured wait for the slowest rank."""
    nprocs = args.nprocs or args.gpus
    if nprocs is None:
        raise ValueError("--cluster local needs --nprocs N (processes on this machine)")
    dtype = dtype or precision_for(precision_name, "plait").dtype  # --auto: the traced model's own dtype
    directory = cache_dir() if cache_directory is None else cache_directory
    compute_path = compute_profile_path(nprocs, directory)
    compute, why_not = load_compute_profile(compute_path, nprocs=nprocs, dtype=dtype)
    if compute is not None:
        device = profile_device(compute, where=compute_path.name)
        emit(f"compute: calibrated profile {compute_path} ({nprocs} ranks at once, plait calibrate --compute): "
             f"{device.describe()}")
    else:
        started = time.perf_counter()
        device = measure_device(dtype=dtype, processes=nprocs, matmul_shapes=_model_matmul_shapes(model))
        emit(f"measured this machine in {time.perf_counter() - started:.1f} s ({why_not}; one process alone, "
             f"scaled by cores/processes): {device.describe()} [{device.source}]")
    host = host_model_from_profile(compute, nprocs=nprocs)
    emit(f"host: {host.ranks} ranks x {host.threads_per_rank} thread(s) on {host.cores} cores; wait for the slowest "
         f"rank {host.sync_wait_s * 1e3:.3g} ms + {host.sync_wait_per_compute:.3g} x compute per call [{host.source}]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileMismatchWarning)
        # plait train's default on one host: shared memory, so its calibration (calibrate's default)
        profile = load_profile(args.profile, backend=DEFAULT_PROFILE_BACKEND, cache_dir=directory)
    if profile is None:
        if args.profile:
            raise ValueError(f"no calibration profile at {args.profile}; run plait calibrate --output {args.profile}")
        link, overhead, source = PLACEHOLDER_LOCAL_LINK, 0.0, "placeholder link (run `plait calibrate` to measure)"
        p2p_call_s, transport = None, None  # a pipeline message pays the per-call cost
    else:
        link, overhead, source = profile.link, profile.call_overhead_s, "calibration profile"
        p2p_call_s = profile.collective_call_s("p2p")  # its own fitted software cost, when the profile has one
        transport = profile.transport_model  # format 2: beta(n) and each call kind's own cost
    emit(f"link: {source}: alpha {link.alpha_s * 1e6:.3g} us, {1e-9 / link.beta_s_per_byte:.3g} GB/s, "
         f"{overhead * 1e6:.3g} us per call" + ("" if p2p_call_s is None else f", {p2p_call_s * 1e6:.3g} us per p2p"))
    if transport is not None:
        emit(f"transport model (prices the collectives and pipeline messages within a host): {transport.describe()}")
    if args.topology is None:
        return cluster_preset("local", nprocs=nprocs, device=device, local_link=link, call_overhead_s=overhead,
                              link_source=source, host=host, p2p_call_s=p2p_call_s, transport=transport)
    return topology_cluster(load_topology(args.topology), nprocs=nprocs, device=device, local_link=link,
                            call_overhead_s=overhead, link_source=f"{source}; between hosts: {args.topology}",
                            host=host, p2p_call_s=p2p_call_s, transport=transport)


def _device_text(device) -> str:
    """The device line: a calibrated device names its profile (in describe()); a
    preset without one says its efficiencies are assumed."""
    if device.calibrated or not device.source:
        return device.describe()
    return f"{device.describe()} [uncalibrated: {device.source}]"


def _check_flag_combinations(args, local: bool) -> None:
    """Refuse flags the chosen cluster or model would silently ignore."""
    problems = []
    hf = (args.model or "").startswith(HF_PREFIX)
    if args.module or hf:
        flags = ("layers", "hidden", "heads", "vocab", "ffn_hidden") + (("model", "seq") if args.module else ())
        shaped = [f"--{flag}" for flag in flags if getattr(args, flag.replace("-", "_")) is not None]
        shaped += ["--untied-head"] if args.untied_head else []
        shaped += ["--dropout"] if args.dropout is not None else []
        shaped += ["--accounting"] if args.accounting is not None else []
        if shaped:
            own = "--module" if args.module else "--model hf:"
            problems.append(f"{', '.join(shaped)} describe a GPT; {own} traces its own model: drop them")
    elif args.tp_plan is not None:
        problems.append("--tp-plan is for --module or --model hf: (plait's GPT has its own tensor parallelism)")
    if local:
        if args.nodes is not None:
            problems.append("--nodes is for DGX clusters; --cluster local is one machine: give --nprocs")
        if args.gpus is not None and args.nprocs is not None and args.gpus != args.nprocs:
            problems.append(f"--gpus {args.gpus} and --nprocs {args.nprocs} disagree; give --nprocs only")
    else:
        if args.nprocs is not None:
            problems.append(f"--nprocs is for --cluster local; {args.cluster} takes --gpus or --nodes")
        if args.profile is not None:
            problems.append(f"--profile is for --cluster local; {args.cluster}'s links come from its topology")
        if args.topology is not None:
            problems.append(f"--topology is for --cluster local (the testbed's links); {args.cluster} has its own")
    if local and args.device_profile is not None:
        problems.append("--device-profile is for a preset cluster's GPUs; --cluster local measures this machine")
    if problems:
        raise ValueError("; ".join(problems))


def run(args) -> int:
    if args.explain_run is not None:
        return run_explain(args)
    if args.auto:
        return run_auto(args, _local_cluster, _check_flag_combinations)
    without = auto_flags_without_auto(args)
    if without:
        raise ValueError(f"{', '.join(without)}: only with --auto (automatic sharding): add --auto or drop them")
    if args.global_batch is None:
        raise ValueError("--global-batch N is required (sequences per optimizer step)")
    emit = (lambda text: print(text, file=sys.stderr)) if args.json else print
    local = args.cluster == "local"
    precision = args.precision or ("fp32" if local else "bf16-mixed")
    # a Hugging Face model is priced as plait train --model hf: runs it: autocast over fp32 weights
    hf = (args.model or "").startswith(HF_PREFIX)
    accounting = args.accounting or ("plait" if local or hf else "megatron")
    _check_flag_combinations(args, local)
    # the request is checked before any work (tracing a module, measuring this machine)
    request = PlanRequest(
        global_batch=args.global_batch, tp=args.tp, pp=args.pp, dp=args.dp, micro_batch=args.micro_batch,
        schedule=args.schedule, virtual=args.virtual, recompute=args.recompute, zero_stage=args.zero_stage,
        sequence_parallel=args.sequence_parallel, precision=precision, accounting=accounting,
        offload=args.offload_activations, offload_optimizer=args.offload_optimizer, mesh_order=args.mesh_order,
        memory_limit_bytes=None if args.memory_limit_gib is None else args.memory_limit_gib * GIB,
        max_micro_batch=args.max_micro_batch, top=args.top, max_layouts=args.max_layouts)
    processes = args.nprocs if args.nprocs is not None else args.gpus
    if local and processes is not None:
        check_count("nprocs", processes, most=MAX_DEVICES)
    device = load_device_profile(args.device_profile) if args.device_profile else None
    cluster = None if local else cluster_preset(args.cluster, gpus=args.gpus, nodes=args.nodes, device=device)
    # a traced model under plait's accounting runs as plait train does: autocast over fp32 weights
    autocast = AUTOCAST_DTYPE_NAMES[precision] if accounting == "plait" else None
    if args.module:
        model = module_model(args.module, args.tp_plan, autocast)
    elif (args.model or "").startswith(HF_PREFIX):
        model = hf_model(args.model[len(HF_PREFIX):], args.seq, args.tp_plan, autocast)
    else:
        model = TransformerModel(_transformer(args))
    if local:
        cluster = _local_cluster(args, precision, emit, model)
    result = search(model, cluster, request)
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
        if result.pruning is not None and result.pruning.pruned:
            emit(f"plait plan: {result.pruning.text()}")
        return 0
    print(f"model: {result.model_description}")
    print(f"cluster: {result.cluster_description} [{cluster.link_source or 'given links'}]")
    print(f"device: {_device_text(cluster.device)}")
    print(f"global batch {args.global_batch}, precision {precision}, activation accounting {accounting}")
    print()
    print("\n".join(table(result)))
    print()
    print("\n".join(explain(result)))
    if isinstance(model, PlannedModel):
        print()
        print("\n".join(plan_lines(model, result.best.layout, precision_for(precision, accounting))))
    return 0
