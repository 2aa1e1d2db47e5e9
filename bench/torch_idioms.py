"""What a PyTorch practitioner tries first on plait's wrappers, measured (issue 33).

    python bench/torch_idioms.py [--only WORD,...] [--list] [--json FILE] [--timeout-s 90]
    PYTHONPATH=/path/to/old/src python bench/torch_idioms.py     # the same probes on another checkout

Each probe writes code the torch way (DDP, FSDP2, DeepSpeed, Hugging Face habits) against
plait's DataParallel, ZeRO (stages 1-3), PipelineEngine or tensor layers, on 2 gloo ranks
(``plait.testing.run_distributed``; ``run_fresh_world`` where a probe may leave the group
unusable), and judges the outcome from outside, against one process (or torch's own
implementation: DDP for BatchNorm), in float64 unless said otherwise:

- ``exact``: the wrapped run equals the reference within the float64 bound (1e-10
  absolute after a few steps: a reordered sum differs by ~1e-15 per step);
- ``refused by name``: a ValueError/TypeError/RuntimeError/NotImplementedError whose
  one-line message names the idiom or the fix (the words each probe lists);
- ``SILENTLY WRONG``: it ran and the result differs from the reference (the detail
  gives the largest difference);
- ``crashed unrelated``: another exception, or one that names neither (the detail
  quotes it), or a hang (the ranks' stacks are dropped; the detail says where).

The probes live in ``bench/idioms/`` (``common``: models, data and references; ``layouts``
and ``state``: the issue's idioms; ``loops`` and ``wrapping``: what practitioners try
beyond them). Models: Hugging Face GPT-2 built from a config (2 layers, hidden 32, vocabulary 64,
dropout 0; never downloaded), a small ResNet-like CNN with BatchNorm built here
(torchvision is not installed), and a two-layer MLP. Probes are independent: ``--only``
runs those whose name contains one of the words.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

# bench/ is on sys.path (the script's directory, and the ranks get the parent's sys.path)
from idioms.layouts import (p_clip_plait_zero, p_clip_torch_dp, p_clip_torch_zero, p_clip_tp, p_pipeline_tied,
                            p_sp_batch_first, p_sp_entry_exit, p_tp_no_sp_batch_first)
from idioms.state import (p_autocast_zero, p_bf16_master, p_dcp, p_dcp_reshard, p_device_mesh, p_dp_state_dict_keys,
                          p_dtensor, p_groups_over_shards, p_load_full_state_dict_strict, p_mp_policy,
                          p_optimizer_object, p_param_groups, p_scheduler_on_user_optimizer,
                          p_scheduler_on_zero_optimizer, p_stage3_outside, p_state_dict_api)
from idioms.loops import (p_accumulate, p_edit_after_wrap, p_eval_no_grad, p_freeze_after_wrap, p_frozen, p_grad_read,
                          p_grad_scaler, p_hf_kwargs, p_inner_module, p_meta_init, p_module_access,
                          p_module_zero_grad, p_optimizer_calls, p_unused_on_one_rank)
from idioms.wrapping import (p_batchnorm, p_compile, p_ddp_arguments, p_distributed_sampler, p_dp_zero_grad_not_none,
                             p_register_comm_hook, p_rewrap, p_stage3_module_state_dict, p_tied_stage3,
                             p_to_dtype_after_wrap, p_torch_save_sharded, p_two_forwards)

USER_ERRORS = ("ValueError", "TypeError", "RuntimeError", "NotImplementedError")
# messages of torch internals reached by accident, never a refusal by name
UNRELATED = ("storage of size 0", "setStorage", "numpy() is not supported", "is not registered",
             "has no attribute", "object is not callable", "data is not allocated", "NoneType", "KeyError",
             "unexpected keyword argument")


# ----------------------------------------------------------------------------- the table of probes
@dataclass
class Probe:
    name: str
    idiom: str
    fn: object
    kwargs: dict = field(default_factory=dict)
    words: tuple = ()  # a refusal "by name" mentions one of these (the idiom, or the fix)
    fresh: bool = False  # run in a fresh world (it may leave the group unusable)
    world_size: int = 2


def probes(path: str) -> list[Probe]:
    P = Probe
    out = []
    for stage in (1, 2, 3):
        out.append(P(f"clip.torch.zero{stage}", f"torch clip_grad_norm_(zero.parameters()) ZeRO-{stage}",
                     p_clip_torch_zero, {"stage": stage}, ("clip_grad_norm_",)))
    out += [
        P("clip.plait.zero3", "zero.clip_grad_norm_(max_norm) ZeRO-3", p_clip_plait_zero, {"stage": 3}),
        P("clip.torch.dp", "torch clip_grad_norm_(dp.parameters()) DataParallel", p_clip_torch_dp),
        P("clip.torch.zero2.tp2", "torch clip_grad_norm_ ZeRO-2 over plait tp=2 layers", p_clip_tp,
          {"wrapper": "zero"}, ("clip_grad_norm_",)),
        P("clip.torch.dp.tp2", "torch clip_grad_norm_ DataParallel over plait tp=2 layers", p_clip_tp,
          {"wrapper": "dataparallel"}, ("clip_grad_norm_",)),
        P("sp.bsh_replicated", "sequence_parallel=True, HF (b,s,h) input replicated", p_sp_batch_first,
          {"layout": "bsh_replicated"}, ("sequence", "layout", "shape")),
        P("sp.sbh_sharded", "sequence_parallel=True, (s/tp,b,h) shard (Megatron layout)", p_sp_batch_first,
          {"layout": "sbh_sharded"}),
        P("tp.bsh_no_sp", "tensor parallel without SP, (b,s,h) input", p_tp_no_sp_batch_first),
        P("sp.entry_exit", "SequenceParallelEntry/Exit(seq_dim=1) around SP layers", p_sp_entry_exit,
          {"sequence_parallel": True}),
        P("tp.entry_exit_no_sp", "SequenceParallelEntry/Exit(seq_dim=1), no SP", p_sp_entry_exit,
          {"sequence_parallel": False}),
    ]
    for schedule in ("1f1b", "zero_bubble"):
        for how in ("stages", "model", "tied"):
            out.append(P(f"pipeline.tied.{schedule}.{how}", f"pipeline, weight tied across ranks, {schedule}, "
                         f"{'stage modules only' if how == 'stages' else how + '='}", p_pipeline_tied,
                         {"schedule_name": schedule, "how": how}, ("tied", "shared", "model=")))
    for wrapper in (1, 3, "dataparallel"):
        label = f"ZeRO-{wrapper}" if wrapper != "dataparallel" else "DataParallel"
        out.append(P(f"dcp.{wrapper if wrapper != 'dataparallel' else 'dp'}",
                     f"dcp.save/load(wrapped.state_dict()) {label}", p_dcp, {"wrapper": wrapper, "path": path},
                     ("checkpoint", "state_dict"), fresh=True))
    out += [P(f"dcp.reshard.zero{stage}_to_1", f"...the ZeRO-{stage} checkpoint dcp.load-ed by 1 plain process",
              p_dcp_reshard, {"path": path, "stage": stage}, ("checkpoint",), world_size=1) for stage in (1, 3)]
    out.append(P("dp.state_dict_keys", "dp.state_dict() keys; DDP 'module.' checkpoint loaded", p_dp_state_dict_keys,
                 {}, ("module.",)))
    for stage in (1, 3):
        for what in ("get_model", "set_model", "get_optimizer", "get_optimizer_given", "get_optimizer_param"):
            out.append(P(f"state_dict_api.{what}.zero{stage}", f"{what}_state_dict(zero, full_state_dict=True) "
                         f"ZeRO-{stage}", p_state_dict_api, {"stage": stage, "what": what}, ("state_dict",)))
    out += [
        P("load_full.strict", "zero.load_full_state_dict(sd without tied lm_head)", p_load_full_state_dict_strict,
          {"strict": True}, ("missing", "lm_head")),
        P("load_full.strict_false", "zero.load_full_state_dict(..., strict=False)", p_load_full_state_dict_strict,
          {"strict": False}, ("strict",)),
    ]
    for what in ("generate", "save_pretrained"):
        out.append(P(f"stage3.{what}.bare", f"zero.module.{what}(...) at ZeRO-3", p_stage3_outside,
                     {"what": what, "context": False, "path": path}, ("full_parameters", "stage 3", "gather")))
        out.append(P(f"stage3.{what}.full_parameters", f"with zero.full_parameters(): {what} at ZeRO-3",
                     p_stage3_outside, {"what": what, "context": True, "path": path}, ("full_parameters",)))
    out.append(P("stage3.module_state_dict", "torch.save(zero.module.state_dict()) at ZeRO-3",
                 p_stage3_module_state_dict, {}, ("full_state_dict", "full_parameters", "stage 3")))
    for stage in (1, 2, 3):
        out.append(P(f"param_groups.zero{stage}", f"AdamW(HF no-decay groups) object to ZeRO-{stage}",
                     p_param_groups, {"stage": stage}, ("group", "optimizer")))
    out += [
        P("param_groups.over_shards", "factory building 2 groups over the shards", p_groups_over_shards, {},
          ("group",)),
        P("optimizer_object.zero2", "ZeRO(model, AdamW(model.parameters()))", p_optimizer_object, {"stage": 2},
          ("optimizer",)),
        P("scheduler.user_optimizer", "StepLR on the optimizer object given to ZeRO", p_scheduler_on_user_optimizer,
          {}, ("optimizer", "scheduler")),
        P("scheduler.zero_optimizer", "StepLR(zero.optimizer)", p_scheduler_on_zero_optimizer),
        P("precision.bf16_model", "bf16 model under ZeRO-2, no policy (as torch: bf16 master)", p_bf16_master, {},
          ("master", "precision", "bfloat16")),
        P("precision.mp_policy.torch", "mp_policy=torch FSDP2 MixedPrecisionPolicy(bf16, fp32 reduce)",
          p_mp_policy, {"which": "torch"}, ("mp_policy", "MixedPrecisionPolicy")),
        P("precision.mp_policy.plait", "mp_policy=plait MixedPrecisionPolicy(bf16, fp32 reduce)", p_mp_policy,
          {"which": "plait"}, ("mp_policy", "MixedPrecisionPolicy")),
        P("precision.autocast.zero3", "torch.autocast(bf16) forward, ZeRO-3 vs DDP", p_autocast_zero, {"stage": 3}),
    ]
    for where in ("all_reduce", "zero", "dataparallel", "zero_2d"):
        out.append(P(f"device_mesh.{where}", f"DeviceMesh as group= ({where})", p_device_mesh, {"where": where},
                     ("DeviceMesh", "mesh")))
    for wrapper in ("zero", "dataparallel"):
        for shape in ((2, 1), (1, 2)):
            out.append(P(f"dtensor.{wrapper}.dp{shape[0]}tp{shape[1]}",
                         f"DTensor params (parallelize_module) under {wrapper}, dp{shape[0]}xtp{shape[1]}",
                         p_dtensor, {"wrapper": wrapper, "shape": shape}, ("DTensor",)))
    # beyond the issue
    for wrapper, inf in (("dataparallel", False), ("dataparallel", True), ("2:zero", False), ("2:optimizer", False),
                         ("1:optimizer", True), ("2:optimizer", True), ("2:param", True)):
        label = wrapper if wrapper == "dataparallel" else f"ZeRO-{wrapper[0]}, scaler.step(zero" + \
            {"zero": "", "optimizer": ".optimizer", "param": ".param_optimizer"}[wrapper.split(":")[1]] + ")"
        out.append(P(f"grad_scaler.{wrapper.replace(':', '.')}{'.inf_rank1' if inf else ''}",
                     f"GradScaler {label}{', inf on rank 1' if inf else ''}", p_grad_scaler,
                     {"wrapper": wrapper, "inf_on_rank1": inf}, ("GradScaler", "scaler", "optimizer.step", "sharded")))
    for wrapper in ("dataparallel", "1", "2", "3"):
        for no_sync in (True, False):
            label = "DataParallel" if wrapper == "dataparallel" else f"ZeRO-{wrapper}"
            out.append(P(f"accumulate.{'no_sync' if no_sync else 'plain'}.{wrapper}",
                         f"accumulation, {'no_sync()' if no_sync else 'repeated backward'}, {label}", p_accumulate,
                         {"wrapper": wrapper, "no_sync": no_sync}))
    out += [P(f"eval_no_grad.zero{s}", f"zero.eval() + no_grad forward, then train, ZeRO-{s}", p_eval_no_grad,
              {"stage": s}) for s in (1, 3)]
    out += [P(f"module_access.zero{s}", f"zero.module.lm_head.weight / numel after a step, ZeRO-{s}",
              p_module_access, {"stage": s}, ("stage 3", "full_parameters", "freed")) for s in (1, 3)]
    out += [P(f"inner_module.{w}", f"forward through wrapped.module (bypass), {w}", p_inner_module, {"wrapper": w},
              ("wrapper", "module")) for w in ("dataparallel", "2", "3")]
    out += [P(f"hf_kwargs.{w}", f"wrapped(input_ids=, labels=).loss, {w}", p_hf_kwargs, {"wrapper": w})
            for w in ("dataparallel", "3")]
    out += [P(f"unused_one_rank.{w}", f"param unused on rank 1, {w}", p_unused_on_one_rank, {"wrapper": w},
              ("unused",)) for w in ("dataparallel", "dataparallel.find", "2", "3")]
    out += [P(f"frozen.{w}", f"frozen params (requires_grad=False), {w}", p_frozen, {"wrapper": w})
            for w in ("dataparallel", "1", "3")]
    out += [P(f"freeze_after_wrap.zero{s}", f"requires_grad_(False) after wrapping, ZeRO-{s}", p_freeze_after_wrap,
              {"stage": s}, ("wrap", "requires_grad")) for s in (1, 3)]
    out.append(P("zero_grad_not_none.dp", "optimizer.zero_grad(set_to_none=False), DataParallel",
                 p_dp_zero_grad_not_none))
    for stage in (1, 3):
        out.append(P(f"zero_grad_not_none.zero{stage}", f"zero.zero_grad(set_to_none=False), ZeRO-{stage}",
                     p_optimizer_calls, {"stage": stage, "how": "set_to_none_false"}))
    out += [P(f"edit_after_wrap.{how}.{w}", f"{'weight.mul_(0.5)' if how == 'mul_' else 'module.load_state_dict(sd)'}"
              f" after wrapping, {w}", p_edit_after_wrap, {"wrapper": w, "how": how},
              ("full_parameters", "stage 3", "load_full_state_dict"))
            for how in ("mul_", "load_state_dict") for w in ("dataparallel", "1", "2", "3")]
    out.append(P("meta_init.zero3", "meta-device model, ZeRO-3, to_empty()", p_meta_init, {},
                 ("meta device", "to_empty")))
    out += [P(f"module_zero_grad.zero{s}", f"model.zero_grad() not zero.zero_grad(), ZeRO-{s}", p_module_zero_grad,
              {"stage": s}, ("zero_grad",)) for s in (1, 2, 3)]
    out += [P(f"grad_read.{w}{'.rank0_norm' if r0 else ''}",
              f"{'p.grad.norm() on rank 0 only' if r0 else '{n: p.grad.clone()}'} after backward, {w}", p_grad_read,
              {"wrapper": w, "rank0_only": r0}, ("grad", "sharded", "collective"))
            for w, r0 in (("dataparallel", False), ("1", False), ("2", False), ("3", False), ("2", True))]
    for stage in (1, 2, 3):
        out.append(P(f"optimizer_zero_grad.zero{stage}", f"zero.optimizer.zero_grad() not zero.zero_grad(), "
                     f"ZeRO-{stage}", p_optimizer_calls, {"stage": stage, "how": "optimizer.zero_grad"},
                     ("zero_grad",)))
        out.append(P(f"optimizer_step.zero{stage}", f"zero.optimizer.step() not zero.step(), ZeRO-{stage}",
                     p_optimizer_calls, {"stage": stage, "how": "optimizer.step"}, ("zero.step", "step()")))
    out += [
        P("torch_save.sharded", "torch.save(zero + optimizer state_dict) + load, same world, ZeRO-2",
          p_torch_save_sharded,
          {"path": path, "phase": "save_and_load"}),
        P("torch_save.other_world", "...those shards loaded into 1 rank", p_torch_save_sharded,
          {"path": path, "phase": "other_world"}, ("world_size", "rank", "full state dict", "layout"),
          world_size=1),
        P("distributed_sampler.dp", "DistributedSampler + DataLoader, DataParallel", p_distributed_sampler),
    ]
    out += [P(f"compile.{w}", f"torch.compile(wrapped, aot_eager), {w}", p_compile, {"wrapper": w},
              ("compile",)) for w in ("dataparallel", "2", "3")]
    out += [
        P("comm_hook.dataparallel", "dp.register_comm_hook(state, hook)", p_register_comm_hook,
          {"where": "dataparallel"}, ("register_comm_hook", "comm hook", "compression")),
        P("comm_hook.ddp_plait", "torch DDP + plait.comm.ddp_comm_hook", p_register_comm_hook, {"where": "ddp"}),
    ]
    out += [P(f"to_dtype_after_wrap.{w}", f"wrapped.to(float64) after wrapping, {w}", p_to_dtype_after_wrap,
              {"wrapper": w}, ("after wrapping", "before wrapping")) for w in ("dataparallel", "2", "3")]
    out += [P(f"batchnorm.{w}", f"CNN with BatchNorm, {w}" + (" (vs DDP)" if w != "syncbn" else ""), p_batchnorm,
              {"wrapper": w}, ("SyncBatchNorm", "BatchNorm")) for w in ("dataparallel", "3", "syncbn")]
    out += [P(f"two_forwards.{w}", f"two forwards then one backward, {w}", p_two_forwards, {"wrapper": w})
            for w in ("dataparallel", "2", "3")]
    out += [P(f"rewrap.zero{a}.{b}", f"del ZeRO-{a}, re-wrap as {b}", p_rewrap, {"first": a, "second": b})
            for a, b in (("3", "3"), ("3", "dataparallel"), ("1", "2"))]
    out += [P("tied.zero3", "HF GPT-2 tied wte/lm_head at ZeRO-3", p_tied_stage3, {"checkpointing": False}),
            P("tied.zero3.checkpointing", "... with gradient_checkpointing_enable()", p_tied_stage3,
              {"checkpointing": True}, ("checkpoint", "recompute")),
            P("ddp_args.device_ids", "DataParallel(model, device_ids=[rank])", p_ddp_arguments, {"how": "keyword"},
              ("device_ids",)),
            P("ddp_args.positional", "DataParallel(model, [rank]) (DDP's device_ids)", p_ddp_arguments,
              {"how": "positional"}, ("group",))]
    return out


# ----------------------------------------------------------------------------- running and judging
def run_probe(rank, world_size, name, path):
    """On each rank: the probe's function (its own reference computed in-process)."""
    probe = next(p for p in probes(path) if p.name == name)
    return probe.fn(rank, world_size, **probe.kwargs)


