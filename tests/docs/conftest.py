"""tests/docs: the slow blocks run only when -m names docs_slow (make docs-check; the
deselection is tests/conftest.py's, with the suite's other opt-in markers)."""
from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "docs_slow: a docs block that runs only in make docs-check (-m docs_slow)")
