"""plait.train.checkpoint on real sharded payloads built without torch.distributed: a
tiny untied GPT (vocab 13, padded at tp 2 and 4) sliced with shard_tensor, written as
a dp=1, tp=2, pp=2 checkpoint; loading, resharding to tp=4, corruption handling,
pruning, compatibility checks and export."""

import errno
import hashlib
import json
from dataclasses import asdict

import pytest
import torch

from plait.models import GPT, GPTConfig
from plait.parallel.tensor.sharding import ShardSpec, shard_spec, shard_tensor
from plait.train import atomic_files
from plait.train import checkpoint as ckpt, checkpoint_load
from plait.train.checkpoint_write import write_manifest, write_shard
from plait.train import export as export_file

CONFIG = GPTConfig(layers=2, hidden=16, heads=4, seq_len=8, vocab=13, tied_head=False)


def build_reference():
    """(full state, specs {name: [dim, full_size] | None}, fake AdamW state) of the tiny GPT."""
    model = GPT(CONFIG, seed=3)
    params = dict(model.named_parameters())
    full = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    specs = {}
    for name in full:
        spec = shard_spec(params[name])
        specs[name] = None if spec is None else [spec.dim, spec.full_size]
    optimizer = {name: {"exp_avg": 0.1 * tensor + 0.5, "exp_avg_sq": tensor * tensor + 1.0,
                        "step": torch.tensor(7.0)}
                 for name, tensor in full.items()}
    return full, specs, optimizer


@pytest.fixture(scope="module")
def reference():
    return build_reference()


def _stage(name: str, pp_size: int) -> int:
    """Embedding and block 0 on stage 0, the rest on the last stage."""
    first = name in ("embedding.weight", "position") or name.startswith("blocks.0.")
    return 0 if first or pp_size == 1 else pp_size - 1


def _spec(entry):
    return None if entry is None else ShardSpec(*entry)


def _payload(full, specs, optimizer, tp_rank, tp_size, pp_rank, pp_size):
    names = [name for name in full if _stage(name, pp_size) == pp_rank]
    return {
        "format": 1, "tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_rank, "pp_size": pp_size,
        "model": {name: shard_tensor(full[name], _spec(specs[name]), tp_rank, tp_size) for name in names},
        "specs": {name: specs[name] for name in names},
        "optimizer": {name: {key: shard_tensor(value, _spec(specs[name]), tp_rank, tp_size)
                             if value.shape == full[name].shape else value
                             for key, value in optimizer[name].items()} for name in names},
        "extra": {"dropout_calls": 5, "rng": torch.get_rng_state(), "note": f"tp{tp_rank}"},
    }


def _manifest(step, tp_size, pp_size, model=None):
    return {"step": step, "mesh": {"dp": 1, "tp": tp_size, "pp": pp_size, "order": "tp-dp-pp"},
            "config": {"lr": 1e-3}, "config_digest": "abc", "model": model or asdict(CONFIG),
            "corpus_digest": "def", "data_position": step, "created_unix_s": 1700000000.0}


def _write(run_dir, step, payloads, tp_size, pp_size):
    directory = ckpt.checkpoint_dir(run_dir, step)
    files = [write_shard(directory, ckpt.shard_name(p["tp_rank"], p["pp_rank"]), p) for p in payloads]
    write_manifest(directory, _manifest(step, tp_size, pp_size), files)
    return directory


def save(run_dir, step, reference, tp_size=2, pp_size=2):
    full, specs, optimizer = reference
    payloads = [_payload(full, specs, optimizer, tp, tp_size, pp, pp_size)
                for pp in range(pp_size) for tp in range(tp_size)]
    return _write(run_dir, step, payloads, tp_size, pp_size)


def _assert_state_equal(got, want):
    assert list(sorted(got)) == list(sorted(want))
    for name in want:
        if isinstance(want[name], dict):
            _assert_state_equal(got[name], want[name])
        else:
            assert got[name].shape == want[name].shape, name
            assert torch.equal(got[name], want[name]), name


