"""The README stays a landing page, its links and the docs' links resolve, every page is
in the site's nav, and every plait module or name the docs mention exists."""
from __future__ import annotations

import importlib
import re
import unicodedata

from tests.docs.extract import ROOT, pages

README_MAX_LINES = 300
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_DOTTED = re.compile(r"`(plait(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w*])")


def _prose(text: str) -> str:
    """The page without its fenced blocks (links and headings in code are not links)."""
    out, fence = [], None
    for line in text.split("\n"):
        match = re.match(r"^(`{3,})", line)
        if match and (fence is None or line.rstrip() == fence):
            fence = match.group(1) if fence is None else None
            out.append("")
            continue
        out.append("" if fence else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """Python-Markdown's toc slug (what MkDocs uses) of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path) -> set[str]:
    return {slug(m.group(2)) for m in map(_HEADING.match, _prose(path.read_text()).split("\n")) if m}


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_links_resolve():
    problems = []
    for page in pages():
        for match in _LINK.finditer(_prose(page.read_text())):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z]+:", target):
                continue                                   # http:, mailto:, ...
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: link {target!r}"
            if not path.exists():
                problems.append(f"{where}: {path_part} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{where}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_in_the_nav():
    nav = set(re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == nav, f"in docs/ but not in mkdocs.yml's nav: {sorted(on_disk - nav)}; " \
                           f"in the nav but missing: {sorted(nav - on_disk)}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{name}")
                    continue
                except (ModuleNotFoundError, AttributeError):
                    return False
            obj = getattr(obj, name)
        return True
    return False


def test_named_plait_modules_and_names_exist():
    """Every `plait.x.y` the pages name (in backticks) imports: a moved or renamed module
    fails here. The moved-modules page names the old paths on purpose."""
    missing = []
    for page in pages():
        if page.name == "moved-modules.md":
            continue
        for dotted in sorted(set(_DOTTED.findall(page.read_text()))):
            if not _resolves(dotted):
                missing.append(f"{page.relative_to(ROOT)}: {dotted}")
    assert not missing, "\n".join(missing)
