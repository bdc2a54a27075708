"""Is the rendezvous port free? Run by the launch scripts on every node BEFORE torchrun (and before the
node pre-flight, so no node of this job can have started torchrun yet):

    python megareshard/launch/port_check.py --master-addr ADDR --rdzv static|c10d --node-rank N --port 29500

A busy ``MASTER_PORT`` otherwise shows up late and unreadably: with the static rendezvous as torchrun's
45-line traceback ending in ``EADDRINUSE``; with c10d as silence — torchrun's agent finds the port taken,
takes whatever listens there for the rendezvous store of another agent, and waits on it forever. Only the
node that will host torchrun's store checks (node rank 0 with the static rendezvous; with c10d the node
whose address is ``MASTER_ADDR``): the others only dial it. A taken port is one line naming the process
that holds it (from ``/proc``, where this user may see it) and exit status 1.

Run as a file, not as ``-m megareshard.launch...``: the package imports torch, which this needs not.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from typing import Sequence

__all__ = ["port_in_use", "port_holder", "hosts_store", "main"]


def port_in_use(port: int) -> bool:
    """Whether a TCP server could not bind ``port`` on every interface now (``SO_REUSEADDR``, as torch's store
    sets it, so connections still closing on the port do not count)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
        finally:
            s.close()
    return False


def port_holder(port: int) -> str | None:
    """'pid N: command' of a process listening on ``port`` (read from /proc), or None when not visible."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except (OSError, ValueError, StopIteration):
            continue
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        return f"pid {pid}: {cmd[:100]}{'…' if len(cmd) > 100 else ''}"
    return None


def _is_this_machine(addr: str) -> bool:
    """Whether ``addr`` names this machine: a loopback name, this host's name, or an address a socket binds to."""
    if addr in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))   # binds only to an address of this machine
                return True
        except OSError:
            continue
    return False


def hosts_store(rdzv: str, node_rank: int, master_addr: str) -> bool:
    """Whether this node's torchrun agent binds the rendezvous port (static: node rank 0; c10d: MASTER_ADDR's node)."""
    return node_rank == 0 if rdzv == "static" else _is_this_machine(master_addr)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--rdzv", choices=("static", "c10d"), default="static")
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--port", type=int, required=True, help="MASTER_PORT: torchrun's rendezvous port")
    args = ap.parse_args(argv)
    if not hosts_store(args.rdzv, args.node_rank, args.master_addr) or not port_in_use(args.port):
        return 0
    holder = port_holder(args.port)
    print(f"error: MASTER_PORT {args.port} is already in use on {socket.gethostname()}"
          f"{' (' + holder + ')' if holder else ''}: torchrun's {args.rdzv} rendezvous would "
          f"{'fail with EADDRINUSE' if args.rdzv == 'static' else 'wait on it forever'}; is another job using it? "
          "Give this one another MASTER_PORT", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
