"""Parameter server (Li et al., OSDI 2014): server ranks own whole-tensor shards of the
parameters and their optimiser state; worker ranks push gradients and pull parameters.

Roles: of a group of p ranks the last ``num_servers`` (k) are servers, the first
``W = p - k`` are workers (worker w is group rank w, so ``rank_batch(.., w, W)``
gives its data). Trainable tensors are assigned whole, largest first, to the least
loaded server (greedy LPT, :func:`shard_by_size`), so each server can run any torch
optimiser, per tensor, over its own copies.

Modes, with g_w^t worker w's gradient of step t and eta the optimiser's rule:

- ``sync``: the server waits for all W pushes of step t, averages them in
  worker-rank order g^t = (1/W) sum_w g_w^t, runs ``optimizer.step()`` once and
  replies to every worker: data-parallel SGD (and Adam, ...) on the global batch.
- ``async`` (stale synchronous parallel, Ho et al. 2013): each push is applied on
  arrival as its own ``optimizer.step()`` with the gradient scaled by 1/W, so one
  round of W pushes moves plain SGD as far as one synchronous step and the learning
  rate means the same in both modes. The reply (current parameters) is withheld while
  ``clock_w - min_v clock_v > max_staleness`` (clock: pushes applied; min over
  workers that have not closed), so no worker starts a step more than
  ``max_staleness`` steps ahead of the slowest. A gradient is then computed on
  parameters missing at most ``(2s+1)(W-1)`` of the other workers' updates
  (``update_staleness_bound``). ``order="arrival"`` serves pushes as they come;
  ``order=<int>`` draws the next worker to serve from a seeded RNG among those the
  server is waiting for (and then waits for that one), so the interleaving, and the
  run, no longer depends on timing; every server draws the same sequence.

Cost per step (sync): two message rounds; server s receives and sends W·n_s bytes
(n_s its shard), T ~ 2a + 2·W·n_s·b through its link, so k servers split the star's
2·W·n·b (DESIGN section 6) by k when the shards balance. Compression (a
``PayloadCompressor``) shrinks the push to ``wire_nbytes(n_s)``; pulls stay dense.

Protocol: ``plait.parallel.ps.protocol`` (the headers, kinds, tags and deadlines both
sides share). A server that loses a worker tells every other open worker who it was and
raises; ``timeout_s`` must therefore exceed one step's compute time; after a failure
the group is not reusable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.compress.base import PayloadCompressor
from plait.compress.powersgd import PowerSGD
from plait.parallel.arguments import check_wrapper_arguments, wrapper_communicator
from plait.parallel.data.buckets import unflatten_into
from plait.parallel.ps.config import ParameterServerConfig, ParameterServerStats, PushRecord, Shard, shard_by_size
from plait.parallel.ps.protocol import (ABORT, CLOSE, DATA_TAG, GLOO_FALLBACK_FACTOR, KIND_NAMES, PUSH, PUSH_TAG,
                                        RAISED, REASONS, REPLY, REPLY_TAG)
from plait.parallel.ps.server import ServerLoop


class ParameterServer(ServerLoop):
    """Push/pull training of ``module`` with ``optimizer_factory(params)`` run on the
    servers; built collectively by every rank of ``group`` (it broadcasts the first
    server's parameters and buffers to all).

    Workers: ``loss.backward(); ps.step(); ps.zero_grad()`` per step, then
    ``ps.close()``. Servers: ``ps.serve()`` until every worker closed. Or
    ``ps.run(train_fn)`` on every rank. Parameters that receive no gradient push zeros.
    Buffers (e.g. batch-norm statistics) are only synchronised at construction.
    """

    def __init__(self, module: nn.Module, optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 *, num_servers: int = 1, mode: str = "sync", max_staleness: int = 0, order: str | int = "arrival",
                 compression=None, group=None):
        check_wrapper_arguments(module, group, "ParameterServer")
        self.config = ParameterServerConfig(num_servers=num_servers, mode=mode, max_staleness=max_staleness,
                                            order=order)
        if not callable(optimizer_factory):
            raise TypeError(f"optimizer_factory must be callable (params -> torch.optim.Optimizer), e.g. "
                            f"lambda params: torch.optim.SGD(params, lr=0.1); got {optimizer_factory!r}")
        _check_compression(compression)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParameterServer needs torch.distributed initialised on every rank (launch with "
                               "torchrun and call dist.init_process_group, or use plait.testing.run_distributed)")
        self.group = group  # as given (None: the world), as before
        self.communicator = wrapper_communicator(group, "ParameterServer")  # every call goes through it
        self.world_size = self.communicator.size
        self.rank = self.communicator.rank
        self.config.check_world_size(self.world_size)
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        if not named:
            raise ValueError("module has no parameters with requires_grad=True; nothing to serve")
        dtypes = sorted({str(param.dtype) for _, param in named})
        if len(dtypes) > 1:
            raise ValueError(f"trainable parameters mix dtypes {dtypes}; the parameter server packs each shard "
                             f"into one flat buffer: cast the module with module.to(dtype) first")
        if num_servers > len(named):
            raise ValueError(f"num_servers={num_servers} > {len(named)} trainable parameter tensors: tensors are "
                             f"assigned whole, so each server needs one; use num_servers <= {len(named)}")
        self.module = module
        self.compression = compression
        self.num_workers = self.world_size - num_servers
        self.worker_ranks = tuple(range(self.num_workers))
        self.server_ranks = tuple(range(self.num_workers, self.world_size))
        self.dtype = named[0][1].dtype
        owned = shard_by_size([p.numel() * p.element_size() for _, p in named], num_servers)
        self._shard_params = [[named[i][1] for i in indices] for indices in owned]
        self.shards = tuple(
            Shard(server=server, names=tuple(named[i][0] for i in indices),
                  numel=sum(named[i][1].numel() for i in indices),
                  nbytes=sum(named[i][1].numel() * named[i][1].element_size() for i in indices))
            for server, indices in zip(self.server_ranks, owned))
        self.timeout_s = self.communicator.config.timeout_s  # the group's deadline
        # pushes and pulls go through shared memory when the whole group shares this host
        self._link = comm.link_for(self.communicator)
        self._broadcast_state(self.server_ranks[0])
        self._bytes_sent = self._bytes_received = 0
        self._wait_time_s = 0.0
        self._pushes = self._updates = 0
        self._max_steps_ahead = self._max_update_staleness = 0
        self._push_log: list[PushRecord] = []
        self._step = 0
        self._closed = False
        self.optimizer = None
        if self.is_server:
            index = self.rank - self.num_workers
            self._shard = self.shards[index]
            self._index = index
            self._params = [nn.Parameter(p.detach().clone()) for p in self._shard_params[index]]
            self.optimizer = optimizer_factory(list(self._params))
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer_factory returned {type(self.optimizer).__name__}, not a "
                                f"torch.optim.Optimizer")

    # ---- roles and small helpers -------------------------------------------------

    @property
    def is_server(self) -> bool:
        return self.rank >= self.num_workers

    @property
    def is_worker(self) -> bool:
        return self.rank < self.num_workers

    @property
    def update_staleness_bound(self) -> int:
        """Async: most updates from other workers a gradient can miss, (2s+1)(W-1)."""
        if self.config.mode == "sync":
            return 0
        return (2 * self.config.max_staleness + 1) * (self.num_workers - 1)

    def _require(self, role: str, call: str) -> None:
        if (role == "worker") != self.is_worker:
            fix = "ps.serve()" if self.is_server else "ps.step() / ps.close()"
            raise RuntimeError(f"rank {self.rank} is a {'server' if self.is_server else 'worker'}: {call} is for "
                               f"{role}s; call {fix} here (branch on ps.is_server)")

    def _broadcast_state(self, src: int) -> None:
        """Every rank takes the first server's parameters and buffers (one broadcast per dtype)."""
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        src_global = self.communicator.ranks[src]
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            comm.broadcast(flat, src_global, self.communicator)
            unflatten_into(flat, same)

    def _header(self, kind: int, step: int, a: int = 0, b: int = 0, culprits=()) -> torch.Tensor:
        header = torch.zeros(4 + self.world_size, dtype=torch.int64)
        header[:4] = torch.tensor([kind, step, a, b])
        for rank in culprits:
            header[4 + rank] = 1
        return header

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str, timeout_s=None) -> comm.Message:
        self._bytes_sent += tensor.numel() * tensor.element_size()
        return comm.isend(tensor, group=self._link, tag=tag, group_dst=dst, label=label, timeout_s=timeout_s)

    def _recv(self, tensor: torch.Tensor, src, tag: int, label: str, timeout_s=None) -> comm.Message:
        self._bytes_received += tensor.numel() * tensor.element_size()
        return comm.irecv(tensor, group=self._link, tag=tag, group_src=src, label=label, timeout_s=timeout_s)

    def _wait(self, message: comm.Message, deadline_s: float | None = None) -> int:
        """``message.wait()``; with ``deadline_s`` the wait runs on a helper thread and
        this rank gives up after ``deadline_s`` from the post (CommTimeoutError) while
        gloo still waits: a gloo timeout closes every connection of this rank, after
        which a server could no longer tell the other workers what went wrong."""
        start_s = time.monotonic()
        try:
            if deadline_s is None:
                return message.wait()
            outcome: dict[str, Any] = {}
            done = threading.Event()

            def wait_in_thread():
                try:
                    outcome["peer"] = message.wait()
                except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                    outcome["error"] = error
                finally:
                    done.set()

            threading.Thread(target=wait_in_thread, name=f"plait-ps-wait-rank{self.rank}", daemon=True).start()
            if not done.wait(max(deadline_s - (time.monotonic() - message.start_s), 0.0)):
                peer = "any" if message.peer is None else message.peer
                raise comm.CommTimeoutError(timeout_s=deadline_s, rank=self.rank, collective=message.label,
                                            algorithm="p2p", step="-", peer=peer,
                                            reason=f"nothing arrived within {deadline_s:g}s")
            if "error" in outcome:
                raise outcome["error"]
            return outcome["peer"]
        finally:
            self._wait_time_s += time.monotonic() - start_s

    def _recv_push(self, tensor: torch.Tensor, src, tag: int, label: str) -> comm.Message:
        """A server's receive from a worker: gloo's own deadline is a late fallback
        (see :meth:`_wait`); :meth:`_guarded_wait` enforces ``self.timeout_s``."""
        return self._recv(tensor, src, tag, label, GLOO_FALLBACK_FACTOR * self.timeout_s)

    def _payload_buffers(self, index: int):
        """(payload object or None, its tensors in wire order) to receive a push into."""
        shard = self.shards[index]
        if self.compression is None:
            flat = torch.empty(shard.numel, dtype=self.dtype)
            return flat, [flat]
        payload = self.compression.empty_payload(shard.numel, self.dtype)
        return payload, [payload.tensors[name] for name in sorted(payload.tensors)]

    def stats(self) -> ParameterServerStats:
        return ParameterServerStats(
            role="server" if self.is_server else "worker", rank=self.rank, mode=self.config.mode,
            pushes=self._pushes, updates=self._updates, bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received, wait_time_s=self._wait_time_s,
            max_steps_ahead=self._max_steps_ahead, max_update_staleness=self._max_update_staleness,
            push_log=tuple(self._push_log))

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if not self.is_worker or self._closed:
            return
        if exc_type is None:
            self.close()
        elif not isinstance(exc, comm.CommError):  # a comm failure: the servers already know
            self.abort()

    def run(self, train_fn: Callable[[ParameterServer], Any]) -> Any:
        """Servers: ``serve()``; workers: ``train_fn(self)`` then ``close()``. Returns that."""
        with self:
            return self.serve() if self.is_server else train_fn(self)

    # ---- worker side -------------------------------------------------------------

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Push this worker's gradient shards, wait for every server's reply and load
        the returned parameters into the module. One round trip per server."""
        self._require("worker", "step()")
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: step() after close(); build a new ParameterServer to train on")
        step, mode = self._step, self.config.mode
        sends = []
        for index, shard in enumerate(self.shards):
            tensors = self._encode(index, step)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            label = f"parameter-server push of step {step} to server"
            sends.append(self._send(self._header(PUSH, step, shard.numel, nbytes), shard.server, PUSH_TAG, label))
            sends += [self._send(t, shard.server, DATA_TAG + i, label) for i, t in enumerate(tensors)]
        # The server may itself wait timeout_s for the slowest worker before it replies
        # or aborts, so a worker waits twice as long: the abort naming the culprit wins.
        reply_timeout_s = 2 * self.timeout_s
        headers = [self._header(REPLY, 0) for _ in self.shards]
        posted = [self._recv(h, s.server, REPLY_TAG, f"parameter-server reply to step {step} from server",
                             reply_timeout_s) for h, s in zip(headers, self.shards)]
        flats, pulls = [], []
        for header, message, shard in zip(headers, posted, self.shards):
            self._wait(message)
            kind, got_step, a, b = header[:4].tolist()
            if kind == ABORT:
                raise self._aborted(header, shard.server, step)
            if kind != REPLY or got_step != step:
                raise comm.CommError(rank=self.rank, collective="parameter-server pull", algorithm=f"ps-{mode}",
                                     step=step, peer=shard.server,
                                     reason=f"expected the reply to step {step}, got {KIND_NAMES.get(kind, kind)} of "
                                            f"step {got_step}; every worker must build the same ParameterServer")
            self._max_steps_ahead = max(self._max_steps_ahead, b)
            flat = torch.empty(shard.numel, dtype=self.dtype)
            flats.append(flat)
            pulls.append(self._recv(flat, shard.server, DATA_TAG, f"parameter-server pull of step {step} from server",
                                    reply_timeout_s))
        for message in pulls + sends:
            self._wait(message)
        with torch.no_grad():
            for flat, params in zip(flats, self._shard_params):
                unflatten_into(flat, params)
        self._pushes += 1
        self._step += 1

    def _encode(self, index: int, step: int) -> list[torch.Tensor]:
        params = self._shard_params[index]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                          for p in params])
        if self.compression is None:
            return [flat]
        payload = self.compression.compress(flat, rank=self.rank, step=step, key=index)
        _, expected = self._payload_buffers(index)
        tensors = [payload.tensors[name].contiguous() for name in sorted(payload.tensors)]
        shapes = [(tuple(t.shape), t.dtype) for t in tensors]
        if shapes != [(tuple(t.shape), t.dtype) for t in expected]:
            raise ValueError(f"{self.compression.describe()} produced payload tensors {shapes} but its "
                             f"empty_payload() gives {[(tuple(t.shape), t.dtype) for t in expected]}; the parameter "
                             f"server needs payloads whose layout depends only on (numel, dtype)")
        return tensors

    def _aborted(self, header: torch.Tensor, server: int, step: int) -> comm.CommError:
        _, _, reason, timeout_ms = header[:4].tolist()
        culprits = [rank for rank in range(self.world_size) if header[4 + rank]]
        what = REASONS.get(reason, "failed").format(timeout_s=timeout_ms / 1000)
        names = ", ".join(map(str, culprits))
        return comm.CommError(rank=self.rank, collective="parameter-server pull", algorithm=f"ps-{self.config.mode}",
                              step=step, peer=names,
                              reason=f"server rank {server} gave up: worker rank {names} {what}")

    def close(self) -> None:
        """Tell every server this worker is done (servers return from ``serve()`` once
        all workers closed). Idempotent."""
        self._require("worker", "close()")
        if self._closed:
            return
        self._closed = True
        sends = [self._send(self._header(CLOSE, self._step), s.server, PUSH_TAG,
                            "parameter-server close to server") for s in self.shards]
        for message in sends:
            self._wait(message)

    def abort(self) -> None:
        """Best effort: tell the servers this worker failed, so they stop at once and
        name it to the other workers instead of waiting out the deadline."""
        self._closed = True
        for shard in self.shards:
            try:
                self._wait(self._send(self._header(ABORT, self._step, RAISED), shard.server, PUSH_TAG,
                                      "parameter-server abort to server", min(self.timeout_s, 5.0)))
            except comm.CommError:
                pass


def _check_compression(compression) -> None:
    if compression is None:
        return
    if isinstance(compression, PowerSGD):
        raise ValueError(
            f"compression={compression.describe()} cannot run on a parameter server: PowerSGD needs two "
            f"all-reduce rounds over the workers' low-rank factors, which push/pull cannot express; use "
            f"plait.parallel.DataParallel(..., compression=PowerSGD(...)) for PowerSGD, or a PayloadCompressor "
            f"(FP16, TopK, ErrorFeedback(TopK(...)), QSGD, Sign) here")
    if not isinstance(compression, PayloadCompressor):
        raise TypeError(f"compression must be a plait.compress PayloadCompressor (FP16, TopK, ErrorFeedback(...), "
                        f"...) or None, got {compression!r}")
