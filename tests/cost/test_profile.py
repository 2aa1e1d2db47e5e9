"""Profiles: JSON round trip, the default path, machine-mismatch warnings, bad files."""

import dataclasses
import json
import sys
import warnings

import pytest

from plait.cost.link import LinkModel
from plait.cost.profile import (calibrate_command, DEFAULT_PROFILE_BACKEND, default_profile_path, link_for_world,
                                load_profile, machine_identity, MachineIdentity, Profile, profile_backend,
                                ProfileMismatchWarning, Sample, save_profile)


def make_profile(**changes):
    samples = (Sample(kind="shift", steps=1, nbytes=1024, reduce=False, time_s=2e-3, rep_times_s=(2e-3, 2.1e-3)),
               Sample(kind="shift", steps=4, nbytes=1 << 20, reduce=True, time_s=9e-3),
               Sample(kind="ping_pong", steps=1, nbytes=1024, reduce=False, time_s=1e-4))
    fields = dict(link=LinkModel(8e-4, 1.1e-9, 2.5e-10), call_overhead_s=9e-4, backend="gloo+shm", device="cpu",
                  world_size=4, sizes_nbytes=(1024, 1 << 20), samples=samples,
                  r2={"shift": 0.93, "ping_pong": 0.7}, notes=("a note",),
                  ping_pong_link=LinkModel(1.5e-4, 5e-10))
    fields.update(changes)
    return Profile(**fields)


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


def test_round_trip_through_the_default_path(cache_dir):
    profile = make_profile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same machine: no warning
        path = save_profile(profile, cache_dir=cache_dir)
        assert path == cache_dir / "profile-gloo+shm.json"  # plait calibrate's default transport's
        loaded = load_profile(cache_dir=cache_dir)
    assert loaded == profile
    assert loaded.samples[0].rep_times_s == (2e-3, 2.1e-3)
    assert loaded.machine == machine_identity()
    assert json.loads(path.read_text())["format"] == "plait-profile"


def test_explicit_path_and_missing_file(tmp_path, cache_dir):
    assert load_profile(cache_dir=cache_dir) is None
    assert load_profile(backend="nccl", cache_dir=cache_dir) is None
    assert load_profile(tmp_path / "nowhere.json") is None
    target = save_profile(make_profile(backend="nccl", device="cuda (H100)"), tmp_path / "sub" / "p.json")
    assert target == tmp_path / "sub" / "p.json"
    assert load_profile(target).backend == "nccl"
    assert not cache_dir.exists()


