"""`plait train`'s configuration: one flat, frozen dataclass, validated as a whole.

Three sources, later wins, judged together once at the end (so a TOML file and a
flag that only make sense in combination are accepted, and every problem of the
combination is reported at once):

    defaults  <  --config FILE (TOML)  <  command-line flags

Every field is a flag ``--field-name`` (``add_config_arguments``) and a TOML key.
The TOML file may be flat (``lr = 1e-3``) or grouped in the tables ``[model]``,
``[data]``, ``[batch]``, ``[parallel]``, ``[optim]`` and ``[run]`` (``[optim]
lr = 1e-3``), or mix both. A key in the wrong table is an error naming its table,
and so is a key set twice. ``model`` and ``data`` are both fields and table names: a
flat ``model = "mlp"`` and a ``[model]`` table cannot share one file (TOML itself
forbids it), so with tables write ``[model] model = "mlp"``.

The batch arithmetic, per optimiser step:

    global_batch = dp · per_rank_batch,  per_rank_batch = microbatches · micro_batch
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from plait.files import read_small_file
from plait.names.axes import DEFAULT_ORDER
from plait.names.precision import FP32, GRAD_REDUCE_DTYPES, PRECISIONS
from plait.names.recompute import RECOMPUTE_MODES
from plait.names.transports import BACKENDS, TRANSPORTS
from plait.names.schedules import ONE_F_ONE_B, PIPELINE_SCHEDULES
from plait.train.config_rules import MODELS, listed, value_problems

HF_PREFIX = "hf:"  # model="hf:CONFIG": a Hugging Face causal LM (plait.train.hf_model); MODELS are plait's own
DTYPES = ("float32", "float64", "bfloat16")
SCHEDULES = PIPELINE_SCHEDULES  # plait.names.schedules: one spelling per schedule
OPTIMIZERS = ("adamw", "sgd")
OFFLOADS = ("none", "optimizer")
LR_SCHEDULES = ("cosine", "linear", "constant")
CHECKPOINT_FORMATS = ("plait", "dcp")  # plait's verified shards always; dcp: torch.distributed.checkpoint too
METRICS_LOGS = ("jsonl", "tensorboard")  # metrics.jsonl always; tensorboard: event files too
TABLES = ("model", "data", "batch", "parallel", "optim", "run")
CLI_GROUP_TITLE = "training config (also settable in --config FILE)"
# a config sets each of TrainConfig's ~60 fields at most once: a few KB. 1 MiB is hundreds of times that and
# still read and parsed in milliseconds; more is not a config (a wrong path, /dev/zero, a data file).
CONFIG_LIMIT_NBYTES = 1 << 20


def _field(default, table: str, help: str, choices: tuple[str, ...] = ()):
    return field(default=default, metadata={"table": table, "help": help, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one `plait train` run needs; defaults are the README's main job
    (a 4-layer GPT on the stdlib character corpus, dp=2 × pp=2 on 4 processes)."""

    # ----- model -----
    model: str = _field("gpt", "model", "model to train: gpt (character LM), mlp (scikit-learn digits) or hf:CONFIG "
                                        "(a Hugging Face causal LM from a local config.json or a directory holding "
                                        "one, with its weights if saved there; nothing is downloaded)")
    layers: int = _field(4, "model", "gpt: transformer blocks")
    hidden: int = _field(128, "model", "gpt: model width h")
    heads: int = _field(4, "model", "gpt: attention heads (must divide hidden)")
    seq_len: int = _field(64, "model", "gpt: context length in tokens")
    ffn_hidden: int = _field(0, "model", "gpt: MLP inner width (0 = 4*hidden)")
    dropout: float = _field(0.0, "model", "gpt: dropout probability in [0, 1)")
    tied_head: bool = _field(False, "model", "gpt: share the token embedding with the output head (pp=1 only)")
    dtype: str = _field("float32", "model", "parameter and activation dtype", DTYPES)
    precision: str = _field(FP32, "model", "fp32, or bf16-mixed / fp16-mixed: 16-bit compute under autocast, "
                                             "fp32 master weights and optimizer state (fp16: dynamic loss scaling)",
                            PRECISIONS)
    recompute: str = _field("none", "model", "gpt: activation recomputation: none, selective (the attention core "
                                             "re-runs in the backward) or full (each block keeps only its input)",
                            RECOMPUTE_MODES)
    offload_activations: bool = _field(False, "model", "move tensors saved for backward to files under "
                                                       "<out>/offload (CPU) or host memory (GPU) during the forward, "
                                                       "read back just before their backward")
    recompute_layers: int = _field(-1, "model", "gpt: recompute only the first K blocks of each pipeline chunk "
                                                "(-1 = all)")
    mlp_hidden: tuple[int, ...] = _field((128, 128, 128), "model", "mlp: hidden widths, comma list e.g. 128,128,128")
    # ----- data -----
    data: str = _field("stdlib", "data", "corpus: stdlib (Python's own sources), digits (mlp), or a text file/dir")
    tokenizer: str = _field("", "data", "hf models: a tokenizer.json, a directory for AutoTokenizer, or "
                                        "train:bpe:VOCAB (a byte-level BPE trained on the training text); empty: "
                                        "characters, as the gpt model reads text")
    text_field: str = _field("text", "data", "JSONL / Parquet / Arrow data: the column holding the text")
    data_max_bytes: int = _field(4_000_000, "data", "read at most this many bytes of text")
    val_fraction: float = _field(0.05, "data", "fraction of the data held out for evaluation, in [0, 1)")
    # ----- batch -----
    global_batch: int = _field(16, "batch", "samples per optimiser step, all dp ranks together")
    micro_batch: int = _field(4, "batch", "samples per pipeline micro-batch on one dp rank")
    # ----- parallel -----
    dp: int = _field(2, "parallel", "data-parallel degree")
    tp: int = _field(1, "parallel", "tensor-parallel degree (gpt only)")
    pp: int = _field(2, "parallel", "pipeline-parallel degree (stages)")
    mesh_order: str = _field(DEFAULT_ORDER, "parallel", "mesh axes innermost (consecutive ranks) first, "
                                                      "a permutation of tp,dp,pp")
    schedule: str = _field(ONE_F_ONE_B, "parallel", "pipeline schedule", SCHEDULES)
    virtual: int = _field(1, "parallel", "model chunks per pipeline rank (interleaved_1f1b only)")
    stage_layers: tuple[int, ...] = _field((), "parallel", "uneven pipeline stages: the layers of each of the pp * "
                                                           "virtual chunks in pipeline order, comma list e.g. 3,1 "
                                                           "(gpt, hf: transformer blocks, the embedding in the first "
                                                           "chunk and the head in the last, as Megatron-LM's "
                                                           "--decoder-first/last-pipeline-num-layers; mlp: linear "
                                                           "layers); empty: balanced (gpt, mlp by parameters, hf by "
                                                           "FLOPs)")
    sequence_parallel: bool = _field(False, "parallel", "gpt: shard LayerNorm/dropout activations along the "
                                                        "sequence across tp ranks")
    grad_reduce_dtype: str = _field("fp32", "parallel", "dtype of the dp gradient all-reduce: fp32, or the "
                                                        "16-bit compute dtype (bf16 / fp16)", GRAD_REDUCE_DTYPES)
    algorithm: str = _field("auto", "parallel", "collective algorithm for gradient all-reduce (auto = cost model)")
    compression: str = _field("none", "parallel", "dp gradient compression spec, e.g. topk:0.01+ef, powersgd:4, none")
    zero_stage: int = _field(0, "parallel", "ZeRO over the dp group: 0 (off), 1 (the optimizer state and its step "
                                            "sharded over the dp ranks), 2 (the gradients too: reduce-scattered "
                                            "inside every micro-batch's backward) or 3 (the parameters too: each "
                                            "block gathered around its forward and backward; pp=1)")
    offload: str = _field("none", "parallel", "optimizer: ZeRO's optimizer state in memory-mapped files under "
                                              "<out>/offload between steps (zero_stage 1-3, CPU)", OFFLOADS)
    # ----- optim -----
    optimizer: str = _field("adamw", "optim", "optimiser", OPTIMIZERS)
    lr: float = _field(3e-3, "optim", "peak learning rate")
    min_lr: float = _field(3e-4, "optim", "learning rate reached at the last step (cosine, linear)")
    lr_schedule: str = _field("cosine", "optim", "decay after warmup", LR_SCHEDULES)
    warmup_steps: int = _field(20, "optim", "linear warmup steps (0 = none)")
    weight_decay: float = _field(0.1, "optim", "decoupled weight decay (adamw) or L2 (sgd)")
    beta1: float = _field(0.9, "optim", "adamw: first-moment decay in [0, 1)")
    beta2: float = _field(0.95, "optim", "adamw: second-moment decay in [0, 1)")
    momentum: float = _field(0.9, "optim", "sgd: momentum in [0, 1)")
    grad_clip: float = _field(1.0, "optim", "clip the global gradient norm to this (0 = off)")
    # ----- run -----
    steps: int = _field(600, "run", "optimiser steps")
    eval_interval: int = _field(50, "run", "evaluate every this many steps (0 = never)")
    eval_batches: int = _field(4, "run", "global batches per evaluation")
    checkpoint_interval: int = _field(100, "run", "checkpoint every this many steps (0 = only at the end)")
    keep_checkpoints: int = _field(3, "run", "newest checkpoints kept on disk (0 = keep all)")
    checkpoint_format: str = _field("plait", "run", "plait (its verified sharded files, always written) or dcp "
                                                    "(also torch.distributed.checkpoint, full tensors, in "
                                                    "<checkpoint>/dcp)", CHECKPOINT_FORMATS)
    log_interval: int = _field(10, "run", "write metrics.jsonl and show progress every this many steps (the "
                                          "steps' losses are averaged over the dp ranks in one collective)")
    log: str = _field("jsonl", "run", "jsonl (metrics.jsonl) or tensorboard (metrics.jsonl and TensorBoard event "
                                      "files under <out>/tensorboard)", METRICS_LOGS)
    seed: int = _field(0, "run", "seed for initialisation, data order and dropout")
    out: str = _field("runs/gpt-small", "run", "run directory: checkpoints, metrics, config")
    timeout_s: float = _field(300.0, "run", "deadline in seconds for any collective or p2p wait")
    backend: str = _field("auto", "run", "process-group backend: auto (nccl with one GPU per process, gloo without "
                                         "GPUs), gloo (on GPUs too: several processes may share a GPU, messages "
                                         "pass through host memory) or nccl", BACKENDS)
    comm_profile: str = _field("", "run", "calibration profile (plait calibrate --output) whose tuner picks "
                                          "algorithm=auto's collectives; empty: the measured default table")
    transport: str = _field("auto", "run", "how messages between ranks on one host travel: auto (plait's shared "
                                           "memory where it can be set up, else gloo, saying why in the report), "
                                           "shm (shared memory or fail) or gloo (its TCP messages); ranks on other "
                                           "hosts always use gloo", TRANSPORTS)

    def __post_init__(self):
        problems = [problem for name in FIELD_NAMES if (problem := _type_problem(name, getattr(self, name)))]
        typed = {name for name in FIELD_NAMES if not _type_problem(name, getattr(self, name))}
        # Canonical forms, so equal configs compare, serialise and digest equal.
        for name in typed:
            value = getattr(self, name)
            if FIELD_KINDS[name] == "float":
                object.__setattr__(self, name, float(value))
            elif FIELD_KINDS[name] == "ints":
                object.__setattr__(self, name, tuple(value))
        if "mesh_order" in typed:
            object.__setattr__(self, "mesh_order", ",".join(part.strip() for part in self.mesh_order.split(",")))
        problems += value_problems(self, typed)
        if problems:
            raise ValueError("invalid TrainConfig:\n" + "\n".join(f"  - {problem}" for problem in problems))

    # ----- derived sizes -----
    @property
    def world_size(self) -> int:
        """Processes the run needs: dp · tp · pp."""
        return self.dp * self.tp * self.pp

    @property
    def per_rank_batch(self) -> int:
        """Samples one dp rank processes per optimiser step: global_batch / dp."""
        return self.global_batch // self.dp

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per step on one dp rank: per_rank_batch / micro_batch."""
        return self.per_rank_batch // self.micro_batch

    @property
    def ffn(self) -> int:
        """The GPT's MLP inner width, ffn_hidden or 4·hidden."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def hf_source(self) -> str | None:
        """CONFIG of model='hf:CONFIG' (a Hugging Face config.json or its directory), else None."""
        return self.model[len(HF_PREFIX):] if self.model.startswith(HF_PREFIX) else None

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axes from innermost to outermost."""
        return tuple(self.mesh_order.split(","))

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the launcher started exactly dp · tp · pp processes."""
        if self.world_size != world_size:
            raise ValueError(f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.world_size} != "
                             f"world_size({world_size}): launch {self.world_size} processes (--nprocs "
                             f"{self.world_size}) or change dp/tp/pp so their product is {world_size}")

    # ----- learning rate -----
    def lr_at(self, step: int) -> float:
        """Learning rate of optimiser step ``step`` (0-based).

        Warmup: lr·(step+1)/warmup_steps for step < warmup_steps, so step 0 already
        moves (lr/warmup_steps) and step warmup_steps-1 reaches lr. Then, with
        progress t = (step - warmup_steps)/(steps - warmup_steps) clamped to [0, 1]:
        cosine min_lr + (lr - min_lr)·(1 + cos πt)/2, linear lr - (lr - min_lr)·t,
        constant lr. So step warmup_steps is also lr, and min_lr is reached at step
        ``steps`` (one past the last step run). If warmup_steps >= steps the run ends
        inside the warmup."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        decay_steps = self.steps - self.warmup_steps
        progress = 1.0 if decay_steps <= 0 else min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.lr_schedule == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    # ----- identity -----
    def to_dict(self) -> dict:
        """Every field, flat, in declaration order, as JSON/TOML types (tuples as lists)."""
        return {name: list(value) if isinstance(value, tuple) else value
                for name in FIELD_NAMES for value in [getattr(self, name)]}

    def model_fields(self) -> dict:
        """The fields that fix the model's parameter shapes and numerics; a checkpoint
        whose model_fields differ cannot be loaded. Only the chosen model's fields
        count, and ffn_hidden is resolved (0 and 4·hidden are the same model)."""
        if self.model == "mlp":
            return {"model": self.model, "mlp_hidden": list(self.mlp_hidden), "dtype": self.dtype}
        if self.model.startswith(HF_PREFIX):  # the rest is the HF config's (plait.train.hf_model.description)
            return {"model": self.model, "seq_len": self.seq_len, "dtype": self.dtype}
        return {"model": self.model, "layers": self.layers, "hidden": self.hidden, "heads": self.heads,
                "seq_len": self.seq_len, "ffn_hidden": self.ffn, "tied_head": self.tied_head, "dtype": self.dtype}

    def digest(self) -> str:
        """sha256 hex of the canonical JSON of to_dict (sorted keys, no spaces)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def replace(self, **overrides) -> TrainConfig:
        """A validated copy with some fields changed."""
        _check_names(overrides, "replace()")
        return dataclasses.replace(self, **overrides)

    # ----- files -----
    @classmethod
    def from_dict(cls, values: Mapping, *, source: str = "dict") -> TrainConfig:
        """Build from flat field -> value (e.g. to_dict's output); unknown keys raise."""
        _check_names(values, source)
        return cls(**values)

    @classmethod
    def from_toml(cls, path) -> TrainConfig:
        """Read a TOML file, flat or in tables (see the module docstring), over the defaults."""
        return cls(**load_toml(path))

    def to_toml(self) -> str:
        """Every field, grouped in the TOML tables; from_toml reads it back equal."""
        tables: dict[str, dict] = {table: {} for table in TABLES}
        values = self.to_dict()
        for name in FIELD_NAMES:
            tables[FIELD_TABLES[name]][name] = values[name]
        return f"# plait TrainConfig, digest {self.digest()}\n" + tomli_w.dumps(tables)


