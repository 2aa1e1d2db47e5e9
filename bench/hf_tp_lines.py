"""The user code lines of tensor parallelism for Hugging Face GPT-2 (issue 34): plait's
ready plan, a plan the user writes, the hand swap into plait's Megatron layers, and
torch's ``parallelize_module``, each run at tp=2 on 2 gloo ranks and judged against
one process.

    .venv/bin/python bench/hf_tp_lines.py [--json FILE]

Each way is a function below holding exactly what a user writes (its imports
included); its lines are counted from this file's source: code lines of the body,
without the docstring, comments or blank lines (a statement wrapped over several lines
counts each line, as a reader sees it). The hand swap is helper A's
``tests/parallel/tensor/hand_swap_gpt2.py`` (the one its parity test runs), counted the
same way, plus its two import lines.

Each runs on HF GPT-2 built from a config (2 layers, width 32, 4 heads, vocabulary 64,
tied head, float64, no dropout; nothing downloaded) on 2 ranks; its logits on a fixed
batch are compared with the unsharded model's in one process (float64: a reordered sum
of 32-64 terms differs by ~1e-16 relative; 1e-10 absolute is the bound). A way that
raises is reported with the exception's type and message as the user sees it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HAND_SWAP_DIR = ROOT / "tests" / "parallel" / "tensor"
TOLERANCE = 1e-10  # float64 logits, see the docstring


# ----------------------------------------------------------------------------- the ways (what a user writes)
def plait_ready_plan(model, group):
    from plait.parallel.tensor import parallelize, plan_for
    parallelize(model, group, plan_for(model))


def plait_written_plan(model, group):
    from plait.parallel.tensor import ColwiseParallel, RowwiseParallel, VocabParallel, parallelize
    from plait.parallel.tensor.plans import GPT2Adapter
    plan = {"transformer.wte": VocabParallel(),
            "transformer.h.*.attn.c_attn": ColwiseParallel(fused=3),  # q|k|v fused: whole heads per rank
            "transformer.h.*.attn.c_proj": RowwiseParallel(),
            "transformer.h.*.mlp.c_fc": ColwiseParallel(),
            "transformer.h.*.mlp.c_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(gather_output=True)}
    parallelize(model, group, plan, adapter=GPT2Adapter())


def torch_parallelize_module(model, group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, {"transformer.h.*.attn.c_attn": ColwiseParallel(),
                                     "transformer.h.*.attn.c_proj": RowwiseParallel(),
                                     "transformer.h.*.mlp.c_fc": ColwiseParallel(),
                                     "transformer.h.*.mlp.c_proj": RowwiseParallel()})


def torch_after_linear_swap(model, group):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in model.transformer.h:  # HF's Conv1D (in, out) into nn.Linear (out, in), then the local heads
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"),
                             (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            conv = getattr(parent, name)
            linear = nn.Linear(conv.nx, conv.nf, dtype=conv.weight.dtype)
            linear.weight.data, linear.bias.data = conv.weight.data.t().contiguous(), conv.bias.data
            setattr(parent, name, linear)
        block.attn.num_heads, block.attn.split_size = block.attn.num_heads // 2, block.attn.split_size // 2
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, {"transformer.h.*.attn.c_attn": ColwiseParallel(),
                                     "transformer.h.*.attn.c_proj": RowwiseParallel(),
                                     "transformer.h.*.mlp.c_fc": ColwiseParallel(),
                                     "transformer.h.*.mlp.c_proj": RowwiseParallel()})


def hand_swap(model, group):
    sys.path.insert(0, str(HAND_SWAP_DIR))  # not a user line: where helper A's file lives
    from hand_swap_gpt2 import hand_swap_gpt2

    hand_swap_gpt2(model, group)


WAYS = {"plait, ready plan (plan_for)": plait_ready_plan,
        "plait, plan written by the user": plait_written_plan,
        "hand swap into plait's Megatron layers": hand_swap,
        "torch parallelize_module": torch_parallelize_module,
        "torch, after swapping Conv1D for nn.Linear": torch_after_linear_swap}


def code_lines(function) -> int:
    """Code lines of ``function``'s body: no def line, docstring, comment or blank line."""
    body = textwrap.dedent("\n".join(inspect.getsource(function).splitlines()[1:]))
    lines = [line for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
    if lines and lines[0].strip().startswith(('"""', "'''")):
        raise ValueError(f"{function.__name__}: the ways are written without docstrings")
    return len(lines)


def user_lines(name: str) -> int:
    if name.startswith("hand swap"):
        sys.path.insert(0, str(HAND_SWAP_DIR))
        from hand_swap_gpt2 import hand_swap_gpt2

        return code_lines(hand_swap_gpt2) + 2  # + its imports: torch, plait.parallel.tensor's layers
    return code_lines(WAYS[name])


# ----------------------------------------------------------------------------- running them
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel  # the hf extra; imported where the ranks need it

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double().eval()


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))


def run_way(rank: int, world_size: int, name: str) -> dict:
    """One way on this rank: its logits against one process's, or its exception."""
    import torch.distributed as dist

    with torch.no_grad():
        reference = gpt2()(batch()).logits
    model = gpt2()
    try:
        WAYS[name](model, dist.group.WORLD)
        with torch.no_grad():
            logits = model(batch()).logits
    except Exception as error:  # noqa: BLE001 - what the user sees is the result
        return {"error": f"{type(error).__name__}: {error}"}
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return {"max_abs_difference": float((logits - reference).abs().max())}


def measure() -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hf_tp_lines  # this file as a module, so the ranks unpickle run_way by name

    from plait.testing import run_distributed, shutdown_pools

    results = []
    try:
        for name in WAYS:
            per_rank = run_distributed(hf_tp_lines.run_way, 2, name, timeout_s=180)
            errors = {result.get("error") for result in per_rank}
            entry = {"way": name, "user_lines": user_lines(name)}
            if errors != {None}:
                entry["error"] = " | ".join(sorted(error for error in errors if error))
            else:
                entry["max_abs_difference"] = max(result["max_abs_difference"] for result in per_rank)
                entry["exact"] = entry["max_abs_difference"] <= TOLERANCE
            results.append(entry)
    finally:
        shutdown_pools()
    return results


def render(results: list[dict]) -> str:
    import transformers

    lines = [f"HF GPT-2 (transformers {transformers.__version__}, torch {torch.__version__}) at tp=2, 2 gloo ranks, "
             f"float64: user code lines and the result against one process (exact: |logits diff| <= {TOLERANCE:g})",
             f"{'way':<44}{'lines':>6}  result"]
    for entry in results:
        if "error" in entry:
            outcome = f"raises {entry['error']}"
        else:
            outcome = (f"{'exact' if entry['exact'] else 'WRONG'} (max |logits diff| "
                       f"{entry['max_abs_difference']:.1e})")
        lines.append(f"{entry['way']:<44}{entry['user_lines']:>6}  {outcome}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    results = measure()
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
