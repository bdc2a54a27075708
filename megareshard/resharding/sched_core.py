"""The scheduling problem in the abstract (`schedulers.py` solves it; paper §3.2): each task has options, one per
candidate sending host, each with a duration and the NIC sides it occupies; a schedule is a global order plus
one option per task, costed under the executor's order (``plan``: list scheduling's makespan; ``concurrent``:
the busiest NIC side's bytes). Pure: no torch, no processes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

__all__ = ["ORDERS", "check_order", "Option", "SchedTask", "Schedule", "simulate", "concurrent_cost",
           "schedule_cost", "rounds_from_order", "finish"]

ORDERS = ("plan", "concurrent")  # the executor's execution orders, each with its own objective



def check_order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    return order


@dataclass(frozen=True)
class Option:
    """Running a task from `host`: takes `duration`, occupies `resources`."""

    host: int
    duration: float  # seconds-as-bytes the task holds its resources (plan order)
    resources: frozenset[Hashable]
    # (resource, bytes) it puts on each NIC side when sharing it (concurrent order);
    # empty: `duration` on every resource
    loads: tuple[tuple[Hashable, float], ...] = ()

    def load_items(self) -> tuple[tuple[Hashable, float], ...]:
        """(resource, bytes) pairs: what this option adds to each resource's total load."""
        if self.loads:
            return self.loads
        return tuple((r, self.duration) for r in sorted(self.resources, key=repr))


@dataclass(frozen=True)
class SchedTask:
    options: tuple[Option, ...]
    naive: int = 0  # option used by the naive scheduler (host of the lowest sender rank)


@dataclass
class Schedule:
    order: list[int]  # task positions in execution order
    choice: list[int]  # per task position: index of the chosen option
    rounds: list[list[int]]  # consecutive groups of `order` with disjoint resources
    makespan: float
    optimal: bool
    scheduler: str


def simulate(tasks: Sequence[SchedTask], order: Sequence[int], choice: Sequence[int]) -> float:
    """Makespan of list-scheduling `order` with the chosen options."""
    free: dict[Hashable, float] = {}
    makespan = 0.0
    for t in order:
        opt = tasks[t].options[choice[t]]
        end = max((free.get(r, 0.0) for r in opt.resources), default=0.0) + opt.duration
        for r in opt.resources:
            free[r] = end
        makespan = max(makespan, end)
    return makespan


def concurrent_cost(tasks: Sequence[SchedTask], choice: Sequence[int]) -> float:
    """Cost under the ``"concurrent"`` order: the busiest resource's total load, or the
    longest chosen task alone, whichever is larger (`NetworkModel.predict` in bytes)."""
    load: dict[Hashable, float] = {}
    peak = 0.0
    for t, i in enumerate(choice):
        o = tasks[t].options[i]
        peak = max(peak, o.duration)
        for r, b in o.load_items():
            load[r] = load.get(r, 0.0) + b
    return max(peak, max(load.values(), default=0.0))


def schedule_cost(tasks: Sequence[SchedTask], sched: "Schedule", order: str) -> float:
    """The objective of `sched` under the executor's `order` (module docstring)."""
    check_order(order)
    return sched.makespan if order == "plan" else concurrent_cost(tasks, sched.choice)


def rounds_from_order(tasks: Sequence[SchedTask], order: Sequence[int], choice: Sequence[int]) -> list[list[int]]:
    """Split `order` into maximal consecutive groups whose resources do not overlap."""
    rounds: list[list[int]] = []
    used: set[Hashable] = set()
    for t in order:
        res = tasks[t].options[choice[t]].resources
        if not rounds or not used.isdisjoint(res):
            rounds.append([])
            used = set()
        rounds[-1].append(t)
        used |= res
    return rounds


def finish(tasks: Sequence[SchedTask], order: list[int], choice: list[int], name: str,
            rounds: list[list[int]] | None = None, optimal: bool = False) -> Schedule:
    return Schedule(
        order=order,
        choice=choice,
        rounds=rounds if rounds is not None else rounds_from_order(tasks, order, choice),
        makespan=simulate(tasks, order, choice),
        optimal=optimal,
        scheduler=name,
    )
