"""`plait --help` and every subcommand's --help: clean text, and the bench modes discoverable."""

import argparse
import subprocess
import sys

import pytest

from plait.cli.main import build_parser, main

BENCH_MODES = ("dp", "tp", "pp")


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command word sequence the parser accepts (train, cost table, checkpoint info, ...)."""
    paths = []
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                paths.append(prefix + (name,))
                paths += command_paths(subparser, prefix + (name,))
    return paths


# the internal names (bench-dp) and the spelling users type (bench dp)
COMMANDS = [()] + command_paths(build_parser()) + [("bench", mode) for mode in BENCH_MODES]


def test_no_help_shows_the_suppress_marker(capsys):
    """argparse prints a subcommand registered with help=SUPPRESS as '==SUPPRESS=='."""
    assert len(COMMANDS) > 15  # the walk found the commands (plait, train, ..., cost table, ...)
    marked = []
    for words in COMMANDS:
        assert main([*words, "--help"]) == 0, words
        out = capsys.readouterr().out
        assert out.startswith("usage: plait"), words
        if "SUPPRESS" in out:
            marked.append(" ".join(("plait",) + words))
    assert marked == []


def test_top_level_help_lists_only_real_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bench-" not in out  # the internal names stay internal
    assert "bench dp" in out  # ... but the modes are mentioned next to bench


def test_bench_help_names_every_training_benchmark(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for mode in BENCH_MODES:
        assert f"plait bench {mode}" in out


@pytest.mark.parametrize("mode", BENCH_MODES)
def test_bench_mode_usage_is_spelled_as_typed(mode, capsys):
    assert main(["bench", mode, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: plait bench {mode} ")


def test_a_subcommand_imports_only_its_own_module():
    """`plait train` builds only train's parser: the benchmarks' torch.distributed.pipelining
    and the plotting stay unimported (every rank of a run starts through this path)."""
    probe = ("import sys; from plait.cli.main import main; main(['train', '--help']); "
             "print(sorted(m for m in ('torch.distributed.pipelining', 'matplotlib', 'plait.cli.bench') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
