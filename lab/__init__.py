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
import sys
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
