"""The hostile-user findings of issue 31, replayed against whichever plait Python imports.

    python bench/hostile_probes.py [--only NAME,...] [--json FILE] [--list]
    PYTHONPATH=/path/to/old/src python bench/hostile_probes.py     # the same probes on another checkout

One probe per finding of the issue (22, grouped as the issue groups them) plus a few
siblings (the same flaw's neighbours, marked "+"). Each does what the hostile user did
and judges the outcome from outside plait only: exit codes, whether the output holds a
"Traceback", whether the error is one line starting "plait <cmd>: error:" (for library
calls: the exception's type and whether its message names the argument), wall time
(a bounded command must answer within 10 s: it runs with a subprocess timeout and its
process group is killed after it), the processes it started (walked in /proc), and the
bytes of a victim directory before and after (sha256 of every file and the listing).
Every process a probe starts is killed at the end. CLI commands run as
``sys.executable -m plait ...``. Probes that need root (a tmpfs, network namespaces)
are skipped without it; a probe that would touch a testbed someone else has up is
skipped too.

The MLP on scikit-learn's digits is the smallest `plait train` (1 process, ~25 s of
which ~13 s is start-up); the runs several probes need are trained once per
invocation and copied.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


def _load_procfs():
    """This checkout's /proc reader, loaded by path: the probes judge whichever plait is on
    PYTHONPATH with the same independent eyes."""
    path = Path(__file__).resolve().parents[1] / "src" / "plait" / "testing" / "procfs.py"
    spec = importlib.util.spec_from_file_location("hostile_probes_procfs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


procfs = _load_procfs()
PLAIT = [sys.executable, "-m", "plait"]
BOUND_S = 10.0  # a bounded command answers within this
MLP = ["--model", "mlp", "--data", "digits", "--dp", "1", "--tp", "1", "--pp", "1", "--eval-interval", "0",
       "--sample-chars", "0", "--timeout-s", "60"]
STEP_1, STEP_2 = "step_00000001", "step_00000002"


# ----------------------------------------------------------------------------- outside eyes
def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


class Run:
    """One command's outcome, as seen from outside."""

    def __init__(self, argv, code, stdout, stderr, seconds, timed_out=False, workers=0):
        self.argv, self.code, self.stdout, self.stderr = argv, code, stdout, stderr
        self.seconds, self.timed_out, self.workers = seconds, timed_out, workers

    @property
    def text(self) -> str:
        return self.stdout + self.stderr

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.text

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.strip().splitlines() if line.strip()]

    def one_line_error(self, command: str) -> bool:
        """Exit 2, no traceback, and stderr's error is one line `plait <command>: error: ...`."""
        lines = self.error_lines()
        errors = [line for line in lines if line.startswith(f"plait {command}: error:")]
        others = [line for line in lines if not line.startswith(f"plait {command}: error:")]
        return (self.code == 2 and not self.traceback and len(errors) == 1
                and not any("Error:" in line for line in others))

    def last(self, width: int = 150) -> str:
        lines = self.error_lines() or self.stdout.strip().splitlines() or ["(no output)"]
        return lines[-1][:width]

    def summary(self) -> str:
        if self.timed_out:
            return f"still running after {self.seconds:.0f} s (killed)"
        return f"exit {self.code} in {self.seconds:.1f} s{', traceback' if self.traceback else ''}: {self.last()}"


def _is_worker(pid: int) -> bool:
    """A process a command started to do work (multiprocessing's resource tracker and
    forkserver are bookkeeping, not workers)."""
    line = procfs.cmdline(pid)
    return bool(line) and "resource_tracker" not in line and "forkserver" not in line