def _flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_names_and_paths(tmp_path):
    assert ckpt.checkpoint_dir(tmp_path, 100) == tmp_path / "checkpoints" / "step_00000100"
    assert ckpt.shard_name(1, 3) == "tp1-pp3.pt"
    with pytest.raises(ValueError, match="step=-1"):
        ckpt.checkpoint_dir(tmp_path, -1)


def test_write_shard_is_atomic_and_loads_with_weights_only(tmp_path, reference):
    full, specs, optimizer = reference
    payload = _payload(full, specs, optimizer, 1, 2, 0, 2)
    entry = write_shard(tmp_path / "d", "tp1-pp0.pt", payload)
    path = tmp_path / "d" / "tp1-pp0.pt"
    assert entry["name"] == "tp1-pp0.pt" and entry["nbytes"] == path.stat().st_size
    assert entry["sha256"] == ckpt.file_sha256(path)
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["tp1-pp0.pt"]  # no temporary file left
    loaded = torch.load(path, weights_only=True)
    assert loaded["tp_rank"] == 1 and loaded["extra"]["dropout_calls"] == 5
    # the vocabulary is padded 13 -> 14 at tp 2: rank 1 holds rows 7..12 and one zero row
    assert torch.equal(loaded["model"]["embedding.weight"][:6], full["embedding.weight"][7:])
    assert torch.equal(loaded["model"]["embedding.weight"][6], torch.zeros(16))


def test_write_shard_stores_views_compactly(tmp_path):
    big = torch.arange(1000.0)
    payload = {"format": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
               "model": {"w": big[:4]}, "specs": {"w": None}}
    entry = write_shard(tmp_path, "tp0-pp0.pt", payload)
    assert entry["nbytes"] < 2000  # not the 4000-byte storage of the view


@pytest.mark.parametrize("extra, message", [({"gen": torch.Generator()}, r"payload\['extra'\]\['gen'\]"),
                                             ({(1, 2): 3}, "use str or int keys")])
def test_write_shard_rejects_what_weights_only_cannot_read(tmp_path, extra, message):
    payload = {"format": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
               "model": {}, "specs": {}, "extra": extra}
    with pytest.raises(TypeError, match=message):
        write_shard(tmp_path, "tp0-pp0.pt", payload)
    assert list(tmp_path.iterdir()) == []


def test_write_shard_checks_shapes_against_specs(tmp_path):
    payload = {"format": 1, "tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1,
               "model": {"w": torch.zeros(6, 4)}, "specs": {"w": [0, 13]}}
    with pytest.raises(ValueError, match=r"w has shape \(6, 4\) but spec \[0, 13\] at tp_size 2 means 7"):
        write_shard(tmp_path, "tp0-pp0.pt", payload)


def test_write_shard_name_must_match_the_coordinates(tmp_path, reference):
    full, specs, optimizer = reference
    with pytest.raises(ValueError, match="'tp0-pp1.pt' does not match tp_rank 1, pp_rank 0"):
        write_shard(tmp_path, "tp0-pp1.pt", _payload(full, specs, optimizer, 1, 2, 0, 2))


def test_write_manifest_requires_the_mesh_grid(tmp_path, reference):
    full, specs, optimizer = reference
    directory = tmp_path / "c"
    files = [write_shard(directory, "tp0-pp0.pt", _payload(full, specs, optimizer, 0, 2, 0, 2))]
    with pytest.raises(ValueError, match=r"missing \['tp0-pp1.pt', 'tp1-pp0.pt', 'tp1-pp1.pt'\]"):
        write_manifest(directory, _manifest(1, 2, 2), files)
    assert not (directory / "manifest.json").exists()


def test_load_full_reproduces_the_full_state(tmp_path, reference):
    full, specs, optimizer = reference
    directory = save(tmp_path, 100, reference)
    assert ckpt.verify(directory) == []
    manifest, model, optimizer_state, got_specs = checkpoint_load.load_full(directory)
    assert manifest["step"] == 100 and manifest["format"] == 1 and len(manifest["files"]) == 4
    assert got_specs == specs
    _assert_state_equal(model, full)
    _assert_state_equal(optimizer_state, optimizer)
    assert all(tensor.is_contiguous() for tensor in model.values())


