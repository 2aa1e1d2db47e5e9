"""tests/docs: the slow blocks run only when -m names docs_slow (make docs-check)."""
from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "docs_slow: a docs block that runs only in make docs-check (-m docs_slow)")


def pytest_collection_modifyitems(config, items):
    if "docs_slow" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("docs_slow") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
