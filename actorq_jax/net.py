"""The one network address the project's own processes use on a single machine."""

# Processes on the replay server's own machine reach it here: the IPv4 loopback, never a host name that a
# resolver could map to another interface (or that would cost a DNS query).
LOOPBACK = "127.0.0.1"
