"""Free TCP ports for the harness and the tests: the one place that asks the kernel for
them."""
from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports on `host`: every socket stays bound until all are picked."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on `host` ("0.0.0.0" for a server that listens on every address)."""
    return free_ports(1, host)[0]
