"""The hostile-user probes of issue 16, replayed against whichever plait Python imports.

    python bench/run_safety_probes.py [--only NAME,...] [--json FILE]
    PYTHONPATH=/path/to/old/src python bench/run_safety_probes.py     # the same probes on another checkout

Each probe does what a careless or hostile user would (two runs on one --out, a
signal to the launcher, absurd sizes, a forged manifest, bad environment values,
...) and judges the outcome from outside plait: exit codes, the process tree in
/proc, listening sockets in /proc/net/tcp{,6}, bytes on disk, peak memory from
getrusage, wall time. It prints one row per probe, "ok" or "BAD" with what was seen,
and the count. Every process a probe starts is killed at the end, survivors
included (found while running by walking /proc). Uses a small GPT (2 processes) and
needs root only for the tmpfs probes (read-only and full disks; skipped otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _load_procfs():
    """This checkout's /proc reader, loaded by path: the probes judge whichever plait is on
    PYTHONPATH (an older one has no plait.testing.procfs) with the same independent eyes."""
    path = Path(__file__).resolve().parents[1] / "src" / "plait" / "testing" / "procfs.py"
    spec = importlib.util.spec_from_file_location("run_safety_procfs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


procfs = _load_procfs()
alive, cmdline, descendants, listening_sockets = procfs.alive, procfs.cmdline, procfs.descendants, \
    procfs.listening_sockets
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--data-max-bytes", "60000",
        "--global-batch", "8", "--micro-batch", "2", "--dp", "2", "--pp", "1", "--eval-interval", "0",
        "--sample-chars", "0", "--timeout-s", "60"]
PLAIT = [sys.executable, "-m", "plait"]


class Processes:
    """Every process a probe starts, and everything below it, killed at the end."""

    def __init__(self):
        self.seen: set[int] = set()
        self.started: list[subprocess.Popen] = []

    def start(self, argv, log: Path, **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(), **kwargs)
        self.started.append(process)
        return process

    def note(self) -> list[int]:
        for process in self.started:
            self.seen.update(descendants(process.pid))
            self.seen.add(process.pid)
        return sorted(self.seen)

    def kill_all(self) -> None:
        self.note()
        for pid in self.seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for process in self.started:
            process.wait()


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def plait(*argv, timeout_s=120, env=None, **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([*PLAIT, *argv], capture_output=True, text=True, timeout=timeout_s,
                              env=env or _env(), **kwargs)
    except subprocess.TimeoutExpired as expired:
        return subprocess.CompletedProcess(expired.cmd, -1, expired.stdout or "", f"timed out after {timeout_s} s")


def steps_file(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file() and path.name != ".lock":
            digest.update(path.read_bytes())
    return digest.hexdigest()


def trained_run(work: Path, name: str, steps: int = 6) -> Path:
    out = work / name
    result = plait("train", *TINY, "--steps", str(steps), "--checkpoint-interval", "2", "--keep-checkpoints", "0",
                   "--out", str(out), timeout_s=300)
    if result.returncode != 0:
        raise RuntimeError(f"could not train the run the probe needs: {result.stderr[-500:]}")
    return out


def one_line_error(result: subprocess.CompletedProcess) -> bool:
    text = result.stdout + result.stderr
    return result.returncode not in (0, -1) and "Traceback" not in text and "Error" not in text.replace(
        "error:", "")


def _mount_tmpfs(point: Path, options: str) -> bool:
    point.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                          capture_output=True).returncode == 0


# ----------------------------------------------------------------------------- the probes
def probe_two_runs_one_out(work: Path, procs: Processes):
    out = work / "run"
    first = procs.start([*PLAIT, "train", *TINY, "--steps", "40", "--checkpoint-interval", "10", "--out", str(out)],
                        work / "a.log")
    if not wait_for(lambda: (out / "checkpoints" / "step_00000010" / "manifest.json").exists(), 240):
        return False, "run A never wrote its first checkpoint"
    started = time.monotonic()
    second = procs.start([*PLAIT, "train", *TINY, "--steps", "40", "--seed", "1", "--out", str(out)],
                         work / "b.log")
    second_code = second.wait(timeout=600)
    refused_after_s = time.monotonic() - started
    first.wait(timeout=600)
    steps = steps_file(out)
    intact = steps == list(range(40))
    ok = second_code != 0 and intact and first.returncode == 0
    return ok, (f"B exit {second_code} after {refused_after_s:.1f} s; A exit {first.returncode}; metrics steps "
                f"{'0..39 once each' if intact else f'{len(steps)} records, {len(set(steps))} distinct'}")


def probe_all_checkpoints_corrupt(work: Path, procs: Processes):
    out = trained_run(work, "run")
    for directory in (out / "checkpoints").iterdir():
        shard = directory / "tp0-pp0.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = tree_hash(out)
    result = plait("train", *TINY, "--steps", "10", "--checkpoint-interval", "2", "--out", str(out), timeout_s=300)
    unchanged = tree_hash(out) == before
    return result.returncode != 0 and unchanged, (f"exit {result.returncode}; run directory "
                                                  f"{'unchanged' if unchanged else 'CHANGED'}")


def probe_vanished_checkpoints(work: Path, procs: Processes):
    out = trained_run(work, "run")
    shutil.rmtree(out / "checkpoints")
    before = (out / "metrics.jsonl").read_bytes()
    result = plait("train", *TINY, "--steps", "10", "--out", str(out), timeout_s=300)
    kept = (out / "metrics.jsonl").read_bytes() == before
    return result.returncode != 0 and kept, (f"exit {result.returncode}; metrics.jsonl "
                                             f"{'unchanged' if kept else 'OVERWRITTEN'}")


def _signal_probe(target: str, number: signal.Signals):
    def probe(work: Path, procs: Processes):
        out = work / "run"
        launcher = procs.start([*PLAIT, "train", *TINY, "--steps", "100000", "--checkpoint-interval", "2",
                                "--out", str(out)], work / "run.log")
        # any complete checkpoint: a given step may be pruned (keep 3) before a poll sees it
        if not wait_for(lambda: any((out / "checkpoints").glob("step_*/manifest.json"))
                        or launcher.poll() is not None, 240) or launcher.poll() is not None:
            return False, f"the run wrote no checkpoint (exit {launcher.poll()}): {_last_line(work / 'run.log')}"
        everyone = procs.note()
        agent = [pid for pid in everyone if ("torch.distributed.run" in cmdline(pid)
                                             or "plait.train.agent" in cmdline(pid))]
        os.kill(launcher.pid if target == "launcher" else agent[0], number)
        time.sleep(10)
        survivors = [pid for pid in everyone if alive(pid)]
        return not survivors, f"{len(everyone)} processes; alive 10 s after {number.name}: {len(survivors)}"

    return probe


def _last_line(log: Path) -> str:
    lines = log.read_text().strip().splitlines() if log.exists() else []
    return lines[-1][:150] if lines else "(no output)"


def probe_listening_sockets(work: Path, procs: Processes):
    out = work / "run"
    procs.start([*PLAIT, "train", *TINY, "--steps", "100000", "--checkpoint-interval", "0", "--out", str(out)],
                work / "run.log")
    if not wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size, 240):
        return False, "the run never trained a step"
    sockets = [f"{address}:{port}" for _, address, port in listening_sockets(procs.note())]
    exposed = [entry for entry in sockets if not entry.startswith("127.")]
    return bool(sockets) and not exposed, f"{len(sockets)} listening sockets; not on loopback: {exposed}"


def probe_manifest_traversal(work: Path, procs: Processes):
    out = trained_run(work, "run")
    directory = sorted((out / "checkpoints").iterdir())[-1]
    secret = work / "secret.txt"
    secret.write_text("secret")
    manifest = json.loads((directory / "manifest.json").read_text())
    # the forged names resolve to real files with the sizes and hashes the manifest claims:
    # WORK/run/checkpoints/step_N/../../../secret.txt is WORK/secret.txt
    for name, target in (("../../../secret.txt", secret), ("/etc/hostname", Path("/etc/hostname"))):
        assert (directory / name).resolve() == target.resolve()
        data = target.read_bytes()
        manifest["files"][name] = {"nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    info = plait("checkpoint", "info", str(directory))
    export = plait("checkpoint", "export", str(directory), "--out", str(work / "model.pt"))
    return info.returncode != 0 and export.returncode != 0, (f"info exit {info.returncode}, export exit "
                                                             f"{export.returncode}")


def _bounded(argv, limit_s: float, memory_limit_bytes: int = 6 << 30):
    def probe(work: Path, procs: Processes):
        def limits():
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))

        started = time.monotonic()
        try:
            result = subprocess.run([*PLAIT, *argv], capture_output=True, text=True, timeout=limit_s, env=_env(),
                                    preexec_fn=limits, cwd=work)
        except subprocess.TimeoutExpired:
            return False, f"still running after {limit_s:.0f} s (killed)"
        elapsed = time.monotonic() - started
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        text = result.stdout + result.stderr
        crashed = "MemoryError" in text or "Traceback" in text or result.returncode < 0
        last = (result.stderr.strip().splitlines() or result.stdout.strip().splitlines() or [""])[-1][:110]
        return not crashed, (f"exit {result.returncode} in {elapsed:.1f} s, children's peak RSS so far "
                             f"{peak_mib:.0f} MiB: {last}")

    return probe


def _before_launch(argv, expect_text: str = ""):
    """Refused by the launcher: non-zero, one line, no training process started, fast."""
    def probe(work: Path, procs: Processes):
        started = time.monotonic()
        launcher = procs.start([*PLAIT, "train", *TINY, "--out", str(work / "run"), *argv], work / "run.log")
        seen_workers = 0
        while launcher.poll() is None and time.monotonic() - started < 120:
            seen_workers = max(seen_workers, sum("plait train" in cmdline(pid) and "--config" in cmdline(pid)
                                                 for pid in descendants(launcher.pid)))
            time.sleep(0.05)
        code = launcher.poll()
        text = (work / "run.log").read_text()
        once = text.count(expect_text) == 1 if expect_text else True
        ok = code not in (None, 0) and seen_workers == 0 and "Traceback" not in text and once
        last = (text.strip().splitlines() or [""])[-1][:110]
        return ok, (f"exit {code} after {time.monotonic() - started:.1f} s, {seen_workers} rank processes started"
                    f"{'' if once else f', {expect_text!r} printed {text.count(expect_text)} times'}: {last}")

    return probe


def probe_small_data_message(work: Path, procs: Processes):
    """The too-small message asks for N characters: N must work and N - 1 must not."""
    text = work / "small.txt"
    text.write_text("abc")
    result = plait("train", *TINY, "--data", str(text), "--dry-run")
    import re

    match = re.search(r"at least ([\d,]+) characters", result.stderr)
    if not match:
        return False, f"no number in: {result.stderr.strip()[-120:]}"
    needed = int(match.group(1).replace(",", ""))
    body = ("the quick brown fox jumps over the lazy dog " * (needed // 40 + 2))[:needed]
    text.write_text(body)
    enough = plait("train", *TINY, "--data", str(text), "--dry-run")
    text.write_text(body[:-1])
    short = plait("train", *TINY, "--data", str(text), "--dry-run")
    return enough.returncode == 0 and short.returncode != 0, (f"asks for {needed}: with {needed} exit "
                                                              f"{enough.returncode}, with {needed - 1} exit "
                                                              f"{short.returncode}")


def probe_full_disk(work: Path, procs: Processes):
    disk = work / "disk"
    if not _mount_tmpfs(disk, "size=640k"):
        return None, "skipped: mounting a tmpfs needs root"
    try:
        result = plait("train", *TINY, "--steps", "6", "--checkpoint-interval", "1", "--keep-checkpoints", "0",
                       "--out", str(disk / "run"), timeout_s=300)
        text = result.stdout + result.stderr
        named = "no space left on device" in text.lower()
        return named and "unexpected pos" not in text and "Traceback" not in text, (
            f"exit {result.returncode}; {'names the full disk' if named else 'does not name the full disk'}"
            + ("; torch's 'unexpected pos'" if "unexpected pos" in text else "")
            + ("; traceback" if "Traceback" in text else ""))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def probe_read_only_out(work: Path, procs: Processes):
    disk = work / "ro"
    if not _mount_tmpfs(disk, "size=1m,ro"):
        return None, "skipped: mounting a tmpfs needs root"
    try:
        result = plait("train", *TINY, "--out", str(disk / "run"))
        return one_line_error(result), f"exit {result.returncode}: {(result.stderr.strip().splitlines() or [''])[-1][:110]}"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def probe_out_is_a_file(work: Path, procs: Processes):
    (work / "file").write_text("x")
    result = plait("train", *TINY, "--out", str(work / "file"))
    return one_line_error(result), f"exit {result.returncode}: {(result.stderr.strip().splitlines() or [''])[-1][:110]}"


def _env_probe(name: str, value: str):
    def probe(work: Path, procs: Processes):
        result = plait("train", *TINY, "--steps", "2", "--out", str(work / "run"), env=_env(**{name: value}),
                       timeout_s=180)
        ok = result.returncode != 0 and not (work / "run" / "metrics.jsonl").exists() and one_line_error(result)
        return ok, f"exit {result.returncode}: {(result.stderr.strip().splitlines() or [''])[-1][:100]}"

    return probe


def probe_bench_output_dir(work: Path, procs: Processes):
    target = work / "missing" / "dir" / "rows.json"
    result = plait("bench", "all_reduce", "--nprocs", "2", "--min-bytes", "1K", "--max-bytes", "1K", "--iters", "2",
                   "--warmup", "1", "--rounds", "1", "--json", str(target), timeout_s=300, cwd=work)
    ok = result.returncode == 0 and target.exists()
    return ok, f"exit {result.returncode}; file {'written' if target.exists() else 'absent'}; " + (
        (result.stderr.strip().splitlines() or [''])[-1][:90])


def probe_broken_pipe(work: Path, procs: Processes):
    reader = subprocess.Popen(f"{sys.executable} -m plait schedule --schedule 1f1b --stages 8 --microbatches 512 "
                              "--actions | head -1", shell=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env())
    _, error = reader.communicate(timeout=120)
    return "Traceback" not in error and "BrokenPipe" not in error, f"stderr: {error.strip()[-100:] or 'empty'}"


def probe_help(work: Path, procs: Processes):
    result = plait("--help")
    return "==SUPPRESS==" not in result.stdout, f"'==SUPPRESS==' x{result.stdout.count('==SUPPRESS==')}"


def probe_resume_missing_dir(work: Path, procs: Processes):
    result = plait("train", *TINY, "--resume", str(work / "nowhere"), "--out", str(work / "run"))
    said = "does not exist" in result.stderr
    return said and result.returncode != 0, f"exit {result.returncode}: {result.stderr.strip()[-110:]}"


PROBES = {
    "two-runs-one-out": probe_two_runs_one_out,
    "resume-all-corrupt": probe_all_checkpoints_corrupt,
    "resume-vanished": probe_vanished_checkpoints,
    "sigterm-launcher": _signal_probe("launcher", signal.SIGTERM),
    "sighup-launcher": _signal_probe("launcher", signal.SIGHUP),
    "sigkill-launcher": _signal_probe("launcher", signal.SIGKILL),
    "sigterm-torchrun": _signal_probe("agent", signal.SIGTERM),
    "sigkill-torchrun": _signal_probe("agent", signal.SIGKILL),
    "listening-sockets": probe_listening_sockets,
    "manifest-traversal": probe_manifest_traversal,
    "plan-1M-gpus": _bounded(["plan", "--gpus", "1048576", "--global-batch", "2097152"], 120),
    "batch-1e8-dry-run": _bounded(["train", "--global-batch", "100000000", "--dry-run"], 120),
    "batch-1e12-dry-run": _bounded(["train", "--global-batch", "1000000000000", "--dry-run"], 60),
    "data-max-bytes-1e11": _bounded(["train", "--data-max-bytes", "100000000000", "--dry-run"], 120),
    "hidden-65536": _before_launch(["--hidden", "65536"]),
    "misspelt-algorithm": _before_launch(["--algorithm", "rign"], expect_text="rign"),
    "model-too-large": _before_launch(["--layers", "50000", "--hidden", "512", "--heads", "8"]),
    "data-too-small-message": probe_small_data_message,
    "full-disk": probe_full_disk,
    "read-only-out": probe_read_only_out,
    "out-is-a-file": probe_out_is_a_file,
    "env-timeout-0": _env_probe("PLAIT_COMM_TIMEOUT_S", "0"),
    "env-timeout-inf": _env_probe("PLAIT_COMM_TIMEOUT_S", "inf"),
    "env-timeout-nan": _env_probe("PLAIT_COMM_TIMEOUT_S", "nan"),
    "env-segment-bytes": _env_probe("PLAIT_COMM_SEGMENT_BYTES", "lots"),
    "env-check": _env_probe("PLAIT_COMM_CHECK", "maybe"),
    "bench-json-missing-dir": probe_bench_output_dir,
    "broken-pipe": probe_broken_pipe,
    "help-suppress": probe_help,
    "resume-missing-dir": probe_resume_missing_dir,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated probe names (default: all)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    names = list(PROBES) if args.only is None else args.only.split(",")
    unknown = [name for name in names if name not in PROBES]
    if unknown:
        parser.error(f"unknown probe(s) {unknown}; valid: {', '.join(PROBES)}")
    import plait

    print(f"plait from {Path(plait.__file__).parent}")
    rows = []
    for name in names:
        procs = Processes()
        with tempfile.TemporaryDirectory(prefix=f"probe-{name}-") as work:
            os.environ["PLAIT_CACHE_DIR"] = str(Path(work) / "cache")  # no probe reads another's data cache
            started = time.monotonic()
            try:
                ok, detail = PROBES[name](Path(work), procs)
            except Exception as error:  # noqa: BLE001 -- a probe that breaks is reported, the rest go on
                ok, detail = False, f"probe raised {type(error).__name__}: {str(error)[:120]}"
            finally:
                procs.kill_all()
        outcome = "skip" if ok is None else "ok" if ok else "BAD"
        rows.append({"probe": name, "outcome": outcome, "detail": detail,
                     "seconds": round(time.monotonic() - started, 1)})
        print(f"{name:<24} {outcome:<4} {rows[-1]['seconds']:>6.1f}s  {detail}", flush=True)
    counts = {outcome: sum(row["outcome"] == outcome for row in rows) for outcome in ("ok", "BAD", "skip")}
    print(f"{counts['ok']} ok, {counts['BAD']} bad, {counts['skip']} skipped of {len(rows)} probes")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