def run(argv, *, timeout_s: float = 60, env=None, cwd=None, memory_limit_bytes=None,
        stop_at_workers: int | None = None) -> Run:
    """``argv`` in its own session, killed (the whole process group, and every process seen
    below it) after ``timeout_s``; with ``stop_at_workers`` also as soon as that many
    worker processes are seen below it (a command that should refuse before starting any)."""
    def limits():
        if memory_limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))

    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, env=env or _env(), cwd=cwd, start_new_session=True,
                                   preexec_fn=limits)
        seen: set[int] = set()
        workers, timed_out = 0, False
        while process.poll() is None:
            below = procfs.descendants(process.pid)
            seen.update(below)
            workers = max(workers, sum(_is_worker(pid) for pid in below))
            if time.monotonic() - started > timeout_s:
                timed_out = True
                break
            if stop_at_workers is not None and workers >= stop_at_workers:
                break
            time.sleep(0.02)
        seconds = time.monotonic() - started
        _kill(process, seen)
        out.seek(0)
        err.seek(0)
        return Run(argv, process.returncode if not timed_out else None, out.read().decode(errors="replace"),
                   err.read().decode(errors="replace"), seconds, timed_out, workers)


def _kill(process: subprocess.Popen, seen: set[int]) -> None:
    seen.update(procfs.descendants(process.pid))
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in seen:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()


def plait(*argv, **kwargs) -> Run:
    return run([*PLAIT, *argv], **kwargs)


def tree_hash(root: Path) -> str:
    """The listing (with link targets) and the bytes of every file under ``root``."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_symlink():
            digest.update(b"->" + os.readlink(path).encode())
        elif path.is_file() and path.name != ".lock":
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def python_script(work: Path, body: str, *, timeout_s: float = 120) -> tuple[Run, dict | None]:
    """Runs ``body`` (which sets ``result``, a JSON-able dict) as a script in ``work``;
    returns the run and the result. Functions for plait.testing must be importable by the
    spawned ranks: the script is a module in ``work``, put on their PYTHONPATH."""
    name = f"probe_{abs(hash(body)) % 10 ** 8}"
    (work / f"{name}.py").write_text(textwrap.dedent(body) + textwrap.dedent(f"""
        if __name__ == "__main__":
            import json, sys
            with open({str(work / 'result.json')!r}, "w") as handle:
                json.dump(main(), handle)
        """))
    (work / "result.json").unlink(missing_ok=True)
    path = os.pathsep.join(filter(None, [str(work), os.environ.get("PYTHONPATH", "")]))
    outcome = run([sys.executable, str(work / f"{name}.py")], timeout_s=timeout_s, env=_env(PYTHONPATH=path), cwd=work)
    result = json.loads((work / "result.json").read_text()) if (work / "result.json").exists() else None
    return outcome, result


def _mount_tmpfs(point: Path, options: str) -> bool:
    point.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                          capture_output=True).returncode == 0


def _testbed_namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in listing.stdout.splitlines() if line.startswith("plait-tb")]


# ----------------------------------------------------------------------------- shared runs
class Shared:
    """What several probes need, made once per invocation: a trained MLP run (2 steps, a
    checkpoint at each) and its launcher's output."""

    def __init__(self, root: Path):
        self.root = root
        self._trained: tuple[Path, Run] | None = None

    def trained(self) -> tuple[Path, Run]:
        if self._trained is None:
            out = self.root / "trained"
            result = plait("train", *MLP, "--steps", "2", "--checkpoint-interval", "1", "--keep-checkpoints", "0",
                           "--out", str(out), timeout_s=300)
            if result.code != 0 or not (out / "checkpoints" / STEP_2 / "manifest.json").exists():
                raise RuntimeError(f"could not train the run the probes need: {result.summary()}")
            self._trained = out, result
        return self._trained

    def copy(self, work: Path, name: str) -> Path:
        source, _ = self.trained()
        target = work / name
        shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns(".lock"))
        return target


def _rewrite_manifest(directory: Path, **changes) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key].update(value)
        else:
            manifest[key] = value
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))


