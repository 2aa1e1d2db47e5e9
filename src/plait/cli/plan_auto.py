"""`plait plan --auto`: Alpa-style automatic sharding of a traced model.

    plait plan --auto --module my_pkg.models:build --cluster dgx-a100 --gpus 8
    plait plan --auto --module my_pkg.models:build --cluster local --nprocs 4 --mesh 2x2 --save plan.json
    plait plan --auto --model hf:gpt2-config/ --seq 128 --global-batch 8 --gpus 8 --svg plan.svg

The model is a training step: ``--module``'s factory returns (module, example_inputs)
with ``module(*example_inputs)`` the scalar loss (dim 0 of the inputs is the batch;
``--global-batch`` repeats or cuts it to that many samples); ``--model hf:CONFIG`` is
the causal LM with its mean token cross-entropy on ``--global-batch`` sequences of
``--seq`` tokens. The planner (``plait.plan.auto.planner``) solves the sharding ILP on
every 1-D and 2-D mesh of the cluster (or ``--mesh``) and prints the chosen sharding per
operator group, the predicted step time and memory, and why; ``--save`` writes the
plan for ``plait train --plan FILE``, ``--svg``/``--dot`` the graph coloured by layout,
``--json`` the plan document on stdout (the rest goes to stderr).

The flags of the knob search (--tp, --pp, --schedule, --recompute, ...) and of plait's
GPT (--layers, --hidden, ...) do not apply and are refused by name. This module stays
torch-free until a plan runs (``plait --help`` must not load torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plait.cli.plan_model import HF_PREFIX
from plait.plan import cluster_preset
from plait.plan.auto.plan_file import plan_json, save_plan
from plait.plan.auto.report import plan_dot, plan_svg, report_lines
from plait.plan.device import load_device_profile

__all__ = ["add_auto_arguments", "run_auto", "parse_mesh", "auto_flags_without_auto"]

# the plan flags --auto takes (dests); any other plan flag given with --auto is refused by name
AUTO_DESTS = frozenset({"auto", "mesh", "save", "svg", "dot", "time_limit_s", "microbatches", "dtype", "module",
                        "model", "seq", "cluster", "gpus", "nodes", "nprocs", "profile", "topology", "device_profile",
                        "memory_limit_gib", "global_batch", "json", "help", "plan_defaults"})
_OWN_FLAGS = ("mesh", "save", "svg", "dot", "microbatches", "dtype", "time_limit_s")


def add_auto_arguments(parser: argparse.ArgumentParser) -> None:
    """--auto and its flags on plait plan's parser (called last in its add_parser: it
    records the other flags' defaults, to refuse those given with --auto)."""
    defaults: dict[str, tuple[object, str]] = {}
    for action in parser._actions:  # argparse keeps the flags only here; --no-recompute shares --recompute's dest
        if action.option_strings and action.dest not in AUTO_DESTS and action.dest not in defaults:
            defaults[action.dest] = (action.default, action.option_strings[0])
    group = parser.add_argument_group("automatic sharding (--auto: Alpa's intra-operator ILP over the traced graph)")
    group.add_argument("--auto", action="store_true",
                       help="choose every operator's sharding (replicated, batch, column/row, ...) on a 1-D or 2-D "
                            "device mesh by an ILP over the traced training step of --module or --model hf:, priced "
                            "by plait's cost model; prints the sharding per operator group, the predicted step time "
                            "and memory, and why")
    group.add_argument("--mesh", default=None, metavar="AxB",
                       help="--auto: the device mesh, e.g. 8 or 2x4 (default: every 1-D and 2-D mesh of the cluster)")
    group.add_argument("--microbatches", type=int, default=None, metavar="M",
                       help="--auto: also search pipeline stages on sub-meshes (Alpa's inter-operator pass, each "
                            "stage priced by the ILP) for M micro-batches per step; shown apart from the "
                            "intra-operator plan")
    group.add_argument("--dtype", default=None, metavar="DTYPE",
                       help="--auto: price the operators' compute as if in DTYPE (e.g. bfloat16 for a float32 model "
                            "trained under autocast on GPUs; default: each operator's own dtype; --cluster local "
                            "measures this machine in it)")
    group.add_argument("--time-limit-s", type=float, default=60.0, help="--auto: the ILP's time limit per mesh")
    group.add_argument("--save", default=None, metavar="FILE", help="--auto: write the plan (JSON) for plait train "
                                                                   "--plan FILE")
    group.add_argument("--svg", default=None, metavar="FILE", help="--auto: the graph coloured by layout, as SVG")
    group.add_argument("--dot", default=None, metavar="FILE", help="--auto: the same graph as Graphviz DOT text")
    parser.set_defaults(plan_defaults=defaults)


