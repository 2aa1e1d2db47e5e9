"""Activation recomputation: run a region of the forward keeping only its inputs, and
re-run it, once, the first time the backward needs a tensor the region would have saved.

``recompute(fn, *args, streams=...)`` returns ``fn(*args)``. While ``fn`` runs, every
tensor autograd saves for the backward is replaced by a slot (an index); the region
keeps its inputs (detached) and nothing else. When the backward unpacks the first slot,
the region runs ``fn`` again on its kept inputs, with autograd on, recording what that
run saves, and every slot is answered from that record. So:

- the backward's own graph is the one built by the first forward (recomputing builds a
  throw-away graph only to regenerate the saved tensors), and its gradients equal the
  gradients without recomputation bitwise, when the recomputed forward does the same
  arithmetic in the same order (it does on CPU; a nondeterministic kernel would not);
- a backward split into an input-gradient and a weight-gradient pass (zero bubble: the
  first pass runs with ``retain_graph=True``) recomputes once: the record lives until
  autograd lets go of the region's last slot, i.e. until the graph is freed;
- autocast replays: the recompute runs under the ``torch.autocast`` state (enabled,
  dtype, weight-cast cache) of the region's forward, on the CPU and, when an input is
  on one, the accelerator (CUDA) device type, since the backward runs outside the
  forward's autocast;
- randomness replays: the random streams named in ``streams`` (modules with a ``calls``
  counter, plait's ``ConsistentDropout``), torch's global CPU generator and the generator
  of each accelerator device (CUDA, or another torch device type) an input lives on are
  set back to their state at the region's forward for the recompute (as
  ``torch.utils.checkpoint`` does with ``preserve_rng_state``) and restored afterwards,
  so ``nn.Dropout`` and ``torch.rand`` draw the forward's masks again;
- collectives inside ``fn`` (tensor-parallel all-reduces, sequence-parallel gathers) run
  again in the recompute, on every rank of their group in the same backward order;
- memory stays measurable: the kept inputs and the tensors the recompute regenerates
  go through the saved-tensor hooks in force at the region's forward (a memory meter,
  the pipeline engine's), so a meter counts them for as long as they live.

``fn`` must follow the same control flow when re-run (same ops, same order); if the
recompute saves a different number of tensors the backward raises naming the region.
Without autograd (``torch.no_grad``, evaluation) ``fn`` simply runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from plait.names.recompute import NONE, RECOMPUTE_MODES


class _Slot:
    """What autograd holds instead of a saved tensor: its region and its index."""

    __slots__ = ("region", "index")

    def __init__(self, region: "_Region", index: int):
        self.region, self.index = region, index


class _Kept:
    """A tensor input of a region, as the enclosing hooks packed it."""

    __slots__ = ("packed", "requires_grad")

    def __init__(self, packed, requires_grad: bool):
        self.packed, self.requires_grad = packed, requires_grad


class _Region:
    """One recomputed region of one forward: its kept inputs, how to replay its
    randomness, and (after the first unpack) the tensors the recompute saved."""

    def __init__(self, fn: Callable, args: tuple, name: str, streams: list[nn.Module],
                 on_recompute: Callable[[str], None] | None):
        self.fn, self.name, self.on_recompute = fn, name, on_recompute
        # the inputs are what the region keeps: handed to the enclosing saved-tensor hooks
        # (a memory meter's, the pipeline engine's), as anything autograd saves would be
        self.outer = _enclosing_hooks()
        self.kept = tuple(self._keep_input(arg) for arg in args)
        self.streams = [(stream, stream.calls) for stream in streams]
        self.device_type, self.devices = _input_devices(args)
        self.cpu_rng = torch.get_rng_state()
        device_module = torch.get_device_module(self.device_type)
        self.device_rngs = [device_module.get_rng_state(device) for device in self.devices]
        device_types = ("cpu",) if not self.devices else ("cpu", self.device_type)
        self.autocast = [(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
                         for device_type in device_types]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.packed = 0  # tensors the first forward saved
        self.saved: list[torch.Tensor] | None = None

    def _keep_input(self, arg):
        if not isinstance(arg, torch.Tensor):
            return arg
        detached = arg.detach()
        return _Kept(self.outer[0](detached) if self.outer is not None else detached, arg.requires_grad)

    def _inputs(self) -> tuple:
        """The kept inputs, detached, with their requires_grad (so the recompute saves
        the same tensors the forward did)."""
        inputs = []
        for kept in self.kept:
            if isinstance(kept, _Kept):
                tensor = self.outer[1](kept.packed) if self.outer is not None else kept.packed
                kept = tensor.detach().requires_grad_(kept.requires_grad)
            inputs.append(kept)
        return tuple(inputs)

    def pack(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(self, self.packed)
        self.packed += 1
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        if self.saved is None:
            self.saved = self._recompute()
        packed = self.saved[slot.index]
        return self.outer[1](packed) if self.outer is not None else packed

    def _recompute(self) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []
        current = [(stream, stream.calls) for stream, _ in self.streams]
        # fork_rng gives every generator set here back its state of now when the recompute ends
        with torch.random.fork_rng(self.devices, device_type=self.device_type), contextlib.ExitStack() as stack:
            try:
                for stream, calls in self.streams:
                    stream.calls = calls
                torch.set_rng_state(self.cpu_rng)
                device_module = torch.get_device_module(self.device_type)
                for device, state in zip(self.devices, self.device_rngs, strict=True):
                    device_module.set_rng_state(state, device)
                for device_type, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                       cache_enabled=self.autocast_cache))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_keep(saved, self.outer), _nothing))
                self.fn(*self._inputs())  # its output and graph are dropped: only what it saved is used
            finally:
                for stream, calls in current:
                    stream.calls = calls
        if len(saved) != self.packed:
            raise RuntimeError(f"recomputing {self.name}: its forward saved {self.packed} tensors for the backward "
                               f"but the recompute saved {len(saved)}; a recomputed region must take the same path "
                               "through the same operations when it is run again")
        if self.on_recompute is not None:
            self.on_recompute(self.name)
        return saved


def _input_devices(args: tuple) -> tuple[str, list[int]]:
    """The accelerator device type of the region's tensor inputs and the indices of
    their devices (sorted, once each), whose generators the recompute sets back: none
    when every input is on the CPU (then the type is only fork_rng's default). One
    device type, CUDA first, as torch.utils.checkpoint picks it."""
    devices = [arg.device for arg in args if isinstance(arg, torch.Tensor) and arg.device.type not in ("cpu", "meta")]
    types = {device.type for device in devices}
    if not types:
        return "cuda", []
    device_type = "cuda" if "cuda" in types else devices[0].type
    if device_type == "cuda" and not torch.cuda.is_initialized():
        return device_type, []  # no CUDA generator has been used: nothing to set back
    indices = {device.index if device.index is not None else torch.get_device_module(device_type).current_device()
               for device in devices if device.type == device_type}
    return device_type, sorted(indices)


def _enclosing_hooks():
    """The saved-tensor hooks in force around the region (pack, unpack), or None.
    torch exposes the top of its hook stack only privately (torch.utils.checkpoint
    reads it the same way); without it the kept inputs are simply held."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _keep(saved: list, outer) -> Callable:
    """The recompute's pack hook: records what it saves, handed to the enclosing hooks
    of the region's forward (so a memory meter sees the regenerated tensors too)."""
    def pack(tensor: torch.Tensor) -> None:
        # detached: a saved output kept with its grad_fn would tie the throw-away graph
        # into a reference cycle through autograd, which nothing collects
        tensor = tensor.detach()
        saved.append(outer[0](tensor) if outer is not None else tensor)
        return None  # the throw-away graph never runs backward: it keeps nothing

    return pack


def _nothing(_) -> None:
    raise RuntimeError("a recompute's own graph ran backward: it is thrown away after recording what it saves")


def _unpack(slot: _Slot) -> torch.Tensor:
    return slot.region.unpack(slot)


def recompute(fn: Callable, *args, name: str = "region", streams: Iterable[nn.Module] = (),
              on_recompute: Callable[[str], None] | None = None):
    """``fn(*args)``, keeping only ``args`` for the backward and recomputing the rest
    once when the backward first needs it (see the module docstring). ``streams``:
    modules whose ``calls`` counter picks their random stream (plait's
    ``ConsistentDropout``), replayed in the recompute. ``on_recompute(name)`` is
    called after each recompute (for counting them)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    region = _Region(fn, args, name, list(streams), on_recompute)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, _unpack):
        return fn(*args)


def random_streams(module: nn.Module) -> list[nn.Module]:
    """The modules under ``module`` that draw from a counted random stream."""
    return [child for child in module.modules() if hasattr(child, "calls") and hasattr(child, "reseed")]



def check_mode(mode: str) -> str:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r}: valid values are {', '.join(RECOMPUTE_MODES)} (none: keep every "
                         "activation; selective: recompute the attention core; full: keep each block's input only)")
    return mode


def set_block_recompute(blocks: list[nn.Module], mode: str, layers: int | None = None, on_recompute=None) -> None:
    """``mode`` for the first ``layers`` of ``blocks`` (None: all of them; fewer is
    Megatron's "block" method: the first K blocks of a stage), "none" for the rest.
    A block is anything with ``set_recompute(mode, on_recompute)`` (plait's GPT blocks)."""
    check_mode(mode)
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise ValueError(f"recompute layers={layers!r}: give a block count >= 0 (or None for every block)")
    count = len(blocks) if layers is None else min(layers, len(blocks))
    for index, block in enumerate(blocks):
        block.set_recompute(mode if index < count else NONE, on_recompute)


__all__ = ["RECOMPUTE_MODES", "check_mode", "random_streams", "recompute", "set_block_recompute"]
