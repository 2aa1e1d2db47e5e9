"""How deep plait's call path is: frames between a public call and the transport.

Traced with a profile hook (``sys.setprofile``) on a real 2-rank gloo run
(``plait.testing.run_fresh_world``), on each rank's calling thread, after warm-up
calls (the communicator, its shared-memory set-up and the schedules exist):

- **all_reduce**: a 1 MiB float32 ``plait.comm.all_reduce(..., algorithm="ring")``
  with the default CommConfig (in-band checks on), from the ``all_reduce`` frame to
  the ring algorithm's first send reaching the transport (``Transport.send``), and on
  to the first byte written into the shared-memory ring (``Ring.write_header``; on a
  gloo-only group, the call into gloo's ``send``);
- **zero3_gather**: a ZeRO stage-3 model's first unit gathered by the unit gatherer's
  pre-forward hook (``UnitGatherer._before_forward``) on a warm step, to the same two
  points.

For each: the plait frames on the stack at that point (``co_filename`` under
``src/plait``), all Python frames from the entry frame down, and the Python calls
made from the entry up to that point (every ``call`` event, torch's included).

    OMP_NUM_THREADS=1 .venv/bin/python bench/frame_depth.py [--stacks]

``--stacks`` also prints the plait frames of each path, outermost first.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import plait
import plait.comm as comm
from plait.testing import run_fresh_world

PLAIT_DIR = os.path.dirname(os.path.abspath(plait.__file__))
TRANSPORT_SEND = ("transport.py", "send")
RING_WRITE = ("shm_ring.py", "write_header")


def _is_plait(code) -> bool:
    return os.path.abspath(code.co_filename).startswith(PLAIT_DIR + os.sep)


def _where(code) -> tuple[str, str]:
    return os.path.basename(code.co_filename), code.co_name


class PathTracer:
    """Profile hook: from the first call of ``entry`` (file, function) on this thread,
    counts Python calls, and records the stack at the first ``Transport.send`` and at
    the first ring write (or gloo send)."""

    def __init__(self, entry: tuple[str, str]):
        self.entry = entry
        self.entry_frame = None
        self.calls = 0
        self.points: dict[str, dict] = {}

    def _stack(self, frame) -> dict:
        frames = []
        while frame is not None:
            frames.append(frame)
            if frame is self.entry_frame:
                break
            frame = frame.f_back
        frames.reverse()
        plait_frames = [f"{_where(f.f_code)[0]}:{f.f_code.co_qualname}" for f in frames if _is_plait(f.f_code)]
        return {"plait_frames": len(plait_frames), "python_frames": len(frames), "python_calls": self.calls,
                "stack": plait_frames}

    def __call__(self, frame, event, arg):
        if self.entry_frame is None:
            if event == "call" and _where(frame.f_code) == self.entry:
                self.entry_frame = frame
                self.calls = 1
            return
        if len(self.points) == 2:
            return
        if event == "call":
            self.calls += 1
            where = _where(frame.f_code)
            if where == TRANSPORT_SEND and "transport" not in self.points:
                self.points["transport"] = self._stack(frame)
            elif where == RING_WRITE and "ring" not in self.points:
                self.points["ring"] = self._stack(frame)
        elif event == "c_call" and "transport" in self.points and "ring" not in self.points:
            if getattr(arg, "__name__", "") == "send" and "ProcessGroup" in repr(getattr(arg, "__self__", "")):
                stack = self._stack(frame)
                stack["plait_frames"] += 0  # the C call itself is not a Python frame
                self.points["ring"] = stack


def _traced(entry, run) -> dict:
    tracer = PathTracer(entry)
    sys.setprofile(tracer)
    try:
        run()
    finally:
        sys.setprofile(None)
    return tracer.points


def all_reduce_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)
    tensor = torch.randn(256 * 1024)  # 1 MiB of float32
    for _ in range(3):  # warm: communicator, shared memory, schedule, scratch
        comm.all_reduce(tensor, algorithm="ring")
    dist.barrier()
    points = _traced(("collectives.py", "all_reduce"), lambda: comm.all_reduce(tensor, algorithm="ring"))
    points["transport_description"] = comm.communicator_for(None).transport.description
    return points


def zero3_rank(rank: int, world_size: int) -> dict:
    from plait.parallel import ZeRO  # noqa: PLC0415 - the script measures both layers; keep comm's run light

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    zero = ZeRO(model, lambda params: torch.optim.SGD(params, lr=0.01), stage=3, algorithm="ring")
    torch.manual_seed(1 + rank)
    batch = torch.randn(8, 256)
    for _ in range(2):  # warm: the units' order is known, schedules cached
        zero(batch).sum().backward()
        zero.step()
    dist.barrier()
    return _traced(("unit_gathering.py", "_before_forward"), lambda: zero(batch).sum().backward())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stacks", action="store_true", help="print the plait frames of each path")
    args = parser.parse_args(argv)
    for name, fn in (("all_reduce 1 MiB ring", all_reduce_rank), ("ZeRO-3 unit gather", zero3_rank)):
        results = run_fresh_world(fn, 2, timeout_s=120.0)
        for rank, points in enumerate(results):
            extra = f" [{points.pop('transport_description')}]" if "transport_description" in points else ""
            for point in ("transport", "ring"):
                found = points.get(point)
                if found is None:
                    print(f"{name} rank {rank}: {point}: not reached")
                    continue
                print(f"{name} rank {rank}{extra}: to {'Transport.send' if point == 'transport' else 'the ring'}: "
                      f"{found['plait_frames']} plait frames, {found['python_frames']} Python frames, "
                      f"{found['python_calls']} Python calls")
                if args.stacks:
                    for line in found["stack"]:
                        print(f"    {line}")


if __name__ == "__main__":
    main()
