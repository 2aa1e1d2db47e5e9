"""plait.names is the vocabulary cost/ and plan/ share with the torch layers: importing
any of its modules must not import torch."""

import pkgutil
import subprocess
import sys

import plait.names

MODULES = sorted(f"plait.names.{info.name}" for info in pkgutil.iter_modules(plait.names.__path__))

CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    assert "torch" not in sys.modules, f"importing {name} imported torch"
print("ok")
"""


def test_names_modules_are_torch_free():
    assert {"plait.names.axes", "plait.names.wire", "plait.names.collectives"} <= set(MODULES)
    for module in ["plait.names", *MODULES]:  # one process each: every module alone
        result = subprocess.run([sys.executable, "-c", CHECK, module], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
