"""The one network address the project's own processes use on a single machine, and whether a port there is free."""

import errno
import socket

# Processes on the replay server's own machine reach it here: the IPv4 loopback, never a host name that a
# resolver could map to another interface (or that would cost a DNS query).
LOOPBACK = "127.0.0.1"


class PortTaken(RuntimeError):
    """A port the run needs is held by another process."""


def port_in_use(port: int) -> bool:
    """Whether something listens on `port` (connections lingering in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False
