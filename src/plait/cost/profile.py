"""Calibration profiles: the measured link of one machine kind, saved as JSON.

A :class:`Profile` is what ``plait calibrate`` measured and fitted: the
alpha-beta-gamma :class:`~plait.cost.link.LinkModel` of plait's executor plus the
fixed overhead of one collective call, so a schedule of S steps is priced

    T = call_overhead_s + sum over steps (alpha + beta * max_bytes_moved + gamma * max_bytes_reduced),

together with the raw samples, the R^2 of each fit and the identity of the machine
it was measured on. A profile holds ONE world size: on an oversubscribed machine
(more ranks than cores) alpha grows with the number of ranks, so a profile measured
with p ranks prices p-rank collectives; :func:`link_for_world` warns when asked for
another p. Profiles live in ``default_profile_path(backend, cache_dir)``: the
cache directory (the CLI passes ``$PLAIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/plait``;
a library call given none uses ``~/.cache/plait``), file ``profile-{backend}.json``,
``backend`` as ``profile_backend`` names it ("gloo+shm", "gloo", "nccl"). Without a
backend every reader looks where ``plait calibrate`` saves by default:
``DEFAULT_PROFILE_BACKEND``, gloo with plait's shared memory between the ranks of a
host (``profile-gloo+shm.json``). Pure python (no torch import): it runs anywhere.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import warnings
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from plait import __version__
from plait.cost.link import LinkModel
from plait.cost.transport_model import TransportModel
from plait.files import default_cache_dir, read_small_file

__all__ = ["Sample", "MachineIdentity", "Profile", "ProfileMismatchWarning", "machine_identity", "profile_backend",
           "DEFAULT_PROFILE_BACKEND", "calibrate_command", "default_profile_path", "save_profile", "load_profile",
           "link_for_world"]

FORMAT_NAME = "plait-profile"
# version 2 adds the "call" samples and the fitted transport_model (both optional); version 1
# profiles are still read (they have neither, and are priced with the plain link as before)
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
SAMPLE_KINDS = ("shift", "ping_pong", "call")
# a profile is a few KB (tens of samples of ~200 bytes); one sweeping 1 byte .. 1 TiB at factor 2 holds
# 41 sizes x 7 configurations = 287 samples, ~100 KB with their reps. 16 MiB is over a hundred times that.
PROFILE_LIMIT_NBYTES = 16 << 20


class ProfileMismatchWarning(UserWarning):
    """A stored profile was measured on another machine, torch or plait."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One measured configuration: the median over reps of the per-call time.

    kind "shift": ``steps`` steps of a ring shift, every rank sending ``nbytes`` to
    rank+1 per step (``reduce``: the receiver adds them in); kind "ping_pong": one
    way of a round trip between ranks 0 and 1 (steps = 1); kind "call": one real call
    of plait's ``collective`` (or "p2p": one isend/irecv exchange with the ring
    neighbours) with ``algorithm`` on ``nbytes``, whose messages the model prices as
    ``terms`` = (rounds, beta bytes, gamma bytes) (the shared-host or one-port terms of
    its schedule, as the predictions use them): what is left is the call's software
    cost. ``rep_times_s`` are the per-call times of each rep (max over ranks),
    ``time_s`` their median.
    """

    kind: str
    steps: int
    nbytes: int
    reduce: bool
    time_s: float
    rep_times_s: tuple[float, ...] = ()
    collective: str = ""
    algorithm: str = ""
    terms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rep_times_s", tuple(float(t) for t in self.rep_times_s))
        object.__setattr__(self, "terms", tuple(float(t) for t in self.terms))
        problems = []
        if self.kind == "call" and (not self.collective or len(self.terms) != 3
                                    or any(not math.isfinite(t) or t < 0 for t in self.terms)):
            problems.append(f"a call sample needs a collective (got {self.collective!r}) and terms = (rounds, "
                            f"beta bytes, gamma bytes) >= 0 (got {self.terms!r})")
        if self.kind not in SAMPLE_KINDS:
            problems.append(f"kind={self.kind!r} not in {SAMPLE_KINDS}")
        if not isinstance(self.steps, int) or self.steps < 1:
            problems.append(f"steps={self.steps!r} must be an int >= 1")
        if not isinstance(self.nbytes, int) or self.nbytes < 1:
            problems.append(f"nbytes={self.nbytes!r} must be an int >= 1")
        if not _positive_number(self.time_s):
            problems.append(f"time_s={self.time_s!r} must be a finite number > 0")
        if any(not _positive_number(t) for t in self.rep_times_s):
            problems.append(f"rep_times_s={self.rep_times_s!r} must all be finite and > 0")
        if problems:
            raise ValueError("invalid calibration sample: " + "; ".join(problems)
                             + " (samples come from plait.bench.calibrate; re-run plait calibrate)")


@dataclass(frozen=True, kw_only=True)
class MachineIdentity:
    """What a profile's numbers depend on; a difference on load gives a warning."""

    hostname: str
    cpu_model: str
    cpu_count: int
    torch_version: str
    python_version: str
    plait_version: str

    def differences(self, other: "MachineIdentity") -> list[str]:
        """'field: stored X, now Y' for every field that differs (self is stored)."""
        return [f"{f.name}: stored {getattr(self, f.name)!r}, now {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as stream:
            for line in stream:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_identity() -> MachineIdentity:
    """This machine: hostname, CPU model (/proc/cpuinfo), cores, torch (from its
    package metadata: torch is not imported), python and plait versions."""

    return MachineIdentity(hostname=socket.gethostname(), cpu_model=_cpu_model(),
                           cpu_count=os.cpu_count() or 0, torch_version=_package_version("torch"),
                           python_version=platform.python_version(), plait_version=__version__)


def _positive_number(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value > 0)


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A fitted link, its call overhead, how and where it was measured.

    ``link`` prices plait's executor with all ranks busy at once (ring shifts);
    ``ping_pong_link`` is the classic two-rank ping-pong fit, kept for reference
    only. ``r2`` holds the R^2 of each fit (weighted by 1/t), ``notes`` what the
    fit had to do (clamped parameters).
    """

    link: LinkModel
    call_overhead_s: float
    backend: str
    device: str
    world_size: int
    sizes_nbytes: tuple[int, ...]
    samples: tuple[Sample, ...]
    r2: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    ping_pong_link: LinkModel | None = None
    transport_model: TransportModel | None = None
    machine: MachineIdentity = field(default_factory=machine_identity)
    created_utc: str = field(default_factory=_utc_now)

    def __post_init__(self) -> None:
        for name in ("sizes_nbytes", "samples", "notes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "r2", {str(k): float(v) for k, v in dict(self.r2).items()})
        problems = []
        if not isinstance(self.link, LinkModel):
            problems.append(f"link={self.link!r} must be a LinkModel")
        if self.transport_model is not None and not isinstance(self.transport_model, TransportModel):
            problems.append(f"transport_model={self.transport_model!r} must be a TransportModel or None")
        if self.ping_pong_link is not None and not isinstance(self.ping_pong_link, LinkModel):
            problems.append(f"ping_pong_link={self.ping_pong_link!r} must be a LinkModel or None")
        value = self.call_overhead_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            problems.append(f"call_overhead_s={value!r} must be a finite number >= 0")
        for name in ("backend", "device"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                problems.append(f"{name}={getattr(self, name)!r} must be a non-empty string")
        if not isinstance(self.world_size, int) or self.world_size < 2:
            problems.append(f"world_size={self.world_size!r} must be an int >= 2 (calibration needs peers)")
        if any(not isinstance(n, int) or n < 1 for n in self.sizes_nbytes):
            problems.append(f"sizes_nbytes={self.sizes_nbytes!r} must be ints >= 1")
        if any(not isinstance(s, Sample) for s in self.samples):
            problems.append("samples must all be Sample")
        if not isinstance(self.machine, MachineIdentity):
            problems.append(f"machine={self.machine!r} must be a MachineIdentity")
        if problems:
            raise ValueError("invalid profile: " + "; ".join(problems))

    def collective_call_s(self, kind: str) -> float:
        """The software cost of one call of ``kind`` (a collective's name, or "p2p"):
        the transport model's fitted call_s[kind], or call_overhead_s without one."""
        if self.transport_model is None:
            return self.call_overhead_s
        return self.transport_model.call_overhead_s(kind)

    def p2p_time_s(self, nbytes: float) -> float:
        """One point-to-point exchange of ``nbytes`` (a pipeline's message): the transport
        model's call_s[p2p] + n beta(n) (no alpha: the fitted call_s[p2p] holds the
        exchange's latency); without one, what the planner charged before: alpha + n beta
        + call_overhead_s."""
        if self.transport_model is None:
            return self.link.alpha_s + nbytes * self.link.beta_s_per_byte + self.call_overhead_s
        return self.transport_model.p2p_time_s(nbytes)

    def as_dict(self) -> dict:
        """The JSON document (format name and version first)."""
        return {
            "format": FORMAT_NAME, "version": FORMAT_VERSION,
            "backend": self.backend, "device": self.device, "world_size": self.world_size,
            "link": self.link.as_dict(), "call_overhead_s": self.call_overhead_s,
            "ping_pong_link": None if self.ping_pong_link is None else self.ping_pong_link.as_dict(),
            "transport_model": None if self.transport_model is None else self.transport_model.as_dict(),
            "r2": dict(self.r2), "notes": list(self.notes), "sizes_nbytes": list(self.sizes_nbytes),
            "machine": asdict(self.machine), "created_utc": self.created_utc,
            "samples": [_sample_dict(s) for s in self.samples],
        }


def _sample_dict(sample: Sample) -> dict:
    """A sample's JSON: the call fields only on call samples (shift and ping-pong rows
    stay as version 1 wrote them)."""
    node = {**asdict(sample), "rep_times_s": list(sample.rep_times_s), "terms": list(sample.terms)}
    if sample.kind != "call":
        for name in ("collective", "algorithm", "terms"):
            node.pop(name)
    return node


def profile_backend(backend: str, transport: str) -> str:
    """The name a profile is saved and looked up under: the process-group backend, with
    "+shm" when the local ranks talk through plait's shared memory ("gloo+shm")."""
    return f"{backend}+shm" if transport == "shm" and backend == "gloo" else backend


# The profile plait calibrate saves by default (--backend auto spawning gloo workers,
# --transport shm: plait's shared memory, what a run on one host uses), so the one
# every reader (tune, cost, simulate, plan, bench --predict) finds without being told.
DEFAULT_PROFILE_BACKEND = profile_backend("gloo", "shm")


def calibrate_command(backend: str = DEFAULT_PROFILE_BACKEND, world_size: int | None = None) -> str:
    """The plait calibrate command that saves ``backend``'s profile: 'plait calibrate
    --nprocs 4' for gloo+shm (its defaults), '--transport gloo' for gloo, '--backend
    nccl' (under torchrun) for nccl."""
    flags = {DEFAULT_PROFILE_BACKEND: "", "gloo": " --transport gloo"}.get(backend, f" --backend {backend}")
    return "plait calibrate" + flags + (f" --nprocs {world_size}" if world_size is not None else "")


def default_profile_path(backend: str = DEFAULT_PROFILE_BACKEND, cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` (None: ``plait.files.default_cache_dir()``, ~/.cache/plait; the CLI
    passes its cache directory), file ``profile-{backend}.json`` (default: plait
    calibrate's, profile-gloo+shm.json)."""
    if not backend or any(c in backend for c in "/\\"):
        raise ValueError(f"backend={backend!r} is not a backend name (gloo, nccl, ...)")
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return directory.expanduser() / f"profile-{backend}.json"


def save_profile(profile: Profile, path: str | os.PathLike | None = None, *,
                 cache_dir: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` as JSON (atomically: a temporary file, then a rename) to
    ``path`` or ``default_profile_path(profile.backend, cache_dir)``; returns the path."""
    target = Path(path) if path is not None else default_profile_path(profile.backend, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as stream:
        json.dump(profile.as_dict(), stream, indent=1)
        stream.write("\n")
    os.replace(temporary, target)
    return target


class _Reader:
    """Typed access to the JSON document; errors name the file and the field."""

    def __init__(self, path: Path, data):
        self.path = path
        self.data = data

    def fail(self, name: str, problem: str) -> ValueError:
        return ValueError(f"profile {self.path}: field {name!r} {problem}; "
                          "re-run `plait calibrate` to write a fresh profile")

    def get(self, name: str, kind, *, node=None, prefix: str = "", optional: bool = False):
        node = self.data if node is None else node
        full = prefix + name
        if not isinstance(node, dict) or name not in node:
            if optional:
                return None
            raise self.fail(full, "is missing")
        value = node[name]
        if optional and value is None:
            return None
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.fail(full, f"must be a number, got {value!r}")
            return float(value)
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(full, f"must be an integer, got {value!r}")
        if not isinstance(value, kind):
            raise self.fail(full, f"must be a {kind.__name__}, got {type(value).__name__}")
        return value

    def link(self, name: str, *, optional: bool = False) -> LinkModel | None:
        node = self.get(name, dict, optional=optional)
        if node is None:
            return None
        values = [self.get(key, float, node=node, prefix=f"{name}.")
                  for key in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte")]
        try:
            return LinkModel(*values)
        except ValueError as error:
            raise self.fail(name, f"is not a valid link ({error})") from None


def _parse(path: Path, data) -> Profile:
    reader = _Reader(path, data)
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: not a JSON object; re-run `plait calibrate`")
    if data.get("format") != FORMAT_NAME:
        raise reader.fail("format", f"is {data.get('format')!r}, expected {FORMAT_NAME!r} (not a plait profile)")
    version = reader.get("version", int)
    if version not in READABLE_VERSIONS:
        raise reader.fail("version", f"is {version}, this plait reads versions "
                                     f"{', '.join(map(str, READABLE_VERSIONS))} (a newer plait wrote it: upgrade plait)")
    samples = []
    for index, node in enumerate(reader.get("samples", list)):
        prefix = f"samples[{index}]."
        try:
            samples.append(Sample(
                kind=reader.get("kind", str, node=node, prefix=prefix),
                steps=reader.get("steps", int, node=node, prefix=prefix),
                nbytes=reader.get("nbytes", int, node=node, prefix=prefix),
                reduce=reader.get("reduce", bool, node=node, prefix=prefix),
                time_s=reader.get("time_s", float, node=node, prefix=prefix),
                rep_times_s=tuple(reader.get("rep_times_s", list, node=node, prefix=prefix)),
                collective=reader.get("collective", str, node=node, prefix=prefix, optional=True) or "",
                algorithm=reader.get("algorithm", str, node=node, prefix=prefix, optional=True) or "",
                terms=tuple(reader.get("terms", list, node=node, prefix=prefix, optional=True) or ())))
        except (ValueError, TypeError) as error:
            if str(error).startswith(f"profile {path}"):
                raise
            raise reader.fail(f"samples[{index}]", f"is invalid ({error})") from None
    machine_node = reader.get("machine", dict)
    machine_values = {}
    for f in fields(MachineIdentity):
        machine_values[f.name] = reader.get(f.name, int if f.name == "cpu_count" else str,
                                            node=machine_node, prefix="machine.")
    r2 = reader.get("r2", dict)
    for key, value in r2.items():
        reader.get(key, float, node=r2, prefix="r2.")
    transport_node = reader.get("transport_model", dict, optional=True)
    try:
        transport_model = None if transport_node is None else TransportModel.from_dict(transport_node)
    except (ValueError, TypeError) as error:
        raise reader.fail("transport_model", f"is invalid ({error})") from None
    try:
        return Profile(
            link=reader.link("link"), transport_model=transport_model, ping_pong_link=reader.link("ping_pong_link", optional=True),
            call_overhead_s=reader.get("call_overhead_s", float),
            backend=reader.get("backend", str), device=reader.get("device", str),
            world_size=reader.get("world_size", int),
            sizes_nbytes=tuple(reader.get("sizes_nbytes", list)), samples=tuple(samples), r2=r2,
            notes=tuple(str(n) for n in reader.get("notes", list)),
            machine=MachineIdentity(**machine_values), created_utc=reader.get("created_utc", str))
    except ValueError as error:
        if str(error).startswith(f"profile {path}"):
            raise
        raise ValueError(f"profile {path}: {error}; re-run `plait calibrate`") from None


def load_profile(path: str | os.PathLike | None = None, *, backend: str = DEFAULT_PROFILE_BACKEND,
                 cache_dir: str | os.PathLike | None = None) -> Profile | None:
    """The profile at ``path`` (default: ``default_profile_path(backend, cache_dir)``,
    where plait calibrate saves it), or None when there is no such file.

    Raises ValueError naming the file and the field when it is malformed or of
    another format version. When it was measured on another machine (hostname, CPU,
    cores, torch, python or plait differ) it warns with ProfileMismatchWarning,
    listing each field stored vs now, and still returns it.
    """
    target = Path(path) if path is not None else default_profile_path(backend, cache_dir)
    try:
        text = read_small_file(target, limit_nbytes=PROFILE_LIMIT_NBYTES, what="calibration profile",
                               fix=f"give the path of a JSON profile that `plait calibrate` saved "
                                   f"(default {default_profile_path(backend, cache_dir)})")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ValueError(f"calibration profile {str(target)!r} cannot be read ({error.strerror}): give a profile "
                         "you can read, or re-run `plait calibrate`") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"profile {target}: not valid JSON ({error}); re-run `plait calibrate`") from None
    profile = _parse(target, data)
    differences = profile.machine.differences(machine_identity())
    if differences:
        warnings.warn(
            f"profile {target} was measured on another machine or software stack ("
            + "; ".join(differences) + f"); its predictions may be off: re-run "
            f"`{calibrate_command(profile.backend, profile.world_size)}` on this machine",
            ProfileMismatchWarning, stacklevel=2)
    return profile


def link_for_world(profile: Profile, world_size: int) -> LinkModel:
    """The profile's link for ``world_size`` ranks. A profile holds one world size;
    for another one the same link is returned with a ProfileMismatchWarning (alpha
    depends on how many ranks share the cores)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if world_size != profile.world_size:
        warnings.warn(
            f"the profile was measured with {profile.world_size} ranks, not {world_size}; its link "
            f"may misprice {world_size}-rank collectives: re-run `{calibrate_command(profile.backend, world_size)}`",
            ProfileMismatchWarning, stacklevel=2)
    return profile.link