def _last_error_line(failures: dict) -> tuple[str, str]:
    """(exception type, message) of the first failed rank, from its remote traceback."""
    kind, text = next(iter(failures.values()))
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(kind) or line.split(":")[0].endswith(kind):
            return kind, line.split(":", 1)[1].strip() if ":" in line else line
    return kind, lines[-1] if lines else ""


def _may_have_broken_the_group(error, world_size: int) -> bool:
    """A failure on some ranks only, or in a collective, can leave the pooled world's
    communicator unusable (a mismatched call poisons it)."""
    from plait.testing import RankError

    if not isinstance(error, RankError):
        return True
    return len(error.failures) < world_size or any(
        kind in ("MismatchError", "CommError", "CommTimeout", "DistributedTimeout")
        for kind, _ in error.failures.values())


def judge(probe: Probe, results=None, error=None) -> tuple[str, str]:
    from plait.testing import DistributedTimeout, RankError, WorkerCrashed

    if error is not None:
        if isinstance(error, RankError):
            kind, message = _last_error_line(error.failures)
            ranks = sorted(error.failures)
            where = f"rank {ranks[0]}" if len(ranks) == 1 else "every rank"
            named = kind in USER_ERRORS and not any(marker in message for marker in UNRELATED) and (
                not probe.words or any(word.lower() in message.lower() for word in probe.words))
            outcome = "refused by name" if named else "crashed unrelated"
            return outcome, f"{kind} on {where}: {message[:220]}"
        if isinstance(error, DistributedTimeout):
            return "crashed unrelated", f"HANG: ranks {error.pending_ranks} still running at the deadline"
        if isinstance(error, WorkerCrashed):
            return "crashed unrelated", f"a rank process died ({error})"[:200]
        return "crashed unrelated", f"{type(error).__name__}: {error}"[:200]
    first = results[0]
    if "outcome" in first:
        return first["outcome"], first["detail"]
    diff = max(result["diff"] for result in results)
    detail = f"max |diff| {diff:.1e} (tol {first['tol']:.0e}){'; ' + first['detail'] if first['detail'] else ''}"
    return ("exact" if diff <= first["tol"] else "SILENTLY WRONG"), detail


