"""Topologies as JSON or TOML files.

Schema (the same keys in both formats; bandwidths in bytes/s per direction, latencies
in seconds; ``host``, ``reduce_bytes_per_s`` and ``allocation`` are optional)::

    version = 1
    name = "two-nodes"
    allocation = ["n0.gpu0", "n0.gpu1", "n1.gpu0"]      # or "3+5"; default: every device
    nodes = [
        { name = "n0.gpu0", kind = "device", host = "n0", reduce_bytes_per_s = 6.8e11 },
        { name = "n0.nvswitch", kind = "switch", host = "n0" },
        ...
    ]
    links = [
        { endpoints = ["n0.gpu0", "n0.nvswitch"], bandwidth_bytes_per_s = 3e11, latency_s = 5e-7 },
        ...
    ]

Every problem names its place (``links[3].bandwidth_bytes_per_s``) and the fix.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

from plait.cost.topology import Link, Node, Topology, link_problems, node_problems
from plait.files import read_small_file

__all__ = ["topology_to_dict", "topology_from_dict", "topology_fingerprint", "save_topology", "load_topology",
           "FORMAT_VERSION"]

FORMAT_VERSION = 1
_NODE_KEYS = ("name", "kind", "host", "reduce_bytes_per_s")
_NODE_REQUIRED = ("name", "kind")
_LINK_KEYS = ("endpoints", "bandwidth_bytes_per_s", "latency_s")
_TOP_KEYS = ("version", "name", "allocation", "nodes", "links")
_MAX_SHOWN = 10


def topology_to_dict(topology: Topology) -> dict:
    """The file schema as plain data (optional fields left out when unset)."""
    nodes = []
    for node in topology.nodes:
        entry = {"name": node.name, "kind": node.kind}
        if node.host is not None:
            entry["host"] = node.host
        if node.reduce_bytes_per_s is not None:
            entry["reduce_bytes_per_s"] = node.reduce_bytes_per_s
        nodes.append(entry)
    links = [{"endpoints": list(link.endpoints), "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
              "latency_s": link.latency_s} for link in topology.links]
    return {"version": FORMAT_VERSION, "name": topology.name, "allocation": list(topology.allocation),
            "nodes": nodes, "links": links}


def topology_fingerprint(topology: Topology) -> str:
    """A short stable digest of the nodes, links and allocation (the name left out):
    equal on every rank that loaded the same cluster, so schedules built from it can be
    cached and compared by it."""
    data = topology_to_dict(topology)
    data.pop("name")
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _entries(data: dict, key: str, keys: tuple, required: tuple, problems: list[str]) -> list[dict]:
    """The well-formed entries of ``data[key]``; what is wrong goes to ``problems``."""
    value = data.get(key)
    if not isinstance(value, list) or not value:
        problems.append(f"{key} must be a non-empty list of tables (got {type(value).__name__})")
        return []
    good = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} must be a table with {', '.join(required)} (got {entry!r:.60})")
            continue
        unknown = [k for k in entry if k not in keys]
        missing = [k for k in required if k not in entry]
        if unknown:
            problems.append(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}; "
                            f"valid: {', '.join(keys)}")
        if missing:
            problems.append(f"{where} is missing {', '.join(map(repr, missing))}")
        if not unknown and not missing:
            good.append((where, entry))
    return good


def topology_from_dict(data, *, source: str = "topology") -> Topology:
    """A Topology from the schema's data; ``source`` (a file name) prefixes errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the top level must be a table with nodes and links, got {type(data).__name__}")
    problems: list[str] = []
    unknown = [k for k in data if k not in _TOP_KEYS]
    if unknown:
        problems.append(f"unknown top-level field(s) {', '.join(map(repr, unknown))}; valid: {', '.join(_TOP_KEYS)}")
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        problems.append(f"version={version!r} is not supported; this plait reads version {FORMAT_VERSION}")
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        problems.append(f"name={name!r} must be a non-empty string")
    allocation = data.get("allocation")
    if allocation is not None and not isinstance(allocation, (str, list)):
        problems.append(f"allocation={allocation!r} must be a list of device names or per-host counts like '3+5'")
    node_entries = _entries(data, "nodes", _NODE_KEYS, _NODE_REQUIRED, problems)
    link_entries = _entries(data, "links", _LINK_KEYS, _LINK_KEYS, problems)
    for where, entry in node_entries:
        problems += [f"{where}.{p}" for p in node_problems(entry["name"], entry["kind"], entry.get("host"),
                                                           entry.get("reduce_bytes_per_s"))]
    for where, entry in link_entries:
        problems += [f"{where}.{p}" for p in link_problems(entry["endpoints"], entry["bandwidth_bytes_per_s"],
                                                           entry["latency_s"])]
    if problems:
        more = f" (and {len(problems) - _MAX_SHOWN} more)" if len(problems) > _MAX_SHOWN else ""
        raise ValueError(f"{source}: malformed topology: " + "; ".join(problems[:_MAX_SHOWN]) + more)
    nodes = [Node(**entry) for _, entry in node_entries]
    links = [Link(endpoints=tuple(e["endpoints"]), bandwidth_bytes_per_s=e["bandwidth_bytes_per_s"],
                  latency_s=e["latency_s"]) for _, e in link_entries]
    try:
        return Topology(nodes=nodes, links=links, allocation=allocation, name=name)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ValueError(f"topology file {str(path)!r} must end in .json or .toml")
    return suffix[1:]


def save_topology(topology: Topology, path) -> Path:
    """Write ``topology`` as JSON or TOML (by the file's suffix)."""
    path = Path(path)
    data = topology_to_dict(topology)
    if _format(path) == "json":
        text = json.dumps(data, indent=1)
    else:
        import tomli_w

        text = tomli_w.dumps(data)
    path.write_text(text + ("" if text.endswith("\n") else "\n"))
    return path


TOPOLOGY_LIMIT_NBYTES = 64 << 20  # a preset's 16,384 devices and their links take about 10 MB of JSON


def load_topology(path, *, allocation=None) -> Topology:
    """Read a JSON or TOML topology; ``allocation`` (if given) replaces the file's."""
    path = Path(path)
    kind = _format(path)
    try:  # a regular file of bounded size: a FIFO hung the reader, /dev/zero filled memory
        raw = read_small_file(path, limit_nbytes=TOPOLOGY_LIMIT_NBYTES, what="topology file",
                              fix="give the path of a JSON or TOML topology (plait testbed probe writes one)")
        text = raw.decode("utf-8")
    except OSError as error:
        raise ValueError(f"cannot read topology file {str(path)!r}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"topology file {str(path)!r} is not UTF-8 text (byte {error.start})") from None
    try:
        data = json.loads(text) if kind == "json" else tomllib.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    topology = topology_from_dict(data, source=str(path))
    return topology if allocation is None else topology.with_allocation(allocation)
