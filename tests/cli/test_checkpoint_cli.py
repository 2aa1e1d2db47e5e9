"""`plait checkpoint info` and `plait checkpoint export` on a tiny tp=2, pp=2
checkpoint (built as in tests/train/test_checkpoint.py): output, exit codes and the
messages of a corrupt or missing checkpoint."""

import pytest
import torch

from plait.cli.main import main
from plait.models import GPT
from tests.train.test_checkpoint import CONFIG, build_reference, save


@pytest.fixture
def run_dir(tmp_path):
    reference = build_reference()
    save(tmp_path, 100, reference)
    save(tmp_path, 200, reference)
    return tmp_path


def test_info_prints_step_mesh_model_and_files(run_dir, capsys):
    assert main(["checkpoint", "info", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step_00000200: complete (4 files verified, sha256)" in out
    assert "step 200, continue data from step 200" in out
    assert "mesh dp=1, tp=2, pp=2 (order tp-dp-pp)" in out
    assert "layers=2, hidden=16, heads=4, seq_len=8, vocab=13" in out
    for name in ("tp0-pp0.pt", "tp1-pp0.pt", "tp0-pp1.pt", "tp1-pp1.pt"):
        assert name in out


def test_info_on_a_corrupt_checkpoint_exits_2(run_dir, capsys):
    path = run_dir / "checkpoints" / "step_00000200" / "tp1-pp0.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert main(["checkpoint", "info", str(path.parent)]) == 2
    err = capsys.readouterr().err
    assert "plait checkpoint: error:" in err and "tp1-pp0.pt sha256 mismatch (corrupt)" in err
    # the run directory falls back to step 100 and says why
    assert main(["checkpoint", "info", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "step_00000200: tp1-pp0.pt sha256 mismatch (corrupt): using step_00000100" in captured.err
    assert "step 100," in captured.out


def test_info_on_a_partial_or_missing_path_exits_2(run_dir, capsys):
    (run_dir / "checkpoints" / "step_00000200" / "manifest.json").unlink()
    assert main(["checkpoint", "info", str(run_dir / "checkpoints" / "step_00000200")]) == 2
    assert "no manifest.json (partial: the save did not finish)" in capsys.readouterr().err
    assert main(["checkpoint", "info", str(run_dir / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("out_name, extra", [("model.safetensors", []), ("model.pt", []),
                                             ("model.bin", ["--format", "safetensors"])])
def test_export_writes_a_strictly_loadable_state_dict(run_dir, tmp_path, capsys, out_name, extra):
    out = tmp_path / "exported" / out_name
    assert main(["checkpoint", "export", str(run_dir), "--out", str(out), *extra]) == 0
    assert f"exported step 200 of {run_dir / 'checkpoints' / 'step_00000200'}" in capsys.readouterr().out
    if out_name.endswith(".pt"):
        state = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file
        state = load_file(out)
    GPT(CONFIG).load_state_dict(state, strict=True)


def test_export_errors_exit_2(run_dir, tmp_path, capsys):
    assert main(["checkpoint", "export", str(run_dir), "--out", str(tmp_path / "model.onnx")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
    for step in (100, 200):
        (run_dir / "checkpoints" / f"step_{step:08d}" / "tp0-pp1.pt").unlink()
    assert main(["checkpoint", "export", str(run_dir), "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert "has no complete checkpoint" in err and "tp0-pp1.pt missing" in err
    assert not (tmp_path / "m.pt").exists()
    assert main(["checkpoint", "export", str(run_dir)]) == 2  # --out is required (argparse)


def test_info_and_export_refuse_a_manifest_naming_files_outside(run_dir, tmp_path, capsys):
    """The probe: a manifest listing ../../../../secret.txt and /etc/hostname was reported
    "complete (4 files verified)" by info, and export torch.load-ed them."""
    import hashlib
    import json

    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    directory = run_dir / "checkpoints" / "step_00000200"
    manifest = json.loads((directory / "manifest.json").read_text())
    entry = {"nbytes": secret.stat().st_size, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    manifest["files"]["../../../../secret.txt"] = entry
    manifest["files"]["/etc/hostname"] = entry
    (directory / "manifest.json").write_text(json.dumps(manifest))
    assert main(["checkpoint", "info", str(directory)]) == 2
    assert "manifest.json lists files outside the checkpoint directory: '../../../../secret.txt'" in \
        capsys.readouterr().err
    assert main(["checkpoint", "export", str(directory), "--out", str(tmp_path / "model.pt")]) == 2
    assert not (tmp_path / "model.pt").exists()
    # the run directory stands for its newest complete checkpoint: step_00000100, named in the skip line
    assert main(["checkpoint", "info", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "step_00000200: manifest.json lists files outside" in captured.err and "step 100," in captured.out


def test_export_to_a_directory_or_under_a_file_is_refused_before_reading(run_dir, tmp_path, capsys):
    (tmp_path / "taken.pt").mkdir()
    (tmp_path / "file").write_text("x")
    for out, reason in ((tmp_path / "taken.pt", "is a directory"), (tmp_path / "file" / "model.pt", "file")):
        assert main(["checkpoint", "export", str(run_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out}" in err and reason in err and "Traceback" not in err
    assert main(["checkpoint", "export", str(run_dir), "--out", str(tmp_path / "new" / "dir" / "model.pt")]) == 0
    assert (tmp_path / "new" / "dir" / "model.pt").is_file()


# --------------------------------------------------------------------------- forged descriptive fields
# Each was a probe of issue 31's review: `info` crashed (OverflowError from time.localtime, "Invalid value NaN
# (not a number)" naming neither field nor file) or called the checkpoint complete and printed the forged
# lines; export accepted it. Now each is named (the field, manifest.json and its directory), exit 2, one line.
@pytest.mark.parametrize("changes, expected", [
    ({"created_unix_s": 1e300}, "manifest.json created_unix_s 1e+300 is not a time"),
    ({"created_unix_s": -1e20}, "manifest.json created_unix_s -1e+20 is not a time"),
    ({"created_unix_s": float("nan")}, "manifest.json created_unix_s nan is not a time"),
    ({"created_unix_s": "yesterday"}, "manifest.json created_unix_s 'yesterday' is not a time"),
    ({"mesh": {"order": "tp,dp\nfake: line"}}, "manifest.json mesh order 'tp,dp\\nfake: line' is not the axes"),
    ({"model": {"dtype": "float64\nfake: line"}}, "manifest.json model dtype='float64\\nfake: line': need a number"),
    ({"model": {"x" * 500: 1}}, "manifest.json model field name 'xxxxx"),
    ({"model": {"note": "y" * 500}}, "manifest.json model note='yyyy"),
    ({"model": [1, 2]}, "manifest.json model [1, 2] is not a mapping"),
    ({"config_digest": ["a", "b"]}, "manifest.json config_digest ['a', 'b'] is list, not a string"),
    ({"corpus_digest": "abc\rdef"}, "manifest.json corpus_digest 'abc\\rdef' holds a control character"),
    ({"config": "lr=1"}, "manifest.json config 'lr=1' is not a mapping of TrainConfig fields"),
])
def test_a_forged_descriptive_field_is_named_by_info_and_export(changes, expected, run_dir, tmp_path, capsys):
    import json

    step = run_dir / "checkpoints" / "step_00000200"
    manifest = json.loads((step / "manifest.json").read_text())
    for key, value in changes.items():
        manifest[key] = {**manifest[key], **value} if key == "mesh" else value
    (step / "manifest.json").write_text(json.dumps(manifest))
    for argv in (["info", str(step)], ["export", str(step), "--out", str(tmp_path / "model.pt")]):
        assert main(["checkpoint", *argv]) == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("plait checkpoint: error: "), err
        assert f"{step} is not a complete checkpoint" in err or str(step) in err
        assert expected in err, err
    assert not (tmp_path / "model.pt").exists()
    # the run directory falls back to the older complete step, saying why
    assert main(["checkpoint", "info", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert expected in captured.err and "using step_00000100" in captured.err and "step 100," in captured.out


def test_a_manifest_past_the_bound_is_refused_without_reading_it_all(run_dir, capsys):
    """A manifest was read in full, whatever its size; now at most 64 MiB (over 500,000 shards' entries)."""
    step = run_dir / "checkpoints" / "step_00000200"
    with (step / "manifest.json").open("r+b") as file:
        file.truncate((64 << 20) + 1)  # sparse past the real manifest
    assert main(["checkpoint", "info", str(step)]) == 2
    err = capsys.readouterr().err
    assert "manifest.json unreadable (larger than 67,108,864 bytes, the most a manifest of 524,288 shards takes)" \
        in err and len(err.strip().splitlines()) == 1