def test_default_path_is_the_cache_dir_given_and_no_environment_variable(monkeypatch, tmp_path):
    """The library reads no environment variable: the CLI resolves PLAIT_CACHE_DIR and
    XDG_CACHE_HOME (tests/cli/test_cache_dir.py) and passes the directory down."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "plait"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_profile_path("gloo") == tmp_path / "home" / ".cache" / "plait" / "profile-gloo.json"
    assert default_profile_path("nccl", tmp_path / "given") == tmp_path / "given" / "profile-nccl.json"
    # no backend: the one plait calibrate saves by default (gloo workers over plait's shared memory)
    assert DEFAULT_PROFILE_BACKEND == profile_backend("gloo", "shm") == "gloo+shm"
    assert default_profile_path(cache_dir=tmp_path / "given") == tmp_path / "given" / "profile-gloo+shm.json"
    with pytest.raises(ValueError, match="not a backend name"):
        default_profile_path("../etc")


def test_other_machine_warns_listing_every_differing_field(cache_dir):
    now = machine_identity()
    other = dataclasses.replace(now, hostname="elsewhere", cpu_model="Some Other CPU", torch_version="1.0.0")
    save_profile(make_profile(machine=other), cache_dir=cache_dir)
    with pytest.warns(ProfileMismatchWarning) as caught:
        loaded = load_profile(cache_dir=cache_dir)
    assert loaded is not None and loaded.machine == other  # still returned
    message = str(caught[0].message)
    for fragment in ("hostname: stored 'elsewhere', now " + repr(now.hostname),
                     "cpu_model: stored 'Some Other CPU'", "torch_version: stored '1.0.0', now "
                     + repr(now.torch_version), "re-run `plait calibrate --nprocs 4` on this machine"):
        assert fragment in message
    for same in ("cpu_count", "python_version", "plait_version"):
        assert same not in message


def test_machine_identity_reads_torch_from_metadata_not_import():
    identity = machine_identity()
    assert identity.cpu_count >= 1 and identity.hostname and identity.cpu_model
    assert identity.python_version == ".".join(map(str, sys.version_info[:3]))
    assert identity.torch_version[0].isdigit()
    from plait import __version__
    assert identity.plait_version == __version__


def test_link_for_world():
    profile = make_profile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert link_for_world(profile, 4) is profile.link
    with pytest.warns(ProfileMismatchWarning, match="measured with 4 ranks, not 8"):
        assert link_for_world(profile, 8) is profile.link


def test_the_calibrate_command_of_each_profile():
    """The command a message suggests saves that profile (calibrate has no --backend gloo+shm)."""
    assert calibrate_command() == "plait calibrate"
    assert calibrate_command("gloo+shm", 4) == "plait calibrate --nprocs 4"
    assert calibrate_command("gloo", 8) == "plait calibrate --transport gloo --nprocs 8"
    assert calibrate_command("nccl") == "plait calibrate --backend nccl"
    with pytest.warns(ProfileMismatchWarning, match=r"re-run `plait calibrate --transport gloo --nprocs 8`"):
        link_for_world(make_profile(backend="gloo"), 8)


def _write(cache_dir, document) -> str:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / "profile-gloo+shm.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


def _good_document():
    return make_profile().as_dict()


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d.pop("link"), "field 'link' is missing"),
    (lambda d: d["link"].pop("beta_s_per_byte"), "field 'link.beta_s_per_byte' is missing"),
    (lambda d: d["link"].update(beta_s_per_byte=-1.0), "field 'link' is not a valid link"),
    (lambda d: d.update(version=0), "field 'version' is 0, this plait reads versions 1, 2"),
    (lambda d: d.update(format="something"), "field 'format'"),
    (lambda d: d.update(world_size="4"), "field 'world_size' must be an integer"),
    (lambda d: d["machine"].pop("cpu_model"), "field 'machine.cpu_model' is missing"),
    (lambda d: d["samples"][1].update(time_s=-1.0), "field 'samples[1]' is invalid"),
    (lambda d: d["samples"][0].pop("nbytes"), "field 'samples[0].nbytes' is missing"),
    (lambda d: d["r2"].update(shift="high"), "field 'r2.shift' must be a number"),
    (lambda d: d.update(call_overhead_s=-1.0), "call_overhead_s=-1.0 must be a finite number >= 0"),
])
def test_malformed_files_name_the_file_and_the_field(cache_dir, edit, fragment):
    document = _good_document()
    edit(document)
    path = _write(cache_dir, document)
    with pytest.raises(ValueError) as error:
        load_profile(cache_dir=cache_dir)
    assert path in str(error.value) and fragment in str(error.value)
    assert "plait calibrate" in str(error.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_not_a_profile_at_all(cache_dir, text):
    path = _write(cache_dir, text)
    with pytest.raises(ValueError, match=r"profile .*profile-gloo\+shm.json"):
        load_profile(cache_dir=cache_dir)
    assert path


def test_profile_validation_names_every_bad_value():
    with pytest.raises(ValueError) as error:
        make_profile(call_overhead_s=float("nan"), world_size=1, backend="", sizes_nbytes=(0,))
    text = str(error.value)
    for fragment in ("call_overhead_s=nan", "world_size=1", "backend=''", "sizes_nbytes=(0,)"):
        assert fragment in text
    with pytest.raises(ValueError, match="kind='other'.*steps=0"):
        Sample(kind="other", steps=0, nbytes=1, reduce=False, time_s=1.0)


def test_identity_differences():
    a = MachineIdentity(hostname="a", cpu_model="x", cpu_count=2, torch_version="1", python_version="3",
                        plait_version="0.1")
    assert a.differences(a) == []
    b = dataclasses.replace(a, cpu_count=8)
    assert a.differences(b) == ["cpu_count: stored 2, now 8"]


def test_cost_modules_import_neither_torch_nor_comm():
    import subprocess

    code = ("import sys, plait.cost.profile, plait.cost.calibration; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('plait.comm')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