def test_reshard_to_tp4_then_load_again(tmp_path, reference):
    full, specs, optimizer = reference
    _, model, optimizer_state, got_specs = checkpoint_load.load_full(save(tmp_path / "a", 100, reference))
    payloads = []
    for pp in range(2):
        names = [name for name in model if _stage(name, 2) == pp]
        for tp in range(4):
            model_shard, optimizer_shard = checkpoint_load.reshard(model, optimizer_state, got_specs, tp, 4, names)
            payloads.append({"format": 1, "tp_rank": tp, "tp_size": 4, "pp_rank": pp, "pp_size": 2,
                             "model": model_shard, "specs": {name: got_specs[name] for name in names},
                             "optimizer": optimizer_shard, "extra": {}})
            if "embedding.weight" in names:
                # 13 rows padded to 16: 4 per rank, the last rank's last 3 rows zero (Adam state too)
                assert model_shard["embedding.weight"].shape == (4, 16)
                assert model_shard["blocks.0.attention.proj.weight"].shape == (16, 4)
                if tp == 3:
                    assert torch.equal(model_shard["embedding.weight"][1:], torch.zeros(3, 16))
                    assert torch.equal(optimizer_shard["embedding.weight"]["exp_avg_sq"][1:], torch.zeros(3, 16))
                    assert torch.equal(model_shard["embedding.weight"][0], full["embedding.weight"][12])
                assert optimizer_shard["embedding.weight"]["step"].shape == ()
    directory = _write(tmp_path / "b", 100, payloads, 4, 2)
    _, model4, optimizer4, specs4 = checkpoint_load.load_full(directory)
    _assert_state_equal(model4, full)
    _assert_state_equal(optimizer4, optimizer)
    assert specs4 == specs


def test_reshard_to_tp1_gives_the_full_tensors(reference):
    full, specs, optimizer = reference
    model_shard, optimizer_shard = checkpoint_load.reshard(full, optimizer, specs, 0, 1, ["head", "ln_f.bias"])
    _assert_state_equal(model_shard, {"head": full["head"], "ln_f.bias": full["ln_f.bias"]})
    _assert_state_equal(optimizer_shard, {"head": optimizer["head"], "ln_f.bias": optimizer["ln_f.bias"]})
    with pytest.raises(ValueError, match=r"no parameter \['blocks.9.ln1.weight'\]"):
        checkpoint_load.reshard(full, optimizer, specs, 0, 1, ["blocks.9.ln1.weight"])
    with pytest.raises(ValueError, match="tp_rank=2, tp_size=2"):
        checkpoint_load.reshard(full, optimizer, specs, 2, 2, ["head"])


def test_load_full_from_a_single_rank_checkpoint(tmp_path, reference):
    full, _, _ = reference
    _, model, _, _ = checkpoint_load.load_full(save(tmp_path, 5, reference, tp_size=1, pp_size=1))
    _assert_state_equal(model, full)


def test_corrupt_byte_falls_back_to_the_older_checkpoint(tmp_path, reference):
    older = save(tmp_path, 100, reference)
    newer = save(tmp_path, 200, reference)
    _flip_byte(newer / "tp0-pp1.pt")
    assert ckpt.verify(newer) == ["tp0-pp1.pt sha256 mismatch (corrupt)"]
    lines = []
    assert ckpt.latest_complete(tmp_path, log=lines.append) == older
    assert lines == ["step_00000200: tp0-pp1.pt sha256 mismatch (corrupt): using step_00000100"]
    with pytest.raises(ValueError, match="sha256 mismatch"):
        checkpoint_load.load_full(newer)


