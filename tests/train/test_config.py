"""TrainConfig: defaults, validation messages, TOML (flat and tabled), CLI overlay,
round trips, the learning-rate schedule and the digest."""

import argparse
import dataclasses

import pytest

from plait.train.config import (
    CLI_GROUP_TITLE,
    FIELD_HELP,
    FIELD_NAMES,
    TrainConfig,
    add_config_arguments,
    config_from_args,
    load_toml,
)


def problems_of(**overrides) -> str:
    with pytest.raises(ValueError) as info:
        TrainConfig(**overrides)
    message = str(info.value)
    assert message.startswith("invalid TrainConfig:")
    return message


def write(tmp_path, text: str, name: str = "train.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(argv: list[str], config_path=None) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv), config_path)


# ----- defaults and derived sizes -----------------------------------------------------------
def test_defaults_are_the_readme_job():
    config = TrainConfig()
    assert (config.model, config.data, config.dp, config.tp, config.pp) == ("gpt", "stdlib", 2, 1, 2)
    assert config.world_size == 4
    assert (config.per_rank_batch, config.microbatches, config.ffn) == (8, 2, 512)
    assert config.axes == ("tp", "dp", "pp")
    assert set(FIELD_HELP) == set(FIELD_NAMES) and all(FIELD_HELP.values())


def test_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().lr = 1.0
    with pytest.raises(TypeError):
        TrainConfig("gpt")


def test_check_world_size_names_the_product():
    TrainConfig().check_world_size(4)
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) \* pp\(2\) = 8 != world_size\(4\)"):
        TrainConfig(tp=2).check_world_size(4)


def test_canonical_forms():
    config = TrainConfig(lr=1, mlp_hidden=[64, 32], mesh_order=" dp, tp ,pp")
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.mlp_hidden == (64, 32)
    assert config.mesh_order == "dp,tp,pp"
    assert config == TrainConfig(lr=1.0, mlp_hidden=(64, 32), mesh_order="dp,tp,pp")


# ----- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    ({"steps": 1.5}, "steps=1.5 (float) must be an int"),
    ({"tied_head": 1}, "tied_head=1 (int) must be a bool"),
    ({"lr": "fast"}, "lr='fast' (str) must be a number"),
    ({"mlp_hidden": (64, "x")}, "mlp_hidden=(64, 'x') (tuple) must be a list of ints"),
    ({"lr": float("nan")}, "lr=nan"),
    ({"model": "cnn"}, "model='cnn' is not valid: use one of gpt, mlp"),
    ({"schedule": "chimra"}, "did you mean 'chimera'?"),
    ({"dtype": "float16"}, "dtype='float16' is not valid"),
    ({"optimizer": "adam"}, "did you mean 'adamw'?"),
    ({"lr_schedule": "step"}, "lr_schedule='step'"),
    ({"layers": 0}, "layers=0 must be >= 1"),
    ({"ffn_hidden": -1}, "ffn_hidden=-1 must be >= 0"),
    ({"dropout": 1.0}, "dropout=1.0 must be in [0, 1)"),
    ({"mlp_hidden": (64, 0)}, "mlp_hidden=[64, 0] widths must all be >= 1"),
    ({"data": ""}, "data='' is empty"),
    ({"data_max_bytes": 0}, "data_max_bytes=0 must be >= 1"),
    ({"val_fraction": 1.0}, "val_fraction=1.0 must be in [0, 1)"),
    ({"val_fraction": 0.0}, "eval_interval=50 needs held-out data but val_fraction=0"),
    ({"mesh_order": "tp,dp"}, "mesh_order='tp,dp' must list tp, dp and pp once each"),
    ({"mesh_order": "tp,tp,pp"}, "mesh_order='tp,tp,pp'"),
    ({"algorithm": " "}, "algorithm=' ' is empty"),
    ({"compression": "topk"}, "compression='topk': bad compressor 'topk'"),
    ({"compression": "topk:0.01+ef", "dp": 1, "pp": 2, "global_batch": 8}, "dp=1 has none"),
    ({"lr": 0.0}, "lr=0.0 must be > 0"),
    ({"min_lr": 0.01}, "min_lr(0.01) > lr(0.003)"),
    ({"min_lr": -0.1}, "min_lr=-0.1 must be >= 0"),
    ({"beta1": 1.0}, "beta1=1.0 must be in [0, 1)"),
    ({"beta2": -0.5}, "beta2=-0.5 must be in [0, 1)"),
    ({"momentum": 1.5}, "momentum=1.5 must be in [0, 1)"),
    ({"weight_decay": -1}, "weight_decay=-1.0 must be >= 0"),
    ({"grad_clip": -1}, "grad_clip=-1.0 must be >= 0"),
    ({"warmup_steps": -1}, "warmup_steps=-1 must be >= 0"),
    ({"steps": 0}, "steps=0 must be >= 1"),
    ({"eval_interval": -1}, "eval_interval=-1 must be >= 0"),
    ({"checkpoint_interval": -5}, "checkpoint_interval=-5 must be >= 0"),
    ({"keep_checkpoints": -1}, "keep_checkpoints=-1 must be >= 0"),
    ({"log_interval": 0}, "log_interval=0 must be >= 1"),
    ({"timeout_s": 0}, "timeout_s=0.0 must be >= 1 second"),
    # accepted before (issue 31): the rank died with a C++ "timed out after 0ms", or "Overflow when unpacking long long"
    ({"timeout_s": 1e-300}, "timeout_s=1e-300 must be >= 1 second"),
    ({"timeout_s": 0.5}, "timeout_s=0.5 must be >= 1 second"),
    ({"seed": 10**23}, "seed=100000000000000000000000 must be <= 9,223,344,366,821 (torch's generators take seeds "
                       "below 2**64"),
    ({"out": ""}, "out='' is empty"),
])
def test_each_rule_names_the_value(overrides, expected):
    assert expected in problems_of(**overrides)