# ----------------------------------------------------------------------------- 1. links, forged manifests
def probe_linked_step_pruned(work: Path, shared: Shared):
    """RUN's newest step directory is a link to VICTIM's; train on with --keep-checkpoints 1."""
    victim = shared.copy(work, "victim")
    run_dir = work / "run"
    shutil.copytree(victim / "checkpoints" / STEP_1, run_dir / "checkpoints" / STEP_1)
    (run_dir / "checkpoints" / STEP_2).symlink_to(victim / "checkpoints" / STEP_2)
    before = tree_hash(victim)
    result = plait("train", *MLP, "--steps", "3", "--checkpoint-interval", "1", "--keep-checkpoints", "1",
                   "--out", str(run_dir), timeout_s=240)
    intact = tree_hash(victim) == before
    return intact and not result.traceback, f"victim {'unchanged' if intact else 'CHANGED'}; {result.summary()}"


def probe_linked_checkpoints_dir(work: Path, shared: Shared):
    """+ RUN/checkpoints itself a link to VICTIM/checkpoints; train on with --keep-checkpoints 1."""
    victim = shared.copy(work, "victim")
    run_dir = work / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(victim / "checkpoints")
    before = tree_hash(victim)
    result = plait("train", *MLP, "--steps", "3", "--checkpoint-interval", "1", "--keep-checkpoints", "1",
                   "--out", str(run_dir), timeout_s=240)
    intact = tree_hash(victim) == before
    return intact and not result.traceback, f"victim {'unchanged' if intact else 'CHANGED'}; {result.summary()}"


def probe_linked_step_info(work: Path, shared: Shared):
    """+ `checkpoint info` on the linked step directory itself: not called complete."""
    victim = shared.copy(work, "victim")
    link = work / "run" / "checkpoints" / "step_00000200"
    link.parent.mkdir(parents=True)
    link.symlink_to(victim / "checkpoints" / STEP_2)
    result = plait("checkpoint", "info", str(link))
    return result.one_line_error("checkpoint") and "link" in result.stderr, result.summary()


def _forged(work: Path, shared: Shared, **changes) -> Path:
    run_dir = shared.copy(work, "run")
    directory = run_dir / "checkpoints" / STEP_2
    _rewrite_manifest(directory, **changes)
    return directory


def probe_forged_step(work: Path, shared: Shared):
    directory = _forged(work, shared, step=999999, data_position=999999)
    result = plait("checkpoint", "info", str(directory))
    return result.one_line_error("checkpoint"), result.summary()


def probe_forged_step_export(work: Path, shared: Shared):
    """+ the same forgery through `checkpoint export` (it exported step 999999)."""
    directory = _forged(work, shared, step=999999, data_position=999999)
    result = plait("checkpoint", "export", str(directory), "--out", str(work / "model.pt"))
    return result.one_line_error("checkpoint") and not (work / "model.pt").exists(), result.summary()


def probe_forged_tp(work: Path, shared: Shared):
    directory = _forged(work, shared, mesh={"tp": 2})
    result = plait("checkpoint", "info", str(directory))
    return result.one_line_error("checkpoint"), result.summary()


def probe_long_file_name(work: Path, shared: Shared):
    run_dir = shared.copy(work, "run")
    directory = run_dir / "checkpoints" / STEP_2
    files = json.loads((directory / "manifest.json").read_text())["files"]
    _rewrite_manifest(directory, files={**files, "y" * 5000: {"nbytes": 1, "sha256": "0" * 64}})
    result = plait("checkpoint", "info", str(directory))
    return result.one_line_error("checkpoint") and len(result.stderr) < 1000, result.summary()


def probe_long_path_argument(work: Path, shared: Shared):
    """+ a 5,000-character path given to `checkpoint info` itself."""
    result = plait("checkpoint", "info", str(work / ("y" * 5000)))
    return result.one_line_error("checkpoint") and len(result.stderr) < 1000, result.summary()


