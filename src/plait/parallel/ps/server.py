"""The parameter server's server side: the sync and async serving loops, the
deadline guard that names a lost worker, and the averaging and optimiser step
(mixed into ``plait.parallel.ps.worker.ParameterServer``; see its docstring for
the modes and the protocol)."""

from __future__ import annotations

import random

import torch

from plait import comm
from plait.parallel.ps.config import ParameterServerStats, PushRecord
from plait.parallel.ps.protocol import (ABORT, BROKE_PROTOCOL, CLOSE, DATA_TAG, DISCONNECTED, KIND_NAMES, PUSH,
                                        PUSH_TAG, RAISED, REASONS, REPLY, REPLY_TAG, TIMED_OUT)


class ServerLoop:
    """Server-side methods of ParameterServer (uses its state: config, shard, params,
    optimizer, the message helpers)."""

    def serve(self) -> ParameterServerStats:
        """Apply pushes and answer pulls until every worker has closed; return stats."""
        self._require("server", "serve()")
        if self.config.mode == "sync":
            self._serve_sync()
        else:
            self._serve_async()
        return self.stats()

    def server_parameters(self) -> dict[str, torch.Tensor]:
        """This server's shard as it stands (in async mode the final model lives here)."""
        self._require("server", "server_parameters()")
        return {name: p.detach().clone() for name, p in zip(self._shard.names, self._params)}

    def _serve_sync(self) -> None:
        """Per step: pushes in worker-rank order, one averaged optimiser step, W replies."""
        open_workers, step = list(self.worker_ranks), 0
        while open_workers:
            headers = {w: self._header(0, 0) for w in open_workers}
            posted = {w: self._recv_push(headers[w], w, PUSH_TAG, f"parameter-server push of step {step} from worker")
                      for w in open_workers}
            payloads, data, steps = {}, [], {w: step for w in open_workers}
            for worker in open_workers:
                _, kind = self._receive_header(posted[worker], headers[worker], worker, steps, open_workers)
                if kind == PUSH:
                    payloads[worker], tensors = self._payload_buffers(self._index)
                    label = f"parameter-server push of step {step} from worker"
                    data += [(worker, self._recv_push(t, worker, DATA_TAG + i, label)) for i, t in enumerate(tensors)]
                else:  # closed: no reply, no abort
                    open_workers = [w for w in open_workers if w != worker]
            for worker, message in data:
                self._guarded_wait(message, worker, step, open_workers)
            if not payloads:
                break
            self._apply(self._average([payloads[w] for w in open_workers]))
            for worker in open_workers:
                self._record(worker, step, update_staleness=0, steps_ahead=0)
            self._reply(open_workers, {w: step for w in open_workers}, {w: 0 for w in open_workers})
            step += 1

    def _serve_async(self) -> None:
        """Stale synchronous parallel: apply each push alone, withhold replies that
        would put a worker more than max_staleness steps ahead of the slowest."""
        limit = self.config.max_staleness
        rng = None if self.config.order == "arrival" else random.Random(self.config.order)
        clock = {w: 0 for w in self.worker_ranks}  # pushes applied per worker
        pulled_version = {w: 0 for w in self.worker_ranks}
        ahead = {w: 0 for w in self.worker_ranks}
        open_workers, withheld = set(self.worker_ranks), set()
        while open_workers:
            expected = sorted(open_workers - withheld)
            assert expected, "the slowest open worker is never withheld"
            src = expected[rng.randrange(len(expected))] if rng is not None else None
            header = self._header(0, 0)
            message = self._recv_push(header, src, PUSH_TAG, "parameter-server push from worker")
            worker, kind = self._receive_header(message, header, src, clock, sorted(open_workers), expected)
            if kind == PUSH:
                step = clock[worker]
                payload, tensors = self._payload_buffers(self._index)
                for i, t in enumerate(tensors):
                    message = self._recv_push(t, worker, DATA_TAG + i,
                                              f"parameter-server push of step {step} from worker")
                    self._guarded_wait(message, worker, step, sorted(open_workers))
                self._apply(self._decode(payload).div_(self.num_workers))
                self._record(worker, step, self._updates - 1 - pulled_version[worker], ahead[worker])
                clock[worker] += 1
                withheld.add(worker)
            else:
                open_workers.discard(worker)
            if not open_workers:
                break
            slowest = min(clock[w] for w in open_workers)
            released = sorted(w for w in withheld if clock[w] - slowest <= limit)
            for w in released:
                ahead[w] = clock[w] - slowest
                pulled_version[w] = self._updates
                withheld.discard(w)
            if released:
                self._reply(released, {w: clock[w] - 1 for w in released}, ahead)

    def _receive_header(self, message, header, worker, steps, open_workers, expected=None) -> tuple[int, int]:
        """Wait for a worker's header (``worker`` None: any of ``expected``) and check
        it against ``steps`` (worker -> the step the server expects); (sender, kind)."""
        step = steps[worker] if worker is not None else None
        worker = self._guarded_wait(message, worker, step, open_workers, culprits=expected)
        kind, got_step, numel = header[:3].tolist()
        mode = f"ps-{self.config.mode}"
        if kind == ABORT:
            self._abort_workers(open_workers, [worker], RAISED, got_step)
            raise comm.CommError(rank=self.rank, collective="parameter-server push", algorithm=mode,
                                 step=got_step, peer=worker, reason=f"worker rank {worker} {REASONS[RAISED]}")
        problem = None
        if expected is not None and worker not in expected:
            problem = f"worker {worker} sent a {KIND_NAMES.get(kind, kind)} while its reply was withheld"
        elif kind == PUSH and numel != self._shard.numel:
            problem = f"it pushed {numel} elements but this server's shard holds {self._shard.numel}"
        elif kind == PUSH and got_step != steps[worker]:
            problem = f"it pushed step {got_step} while the server expected step {steps[worker]}"
        elif kind not in (PUSH, CLOSE):
            problem = f"unexpected message kind {kind}"
        if problem:
            self._abort_workers(open_workers, [worker], BROKE_PROTOCOL, got_step)
            raise comm.CommError(rank=self.rank, collective="parameter-server push", algorithm=mode,
                                 step=got_step, peer=worker, reason=problem + "; every rank must build the same "
                                 "model and ParameterServer")
        return worker, kind

    def _guarded_wait(self, message, worker, step, open_workers, culprits=None) -> int:
        """Wait for a worker's message; on failure tell the other workers who failed, then raise."""
        try:
            return self._wait(message, self.timeout_s)
        except comm.CommError as error:
            culprits = [worker] if worker is not None else list(culprits or open_workers)
            timed_out = isinstance(error, comm.CommTimeoutError)
            self._abort_workers(open_workers, culprits, TIMED_OUT if timed_out else DISCONNECTED, step)
            names = ", ".join(map(str, culprits))
            kwargs = dict(rank=self.rank, collective="parameter-server push", algorithm=f"ps-{self.config.mode}",
                          step="-" if step is None else step, peer=names,
                          reason=f"no push from worker rank {names}" + ("" if timed_out else f": {error.reason}"))
            if timed_out:
                raise comm.CommTimeoutError(timeout_s=error.timeout_s, **kwargs) from error
            raise comm.CommError(**kwargs) from error

    def _abort_workers(self, open_workers, culprits, reason: int, step) -> None:
        """Best effort ABORT (naming ``culprits``) to every other open worker, bounded by the deadline."""
        header = self._header(ABORT, -1 if step is None else step, reason, int(self.timeout_s * 1000), culprits)
        sends = []
        for worker in open_workers:
            if worker not in culprits:
                try:
                    sends.append(self._send(header, worker, REPLY_TAG, "parameter-server abort to worker"))
                except comm.CommError:
                    pass
        for message in sends:
            try:
                self._wait(message)
            except comm.CommError:
                pass

    def _average(self, payloads: list) -> torch.Tensor:
        """(1/n) sum of the pushes, summed in worker-rank order (deterministic)."""
        if self.compression is not None:
            return self.compression.aggregate(payloads).to(self.dtype)
        total = payloads[0].clone()
        for flat in payloads[1:]:
            total.add_(flat)
        return total.div_(len(payloads))

    def _decode(self, payload) -> torch.Tensor:
        if self.compression is None:
            return payload
        return self.compression.decompress(payload).to(self.dtype).clone()

    def _apply(self, flat_grad: torch.Tensor) -> None:
        """One optimiser step with ``flat_grad`` (numel,) as the shard's gradient."""
        offset = 0
        for param in self._params:
            param.grad = flat_grad[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
        self.optimizer.step()
        self._updates += 1

    def _record(self, worker: int, step: int, update_staleness: int, steps_ahead: int) -> None:
        self._pushes += 1
        self._max_update_staleness = max(self._max_update_staleness, update_staleness)
        self._max_steps_ahead = max(self._max_steps_ahead, steps_ahead)
        self._push_log.append(PushRecord(worker=worker, step=step, version=self._updates - 1,
                                         update_staleness=update_staleness, steps_ahead=steps_ahead))

    def _reply(self, workers, steps, steps_ahead) -> None:
        """Send the shard's current parameters to ``workers`` (header first)."""
        flat = torch.cat([p.detach().reshape(-1) for p in self._params])
        sends = []
        for worker in workers:
            header = self._header(REPLY, steps[worker], self._updates, steps_ahead[worker])
            label = f"parameter-server reply to step {steps[worker]} to worker"
            sends += [self._send(header, worker, REPLY_TAG, label), self._send(flat, worker, DATA_TAG, label)]
        for message in sends:
            self._wait(message)
