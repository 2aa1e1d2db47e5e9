"""`plait train` before any training process starts: config and data errors,
--nprocs, --dry-run, the --resume checks and the --port fallback.

Everything runs in-process through plait.cli.main.main. subprocess.Popen (how the
launcher starts torch.distributed.run) is replaced by a recorder for every test, so
a test that would start processes fails loudly instead of training for minutes; the
tests that go all the way to the launch check the command it would have run. The one
real checkpoint is trained once, in the harness's world_size-1 pool.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.testing import run_distributed
from plait.train.config import TrainConfig

# The tiny GPT of every test: small enough that config validation, the data cache and
# the layout take milliseconds.
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--data-max-bytes", "60000",
        "--global-batch", "8", "--micro-batch", "2"]
REAL_POPEN = subprocess.Popen  # the launcher fixture replaces subprocess.Popen in every test
TINY_CONFIG = dict(layers=2, hidden=32, heads=4, seq_len=16, data_max_bytes=60_000, global_batch=8, micro_batch=2,
                   dp=1, tp=1, pp=1)
SINGLE = ["--dp", "1", "--tp", "1", "--pp", "1"]


class PopenRecorder:
    """Stands in for subprocess.Popen: records the command, returns a process that
    exits with `exit_code` at once."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.exit_code = 0

    def __call__(self, command, *args, **kwargs):
        self.calls.append(list(command))
        recorder = self

        class FinishedProcess:
            pid = -1

            def wait(self, timeout=None):
                return recorder.exit_code

            def send_signal(self, number):
                pass

        return FinishedProcess()


@pytest.fixture(autouse=True)
def launcher(monkeypatch):
    """No real processes, and not mistaken for a rank of a torchrun world."""
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    recorder = PopenRecorder()
    monkeypatch.setattr(subprocess, "Popen", recorder)
    return recorder