# ----------------------------------------------------------------------------- 2. mismatched roots
ROOTS_SCRIPT = """
    import torch
    from plait import comm
    from plait.testing import run_fresh_world

    def rank_fn(rank, world_size, collective, numel):
        comm.init_communicator(None, comm.CommConfig(timeout_s=8.0, transport="shm"))
        x = torch.full((numel,), float(rank + 1))
        try:
            if collective == "broadcast":
                comm.broadcast(x, src=rank)
            else:
                sources = [torch.full((numel,), 10.0 + i) for i in range(world_size)]
                comm.scatter(x, sources, src=rank)
            return {"raised": None, "x0": x[0].item()}
        except Exception as error:  # the probe reports what each rank saw
            return {"raised": type(error).__name__, "message": str(error)[:300], "x0": x[0].item()}

    def main():
        return {"ranks": run_fresh_world(rank_fn, 2, COLLECTIVE, NUMEL, timeout_s=90)}
    """


def _roots_probe(collective: str, numel: int):
    def probe(work: Path, shared: Shared):
        body = ROOTS_SCRIPT.replace("COLLECTIVE", repr(collective)).replace("NUMEL", str(numel))
        outcome, result = python_script(work, body, timeout_s=120)
        if result is None:
            return False, f"no result from the world: {outcome.summary()}"
        ranks = result["ranks"]
        named = [r["raised"] is not None and "root" in r.get("message", "") for r in ranks]
        seen = "; ".join(f"rank {i}: " + (f"{r['raised']}: {r['message'][:70]}" if r["raised"] else
                                          f"returned, x[0]={r['x0']:g}") for i, r in enumerate(ranks))
        return all(named), seen

    return probe


# ----------------------------------------------------------------------------- 3. unbounded commands
def _refused_before_workers(argv, command: str, *, timeout_s: float = BOUND_S, expect: str = ""):
    """Exit 2 in one line within ``timeout_s``, no worker process started (killed at the first)."""
    def probe(work: Path, shared: Shared):
        result = plait(*argv, timeout_s=timeout_s, cwd=work, stop_at_workers=1,
                       memory_limit_bytes=None)
        ok = (not result.timed_out and result.workers == 0 and result.one_line_error(command)
              and expect in result.stderr)
        started = f"{result.workers} worker(s) started (killed); " if result.workers else ""
        return ok, started + result.summary()

    return probe


def _bounded(argv, *, limit_s: float = BOUND_S, memory_limit_bytes: int = 4 << 30):
    """Answers within ``limit_s`` (any exit 0 or 2) without a traceback."""
    def probe(work: Path, shared: Shared):
        result = plait(*argv, timeout_s=limit_s, cwd=work, memory_limit_bytes=memory_limit_bytes)
        crashed = result.traceback or "MemoryError" in result.text
        ok = not result.timed_out and result.code in (0, 2) and not crashed
        return ok, result.summary()

    return probe


def _half_ram() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) // 2 // 1024}M"  # kB -> MiB, half of it
    return "8G"


def probe_bench_half_ram(work: Path, shared: Shared):
    """+ a size between a quarter of RAM and RAM (half of it): it would be attempted."""
    return _refused_before_workers(["bench", "all_reduce", "--nprocs", "2", "--min-bytes", _half_ram(),
                                    "--max-bytes", _half_ram()], "bench")(work, shared)


# ----------------------------------------------------------------------------- 4. tracebacks and late errors
def probe_fp16_divergence(work: Path, shared: Shared):
    result = plait("train", *MLP, "--steps", "80", "--checkpoint-interval", "0", "--precision", "fp16-mixed",
                   "--lr", "1e30", "--optimizer", "sgd", "--lr-schedule", "constant", "--out", str(work / "run"),
                   timeout_s=240)
    diverged = "diverged" in result.text
    ok = diverged and result.code == 2 and not result.traceback
    return ok, f"{'diverged named' if diverged else 'divergence NOT named'}; {result.summary()}"


