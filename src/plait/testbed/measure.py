"""One TCP stream between two testbed hosts, timed at the receiver: the rate a link
really carries (payload bits per second over the bytes that arrive after the first
read, from that read to the last), independent of what the qdiscs were told. The first
read's bytes are left out: they may have queued before the clock started, which would
put the rate above the link's."""

from __future__ import annotations

import subprocess
import sys

from plait.testbed.netns import Testbed, TestbedError

# Both listeners: take (address, port, count) from argv, say "listening" once the
# socket is bound (what _serve_and_run waits for) and accept one connection.
_ACCEPT = """
import socket, statistics, sys, time
address, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((address, port))
server.settimeout(20)
print("listening", flush=True)
connection, _ = server.accept()
connection.settimeout(20)
"""

_RECEIVE = _ACCEPT + """
nbytes = count
got, first, timed = 0, None, 0
while got < nbytes:
    chunk = connection.recv(1 << 20)
    if not chunk:
        break
    if first is None:
        first = time.perf_counter()
    else:
        timed += len(chunk)
    got += len(chunk)
last = time.perf_counter()
print(got, timed, last - first, flush=True)
"""

_SEND = """
import socket, sys
address, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
connection = socket.create_connection((address, port), timeout=20)
block = b"x" * (1 << 20)
sent = 0
while sent < nbytes:
    sent += connection.send(block[:min(len(block), nbytes - sent)])
connection.shutdown(socket.SHUT_WR)
connection.recv(1)
"""


def _serve_and_run(testbed: Testbed, server: int, server_script: str, client: int, client_script: str,
                   arguments: list[str]) -> tuple[str, str]:
    """Start ``server_script`` on host ``server`` (it prints "listening" once ready),
    run ``client_script`` on host ``client`` with the same ``arguments``, and return
    (client's output, server's output); the server is killed if it outlives this."""
    listening = subprocess.Popen(testbed.command_in(server, [sys.executable, "-c", server_script, *arguments]),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if listening.stdout.readline().strip() != "listening":
            raise TestbedError(f"the listener on host {server} did not start: {listening.stderr.read().strip()}")
        done = subprocess.run(testbed.command_in(client, [sys.executable, "-c", client_script, *arguments]),
                              capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise TestbedError(f"the client on host {client} failed: {done.stderr.strip()}")
        output, errors = listening.communicate(timeout=60)
    finally:
        if listening.poll() is None:
            listening.kill()
            listening.wait()
    if listening.returncode:
        raise TestbedError(f"the listener on host {server} failed: {errors.strip()}")
    return done.stdout, output


def tcp_rate_bits_per_s(testbed: Testbed, sender: int, receiver: int, nbytes: int, port: int = 29517) -> float:
    """Send ``nbytes`` from host ``sender`` to host ``receiver`` over one TCP stream;
    the payload rate the receiver saw, in bits per second."""
    _, output = _serve_and_run(testbed, receiver, _RECEIVE, sender, _SEND,
                               [testbed.hosts[receiver].address, str(port), str(nbytes)])
    fields = output.split()
    if len(fields) != 3 or int(fields[0]) != nbytes:
        raise TestbedError(f"the receiver on host {receiver} got {output.strip() or 'nothing'} of {nbytes} bytes")
    timed_bytes, seconds = int(fields[1]), float(fields[2])
    if timed_bytes == 0 or seconds <= 0:
        raise TestbedError(f"the {nbytes} bytes reached host {receiver} in one read: send more to time the link")
    return 8 * timed_bytes / seconds


_ECHO = _ACCEPT + """
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(count):
    connection.sendall(connection.recv(1))
"""

_PING = """
import socket, statistics, sys, time
address, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
connection = socket.create_connection((address, port), timeout=20)
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(rounds):
    start = time.perf_counter()
    connection.sendall(b"x")
    connection.recv(1)
    times.append(time.perf_counter() - start)
print(statistics.median(times[rounds // 5:]))
"""


def tcp_latency_s(testbed: Testbed, sender: int, receiver: int, rounds: int = 60, port: int = 29518) -> float:
    """Half the median round trip of a one-byte TCP ping-pong between two hosts (the
    first fifth of the rounds left out as warm-up)."""
    output, _ = _serve_and_run(testbed, receiver, _ECHO, sender, _PING,
                               [testbed.hosts[receiver].address, str(port), str(rounds)])
    return float(output) / 2