def test_the_largest_seed_seeds_every_epoch():
    """MAX_SEED is what torch takes: the data order's seed of a late epoch stays below 2**64."""
    import torch

    from plait.train.config_rules import DATA_SEED_STRIDE, MAX_SEED

    torch.Generator().manual_seed(MAX_SEED * DATA_SEED_STRIDE + 2**63)
    assert TrainConfig(seed=MAX_SEED).seed == MAX_SEED
    assert f"seed={MAX_SEED + 1} must be <=" in problems_of(seed=MAX_SEED + 1)


def test_batch_divisibility_suggests_fixes():
    message = problems_of(dp=3)
    assert "global_batch(16) % dp(3) = 1" in message
    assert "global_batch in {15, 18}" in message and "dp in {1, 2, 4, 8, 16}" in message
    message = problems_of(micro_batch=3)
    assert "per_rank_batch = global_batch(16) / dp(2) = 8 is not a multiple of micro_batch(3)" in message
    assert "micro_batch in {1, 2, 4, 8}" in message


def test_gpt_shape_rules():
    message = problems_of(hidden=130)
    assert "hidden(130) % heads(4) = 2" in message
    message = problems_of(tp=3, dp=1, global_batch=8)
    assert "heads(4) % tp(3) = 1" in message and "ffn(512) % tp(3) = 2" in message
    assert "use tp in {1, 2, 4}" in message
    message = problems_of(tp=4, sequence_parallel=True, seq_len=66)
    assert "seq_len(66) % tp(4) = 2" in message and "use tp in {1, 2}" in message
    TrainConfig(tp=4, sequence_parallel=True, seq_len=64)
    assert "layers(4) < pp(8) * virtual(1) = 8" in problems_of(pp=8)
    message = problems_of(tied_head=True)
    assert "tied_head=true with pp(2) > 1" in message and "set tied_head=false" in message
    assert TrainConfig(tied_head=True, pp=1, global_batch=8).tied_head
    assert "data='digits' with model='gpt'" in problems_of(data="digits")


def test_mlp_rules():
    mlp = TrainConfig(model="mlp", data="digits")
    assert mlp.model_fields() == {"model": "mlp", "mlp_hidden": [128, 128, 128], "dtype": "float32"}
    message = problems_of(model="mlp", tp=2, sequence_parallel=True)
    assert "tp=2 with model='mlp': tensor parallelism is for the GPT" in message
    assert "sequence_parallel=true with model='mlp'" in message
    assert "data='stdlib' with model='mlp'" in message
    message = problems_of(model="mlp", data="digits", mlp_hidden=(), pp=2)
    assert "mlp_hidden=[] gives 1 linear layers < pp(2) * virtual(1) = 2" in message
    # the GPT's shape rules do not apply to the MLP
    TrainConfig(model="mlp", data="digits", hidden=130, layers=1)