FIELDS = dataclasses.fields(TrainConfig)
FIELD_NAMES = tuple(spec.name for spec in FIELDS)
FIELD_TABLES = {spec.name: spec.metadata["table"] for spec in FIELDS}
FIELD_HELP = {spec.name: spec.metadata["help"] for spec in FIELDS}
FIELD_CHOICES = {spec.name: spec.metadata["choices"] for spec in FIELDS}
_KIND_OF_TYPE = {int: "int", float: "float", bool: "bool", str: "str", tuple[int, ...]: "ints"}
FIELD_KINDS = {name: _KIND_OF_TYPE[hint] for name, hint in typing.get_type_hints(TrainConfig).items()}
_EXPECTED = {"int": "an int", "float": "a number", "bool": "a bool (true/false)", "str": "a string",
             "ints": "a list of ints"}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problem(name: str, value) -> str | None:
    kind = FIELD_KINDS[name]
    if kind == "int":
        ok = _is_int(value)
    elif kind == "float":
        ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, (list, tuple)) and all(_is_int(item) for item in value)
    if ok:
        return None
    return f"{name}={value!r} ({type(value).__name__}) must be {_EXPECTED[kind]}, e.g. {name}={_default(name)!r}"


def _default(name: str):
    return next(spec.default for spec in FIELDS if spec.name == name)


