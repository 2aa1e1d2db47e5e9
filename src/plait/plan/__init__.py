"""plait.plan: auto-parallelisation. Given a model and a cluster, choose tp, pp, dp,
the micro-batching, the pipeline schedule and the memory options (recomputation, ZeRO,
sequence parallelism) that train fastest within memory, predict the step time,
throughput and memory, and explain the choice.

    from plait.plan import plan
    result = plan("gpt-175b", "dgx-a100", gpus=1024, global_batch=1536)
    print(result.best.layout.text(), result.best.step_time_s)
    print("\\n".join(explain(result)))

Pieces: ``transformer`` (analytic GPT: FLOPs, parameters, activations, communication),
``trace`` (the same per-layer costs measured on a real nn.Module), ``device`` (peaks,
efficiency, this machine's measured CPU), ``cluster`` (topology links and collective
prices), ``stages`` (min-max and Alpa stage partitioning), ``estimate`` (one layout),
``search`` (all layouts, ranked), ``explain`` (tables and reasons). Nothing here
loads the distributed runtime; torch is imported only to trace or measure.
"""

from __future__ import annotations

from plait.plan.cluster import Cluster, cluster_preset, CLUSTER_PRESETS
from plait.plan.device import device_preset, DEVICE_PRESETS, DeviceSpec
from plait.plan.estimate import estimate, Estimate
from plait.plan.layout import Layout, layout_problems
from plait.plan.precision import Precision, PRECISIONS, precision_for
from plait.plan.explain import explain, table
from plait.plan.layers import LayerCost
from plait.plan.models import ModuleModel, TransformerModel
from plait.plan.search import PlanError, PlanRequest, PlanResult, search
from plait.plan.transformer import model_preset, MODEL_PRESETS, TransformerSpec

__all__ = ["plan", "estimate_layout", "explain", "table", "PlanRequest", "PlanResult", "PlanError", "Layout",
           "Estimate", "TransformerSpec", "TransformerModel", "ModuleModel", "LayerCost", "Cluster", "DeviceSpec",
           "MODEL_PRESETS", "CLUSTER_PRESETS", "DEVICE_PRESETS", "PRECISIONS", "precision_for", "model_preset", "cluster_preset",
           "device_preset"]


def _model(model):
    if isinstance(model, str):
        return TransformerModel(model_preset(model))
    if isinstance(model, TransformerSpec):
        return TransformerModel(model)
    if isinstance(model, (TransformerModel, ModuleModel)):
        return model
    raise TypeError(f"model must be a preset name, a TransformerSpec, a TransformerModel or a ModuleModel, "
                    f"got {type(model).__name__}")


def _cluster(cluster, gpus, nodes):
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return cluster_preset(cluster, gpus=gpus, nodes=nodes)
    raise TypeError(f"cluster must be a preset name or a Cluster, got {type(cluster).__name__}")


def plan(model, cluster, *, global_batch: int, gpus: int | None = None, nodes: int | None = None,
         **constraints) -> PlanResult:
    """Search the layouts of ``model`` (a preset name such as "gpt-175b", a
    TransformerSpec or a ModuleModel) on ``cluster`` (a preset name with ``gpus`` or
    ``nodes``, or a Cluster) for ``global_batch`` sequences per step. ``constraints``
    are PlanRequest fields: tp, pp, dp, micro_batch, schedule, virtual, recompute,
    zero_stage, sequence_parallel, precision, accounting, memory_limit_bytes, top, ...
    Raises PlanError (a ValueError) when nothing fits, saying what would."""
    return search(_model(model), _cluster(cluster, gpus, nodes), PlanRequest(global_batch=global_batch, **constraints))


def estimate_layout(model, cluster, layout: Layout, *, gpus: int | None = None, nodes: int | None = None,
                    precision: str | Precision = "bf16-mixed", accounting: str = "megatron") -> Estimate:
    """Price one fully given ``layout`` (no search); memory is reported, not enforced.
    ``precision``: a name, or a Precision (``precision_for(name, accounting, device_type)``)."""

    model, cluster = _model(model), _cluster(cluster, gpus, nodes)
    problems = layout_problems(layout, num_groups=model.num_groups, world_size=cluster.world_size,
                               global_batch=layout.global_batch, tp_problem=model.tensor_parallel_problem(layout.tp),
                               seq_len=getattr(model, "seq_len", None))
    if problems:
        raise ValueError(f"invalid layout {layout.text()}: " + "; ".join(problems))
    chosen = precision if isinstance(precision, Precision) else precision_for(precision, accounting)
    groups = model.groups(layout.micro_batch, layout.tp, layout.sequence_parallel, chosen, accounting)
    return estimate(groups, layout, cluster, chosen, model_flops=model.training_flops(layout.global_batch, "none"),
                    hardware_flops=model.training_flops(layout.global_batch, layout.recompute),
                    tied_embedding_params=model.tied_embedding_params(layout.tp), end_modules=model.end_modules)