def probe_bench_bad_topology(work: Path, shared: Shared):
    (work / "bad.json").write_text('{"bogus": 1}')
    return _refused_before_workers(["bench", "all_reduce", "--nprocs", "2", "--min-bytes", "1K", "--max-bytes",
                                    "1K", "--topology", str(work / "bad.json")], "bench")(work, shared)


def probe_bench_missing_topology(work: Path, shared: Shared):
    """+ --topology naming no file."""
    return _refused_before_workers(["bench", "all_reduce", "--nprocs", "2", "--min-bytes", "1K", "--max-bytes",
                                    "1K", "--topology", str(work / "missing.json")], "bench")(work, shared)


FACTORIES = """
import torch
from torch import nn


def wrong_shape():
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), (torch.randn(2, 5),)


def inputs_tuple():
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), (torch.randn(2, 8),)


def inputs_tensor():
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), torch.randn(2, 8)
"""


def _optimize_probe(spec: str, timeout_s: float = 60):
    def probe(work: Path, shared: Shared):
        (work / "user_factories.py").write_text(FACTORIES)
        result = plait("optimize", spec, timeout_s=timeout_s, cwd=work)
        return result.one_line_error("optimize") and not result.timed_out, result.summary()

    return probe


def probe_hierarchy_dry_run(work: Path, shared: Shared):
    result = plait("train", *MLP, "--dp", "4", "--algorithm", "hierarchical", "--dry-run", "--out",
                   str(work / "run"), env=_env(PLAIT_HIERARCHY="foo"), timeout_s=60, stop_at_workers=2)
    return result.one_line_error("train") and "PLAIT_HIERARCHY" in result.stderr, result.summary()


def probe_hierarchy_launch(work: Path, shared: Shared):
    """+ the same without --dry-run: refused before any rank starts."""
    result = plait("train", *MLP, "--dp", "4", "--nprocs", "4", "--algorithm", "hierarchical", "--steps", "2",
                   "--out", str(work / "run"), env=_env(PLAIT_HIERARCHY="foo"), timeout_s=60, stop_at_workers=2)
    ok = result.workers == 0 and result.one_line_error("train")
    return ok, f"{result.workers} processes below the launcher; {result.summary()}"


def probe_testbed_missing_script(work: Path, shared: Shared):
    """The missing script is named first. (With a testbed up, the old code ended in torchrun's
    traceback; with none up it says "no testbed is up", which does not name the script.)"""
    if os.geteuid() != 0:
        return None, "skipped: the testbed needs root"
    result = plait("testbed", "run", "--", "nonexistent.py", cwd=work, timeout_s=30)
    return result.one_line_error("testbed") and "nonexistent.py" in result.stderr, result.summary()


OFFLOAD_SCRIPT = """
    import torch
    from plait.memory.offload import ActivationOffloader

    def main():
        directory = DIRECTORY
        offloader = ActivationOffloader(directory, min_bytes=1024)
        weight = torch.ones(512, 512, dtype=torch.float64, requires_grad=True)  # 2 MiB saved on a 1 MiB disk
        inputs = torch.ones(512, 512, dtype=torch.float64, requires_grad=True)
        offloader.begin((0, 0))
        try:
            with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
                (inputs * weight).sum()
            return {"raised": None}
        except Exception as error:
            return {"raised": type(error).__name__, "message": str(error)[:400]}
    """


