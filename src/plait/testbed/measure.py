"""One TCP stream between two testbed hosts, timed at the receiver: the rate a link
really carries (payload bits per second, from the first byte received to the last),
independent of what the qdiscs were told."""

from __future__ import annotations

import subprocess
import sys

from plait.testbed.netns import Testbed, TestbedError

_RECEIVE = """
import socket, sys, time
address, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((address, port))
server.settimeout(20)
print("listening", flush=True)
connection, _ = server.accept()
connection.settimeout(20)
got, first = 0, None
while got < nbytes:
    chunk = connection.recv(1 << 20)
    if not chunk:
        break
    if first is None:
        first = time.perf_counter()
    got += len(chunk)
last = time.perf_counter()
print(got, last - first, flush=True)
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


def tcp_rate_bits_per_s(testbed: Testbed, sender: int, receiver: int, nbytes: int, port: int = 29517) -> float:
    """Send ``nbytes`` from host ``sender`` to host ``receiver`` over one TCP stream;
    the payload rate the receiver saw, in bits per second."""
    address = testbed.hosts[receiver].address
    listening = subprocess.Popen(testbed.command_in(receiver, [sys.executable, "-c", _RECEIVE, address, str(port),
                                                               str(nbytes)]),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if listening.stdout.readline().strip() != "listening":
            raise TestbedError(f"the receiver on host {receiver} did not start: {listening.stderr.read().strip()}")
        sent = subprocess.run(testbed.command_in(sender, [sys.executable, "-c", _SEND, address, str(port),
                                                          str(nbytes)]),
                              capture_output=True, text=True, timeout=60)
        if sent.returncode:
            raise TestbedError(f"the sender on host {sender} failed: {sent.stderr.strip()}")
        output, errors = listening.communicate(timeout=60)
    finally:
        if listening.poll() is None:
            listening.kill()
            listening.wait()
    fields = output.split()
    if listening.returncode or len(fields) != 2 or int(fields[0]) != nbytes:
        raise TestbedError(f"the receiver on host {receiver} got {output.strip() or 'nothing'}: {errors.strip()}")
    return 8 * nbytes / float(fields[1])


_ECHO = """
import socket, sys
address, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((address, port))
server.settimeout(20)
print("listening", flush=True)
connection, _ = server.accept()
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(rounds):
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
    address = testbed.hosts[receiver].address
    echo = subprocess.Popen(testbed.command_in(receiver, [sys.executable, "-c", _ECHO, address, str(port),
                                                          str(rounds)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if echo.stdout.readline().strip() != "listening":
            raise TestbedError(f"the echo on host {receiver} did not start: {echo.stderr.read().strip()}")
        ping = subprocess.run(testbed.command_in(sender, [sys.executable, "-c", _PING, address, str(port),
                                                          str(rounds)]),
                              capture_output=True, text=True, timeout=60)
        if ping.returncode:
            raise TestbedError(f"the ping on host {sender} failed: {ping.stderr.strip()}")
        echo.wait(timeout=20)
    finally:
        if echo.poll() is None:
            echo.kill()
            echo.wait()
    return float(ping.stdout) / 2
