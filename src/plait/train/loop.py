"""The training job one process of ``plait train`` runs, inside a torchrun world.

``run(config)`` joins the world (gloo on CPU, NCCL on GPU, from torchrun's
environment), builds the dp × tp × pp mesh, the data, the model cut into this
rank's pipeline chunks at its tensor-parallel degree, and the optimiser; resumes
from the newest complete checkpoint in ``config.out`` when there is one; then
trains ``config.steps`` steps. Rank 0 shows progress, writes ``metrics.jsonl``
(one line per step, every ``log_interval`` steps: plait.train.metrics; rewritten
on resume so no step appears twice) and, at the end, the run report. Checkpoints are written every ``checkpoint_interval``
steps and at the end (see plait.train.checkpoint).

The data position is the step number: global batch t is a deterministic function
of (seed, t) and dp rank r reads its 1/dp slice of it, so a resumed or resharded
run sees exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait import comm
from plait.parallel.hybrid import build_hybrid, evaluate, HybridModel, TIMED_PARTS, train_step
from plait.parallel.mesh import DeviceMesh, ParallelDims
from plait.memory.precision import check_device
from plait.parallel.zero.optimizer import ShardedOptimizer
from plait.train import checkpoint as ckpt, checkpoint_load, hf_layout, hf_model, rundir, runlock
from plait.train.atomic_files import atomic_write
from plait.train.budget import chunk_layer_counts
from plait.train.build import batch, build_model, load_data, make_optimizer, model_description
from plait.train.checkpoint_write import CheckpointNotWritten, write_manifest, write_shard
from plait.train.config import TrainConfig
from plait.train.memory import MemoryMonitor
from plait.train.checkpoint_dcp import write_dcp
from plait.train.metrics import AxisCommClock, MetricsLog
from plait.train.eager_costs import measure_eager_costs
from plait.train.plan_compare import step_parts_section
from plait.train.step_breakdown import measured_breakdown, StepTotals
from plait.train.tensorboard_log import TENSORBOARD_DIR
from plait.train.offload_dirs import prepare_offload_dir, remove_offload_dir
from plait.train.progress import rate_key, throughput_unit
from plait.train.flops import gpt_train_flops, measure_peak_flops, mlp_train_flops
from plait.train.report import summary_lines, write_report
from plait.train.world import init_distributed, threads_per_process

FAULT_ENV = "PLAIT_FAULT_KILL"  # "RANK:STEP": that rank kills itself before STEP, first attempt only (tests)


class Trainer:
    """One rank's training state (see the module docstring)."""

    def __init__(self, config: TrainConfig, *, resume: str = "auto", log=print, data=None, run_id: str | None = None,
                 force_fresh: bool = False, comm_environment: comm.CommConfig | None = None, cache_dir=None,
                 batch_source=None, optimizer_factory=None):
        """``batch_source``: a data source of your own, ``batch_source(step, dp_rank, dp_size) ->
        (inputs, targets)``, this dp rank's slice of global batch ``step`` (default: the config's
        data, ``plait.train.build.batch``); its time is the report's ``data`` part.
        ``optimizer_factory``: ``optimizer_factory(named_parameters, config) -> torch optimizer``
        over this rank's parameters (default ``plait.train.build.make_optimizer``; ZeRO wraps it)."""
        self.config, self.log = config, log
        self.batch_source = batch_source
        self.run_id, self.force_fresh = run_id, force_fresh
        self.started_s = float(os.environ.get("PLAIT_LAUNCH_TIME", time.time()))
        self.device = init_distributed(config.timeout_s, config.backend)
        if self.device.type == "cpu" and "LOCAL_WORLD_SIZE" in os.environ:  # under torchrun: share the cores
            torch.set_num_threads(threads_per_process())
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims = ParallelDims(dp=config.dp, tp=config.tp, pp=config.pp, order=config.mesh_order)
        self.mesh = DeviceMesh.create(self.dims)
        self.coords = self.mesh.coords
        self.data = load_data(config, cache_dir) if data is None else data  # cache_dir: the CLI's
        self.cache_dir = cache_dir  # also where the plan beside the report finds plait calibrate's profile
        self.model_info = model_description(config, self.data)
        self.hf_config = None if config.hf_source is None else hf_model.load_config(config.hf_source)
        self._check_agreement()
        self.comm_config = comm_config(config, comm_environment)
        for group in (None, *self.mesh.group.values()):  # every group this rank talks on, one config
            comm.init_communicator(group, self.comm_config)
        check_device(config.precision, self.device)  # every rank alike, before any group is built
        self.memory = MemoryMonitor(self.device)
        model, layers, loss_fn = build_model(config, self.data, self.mesh.group["tp"])
        hf = config.hf_source is not None  # its blocks' recompute is set by build_model, its ZeRO-3 units here:
        units = [hf_model.zero_units(model)] if hf and config.zero_stage == 3 else None  # one per decoder block
        self.hybrid: HybridModel = build_hybrid(
            model, layers, self.mesh, loss_fn, schedule=config.schedule, microbatches=config.microbatches,
            virtual=config.virtual, algorithm=config.algorithm, compression=config.compression,
            timeout_s=config.timeout_s, tp_rank=self.coords["tp"], tp_size=config.tp,
            recompute="none" if hf else config.recompute,
            recompute_layers=None if config.recompute_layers < 0 else config.recompute_layers,
            meter=self.memory.meter, precision=config.precision, grad_reduce_dtype=config.grad_reduce_dtype,
            offload_dir=self._offload_dir() if config.offload_activations else None,
            layers_are_chunks=hf and hf_layout.chunk_count(config) > 1,  # split's stage modules
            chunk_layers=None if hf else chunk_layer_counts(config))  # --stage-layers
        for stage in self.hybrid.engine.stages.values():  # only this rank's chunks reach the device
            stage.to(self.device)
        self.hybrid.engine.parameters_moved()  # its autocast and received activations follow them there
        if hf:  # a pipeline rank keeps only its chunks' parameters (the split's stages share the model's)
            hf_model.free_unheld(model, self.hybrid.names.values())
        del model, layers
        self.optimizer = (optimizer_factory or make_optimizer)(self.hybrid.names.items(), config)
        if config.zero_stage:  # optimizer state (2: and gradients; 3: and parameters) sharded over the dp group
            shared = set(self.hybrid.engine.shared_parameters)  # summed over pipeline ranks after the backward
            self.optimizer = ShardedOptimizer(
                self.optimizer, self.mesh.group["dp"], algorithm=config.algorithm, stage=config.zero_stage,
                late=[param for name, param in self.hybrid.names.items() if name in shared],
                offload_dir=self._offload_dir() if config.offload == "optimizer" else None,
                modules=(units or list(self.hybrid.engine.stages.values())) if config.zero_stage == 3 else None)
            self.hybrid.engine.parameters_moved()  # the parameters now live in the flat buckets
        del units
        # the same Parameter objects every step (ZeRO 3 moves their storages, not them)
        self._parameters = list(self.hybrid.parameters())
        self.out = Path(config.out)
        self.start_step = 0
        self.resumed_from = None
        self.times = StepTotals()  # this process's steps, timed part by part (plait.train.step_breakdown)
        self._resume(resume)

    def _whole_parameters(self, write: bool = False):
        """ZeRO 3: every parameter gathered inside (all dp ranks enter); else nothing to do."""
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.whole_parameters(write=write)
        return contextlib.nullcontext()

    def _hf_json(self) -> str | None:
        return None if self.hf_config is None else hf_model.config_json(self.hf_config)

    def _offload_dir(self) -> Path:
        """This rank's offload directory, checked writable on every rank (collective)."""
        wanting = [what for what, wanted in (("offload_activations=true", self.config.offload_activations),
                                             ("offload=optimizer", self.config.offload == "optimizer")) if wanted]
        return prepare_offload_dir(Path(self.config.out), self.rank, self.world_size, wanting)

    def _close_offload(self) -> None:
        """Stop the prefetch thread and remove this rank's (by now empty) offload directory
        (the optimizer state's files were unlinked as soon as they were mapped)."""
        offloader = self.hybrid.engine.offloader
        if offloader is not None:
            offloader.close()
        if offloader is not None or self.config.offload != "none":
            remove_offload_dir(Path(self.config.out), self.rank)

    # ----- checkpoints ---------------------------------------------------------------------
    def _check_agreement(self) -> None:
        """Every rank must train the same config on the same data (under torchrun each
        node parses its own flags and reads its own files): one all-gather, and the
        ranks that differ from rank 0 are named on every rank."""
        mine = (self.config.digest(), getattr(self.data, "digest", None))
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        config_differs = [rank for rank, (config, _) in enumerate(everyone) if config != everyone[0][0]]
        data_differs = [rank for rank, (_, data) in enumerate(everyone) if data != everyone[0][1]]
        problems = ([f"ranks {config_differs} have a different config from rank 0's (launch every node with the "
                     f"same flags / --config)"] if config_differs else []) + \
                   ([f"ranks {data_differs} read different data from rank 0's (every node needs the same --data "
                     f"files; 'stdlib' is each node's own Python)"] if data_differs else [])
        if problems:
            raise ValueError("plait train: " + "; ".join(problems))

    def _choose_checkpoint(self, resume: str) -> str | None:
        """Rank 0 picks the checkpoint (or refuses), every rank gets its decision: ranks
        never start from different steps. Checkpoints need a filesystem every node
        sees at --out."""
        decision = [None]
        if self.rank == 0:
            try:
                decision[0] = ("ok", self._pick(resume))
            except (ValueError, OSError) as error:  # every rank raises it, none waits for a step that never comes
                decision[0] = ("error", str(error))
        dist.broadcast_object_list(decision, src=0)
        status, value = decision[0]
        if status == "error":
            raise ValueError(value)
        return value

    def _pick(self, resume: str) -> str | None:
        """Rank 0: what to start from (plait.train.rundir.decide), with its side effects
        (broken newer checkpoints set aside, an earlier run moved aside on
        --force-fresh) and run.json written before any step runs."""
        plan = rundir.decide(self.out, resume, run_id=self.run_id, force_fresh=self.force_fresh)
        self.out.mkdir(parents=True, exist_ok=True)
        rundir.apply(plan, self.out, log=self.log)
        if self.run_id is not None:
            rundir.write_run_record(self.out, self.run_id, plan.checkpoint)
        return None if plan.checkpoint is None else str(plan.checkpoint)

    def _resume(self, resume: str) -> None:
        chosen = self._choose_checkpoint(resume)
        if chosen is None:
            return
        path = Path(chosen)
        manifest, model_state, optimizer_state, _ = checkpoint_load.load_full(path, check_files=False)  # verified above
        checkpoint_load.check_compatible(manifest, self.model_info)
        checkpoint_load.check_same_data(manifest, getattr(self.data, "digest", None))
        names = list(self.hybrid.names)
        # sliced as THIS model shards each tensor (an HF model at tp=1 saves no specs; at tp=2 its plan shards)
        model_shard, optimizer_shard = checkpoint_load.reshard(model_state, optimizer_state, self.hybrid.named_specs(),
                                                               self.coords["tp"], self.config.tp, names)
        with torch.no_grad(), self._whole_parameters(write=True):
            for name, param in self.hybrid.names.items():
                param.copy_(model_shard[name].to(param.device, param.dtype))
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.load_full_state(optimizer_shard, {id(p): name for name, p in self.hybrid.names.items()})
        for name, param in self.hybrid.names.items():
            state = optimizer_shard.get(name)
            if state and not isinstance(self.optimizer, ShardedOptimizer):
                self.optimizer.state[param] = {key: value.to(self.device) if value.dim() else value.clone()
                                               for key, value in state.items()}
        same_mesh = manifest["mesh"] == self._mesh_info()
        extra = self._my_extra(path) if same_mesh else {}
        for name, module in self.hybrid.dropouts.items():
            if name in extra.get("dropout", {}):
                module.calls = int(extra["dropout"][name])
        if self.hybrid.scaler is not None and "loss_scale" in extra:
            self.hybrid.scaler.load_state_dict(extra["loss_scale"])
        self.start_step = int(manifest["data_position"])
        self.resumed_from = path
        if self.rank == 0 and self.hybrid.compressor is not None:
            self.log("note: the compressor's state (error-feedback residuals, PowerSGD factors) is not in "
                     "checkpoints; it restarts from zero, so the resumed run is close to, not identical with, "
                     "an uninterrupted one")
        if self.rank == 0:
            self.log(f"resuming from {path} (step {self.start_step}, saved with mesh "
                     f"dp={manifest['mesh']['dp']} tp={manifest['mesh']['tp']} pp={manifest['mesh']['pp']})")

    def _my_extra(self, path: Path) -> dict:
        shard = path / ckpt.shard_name(self.coords["tp"], self.coords["pp"])
        # O_NOFOLLOW as checkpoint_load reads it: a shard replaced by a link since it was verified is not read through
        with os.fdopen(os.open(shard, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as file:
            payload = torch.load(file, map_location="cpu", weights_only=True)
        return payload.get("extra", {})

    def _saved_names(self) -> list[str]:
        """What this rank's shard holds: a parameter two pipeline ranks share (an HF
        model's tied embedding and head, cut apart by the split) on the first only."""
        shared = self.hybrid.engine.shared_parameters
        return [name for name in self.hybrid.saved_names
                if name not in shared or min(shared[name]) == self.coords["pp"]]

    def _mesh_info(self) -> dict:
        return {"dp": self.config.dp, "tp": self.config.tp, "pp": self.config.pp, "order": self.config.mesh_order}

    def save(self, step: int) -> Path:
        """Every (tp, pp) coordinate's dp-rank-0 process writes its shard; rank 0
        writes the manifest (the commit point) once all are on disk."""
        directory = ckpt.checkpoint_dir(self.out, step)
        if self.rank == 0:
            # never overwritten, nor written through a link put there during the run: the link itself is renamed
            if directory.is_symlink() or (directory / ckpt.MANIFEST_NAME).exists():
                self.log(f"{directory.name} already exists: kept as {ckpt.set_aside(directory, 'replaced').name}")
            elif directory.exists():
                shutil.rmtree(directory)  # partial (no manifest): this run's own interrupted save
            directory.mkdir(parents=True)
        dist.barrier()
        entry = None
        if isinstance(self.optimizer, ShardedOptimizer):  # every dp rank takes part in gathering the state
            full = self.optimizer.full_state({id(p): name for name, p in self.hybrid.names.items()})
        with self._whole_parameters():  # ZeRO 3: every dp rank takes part in gathering the parameters
            model = {name: self.hybrid.names[name].detach().cpu().clone() for name in self._saved_names()} \
                if self.coords["dp"] == 0 else None
        if self.coords["dp"] == 0:
            if isinstance(self.optimizer, ShardedOptimizer):
                state = {name: full.get(name, {}) for name in self._saved_names()}
            else:
                state = {name: self.optimizer.state.get(self.hybrid.names[name], {})
                         for name in self._saved_names()}
            payload = {
                "format": 1, "tp_rank": self.coords["tp"], "tp_size": self.config.tp,
                "pp_rank": self.coords["pp"], "pp_size": self.config.pp,
                "model": model,
                "specs": {name: spec for name, spec in self.hybrid.named_specs().items()
                          if name in self._saved_names()},
                "optimizer": {name: {key: value.detach().cpu().clone() if torch.is_tensor(value)
                                     else torch.tensor(value) for key, value in entry_state.items()}
                              for name, entry_state in state.items() if entry_state},
                "extra": {"dropout": {name: int(module.calls) for name, module in self.hybrid.dropouts.items()},
                          **({"loss_scale": self.hybrid.scaler.state_dict()} if self.hybrid.scaler else {})},
            }
            try:
                entry = write_shard(directory, ckpt.shard_name(self.coords["tp"], self.coords["pp"]), payload)
            except (OSError, ValueError, TypeError) as error:  # e.g. a full disk: every rank hears why
                entry = {"error": f"rank {self.rank} could not write its shard to {directory}: {error}"}
        entries = [None] * self.world_size
        dist.all_gather_object(entries, entry)
        failures = [e["error"] for e in entries if e is not None and "error" in e]
        if failures:
            raise CheckpointNotWritten(step, failures)
        if self.rank == 0:
            hf_model.write_config(directory, self._hf_json())  # HF's config.json beside the shards (hf models)
            manifest = {"step": step, "mesh": self._mesh_info(), "config": self.config.to_dict(),
                        "config_digest": self.config.digest(), "model": self.model_info,
                        "corpus_digest": getattr(self.data, "digest", None), "data_position": step,
                        "created_unix_s": time.time()}
            if self.config.checkpoint_format == "dcp":  # torch's format too, before the commit point (F)
                write_dcp(directory, manifest, [e for e in entries if e is not None], self.config)
            write_manifest(directory, manifest, [e for e in entries if e is not None])
            if self.config.keep_checkpoints:  # 0 keeps them all
                ckpt.prune(self.out, self.config.keep_checkpoints, log=self.log)
        dist.barrier()
        return directory

    # ----- the loop ------------------------------------------------------------------------
    def _batch(self, step, evaluation=False):
        if self.batch_source is not None and not evaluation:
            inputs, targets = self.batch_source(step, self.coords["dp"], self.config.dp)
        else:
            inputs, targets = batch(self.config, self.data, step, self.coords["dp"], self.config.dp,
                                    evaluation=evaluation)
        return inputs.to(self.device), targets.to(self.device)

    def evaluate(self) -> float:
        losses = [evaluate(self.hybrid, *self._batch(index, evaluation=True))
                  for index in range(self.config.eval_batches)]
        return sum(losses) / len(losses)

    def _fault_injection(self, step: int) -> None:
        spec = os.environ.get(FAULT_ENV)
        if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        rank, at = (int(part) for part in spec.split(":"))
        if rank == self.rank and step == at:
            os.kill(os.getpid(), signal.SIGKILL)

    def train(self, *, until: int | None = None) -> dict | None:
        """Train from the start (or resumed) step to ``config.steps``, or only up to
        step ``until`` (exclusive; a partial run, as if stopped there: the LR
        schedule is still the full run's). Returns rank 0's report."""
        config = self.config
        end = config.steps if until is None else min(until, config.steps)
        if self.start_step >= end:  # e.g. rerun of a finished job: keep its metrics and report as they are
            if self.rank == 0:
                self.log(f"{self.out} is already trained to step {self.start_step} of {config.steps}: nothing to do "
                         f"(raise --steps to train on, or use a new --out)")
            return None
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            text = config.to_toml()  # renamed over config.toml: a link there is replaced, never written through
            atomic_write(self.out / "config.toml", lambda temporary: Path(temporary).write_text(text))
            hf_model.write_config(self.out, self._hf_json(), self.data)  # and its tokenizer (plait's char: none)
        metrics = MetricsLog(self.out / "metrics.jsonl", group=self.mesh.group["dp"], dp_size=config.dp,
                             write=self.rank == 0, interval=config.log_interval, start_step=self.start_step,
                             tensorboard_dir=self.out / TENSORBOARD_DIR if config.log == "tensorboard" else None)
        progress = None
        unit = throughput_unit(config.model)  # tokens for the GPT, samples for the MLP
        if self.rank == 0:
            from plait.train.progress import Progress

            progress = Progress(config.steps, start_step=self.start_step, unit=unit)
        items_per_step = config.global_batch * (config.seq_len if unit == "tokens" else 1)
        comm.reset_stats()
        axis_clock = AxisCommClock(self.mesh.group, {axis: self.mesh.size(axis) for axis in self.mesh.group})
        first_step_s = None
        loop_start_s = time.perf_counter()
        steps_run = 0
        try:
            for step in range(self.start_step, end):
                self._fault_injection(step)
                data_start_s = time.perf_counter()
                inputs, targets = self._batch(step)
                data_s = time.perf_counter() - data_start_s
                self.memory.begin_step(exclude=[*self._parameters, inputs, targets])
                lr = config.lr_at(step)
                axis_clock.start()
                loss, norm, times = train_step(self.hybrid, inputs, targets, self.optimizer, step=step,
                                               grad_clip=config.grad_clip, lr=lr, reduce_loss=False)
                times = times.with_data(data_s)
                memory = self.memory.end_step(self.hybrid.engine.history[-1].peak_activation_bytes,
                                              itertools.chain(self._parameters,  # read after the first step only
                                                              getattr(self.optimizer, "shards", [])),
                                              self.optimizer)
                steps_run += 1
                if first_step_s is None:
                    first_step_s = time.time() - self.started_s
                self.times.add(times)
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm,
                          rate_key(unit): items_per_step / times.wall_s, "step_s": times.wall_s,
                          "elapsed_s": time.perf_counter() - loop_start_s,
                          **({"loss_scale": self.hybrid.scaler.scale, "skipped_steps": self.hybrid.scaler.skipped_steps}
                             if self.hybrid.scaler is not None else {}),
                          "saved_peak_bytes": memory["saved_peak_bytes"],
                          "resident_peak_bytes": memory["resident_peak_bytes"], **axis_clock.stop(),
                          **{f"part_{name}": getattr(times, name) for name in TIMED_PARTS[1:]}}  # rank 0's
                last = step == end - 1
                if config.eval_interval and ((step + 1) % config.eval_interval == 0 or last):
                    record["val_loss"] = self.evaluate()
                metrics.add(record)  # its loss is this dp rank's until the flush averages it
                checkpoint = last or bool(config.checkpoint_interval and (step + 1) % config.checkpoint_interval == 0)
                if metrics.flush_due(step, last=last, checkpoint=checkpoint):
                    for flushed in metrics.flush():
                        if progress is not None:
                            extra = f"val {flushed['val_loss']:.3f}" if "val_loss" in flushed else ""
                            progress.update(flushed["step"] + 1, flushed["loss"], flushed[rate_key(unit)], extra)
                if checkpoint:
                    path = self.save(step + 1)
                    if self.rank == 0:
                        progress.log(f"checkpoint {path}")
        finally:
            self._close_offload()
            metrics.close()
            if progress is not None:
                progress.close()
        records = metrics.records
        return self._report(records, steps_run, {f"{unit}_per_step": items_per_step}, first_step_s)

    def _transports(self) -> dict[str, str]:
        """How each group this rank talks on moves its messages (shared memory, gloo and why)."""
        groups = {"world": None, **{axis: group for axis, group in self.mesh.group.items()}}
        return {axis: comm.communicator_for(group).transport.description for axis, group in groups.items()
                if comm.communicator_for(group) is not None}

    def _report(self, records, steps_run, per_step: dict, first_step_s) -> dict | None:
        peak_flops_per_s = self.peak_flops_per_process(measure_peak_flops)
        eager = self.peak_flops_per_process(measure_eager_costs)  # the plan's per-kernel cost and bandwidth
        mine = {"rank": self.rank, "coords": dict(self.coords), "steps": steps_run,
                **self.times.report(self.hybrid.engine.history),
                "collectives": {name: {key: entry[key] for key in ("calls", "bytes_sent", "time_s", "algorithms")}
                                for name, entry in comm.stats().items()},
                "comm": {"config": self.comm_config.describe(),
                         "tuner": getattr(self.comm_config.tuner, "source", None) or "none: the default table",
                         "transports": self._transports()},
                "memory": {**self.memory.summary(), **({"offload": dict(self.hybrid.engine.offloader.stats)}
                                                      if self.hybrid.engine.offloader is not None else {})}}
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        if self.rank != 0:
            return None

        run_info = {"config": self.config.to_dict(), "mesh": self.dims.describe(), "world_size": self.world_size,
                    "backend": dist.get_backend(), "device": str(self.device), **per_step,
                    "flops_per_step": self.flops_per_step(), "peak_flops_per_s": peak_flops_per_s,
                    "time_to_first_step_s": first_step_s or 0.0, "steps": self.config.steps,
                    "start_step": self.start_step}
        inputs = {"world_size": self.world_size, "vocab": getattr(self.data, "vocab_size", None),
                  "peak_flops_per_s": peak_flops_per_s, "eager": list(eager)}
        step_parts = step_parts_section(self.config.to_dict(), measured_breakdown(everyone), inputs,
                                        cache_dir=self.cache_dir)
        report = write_report(self.out, metrics=records, ranks=everyone, run=run_info, step_parts=step_parts)
        for line in summary_lines(report):
            self.log(line)
        return report

    def peak_flops_per_process(self, measure):
        """The matmul rate a process achieves while every rank measures at once (so
        4 processes sharing 2 cores each see their share): the median over ranks (of
        whatever ``measure`` returns: a tuple's median by its first element).
        Collective: every rank calls it."""
        dist.barrier()
        rate = measure(device=self.device)
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, rate)
        return sorted(everyone)[len(everyone) // 2]

    def flops_per_step(self) -> float:
        config = self.config
        if config.hf_source is not None:
            return hf_model.train_flops(self.hf_config, config.global_batch, config.seq_len)
        if config.model == "gpt":
            return gpt_train_flops(config.global_batch, config.seq_len, config.layers, config.hidden,
                                   self.data.vocab_size)
        return mlp_train_flops(config.global_batch, (64, *config.mlp_hidden, 10))


def comm_config(config: TrainConfig, base: comm.CommConfig | None = None) -> comm.CommConfig:
    """The CommConfig of every group of a run: ``base`` (the CLI's, from PLAIT_COMM_*;
    default CommConfig()) with the run's timeout and, with ``comm_profile``, a tuner
    on that calibration profile."""
    tuner = None
    if config.comm_profile:
        from plait.comm.tuner import tuner_from_profile
        from plait.cost.profile import load_profile

        profile = load_profile(config.comm_profile)
        if profile is None:
            raise ValueError(f"comm_profile={config.comm_profile!r}: no such file; run plait calibrate --output "
                             f"{config.comm_profile} first, or leave comm_profile empty for the default table")
        tuner = tuner_from_profile(profile, source=f"profile {config.comm_profile}")
    return (base or comm.CommConfig()).replace(timeout_s=config.timeout_s, tuner=tuner, transport=config.transport)


def run(config: TrainConfig, *, run_id: str, resume: str = "auto", force_fresh: bool = False, log=print,
        until: int | None = None, comm_environment: comm.CommConfig | None = None, cache_dir=None) -> dict | None:
    """Train on this rank of the torchrun world; rank 0 returns the report. The run
    directory's lock is held (or shared with the run's launcher) throughout."""
    with runlock.acquire(config.out, run_id):
        trainer = Trainer(config, resume=resume, log=log, run_id=run_id, force_fresh=force_fresh,
                          comm_environment=comm_environment, cache_dir=cache_dir)
        try:
            return trainer.train(until=until)
        finally:
            if os.environ.get("TORCHELASTIC_RUN_ID") and dist.is_initialized():
                comm.destroy_process_group()  # a clean gloo shutdown before the process exits
