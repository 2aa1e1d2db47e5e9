"""The torchrun agent ``plait train`` launches, and how its ranks report errors to it.

    python -m plait.train.agent --parent-pid PID [torchrun arguments] -m plait train ...

It is torch's own elastic agent (``torch.distributed.run``) with three differences:

- **Stores bound to one address.** torchrun's c10d rendezvous store and the store it
  shares with the ranks listen on every interface (``*:PORT``, no authentication).
  The rendezvous backend ``plait-c10d`` (registered here) creates both stores on a
  socket bound to one address: the rendezvous endpoint's host for the rendezvous
  store, ``--local-addr`` for the shared one. ``plait train`` passes 127.0.0.1 for
  both on one machine, and the node's own address on many.
- **Tied to the launcher.** With ``--parent-pid`` the agent gets SIGTERM when the
  launcher dies, even by SIGKILL (plait.train.lifeline), and stops its ranks as
  torchrun does on any SIGTERM.
- **Errors reported once.** A rank records its error in the file torchrun names in
  ``TORCHELASTIC_ERROR_FILE`` (``record_rank_error``) and prints nothing; the agent
  prints the first failure (the root cause, earliest in time) once, then one line
  for the ranks that stopped after it, instead of torchrun's traceback and report.
  User errors (ValueError, OSError and plait.errors.PlaitError: LossScaleError,
  DiskFull, TestbedError, ...) are printed as their message, one line, and the agent
  exits 2 as the plait command does for a user error; anything else with the rank's
  traceback, exit 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback

from plait.errors import PlaitError
from plait.train import lifeline

USER_ERRORS = (ValueError, OSError, PlaitError)  # messages written for users: no traceback (plait.errors says which)
EXIT_USER_ERROR = 2  # the root cause was a user error (the plait command's status for one)
EXIT_FAILED = 1
BACKEND = "plait-c10d"
DEFAULT_RENDEZVOUS_PORT = 29400
PROG = "plait train"


# ----------------------------------------------------------------------------- stores

def bound_store(host: str, port: int, *, is_server: bool, timeout_s: float):
    """A TCPStore: the server listens on (host, port) only, a client connects there."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_server:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout, multi_tenant=True)
    listener = socket.create_server((host, port), family=_family(host))
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (binding to it succeeds)."""
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def _create_handler(params):
    """torchrun's c10d rendezvous, with both of its stores bound (see the module docstring)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_RENDEZVOUS_PORT)
    timeout_s = float(params.get_as_int("read_timeout", 60))
    explicit = params.get_as_bool("is_host")
    is_host = explicit if explicit is not None else is_local_address(host)
    store = None
    if is_host:
        try:
            store = bound_store(host, port, is_server=True, timeout_s=timeout_s)
        except OSError:
            if explicit:  # asked to host, and cannot
                raise
            # another agent on this machine hosts it (several nodes on one machine)
    if store is None:
        store = bound_store(host, port, is_server=False, timeout_s=timeout_s)

    class BoundBackend(C10dRendezvousBackend):  # torch checks the handler's backend name against --rdzv-backend
        @property
        def name(self) -> str:
            return BACKEND

    handler = create_handler(store, BoundBackend(store, params.run_id), params)
    # the store torchrun shares with the ranks, hosted by the rendezvous's rank 0 at --local-addr
    handler._create_tcp_store_server = lambda addr, server_port: bound_store(addr, server_port, is_server=True,
                                                                            timeout_s=timeout_s)
    return handler


def register_backend() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)


# ----------------------------------------------------------------------------- errors

