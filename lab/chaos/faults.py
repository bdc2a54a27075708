"""Fault injection for the reliability tests and ``lab.chaos.chaos_ranks``: a rank hurts itself on cue.

A run plugs it in with ``--custom-import lab.chaos.faults`` (importing it registers the trainer step hook
`inject_hook`); then ``MEGARESHARD_INJECT_FAULT=KIND@RANK:ITERATION`` (several separated by ``,``) makes global rank
RANK do KIND in iteration ITERATION (1-based), as it is about to run its forward and backward
(the learning rate already stepped): its peers are inside the same iteration, waiting for its
pipeline transfers or its share of the gradient reductions. Only the first attempt of a torchrun
job (``TORCHELASTIC_RESTART_COUNT`` 0 or unset) injects: the restarted job must run clean.

Kinds: ``kill`` (SIGKILL itself: a crash, an OOM kill), ``stop`` (SIGSTOP itself: a stalled
process, a hung driver; it never resumes), ``slow`` (from that iteration on, every step first sleeps
``SLOW_STEP_S``: a straggler; a job that must stay alive while another starts beside it leaves it the CPU).
Preemption is not injected from inside: a SIGTERM comes from outside (``lab/chaos/chaos_ranks.py`` signals the
launch script).

Unset (or not imported), it costs nothing.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from megareshard.plugins import register_step_hook

ENV = "MEGARESHARD_INJECT_FAULT"
KINDS = ("kill", "stop", "slow")
SLOW_STEP_S = 0.5


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    iteration: int


def parse_faults(spec: str | None) -> list[Fault]:
    """``'kill@1:5,stop@0:7'`` -> faults; a malformed spec raises ValueError naming the bad part."""
    out = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        kind, _, where = part.partition("@")
        rank, _, it = where.partition(":")
        if kind not in KINDS or not rank.isdigit() or not it.isdigit() or int(it) < 1:
            raise ValueError(f"{ENV}: {part!r} is not KIND@RANK:ITERATION with KIND one of {', '.join(KINDS)} "
                             "and ITERATION >= 1 (e.g. kill@1:5)")
        out.append(Fault(kind, int(rank), int(it)))
    return out


def faults_for(rank: int) -> dict[int, str]:
    """This rank's faults by iteration, for this attempt (none after a torchrun restart)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return {}
    return {f.iteration: f.kind for f in parse_faults(os.environ.get(ENV)) if f.rank == rank}


def inject(kind: str) -> None:
    """Do ``kind`` to this process now (neither returns: SIGSTOP is never followed by SIGCONT here)."""
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"unknown fault kind {kind!r}")


@register_step_hook
def inject_hook(trainer: Any, iteration: int) -> None:
    """The trainer step hook: do this rank's fault of `iteration`, if any (its peers are inside the iteration's
    pipeline or reductions, waiting for it)."""
    rank = trainer.ctx.rank
    faults = faults_for(rank)
    if any(kind == "slow" and it <= iteration for it, kind in faults.items()):
        time.sleep(SLOW_STEP_S)
        return
    fault = faults.get(iteration)
    if fault is not None:
        print(f" rank {rank}: injecting fault '{fault}' in iteration {iteration} ({ENV})", file=trainer.out,
              flush=True)
        inject(fault)
