"""The lab: what measures, emulates, validates and breaks megareshard — never what a user trains with.

The lab imports the product (`megareshard`); the product never imports the lab (`tests/test_imports.py`
fails on such an arrow), and the wheel does not ship it. It plugs into the product through the seams
the product offers anyway: the strategy registry (`lab.signal`), the runtime's action hooks
(`lab.cluster.pacing`), the trainer's step hooks (`lab.chaos.faults`) and the planner's cost terms
(`lab.cluster.shared_cpu`).

    lab/bench/       benchmarks: pipelines against torch's schedules and the bounds, resharding, memory,
                     training throughput, the GPU checks
    lab/cluster/     the emulated cluster (network namespaces), paced compute, the shared-cores cost term
    lab/validation/  the layout planner's validation runs and their replays
    lab/chaos/       fault trials and fault injection

Every tool runs as a module from the repository root: ``python -m lab.bench.bench_pipeline --help``.
Tools that start themselves again (under torchrun or the emulated cluster) do so with `module_command`.
"""
from __future__ import annotations

import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the lab is not installed: it runs from a checkout)."""


def module_command(module: str, args: Sequence[str] = ()) -> list[str]:
    """``python -m MODULE ARGS`` for this interpreter (run with `env_with_root` so that `lab` imports)."""
    return [sys.executable, "-m", module, *args]


def env_with_root(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`env` (default: this process's) with the repository root first on PYTHONPATH, plus `extra`."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), out.get("PYTHONPATH", "")) if p)
    out.update(extra)
    return out


_HANDED_OUT: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now, for a rendezvous the test or the trial makes itself.

    Taken below the kernel's ephemeral range, in a slice of its own per pytest-xdist worker, never the same twice in
    a process: a port from ``bind(port 0)`` lies in the range every outgoing connection draws from (gloo opens many
    on loopback, in the other worker too), so it could be taken between this call and the listen — fresh-clone CI
    runs failed so (EADDRINUSE serving a transfer group's rendezvous, a fault trial's store)."""
    top = _ephemeral_start()
    base = max(1024, top - 8192)
    width = max((top - base) // 8, 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    start = base + (int(worker) % 8 if worker.isdigit() else 0) * width
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(500):
        port = start + rng.randrange(width)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"free_port: no free port among {width} in {start}..{start + width - 1} after 500 tries")