def record_rank_error(error: BaseException) -> bool:
    """Write ``error`` to torchrun's per-rank error file (call inside ``except``); the
    traceback is kept for errors that are not USER_ERRORS. False if torchrun gave no file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    extra = {"timestamp": str(int(time.time()))}
    if not isinstance(error, USER_ERRORS):
        extra["py_callstack"] = traceback.format_exc()
    with open(path, "w") as file:
        json.dump({"message": {"message": f"{type(error).__name__}: {error}", "extraInfo": extra}}, file)
    return True


def _recorded(failure) -> dict | None:
    """The error a rank recorded ({"message", "extraInfo"}), or None (torchrun's
    placeholder when the rank wrote no file)."""
    message = (failure.error_file_data or {}).get("message")
    return message if isinstance(message, dict) else None


def _failure_text(failure) -> tuple[str, str]:
    """(one-line reason, traceback or '') of a torchrun ProcessFailure."""
    recorded = _recorded(failure)
    if recorded is not None:
        return str(recorded.get("message", "")), str(recorded.get("extraInfo", {}).get("py_callstack", ""))
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}", ""
    return f"exited with code {failure.exitcode} without recording an error", ""


def _cause_order(rank: int, failure) -> tuple:
    """Root cause first: a rank killed by a signal torchrun does not send (SIGKILL from
    the OOM killer, SIGSEGV), then a rank that recorded an error, then the rest (ranks
    torchrun stopped with SIGTERM); earlier first within each (timestamps are whole
    seconds), then lower rank."""
    killed = failure.exitcode < 0 and -failure.exitcode not in (signal.SIGTERM, signal.SIGINT)
    kind = 0 if killed else 1 if _recorded(failure) is not None else 2
    return kind, failure.timestamp, rank


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _root_cause(failures: dict) -> int:
    """The rank whose failure is reported first (``_cause_order``)."""
    return min(failures, key=lambda rank: _cause_order(rank, failures[rank]))


def failure_status(failures: dict) -> int:
    """EXIT_USER_ERROR when the root cause is a user error its rank recorded (no
    traceback kept), else EXIT_FAILED."""
    first = failures[_root_cause(failures)]
    recorded = _recorded(first)
    return EXIT_USER_ERROR if recorded is not None and not _failure_text(first)[1] else EXIT_FAILED


def failure_report(failures: dict) -> list[str]:
    """The lines printed for a failed world: the root cause once (``_cause_order``),
    naming every rank that failed the same way, then one line per other reason."""
    first = _root_cause(failures)
    reason, callstack = _failure_text(failures[first])
    same = [rank for rank in failures if _failure_text(failures[rank])[0] == reason]
    lines = [f"{PROG}: {_ranks_text(same)} failed: {reason}"]
    if callstack:
        lines.append(callstack.rstrip())
    others: dict[str, list[int]] = {}
    for rank in sorted(failures):
        if rank not in same:
            others.setdefault(_failure_text(failures[rank])[0].splitlines()[0][:200], []).append(rank)
    for other, ranks in others.items():
        lines.append(f"{PROG}: {_ranks_text(ranks)} stopped after it: {other}")
    return lines


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.train.agent", add_help=False)
    parser.add_argument("--parent-pid", type=int, default=None)
    ours, torchrun_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    if ours.parent_pid is not None:
        try:
            lifeline.tie_to_parent(signal.SIGTERM, ours.parent_pid)
        except lifeline.ParentGone as error:
            print(f"{PROG}: {error}: not starting", file=sys.stderr)
            return 1
    # torchrun's own log lines (closing signals, its failure table) repeat what is reported below: loggers
    # made by its get_logger take their level from LOGLEVEL when imported, the others inherit the parent's
    os.environ.setdefault("LOGLEVEL", "CRITICAL")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    register_backend()
    args = torchrun.parse_args(torchrun_argv)
    try:
        torchrun.run(args)
    except ChildFailedError as error:
        print("\n".join(failure_report(error.failures)), file=sys.stderr)
        return failure_status(error.failures)
    except SignalException as error:
        print(f"{PROG}: the agent was stopped by {signal.Signals(error.sigval).name}; its ranks were stopped",
              file=sys.stderr)
        return 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
