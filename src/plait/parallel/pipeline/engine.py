"""Run a pipeline schedule over real processes.

``PipelineEngine(schedule, stage_modules, loss_fn, group=...)`` holds this rank's
model chunks (``stage_modules[s]`` for every stage s the schedule places here) and
``train_step(inputs, targets, optimizer)`` executes the rank's action list:

- the global batch is split into m equal micro-batches along dim 0; the ranks
  holding a first stage read ``inputs``, those holding a last stage ``targets``;
- a forward keeps its input (detached, requiring grad) and output; activations and
  gradients cross stage boundaries as point-to-point messages (``plait.comm.isend``
  / ``irecv`` with deadlines; ``plait.parallel.pipeline.messages``): shapes need no
  configuration, the first step announces each stream's shape (and any step whose
  batch shape changes), later ones send payloads alone into receives posted ahead,
  and a shape that changes between micro-batches is caught; a stage may take and
  return a tuple of tensors (an automatically split model's hidden states with its
  position ids, masks, rotary cos/sin: ``plait.parallel.pipeline.boundary_values``),
  sent as one message, whose floating parts that required a gradient carry one back;
- each micro-batch's loss is ``loss_fn(output, target) / m``, so the summed
  gradients are those of the mean loss over the whole batch, as one big batch gives;
- a split backward (zero bubble) computes the stage input's gradient in B and
  leaves W only the weight-gradient half (``plait.parallel.pipeline.split_backward``);
- Chimera's ALL_REDUCE sums the two replicas' gradients (an exchange with the rank
  holding the other replica); STEP waits for every send, then runs the optimiser.
- parameters shared between stages held by different ranks (a tied embedding and
  output head, as GPT-2 has; any nn.Parameter appearing in two stages) are found at
  construction (``plait.parallel.pipeline.shared_params``): by their names in
  ``model``, the whole model the stages were cut from, when it is given; else as the
  ``tied=`` groups declare; and parameters that look shared (equal shape and initial
  values on two ranks) but are declared neither way are refused by name. For every
  set of ranks holding a common parameter one process group is made (Megatron's
  "embedding group"); before the optimiser step each such parameter's gradient is
  all-reduced (summed) over it, so every copy steps with the gradient of the whole
  model: the sum over the stages that use it.

Sends never block and receives block, as the replay assumes. The engine records a
timeline of its computations (``plait.parallel.pipeline.replay.Timeline``) and the
activation memory it holds: bytes of the tensors autograd saves for backward
(each once, parameters and the caller's batch excluded) plus the stage input, per
micro-batch from its forward to its backward. That is bookkeeping, not a
measurement: ``plait.memory.saved_memory`` measures live storages independently.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.comm import tags
from plait.comm.communicator import process_group
from plait.comm.errors import CommError
from plait.parallel.arguments import wrapper_communicator
from plait.parallel.pipeline.boundary_values import (as_leaf, grad_pairs, gradient_inputs, handed_over, input_grad,
                                                     parts, shape_of)
from plait.parallel.pipeline.engine_checks import check_pipeline_arguments
from plait.parallel.pipeline.messages import PipelineError, StageMessages
from plait.parallel.pipeline.replay import Interval, Timeline
from plait.parallel.pipeline.shared_params import find_shared
from plait.parallel.pipeline.split_backward import input_backward, weight_backward
from plait.parallel.pipeline.schedules import (ALL_REDUCE, BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                              STEP, WEIGHT, PipelineSchedule, backward_next, next_backward)
from plait.memory.offload import ActivationOffloader
from plait.memory.precision import autocast
from plait.memory.saved_memory import SavedTensorMeter

_REPLICA_TAG = tags.CHIMERA_REPLICA.start  # Chimera's gradient exchange (plait.comm.tags)


@dataclass
class StepRecord:
    """What one train_step did on this rank."""

    loss: float = 0.0
    intervals: list[Interval] = field(default_factory=list)
    peak_activation_bytes: int = 0
    stage_activation_bytes: dict = field(default_factory=dict)  # stage -> bytes one micro-batch holds there
    step_time_s: float = 0.0
    # where the step's time outside forward/backward went (seconds on this rank): waiting in
    # receives of activations/gradients, posting sends and waiting for them at the end,
    # and the step's closing collectives (loss sum, shared and Chimera replica gradients)
    receive_s: float = 0.0
    send_s: float = 0.0
    closing_s: float = 0.0
    # each receive's wait (kind, micro-batch, stage, start_s, end_s) and each send's
    # post time (kind, micro-batch, stage, posted_s): perf_counter, comparable between
    # processes of one host (plait.train.step_parts splits receive waits into the
    # peer's compute (bubble) and the message's transfer with them)
    receives: list = field(default_factory=list)
    sends: list = field(default_factory=list)
    # the step's closing exchanges, (what, posted_s, end_s) (perf_counter): when this rank
    # posted its part and when the exchange ended here; what: "replicas" (Chimera's gradient
    # exchange with the partner rank) or "loss" (the loss sum over the pipeline group, with the
    # shared parameters' sums). A rank posting before its peers waits there for the pipeline's
    # drain (plait.train.step_breakdown counts that wait as bubble)
    closings: list = field(default_factory=list)
    stage_busy_s: dict = field(default_factory=dict)  # stage -> seconds of its forward/backward/weight intervals


class PipelineEngine:
    """Executes ``schedule``'s actions for this rank (see the module docstring)."""

    def __init__(self, schedule: PipelineSchedule, stage_modules: dict[int, nn.Module], loss_fn, *,
                 group=None, timeout_s: float | None = None, model: nn.Module | None = None, tied=None,
                 meter: SavedTensorMeter | None = None, autocast_dtype: torch.dtype | None = None,
                 loss_scale=None, offloader: ActivationOffloader | None = None):
        """``autocast_dtype``: run the stages' forwards under ``torch.autocast`` in this
        16-bit dtype (mixed precision: the parameters stay as they are); the last
        stage's output is cast to float32 before ``loss_fn`` (the loss in fp32).
        ``offloader``: an ActivationOffloader whose hooks move saved tensors off the
        device in the forward; before each action the engine asks it to prefetch the
        next backward's tensors (the schedule says which). ``loss_scale``: multiplies each micro-batch's loss before its backward (dynamic
        loss scaling's ``scale_loss``). ``meter``: a SavedTensorMeter that also sees every tensor the stages save (its
        hooks composed with the engine's own, so neither hides the other).
        ``model``: the whole model the stage modules were cut from (every rank builds
        it the same way); its parameter names identify a parameter across processes, so
        parameters shared by stages on different ranks are found and their gradients
        summed. ``tied``, without ``model``: every parameter shared across stages, as
        groups of (stage, qualified name in that stage's module) that are one parameter,
        e.g. ``[[(0, "wte.weight"), (1, "lm_head.weight")]]``; their gradients are summed
        as with ``model``; ``tied=()`` says there are none. Neither given, trainable
        parameters that look shared (same shape and the same non-pattern initial values
        on two ranks) are refused by name. Construction is collective over the pipeline
        group (unless it has one rank and neither is given), and, with ``model`` or
        ``tied``, over the default group too when the pipeline group is a subgroup
        (every rank then builds its engine at the same point, as ``new_group`` needs)."""
        check_pipeline_arguments(schedule, stage_modules, loss_fn, group, model, tied)
        # the Communicator every plait call of the engine goes through; torch's own calls
        # (objects, new_group) take its process group (None: the world, as given)
        self.communicator = wrapper_communicator(group, "PipelineEngine")
        group = process_group(group)  # a Communicator's or a 1-D DeviceMesh's process group; None stays
        self.schedule, self.loss_fn, self.group = schedule, loss_fn, group
        self.rank, size = self.communicator.rank, self.communicator.size
        if size != schedule.ranks:
            raise ValueError(f"schedule {schedule.name} is for {schedule.ranks} pipeline ranks, the group has {size}")
        mine = sorted(s for _, s in schedule.stages_of(self.rank))
        if sorted(stage_modules) != mine:
            raise ValueError(f"rank {self.rank} holds stages {mine} in {schedule.name}, "
                             f"got modules for {sorted(stage_modules)}")
        # activations and gradients go through shared memory when the whole group is on this host
        self.link = comm.link_for(self.communicator)
        self.messages = StageMessages(schedule, self.rank, self.link, timeout_s)
        self.stages = {s: stage_modules[s] for s in mine}
        self.timeout_s = timeout_s
        self.meter = meter
        self.autocast_dtype, self.loss_scale = autocast_dtype, loss_scale
        self.offloader = offloader
        self.last = schedule.stages - 1
        self.history: deque[StepRecord] = deque(maxlen=100)
        self.steps = 0
        first = next((param for module in self.stages.values() for param in module.parameters()), None)
        self.device = first.device if first is not None else comm.default_device(self.communicator)
        self._parameter_storages: set[int] = set()
        self._parameter_storage_objects: set[int] = set()
        self.parameters_moved()
        self.shared = find_shared(self.stages, schedule, self.rank, group, model=model, tied=tied)
        # name -> pipeline ranks holding it, for parameters held by more than one rank
        self.shared_parameters: dict[str, tuple[int, ...]] = self.shared.ranks_of

    def parameters(self):
        """Every parameter of this rank's stages once (a parameter shared by two
        chunks must not be stepped twice)."""
        seen = set()
        for module in self.stages.values():
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    # ----- one step ------------------------------------------------------------------------
    def parameters_moved(self) -> None:
        """Read again where the parameters' storages are (after something re-homed them,
        as ZeRO's flat buckets do, or moved them to a GPU): they never count as
        activations, never go to files; and the engine's device (its autocast, the
        activations it receives) is where the parameters now are."""
        first = next(iter(self.parameters()), None)
        if first is not None:
            self.device = first.device
        old = self._parameter_storages
        self._parameter_storages = {param.untyped_storage().data_ptr() for param in self.parameters()}
        # by identity too: ZeRO 3 frees and re-gathers the storages, at other addresses
        self._parameter_storage_objects = {param.untyped_storage()._cdata for param in self.parameters()}
        if self.offloader is not None:  # parameters stay where they are
            self.offloader.keep_storages = (self.offloader.keep_storages - old) | self._parameter_storages

    def train_step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, optimizer=None) -> float:
        """One optimiser step on the global batch: returns the mean loss over the
        micro-batches (the same on every rank of the pipeline)."""
        m = self.schedule.microbatches
        record = StepRecord()
        start = time.perf_counter()
        for module in self.stages.values():
            module.zero_grad(set_to_none=True)
        state = _StepState()
        state.batch_storages = {batch.untyped_storage().data_ptr() for batch in (*parts(inputs), *parts(targets))
                                if isinstance(batch, torch.Tensor)}
        actions = self.schedule.actions[self.rank]
        # checked before any message, so ranks given the same bad batch all raise alike
        micro_inputs = self._split(inputs, "inputs") if 0 in self.stages else None
        micro_targets = self._split(targets, "targets") if self.last in self.stages else None
        self.messages.begin(self.steps, self.device)
        try:
            upcoming = next_backward(actions) if self.offloader is not None else None
            state.backward_next = backward_next(actions) if self.offloader is not None else set()
            for state.position, action in enumerate(actions):
                if upcoming is not None and upcoming[state.position] is not None:
                    self.offloader.prefetch(upcoming[state.position])  # read back while this action computes
                self._run(action, state, micro_inputs, micro_targets, record)
        except Exception:
            self.messages.abort(actions[state.position:])
            self.steps += 1  # the step's tags are retired
            raise
        try:
            finish_start_s = time.perf_counter()
            self.messages.finish()
            closing_start_s = time.perf_counter()
            record.send_s += closing_start_s - finish_start_s
            self.steps += 1
            loss = torch.tensor([state.loss_sum], dtype=torch.float64)
            reduction = comm.all_reduce(loss, group=self.communicator, async_op=True)  # in flight during the step
            self.shared.sum_gradients()
            if optimizer is not None:
                optimizer.step()
            reduction.wait()
            closing_end_s = time.perf_counter()
            record.closings.append(("loss", closing_start_s, closing_end_s))
            record.closing_s += closing_end_s - closing_start_s
        except Exception:
            self.messages.forget()
            raise
        self.messages.commit()
        record.loss = float(loss) / m
        record.peak_activation_bytes = state.peak_bytes
        record.stage_activation_bytes = dict(state.stage_bytes)
        record.step_time_s = time.perf_counter() - start
        self.history.append(record)
        return record.loss

    def _split(self, batch, what: str):
        m = self.schedule.microbatches
        if batch is None:
            raise ValueError(f"rank {self.rank} holds a {'first' if what == 'inputs' else 'last'} stage: "
                             f"pass the global batch's {what}")
        if isinstance(batch, tuple):  # several inputs (a split model's positional inputs): each split alike
            return list(zip(*(self._split(part, what) for part in batch)))
        if batch.shape[0] % m:
            raise ValueError(f"the batch of {batch.shape[0]} does not split into {m} equal micro-batches: "
                             f"use a batch size that is a multiple of {m}")
        return batch.chunk(m)

    def _run(self, action, state, micro_inputs, micro_targets, record):
        mb, s = action.microbatch, action.stage
        if action.kind in (RECV_ACT, RECV_GRAD):
            t0 = time.perf_counter()
            received = self.messages.receive(action)
            if action.kind == RECV_ACT:
                state.inputs[(mb, s + 1)] = as_leaf(received)
            else:
                state.output_grads[(mb, s - 1)] = received
            t1 = time.perf_counter()
            record.receive_s += t1 - t0
            record.receives.append((action.kind, mb, s, t0, t1))
        elif action.kind in (SEND_ACT, SEND_GRAD):
            t0 = time.perf_counter()
            if action.kind == SEND_ACT:
                self.messages.send(self._checked(state, s, mb, state.outputs[(mb, s)]), action)
            else:
                self.messages.send(input_grad(state.inputs.pop((mb, s))), action)
            t1 = time.perf_counter()
            record.send_s += t1 - t0
            record.sends.append((action.kind, mb, s, t1))
        elif action.kind == FORWARD:
            t0 = time.perf_counter()
            self._forward(mb, s, state, micro_inputs, micro_targets)
            t1 = time.perf_counter()
            record.intervals.append(Interval(self.rank, action.label(), FORWARD, mb, t0, t1))
            record.stage_busy_s[s] = record.stage_busy_s.get(s, 0.0) + t1 - t0
        elif action.kind == BACKWARD:
            t0 = time.perf_counter()
            self._backward(mb, s, state)
            t1 = time.perf_counter()
            record.intervals.append(Interval(self.rank, action.label(), BACKWARD, mb, t0, t1))
            record.stage_busy_s[s] = record.stage_busy_s.get(s, 0.0) + t1 - t0
        elif action.kind == WEIGHT:
            t0 = time.perf_counter()
            self._weight(mb, s, state)
            t1 = time.perf_counter()
            record.intervals.append(Interval(self.rank, action.label(), WEIGHT, mb, t0, t1))
            record.stage_busy_s[s] = record.stage_busy_s.get(s, 0.0) + t1 - t0
        elif action.kind == ALL_REDUCE:
            t0 = time.perf_counter()
            self._sum_replicas()
            t1 = time.perf_counter()
            record.closings.append(("replicas", t0, t1))
            record.closing_s += t1 - t0
        else:
            assert action.kind == STEP

    def _checked(self, state, stage, microbatch, tensor):
        first = state.shapes.setdefault(stage, (microbatch, shape_of(tensor)))
        if first[1] != shape_of(tensor):
            raise ValueError(f"stage {stage} output shape changed between micro-batches: {first[1]} for micro-batch "
                             f"{first[0]}, {shape_of(tensor)} for micro-batch {microbatch}; every micro-batch "
                             "must give the same shape")
        return tensor

    def _forward(self, mb, s, state, micro_inputs, micro_targets):
        if s == 0:
            x = micro_inputs[mb]
        elif (mb, s) in state.inputs:
            x = state.inputs[(mb, s)]
        else:  # the previous stage ran here: hand over a detached copy, as a message would
            x = handed_over(state.outputs[(mb, s - 1)])
            state.inputs[(mb, s)] = x
        saved, counted = [0], set()  # activations only: each tensor (view) once, never a parameter
        # nor the caller's batch (a micro-batch is a view of it: memory the caller holds anyway)
        batch_storages = state.batch_storages

        meter, offloader = self.meter, self.offloader
        if offloader is not None:
            offloader.begin((mb, s), enabled=state.position not in state.backward_next)
        input_storages = {part.untyped_storage().data_ptr() for part in parts(x) if isinstance(part, torch.Tensor)}

        def pack(tensor):
            key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            storage = tensor.untyped_storage().data_ptr()
            parameter = storage in self._parameter_storages or \
                tensor.untyped_storage()._cdata in self._parameter_storage_objects
            if key not in counted and not parameter and storage not in batch_storages:
                counted.add(key)
                saved[0] += key[1]
            if offloader is not None and storage not in input_storages and storage not in batch_storages:
                tensor = offloader.pack(tensor)  # (the stage input and the batch are held anyway)
                if not isinstance(tensor, torch.Tensor):
                    return tensor  # off the device: nothing resident to meter
            # detached: a saved *output* held as itself holds its own grad_fn, which holds it (a cycle
            # in C++ no collector sees); a backward that retains the graph (the split B and W) never
            # releases it, so each micro-batch's graph leaked (zero bubble: ~36 MB a step on stage 1)
            return tensor.detach() if meter is None else meter.pack(tensor)

        def unpack(packed):
            if offloader is not None:
                packed = offloader.unpack(packed)
            return packed if meter is None or isinstance(packed, torch.Tensor) else meter.unpack(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack if (meter or offloader) else _identity):
            with autocast(self.device, self.autocast_dtype):
                out = _call_stage(self.stages[s], s, x)
            if s != self.last and not (isinstance(out, torch.Tensor) or isinstance(out, tuple) and
                                       all(isinstance(part, torch.Tensor) for part in out)):
                raise TypeError(f"stage {s} ({type(self.stages[s]).__name__}) returned a {type(out).__name__} for "
                                f"micro-batch {mb}: a pipeline stage before the last must return a tensor or a tuple "
                                f"of tensors, the activation stage {s + 1} receives; return those (e.g. keep the "
                                "first element, or move the extra outputs into a later stage)")
            if s == self.last:
                if self.autocast_dtype is not None and out.is_floating_point():
                    out = out.float()  # the loss in fp32, as Megatron keeps its cross-entropy
                loss = self.loss_fn(out, micro_targets[mb])
                state.loss_sum += float(loss.detach())
                out = loss / self.schedule.microbatches
                if self.loss_scale is not None:
                    out = self.loss_scale(out)
        if offloader is not None:
            offloader.end()
        state.outputs[(mb, s)] = out
        # the stage input we keep, unless autograd saved it
        input_keys = [(part.data_ptr(), part.numel() * part.element_size()) for part in parts(x)] if s > 0 else []
        state.alive[(mb, s)] = saved[0] + sum(key[1] for key in input_keys if key not in counted)
        state.stage_bytes.setdefault(s, state.alive[(mb, s)])
        state.peak_bytes = max(state.peak_bytes, sum(state.alive.values()))

    def _backward(self, mb, s, state):
        grad = None if s == self.last else state.output_grads.pop((mb, s))
        if self.schedule.split_backward:
            # B: the input gradient only, keeping the graph for W (stage 0 has none to make)
            outs, grads = grad_pairs(state.outputs[(mb, s)], grad)
            inputs = gradient_inputs(state.inputs.get((mb, s)))
            deferred = None
            if outs and inputs:
                deferred = input_backward(outs, grads, inputs, self._trained(s))
            state.weight_grads[(mb, s)] = (grads, deferred)
        else:
            outs, grads = grad_pairs(state.outputs.pop((mb, s)), grad)
            if outs:  # a frozen stage (e.g. a fixed embedding) has nothing to do
                torch.autograd.backward(outs, grads)
            state.alive.pop((mb, s), None)
        if s > 0 and self.schedule.rank_of(mb, s - 1) == self.rank:
            state.output_grads[(mb, s - 1)] = input_grad(state.inputs.pop((mb, s)))

    def _weight(self, mb, s, state):
        """W of a split backward: the stage's weight gradients, then its activations go."""
        out, (grads, deferred) = state.outputs.pop((mb, s)), state.weight_grads.pop((mb, s))
        outs = [part for part in parts(out) if part.requires_grad]
        params = self._trained(s)
        if outs and params:
            weight_backward(outs, grads, deferred, params)
        state.alive.pop((mb, s), None)

    def _trained(self, stage: int) -> list[nn.Parameter]:
        return [param for param in self.stages[stage].parameters() if param.requires_grad]

    def _sum_replicas(self):
        """Chimera: stage s lives on rank s (down) and rank p-1-s (up). Exchange every
        gradient with the partner rank and add: both replicas end with the sum."""
        partner = self.schedule.ranks - 1 - self.rank
        # each parameter once (a tied pair within the rank is one), in stage order: the
        # partner holds the same stages, so the same list; shared groups sum the rest
        skip = self.shared.replica_skip
        params = [param for param in self.parameters() if param.requires_grad and id(param) not in skip]
        if not params:
            return
        if len({param.dtype for param in params}) > 1:
            raise TypeError("chimera's replica exchange needs one parameter dtype per rank, got "
                            f"{sorted({str(param.dtype) for param in params})}")
        flat = torch.cat([param.grad.reshape(-1) if param.grad is not None else
                          torch.zeros(param.numel(), dtype=param.dtype, device=param.device) for param in params])
        theirs = torch.empty_like(flat)
        try:
            sent = comm.isend(flat, group=self.link, tag=_REPLICA_TAG, group_dst=partner, label="chimera replica gradients",
                              timeout_s=self.timeout_s)
            comm.recv(theirs, group=self.link, tag=_REPLICA_TAG, group_src=partner, label="chimera replica gradients",
                      timeout_s=self.timeout_s)
            sent.wait()
        except CommError as error:
            raise PipelineError(f"rank {self.rank}: exchanging replica gradients with rank {partner}: {error}") from error
        # partner's chunks are the same stages in the same sorted order
        total = flat + theirs
        offset = 0
        for param in params:
            param.grad = total[offset:offset + param.numel()].view_as(param).clone()
            offset += param.numel()

    def timeline(self, step: int = -1) -> Timeline:
        """This rank's intervals of one recorded step (seconds from its first)."""
        return _relative(self.schedule.ranks, self.history[step].intervals)


