"""lab/chaos/chaos_ranks.py as a module: the reliability tests run its trials at the quick size and check
the details each trial returns (beyond the runner's seven fields). Clean jobs (the uninterrupted
reference, the job after a preemption) run on tests.harness.run_pretrain: forked from a process that already
imported torch, the same gloo operations in the same order as separate processes, so bitwise comparable."""
from __future__ import annotations

import os
from pathlib import Path

from tests.harness import RankFailure, run_pretrain

ROOT = Path(__file__).resolve().parents[2]


def _run_job(argv: list[str], world: int, workdir: str, tag: str) -> list[int | None]:
    try:
        return run_pretrain(argv, world, os.path.join(workdir, f"{tag}.rank{{}}.log"), timeout=600)
    except RankFailure as e:
        raise AssertionError(f"clean job {tag} failed; logs in {workdir}:\n{e}") from None


def chaos_ranks():
    """lab.chaos.chaos_ranks, its clean jobs run on tests.harness.run_pretrain."""
    from lab.chaos import chaos_ranks as mod

    mod.run_job = _run_job
    return mod