def test_schedule_rules():
    TrainConfig(schedule="gpipe")
    TrainConfig(schedule="zero_bubble")
    TrainConfig(schedule="chimera")
    assert "virtual=2 model chunks per rank apply to schedule='interleaved_1f1b' only" in problems_of(virtual=2)
    assert "needs virtual >= 2" in problems_of(schedule="interleaved_1f1b")
    config = TrainConfig(schedule="interleaved_1f1b", virtual=2, layers=4)
    assert config.microbatches == 2
    message = problems_of(schedule="interleaved_1f1b", virtual=2, micro_batch=8)
    assert "microbatches = global_batch(16) / dp(2) / micro_batch(8) = 1" in message
    assert "use micro_batch in {1, 2, 4}" in message
    assert "layers(4) < pp(2) * virtual(3) = 6" in problems_of(schedule="interleaved_1f1b", virtual=3)
    message = problems_of(schedule="chimera", pp=3, dp=1, global_batch=4, micro_batch=4, layers=6)
    assert "even pp, got pp=3" in message and "= 1: use micro_batch in {1, 2}" in message


def test_every_problem_in_one_message():
    message = problems_of(dp=3, lr=-1.0, hidden=130, schedule="chimra", steps=0)
    lines = [line for line in message.splitlines()[1:] if line.startswith("  - ")]
    assert len(lines) == 5
    for expected in ("global_batch(16) % dp(3)", "lr=-1.0", "hidden(130) % heads(4)", "schedule='chimra'",
                     "steps=0"):
        assert expected in message


# ----- TOML ---------------------------------------------------------------------------------
def test_toml_flat(tmp_path):
    path = write(tmp_path, 'model = "mlp"\ndata = "digits"\nlr = 1\nmlp_hidden = [64, 32]\ntied_head = false\n')
    config = TrainConfig.from_toml(path)
    assert (config.model, config.data, config.lr, config.mlp_hidden) == ("mlp", "digits", 1.0, (64, 32))
    assert config.steps == TrainConfig().steps  # untouched fields keep their defaults


def test_toml_tables_and_mixed(tmp_path):
    path = write(tmp_path, 'steps = 10\n[model]\nmodel = "gpt"\nlayers = 8\n[parallel]\ndp = 4\npp = 1\n'
                           '[batch]\nglobal_batch = 32\n[optim]\nlr_schedule = "linear"\n')
    config = TrainConfig.from_toml(path)
    assert (config.steps, config.layers, config.dp, config.pp, config.global_batch) == (10, 8, 4, 1, 32)
    assert config.lr_schedule == "linear"


def test_toml_unknown_key_suggests(tmp_path):
    path = write(tmp_path, "learning_rate = 0.1\nglobl_batch = 8\nzzz = 1\n[optim]\nwarmup_step = 3\n")
    with pytest.raises(ValueError) as info:
        TrainConfig.from_toml(path)
    message = str(info.value)
    assert str(path) in message
    assert "unknown key 'learning_rate' in the top level: did you mean 'lr'?" in message
    assert "unknown key 'warmup_step' in [optim]: did you mean 'warmup_steps'?" in message
    assert "unknown key 'globl_batch' in the top level: did you mean 'global_batch'?" in message
    assert "unknown key 'zzz' in the top level: valid names: model, layers" in message


def test_toml_wrong_table_unknown_table_twice_and_types(tmp_path):
    path = write(tmp_path, 'lr = 0.1\nsteps = "ten"\n[model]\nlr = 0.2\ndp = 2\n[optim]\nlr = 0.3\n[optimizer]\nx = 1\n')
    with pytest.raises(ValueError) as info:
        load_toml(path)
    message = str(info.value)
    assert "'dp' belongs in [parallel], not [model]" in message
    assert "'lr' belongs in [optim], not [model]" in message
    assert "'lr' is set twice, in the top level and in [optim]" in message
    assert "unknown table [optimizer]: did you mean [optim]?" in message
    assert "steps='ten' (str) must be an int" in message


def test_toml_missing_and_malformed(tmp_path):
    with pytest.raises(ValueError, match="nope.toml.*not found"):
        TrainConfig.from_toml(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="cannot read config file"):
        TrainConfig.from_toml(write(tmp_path, "lr = = 3\n"))


def test_toml_values_are_judged_together(tmp_path):
    path = write(tmp_path, "[parallel]\ndp = 3\n")
    with pytest.raises(ValueError, match=r"invalid TrainConfig:[\s\S]*global_batch\(16\) % dp\(3\)"):
        TrainConfig.from_toml(path)


def test_round_trip_toml_and_dict(tmp_path):
    config = TrainConfig(model="mlp", data="digits", mlp_hidden=(32, 16), lr=0.01, min_lr=0.0, tp=1,
                         compression="powersgd:4", mesh_order="pp,tp,dp", sequence_parallel=False,
                         out="runs/x", timeout_s=12.5)
    text = config.to_toml()
    assert "[parallel]" in text and "[optim]" in text
    assert TrainConfig.from_toml(write(tmp_path, text)) == config
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert list(config.to_dict()) == list(FIELD_NAMES)
    assert config.to_dict()["mlp_hidden"] == [32, 16]
    with pytest.raises(ValueError, match="'lrr' .*did you mean 'lr'"):
        TrainConfig.from_dict({"lrr": 1.0})