def auto_flags_without_auto(args) -> list[str]:
    """The --auto-only flags given without --auto."""
    return [f"--{name.replace('_', '-')}" for name in _OWN_FLAGS
            if name != "time_limit_s" and getattr(args, name) is not None] + (
        ["--time-limit-s"] if args.time_limit_s != 60.0 else [])


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"8"`` -> (8,), ``"2x4"`` -> (2, 4); ValueError naming the text otherwise."""
    parts = text.lower().split("x")
    if not 1 <= len(parts) <= 2 or not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"--mesh {text!r} must be N or AxB with whole numbers >= 1, e.g. 8 or 2x4")
    return tuple(int(part) for part in parts)


def _refused(args) -> list[str]:
    """Plan flags given with --auto that it does not use (knob search, plait's GPT)."""
    problems = [flag for dest, (default, flag) in args.plan_defaults.items() if getattr(args, dest, default) != default]
    model = args.model or ""
    if args.module is None and not model.startswith(HF_PREFIX):
        problems.append("--model " + (model or "(none)") + " (--auto plans a traced model: give --module "
                        "PKG.MOD:FUNCTION or --model hf:CONFIG)")
    if args.module is not None and args.model is not None:
        problems.append("--model with --module (give one model)")
    if args.module is not None and args.seq is not None:
        problems.append("--seq with --module (the factory's inputs have their own length)")
    return problems


def _resize_batch(inputs, batch: int):
    """The inputs with dim 0 (the batch) repeated or cut to ``batch`` rows (row i = row i mod B)."""
    import torch  # only when a plan runs

    first = inputs[0].shape[0]
    rows = torch.arange(batch) % first
    return tuple(tensor[rows] if tensor.dim() >= 1 and tensor.shape[0] == first else tensor for tensor in inputs)


def module_train_step(spec: str, global_batch: int | None):
    """(module, example_inputs) of a --module factory whose module returns the scalar loss."""
    import torch  # only when a plan runs

    from plait.cli.factory import check_forward, describe_tensor, FactoryError, load_factory

    module, inputs = load_factory(spec)
    check_forward(spec, module, inputs)
    if any(tensor.dim() < 1 for tensor in inputs):
        raise FactoryError(f"factory {spec!r}: plait plan --auto needs every example input to have a batch "
                           f"dimension first; got {', '.join(describe_tensor(t) for t in inputs)}")
    if global_batch is not None:
        inputs = _resize_batch(inputs, global_batch)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        loss = module(*inputs)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        shown = describe_tensor(loss) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise FactoryError(f"factory {spec!r}: plait plan --auto plans a training step, so module(*example_inputs) "
                           f"must return the scalar loss; it returned {shown}: wrap the model and its loss in one "
                           "module (forward(x, target) -> loss)")
    return module, inputs


def hf_train_step(source: str, seq_len: int | None, global_batch: int):
    """(module, (input_ids, targets)) of ``hf:CONFIG``: plait.train.hf_model.causal_lm_step,
    the causal LM returning its mean next-token cross-entropy (parameters ``lm.<HF name>``)."""
    from plait.train.hf_model import causal_lm_step  # loads torch and transformers: only for --model hf:

    return causal_lm_step(source, seq_len, global_batch)


def _float_dtype(model, inputs) -> str:
    """The name of the model's floating dtype (its first floating parameter's, else its
    first floating input's, else float32): what a measured --cluster local is timed in."""
    tensors = [*model.parameters(), *inputs]
    return next((str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()), "float32")


def run_auto(args, local_cluster, check_flags) -> int:
    """Plan, print and write (see the module doc). ``local_cluster(args, precision, emit,
    model, dtype=)`` is plait plan's builder of the measured --cluster local,
    ``check_flags(args, local)`` its check of the cluster flags."""
    problems = _refused(args)
    if problems:
        raise ValueError("with --auto these do not apply: " + "; ".join(problems) + ": drop them")
    check_flags(args, args.cluster == "local")
    emit = (lambda text: print(text, file=sys.stderr)) if args.json else print
    mesh_shapes = None if args.mesh is None else [parse_mesh(args.mesh)]
    hf = (args.model or "").startswith(HF_PREFIX)
    if hf and args.global_batch is None:
        raise ValueError("--auto --model hf: needs --global-batch N (sequences per step)")
    if args.global_batch is not None and args.global_batch < 1:
        raise ValueError(f"--global-batch {args.global_batch} must be >= 1 (samples per step)")
    if args.microbatches is not None and args.microbatches < 1:
        raise ValueError(f"--microbatches {args.microbatches} must be >= 1")
    if args.time_limit_s <= 0:
        raise ValueError(f"--time-limit-s {args.time_limit_s} must be > 0 (seconds per mesh)")
    # imported here: the planner traces with torch.export, which plait plan without --auto never loads
    from plait.plan.auto.planner import auto_plan

    if hf:
        model, inputs = hf_train_step(args.model[len(HF_PREFIX):], args.seq, args.global_batch)
        source = args.model
    else:
        model, inputs = module_train_step(args.module, args.global_batch)
        source = args.module
    if args.cluster == "local":  # measured in the dtype the operators are priced in
        cluster = local_cluster(args, "fp32", emit, None, dtype=args.dtype or _float_dtype(model, inputs))
    else:
        device = load_device_profile(args.device_profile) if args.device_profile else None
        cluster = cluster_preset(args.cluster, gpus=args.gpus, nodes=args.nodes, device=device)
    limit = None if args.memory_limit_gib is None else args.memory_limit_gib * (1 << 30)
    plan = auto_plan(model, inputs, cluster, mesh_shapes=mesh_shapes, memory_limit_bytes=limit,
                     time_limit_s=args.time_limit_s, microbatches=args.microbatches, dtype=args.dtype)
    shapes = [tuple(tensor.shape) for tensor in inputs]
    written = []
    if args.save:
        written.append(f"plan: {save_plan(plan, args.save, source=source, input_shapes=shapes)}")
    for path, text_of, what in ((args.svg, plan_svg, "picture"), (args.dot, plan_dot, "graphviz")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text_of(plan))
            written.append(f"{what}: {path}")
    if args.json:
        print(json.dumps(plan_json(plan, source=source, input_shapes=shapes), indent=1, allow_nan=False))
    else:
        print("\n".join(report_lines(plan)))
    for line in written:
        emit(f"wrote {line}")
    return 0
