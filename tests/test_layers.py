"""DESIGN.md section 2's layer rules, read from every module's imports (ast, no import).

Each import (top-level or inside a function; relative ones resolved) is checked:
(a) cost/ and plan/ never import torch.distributed; (b) comm/ never imports the layers
above it; (c) dependencies point down; (d) imports sit at module top unless allow-listed."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# DESIGN.md section 2 / CONTRIBUTING.md: cli -> train | bench -> plan -> models -> parallel ->
# memory -> compress -> comm -> cost. train and bench are peers (neither imports the other); models
# (GPT at any tp) is built from parallel.tensor, so it sits above parallel.
RANK = {"__main__": 9, "cli": 8, "train": 7, "bench": 7, "plan": 6, "testbed": 6, "graph": 6, "models": 5,
        "parallel": 4, "memory": 3.5, "compress": 3, "comm": 2, "cost": 1, "testing": 0,
        "errors": -1,  # plait.errors: the user-error base class, torch-free, below every layer
        "files": -1,  # plait.files: reading a user's small file (regular, bounded), torch-free, below every layer
        "names": -2}  # plait.names: the shared vocabulary (DESIGN.md 2), torch-free, imports nothing of plait
# the root package (plait.__version__) is a leaf anyone may import
ROOT = "plait"

# (importer, imported module prefix): why an upward or sideways dependency is allowed
LAYER_EXCEPTIONS = {
    # DESIGN.md: "the pipeline schedules are plain data that plan/ may import"
    ("plait.plan", "plait.parallel.pipeline.schedules"): "schedules are plain data (DESIGN.md 2)",
    ("plait.plan", "plait.parallel.pipeline"): "package of the schedules; lazy __getattr__, no torch",
    ("plait.plan", "plait.parallel"): "package of the schedules; lazy __getattr__, no torch",
    # VIOLATION of the docs (train | bench are peers), kept: bench dp reuses train's digits data
    ("plait.bench.dp", "plait.train.data"): "bench dp trains on plait train's digits data set",
    # VIOLATION of the docs (train | bench are peers), kept: one definition of the peak resident set
    ("plait.bench.memory_peers", "plait.train.memory"): "peak resident set read as plait train's report reads it",
    ("plait.bench.zero", "plait.train.memory"): "peak resident set read as plait train's report reads it",
}

# (module, imported module prefix): why this import stays inside a function
LOCAL_ALLOWED = {
    # plait plan --auto (issue 35): `plait plan --help` and a refused flag load no torch
    ("plait.cli.plan_auto", "torch"): "only when --auto plans (the factory's inputs, --model hf:)",
    ("plait.cli.plan_auto", "plait.cli.factory"): "a --module factory loads torch; only when --auto plans one",
    ("plait.cli.plan_auto", "plait.train"): "hf_model loads torch and transformers; only for --auto --model hf:",
    ("plait.cli.plan_auto", "plait.plan.auto.planner"): "traces with torch.export; only when --auto plans",
    ("plait.cli.train", "plait.cli.factory"): "a --plan run builds the plan's model factory (torch and the user's module); only for --plan",
    ("plait.plan.trace", "torch"): "keeps torch out of plait.plan's import path (plan runs anywhere, fast)",
    ("plait.plan.trace", "plait.models.gpt_layers"): "loads torch; keeps it out of plait.plan's import path",
    ("plait.plan.device", "torch"): "keeps torch out of plait.plan's import path",
    ("plait.plan.tp_trace", "torch"): "keeps torch out of plait.plan's import path (plan runs anywhere, fast)",
    ("plait.plan.tp_plan", "torch"): "keeps torch out of plait.plan's import path (plan runs anywhere, fast)",
    ("plait.plan.device", "numpy"): "inside a guarded block of the CPU measurement",
    ("plait.cost.topology_io", "tomli_w"): "optional dependency, only to write TOML",
    ("plait.train.data", "sklearn"): "optional heavy dependency, only for the digits data set",
    ("plait.train.export", "safetensors"): "optional dependency, only for safetensors export",
    # the hf extra (transformers, tokenizers, datasets, tensorboard) loads only where it is used:
    ("plait.train.export_hf", "transformers"): "optional hf extra, only an HF export needs it",
    ("plait.train.export_hf", "safetensors"): "optional dependency, only for the HF export",
    ("plait.train.tensorboard_log", "torch.utils.tensorboard"): "optional tensorboard, only with --log tensorboard",
    ("plait.train.tensorboard_log", "tensorboard"): "optional hf extra, only readers of event files",
    ("plait.train.text_sources", "datasets"): "optional hf extra (~1 s import), only for Parquet/Arrow files",
    ("plait.train.text_sources", "pyarrow"): "datasets' own dependency, only for Arrow IPC files",
    ("plait.train.tokenizer", "transformers"): "optional hf extra (~3 s import), only for an AutoTokenizer directory",
    ("plait.train.hf_model", "transformers"): "optional hf extra, seconds to import; only with --model hf:",
    ("plait.train.hf_generate", "transformers"): "optional hf extra; only for an hf run's closing sample",
    ("plait.train.hf_layout", "transformers"): "optional hf extra; only when an hf model is laid out",
    ("plait.train.build", "plait.train.text_data"): "imports tokenizers; only with --tokenizer",
    ("plait.bench.hf", "transformers"): "optional hf extra, seconds to import; only the ranks that build the model",
    ("plait.train.agent", "torch.distributed"): "agent helpers are imported by the CLI before torch is needed",
    ("plait.train.agent", "plait.train.lifeline"): "inside a conditional branch",
    ("plait.testing.worker", "torch"): "the worker imports torch only in the spawned child, after setting threads",
    ("plait.parallel.mesh", "torch.distributed"): "plait.parallel stays importable without torch.distributed",
    ("plait.parallel.data.data_parallel", "plait.compress"): "inside a conditional branch (compressor given as a spec)",
    ("plait.parallel.hybrid", "plait.compress"): "inside a conditional branch (compression on)",
    ("plait.compress.feedback", "plait.compress.powersgd"): "inside a conditional branch (PowerSGD's own feedback)",
    # `plait --help` and a refused flag must not load torch, matplotlib or the layers that do:
    ("plait.cli.bench", "plait.bench.predict"): "loads the cost model's predictions only for --predict",
    ("plait.cli.bench", "plait.bench"): "the benchmark modules load torch; only when a benchmark runs",
    ("plait.cli.bench_dp", "matplotlib"): "optional heavy dependency, only for the plot",
    ("plait.cli.bench_fold", "plait.bench"): "the FoldedCNN benchmark loads torch; only when it runs",
    ("plait.cli.plan", "plait.train"): "train's config and corpus load torch; only for --model plait (this machine)",
    ("plait.cli.plan_model", "plait.cli.factory"): "a --module factory loads torch; only when one is given",
    ("plait.cli.plan_model", "plait.train"): "hf_model loads torch and transformers; only for --model hf:",
    ("plait.cli.plan_model", "torch"): "only for --module / --model hf: (traced under FakeTensorMode)",
    ("plait.cli.plan_model", "transformers"): "optional hf extra, seconds to import; only for --model hf:",
    ("plait.cli.plan_model", "plait.parallel"): "plan_for loads torch.distributed; only without --tp-plan",
    ("plait.cli.simulate", "matplotlib"): "optional heavy dependency, only for the plot",
    ("plait.cli.simulate", "plait.cost.profile"): "only when --profile names one",
    ("plait.cli.train", "plait.train"): "the launcher's checks and the loop load torch; only once flags are valid",
    ("plait.cli.train", "plait.cli.comm_config"): "reads PLAIT_COMM_* into a CommConfig (loads comm/torch) per run",
    ("plait.cli.train", "torch"): "only in the rank process and for sampling",
    ("plait.bench.report", "matplotlib"): "optional heavy dependency, only for plots",
    ("plait.bench.memory", "matplotlib"): "optional heavy dependency, only for the frontier PNG",
    ("plait.bench.zero", "torch.distributed.device_mesh"): "FSDP2's mesh loads only when an FSDP2 variant runs",
    ("plait.bench.zero", "torch.distributed.fsdp"): "FSDP2 loads only when an FSDP2 variant runs",
    ("plait.bench.collectives", "plait.comm"): "inside conditional branches (tuner profile, --check module)",
    ("plait.bench.dp", "plait.compress"): "inside a conditional branch (compressor spec)",
    ("plait.parallel.pipeline.draw", "matplotlib"): "optional heavy dependency, only for PNG Gantt charts",
    ("plait.train.report", "matplotlib"): "optional heavy dependency, only for plots",
    ("plait.train.budget", "plait.parallel.pipeline.partition"): "loads torch; budget is checked before any process",
    ("plait.train.config_rules", "plait.comm"): "comm loads torch; TrainConfig parses flags without it",
    ("plait.train.config_rules", "plait.compress"): "compress loads torch; TrainConfig parses flags without it",
    ("plait.train.loop", "plait.train.progress"): "inside a branch: the progress line on rank 0 only",
    ("plait.train.loop", "plait.comm.tuner"): "inside a branch: a tuner only when a profile is given",
    ("plait.train.loop", "plait.cost.profile"): "inside a branch: a tuner only when a profile is given",
    ("plait.train.build", "plait.models.gpt"): "inside a branch per model kind (GPT or MLP)",
    ("plait.train.build", "plait.parallel.pipeline"): "inside a branch: pipeline stages only when pp > 1",
    ("plait.train.build", "plait.parallel.tensor"): "inside a branch: tensor-parallel groups only when tp > 1",
    ("plait.train.build", "plait.train.corpus"): "inside a branch per data kind (corpus or digits)",
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    lineno: int
    local: bool


def _module_name(path: Path) -> tuple[str, list[str]]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), parts
    return ".".join(parts), parts[:-1]


def _is_module(name: str) -> bool:
    base = SRC.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def collect_imports(source: str, module: str, package: list[str]) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(module, alias.name, child.lineno, local) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                found.append(Import(module, target, child.lineno, local))
                for alias in child.names:  # `from torch import distributed`, `from plait.train import loop`
                    sub = f"{target}.{alias.name}"
                    if sub == "torch.distributed" or (sub.startswith("plait.") and _is_module(sub)):
                        found.append(Import(module, sub, child.lineno, local))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def all_imports() -> list[Import]:
    imports = []
    for path in sorted((SRC / "plait").rglob("*.py")):
        module, package = _module_name(path)
        imports.extend(collect_imports(path.read_text(), module, package))
    return imports


def _within(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == ROOT else None


def _allowed(table: dict, imp: Import) -> bool:
    return any(_within(imp.importer, who) and _within(imp.target, what) for who, what in table)


def _where(imp: Import) -> str:
    return f"{imp.importer}:{imp.lineno} imports {imp.target}"


def test_imports_are_found():
    imports = all_imports()
    assert any(i.importer == "plait.cli.main" and i.target == "plait" for i in imports)
    assert any(i.local for i in imports)
    # relative imports resolve against the package
    found = collect_imports("from .b import c\nfrom .. import d\n", "plait.x.a", ["plait", "x"])
    assert [i.target for i in found][:1] == ["plait.x.b"] and "plait" in [i.target for i in found]


def test_cost_and_plan_never_import_torch_distributed():
    bad = [_where(i) for i in all_imports()
           if _layer(i.importer) in ("cost", "plan") and _within(i.target, "torch.distributed")]
    assert not bad, bad


def test_names_is_torch_free_and_imports_no_layer():
    """DESIGN.md 2: the vocabulary every layer shares is torch-free and depends on nothing."""
    bad = [_where(i) for i in all_imports() if _layer(i.importer) == "names"
           and (_within(i.target, "torch") or (_layer(i.target) not in (None, "names") and i.target != ROOT))]
    assert not bad, bad


def test_comm_never_imports_layers_above_it():
    above = ("parallel", "compress", "train", "bench", "cli", "plan", "models")
    bad = [_where(i) for i in all_imports()
           if _layer(i.importer) == "comm" and _layer(i.target) in above]
    assert not bad, bad


def test_dependencies_point_down():
    bad = []
    for imp in all_imports():
        src, dst = _layer(imp.importer), _layer(imp.target)
        if src is None or dst is None or src == dst or imp.target in (ROOT, f"{ROOT}.__version__"):
            continue
        assert src in RANK and dst in RANK, f"{_where(imp)}: add the layer to RANK"
        if RANK[dst] >= RANK[src] and not _allowed(LAYER_EXCEPTIONS, imp):
            bad.append(f"{_where(imp)} ({src} -> {dst} does not point down)")
    assert not bad, "\n".join(bad)


# DESIGN.md 2's parallel/: one package a concept, each below the ones that build on it
PARALLEL_RANK = {"hybrid": 3, "pipeline": 2, "zero": 2, "ps": 2, "data": 1, "tensor": 1, "mesh": 0, "arguments": 0, "step_times": 0}


def test_parallel_concepts_depend_downwards():
    """Inside plait.parallel: hybrid builds on the rest; pipeline uses tensor; zero and ps use
    data's pieces; nothing below imports what is above it, and no two concepts import each other."""
    bad = []
    for imp in all_imports():
        src, dst = imp.importer.split("."), imp.target.split(".")
        if src[:2] != [ROOT, "parallel"] or dst[:2] != [ROOT, "parallel"] or len(src) < 3 or len(dst) < 3:
            continue
        if src[2] == dst[2]:
            continue
        assert src[2] in PARALLEL_RANK and dst[2] in PARALLEL_RANK, f"{_where(imp)}: add the concept to PARALLEL_RANK"
        if PARALLEL_RANK[dst[2]] >= PARALLEL_RANK[src[2]]:
            bad.append(f"{_where(imp)} (parallel.{src[2]} -> parallel.{dst[2]} does not point down)")
    assert not bad, "\n".join(bad)


def test_imports_are_at_module_top():
    bad = [_where(i) for i in all_imports() if i.local and not _allowed(LOCAL_ALLOWED, i)]
    assert not bad, "function-local imports (move to the top or allow-list with a reason):\n" + "\n".join(bad)


def test_every_allow_list_entry_is_used():
    imports = all_imports()
    for table in (LAYER_EXCEPTIONS, LOCAL_ALLOWED):
        for who, what in table:
            assert any(_within(i.importer, who) and _within(i.target, what) for i in imports), (who, what)
