"""ZeRO's state dicts: the full (unsharded) state of the wrapped module, and this
rank's sharded state. A mixin of ``plait.parallel.zero.module.ZeRO``: it reads the
wrapper's ``module``, ``units``, ``optimizer``, ``engine``, ``communicator`` and rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait import comm


class ZeroStateDicts:
    """The state-dict methods of ZeRO (see the module docstring)."""

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The unsharded parameters and buffers, as ``module.state_dict()`` would give
        without ZeRO: on every rank, or (``rank0_only``) on rank 0 of the group only, the
        others getting ``{}``. Every rank of the group must call it (stage 3 gathers)."""
        with self.engine.gathered():
            return {} if rank0_only and self.rank != 0 else \
                {name: tensor.detach().clone() for name, tensor in self.module.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor] | None, from_rank0: bool = False) -> None:
        """Load unsharded parameters and buffers (names and shapes must match the
        module's). ``from_rank0``: only rank 0's ``state`` is read and broadcast (the
        other ranks may pass None); every rank of the group must call it."""
        template = self.module.state_dict()
        if from_rank0 and self.world_size > 1:
            verdict = [self._state_problem(state, template) if self.rank == 0 else None]
            dist.broadcast_object_list(verdict, src=self._src, group=self.communicator.group)
            if verdict[0]:
                raise ValueError(verdict[0])
            received = {}
            for name in sorted(template):
                value = state[name].detach().to(template[name].dtype).contiguous().clone() if self.rank == 0 \
                    else torch.empty(template[name].shape, dtype=template[name].dtype)
                comm.broadcast(value, src=self._src, group=self.communicator)
                received[name] = value
            state = received
        else:
            problem = self._state_problem(state, template)
            if problem:
                raise ValueError(problem)
        names = {id(param): name for name, param in self.module.named_parameters()}
        for unit in self.units:
            start = self.rank * unit.shard_numel
            flat = torch.zeros(unit.padded, dtype=unit.shard.dtype)
            for param, offset in zip(unit.params, unit.offsets):
                flat[offset:offset + param.numel()].copy_(state[names[id(param)]].reshape(-1))
            with torch.no_grad():
                unit.shard.copy_(flat[start:start + unit.shard_numel])
            if unit.gathered:
                unit.gather(self.communicator, self.algorithm)
        # every name of every parameter (a tied one has two): only the buffers remain to load
        params = {name for name, _ in self.module.named_parameters(remove_duplicate=False)}
        buffers = {name: value for name, value in state.items() if name not in params}
        self.module.load_state_dict(buffers, strict=False)

    @staticmethod
    def _state_problem(state, template: dict) -> str | None:
        """What keeps ``state`` from loading into a module whose state dict is ``template``."""
        if not isinstance(state, dict):
            return f"ZeRO: load_full_state_dict needs a dict of tensors, got {type(state).__name__}"
        missing, unexpected = sorted(set(template) - set(state)), sorted(set(state) - set(template))
        if missing or unexpected:
            return (f"ZeRO: the state dict does not fit this model: missing {missing[:8]}"
                    f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                    f"{' ...' if len(unexpected) > 8 else ''}")
        shapes = [f"{name} {tuple(state[name].shape)} (the model's: {tuple(value.shape)})"
                  for name, value in template.items() if tuple(state[name].shape) != tuple(value.shape)]
        if shapes:
            return f"ZeRO: the state dict's shapes do not fit this model: {', '.join(shapes[:8])}"
        return None

    def state_dict(self, *args, **kwargs) -> dict:  # noqa: D102 - sharded: this rank's shards
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "shards": [unit.shard.detach().clone() for unit in self.units],
                "optimizer": self.optimizer.state_dict(),
                "buffers": {name: buffer.detach().clone() for name, buffer in self.module.named_buffers()}}

    def load_state_dict(self, state: dict, strict: bool = True):  # noqa: D102 - what state_dict wrote
        if (state.get("stage"), state.get("world_size"), state.get("rank")) != (self.stage, self.world_size,
                                                                                 self.rank):
            raise ValueError(f"ZeRO: this sharded state is stage {state.get('stage')} rank {state.get('rank')} of "
                             f"{state.get('world_size')}; this wrapper is stage {self.stage} rank {self.rank} of "
                             f"{self.world_size}: load a full state dict to change the layout")
        with torch.no_grad():
            for unit, shard in zip(self.units, state["shards"]):
                unit.shard.copy_(shard)
                if unit.gathered:
                    unit.gather(self.communicator, self.algorithm)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.offload is not None:  # the loaded state into files, the replaced files let go
            for unit in self.units:
                self.offload.adopt(self.optimizer.state.get(unit.shard, {}), unit.shard)
            self.offload.forget([value for entry in self.optimizer.state.values() for value in entry.values()])
        for name, buffer in self.module.named_buffers():
            buffer.copy_(state["buffers"][name])

