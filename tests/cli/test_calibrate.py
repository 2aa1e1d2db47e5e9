"""`plait calibrate` end to end: 2 spawned gloo ranks, a few small sizes, the saved
profile parses and holds positive parameters; argument errors."""

import json
import warnings

import pytest

from plait.cli.environment import cache_dir
from plait.cli.main import main
from plait.cost.profile import load_profile

QUICK = ["--min-bytes", "16K", "--max-bytes", "4M", "--factor", "16", "--steps", "1,4", "--reps", "3",
         "--time-budget", "0.01"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calibrate_saves_a_profile_with_positive_parameters(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "profile.json"
    status = main(["calibrate", "--nprocs", "2", *QUICK, "--output", str(path), "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    document = json.loads(captured.out)  # --json: the profile on stdout, the tables on stderr
    assert f"profile saved to {path}" in captured.err
    assert "alpha" in captured.err and "GB/s" in captured.err and "R^2" in captured.err
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured here: no mismatch warning
        profile = load_profile(path)
    assert profile.as_dict() == document
    assert not (tmp_path / "cache").exists()  # --output wins over the cache path
    # measured through plait's shared memory (the default transport), and named so
    assert profile.world_size == 2 and profile.backend == "gloo+shm" and profile.device == "cpu"
    assert profile.sizes_nbytes == (64, 256, 16 << 10, 256 << 10, 4 << 20)  # the calls' sizes, then the shifts'
    # beta > 0 always (the fit refuses otherwise); the split of the per-call latency
    # between c and alpha, and gamma, are at the mercy of this shared machine's noise
    # at so few samples: each is >= 0 (clamped, with a note) and together they are > 0
    link = profile.link
    assert link.beta_s_per_byte > 0 and link.alpha_s >= 0 and link.gamma_s_per_byte >= 0
    assert profile.call_overhead_s >= 0 and profile.call_overhead_s + link.alpha_s > 0
    assert len(profile.notes) == len([n for n in profile.notes if "clamped to 0" in n])
    kinds = {(s.kind, s.steps, s.reduce) for s in profile.samples if s.kind != "call"}
    assert kinds == {("shift", 1, False), ("shift", 1, True), ("shift", 4, False), ("shift", 4, True),
                     ("ping_pong", 1, False)}
    assert all(len(s.rep_times_s) == 3 for s in profile.samples)
    assert set(profile.r2) >= {"shift", "shift_copy", "shift_reduce", "ping_pong"}
    # real calls of every kind at 64 and 256 B fit each kind's software cost (>= 0), the transport model's
    calls = {(s.collective, s.nbytes) for s in profile.samples if s.kind == "call"}
    assert calls == {(kind, n) for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
                     for n in (64, 256)}
    model = profile.transport_model
    assert set(model.call_s) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"}
    assert all(v >= 0 for v in model.call_s.values()) and "real calls" in captured.err


@pytest.mark.parametrize("argv, fragment", [
    (["--nprocs", "1"], "needs >= 2 processes"),
    (["--min-bytes", "1K", "--max-bytes", "1K"], "gives one size"),
])
def test_calibrate_user_errors(argv, fragment, capsys):
    assert main(["calibrate", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_calibrate_rejects_a_single_step_count(capsys):
    assert main(["calibrate", "--steps", "4"]) == 2
    assert "need >= 2 distinct ints" in capsys.readouterr().err


def _calibrate_defaults_profile(world_size: int):
    """The profile plait calibrate --nprocs N saves with its defaults, made fast: its name from
    calibrate's own parser defaults and functions, its link fitted (make_profile, as calibrate
    does) to exact samples of t = c + k (alpha + beta n + r gamma n), saved where
    calibrate saves without --output."""
    from plait.bench.launch import choose_backend
    from plait.cli.calibrate import config_from_args
    from plait.cli.main import build_parser
    from plait.cost.calibration import make_profile
    from plait.cost.profile import profile_backend, Sample, save_profile

    args = build_parser("calibrate").parse_args(["calibrate", "--nprocs", str(world_size)])
    name = profile_backend(choose_backend(args.backend, spawned=True), config_from_args(args).transport)
    alpha_s, beta_s_per_byte, gamma_s_per_byte, call_s = 500e-6, 1e-9, 3e-10, 200e-6
    samples = [Sample(kind="shift", steps=steps, nbytes=nbytes, reduce=reduce,
                      time_s=call_s + steps * (alpha_s + beta_s_per_byte * nbytes + reduce * gamma_s_per_byte * nbytes))
               for steps in (1, 4) for nbytes in (16 << 10, 256 << 10, 4 << 20) for reduce in (False, True)]
    profile, _ = make_profile(samples, backend=name, device="cpu", world_size=world_size)
    return save_profile(profile, args.output, cache_dir=cache_dir())  # where calibrate saves: the CLI's directory


def test_tune_show_reads_the_profile_calibrate_saved(tmp_path, capsys, monkeypatch):
    """The README's sequence: plait calibrate --nprocs 4, then plait tune --show --p 4."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    path = _calibrate_defaults_profile(4)
    assert path == tmp_path / "cache" / "profile-gloo+shm.json"
    assert main(["tune", "--show", "--p", "4"]) == 0
    captured = capsys.readouterr()
    assert f"tuner: profile {path}: alpha 500.0 us, 1 GB/s" in captured.out
    assert f"all_reduce, p=4 (profile {path})" in captured.out and "default table" not in captured.out
    assert captured.err == ""  # measured with the p asked for: no note
    # another world size: it says the profile is for 4 ranks, and how to measure 8
    assert main(["tune", "--show", "--p", "8"]) == 0
    captured = capsys.readouterr()
    assert f"tuner: profile {path}" in captured.out
    assert (f"plait tune: note: {path} was measured with 4 ranks, not --p 8: its link may misprice 8-rank "
            f"collectives (re-run plait calibrate --nprocs 8)") in captured.err
    # the TCP profile is calibrate --transport gloo's, read with --backend gloo; none here: the path is named
    assert main(["tune", "--show", "--p", "4", "--backend", "gloo"]) == 0
    assert (f"(the default table (no calibration profile at {tmp_path / 'cache' / 'profile-gloo.json'}: run plait "
            f"calibrate --transport gloo))") in capsys.readouterr().out


def test_every_default_reader_finds_the_profile_calibrate_saved(tmp_path, capsys, monkeypatch):
    """plait cost and plait simulate --topology local read the default profile too."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    _calibrate_defaults_profile(4)
    assert main(["cost", "table", "--nbytes", "1MB", "--p", "4"]) == 0
    out = capsys.readouterr().out
    assert "link alpha 500.00 us, bandwidth 1 GB/s" in out and "calibrated profile" in out
    assert main(["simulate", "--topology", "local", "--nbytes", "1MB", "--algorithm", "ring", "--json"]) == 0
    ring = json.loads(capsys.readouterr().out)["results"][0]
    # each of the ring's 2(p-1) = 6 steps costs at least the profile's alpha (500 us); the
    # placeholder link's 20 us would give well under that
    assert ring["steps"] == 6 and ring["time_s"] >= 6 * 500e-6


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calibrate_then_tune_show_end_to_end(tmp_path, capsys, monkeypatch):
    """A real plait calibrate (2 ranks, few sizes, default path), then plait tune --show --p 2."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["calibrate", "--nprocs", "2", *QUICK]) == 0
    saved = tmp_path / "cache" / "profile-gloo+shm.json"
    calibrated = capsys.readouterr().out
    assert f"profile saved to {saved}" in calibrated
    assert main(["tune", "--show", "--p", "2"]) == 0
    out = capsys.readouterr().out
    assert f"tuner: profile {saved}" in out and "default table" not in out
    assert "# read by default: plait tune --show --p 2" in calibrated  # calibrate says how it is read


@pytest.mark.parametrize("backend", ["gloo+shm", "gloo", "nccl"])
def test_the_suggested_calibrate_command_saves_that_profile(backend):
    """Messages suggest calibrate_command(backend); calibrate's parser takes it and names the profile so."""
    from plait.bench.launch import choose_backend
    from plait.cli.calibrate import config_from_args
    from plait.cli.main import build_parser
    from plait.cost.profile import calibrate_command, profile_backend

    command = calibrate_command(backend, 4).split()
    assert command[:2] == ["plait", "calibrate"]
    args = build_parser("calibrate").parse_args(command[1:])
    assert args.nprocs == 4
    spawned = backend != "nccl"  # nccl is measured under torchrun (choose_backend keeps an explicit nccl)
    assert profile_backend(choose_backend(args.backend, spawned=spawned), config_from_args(args).transport) == backend
