"""Free TCP ports for the harness and the tests: the one place that picks them.

A port picked here is used a moment later, by another process. Picked from the kernel's
ephemeral range (bind to port 0), it could meanwhile be handed to any socket that binds
port 0 on the same address (Ray's gRPC servers do), and the probe or client meant for it
would reach that one instead. So the ports come from PICKED_RANGE: below the ephemeral
range (/proc/sys/net/ipv4/ip_local_port_range, 32768 and up by default) and above Ray's
worker ports (10002-19999 by default), each checked free by binding it."""
from __future__ import annotations

import random
import socket

PICKED_RANGE = range(20000, 32768)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports on `host`: every socket stays bound until all are picked."""
    socks: list[socket.socket] = []
    try:
        for port in random.sample(PICKED_RANGE, len(PICKED_RANGE)):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise RuntimeError(f"fewer than {n} free ports on {host} in {PICKED_RANGE}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on `host` ("0.0.0.0" for a server that listens on every address)."""
    return free_ports(1, host)[0]
