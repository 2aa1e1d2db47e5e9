"""The fenced blocks of the README and docs/, with how tests/docs runs each.

A block is a fence tagged with its language. ``bash`` blocks are shell scripts,
``console`` blocks are transcripts (each ``$ `` line, with its ``\\`` continuations,
is a command; the rest is output), ``python`` blocks are programs. ``text`` blocks
(output, excerpts) and other languages are not run, unless a directive writes them
to a file. An HTML comment on the line before the fence says how to run the block:

    <!-- docs: slow -->                   runs in make docs-check only (quick: make test too)
    <!-- docs: skip reason=WHY -->        never runs here; the reason is required
    <!-- docs: slow timeout=900 -->       seconds before the block counts as failed
    <!-- docs: slow torchrun=4 -->        a python block run by torchrun with 4 processes
    <!-- docs: slow append=--rounds 1 --> ARGS added to every command (a long benchmark
                                          checked shorter; the last one of a flag wins)
    <!-- docs: file=job.toml -->          the block is written to that file in the work
                                          directory before any block runs
    <!-- docs: slow cleanup=CMD -->       CMD runs after the block, passed or failed, once
                                          its first command has succeeded (e.g. a testbed
                                          brought up is taken down)

An unmarked runnable block is quick. Values run to the next key (``key=``) or the end.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNNABLE = ("bash", "console", "python")
NOT_RUN = ("text", "toml")
KEYS = ("reason", "timeout", "torchrun", "append", "file", "cleanup")
_DIRECTIVE = re.compile(r"^<!--\s*docs:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(`{3,})(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str          # path relative to the repository root
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    mode: str          # quick, slow, skip or file
    options: tuple[tuple[str, str], ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)


def pages() -> list[pathlib.Path]:
    """The README first, then docs/ in the site's order (mkdocs.yml's nav), then any other page."""
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    docs = [ROOT / "docs" / name for name in nav]
    rest = sorted(set((ROOT / "docs").rglob("*.md")) - set(docs))
    return [ROOT / "README.md", *docs, *rest]


def parse_directive(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    words = text.split()
    mode = "quick"
    if words and words[0] in ("quick", "slow", "skip"):
        mode, text = words[0], text[len(words[0]):].strip()
    options: list[tuple[str, str]] = []
    pattern = re.compile(r"(?:^|\s)(" + "|".join(KEYS) + r")=")
    found = list(pattern.finditer(text))
    if text and (not found or found[0].start() != 0):
        raise ValueError(f"docs directive {text!r}: expected quick|slow|skip then key=value ({', '.join(KEYS)})")
    for i, match in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        options.append((match.group(1), text[match.end():end].strip()))
    if "file" in dict(options):
        mode = "file"
    return mode, tuple(options)


def blocks(path: pathlib.Path) -> list[Block]:
    page = str(path.relative_to(ROOT))
    lines = path.read_text().split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang = match.group(1), match.group(2).strip()
        directive = _DIRECTIVE.match(lines[i - 1]) if i > 0 else None
        mode, options = parse_directive(directive.group(1)) if directive else ("quick", ())
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != fence:
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: the fence is never closed")
        found.append(Block(page, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", mode, options))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]


def console_commands(text: str) -> list[str]:
    """The commands of a transcript: each '$ ' line joined with its backslash continuations."""
    commands: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            command = lines[i][2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            commands.append(command)
        i += 1
    return commands


def with_appended(command: str, extra: str) -> str:
    """``extra`` added to a command line, before a trailing comment and on each side of && / ;."""
    parts = re.split(r"(\s*(?:&&|;)\s*)", command)
    out = []
    for part in parts:
        if re.fullmatch(r"\s*(?:&&|;)\s*", part) or not part.strip():
            out.append(part)
            continue
        body, _, comment = part.partition(" #")
        out.append(f"{body.rstrip()} {extra}" + (f"  #{comment}" if comment else ""))
    return "".join(out)
