"""Node-level pre-flight, run by the launch scripts on every node BEFORE torchrun.

    python -m megareshard.launch.node_preflight --nnodes 2 --node-rank 0 --master-addr node0 \
        --port 29501 --timeout 300 [--rdzv static|c10d]

Why before torchrun: with a node missing, torchrun's own rendezvous (static or c10d) blocks in
its agent until every node's agent arrives — before any worker, and so before the workers'
pre-flight (``preflight.py``), ever runs. A new user sees nothing for minutes. Here every node
registers (node rank, host, pid) on a small TCP store and waits for the others up to
``--timeout``; a miss is reported by node rank, with the hosts that did join, and every node
that started exits 1 within the timeout (plus about two seconds).

Who hosts the store: node rank 0 (``--rdzv static``, torchrun's ``--master-addr`` node), or, with
``--rdzv c10d``, the node whose address is ``--master-addr`` (torchrun's c10d rendezvous picks its
host the same way; on one machine the first to bind wins). The store uses its own port (the
scripts take ``MASTER_PORT + 1``): torchrun's rendezvous port stays untouched until this step has
closed its store. Node ranks must be distinct (``NODE_RANK``; Slurm's ``SLURM_NODEID``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence, TextIO

import torch.distributed as dist

from .preflight import PreflightError, _ranges

_PREFIX = "megareshard/node-preflight/"


@dataclass(frozen=True)
class NodeInfo:
    node_rank: int
    host: str
    pid: int

    @classmethod
    def parse(cls, text: str | bytes) -> "NodeInfo":
        d = json.loads(text)
        return cls(int(d["node_rank"]), str(d["host"]), int(d["pid"]))


def _is_this_machine(addr: str) -> bool:
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return addr in ("localhost", "127.0.0.1", "::1") or _matches_machine_hostname(addr)


def _open_store(nnodes: int, node_rank: int, addr: str, port: int, timeout_s: float,
                rdzv: str) -> tuple[dist.TCPStore, bool]:
    """(store, hosting): host it when this node is the rendezvous node, else connect (waiting for it)."""
    timeout = timedelta(seconds=timeout_s)
    wants_host = node_rank == 0 if rdzv == "static" else _is_this_machine(addr)
    if wants_host:
        try:
            return dist.TCPStore(addr if rdzv == "static" else "0.0.0.0", port, nnodes, is_master=True,
                                 timeout=timeout, wait_for_workers=False), True
        except (RuntimeError, OSError) as e:
            if rdzv == "static":
                raise PreflightError(f"node 0 could not host the pre-flight store on {addr}:{port} ({e}); is the "
                                     "port in use, or is MASTER_ADDR not this machine?") from None
            # c10d on a machine running several nodes: another one hosts it
    try:
        return dist.TCPStore(addr, port, nnodes, is_master=False, timeout=timeout, wait_for_workers=False), False
    except (RuntimeError, OSError) as e:
        host = "node 0" if rdzv == "static" else "the rendezvous node"
        raise PreflightError(f"pre-flight: node {node_rank} could not reach the pre-flight store at {addr}:{port} "
                             f"within {timeout_s:.0f}s: {host} ({addr}) did not start, or MASTER_ADDR/MASTER_PORT "
                             f"are wrong ({str(e).splitlines()[0][:200]})") from None


def node_preflight(nnodes: int, node_rank: int, addr: str, port: int, timeout_s: float, rdzv: str = "static",
                   out: TextIO | None = None) -> list[NodeInfo]:
    """Register this node, wait for all ``nnodes``; returns every node's info or raises PreflightError
    naming the missing node ranks and the hosts that joined."""
    if not 0 <= node_rank < nnodes:
        raise PreflightError(f"pre-flight: --node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if rdzv not in ("static", "c10d"):
        raise PreflightError(f"pre-flight: --rdzv {rdzv!r} must be static or c10d")
    out = out or sys.stdout
    start = time.monotonic()
    store, hosting = _open_store(nnodes, node_rank, addr, port, timeout_s, rdzv)
    me = NodeInfo(node_rank, socket.gethostname(), os.getpid())
    mine = json.dumps({**me.__dict__, "nonce": uuid.uuid4().hex})  # two claims never look alike
    key = f"{_PREFIX}node/{node_rank}"
    keys = [f"{_PREFIX}node/{r}" for r in range(nnodes)]
    try:
        held = store.compare_set(key, "", mine)
        held = held.decode() if isinstance(held, bytes) else held
        if held != mine:
            other = json.loads(held)
            raise PreflightError(f"pre-flight: node rank {node_rank} is taken twice: by host {other['host']} "
                                 f"(pid {other['pid']}) and by this host {me.host}; give every node its own "
                                 "NODE_RANK (0..NNODES-1)")
        print(f"megareshard pre-flight: node {node_rank} ({me.host}) waiting up to {timeout_s:.0f}s for "
              f"{nnodes} node(s) at {addr}:{port}", file=out, flush=True)
        deadline = start + timeout_s
        while True:
            present = [r for r, k in enumerate(keys) if store.check([k])]
            if len(present) == nnodes:
                break
            if not hosting and store.check([_PREFIX + "failed"]):  # the host gave up first: same verdict
                raise PreflightError(store.get(_PREFIX + "failed").decode())
            if time.monotonic() > deadline:
                missing = sorted(set(range(nnodes)) - set(present))
                joined = [NodeInfo.parse(store.get(keys[r])) for r in present]
                where = "; ".join(f"node {n.node_rank} on {n.host}" for n in joined)
                verdict = (
                    f"pre-flight: {len(missing)} of {nnodes} nodes did not join within {timeout_s:.0f}s: missing "
                    f"node rank{'s' if len(missing) > 1 else ''} {_ranges(missing)}; joined: {where}. Did every "
                    f"node start this script with NNODES={nnodes} and its own NODE_RANK, and can it reach "
                    f"{addr}:{port}?")
                if hosting and len(present) > 1:  # keep the store up so the nodes that joined report it too
                    store.set(_PREFIX + "failed", verdict)
                    time.sleep(min(2.0, timeout_s))
                raise PreflightError(verdict)
            time.sleep(0.1)
        infos = [NodeInfo.parse(store.get(k)) for k in keys]
        store.add(_PREFIX + "done", 1)
        if hosting:  # the others read the result from this store: wait for them (bounded)
            until = time.monotonic() + 10.0
            while store.add(_PREFIX + "done", 0) < nnodes and time.monotonic() < until:
                time.sleep(0.05)
    except dist.DistError as e:
        raise PreflightError(f"pre-flight: node {node_rank} lost the pre-flight store at {addr}:{port} while "
                             f"waiting for the other nodes ({str(e).splitlines()[0][:200]}); the hosting node "
                             "stopped first — its log says why") from None
    hosts = ", ".join(f"{n.node_rank}:{n.host}" for n in infos)
    print(f"megareshard pre-flight: all {nnodes} nodes joined in {time.monotonic() - start:.1f}s ({hosts})",
          file=out, flush=True)
    return infos


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nnodes", type=int, required=True, help="number of nodes that must join")
    ap.add_argument("--node-rank", type=int, required=True, help="this node's rank, 0..nnodes-1")
    ap.add_argument("--master-addr", required=True, help="address of the node hosting the store")
    ap.add_argument("--port", type=int, required=True, help="TCP port of the pre-flight store (not torchrun's)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every node")
    ap.add_argument("--rdzv", default="static", choices=("static", "c10d"),
                    help="the torchrun rendezvous that follows: who hosts the store")
    args = ap.parse_args(argv)
    if args.nnodes < 1 or args.timeout <= 0 or not 0 < args.port < 65536:
        print(f"node_preflight: error: --nnodes {args.nnodes} must be >= 1, --timeout {args.timeout} > 0 and "
              f"--port {args.port} in 1..65535", file=sys.stderr)
        return 2
    try:
        node_preflight(args.nnodes, args.node_rank, args.master_addr, args.port, args.timeout, args.rdzv)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