def probe_offload_disk_full(work: Path, shared: Shared):
    disk = work / "disk"
    if not _mount_tmpfs(disk, "size=1m"):
        return None, "skipped: mounting a tmpfs needs root"
    try:
        body = OFFLOAD_SCRIPT.replace("DIRECTORY", repr(str(disk / "offload")))
        outcome, result = python_script(work, body, timeout_s=60)
        if result is None:
            return False, f"no result: {outcome.summary()}"
        message = result.get("message", "")
        ok = result["raised"] is not None and str(disk / "offload") in message and "bytes" in message
        return ok, f"{result['raised']}: {message[:140]}"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def probe_testbed_ranks_per_host_0(work: Path, shared: Shared):
    if os.geteuid() != 0:
        return None, "skipped: the testbed needs root"
    if _testbed_namespaces():
        return None, "skipped: a testbed is up (someone else's): not touching it"
    try:
        result = plait("testbed", "up", "--hosts", "2", "--ranks-per-host", "0", timeout_s=60)
        created = _testbed_namespaces()
        ok = result.one_line_error("testbed") and not created
        return ok, f"{len(created)} plait-tb namespaces created; {result.summary()}"
    finally:
        if _testbed_namespaces():
            plait("testbed", "down", timeout_s=60)


def _unknown_env_probe(*argv, command: str):
    def probe(work: Path, shared: Shared):
        result = plait(*argv, env=_env(PLAIT_COMM_TIMEOUTS="5"), cwd=work, timeout_s=60, stop_at_workers=2)
        ok = result.one_line_error(command) and "PLAIT_COMM_TIMEOUTS" in result.stderr
        return ok, result.summary()

    return probe


def probe_mlp_units(work: Path, shared: Shared):
    _, result = shared.trained()
    says = sorted({unit for unit in ("samples/s", "tokens/s", "tok/s") if unit in result.stdout})
    ok = "samples/s" in result.stdout and "tokens/s" not in result.stdout and "tok/s" not in result.stdout
    return ok, f"the MLP run's output says {', '.join(says) or 'no unit'}"


# ----------------------------------------------------------------------------- 5. unclear library errors
LIBRARY_SCRIPT = """
    import torch
    from torch import nn
    from plait import comm
    from plait.testing import run_fresh_world

    def rank_fn(rank, world_size, case):
        comm.init_communicator(None, comm.CommConfig(timeout_s=8.0))
        try:
            if case == "all_reduce_list":
                comm.all_reduce([1, 2, 3])
            elif case == "broadcast_str":
                comm.broadcast("abc", src=0)
            elif case == "dataparallel_str":
                from plait.parallel import DataParallel
                DataParallel("net")
            elif case == "zero_str":
                from plait.parallel import ZeRO
                ZeRO("net", lambda params: torch.optim.SGD(params, lr=0.1))
            return {"raised": None}
        except Exception as error:
            return {"raised": type(error).__name__, "message": str(error)[:300]}

    def main():
        return {"ranks": run_fresh_world(rank_fn, 1, CASE, timeout_s=90)}
    """


def _library_probe(case: str, argument: str):
    """A TypeError whose message names the argument."""
    def probe(work: Path, shared: Shared):
        outcome, result = python_script(work, LIBRARY_SCRIPT.replace("CASE", repr(case)), timeout_s=120)
        if result is None:
            return False, f"no result: {outcome.summary()}"
        seen = result["ranks"][0]
        ok = seen["raised"] == "TypeError" and argument in seen.get("message", "")
        return ok, f"{seen['raised']}: {seen.get('message', '')[:130]}"

    return probe


def probe_resume_run_dir(work: Path, shared: Shared):
    victim = shared.copy(work, "victim")
    before = tree_hash(victim)
    result = plait("train", *MLP, "--steps", "3", "--checkpoint-interval", "0", "--resume", str(victim), "--out",
                   str(work / "new"), timeout_s=240)
    intact = tree_hash(victim) == before
    resumed = f"resuming from {victim / 'checkpoints' / STEP_2}" in result.text
    ok = result.code == 0 and resumed and intact
    return ok, (f"{'resumed from its newest checkpoint' if resumed else 'did NOT resume from its newest checkpoint'}"
                f"; victim {'unchanged' if intact else 'CHANGED'}; {result.summary()}")


