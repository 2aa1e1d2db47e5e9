"""``plait train --plan FILE``: train a model under a plan saved by ``plait plan --auto
... --save FILE`` (plait.plan.auto.plan_file), on as many processes as the plan's mesh
has devices, with plait's auto-parallel executor (plait.parallel.auto.execute).

The model comes from the plan's source: a factory ``PKG.MOD:FUNCTION`` returning
``(module, example_inputs)`` whose module returns the scalar loss (the caller imports
it: plait.cli), or ``hf:CONFIG``, the causal LM with its loss at the plan's (batch, seq)
(plait.train.hf_model.causal_lm_step, fresh weights as plait plan --auto traced). Every rank builds it alike (the factory seeds it), re-traces it on the
example inputs, checks the trace against the plan (``SavedPlan.check_graph``: the node
names and kinds the plan was made for) and keeps its shards of the parameters.

Data: global batch t is synthetic and seeded, shaped like the example inputs: a
floating input is standard normal, an integer one uniform over the example's own range
[min, max] (class labels, token ids stay valid); batch t is a deterministic function of
(seed, t), the same on every rank (the executor takes the global inputs). With
``--data digits`` and inputs that fit scikit-learn's digits (features (B, 64) floating,
labels (B,) integer) batch t is the digits' (plait.train.data.global_batch, as plait
train's MLP reads them).

The step is plait train's: learning rate ``config.lr_at(step)``, AdamW or SGD
(``build.make_optimizer``: decay on matrices only), the global gradient norm clipped to
``grad_clip`` as torch's clip_grad_norm_ does, over the shards: each parameter's local
squared norm divided by its replica count (mesh devices / shards) and summed over the
world in one all-reduce. Rank 0 writes ``metrics.jsonl`` (step, loss, lr, grad_norm,
step_s) every ``log_interval`` steps and ``plan-run.json`` at the end (the plan's
predicted step time next to the measured median). Not yet: checkpoints and resume,
evaluation.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait.parallel.auto.execute import AutoParallelModule
from plait.parallel.auto.trace import simplify, trace_graph
from plait.plan.auto.plan_file import SavedPlan, load_plan
from plait.train.atomic_files import atomic_write
from plait.train.build import make_optimizer
from plait.train.config import TrainConfig
from plait.train.config_rules import DATA_SEED_STRIDE
from plait.train.data import global_batch, load_digits
from plait.train.hf_model import causal_lm_step
from plait.train.metrics import MetricsLog
from plait.train.world import init_distributed

# What a --plan run reads of TrainConfig; the rest (model, batch, layout) is the plan's and its factory's.
PLAN_FIELDS = ("data", "steps", "lr", "min_lr", "lr_schedule", "warmup_steps", "optimizer", "weight_decay", "beta1",
               "beta2", "momentum", "grad_clip", "seed", "out", "log_interval", "timeout_s", "backend")
RUN_RECORD = "plan-run.json"
DIGIT_FEATURES = 64  # scikit-learn's digits: 8 x 8 pixels
HF_SOURCE = "hf:"  # a plan of plait plan --auto --model hf:CONFIG


def load(path) -> SavedPlan:
    """The plan at ``path``, refused by name unless it names a factory this run can build."""
    saved = load_plan(path)
    if not saved.source:
        raise ValueError(f"plan {path} names no model source: save it with plait plan --auto --module "
                         "PKG.MOD:FUNCTION ... --save FILE, so plait train can build the model")
    if saved.source.startswith(HF_SOURCE) and len(saved.input_shapes[0] if saved.input_shapes else ()) != 2:
        raise ValueError(f"plan {path} is of {saved.source} but records no (batch, seq) input shape: save it again "
                         "with plait plan --auto --model hf:CONFIG ... --save FILE")
    return saved


def build_model(saved: SavedPlan, load_factory) -> tuple[torch.nn.Module, tuple]:
    """(module, example inputs) of the plan's source: an ``hf:CONFIG`` causal LM with its
    loss (plait.train.hf_model.causal_lm_step at the recorded (batch, seq)), else
    ``load_factory(source)`` (the caller's: plait.cli.factory)."""
    if saved.source.startswith(HF_SOURCE):
        batch, seq_len = saved.input_shapes[0]
        return causal_lm_step(saved.source[len(HF_SOURCE):], seq_len, batch)
    return load_factory(saved.source)


def plan_config(config: TrainConfig, saved: SavedPlan) -> TrainConfig:
    """``config`` with the layout fields set to what the plan runs on (dp = its devices,
    one sample per rank), so the launcher starts mesh-size processes."""
    devices = saved.mesh.size
    return config.replace(dp=devices, tp=1, pp=1, virtual=1, stage_layers=(), global_batch=devices, micro_batch=1,
                          zero_stage=0, offload="none", compression="none", recompute="none")


def given_fields_problems(given: list[str]) -> list[str]:
    """The TrainConfig fields set (flags or --config) that a --plan run does not read."""
    ignored = [name for name in given if name not in PLAN_FIELDS]
    if not ignored:
        return []
    return [f"{', '.join('--' + name.replace('_', '-') for name in ignored)} with --plan: the plan and its model "
            f"factory fix the model, batch and layout; leave them out (a --plan run reads "
            f"{', '.join(PLAN_FIELDS)})"]


def traced_step(saved: SavedPlan, model, example_inputs):
    """(traced, graph): the model re-traced as the plan was, checked against it."""
    traced = trace_graph(model, tuple(example_inputs))
    graph = simplify(traced.graph) if saved.simplified else traced.graph
    saved.check_graph(graph)
    return traced, graph


def batch_source(config: TrainConfig, example_inputs):
    """step -> the global batch of that step: the digits for ``data="digits"`` (refused by
    name unless the inputs fit them), synthetic for the default data (module docstring)."""
    if config.data == "digits":
        shapes = [tuple(tensor.shape) for tensor in example_inputs]
        fits = (len(example_inputs) == 2 and example_inputs[0].is_floating_point() and len(shapes[0]) == 2
                and shapes[0][1] == DIGIT_FEATURES and not example_inputs[1].is_floating_point()
                and shapes[1] == shapes[0][:1])
        if not fits:
            raise ValueError(f"--data digits with --plan: the factory's inputs have shapes {shapes}, the digits "
                             f"are (features (B, {DIGIT_FEATURES}) floating, labels (B,) integer); leave --data out "
                             "for synthetic batches shaped like the inputs")
        train_set = load_digits(seed=config.seed, dtype=example_inputs[0].dtype)[0]
        return lambda step: global_batch(train_set, step, shapes[0][0], seed=config.seed)
    if config.data != TrainConfig().data:
        raise ValueError(f"--data {config.data} with --plan: a plan run reads synthetic batches shaped like the "
                         "factory's inputs, or --data digits when they fit; leave --data out")
    return lambda step: synthetic_batch(example_inputs, config.seed, step)


def synthetic_batch(example_inputs, seed: int, step: int) -> tuple[torch.Tensor, ...]:
    """Global batch ``step``: shaped like ``example_inputs`` (module docstring)."""
    batch = []
    for index, example in enumerate(example_inputs):
        generator = torch.Generator().manual_seed((seed * DATA_SEED_STRIDE + step) * 64 + index)
        if example.is_floating_point():
            batch.append(torch.randn(example.shape, generator=generator, dtype=example.dtype))
        else:
            low, high = int(example.min()), int(example.max())
            batch.append(torch.randint(low, high + 1, example.shape, generator=generator, dtype=example.dtype))
    return tuple(batch)


def clip_gradients(module: AutoParallelModule, max_norm: float, mesh_shape: tuple[int, ...]) -> float:
    """The global gradient norm over the shards (module docstring), and the gradients
    scaled by min(1, max_norm / (norm + 1e-6)) when ``max_norm`` > 0 (torch's rule)."""
    squares = torch.zeros((), dtype=torch.float64)
    grads = []
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        shards = math.prod(size for size, placement in zip(mesh_shape, module.stored_layout(name))
                           if placement.startswith("S"))
        squares += param.grad.detach().double().pow(2).sum() * shards / math.prod(mesh_shape)
        grads.append(param.grad)
    dist.all_reduce(squares)
    norm = float(squares.sqrt())
    if max_norm > 0:
        coefficient = min(1.0, max_norm / (norm + 1e-6))
        if coefficient < 1.0:
            for grad in grads:
                grad.mul_(coefficient)
    return norm


def train(config: TrainConfig, saved: SavedPlan, model, example_inputs, *, log=print) -> list[float]:
    """One rank's run (module docstring); returns this rank's losses."""
    init_distributed(config.timeout_s, config.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != saved.mesh.size:
        raise ValueError(f"plan {saved.path} runs on mesh {saved.mesh.text()} = {saved.mesh.size} processes; this "
                         f"world has {world}: launch {saved.mesh.size}")
    traced, graph = traced_step(saved, model, example_inputs)
    module = AutoParallelModule(traced, saved.layouts, saved.mesh, graph=graph)
    batch = batch_source(config, example_inputs)
    optimizer = make_optimizer(module.named_parameters(), config)
    out = Path(config.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metrics = MetricsLog(out / "metrics.jsonl", group=None, dp_size=1, write=rank == 0,
                         interval=config.log_interval)
    losses, times_s = [], []
    try:
        for step in range(config.steps):
            started = time.perf_counter()
            inputs = batch(step)
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss = module(*inputs)
            loss.backward()
            norm = clip_gradients(module, config.grad_clip, saved.mesh.shape)
            optimizer.step()
            times_s.append(time.perf_counter() - started)
            losses.append(float(loss.detach()))
            metrics.add({"step": step, "loss": losses[-1], "lr": lr, "grad_norm": norm, "step_s": times_s[-1]})
            if metrics.flush_due(step, last=step == config.steps - 1):
                metrics.flush()
                if rank == 0:
                    log(f"step {step + 1}/{config.steps}  loss {losses[-1]:.4g}  {times_s[-1] * 1e3:.1f} ms")
    finally:
        metrics.close()
    if rank == 0:
        measured_s = statistics.median(times_s[1:] or times_s) if times_s else None
        record = {"plan": saved.path, "mesh": list(saved.mesh.shape), "steps": config.steps,
                  "measured_step_s": measured_s, "prediction": saved.prediction}
        text = json.dumps(record, indent=1) + "\n"
        atomic_write(out / RUN_RECORD, lambda temporary: Path(temporary).write_text(text))
    return losses