def test_partial_truncated_and_missing_are_skipped(tmp_path, reference):
    older = save(tmp_path, 100, reference)
    truncated = save(tmp_path, 200, reference)
    path = truncated / "tp1-pp0.pt"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    missing = save(tmp_path, 300, reference)
    (missing / "tp1-pp1.pt").unlink()
    partial = save(tmp_path, 400, reference)
    (partial / "manifest.json").unlink()
    assert ckpt.list_checkpoints(tmp_path) == [older, truncated, missing, partial]
    assert ckpt.verify(truncated) == [f"tp1-pp0.pt is {size // 2} bytes, manifest says {size} (truncated or "
                                      "overwritten)"]
    assert ckpt.verify(missing) == ["tp1-pp1.pt missing"]
    lines = []
    assert ckpt.latest_complete(tmp_path, log=lines.append) == older
    assert lines == [
        "step_00000400: no manifest.json (partial: the save did not finish): using step_00000100",
        "step_00000300: tp1-pp1.pt missing: using step_00000100",
        f"step_00000200: tp1-pp0.pt is {size // 2} bytes, manifest says {size} (truncated or overwritten): "
        "using step_00000100",
    ]
    with pytest.raises(ValueError, match="has no manifest.json: it is a partial checkpoint"):
        ckpt.read_manifest(partial)


def test_no_complete_checkpoint(tmp_path, reference):
    assert ckpt.latest_complete(tmp_path / "nothing") is None
    partial = save(tmp_path, 100, reference)
    (partial / "manifest.json").write_text("{not json")
    lines = []
    assert ckpt.latest_complete(tmp_path, log=lines.append) is None
    assert lines == ["step_00000100: manifest.json unreadable (JSONDecodeError: Expecting property name enclosed in "
                     "double quotes: line 1 column 2 (char 1)): no complete checkpoint left"]


