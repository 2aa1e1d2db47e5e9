"""What the kernel says about processes and sockets (Linux /proc), for tests and probes
that must not take plait's word for it: a process tree (survivors of a stopped run
are found even after they were re-parented), whether a pid is still running (a
zombie is not), and the TCP sockets a set of processes listens on, with the address
each is bound to."""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from pathlib import Path

TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process now."""
    found = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[int(_stat_fields(entry)[1])].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (children, their children, ...)."""
    tree, todo, found = children(), [pid], []
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is running (a zombie, exited but not yet reaped, is not)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces ('' if gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _socket_inodes(pids) -> dict[int, int]:
    """Socket inode -> pid, for the sockets the processes hold open."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[int(link[8:-1])] = pid
        except OSError:
            continue
    return inodes


def listening_sockets(pids) -> list[tuple[int, str, int]]:
    """(pid, bound address, port) of every TCP socket in LISTEN state held by ``pids``
    ('0.0.0.0' or '::' for a socket on every interface)."""
    inodes = _socket_inodes(pids)
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != TCP_LISTEN or int(fields[9]) not in inodes:
                continue
            address_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(address_hex)  # 32-bit words, each in host (little-endian) byte order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((inodes[int(fields[9])], socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found
