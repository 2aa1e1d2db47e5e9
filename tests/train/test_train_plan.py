"""plait train --plan FILE: a plan saved by the auto planner runs on its mesh's processes
and trains exactly like one process.

The plan is the planner's own (a memory limit of 60% of the replicated plan's makes it
shard the wide MLP Megatron's way: column then row on the 2-device mesh); the reference
is written here from plain torch: the factory's model, the same synthetic batches,
AdamW (decay on matrices only), torch's clip_grad_norm_, plait's LR schedule. float64:
the sharded run differs only in the order of the row-parallel partial sums and of the
gradient norm's terms, ~1e-16 relative per step; four steps of AdamW keep it far below
the stated 1e-10.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from plait.cli.main import main
from plait.plan.auto.plan_file import save_plan
from plait.plan.auto.planner import auto_plan
from plait.plan.cluster import cluster_preset
from plait.testing import run_distributed
from plait.train import auto_run
from plait.train.build import make_optimizer
from plait.train.config import TrainConfig
from tests.train import runs

TOLERANCE = 1e-10  # float64, four steps (module docstring)
FACTORY = "tests.train.test_train_plan:factory"


class _WideMLP(nn.Module):
    """x + down(relu(up(x))), then a head and the cross-entropy against y."""

    def __init__(self, width=16, inner=256, classes=4):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(width, inner), nn.Linear(inner, width), nn.Linear(width, classes)

    def forward(self, x, y):
        x = x + self.down(torch.relu(self.up(x)))
        return nn.functional.cross_entropy(self.head(x), y)


def factory():
    """The plan's model factory: (module, example_inputs), float64, seeded."""
    torch.manual_seed(0)
    return _WideMLP().double(), (torch.randn(4, 16, dtype=torch.float64), torch.randint(0, 4, (4,)))


def _save_megatron_plan(path: Path) -> Path:
    model, inputs = factory()
    cluster = cluster_preset("dgx-a100", gpus=2)
    free = auto_plan(model, inputs, cluster, mesh_shapes=[(2,)], dtype="float32")
    plan = auto_plan(model, inputs, cluster, mesh_shapes=[(2,)], dtype="float32",
                     memory_limit_bytes=0.6 * free.cost.memory_bytes)
    assert plan.choice["linear"].name == "column@0" and plan.choice["linear_1"].name == "row@0"
    return save_plan(plan, path, source=FACTORY, input_shapes=[tuple(t.shape) for t in inputs])


def _run(rank, world_size, config, plan_path):
    """A plait.testing worker: the run one rank of plait train --plan makes."""
    model, inputs = factory()
    return auto_run.train(config, auto_run.load(plan_path), model, inputs, log=lambda _: None)


def _reference(config: TrainConfig) -> tuple[list[float], list[float]]:
    """(losses, pre-clip gradient norms) of one process."""
    model, inputs = factory()
    optimizer = make_optimizer(model.named_parameters(), config)
    losses, norms = [], []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        optimizer.zero_grad()
        loss = model(*auto_run.synthetic_batch(inputs, config.seed, step))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)))
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, norms


def test_plan_runs_refuse_what_the_plan_fixes(tmp_path, capsys):
    """Flags a plan run does not read, and plans it cannot build, are refused by name."""
    assert auto_run.given_fields_problems(["steps", "lr", "out"]) == []
    (problem,) = auto_run.given_fields_problems(["steps", "dp", "hidden"])
    assert problem.startswith("--dp, --hidden with --plan: the plan and its model factory fix")
    plan = json.loads(_save_megatron_plan(tmp_path / "plan.json").read_text())
    plan["model"]["source"] = None
    (tmp_path / "anonymous.json").write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="names no model source: save it with plait plan --auto --module"):
        auto_run.load(tmp_path / "anonymous.json")
    assert main(["train", "--plan", str(tmp_path / "plan.json"), "--dp", "4"]) != 0  # the CLI refuses it too
    assert "--dp with --plan: the plan and its model factory fix" in capsys.readouterr().err
    assert main(["train", "--plan", str(tmp_path / "plan.json"), "--nprocs", "4"]) != 0
    assert "--nprocs 4 with --plan: the plan's mesh 2 runs on 2 processes" in capsys.readouterr().err
    _, inputs = factory()
    first, again = auto_run.synthetic_batch(inputs, 3, 7), auto_run.synthetic_batch(inputs, 3, 7)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert first[0].dtype == torch.float64 and first[1].dtype == torch.int64
    assert int(first[1].min()) >= int(inputs[1].min()) and int(first[1].max()) <= int(inputs[1].max())


