"""torch DDP's constructor keywords on plait's DataParallel (code written for
``DistributedDataParallel(model, device_ids=[rank], ...)`` carries them by habit).

A keyword whose meaning plait has is taken in plait's spelling: ``process_group=`` and
``device_mesh=`` are ``group=``, ``bucket_cap_mb=`` is ``bucket_mb=``; ``device_ids=`` /
``output_device=`` naming the device the module's parameters are on (plait computes
where the parameters are), and DDP's defaults of the others (``dim=0``,
``gradient_as_bucket_view=False``, ``static_graph=False``, ...), which are what plait
does anyway. Any other value is refused by name with plait's spelling, as a TypeError
(as torch names a bad keyword); a keyword DDP does not have either is Python's
"unexpected keyword argument"."""

from __future__ import annotations

import torch
from torch import nn

# DDP's keyword -> its default, which is plait's behaviour (accepted), and the fix for any other value
_DEFAULTS_AND_FIXES = {
    "dim": (0, "plait's DataParallel does not scatter inputs (each rank feeds its own batch): drop dim="),
    "init_sync": (None, "plait spells it init='broadcast' (rank 0's parameters, DDP's init_sync=True) or "
                        "init='check' (the default: parameters that differ between ranks are refused)"),
    "check_reduction": (False, "it is deprecated in DDP and has no meaning in plait: drop it"),
    "gradient_as_bucket_view": (False, "plait keeps each .grad a tensor of its own (DDP's default): drop "
                                       "gradient_as_bucket_view="),
    "static_graph": (False, "plait's DataParallel needs no static-graph promise (unused parameters: "
                            "find_unused_parameters=True; activation checkpointing works as is): drop static_graph="),
    "mixed_precision": (None, "DataParallel reduces the gradients in the parameters' dtype: use torch.autocast for "
                              "the forward, or plait.parallel.zero.ZeRO(..., mp_policy=MixedPrecisionPolicy(...)) "
                              "for 16-bit parameters with float32 master weights"),
    "delay_all_reduce_named_params": (None, "plait has no delayed all-reduce: drop it"),
    "param_to_hook_all_reduce": (None, "plait has no delayed all-reduce: drop it"),
    "skip_all_reduce_unused_params": (False, "plait's spelling is find_unused_parameters=True (their .grad stays "
                                             "None; with False they average as zeros)"),
}
_GROUP_ALIASES = ("process_group", "device_mesh")
_DEVICE_KEYWORDS = ("device_ids", "output_device")
DDP_KEYWORDS = (*_DEFAULTS_AND_FIXES, *_GROUP_ALIASES, *_DEVICE_KEYWORDS, "bucket_cap_mb")


def apply_ddp_keywords(module: nn.Module, group, bucket_mb, keywords: dict) -> tuple:
    """``(group, bucket_mb)`` after DDP's ``keywords`` (see the module docstring); a
    TypeError naming the first keyword plait cannot honour and its plait spelling."""
    for name, value in keywords.items():
        if name not in DDP_KEYWORDS:
            raise TypeError(f"DataParallel.__init__() got an unexpected keyword argument {name!r}")
        if name in _GROUP_ALIASES:
            if value is not None and group is not None and value is not group:
                raise TypeError(f"DataParallel: {name}= and group= both given; plait's spelling is group= "
                                "(a ProcessGroup, a DeviceMesh or a plait Communicator)")
            group = group if value is None else value
        elif name == "bucket_cap_mb":
            bucket_mb = bucket_mb if value is None else value  # DDP's None: its default, 25 MiB (plait's too)
        elif name in _DEVICE_KEYWORDS:
            _check_device(module, name, value)
        else:
            default, fix = _DEFAULTS_AND_FIXES[name]
            if value != default:
                raise TypeError(f"DataParallel: {name}={value!r} (a torch DDP keyword) is not plait's: {fix}")
    return group, bucket_mb


def _check_device(module: nn.Module, name: str, value) -> None:
    """DDP's ``device_ids=[d]`` / ``output_device=d``: accepted when ``d`` is where the
    module's parameters are (plait computes there); anything else is refused."""
    if value is None:
        return
    devices = {param.device for param in module.parameters()}
    given = list(value) if name == "device_ids" and isinstance(value, (list, tuple)) else [value]
    wanted = {torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in given}
    if len(given) != 1 or wanted != devices:
        raise TypeError(f"DataParallel: {name}={value!r} (a torch DDP keyword) does not name the device of the "
                        f"module's parameters ({', '.join(sorted(map(str, devices)))}): plait computes where the "
                        "parameters are; move the model there first (model.to(device)) and drop "
                        f"{name}=")