def main(argv=None) -> int:
    from plait.testing import run_distributed, run_fresh_world, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated words: run the probes whose name holds one")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--timeout-s", type=float, default=90.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torch-idioms-") as path:
        chosen = probes(path)
        if args.only:
            words = [word for word in args.only.split(",") if word]
            chosen = [p for p in chosen if any(word in p.name for word in words)]
        if args.list:
            for probe in chosen:
                print(f"{probe.name:40s} {probe.idiom}")
            return 0
        import plait

        print(f"# torch idioms on plait from {Path(plait.__file__).parent}, torch {torch.__version__}, "
              f"{len(chosen)} probes, 2 gloo ranks unless said")
        print(f"{'probe':38s} | {'idiom':62s} | {'outcome':17s} | detail")
        rows_out = []
        started = time.monotonic()
        for probe in chosen:
            runner = run_fresh_world if probe.fresh else run_distributed
            began = time.monotonic()
            try:
                results = runner(run_probe, probe.world_size, probe.name, path, timeout_s=args.timeout_s)
                outcome, detail = judge(probe, results=results)
            except Exception as error:  # noqa: BLE001 - every failure is an outcome to report
                outcome, detail = judge(probe, error=error)
                if _may_have_broken_the_group(error, probe.world_size):
                    shutdown_pools()  # the next probe starts on a new world, not a poisoned one
            seconds = time.monotonic() - began
            print(f"{probe.name:38s} | {probe.idiom[:62]:62s} | {outcome:17s} | {detail} [{seconds:.1f} s]",
                  flush=True)
            rows_out.append({"probe": probe.name, "idiom": probe.idiom, "outcome": outcome, "detail": detail,
                             "seconds": round(seconds, 1)})
        shutdown_pools()
        counts = {}
        for row in rows_out:
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        print(f"# {len(rows_out)} probes in {time.monotonic() - started:.0f} s: "
              + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        if args.json:
            Path(args.json).write_text(json.dumps(rows_out, indent=2))
    return 0


if __name__ == "__main__":
    # the ranks unpickle run_probe by its module name: import this file as ``torch_idioms``
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch_idioms

    raise SystemExit(torch_idioms.main())
