"""A user's model factory (plait.cli.factory): one shape, one set of messages, for
`plait optimize PKG.MOD:FUNCTION` and `plait plan --module PKG.MOD:FUNCTION`.

The factories live in a file written to a temporary directory and imported from there,
as a user's would be (FACTORIES below)."""

import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli.main import main

PLAIT = str(Path(sys.executable).parent / "plait")
PLAN = ["--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "8"]

FACTORIES = '''
import torch
from torch import nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def tensor_form():
    return mlp(), torch.randn(2, 8)


def tuple_form():
    return mlp(), (torch.randn(2, 8),)


def wrong_width():
    return mlp(), (torch.randn(2, 5),)


def wrong_channels():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval(), torch.randn(2, 4, 16, 16)


def returns_none():
    return None


def three_items():
    return mlp(), torch.randn(2, 8), 3


def not_a_module():
    return 5, torch.randn(2, 8)


def a_class():
    return nn.Linear, torch.randn(2, 8)


def raises():
    raise RuntimeError("no weights here")


def needs_arguments(width):
    return mlp(), torch.randn(2, width)


def not_tensors():
    return mlp(), [1, 2]


def one_row_batchnorm():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)).eval(), torch.randn(1, 8)


def two_inputs():
    class Add(nn.Module):
        def forward(self, a, b):
            return a + b
    return Add(), (torch.randn(2, 3), torch.randn(2, 3))


INSTANCE = nn.Linear(8, 4)
'''


@pytest.fixture
def models(tmp_path, monkeypatch):
    """The name of an importable module holding FACTORIES (unique per test)."""
    name = f"user_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return name


def run(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def error_text(err: str, command: str) -> str:
    """The message of a one-line `plait COMMAND: error: MESSAGE`."""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    prefix = f"plait {command}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix):].rstrip("\n")


def test_optimize_of_os_system_is_one_line_exit_2(tmp_path):
    done = subprocess.run([PLAIT, "optimize", "os:system"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("plait optimize: error: factory 'os:system': system(command) needs arguments")
    assert "returns (module, example_inputs)" in done.stderr


def factory_argv(command: str, spec: str) -> list[str]:
    return [command, spec] if command == "optimize" else [command, "--module", spec, *PLAN]


@pytest.mark.parametrize("command", ["optimize", "plan"])
def test_wrong_shaped_inputs_name_the_input_and_the_expected_shape(models, capsys, command):
    status, out, err = run(capsys, *factory_argv(command, f"{models}:wrong_width"))
    assert status == 2
    message = error_text(err, command)
    assert "input 0: (2, 5) float32" in message
    assert "layer '0' (Linear) got input 0, (2, 5) float32 and expects in_features 8: shape (..., 8)" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message  # torch's own words, one line of them
    status, out, err = run(capsys, *factory_argv(command, f"{models}:wrong_channels"))
    assert status == 2
    assert "layer '0' (Conv2d) got input 0, (2, 4, 16, 16) float32 and expects in_channels 3: shape (N, 3, H, W)" \
        in error_text(err, command)


def test_plan_and_optimize_take_the_same_factory_in_both_forms(models, capsys):
    for form in ("tensor_form", "tuple_form"):
        status, out, err = run(capsys, *factory_argv("optimize", f"{models}:{form}"))
        assert status == 0, err
        assert "equivalence: relative error" in out
        status, out, err = run(capsys, *factory_argv("plan", f"{models}:{form}"), "--top", "1")
        assert status == 0, err
        assert f"model: {models}:{form}" in out


@pytest.mark.parametrize("function, fragment", [
    ("returns_none", "returned None: it must name a function taking no arguments that returns (module, "
                     "example_inputs): an nn.Module instance and a tensor or a tuple of tensors"),
    ("three_items", "returned 3 items (Sequential, Tensor, int), not 2"),
    ("not_a_module", "returned (int, Tensor): its first item must be an nn.Module instance"),
    ("a_class", "returned (the class Linear, Tensor): its first item must be an nn.Module instance "
                "(call the class: Linear(...))"),
    ("raises", "calling raises() raised RuntimeError: no weights here"),
    ("needs_arguments", "needs_arguments(width) needs arguments and plait calls it with none"),
    ("not_tensors", "returned example_inputs with non-tensors (item 0 is int, item 1 is int)"),
    ("INSTANCE", "names an nn.Module instance (Linear), not a function"),
    ("missing", "has no 'missing'; its functions: a_class, mlp, needs_arguments"),
])
def test_a_bad_factory_gets_the_same_one_line_error_from_both(models, capsys, function, fragment):
    spec = f"{models}:{function}"
    status, _, err = run(capsys, *factory_argv("optimize", spec))
    assert status == 2
    from_optimize = error_text(err, "optimize")
    status, _, err = run(capsys, *factory_argv("plan", spec))
    assert status == 2
    assert error_text(err, "plan") == from_optimize
    assert from_optimize.startswith(f"factory '{spec}'") and fragment in from_optimize


@pytest.mark.parametrize("spec, fragment", [
    ("os:system", "factory 'os:system': system(command) needs arguments"),
    ("math:pi", "factory 'math:pi' names a float (3.141592653589793), not a function"),
    ("torch.nn:Linear", "factory 'torch.nn:Linear' names the nn.Module class Linear, not a function"),
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz' (ModuleNotFoundError"),
    ("models.py", "factory 'models.py' is a file path, not PKG.MOD:FUNCTION: write models:FUNCTION"),
    ("./models.py:build", "is a file path, not PKG.MOD:FUNCTION: write models:build (plait imports modules "
                          "from the current directory)"),
    ("build", "factory 'build' is not PKG.MOD:FUNCTION"),
])
def test_specs_that_name_no_factory(models, capsys, spec, fragment):
    status, _, err = run(capsys, *factory_argv("optimize", spec))
    assert status == 2
    from_optimize = error_text(err, "optimize")
    status, _, err = run(capsys, *factory_argv("plan", spec))
    assert status == 2
    assert error_text(err, "plan") == from_optimize and fragment in from_optimize


def test_what_only_plan_refuses_is_one_line_too(models, capsys):
    """plan traces one input in training mode (forward and backward); optimize runs both."""
    status, _, err = run(capsys, *factory_argv("plan", f"{models}:two_inputs"))
    assert status == 2
    assert "returned example inputs (2, 3) float32, (2, 3) float32: plait plan --module traces a model called on " \
           "one tensor" in error_text(err, "plan")
    status, _, err = run(capsys, *factory_argv("plan", f"{models}:one_row_batchnorm"))
    assert status == 2
    assert ("tracing its Sequential for the plan (training mode, forward and backward, on (1, 8) float32) failed "
            "(while describing layers[1] (1:BatchNorm1d) on an input of shape (1, 16)): ValueError: Expected more "
            "than 1 value per channel when training") in error_text(err, "plan")
    for function in ("two_inputs", "one_row_batchnorm"):
        status, out, err = run(capsys, *factory_argv("optimize", f"{models}:{function}"))
        assert status == 0, err


def test_help_states_both_forms(capsys):
    for argv in (["optimize", "--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit):
            from plait.cli.main import build_parser
            build_parser(argv[0]).parse_args(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "returns (module, example_inputs)" in text and "no arguments" in text
        assert "a tuple of" in text