@dataclass
class _StepState:
    inputs: dict = field(default_factory=dict)  # (mb, stage) -> stage input (requires grad)
    outputs: dict = field(default_factory=dict)  # (mb, stage) -> stage output (or scaled loss)
    output_grads: dict = field(default_factory=dict)  # (mb, stage) -> gradient of the stage output
    alive: dict = field(default_factory=dict)  # (mb, stage) -> activation bytes held
    shapes: dict = field(default_factory=dict)
    stage_bytes: dict = field(default_factory=dict)
    weight_grads: dict = field(default_factory=dict)  # (mb, stage) -> (output gradient, B's DeferredWeights) for W
    batch_storages: set = field(default_factory=set)  # storages of the caller's inputs and targets
    loss_sum: float = 0.0
    peak_bytes: int = 0
    position: int = 0
    backward_next: set = field(default_factory=set)  # forwards whose backward comes right after (not offloaded)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _call_stage(module: nn.Module, stage: int, x):
    """module(x), or module(*x) for the tuple a split model's stage receives."""
    if not isinstance(x, tuple):
        return module(x)
    try:
        return module(*x)
    except TypeError as error:
        try:
            inspect.signature(module.forward).bind(*x)
        except TypeError:
            raise TypeError(f"stage {stage} ({type(module).__name__}) cannot take the {len(x)} tensors the stage "
                            f"before returned ({error}): a stage after one returning a tuple takes its parts as "
                            "positional arguments") from error
        raise


def gather_timeline(engine: PipelineEngine, step: int = -1) -> Timeline:
    """Every rank's intervals of one step, on every rank (times from each process's
    perf_counter, comparable between processes of one host)."""
    everyone: list = [None] * engine.schedule.ranks
    dist.all_gather_object(everyone, engine.history[step].intervals, group=engine.group)
    return _relative(engine.schedule.ranks, [interval for rank_intervals in everyone for interval in rank_intervals])


def _relative(ranks: int, intervals) -> Timeline:
    origin = min((interval.start_s for interval in intervals), default=0.0)
    shifted = tuple(Interval(i.rank, i.label, i.kind, i.microbatch, i.start_s - origin, i.end_s - origin)
                    for i in intervals)
    return Timeline(ranks=ranks, intervals=shifted, source="measured")
