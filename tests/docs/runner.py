"""Runs one docs block: commands through bash, python blocks with the venv's python.

Everything runs in one work directory per test session that looks like the
repository (links to .venv, bench, src, tests, docs, pyproject.toml), so commands
that name ``.venv/bin/plait`` or ``bench/...`` work, and whatever a block writes
(runs/, topology.json, ...) lands in the work directory, not in the checkout.
PLAIT_CACHE_DIR points into it too, so a block never touches the user's profiles.
Its Makefile includes the checkout's and never installs: a ``make run`` there once
found the install stamp older than pyproject.toml and reinstalled plait from the work
directory, which pointed the venv's ``plait`` script at a temporary path.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from tests.docs.extract import ROOT, Block, console_commands, with_appended

LINKED = (".venv", "bench", "src", "tests", "pyproject.toml", "constraints.txt", "docs")
QUICK_TIMEOUT_S = 120
SLOW_TIMEOUT_S = 600


def make_workdir(path: pathlib.Path, file_blocks: list[Block]) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if (ROOT / name).exists() and not (path / name).exists():
            (path / name).symlink_to(ROOT / name)
    (path / "Makefile").write_text(f"include {ROOT / 'Makefile'}\n\n"
                                   "# the checkout's make install installs; here the stamp is never remade\n"
                                   "$(STAMP):\n\t@true\n")
    for block in file_blocks:
        (path / block.option("file")).write_text(block.text)
    return path


def environment(workdir: pathlib.Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PLAIT_")}
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["PLAIT_CACHE_DIR"] = str(workdir / ".cache-plait")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def bash_script(block: Block) -> str:
    extra = block.option("append")
    text = block.text
    if extra:
        logical: list[str] = []
        for line in text.split("\n"):
            if logical and logical[-1].endswith("\\"):
                logical[-1] = logical[-1][:-1] + " " + line.strip()
            else:
                logical.append(line)
        text = "\n".join(with_appended(line, extra) if line.strip() and not line.lstrip().startswith("#") else line
                         for line in logical)
    return "set -e\n" + text


def commands_of(block: Block) -> list[tuple[str, list[str]]]:
    """(what to show on failure, argv) for each process the block runs."""
    bash = "bash"
    if block.lang == "console":
        extra = block.option("append")
        return [(command, [bash, "-o", "pipefail", "-c", with_appended(command, extra) if extra else command])
                for command in console_commands(block.text)]
    if block.lang == "bash":
        return [(block.text, [bash, "-c", bash_script(block)])]
    if block.lang == "python":
        script = f"docs-block-{block.page.replace('/', '-')}-{block.line}.py"
        nprocs = block.option("torchrun")
        if nprocs:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
                    script]
        else:
            argv = [sys.executable, script]
        return [(block.text, argv)]
    raise ValueError(f"{block.id}: a {block.lang!r} block is not run")


def block_timeout_s(block: Block) -> int:
    return int(block.option("timeout", QUICK_TIMEOUT_S if block.mode == "quick" else SLOW_TIMEOUT_S))


def run_block(block: Block, workdir: pathlib.Path) -> None:
    """Every command of the block, in order, each to the end (no command is skipped as seen before:
    a repeated `plait testbed down` is not the same as the first)."""
    env = environment(workdir)
    timeout_s = block_timeout_s(block)
    if block.lang == "python":
        (workdir / commands_of(block)[0][1][-1]).write_text(block.text)
    started = False
    try:
        for shown, argv in commands_of(block):
            try:
                done = subprocess.run(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                      text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired as error:
                raise AssertionError(f"{block.id}: still running after {timeout_s:g} s: {shown}\n"
                                     f"{(error.stdout or '')[-3000:]}{(error.stderr or '')[-3000:]}") from None
            if done.returncode != 0:
                raise AssertionError(f"{block.id}: exit {done.returncode}: {shown}\n--- stdout (tail)\n"
                                     f"{done.stdout[-4000:]}\n--- stderr (tail)\n{done.stderr[-4000:]}")
            started = True
    finally:
        if started and block.option("cleanup"):
            subprocess.run(["bash", "-c", block.option("cleanup")], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=SLOW_TIMEOUT_S)
