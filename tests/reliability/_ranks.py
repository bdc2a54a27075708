"""lab/chaos/chaos_ranks.py as a module: the reliability tests run its trials at the quick size and check
the details each trial returns (beyond the runner's seven fields). Clean jobs (the uninterrupted
reference, the job after a preemption) run on tests.harness.run_ranks: forked from a process that already
imported torch, the same gloo operations in the same order as separate processes, so bitwise comparable."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.harness import RankFailure, run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _pretrain_rank(rank: int, world: int, argv: list[str], log: str) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # what pretrain_gpt.py reads besides the process group
    fd = os.open(log.format(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pretrain_gpt import main

    return main(list(argv))


def _run_job(argv: list[str], world: int, workdir: str, tag: str) -> list[int | None]:
    try:
        return run_ranks(_pretrain_rank, world, argv, os.path.join(workdir, f"{tag}.rank{{}}.log"), timeout=600,
                         env={"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    except RankFailure as e:
        raise AssertionError(f"clean job {tag} failed; logs in {workdir}:\n{e}") from None


def chaos_ranks():
    """lab.chaos.chaos_ranks, its clean jobs run on tests.harness.run_ranks."""
    from lab.chaos import chaos_ranks as mod

    mod.run_job = _run_job
    return mod