def _write_raw(directory, payloads, tp_size, pp_size):
    """Shards saved with plain torch.save (as a buggy writer might), then the manifest."""
    directory.mkdir(parents=True)
    files = []
    for name, payload in payloads.items():
        torch.save(payload, directory / name)
        data = (directory / name).read_bytes()
        files.append({"name": name, "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    write_manifest(directory, _manifest(1, tp_size, pp_size), files)
    return directory


@pytest.mark.parametrize("change, message, problem", [
    ({"tp_rank": 0}, r"tp1-pp0.pt holds tp_rank 0, pp_rank 0, which does not match its name",
     "tp1-pp0.pt holds tp_rank 0 of tp_size 2, pp_rank 0 of pp_size 2; its name and the manifest's mesh say "
     "tp_rank 1 of 2, pp_rank 0 of 2 (not valid)"),
    ({"tp_size": 3}, r"shards disagree on \(tp_size, pp_size\): \[\(2, 2\), \(3, 2\)\]",
     "tp1-pp0.pt holds tp_rank 1 of tp_size 3, pp_rank 0 of pp_size 2; its name and the manifest's mesh say "
     "tp_rank 1 of 2, pp_rank 0 of 2 (not valid)"),
    ({"format": 2}, r"shard format 2 != 1", "tp1-pp0.pt: shard format 2 != 1; this plait reads format 1 only"),
])
def test_load_full_rejects_an_inconsistent_grid(tmp_path, reference, change, message, problem):
    """Sizes and hashes agree with the manifest, the contents do not: verify (info,
    resume, export) names the shard, and the loader refuses it too."""
    full, specs, optimizer = reference
    payloads = {ckpt.shard_name(tp, pp): _payload(full, specs, optimizer, tp, 2, pp, 2)
                for pp in range(2) for tp in range(2)}
    payloads["tp1-pp0.pt"].update(change)
    directory = _write_raw(tmp_path / "c", payloads, 2, 2)
    assert ckpt.verify(directory) == [problem]
    with pytest.raises(ValueError, match=message):
        checkpoint_load.load_full(directory, check_files=False)


def test_load_full_rejects_a_parameter_in_two_stages(tmp_path, reference):
    full, specs, optimizer = reference
    payloads = {ckpt.shard_name(tp, pp): _payload(full, specs, optimizer, tp, 2, pp, 2)
                for pp in range(2) for tp in range(2)}
    for tp in range(2):
        for key in ("model", "specs"):
            payloads[f"tp{tp}-pp1.pt"][key]["position"] = payloads[f"tp{tp}-pp0.pt"][key]["position"]
    directory = _write_raw(tmp_path / "c", payloads, 2, 2)
    assert ckpt.verify(directory) == ["'position' is in pipeline stages 0 and 1; each tensor belongs to one stage"]
    with pytest.raises(ValueError, match="position is in pipeline stages 0 and 1"):
        checkpoint_load.load_full(directory, check_files=False)


def test_load_full_rejects_disagreeing_replicas(tmp_path, reference):
    full, specs, optimizer = reference
    payloads = [_payload(full, specs, optimizer, tp, 2, pp, 2) for pp in range(2) for tp in range(2)]
    payloads[3]["model"]["ln_f.weight"] = payloads[3]["model"]["ln_f.weight"] + 1
    directory = _write(tmp_path, 1, payloads, 2, 2)
    with pytest.raises(ValueError, match=r"ln_f.weight \(pp 1\) differs between tp rank 0 and tp rank 1"):
        checkpoint_load.load_full(directory)
    _, model, _, _ = checkpoint_load.load_full(directory, check_replicas=False)
    assert torch.equal(model["ln_f.weight"], full["ln_f.weight"])


def test_check_compatible_names_every_differing_field(tmp_path, reference):
    manifest = ckpt.read_manifest(save(tmp_path, 100, reference))
    checkpoint_load.check_compatible(manifest, asdict(CONFIG))
    other = asdict(GPTConfig(layers=6, hidden=32, heads=4, seq_len=8, vocab=13, tied_head=False))
    with pytest.raises(ValueError) as error:
        checkpoint_load.check_compatible(manifest, other)
    assert str(error.value) == ("checkpoint step_00000100 was saved for a different model: layers 2 != 6, "
                                "hidden 16 != 32; train with the same model settings or start a new --out "
                                "directory")


def test_prune_keeps_the_newest_complete(tmp_path, reference):
    steps = [100, 200, 300, 400, 500]
    dirs = {step: save(tmp_path, step, reference) for step in steps}
    (dirs[200] / "manifest.json").unlink()  # partial, older than the newest complete: deleted
    (dirs[500] / "manifest.json").unlink()  # partial, newer (maybe still being written): kept
    deleted = ckpt.prune(tmp_path, keep=2)
    assert deleted == [dirs[100], dirs[200]]
    assert ckpt.list_checkpoints(tmp_path) == [dirs[300], dirs[400], dirs[500]]
    assert ckpt.prune(tmp_path, keep=1) == [dirs[300]]
    assert ckpt.latest_complete(tmp_path, log=None) == dirs[400]
    with pytest.raises(ValueError, match="keep=0 must be an int >= 1"):
        ckpt.prune(tmp_path, keep=0)


@pytest.mark.parametrize("suffix, fmt", [(".safetensors", None), (".pt", None), (".weights", "torch"),
                                         (".st", "safetensors")])
def test_export_loads_into_gpt_strictly(tmp_path, reference, suffix, fmt):
    full, _, _ = reference
    save(tmp_path, 100, reference)
    newest = save(tmp_path, 200, reference)
    _flip_byte(newest / "tp1-pp1.pt")
    lines = []
    out = export_file.export(tmp_path, tmp_path / f"model{suffix}", fmt, log=lines.append)  # a run dir: step 100
    assert lines == ["step_00000200: tp1-pp1.pt sha256 mismatch (corrupt): using step_00000100"]
    if (fmt or export_file.export_format(out)) == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        state = load_file(out)
        with safe_open(out, "pt") as file:
            metadata = file.metadata()
        assert json.loads(metadata["model"]) == asdict(CONFIG) and metadata["step"] == "100"
    else:
        state = torch.load(out, weights_only=True)
    model = GPT(GPTConfig(**ckpt.read_manifest(ckpt.checkpoint_dir(tmp_path, 100))["model"]))
    model.load_state_dict(state, strict=True)
    _assert_state_equal(model.state_dict(), full)


def test_export_format_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the format of .*model.bin2"):
        export_file.export_format(tmp_path / "model.bin2")
    with pytest.raises(ValueError, match="format 'onnx' is not one of"):
        export_file.export_format(tmp_path / "model.pt", "onnx")
    with pytest.raises(ValueError, match="neither a checkpoint directory"):
        export_file.export(tmp_path, tmp_path / "model.pt")


# ----------------------------------------------------------------------------- confinement
@pytest.mark.parametrize("name", ["../../../../secret.txt", "/etc/hostname", "sub/tp0-pp0.pt", "..", "a\\b"])
def test_a_manifest_naming_files_outside_its_directory_is_not_valid(tmp_path, reference, name):
    """The probe: a manifest listing ../../../../secret.txt and /etc/hostname (with their
    true sizes and hashes) was reported complete, and export torch.load-ed them."""
    directory = save(tmp_path / "run", 100, reference)
    outside = tmp_path / "secret.txt"
    outside.write_bytes(b"not a shard")
    manifest = json.loads((directory / "manifest.json").read_text())
    target = {"../../../../secret.txt": outside, "/etc/hostname": outside}.get(name, outside)
    manifest["files"][name] = {"nbytes": target.stat().st_size,
                               "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    problems = ckpt.verify(directory)
    assert problems == [f"manifest.json lists files outside the checkpoint directory: {name!r} (not valid)"]
    with pytest.raises(ValueError, match="plain names inside its directory"):
        ckpt.read_manifest(directory)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint_load.load_full(directory)
    with pytest.raises(ValueError, match="plain names"):
        checkpoint_load.load_full(directory, check_files=False)  # the loader itself never opens such a name
    assert ckpt.latest_complete(tmp_path / "run", log=None) is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        export_file.export(directory, tmp_path / "model.pt", log=None)


def test_a_shard_that_is_a_symlink_leading_out_is_not_valid(tmp_path, reference):
    directory = save(tmp_path / "run", 100, reference)
    real = tmp_path / "elsewhere.pt"
    (directory / "tp0-pp0.pt").rename(real)  # same bytes, same hash: only the link is wrong
    (directory / "tp0-pp0.pt").symlink_to(real)
    assert ckpt.verify(directory) == ["tp0-pp0.pt is a symbolic link (a checkpoint's files are regular files "
                                      "inside it)"]
    (directory / "tp0-pp0.pt").unlink()
    real.rename(directory / "tp0-pp0.pt")
    assert ckpt.verify(directory) == []
    manifest = directory / "manifest.json"
    (tmp_path / "manifest.json").write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(tmp_path / "manifest.json")
    assert ckpt.verify(directory) == ["manifest.json is a symbolic link (a checkpoint's files are regular files "
                                      "inside it)"]


# ----------------------------------------------------------------------------- a full disk
@pytest.fixture
def tiny_disk(small_tmpfs):
    """A 512 KiB tmpfs: a real filesystem that fills up."""
    return small_tmpfs("512k")


def test_a_full_disk_is_named_with_the_path_and_the_bytes_needed(tiny_disk):
    """Before: torch.save's "unexpected pos 64 vs 0". Now: no space left on device, the
    path, the bytes needed and free; no temporary file left; nothing counted complete."""
    payload = {"format": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
               "model": {"w": torch.zeros(1 << 18)}, "specs": {"w": None}}  # 1 MiB of weights
    directory = tiny_disk / "step_00000001"
    with pytest.raises(OSError) as full:
        write_shard(directory, "tp0-pp0.pt", payload)
    assert full.value.errno == errno.ENOSPC
    message = str(full.value)
    assert "no space left on device writing" in message and str(directory / "tp0-pp0.pt") in message
    assert f"needs about {(1 << 20) + (1 << 16):,} bytes" in message and "bytes are free" in message
    assert list(directory.iterdir()) == []
    assert ckpt.verify(directory) == ["no manifest.json (partial: the save did not finish)"]


def test_a_write_that_outgrows_its_estimate_still_says_disk_full(tiny_disk):
    """The free-space check passed (the estimate was low); the write itself hits ENOSPC."""
    target = tiny_disk / "big.bin"
    with pytest.raises(OSError, match="no space left on device writing .*big.bin") as full:
        atomic_files.atomic_write(target, lambda temp: atomic_files.torch_save({"w": torch.zeros(1 << 18)}, temp),
                                  nbytes=1024)
    assert full.value.errno == errno.ENOSPC
    assert list(tiny_disk.iterdir()) == []
