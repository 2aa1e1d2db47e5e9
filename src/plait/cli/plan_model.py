"""The model ``plait plan`` prices when it is the user's: ``--module PKG.MOD:FUNCTION``
(a factory, as plait optimize loads it) and ``--model hf:CONFIG`` (plait train --model
hf:CONFIG's causal LM), each under its tensor-parallel plan (``--tp-plan PKG.MOD:NAME``,
else plait's ``plan_for(model)``), priced by ``plait.plan.tp_plan``; a module no plan
covers is traced layer by layer for tp = 1 (``plait.plan.trace``). torch, transformers
and plait.parallel load only here, only when such a model is given."""

from __future__ import annotations

from plait.plan import ModuleModel
from plait.plan.tp_plan import plan_model
from plait.plan.trace import describe_module

__all__ = ["HF_PREFIX", "module_model", "hf_model"]

HF_PREFIX = "hf:"


def module_model(spec: str, plan_spec: str | None, autocast: str | None):
    """The model of a user's factory (plait.cli.factory, as plait optimize loads it): one
    example input, its first dimension the batch, traced layer by layer; under a
    tensor-parallel plan (--tp-plan, or plait's plan_for) a PlannedModel."""
    # imported here: the factory needs torch, which plait plan without --module never loads
    from plait.cli.factory import check_forward, describe_tensor, FactoryError, load_factory

    module, inputs = load_factory(spec)
    if len(inputs) != 1 or inputs[0].dim() < 1:
        given = ", ".join(describe_tensor(tensor) for tensor in inputs)
        raise FactoryError(f"factory {spec!r} returned example inputs {given}: plait plan --module traces a model "
                           f"called on one tensor whose first dimension is the batch; return (module, tensor) or "
                           f"(module, (tensor,)) (wrap a model of several inputs in one that takes one)")
    sample = inputs[0]
    check_forward(spec, module, inputs)
    plan = _tp_plan(module, plan_spec, required=False)
    try:
        if plan is not None:
            return plan_model(module, sample, plan, name=spec, autocast=autocast)
        layers = describe_module(module, sample)
    except FactoryError:
        raise
    except Exception as error:  # it ran eagerly as returned: this is training mode, a layer's output or the backward
        where = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))  # describe_layers: which layer
        raise FactoryError(f"factory {spec!r}: tracing its {type(module).__name__} for the plan (training mode, "
                           f"forward and backward, on {describe_tensor(sample)}) failed{where}: "
                           f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}") from None
    dtypes = [p.dtype for p in module.parameters() if p.is_floating_point()]
    element_bytes = dtypes[0].itemsize if dtypes else (sample.element_size() if sample.is_floating_point() else 4)
    return ModuleModel(name=spec, layers=tuple(layers), traced_batch=int(sample.shape[0]),
                       traced_element_bytes=element_bytes)


def _tp_plan(module, plan_spec: str | None, *, required: bool):
    """The plan dict of --tp-plan (a dict, or a function of the model returning one), else
    plait's own plan for ``module`` (plan_for), else None (``required``: refused by name)."""
    from plait.cli.factory import FactoryError, import_attribute

    if plan_spec is not None:
        plan = import_attribute(plan_spec, what="--tp-plan", form="PKG.MOD:NAME", example="my_pkg.models:PLAN")
        if callable(plan) and not isinstance(plan, dict):
            try:
                plan = plan(module)
            except Exception as error:
                raise FactoryError(f"--tp-plan {plan_spec!r}: calling it on the {type(module).__name__} raised "
                                   f"{type(error).__name__}: {error}") from None
        if not isinstance(plan, dict):
            raise FactoryError(f"--tp-plan {plan_spec!r} is a {type(plan).__name__}, not a plan dict of module "
                               "patterns to styles (or a function of the model returning one)")
        return plan
    plan_for = _plan_for()
    if plan_for is not None:
        try:
            return plan_for(module)
        except (ValueError, TypeError) as error:
            if required:
                raise ValueError(f"{type(module).__name__}: plait has no tensor-parallel plan for it ({error}); "
                                 "give one with --tp-plan PKG.MOD:NAME") from None
    return {} if required else None


def _plan_for():
    """plait's plan_for(model), where plait.parallel.tensor has one (None before it)."""
    try:
        from plait.parallel.tensor.plans import plan_for
    except ImportError:
        return None
    return plan_for


def hf_model(source: str, seq_len: int | None, plan_spec: str | None, autocast: str | None):
    """The PlannedModel of ``hf:CONFIG`` (plait train --model hf:CONFIG's causal LM), built
    from its config under torch's FakeTensorMode (no memory, no weights; CPU kernels, so
    the fused attention keeps what it keeps on a GPU: O(s), not the s² probabilities of
    the meta device's math path) and traced on ``seq_len`` tokens (default: the config's
    positions) with HF's own loss, under torch.autocast to ``autocast`` (a dtype name) for
    plait train's mixed precision."""
    # imported here: plait plan of a GPT never loads torch or transformers
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from plait.train.hf_model import load_config, positions

    config = load_config(source)
    seq_len = seq_len or positions(config)
    if not seq_len:
        raise ValueError(f"--model hf:{source}: the config names no positions; give --seq N")
    with FakeTensorMode():
        module = AutoModelForCausalLM.from_config(config)
        plan = _tp_plan(module, plan_spec, required=True)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        # use_cache: HF then takes positions from the cache; without one it checks position_ids for packed
        # sequences with a data-dependent branch, which a fake tensor cannot take (the cache holds k and v,
        # which the backward keeps anyway: the same saved tensors, FLOPs and bytes)
        sample = {"input_ids": ids, "labels": ids, "use_cache": True}
        return plan_model(module, sample, plan, name=f"hf:{source} ({type(module).__name__})", autocast=autocast)