def test_digits_feed_a_plan_whose_inputs_fit_them():
    """--data digits: the digits' global batches when the inputs are (B, 64) features and
    (B,) labels; inputs of other shapes, and data other than digits, refused by name."""
    fitting = (torch.zeros(4, 64, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))
    batch = auto_run.batch_source(TrainConfig(model="mlp", data="digits", dp=1, pp=1), fitting)
    features, labels = batch(3)
    assert features.shape == (4, 64) and features.dtype == torch.float64 and labels.shape == (4,)
    assert 0 <= int(labels.min()) and int(labels.max()) <= 9 and not torch.equal(batch(3)[0], batch(4)[0])
    _, inputs = factory()
    with pytest.raises(ValueError, match=r"--data digits with --plan: the factory's inputs have shapes "
                                         r"\[\(4, 16\), \(4,\)\]"):
        auto_run.batch_source(TrainConfig(model="mlp", data="digits", dp=1, pp=1), inputs)
    with pytest.raises(ValueError, match="--data notes.txt with --plan: a plan run reads synthetic batches"):
        auto_run.batch_source(TrainConfig(data="notes.txt"), inputs)


@pytest.mark.slow
def test_a_saved_plan_trains_like_one_process(tmp_path):
    """The planner's column/row plan on 2 processes: losses and clipped gradient norms
    (the clip engaged) equal one process's; metrics.jsonl and plan-run.json written."""
    plan_path = _save_megatron_plan(tmp_path / "plan.json")
    saved = auto_run.load(plan_path)
    config = auto_run.plan_config(TrainConfig(steps=4, lr=3e-3, warmup_steps=1, grad_clip=0.05, log_interval=1,
                                              out=str(tmp_path / "run"), timeout_s=60.0), saved)
    per_rank = run_distributed(_run, 2, config, str(plan_path), timeout_s=300)
    losses, norms = _reference(config)
    assert per_rank[0] == per_rank[1]  # the loss is replicated
    logged = runs.losses(config.out)
    assert len(logged) == len(losses) == config.steps
    worst = max(abs(a - b) for a, b in zip(logged, losses))
    assert worst <= TOLERANCE, f"max |loss - one process| = {worst:.3g}"
    records = [json.loads(line) for line in (Path(config.out) / "metrics.jsonl").read_text().splitlines()]
    assert all(norm > config.grad_clip for norm in norms)  # every step clipped
    assert [record["grad_norm"] for record in records] == pytest.approx(norms, rel=TOLERANCE, abs=0)
    record = json.loads((Path(config.out) / auto_run.RUN_RECORD).read_text())
    assert record["mesh"] == [2] and record["measured_step_s"] > 0


def test_an_hf_plan_rebuilds_its_causal_lm(tmp_path):
    """A plan of plait plan --auto --model hf:CONFIG names its source and (batch, seq):
    plait train --plan rebuilds the same causal LM with its loss at that shape (seq 6, not
    the config's 8 positions), which re-traces to the plan's graph; a plan without the
    shape is refused by name."""
    from transformers import GPT2Config

    from plait.train.hf_model import causal_lm_step

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8).save_pretrained(tmp_path)
    source = f"hf:{tmp_path}"
    model, inputs = causal_lm_step(str(tmp_path), 6, 4)
    plan = auto_plan(model, inputs, cluster_preset("dgx-a100", gpus=2), mesh_shapes=[(2,)], dtype="float32")
    path = save_plan(plan, tmp_path / "plan.json", source=source, input_shapes=[tuple(t.shape) for t in inputs])
    saved = auto_run.load(path)
    rebuilt, rebuilt_inputs = auto_run.build_model(saved, load_factory=None)
    assert [tuple(t.shape) for t in rebuilt_inputs] == [(4, 6), (4, 6)]
    assert all(torch.equal(a, b) for a, b in zip(rebuilt_inputs, inputs))
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.state_dict().values(), model.state_dict().values()))
    auto_run.traced_step(saved, rebuilt, rebuilt_inputs)  # the plan's node names and kinds: refused if not
    document = json.loads(path.read_text())
    document["model"]["input_shapes"] = []
    (tmp_path / "shapeless.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="records no \\(batch, seq\\) input shape: save it again"):
        auto_run.load(tmp_path / "shapeless.json")
