"""Every runnable block of the README and docs/ runs (quick ones in make test, all in make docs-check)."""
from __future__ import annotations

import pytest

from tests.docs.extract import NOT_RUN, RUNNABLE, all_blocks, console_commands
from tests.docs.runner import block_timeout_s, make_workdir, run_block

BLOCKS = all_blocks()
RUN = [block for block in BLOCKS if block.lang in RUNNABLE and block.mode in ("quick", "slow")]


def _param(block):
    marks = [pytest.mark.docs_slow] if block.mode == "slow" else []
    marks.append(pytest.mark.timeout(block_timeout_s(block) + 60))
    return pytest.param(block, id=block.id, marks=marks)


@pytest.fixture(scope="session")
def docs_workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("docs-work"), [b for b in BLOCKS if b.mode == "file"])


@pytest.mark.parametrize("block", [_param(block) for block in RUN])
def test_block_runs(block, docs_workdir):
    run_block(block, docs_workdir)


def test_every_block_is_tagged_and_marked():
    problems = []
    for block in BLOCKS:
        if block.lang not in RUNNABLE + NOT_RUN:
            problems.append(f"{block.id}: fence tagged {block.lang!r}; use one of {RUNNABLE + NOT_RUN}")
        if block.mode == "skip" and not block.option("reason"):
            problems.append(f"{block.id}: docs: skip needs reason=...")
        if block.mode == "file" and block.lang not in NOT_RUN:
            problems.append(f"{block.id}: file= is for text or toml blocks")
        if block.lang in NOT_RUN and block.mode in ("slow", "skip"):
            problems.append(f"{block.id}: a {block.lang} block is never run: drop the directive")
        if block.lang == "console" and not console_commands(block.text):
            problems.append(f"{block.id}: a console block without a '$ ' command")
        if block.lang == "text" and any(line.startswith("$ ") for line in block.text.split("\n")):
            problems.append(f"{block.id}: a text block holds a '$ ' command: tag it console so it runs")
        if block.option("torchrun") and block.lang != "python":
            problems.append(f"{block.id}: torchrun= is for python blocks")
    assert not problems, "\n".join(problems)


def test_extractor_finds_blocks():
    langs = {block.lang for block in BLOCKS}
    assert {"console", "python"} <= langs and len(RUN) >= 20, (langs, len(RUN))