def test_replace_validates():
    config = TrainConfig().replace(steps=10, dp=4, pp=1)
    assert (config.steps, config.world_size) == (10, 4)
    with pytest.raises(ValueError, match="invalid TrainConfig"):
        TrainConfig().replace(dp=3)
    with pytest.raises(ValueError, match="did you mean 'micro_batch'"):
        TrainConfig().replace(microbatch=2)


# ----- command line -------------------------------------------------------------------------
def test_cli_flags_one_per_field():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert vars(parser.parse_args([])) == {}  # SUPPRESS: only given flags appear
    group = next(group for group in parser._action_groups if group.title == CLI_GROUP_TITLE)
    dests = {action.dest for action in group._group_actions}
    assert dests == set(FIELD_NAMES)
    help_text = parser.format_help()
    assert "--global-batch" in help_text and "--timeout-s" in help_text and "(default: 16)" in help_text


def test_cli_types_bools_and_lists():
    config = parse(["--model", "mlp", "--data", "digits", "--mlp-hidden", "64,32", "--lr", "1e-2",
                    "--steps", "7", "--no-sequence-parallel"])
    assert (config.model, config.mlp_hidden, config.lr, config.steps) == ("mlp", (64, 32), 0.01, 7)
    assert parse(["--tied-head", "--pp", "1", "--global-batch", "8"]).tied_head is True
    assert parse(["--no-tied-head"]).tied_head is False
    with pytest.raises(SystemExit):
        parse(["--mlp-hidden", "64,x"])


def test_cli_beats_toml_and_is_judged_together(tmp_path):
    path = write(tmp_path, "[parallel]\ndp = 4\npp = 1\n[optim]\nlr = 0.1\nmin_lr = 0.01\n")
    config = parse(["--lr", "0.05"], str(path))
    assert (config.dp, config.pp, config.lr, config.min_lr) == (4, 1, 0.05, 0.01)
    # dp=3 in the file alone is invalid; the flag fixes it before validation
    path = write(tmp_path, "[parallel]\ndp = 3\n", name="bad.toml")
    assert parse(["--global-batch", "12", "--micro-batch", "2"], str(path)).per_rank_batch == 4
    with pytest.raises(ValueError, match=r"min_lr\(0.01\) > lr\(0.001\)"):
        parse(["--min-lr", "0.01", "--lr", "0.001"])


# ----- learning rate ------------------------------------------------------------------------
def test_lr_warmup_then_cosine():
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, steps=110)
    assert config.lr_at(0) == pytest.approx(0.1)
    assert config.lr_at(4) == pytest.approx(0.5)
    assert config.lr_at(9) == pytest.approx(1.0)
    assert config.lr_at(10) == pytest.approx(1.0)
    assert config.lr_at(60) == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert config.lr_at(110) == pytest.approx(0.1)
    assert config.lr_at(500) == pytest.approx(0.1)
    decay = [config.lr_at(step) for step in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    warmup = [config.lr_at(step) for step in range(10)]
    assert all(a < b for a, b in zip(warmup, warmup[1:]))
    with pytest.raises(ValueError):
        config.lr_at(-1)


def test_lr_linear_constant_no_warmup():
    linear = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, steps=100, lr_schedule="linear")
    assert [linear.lr_at(s) for s in (0, 50, 100)] == pytest.approx([1.0, 0.5, 0.0])
    constant = TrainConfig(lr=0.5, warmup_steps=5, lr_schedule="constant")
    assert constant.lr_at(0) == pytest.approx(0.1) and constant.lr_at(299) == 0.5
    short = TrainConfig(lr=1.0, warmup_steps=20, steps=5)  # the run ends inside the warmup
    assert short.lr_at(4) == pytest.approx(0.25)


# ----- identity -----------------------------------------------------------------------------
def test_digest_and_model_fields():
    base = TrainConfig()
    assert len(base.digest()) == 64 and base.digest() == TrainConfig().digest()
    assert base.digest() != base.replace(seed=1).digest()
    assert base.digest() == TrainConfig(lr=0.003).digest()
    fields = base.model_fields()
    assert fields == {"model": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "ffn_hidden": 512,
                      "tied_head": False, "dtype": "float32"}
    assert base.replace(ffn_hidden=512).model_fields() == fields  # 0 means 4*hidden: the same model
    assert base.replace(lr=0.01, dp=4, pp=1).model_fields() == fields
    assert base.replace(layers=8).model_fields() != fields