# Names other trainers use, which difflib would not match to ours.
_ALIASES = {"learning_rate": "lr", "batch_size": "global_batch", "micro_batch_size": "micro_batch",
            "max_steps": "steps", "iterations": "steps", "epochs": "steps", "n_layer": "layers",
            "n_head": "heads", "d_model": "hidden", "block_size": "seq_len", "warmup": "warmup_steps",
            "clip_grad": "grad_clip", "output_dir": "out"}


def _suggest(name: str, names=FIELD_NAMES) -> str:
    key = name.replace("-", "_").lower()
    if names is FIELD_NAMES and key in _ALIASES:
        return f"did you mean {_ALIASES[key]!r}?"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"valid names: {listed(names)}"


def _check_names(values: Mapping, source: str) -> None:
    unknown = [name for name in values if name not in FIELD_NAMES]
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) in {source}: "
                         + "; ".join(f"{name!r} ({_suggest(name)})" for name in unknown))


# ----- TOML -------------------------------------------------------------------------------
def load_toml(path) -> dict:
    """A TOML file's fields as a flat dict (not yet validated together: the caller
    builds the TrainConfig). Raises ValueError naming the file for a missing or
    malformed file, an unknown key or table (with the closest valid name), a key in
    the wrong table or set twice, and a value of the wrong type."""
    path = Path(path)
    try:
        raw = read_small_file(path, limit_nbytes=CONFIG_LIMIT_NBYTES, what="config file",
                              fix="give --config the path of a TOML file of TrainConfig fields, such as a run's launch-config.toml")
        document = tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} not found (cwd: {Path.cwd()})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"cannot read config file {str(path)!r}: not UTF-8 text (byte {error.start}): a TOML "
                         "file is UTF-8") from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"cannot read config file {str(path)!r}: {error}") from None
    values: dict = {}
    where: dict[str, str] = {}
    problems: list[str] = []

    def take(key: str, value, place: str, table: str | None) -> None:
        if key not in FIELD_NAMES:
            problems.append(f"unknown key {key!r} in {place}: {_suggest(key)}")
        elif table is not None and FIELD_TABLES[key] != table:
            problems.append(f"{key!r} belongs in [{FIELD_TABLES[key]}], not [{table}]")
        elif key in values:
            problems.append(f"{key!r} is set twice, in {where[key]} and in {place}: keep one")
        elif (problem := _type_problem(key, value)) is not None:
            problems.append(problem)
        else:
            values[key], where[key] = value, place

    for key, value in document.items():
        if isinstance(value, dict):
            if key in TABLES:
                for inner_key, inner_value in value.items():
                    take(inner_key, inner_value, f"[{key}]", key)
            else:
                close = difflib.get_close_matches(key, TABLES, n=1, cutoff=0.5)
                hint = f"did you mean [{close[0]}]? " if close else ""
                problems.append(f"unknown table [{key}]: {hint}tables are {listed(f'[{t}]' for t in TABLES)}")
        else:
            take(key, value, "the top level", None)
    if problems:
        raise ValueError(f"invalid config file {str(path)!r}:\n" + "\n".join(f"  - {p}" for p in problems))
    return values