def train(argv, capsys) -> tuple[int, str, str]:
    code = main(["train", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("argv, expected", [
    (["--dp", "3"], ["global_batch(16) % dp(3) = 1", "dp in {1, 2, 4, 8, 16}"]),
    (["--tp", "3"], ["heads(4) % tp(3) = 1", "ffn(512) % tp(3) = 2", "use tp in {1, 2, 4}"]),
    (["--pp", "8"], ["layers(4) < pp(8) * virtual(1) = 8 pipeline chunks"]),
    (["--schedule", "chimera", "--micro-batch", "8"],
     ["schedule='chimera'", "microbatches = global_batch(16) / dp(2) / micro_batch(8) = 1",
      "use micro_batch in {1, 2, 4}"]),
    (["--schedule", "interleaved_1f1b"], ["needs virtual >= 2", "virtual=1"]),
    (["--virtual", "2"], ["virtual=2 model chunks per rank apply to schedule='interleaved_1f1b' only", "'1f1b'"]),
    (["--hidden", "30"], ["hidden(30) % heads(4) = 2"]),
])
def test_config_errors_exit_2_naming_the_values(argv, expected, tmp_path, capsys, launcher):
    code, out, err = train([*argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 2, err
    assert err.startswith("plait train: error: invalid TrainConfig")
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"
    assert launcher.calls == []
    assert not (tmp_path / "run").exists()


def test_every_config_problem_is_reported_at_once(tmp_path, capsys, launcher):
    code, _, err = train(["--dp", "3", "--tp", "3", "--pp", "8", "--out", str(tmp_path)], capsys)
    assert code == 2
    for text in ("global_batch(16) % dp(3)", "heads(4) % tp(3)", "layers(4) < pp(8)"):
        assert text in err
    assert launcher.calls == []


def test_unknown_key_in_a_config_file_exits_2_naming_file_and_key(tmp_path, capsys, launcher):
    config = tmp_path / "job.toml"
    config.write_text('learning_rate = 1e-3\n[optim]\nlr = 1e-3\n[parallel]\nlayers = 2\n')
    code, _, err = train(["--config", str(config), "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert str(config) in err
    assert "unknown key 'learning_rate' in the top level: did you mean 'lr'?" in err
    assert "'layers' belongs in [model], not [parallel]" in err
    assert launcher.calls == []


def test_missing_config_file_exits_2(tmp_path, capsys):
    code, _, err = train(["--config", str(tmp_path / "nope.toml")], capsys)
    assert code == 2
    assert "nope.toml" in err and "not found" in err


def test_flags_override_the_config_file(tmp_path, capsys, launcher):
    """The file alone is invalid (pp=8 > layers); the flag fixes it, so the pair is accepted."""
    config = tmp_path / "job.toml"
    config.write_text("[parallel]\npp = 8\ndp = 1\n")
    code, out, err = train(["--config", str(config), *TINY, "--pp", "2", "--dry-run", "--out", str(tmp_path)],
                           capsys)
    assert code == 0, err
    assert "mesh dp=1 x tp=1 x pp=2 = 2 processes" in out
    assert launcher.calls == []


@pytest.mark.parametrize("nprocs", ["3", "8"])
def test_nprocs_other_than_dp_tp_pp_exits_2_naming_both(nprocs, tmp_path, capsys, launcher):
    code, _, err = train([*TINY, "--nprocs", nprocs, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert f"--nprocs {nprocs} != dp(2) * tp(1) * pp(2) = 4" in err
    assert "pass --nprocs 4" in err
    assert launcher.calls == []


@pytest.mark.parametrize("nprocs", ["0", "-3"])
def test_nprocs_below_one_says_it_must_be_at_least_one(nprocs, tmp_path, capsys, launcher):
    """Was: "pass --nprocs 4, or change --dp/--tp/--pp so their product is 0"."""
    code, _, err = train(["--nprocs", nprocs, "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert f"--nprocs {nprocs} must be >= 1 (processes on this node): pass --nprocs 4 (dp * tp * pp)" in err
    assert "product is" not in err and launcher.calls == []


@pytest.mark.parametrize("flag, value", [("--max-restarts", "-1"), ("--sample-chars", "-5")])
def test_negative_launcher_options_exit_2(flag, value, tmp_path, capsys, launcher):
    code, _, err = train([*TINY, flag, value, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert f"{flag} {value} must be >= 0" in err
    assert launcher.calls == []


# --------------------------------------------------------------------------- data errors
def test_missing_data_path_exits_2_naming_it(tmp_path, capsys, launcher):
    code, _, err = train([*TINY, "--data", "/nonexistent/path", "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "'/nonexistent/path' does not exist" in err
    assert launcher.calls == []
    assert not (tmp_path / "run").exists()


def test_empty_data_directory_exits_2(tmp_path, capsys, launcher):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = train([*TINY, "--data", str(empty), "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert str(empty) in err and "has no files" in err
    assert launcher.calls == []


def test_too_small_data_file_exits_2(tmp_path, capsys, launcher):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")
    code, _, err = train([*TINY, "--data", str(tiny), "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "has 3 characters; plait train needs at least 331 characters" in err
    assert launcher.calls == []


@pytest.mark.parametrize("batch, seq_len, evaluate", [("8", "16", True), ("4", "32", False), ("16", "8", True)])
def test_the_data_size_the_message_asks_for_is_exactly_enough(batch, seq_len, evaluate, tmp_path, capsys,
                                                              monkeypatch):
    """The number in the too-small message is the least that trains: N characters
    pass the launcher and train a step (lm_batch and eval_batch draw real windows),
    N - 1 are refused, naming N."""
    from plait.train.corpus import eval_batch, load_corpus, lm_batch

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    argv = [*TINY, *SINGLE, "--global-batch", batch, "--micro-batch", batch, "--seq-len", seq_len, "--dry-run",
            "--eval-interval", "5" if evaluate else "0"]
    probe = tmp_path / "probe.txt"
    probe.write_text("x")
    code, _, err = train([*argv, "--data", str(probe)], capsys)
    needed = int(re.search(r"needs at least ([\d,]+) characters", err).group(1).replace(",", ""))
    text = ("the quick brown fox jumps over the lazy dog " * (needed // 40 + 1))[:needed]
    enough, short = tmp_path / "enough.txt", tmp_path / "short.txt"
    enough.write_text(text)
    short.write_text(text[:-1])
    assert train([*argv, "--data", str(enough)], capsys)[0] == 0
    code, _, err = train([*argv, "--data", str(short)], capsys)
    assert code == 2 and f"has {needed - 1:,} characters; plait train needs at least {needed:,}" in err
    corpus = load_corpus(str(enough), max_bytes=60_000, cache_dir=tmp_path / "cache")
    inputs, _ = lm_batch(corpus.train, 0, int(batch), int(seq_len))
    assert inputs.shape == (int(batch), int(seq_len))
    if evaluate:
        assert eval_batch(corpus.val, 0, int(batch), int(seq_len))[0].shape == (int(batch), int(seq_len))


# --------------------------------------------------------------------------- --dry-run
RANK_LINE = re.compile(r"^  rank +(\d+): dp (\d+) tp (\d+) pp (\d+)  stage (.*?)  (?:tp shard (\d)/(\d).*?  )?\(",
                       re.M)


def _tiny_parameter_count(**overrides) -> int:
    """The oracle: build the GPT the dry run describes and count its parameters."""
    from plait.models.gpt import GPT
    from plait.train.build import gpt_config, load_data

    config = TrainConfig(**{**TINY_CONFIG, **overrides})
    data = load_data(config)
    return sum(parameter.numel() for parameter in GPT(gpt_config(config, data.vocab_size)).parameters())


def _dry_run_ranks(out: str) -> dict[int, tuple[dict, str, str | None]]:
    ranks = {}
    for match in RANK_LINE.finditer(out):
        rank, dp, tp, pp = map(int, match.group(1, 2, 3, 4))
        assert rank not in ranks, f"rank {rank} listed twice"
        ranks[rank] = ({"dp": dp, "tp": tp, "pp": pp}, match.group(5), match.group(6))
    return ranks


@pytest.mark.parametrize("layout, extra, stages", [
    ({"dp": 2, "tp": 1, "pp": 2}, [], {0: "chunk 0 [embedding..block 0]", 1: "chunk 1 [block 1..head]"}),
    ({"dp": 1, "tp": 2, "pp": 2}, [], {0: "chunk 0 [embedding..block 0]", 1: "chunk 1 [block 1..head]"}),
    ({"dp": 1, "tp": 1, "pp": 2}, ["--schedule", "interleaved_1f1b", "--virtual", "2", "--layers", "4"],
     {0: "chunk 0 [embedding..block 0], chunk 2 [block 2]", 1: "chunk 1 [block 1], chunk 3 [block 3..head]"}),
], ids=["dp2xpp2", "tp2xpp2", "interleaved"])
def test_dry_run_prints_ranks_stages_parameters_and_schedule(layout, extra, stages, tmp_path, capsys, launcher):
    from plait.parallel.mesh import ParallelDims

    flags = [f"--{axis}={size}" for axis, size in layout.items()]
    code, out, err = train([*TINY, *flags, *extra, "--dry-run", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert launcher.calls == []  # no process started
    assert not (tmp_path / "run").exists()  # and nothing written
    dims = ParallelDims(**layout)
    ranks = _dry_run_ranks(out)
    assert sorted(ranks) == list(range(dims.world_size)), out
    for rank, (coords, stage, shard) in ranks.items():
        assert coords == dims.coords(rank)
        assert stage == stages[coords["pp"]], (rank, stage)
        assert (shard is not None) == (layout["tp"] > 1)
        if shard is not None:
            assert int(shard) == coords["tp"] + 1
    layers = 4 if "--layers" in extra else 2
    parameters = _tiny_parameter_count(layers=layers)
    assert f"GPT layers={layers} hidden=32 heads=4 seq_len=16" in out
    assert f": {parameters:,} parameters" in out
    schedule = "interleaved_1f1b (virtual=2)" if extra else "1f1b"
    microbatches = 8 // layout["dp"] // 2
    assert f"schedule  {schedule}, {microbatches} micro-batches of 2 per dp rank" in out
    assert f"batch     global 8 = dp {layout['dp']} x per-rank {8 // layout['dp']}" in out
    assert f"output    {tmp_path / 'run'}" in out


def test_dry_run_checks_the_resume_choice(tmp_path, capsys, launcher):
    """--dry-run refuses what the launch refuses: --resume never over an earlier run (it
    printed the layout and exited 0, then the real run refused)."""
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    code, out, err = train([*TINY, "--resume", "never", "--dry-run", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--resume never would start over in" in err and "mesh" not in out
    code, out, err = train([*TINY, "--dry-run", "--out", str(tmp_path / "fresh")], capsys)
    assert code == 0, err
    assert "plait train: starting at step 0" in out and "mesh dp=2 x tp=1 x pp=2" in out
    assert not (tmp_path / "fresh").exists()  # the check changes nothing


def _not_a_checkpoint(tmp_path: Path, kind: str) -> Path:
    run = tmp_path / "other-run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    return {"root": Path("/"), "empty": tmp_path / "empty", "file": tmp_path / "file", "fifo": tmp_path / "fifo",
            "checkpoints": run / "checkpoints"}[kind]


@pytest.mark.parametrize("kind, expected", [
    ("root", "--resume /: / is not a checkpoint directory (no manifest.json, no shard files, not named step_*): "
             "pass a run directory RUN (its newest complete checkpoint) or a checkpoint directory "
             "RUN/checkpoints/step_*"),
    ("empty", "is not a checkpoint directory (empty): pass a run directory RUN"),
    ("file", "is a regular file, not a directory; give a checkpoint directory (RUN/checkpoints/step_*)"),
    ("fifo", "is a FIFO (named pipe), not a directory; give a checkpoint directory"),
    ("checkpoints", "is a run's checkpoints directory, not a checkpoint: pass the run directory "),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_resume_path_that_is_no_checkpoint_says_what_it_is(kind, expected, dry_run, tmp_path, capsys, launcher):
    """Was: --dry-run exit 0 with the layout; the launch "not a complete checkpoint: no
    manifest.json (partial: the save did not finish)" for a directory no save ever touched."""
    resume = _not_a_checkpoint(tmp_path, kind)
    code, out, err = train([*TINY, *SINGLE, "--resume", str(resume), "--out", str(tmp_path / "run"),
                            *(["--dry-run"] if dry_run else [])], capsys)
    assert code == 2, out
    assert expected in err and err.count("error:") == 1 and "partial" not in err
    if kind == "checkpoints":
        assert f"pass the run directory {tmp_path / 'other-run'}, or one of its step_* directories" in err
    assert launcher.calls == []


def test_dry_run_parameter_count_with_a_tied_head(tmp_path, capsys):
    code, out, err = train([*TINY, *SINGLE, "--tied-head", "--dry-run", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert f": {_tiny_parameter_count(tied_head=True):,} parameters" in out


# --------------------------------------------------------------------------- the launch itself
def test_a_valid_run_launches_torchrun_with_the_written_config(tmp_path, capsys, launcher):
    out_dir = tmp_path / "run"
    code, out, err = train([*TINY, *SINGLE, "--sample-chars", "0", "--out", str(out_dir)], capsys)
    assert code == 0, err
    assert len(launcher.calls) == 1
    command = launcher.calls[0]
    assert command[1:3] == ["-m", "plait.train.agent"]  # torch's elastic agent, stores bound to one address
    assert command[command.index("--rdzv-backend") + 1] == "plait-c10d"
    assert command[command.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    assert command[command.index("--local-addr") + 1] == "127.0.0.1"
    assert command[command.index("--rdzv-id") + 1] == command[command.index("--run-id") + 1]
    assert command[command.index("--nproc-per-node") + 1] == "1"
    assert command[command.index("--resume") + 1] == "auto"
    written = command[command.index("--config") + 1]
    assert Path(written) == out_dir / "launch-config.toml"
    assert TrainConfig.from_toml(written) == TrainConfig(**TINY_CONFIG, out=str(out_dir))
    assert "plait train: 1 processes (dp=1 x tp=1 x pp=1)" in out
    assert f"report: {out_dir / 'report.md'}" in out


def test_a_failed_launch_returns_its_exit_code(tmp_path, capsys, launcher):
    launcher.exit_code = 3
    code, _, err = train([*TINY, *SINGLE, "--out", str(tmp_path)], capsys)
    assert code == 3
    assert "the training processes failed (exit 3)" in err


# --------------------------------------------------------------------------- --resume
def _train_rank(rank, world_size, config):
    from plait.train.loop import Trainer

    Trainer(config, log=lambda _: None).train()
    return None


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real run of the tiny GPT (layers=2, dp=tp=pp=1): checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("trained") / "run"
    config = TrainConfig(**TINY_CONFIG, steps=2, eval_interval=0, checkpoint_interval=1, out=str(out),
                         timeout_s=60.0)
    run_distributed(_train_rank, 1, config, timeout_s=120.0)
    return out


@pytest.fixture
def run_dir(trained_run, tmp_path) -> Path:
    """A private copy of the trained run, free to damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    return copy


def _steps(run: Path) -> list[str]:
    return sorted(path.name for path in (run / "checkpoints").iterdir())


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_the_trained_run_has_two_checkpoints(trained_run):
    assert _steps(trained_run) == ["step_00000001", "step_00000002"]


@pytest.mark.slow
def test_resume_never_into_a_run_with_checkpoints_exits_2_with_the_fix(run_dir, capsys, launcher):
    code, _, err = train([*TINY, *SINGLE, "--resume", "never", "--out", str(run_dir)], capsys)
    assert code == 2
    assert f"--resume never would start over in {run_dir}, which holds an earlier run" in err
    assert "2 checkpoints: step_00000002, step_00000001" in err
    assert "--force-fresh" in err and "--resume auto" in err and "another --out" in err
    assert launcher.calls == []
    assert _steps(run_dir) == ["step_00000001", "step_00000002"]  # nothing deleted


def test_resume_never_into_a_fresh_directory_launches(tmp_path, capsys, launcher):
    code, _, err = train([*TINY, *SINGLE, "--resume", "never", "--sample-chars", "0", "--out", str(tmp_path)],
                         capsys)
    assert code == 0, err
    assert launcher.calls and launcher.calls[0][launcher.calls[0].index("--resume") + 1] == "never"


@pytest.mark.slow
def test_resume_auto_of_the_same_model_launches(run_dir, capsys, launcher):
    code, _, err = train([*TINY, *SINGLE, "--sample-chars", "0", "--out", str(run_dir)], capsys)
    assert code == 0, err
    assert len(launcher.calls) == 1


@pytest.mark.slow
def test_resume_auto_with_another_model_exits_2_naming_the_field(run_dir, capsys, launcher):
    code, _, err = train([*TINY, *SINGLE, "--layers", "4", "--out", str(run_dir)], capsys)
    assert code == 2
    assert "step_00000002 was saved for a different model" in err
    assert "layers 2 != 4" in err
    assert "hidden" not in err.split("different model:")[1].split(";")[0]  # only the differing field
    assert "start a new --out" in err
    assert launcher.calls == []


@pytest.mark.slow
def test_resume_from_a_directory_with_another_model_exits_2(run_dir, tmp_path, capsys, launcher):
    checkpoint = run_dir / "checkpoints" / "step_00000001"
    code, _, err = train([*TINY, *SINGLE, "--hidden", "64", "--resume", str(checkpoint),
                          "--out", str(tmp_path / "new")], capsys)
    assert code == 2
    assert "step_00000001 was saved for a different model" in err and "hidden 32 != 64" in err
    assert launcher.calls == []


@pytest.mark.slow
def test_corrupt_checkpoint_is_reported_by_checkpoint_info(run_dir, capsys):
    _corrupt(run_dir / "checkpoints" / "step_00000002" / "tp0-pp0.pt")
    assert main(["checkpoint", "info", str(run_dir / "checkpoints" / "step_00000002")]) == 2
    assert "tp0-pp0.pt sha256 mismatch (corrupt)" in capsys.readouterr().err
    assert main(["checkpoint", "info", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "step_00000002: tp0-pp0.pt sha256 mismatch (corrupt): using step_00000001" in captured.err
    assert "step 1," in captured.out


@pytest.mark.slow
def test_resume_auto_falls_back_past_a_corrupt_checkpoint(run_dir, capsys):
    from plait.train.launch import check_resume_choice, prepare_data

    _corrupt(run_dir / "checkpoints" / "step_00000002" / "tp0-pp0.pt")
    config = TrainConfig(**TINY_CONFIG, out=str(run_dir))
    data = prepare_data(config)
    check_resume_choice(config, "auto", data)  # the older, intact step_00000001 is fine
    assert (f"resuming from {run_dir / 'checkpoints' / 'step_00000001'}; step_00000002 (tp0-pp0.pt sha256 mismatch "
            "(corrupt)) is newer but not complete: it will be kept as step_00000002.corrupt"
            in capsys.readouterr().out)
    assert _steps(run_dir) == ["step_00000001", "step_00000002"]  # the launcher only looks
    # the corrupt one named explicitly is refused, with the reason
    with pytest.raises(ValueError, match=re.escape("tp0-pp0.pt sha256 mismatch (corrupt)")):
        check_resume_choice(config, str(run_dir / "checkpoints" / "step_00000002"), data)
    # the fallback checkpoint is still checked against the model
    with pytest.raises(ValueError, match="step_00000001 was saved for a different model: layers 2 != 3"):
        check_resume_choice(config.replace(layers=3), "auto", data)


@pytest.mark.slow
def test_resume_auto_through_the_cli_falls_back_and_launches(run_dir, capsys, launcher):
    _corrupt(run_dir / "checkpoints" / "step_00000002" / "tp0-pp0.pt")
    code, out, err = train([*TINY, *SINGLE, "--sample-chars", "0", "--out", str(run_dir)], capsys)
    assert code == 0, err
    assert "resuming from" in out and "step_00000001;" in out and "kept as step_00000002.corrupt" in out
    assert len(launcher.calls) == 1


@pytest.mark.slow
def test_resume_from_a_missing_or_partial_directory_exits_2(run_dir, tmp_path, capsys, launcher):
    (run_dir / "checkpoints" / "step_00000002" / "manifest.json").unlink()
    code, _, err = train([*TINY, *SINGLE, "--resume", str(run_dir / "checkpoints" / "step_00000002"),
                          "--out", str(tmp_path / "new")], capsys)
    assert code == 2
    assert "no manifest.json (partial" in err
    code, _, err = train([*TINY, *SINGLE, "--resume", str(tmp_path / "nowhere"), "--out", str(tmp_path / "new")],
                         capsys)
    assert code == 2
    assert "nowhere" in err
    assert launcher.calls == []


# --------------------------------------------------------------------------- --port
def test_free_port_keeps_a_free_port():
    from plait.cli.train import _free_port

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert _free_port(port) == port


def test_free_port_replaces_a_busy_port(capsys):
    from plait.cli.train import _free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        replacement = _free_port(port)
        assert replacement != port
        assert 0 < replacement < 65536
    assert f"port {port} is in use; using a free one instead" in capsys.readouterr().err


def test_free_port_zero_picks_one(capsys):
    from plait.cli.train import _free_port

    assert 0 < _free_port(0) < 65536
    assert capsys.readouterr().err == ""


def test_busy_port_flag_launches_on_another_port(tmp_path, capsys, launcher):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = train([*TINY, *SINGLE, "--sample-chars", "0", "--port", str(port), "--out", str(tmp_path)],
                               capsys)
    assert code == 0, err
    assert f"port {port} is in use" in err
    endpoint = launcher.calls[0][launcher.calls[0].index("--rdzv-endpoint") + 1]
    assert endpoint.startswith("127.0.0.1:") and endpoint != f"127.0.0.1:{port}"
    assert f"rendezvous {endpoint}" in out


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_out_of_range_port_exits_2(port, tmp_path, capsys, launcher):
    code, _, err = train([*TINY, *SINGLE, "--port", port, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert f"--port {port}" in err
    assert launcher.calls == []


# --------------------------------------------------------------------------- bounds and errors before launch
# Each was a probe that failed on the old code: found only after the ranks started (printed once per rank),
# or eating the machine. Now each is refused by the launcher: exit 2, one line, no process started.
@pytest.mark.parametrize("argv, expected", [
    (["--hidden", "65536", "--heads", "4"], ["processes need at least", "GiB is available", "parameters on the "
                                             "largest rank"]),
    (["--layers", "100000"], ["processes need at least"]),
    (["--seq-len", "200000", "--global-batch", "2", "--micro-batch", "1", "--pp", "1", "--eval-interval", "0",
      "--data-max-bytes", "1000000"], ["activations for one micro-batch"]),
    (["--global-batch", "100000000"], ["= 12500000 exceeds the limit of 4096 micro-batches per step",
                                       "use micro_batch >= 12500"]),
    (["--global-batch", "1000000000000"], ["exceeds the limit of 4096 micro-batches per step"]),
    (["--algorithm", "rign"], ["algorithm='rign' is not a plait algorithm: did you mean 'ring'?"]),
    (["--algorithm", "bruck"], ["algorithm='bruck' has no all_reduce"]),
    (["--compression", "topk:0.01", "--algorithm", "binary_tree"], ["has no all_gather (needed by compression"]),
    (["--timeout-s", "inf"], ["timeout_s=inf"]),
    # the rank died with a C++ "timed out after 0ms" / "Overflow when unpacking long long" (issue 31's review)
    (["--timeout-s", "1e-300"], ["timeout_s=1e-300 must be >= 1 second"]),
    (["--timeout-s", "1e300"], ["timeout_s=1e+300 must be <= 9223372036 seconds"]),  # every rank failed at start
    (["--seed", "100000000000000000000000"], ["seed=100000000000000000000000 must be <= 9,223,344,366,821"]),
    (["--dp", "512", "--global-batch", "1024", "--micro-batch", "1", "--pp", "1"], ["512 processes need at least"]),
])
@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.filterwarnings("ignore:512 processes on")  # the 512-process case also warns of oversubscription
def test_what_cannot_run_is_refused_before_any_process(argv, expected, dry_run, tmp_path, capsys, launcher):
    code, _, err = train(["--out", str(tmp_path / "run"), *argv, *(["--dry-run"] if dry_run else [])], capsys)
    assert code == 2, err
    for text in expected:
        assert text in err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert launcher.calls == []
    assert not (tmp_path / "run").exists()  # nothing written either


def test_data_max_bytes_beyond_the_text_reads_the_text(tmp_path, capsys, launcher):
    """--data-max-bytes 1e11 was a MemoryError (read(n) allocates n characters): the cap is a cap."""
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    code, out, err = train([*TINY, *SINGLE, "--data", str(text), "--data-max-bytes", str(10**11), "--dry-run"],
                           capsys)
    assert code == 0, err
    assert f"(1 file, {len(text.read_text()) / 1e3:.1f} kB)" in out


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file, not a directory"),
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file" / "run", "is a file, so the run directory"),
    # was an OSError traceback (File name too long) from Path.exists
    (lambda tmp: tmp / ("x" * 300) / "run", "is 300 bytes, longer than this filesystem's NAME_MAX"),
])
def test_an_out_that_cannot_be_a_directory_is_refused(make, expected, tmp_path, capsys, launcher):
    out = make(tmp_path)
    for extra in ([], ["--dry-run"]):
        code, _, err = train([*TINY, *SINGLE, "--out", str(out), *extra], capsys)
        assert code == 2 and expected in err and "Traceback" not in err
    assert launcher.calls == []


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(options) -> a fresh tmpfs (root / CAP_SYS_ADMIN only), unmounted at the end."""
    mounted = []

    def mount(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        result = REAL_POPEN(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], stderr=subprocess.PIPE,
                            text=True)
        _, error = result.communicate(timeout=30)
        if result.returncode != 0:
            pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {error.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        REAL_POPEN(["umount", "-l", str(point)]).wait(timeout=30)


def test_a_read_only_out_is_refused(mount_tmpfs, capsys, launcher):
    read_only = mount_tmpfs("size=1m,ro")
    code, _, err = train([*TINY, *SINGLE, "--out", str(read_only / "run")], capsys)
    assert code == 2 and "is not writable (Read-only file system)" in err and "Traceback" not in err
    assert launcher.calls == []


def test_an_out_without_room_for_a_checkpoint_is_refused(mount_tmpfs, capsys, launcher):
    small = mount_tmpfs("size=64k")
    code, _, err = train([*TINY, *SINGLE, "--out", str(small / "run")], capsys)
    assert code == 2
    match = re.search(r"has ([\d,]+) bytes free but one checkpoint needs about ([\d,]+)", err)
    assert match and int(match.group(1).replace(",", "")) < int(match.group(2).replace(",", ""))
    assert launcher.calls == []


def test_a_second_run_on_a_locked_out_is_refused_at_once(tmp_path, capsys, launcher):
    from plait.train import runlock

    with runlock.acquire(tmp_path / "run", "the-first-run"):
        code, _, err = train([*TINY, *SINGLE, "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    assert f"{tmp_path / 'run'} is in use by another plait train run: pid {os.getpid()}" in err
    assert "(run the-first-run)" in err and "choose another --out" in err
    assert launcher.calls == []
    code, _, err = train([*TINY, *SINGLE, "--sample-chars", "0", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err  # released: the next run goes ahead


def test_the_launcher_holds_the_lock_while_the_agent_runs(tmp_path, capsys, launcher):
    from plait.train import runlock

    seen = []

    class Agent:
        pid = -1

        def __init__(self, command, **kwargs):
            seen.append((runlock.holder(tmp_path / "run"), kwargs.get("pass_fds"), kwargs.get("start_new_session")))

        def wait(self, timeout=None):
            return 0

    subprocess.Popen = Agent
    code, _, err = train([*TINY, *SINGLE, "--sample-chars", "0", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    ((holder, pass_fds, new_session),) = seen
    assert holder is not None and holder.pid == os.getpid() and len(pass_fds) == 1 and new_session
    assert runlock.holder(tmp_path / "run") is None


@pytest.mark.parametrize("argv, expected", [
    (["--resume", "auto", "--force-fresh"], "--force-fresh replaces an earlier run, but --resume auto continues"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--port", "5"], "--port is for one machine"),
    (["--rdzv-endpoint", "127.0.0.1:29400"], "are for --nnodes > 1"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "must be HOST:PORT"),
    (["--nnodes", "3"], "do not split over --nnodes 3"),
    (["--run-id", "x"], "--run-id is set by plait train"),
])
def test_launcher_flag_errors(argv, expected, tmp_path, capsys, launcher):
    code, _, err = train([*TINY, "--dp", "2", "--pp", "1", "--out", str(tmp_path / "run"), *argv], capsys)
    assert code == 2 and expected in err, err
    assert launcher.calls == []


def _tree(root: Path) -> dict[str, bytes]:
    """Every file's bytes, but .lock: the launcher decides under the lock, so it creates it."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*"))
            if path.is_file() and path.name != ".lock"}


@pytest.mark.slow
def test_resume_auto_with_every_checkpoint_corrupt_is_refused_and_changes_nothing(run_dir, capsys, launcher):
    """The probe: all checkpoints with one corrupt shard made --resume auto start from
    step 0, rewrite metrics.jsonl and later delete the corrupt directories."""
    for step in ("step_00000001", "step_00000002"):
        _corrupt(run_dir / "checkpoints" / step / "tp0-pp0.pt")
    before = _tree(run_dir)
    code, _, err = train([*TINY, *SINGLE, "--out", str(run_dir)], capsys)
    assert code == 2
    assert "2 checkpoints, all corrupt or partial" in err and "nothing was changed" in err
    assert launcher.calls == []
    assert _tree(run_dir) == before


def _start_trainer(rank, world_size, config, resume, run_id):
    from plait.train.loop import Trainer

    try:
        Trainer(config, resume=resume, log=lambda _: None, run_id=run_id)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_checkpoints_vanished_after_the_launcher_looked_are_refused_by_rank_0(run_dir):
    """The launcher saw checkpoints; by the time the ranks start, checkpoints/ is gone:
    rank 0 refuses (every rank raises it) and the earlier run's metrics stay."""
    shutil.rmtree(run_dir / "checkpoints")
    before = _tree(run_dir)
    config = TrainConfig(**TINY_CONFIG, out=str(run_dir), steps=4, timeout_s=60.0)
    (message,) = run_distributed(_start_trainer, 1, config, "auto", "a-new-run", timeout_s=120)
    assert message is not None and "found an earlier run" in message and "metrics.jsonl with 2 steps" in message
    assert _tree(run_dir) == before


# --------------------------------------------------------------------------- --comm-profile before launch
@pytest.mark.parametrize("make, expected", [
    # a FIFO hung every rank; a directory failed after the ranks started (IsADirectoryError): now the launcher
    (lambda tmp: os.mkfifo(tmp / "fifo") or tmp / "fifo", "is a FIFO (named pipe), not a regular file"),
    (lambda tmp: Path("/dev/zero"), "'/dev/zero' is a character device, not a regular file"),
    (lambda tmp: tmp, "is a directory, not a regular file"),
    (lambda tmp: tmp / "missing.json", "no such file; run plait calibrate --output"),
    (lambda tmp: (tmp / "bad.json").write_text("{") and tmp / "bad.json", "not valid JSON"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_comm_profile_that_cannot_be_read_is_refused_before_any_process(make, expected, dry_run, tmp_path, capsys,
                                                                          launcher):
    profile = make(tmp_path)
    code, _, err = train([*TINY, *SINGLE, "--out", str(tmp_path / "run"), "--comm-profile", str(profile),
                          *(["--dry-run"] if dry_run else [])], capsys)
    assert code == 2, err
    assert expected in err and err.count("error:") == 1 and "Traceback" not in err
    assert launcher.calls == []
