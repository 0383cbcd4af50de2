"""The one place that asks the OS for a free TCP port.

Binding port 0 and closing again leaves a window in which another process can
take the port, so this is for tests, benchmarks and one-machine set-ups; a
deployment behind a firewall names its ports instead.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