# ----- command line -----------------------------------------------------------------------
def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints, e.g. 128,128,128") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, ``--field-name``, in the group
    "training config (also settable in --config FILE)". Defaults are SUPPRESSed, so
    the namespace holds only the flags given (config_from_args overlays them)."""
    group = parser.add_argument_group(CLI_GROUP_TITLE)
    for spec in FIELDS:
        name, kind, choices = spec.name, FIELD_KINDS[spec.name], FIELD_CHOICES[spec.name]
        default = (",".join(map(str, spec.default)) or "empty") if kind == "ints" else spec.default
        help_text = f"{FIELD_HELP[name]} (default: {str(default).lower() if kind == 'bool' else default})"
        options = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if kind == "bool":
            group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **options)
            continue
        if choices:
            options["metavar"] = "{" + ",".join(choices) + "}"
        elif kind == "ints":
            options["metavar"] = "N,N,..." if name == "stage_layers" else "W,W,..."
        else:
            options["metavar"] = {"int": "N", "float": "X", "str": "TEXT"}[kind]
        group.add_argument(_flag(name), type={"int": int, "float": float, "str": str, "ints": _int_list}[kind],
                           **options)


def config_from_args(args: argparse.Namespace, config_path: str | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``config_path`` (if any), then the flags given
    on the command line; validated once, as a whole, at the end."""
    values = load_toml(config_path) if config_path else {}
    values.update({name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)})
    return TrainConfig(**values)