# ----------------------------------------------------------------------------- 6. the README's sequence
def probe_calibrate_then_tune(work: Path, shared: Shared):
    cache = work / "cache"
    env = _env(PLAIT_CACHE_DIR=str(cache))
    calibrated = plait("calibrate", "--nprocs", "4", "--min-bytes", "16K", "--max-bytes", "1M", "--factor", "4",
                       "--reps", "1", "--max-calls", "2", "--time-budget", "0.001", "--no-ping-pong", env=env,
                       timeout_s=180, cwd=work)
    if calibrated.code != 0:
        return False, f"calibrate failed: {calibrated.summary()}"
    saved = sorted(path.name for path in cache.glob("profile-*.json"))
    shown = plait("tune", "--show", "--p", "4", env=env, timeout_s=60, cwd=work)
    default = "no calibration profile" in shown.text
    ok = shown.code == 0 and not default and any(name in shown.text for name in saved)
    return ok, (f"calibrate saved {saved}; tune --show exit {shown.code}, "
                f"{'prints the DEFAULT table' if default else 'reads the profile'}"
                f"{'' if any(name in shown.text for name in saved) else ' (names no profile file)'}")


def probe_plan_module_factory(work: Path, shared: Shared):
    """`plan --module` and `optimize` take the same factory: (module, (inputs,)) and (module, tensor)."""
    (work / "user_factories.py").write_text(FACTORIES)
    seen, ok = [], True
    for command in ("plan", "optimize"):
        for factory in ("inputs_tuple", "inputs_tensor"):
            argv = ["optimize", f"user_factories:{factory}"] if command == "optimize" else \
                ["plan", "--module", f"user_factories:{factory}", "--gpus", "1", "--global-batch", "2"]
            result = plait(*argv, cwd=work, timeout_s=60)
            ok = ok and result.code == 0
            why = "" if result.code == 0 else f" ({result.last(70)})"
            seen.append(f"{command} {factory}: exit {result.code}{why}")
    return ok, "; ".join(seen)


