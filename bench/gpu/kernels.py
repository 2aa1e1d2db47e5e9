"""Measure one device's kernels for the planner's compute model (``plait.plan.device_profile``).

    python bench/gpu/kernels.py --out kernels.json            # on a GPU (about a minute)
    python bench/gpu/kernels.py --device cpu --quick --out k.json   # a smoke run on a CPU

What is timed (CUDA events around a loop of launches, after warm-up; the median of
five repeats; inputs rotated among several buffer sets when one set fits in L2, so the
cache does not flatter small shapes):

- matmul: the GEMMs of a transformer layer, forward and backward, in bf16: for hidden
  h, tensor-parallel degree t and tokens T = micro-batch x sequence, QKV (T, 3h/t, h),
  projection (T, h, h/t), MLP up (T, 4h/t, h) and down (T, h, 4h/t) as (m, n, k) with
  C[m, n] = A[m, k] B[k, n], and each one's input-gradient (m, k, n) and
  weight-gradient (k, n, m) products;
- attention: the batched QK^T and PV products of unfused attention (batch b*a/t,
  head dim 64 and 128), and torch's fused scaled_dot_product_attention beside them;
- memory-bound kernels: copy, add, GELU, LayerNorm (forward and backward), softmax,
  dropout and a fused AdamW step, each with the bytes it must move (inputs read once,
  outputs written once) counted by hand in ``MEMORY_OPS``;
- the per-kernel cost: an empty-ish kernel launched back to back (launch rate), and a
  chain of tiny autograd ops forward and backward (eager dispatch per kernel);
- host <-> device copies, pinned and pageable.

Every figure is written to the JSON; a summary table goes to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import time

import torch
from torch.nn import functional as F

HIDDENS = (1024, 2048, 4096, 8192, 12288, 16384)
TPS = (1, 2, 4, 8)
TOKENS = (2048, 4096, 8192, 16384)
L2_ROTATE_BYTES = 256 << 20  # below this, rotate among buffer sets


class Timer:
    """Seconds per call of ``fn`` (median of ``repeats`` timed loops)."""

    def __init__(self, device: torch.device, repeats: int = 5, loop_s: float = 0.004):
        self.device, self.repeats, self.loop_s = device, repeats, loop_s

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _loop(self, fn, calls: int) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                fn(i)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        begin = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - begin) / calls

    def __call__(self, fn) -> float:
        fn(0)
        self._sync()
        once = max(self._loop(fn, 1), 1e-7)
        calls = max(1, min(2000, int(self.loop_s / once)))
        return statistics.median(self._loop(fn, calls) for _ in range(self.repeats))


def layer_gemms(h: int, t: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of one layer's forward GEMMs and their two backward products."""
    forward = [("qkv", tokens, 3 * h // t, h), ("proj", tokens, h, h // t),
               ("fc1", tokens, 4 * h // t, h), ("fc2", tokens, h, 4 * h // t)]
    shapes = []
    for name, m, n, k in forward:
        shapes += [(name, m, n, k), (name + ".dgrad", m, k, n), (name + ".wgrad", k, n, m)]
    return shapes


def buffer_sets(nbytes: int) -> int:
    return 1 if nbytes >= L2_ROTATE_BYTES else min(8, math.ceil(L2_ROTATE_BYTES / max(nbytes, 1)))


def time_matmuls(timer, device, dtype, grid) -> list[dict]:
    seen, rows = set(), []
    for h, t, tokens in grid:
        for name, m, n, k in layer_gemms(h, t, tokens):
            if (m, n, k) in seen:
                continue
            seen.add((m, n, k))
            element = torch.tensor([], dtype=dtype).element_size()
            sets = buffer_sets(element * (m * k + k * n + m * n))
            a = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(sets)]
            b = [torch.randn(k, n, device=device, dtype=dtype) for _ in range(sets)]
            c = [torch.empty(m, n, device=device, dtype=dtype) for _ in range(sets)]
            seconds = timer(lambda i: torch.mm(a[i % sets], b[i % sets], out=c[i % sets]))
            flops = 2.0 * m * n * k
            rows.append({"op": name.split(".")[0] + ("" if "." not in name else "." + name.split(".")[1]),
                         "hidden": h, "tp": t, "tokens": tokens, "m": m, "n": n, "k": k, "dtype": str(dtype),
                         "flops": flops, "seconds": seconds, "tflops": flops / seconds / 1e12})
            del a, b, c
    return rows


def time_attention(timer, device, dtype, cases) -> list[dict]:
    rows = []
    for batch_heads, seq, head_dim in cases:
        q = torch.randn(batch_heads, seq, head_dim, device=device, dtype=dtype)
        k = torch.randn(batch_heads, seq, head_dim, device=device, dtype=dtype)
        v = torch.randn(batch_heads, seq, head_dim, device=device, dtype=dtype)
        scores = torch.empty(batch_heads, seq, seq, device=device, dtype=dtype)
        out = torch.empty(batch_heads, seq, head_dim, device=device, dtype=dtype)
        flops = 2.0 * batch_heads * seq * seq * head_dim
        qk = timer(lambda i: torch.bmm(q, k.transpose(1, 2), out=scores))
        pv = timer(lambda i: torch.bmm(scores, v, out=out))
        q4, k4, v4 = (x.view(1, batch_heads, seq, head_dim) for x in (q, k, v))
        fused = timer(lambda i: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True))
        rows += [{"op": "bmm.qk", "batch": batch_heads, "m": seq, "n": seq, "k": head_dim, "flops": flops,
                  "seconds": qk, "tflops": flops / qk / 1e12},
                 {"op": "bmm.pv", "batch": batch_heads, "m": seq, "n": head_dim, "k": seq, "flops": flops,
                  "seconds": pv, "tflops": flops / pv / 1e12},
                 # causal: half the two products' FLOPs are needed
                 {"op": "sdpa.causal", "batch": batch_heads, "m": seq, "n": seq, "k": head_dim, "flops": flops,
                  "seconds": fused, "tflops": flops / fused / 1e12}]
        del q, k, v, scores, out
    return rows


def memory_ops(device, dtype, numel: int, row: int = 4096):
    """(name, bytes moved, fn(i)) for each memory-bound kernel at ``numel`` elements."""
    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(numel, device=device, dtype=dtype)
    y = torch.randn(numel, device=device, dtype=dtype)
    out = torch.empty_like(x)
    rows2d = x.view(-1, row)
    weight = torch.ones(row, device=device, dtype=dtype)
    bias = torch.zeros(row, device=device, dtype=dtype)
    ln_in = rows2d.clone().requires_grad_(True)
    ln_out = F.layer_norm(ln_in, (row,), weight, bias)
    grad = torch.randn_like(ln_out)
    params = [torch.randn(numel // 4, device=device, dtype=torch.float32, requires_grad=True)]
    params[0].grad = torch.randn_like(params[0])
    fused = device.type == "cuda"
    adamw = torch.optim.AdamW(params, lr=1e-4, fused=fused) if fused else torch.optim.AdamW(params, lr=1e-4)
    adamw.step()  # creates the state
    return [
        ("copy", 2 * e * numel, lambda i: out.copy_(x)),
        ("add", 3 * e * numel, lambda i: torch.add(x, y, out=out)),
        ("gelu", 2 * e * numel, lambda i: F.gelu(x)),
        ("layernorm", 2 * e * numel, lambda i: F.layer_norm(rows2d, (row,), weight, bias)),
        ("layernorm.backward", 3 * e * numel,
         lambda i: torch.autograd.grad(ln_out, ln_in, grad, retain_graph=True)),
        ("softmax", 2 * e * numel, lambda i: torch.softmax(rows2d, dim=-1)),
        ("dropout", (2 * e + 1) * numel, lambda i: F.dropout(x, 0.1, training=True)),
        # fp32 AdamW: reads param, grad, exp_avg, exp_avg_sq; writes param and both moments
        ("adamw", 28 * (numel // 4), lambda i: adamw.step()),
    ]


def time_memory(timer, device, dtype, sizes) -> list[dict]:
    rows = []
    for numel in sizes:
        for name, nbytes, fn in memory_ops(device, dtype, numel):
            seconds = timer(fn)
            rows.append({"op": name, "numel": numel, "bytes": nbytes, "seconds": seconds,
                         "gbps": nbytes / seconds / 1e9})
    return rows


def time_launch(timer, device) -> dict:
    tiny = torch.ones(1, device=device)
    chain = 64

    def launches(_):
        for _ in range(chain):
            tiny.add_(0.0)

    leaf = torch.ones(8, device=device, requires_grad=True)

    def autograd_chain(_):
        z = leaf
        for _ in range(chain):
            z = z * 1.0001
        z.sum().backward()

    timer_host = Timer(torch.device("cpu"), timer.repeats)  # host time: includes dispatch

    def host_timed(fn):
        def call(i):
            fn(i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return timer_host(call)

    return {"kernel_s": timer(launches) / chain,  # device time between back-to-back launches
            "dispatch_s": host_timed(launches) / chain,  # host time per eager op, synchronized per chain
            "eager_autograd_kernel_s": host_timed(autograd_chain) / (3 * chain)}


def time_copies(device, sizes_bytes, repeats: int = 5) -> list[dict]:
    if device.type != "cuda":
        return []
    rows = []
    for nbytes in sizes_bytes:
        numel = nbytes // 4
        gpu = torch.empty(numel, device=device)
        for pinned in (True, False):
            host = torch.empty(numel, pin_memory=pinned)
            for kind, fn in (("h2d", lambda: gpu.copy_(host, non_blocking=pinned)),
                             ("d2h", lambda: host.copy_(gpu, non_blocking=pinned))):
                fn()
                torch.cuda.synchronize(device)
                times = []
                for _ in range(repeats):
                    begin = time.perf_counter()
                    fn()
                    torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - begin)
                seconds = statistics.median(times)
                rows.append({"kind": kind, "pinned": pinned, "bytes": nbytes, "seconds": seconds,
                             "gbps": nbytes / seconds / 1e9})
        del gpu, host
    return rows


def device_facts(device) -> dict:
    facts = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(name=props.name, multiprocessors=props.multi_processor_count,
                     memory_bytes=props.total_memory, cuda=torch.version.cuda)
        try:
            facts["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit",
                 "--format=csv"], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            facts["nvidia_smi"] = f"unavailable: {error}"
    return facts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    timer = Timer(device)
    started = time.perf_counter()
    if args.quick:
        grid = [(256, 1, 256), (256, 2, 512)]
        attention = [(4, 256, 32)]
        sizes = [1 << 16, 1 << 18]
        copies = [1 << 20]
    else:
        grid = list(itertools.product(HIDDENS, TPS, TOKENS))
        attention = [(bh, s, d) for bh in (8, 32, 96) for s in (1024, 2048, 4096) for d in (64, 128)]
        sizes = [1 << 16, 1 << 20, 1 << 24, 1 << 27]
        copies = [1 << 20, 16 << 20, 256 << 20, 1 << 30]
    result = {"facts": device_facts(device), "dtype": str(dtype)}
    for key, measure in (("launch", lambda: time_launch(timer, device)),
                         ("memory", lambda: time_memory(timer, device, dtype, sizes)),
                         ("copies", lambda: time_copies(device, copies)),
                         ("attention", lambda: time_attention(timer, device, dtype, attention)),
                         ("matmul", lambda: time_matmuls(timer, device, dtype, grid))):
        begin = time.perf_counter()
        result[key] = measure()
        result.setdefault("seconds", {})[key] = time.perf_counter() - begin
        with open(args.out, "w") as handle:  # what is measured so far survives a later failure
            json.dump(result, handle, indent=1)
        print(f"{key}: {time.perf_counter() - begin:.1f} s", flush=True)
    print(f"kernels: {len(result['matmul'])} GEMM shapes, {len(result['attention'])} attention rows, "
          f"{len(result['memory'])} memory rows in {time.perf_counter() - started:.0f} s")
    best = max(result["matmul"], key=lambda r: r["tflops"])
    print(f"best GEMM {best['m']}x{best['n']}x{best['k']}: {best['tflops']:.1f} TFLOP/s; launch "
          f"{result['launch']['kernel_s'] * 1e6:.2f} us, eager autograd "
          f"{result['launch']['eager_autograd_kernel_s'] * 1e6:.2f} us per kernel")
    for row in result["memory"][-8:]:
        print(f"  {row['op']:<20} {row['numel']:>10} el {row['gbps']:8.1f} GB/s")
    for row in result["copies"]:
        print(f"  {row['kind']} {'pinned' if row['pinned'] else 'pageable'} {row['bytes'] >> 20} MiB "
              f"{row['gbps']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
