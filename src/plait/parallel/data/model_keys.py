"""The model's own names through a wrapper (DataParallel, ZeRO): ``state_dict()``,
``named_parameters()`` and ``named_buffers()`` give the wrapped model's keys
(``transformer.h.0.attn.c_attn.weight``), not DDP's ``module.``-prefixed ones, and
``load_state_dict`` takes them, so a checkpoint moves between a plain model, a
DataParallel and a ZeRO model unchanged.

torch's ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``,
``get_optimizer_state_dict``, ``set_*``) walks a state dict's keys as attributes from
the model it is given; ``_fqn_modifiers`` is its contract for a module whose keys drop
a level (here the wrapper's ``module``): every top-level child name of the wrapped
model maps to ``"module"``. The wrapper does not forward other attributes (as DDP does
not): ``wrapper.module.generate(...)`` is the wrapped model itself, with no hidden
difference from ``wrapper(...)``.

A DDP checkpoint (every key ``module.``-prefixed) loads too: the prefix is consumed,
as ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present`` does, when the
wrapped model has no key of that name.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

DDP_PREFIX = "module."


class ModelKeys:
    """Mixin for an ``nn.Module`` wrapper holding the model in ``self.module``."""

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's key -> attribute contract: a key's
        first name is a child of ``self.module``."""
        return {name: "module" for name, _ in self.module.named_children()}

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's parameters under its own names (no ``module.``)."""
        if not recurse:  # the wrapper's own: none
            return super().named_parameters(prefix=prefix, recurse=False, remove_duplicate=remove_duplicate)
        return self.module.named_parameters(prefix=prefix, recurse=True, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's buffers under its own names (no ``module.``)."""
        if not recurse:
            return super().named_buffers(prefix=prefix, recurse=False, remove_duplicate=remove_duplicate)
        return self.module.named_buffers(prefix=prefix, recurse=True, remove_duplicate=remove_duplicate)

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped model's state dict, keyed by its own names."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the wrapped model's state dict (its own keys, or a DDP checkpoint's
        ``module.``-prefixed ones); returns torch's (missing_keys, unexpected_keys)."""
        refuse_assign(assign, type(self).__name__)
        state_dict = consume_ddp_prefix(state_dict, self.module.state_dict(keep_vars=True))
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def refuse_assign(assign: bool, who: str) -> None:
    """``load_state_dict(assign=True)`` would put new Parameter objects into the model,
    which the wrapper's gradient hooks (and ZeRO's flat units) do not hold."""
    if assign:
        raise ValueError(f"{who}: load_state_dict(assign=True) would replace the model's parameters behind the "
                         "wrapper (its gradient hooks and buffers hold the old ones); load with assign=False (the "
                         "values are copied), or load into the model before wrapping it")


def consume_ddp_prefix(state_dict, template) -> dict:
    """``state_dict`` without DDP's ``module.`` prefix when every key has it and the
    model (``template``: its state dict) has no key that starts with it."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict needs a dict of tensors keyed by the model's names, got "
                        f"{type(state_dict).__name__}")
    if state_dict and all(key.startswith(DDP_PREFIX) for key in state_dict) \
            and not any(key.startswith(DDP_PREFIX) for key in template):
        return OrderedDict((key[len(DDP_PREFIX):], value) for key, value in state_dict.items())
    return state_dict


def key_report(state_dict, template) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, size mismatches) of ``state_dict`` against ``template``
    (the model's state dict), as ``nn.Module.load_state_dict`` names them."""
    missing = [key for key in template if key not in state_dict]
    unexpected = [key for key in state_dict if key not in template]
    sizes = [f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, the shape "
             f"in current model is {tuple(template[key].shape)}."
             for key, value in state_dict.items()
             if key in template and torch.is_tensor(value) and torch.is_tensor(template[key])
             and tuple(value.shape) != tuple(template[key].shape)]
    return missing, unexpected, sizes


def raise_key_errors(missing: list[str], unexpected: list[str], sizes: list[str], strict: bool, owner: str) -> None:
    """torch's error for a state dict that does not fit (size mismatches always; missing
    and unexpected keys when ``strict``)."""
    messages = []
    if strict and unexpected:
        messages.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{key}"' for key in unexpected) + ". ")
    if strict and missing:
        messages.append("Missing key(s) in state_dict: " + ", ".join(f'"{key}"' for key in missing) + ". ")
    messages += sizes
    if messages:
        raise RuntimeError(f"Error(s) in loading state_dict for {owner}:\n\t" + "\n\t".join(messages)
                           + ("\n\t(strict=False loads the keys present and returns the others)" if strict and
                              (missing or unexpected) else ""))


def incompatible_keys(missing: list[str], unexpected: list[str]) -> _IncompatibleKeys:
    """torch's (missing_keys, unexpected_keys) named tuple."""
    return _IncompatibleKeys(missing, unexpected)