# ----------------------------------------------------------------------------- the table
PROBES = {
    # 1. data loss: links, forged manifests
    "linked-step-pruned": probe_linked_step_pruned,
    "+linked-checkpoints-dir": probe_linked_checkpoints_dir,
    "+linked-step-info": probe_linked_step_info,
    # 2. a silent wrong result
    "roots-broadcast-shm-1KB": _roots_probe("broadcast", 256),
    "+roots-broadcast-shm-1MB": _roots_probe("broadcast", 1 << 18),
    "+roots-scatter-shm-1KB": _roots_probe("scatter", 256),
    # 3. unbounded commands
    "bench-nprocs-1000": _refused_before_workers(["bench", "all_reduce", "--nprocs", "1000", "--min-bytes", "1K",
                                                  "--max-bytes", "1K"], "bench"),
    "+calibrate-nprocs-1000": _refused_before_workers(["calibrate", "--nprocs", "1000", "--min-bytes", "1K",
                                                       "--max-bytes", "2K", "--output", "p.json"], "calibrate"),
    "simulate-100000-nodes": _bounded(["simulate", "--topology", "dgx-a100", "--nodes", "100000"]),
    "schedule-ring-100000": _bounded(["schedule", "all_reduce", "ring", "-n", "100000", "--numel", "10"]),
    "schedule-1f1b-10000x100000": _bounded(["schedule", "--schedule", "1f1b", "--stages", "10000",
                                            "--microbatches", "100000"]),
    "bench-min-bytes-100G": _refused_before_workers(["bench", "all_reduce", "--nprocs", "2", "--min-bytes", "100G",
                                                     "--max-bytes", "100G"], "bench"),
    "+bench-half-ram": probe_bench_half_ram,
    # 4. forged manifests
    "forged-step-999999": probe_forged_step,
    "+forged-step-export": probe_forged_step_export,
    "forged-tp2-over-tp1": probe_forged_tp,
    "manifest-5000-char-name": probe_long_file_name,
    "+info-5000-char-path": probe_long_path_argument,
    # 5. tracebacks and late errors
    "fp16-divergence": probe_fp16_divergence,
    "bench-bad-topology": probe_bench_bad_topology,
    "+bench-missing-topology": probe_bench_missing_topology,
    "optimize-os-system": _optimize_probe("os:system"),
    "+optimize-math-pi": _optimize_probe("math:pi"),
    "optimize-wrong-shape": _optimize_probe("user_factories:wrong_shape", timeout_s=120),
    "hierarchy-foo-dry-run": probe_hierarchy_dry_run,
    "+hierarchy-foo-launch": probe_hierarchy_launch,
    "testbed-run-missing-script": probe_testbed_missing_script,
    "offload-disk-full": probe_offload_disk_full,
    "testbed-ranks-per-host-0": probe_testbed_ranks_per_host_0,
    "unknown-env-cost-table": _unknown_env_probe("cost", "table", "--p", "8", "--nbytes", "100MB", command="cost"),
    "+unknown-env-train-dry-run": _unknown_env_probe("train", *MLP, "--dry-run", "--out", "run", command="train"),
    "mlp-samples-per-s": probe_mlp_units,
    # 6. unclear errors kept from last time
    "all-reduce-list": _library_probe("all_reduce_list", "tensor"),
    "+broadcast-str": _library_probe("broadcast_str", "tensor"),
    "dataparallel-str": _library_probe("dataparallel_str", "module"),
    "zero-str": _library_probe("zero_str", "module"),
    "resume-run-dir": probe_resume_run_dir,
    # 7. the README's sequence
    "calibrate-then-tune-show": probe_calibrate_then_tune,
    "plan-module-vs-optimize": probe_plan_module_factory,
}
FINDINGS = [name for name in PROBES if not name.startswith("+")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated probe names (default: all)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    parser.add_argument("--list", action="store_true", help="list the probes and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(PROBES))
        return 0
    names = list(PROBES) if args.only is None else args.only.split(",")
    unknown = [name for name in names if name not in PROBES]
    if unknown:
        parser.error(f"unknown probe(s) {unknown}; valid: {', '.join(PROBES)}")
    import plait

    print(f"plait from {Path(plait.__file__).parent}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostile-shared-") as shared_root:
        shared = Shared(Path(shared_root))
        saved_cache = os.environ.get("PLAIT_CACHE_DIR")
        for name in names:
            with tempfile.TemporaryDirectory(prefix="hostile-probe-") as work:
                os.environ["PLAIT_CACHE_DIR"] = str(Path(work) / "cache")  # no probe reads another's cache
                started = time.monotonic()
                try:
                    ok, detail = PROBES[name](Path(work), shared)
                except Exception as error:  # noqa: BLE001 -- a probe that breaks is reported, the rest go on
                    ok, detail = False, f"probe raised {type(error).__name__}: {str(error)[:200]}"
            outcome = "skip" if ok is None else "ok" if ok else "BAD"
            rows.append({"probe": name, "finding": not name.startswith("+"), "outcome": outcome, "detail": detail,
                         "seconds": round(time.monotonic() - started, 1)})
            print(f"{name:<28} {outcome:<4} {rows[-1]['seconds']:>6.1f}s  {detail}", flush=True)
        if saved_cache is None:
            os.environ.pop("PLAIT_CACHE_DIR", None)
        else:
            os.environ["PLAIT_CACHE_DIR"] = saved_cache
    counts = {outcome: sum(row["outcome"] == outcome for row in rows) for outcome in ("ok", "BAD", "skip")}
    findings = [row for row in rows if row["finding"]]
    print(f"{len(rows)} probes: {counts['ok']} ok, {counts['BAD']} bad, {counts['skip']} skipped "
          f"(findings: {sum(r['outcome'] == 'ok' for r in findings)} ok, {sum(r['outcome'] == 'BAD' for r in findings)}"
          f" bad of {len(findings)}; siblings: {len(rows) - len(findings)})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
