"""`plait calibrate` end to end: 2 spawned gloo ranks, a few small sizes, the saved
profile parses and holds positive parameters; argument errors."""

import json
import warnings

import pytest

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
    assert profile.sizes_nbytes == (16 << 10, 256 << 10, 4 << 20)
    # beta > 0 always (the fit refuses otherwise); the split of the per-call latency
    # between c and alpha, and gamma, are at the mercy of this shared machine's noise
    # at so few samples: each is >= 0 (clamped, with a note) and together they are > 0
    link = profile.link
    assert link.beta_s_per_byte > 0 and link.alpha_s >= 0 and link.gamma_s_per_byte >= 0
    assert profile.call_overhead_s >= 0 and profile.call_overhead_s + link.alpha_s > 0
    assert len(profile.notes) == len([n for n in profile.notes if "clamped to 0" in n])
    kinds = {(s.kind, s.steps, s.reduce) for s in profile.samples}
    assert kinds == {("shift", 1, False), ("shift", 1, True), ("shift", 4, False), ("shift", 4, True),
                     ("ping_pong", 1, False)}
    assert all(len(s.rep_times_s) == 3 for s in profile.samples)
    assert set(profile.r2) >= {"shift", "shift_copy", "shift_reduce", "ping_pong"}


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
