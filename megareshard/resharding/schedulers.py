"""Choose a sending host for every unit task and an execution order (paper §3.2).

The problem is abstract here: each task has options (one per candidate sending host),
each option a duration and the set of resources it occupies -- a resource is one side
(SEND/RECV) of one host's NIC. A schedule is a global order plus one option per task.

Its cost depends on how the executor will run it (`ORDERS`):

* ``"plan"``: one task at a time per NIC side, in plan order. The cost is the makespan of
  list scheduling: in order, a task starts once all its resources are free. Any
  per-resource order without cycles is reachable from some global order, so searching
  global orders loses nothing.
* ``"concurrent"``: every task on the wire at once, each NIC side shared among its flows.
  The cost is the busiest NIC side's bytes (or the longest single task), as
  `NetworkModel.predict(plan, "concurrent")` computes it; only the choice of options
  matters, not the order.

The problem's types and costs are `sched_core.py` (re-exported here); this module holds the algorithms and the
reshard scheduler registry (`--reshard-scheduler`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from ..registry import Registry
from .network import SEND
from .sched_core import (ORDERS, Option, SchedTask, Schedule, check_order, concurrent_cost,  # noqa: F401 (re-exported)
                         finish, rounds_from_order, schedule_cost, simulate)

# DFS recursion depth equals the number of tasks; beyond this we only check the seeds.
_MAX_DFS_TASKS = 400


def schedule_naive(tasks: Sequence[SchedTask]) -> Schedule:
    """Lowest-index sender, decomposition order: the paper's baseline."""
    return finish(tasks, list(range(len(tasks))), [t.naive for t in tasks], "naive")


def _min_duration(task: SchedTask) -> float:
    return min(o.duration for o in task.options)


def schedule_loadbalance(tasks: Sequence[SchedTask]) -> Schedule:
    """Longest task first, each to the option whose busiest resource ends earliest.

    With one resource per option this is the classic LPT rule the paper uses for the
    load-balance-only problem; the order is the sorted order.
    """
    order = sorted(range(len(tasks)), key=lambda t: -_min_duration(tasks[t]))
    load: dict[Hashable, float] = {}
    choice = [0] * len(tasks)
    for t in order:
        opts = tasks[t].options
        best = min(
            range(len(opts)),
            key=lambda i: (max((load.get(r, 0.0) for r in opts[i].resources), default=0.0) + opts[i].duration,
                           opts[i].host),
        )
        choice[t] = best
        for r in opts[best].resources:
            load[r] = load.get(r, 0.0) + opts[best].duration
    return finish(tasks, order, choice, "loadbalance")


def schedule_greedy(tasks: Sequence[SchedTask], seed: int = 0) -> Schedule:
    """Rounds of non-overlapping tasks, each the heaviest of several randomised trials.

    Event driven: at time `now`, the candidates are the remaining tasks with an allowed
    option whose NIC sides are all free; a trial walks them in a random order and keeps
    each one that has such an option (cheapest first) not overlapping those kept so far.
    The heaviest kept set (useful work = each task's cheapest duration, then count) over
    the trials starts now and forms a round; `now` then moves to the next time a NIC side
    frees up. The construction is restarted a few times, alternately allowing only the
    cheapest options (waiting for a busy host beats a slower path, e.g. a remote copy
    instead of a local one) and any option (a slower host can balance load), and the
    best makespan is kept. Deterministic for a given seed: the work is fixed by counts, never by
    the clock.
    """
    n = len(tasks)
    if n == 0:
        return finish(tasks, [], [], "greedy", rounds=[])
    rng = random.Random(seed)
    mindur = [_min_duration(t) for t in tasks]
    efficient = [[i for i, o in enumerate(t.options) if o.duration <= mindur[t_]] for t_, t in enumerate(tasks)]
    by_cost = [sorted(range(len(t.options)), key=lambda i, t=t: t.options[i].duration) for t in tasks]
    restarts = 6 if n <= 64 else (2 if n <= 256 else 1)
    best: Schedule | None = None
    for restart in range(restarts):
        # even restarts use cheapest options only, odd ones any option (cheapest first)
        allowed = efficient if restart % 2 == 0 else by_cost
        remaining = set(range(n))
        free: dict[Hashable, float] = {}
        now = 0.0
        order: list[int] = []
        choice = [0] * n
        rounds: list[list[int]] = []
        while remaining:
            avail = [
                (t, [i for i in allowed[t]
                     if all(free.get(r, 0.0) <= now for r in tasks[t].options[i].resources)])
                for t in sorted(remaining)
            ]
            avail = [(t, opts) for t, opts in avail if opts]
            if avail:
                trials = max(2, min(16, 4096 // len(avail)))
                best_set: list[tuple[int, int]] = []
                best_score = (-1.0, -1)
                for _trial in range(trials):
                    perm = avail[:]
                    rng.shuffle(perm)
                    used: set[Hashable] = set()
                    chosen: list[tuple[int, int]] = []
                    weight = 0.0
                    for t, opts in perm:
                        for i in opts:
                            res = tasks[t].options[i].resources
                            if used.isdisjoint(res):
                                chosen.append((t, i))
                                used |= res
                                weight += mindur[t]  # useful work: a slow option earns no more
                                break
                    score = (weight, len(chosen))
                    if score > best_score:
                        best_score, best_set = score, chosen
                best_set.sort()
                for t, i in best_set:
                    choice[t] = i
                    o = tasks[t].options[i]
                    for r in o.resources:
                        free[r] = now + o.duration
                    remaining.discard(t)
                    order.append(t)
                rounds.append([t for t, _ in best_set])
            later = [v for v in free.values() if v > now]
            if later:
                now = min(later)
        cand = finish(tasks, order, choice, "greedy", rounds=rounds)
        if best is None or cand.makespan < best.makespan:
            best = cand
    assert best is not None
    return _polish(tasks, best)


def _polish(tasks: Sequence[SchedTask], sched: Schedule, work: int = 100_000) -> Schedule:
    """First-improvement local search: move one task elsewhere in the order and/or give
    it another option, while the makespan drops; bounded by a count of evaluations
    (about `work` task placements), so it is deterministic.

    Event-driven greedy starts big tasks as early as it can, which can strand a small
    task behind them; one relocation usually repairs that.
    """
    n = len(tasks)
    if n < 2 or n > 200:
        return sched
    order, choice = list(sched.order), list(sched.choice)
    best = sched.makespan
    eps = 1e-9 * max(best, 1.0)
    if best <= lower_bound(tasks) + eps:
        return sched  # already optimal
    max_evals = min(4000, work // n)  # each evaluation costs O(n)
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        for p in range(n):
            t = order[p]
            rest = order[:p] + order[p + 1:]
            for q in range(n):
                cand_order = rest[:q] + [t] + rest[q:]
                for i in range(len(tasks[t].options)):
                    if q == p and i == choice[t]:
                        continue
                    cand_choice = choice[:]
                    cand_choice[t] = i
                    evals += 1
                    ms = simulate(tasks, cand_order, cand_choice)
                    if ms < best - eps:
                        order, choice, best, improved = cand_order, cand_choice, ms, True
                        break
                if improved or evals >= max_evals:
                    break
            if improved or evals >= max_evals:
                break
    if order == sched.order and choice == sched.choice:
        return sched
    return finish(tasks, order, choice, "greedy")


class _Timeout(Exception):
    pass


def lower_bound(tasks: Sequence[SchedTask]) -> float:
    """Makespan lower bound of any schedule (the DFS bound at the root)."""
    return _Search(tasks, None, 0.0).root_bound()


class _Search:
    """Branch and bound over (next task, its option), see `schedule_dfs`."""

    def __init__(self, tasks: Sequence[SchedTask], incumbent: Schedule | None, budget_s: float) -> None:
        self.tasks = tasks
        self.n = len(tasks)
        self.deadline = time.perf_counter() + budget_s
        self.nodes = 0
        # unavoidable load per resource: min over options of what the option puts there
        self.forced: list[dict[Hashable, float]] = []
        self.rem_load: dict[Hashable, float] = {}
        resources: set[Hashable] = set()
        for t in tasks:
            for o in t.options:
                resources |= o.resources
        self.resources = sorted(resources, key=repr)
        for t in tasks:
            f: dict[Hashable, float] = {}
            for r in set().union(*(o.resources for o in t.options)):
                m = min(o.duration if r in o.resources else 0.0 for o in t.options)
                if m > 0:
                    f[r] = m
                    self.rem_load[r] = self.rem_load.get(r, 0.0) + m
            self.forced.append(f)
        # aggregate over all send sides: each such task keeps some send side busy
        self.send_res = [r for r in self.resources if isinstance(r, tuple) and len(r) == 2 and r[1] == SEND]
        send_set = set(self.send_res)
        self.send_min = [
            _min_duration(t) if all(not send_set.isdisjoint(o.resources) for o in t.options) else 0.0
            for t in tasks
        ]
        self.rem_send = sum(self.send_min)
        self.mindur = [_min_duration(t) for t in tasks]
        total = sum(self.mindur) or 1.0
        self.eps = 1e-9 * total
        # identical tasks are interchangeable: only the first unscheduled one of a class may go next
        classes: dict[tuple, list[int]] = {}
        for i, t in enumerate(tasks):
            key = tuple((o.host, o.duration, tuple(sorted(o.resources, key=repr))) for o in t.options)
            classes.setdefault(key, []).append(i)
        self.classes = list(classes.values())
        self.ptr = [0] * len(self.classes)
        self.free: dict[Hashable, float] = {}
        self.remaining = set(range(self.n))
        self.best = incumbent
        self.best_ms = incumbent.makespan if incumbent is not None else float("inf")
        self.seq: list[tuple[int, int]] = []

    def bound(self, cur: float) -> float:
        free = self.free
        lb = cur
        for r, load in self.rem_load.items():
            v = free.get(r, 0.0) + load
            if v > lb:
                lb = v
        if self.send_res and self.rem_send > 0:
            v = (sum(free.get(r, 0.0) for r in self.send_res) + self.rem_send) / len(self.send_res)
            lb = max(lb, v)
        for t in self.remaining:
            e = min(max((free.get(r, 0.0) for r in o.resources), default=0.0) + o.duration
                    for o in self.tasks[t].options)
            if e > lb:
                lb = e
        return lb

    def root_bound(self) -> float:
        return self.bound(0.0)

    def run(self) -> bool:
        """True if the search finished (the best schedule found is optimal)."""
        try:
            self._rec(0.0, None)
        except _Timeout:
            return False
        return True

    def _rec(self, cur: float, last: tuple[int, frozenset] | None) -> None:
        self.nodes += 1
        if self.nodes & 255 == 0 and time.perf_counter() > self.deadline:
            raise _Timeout
        if not self.remaining:
            if cur < self.best_ms - self.eps:
                order = [t for t, _ in self.seq]
                choice = [0] * self.n
                for t, i in self.seq:
                    choice[t] = i
                self.best_ms = cur
                self.best = finish(self.tasks, order, choice, "dfs")
            return
        cands = []
        for c, members in enumerate(self.classes):
            if self.ptr[c] >= len(members):
                continue
            t = members[self.ptr[c]]
            for i, o in enumerate(self.tasks[t].options):
                # adjacent tasks on disjoint resources commute: keep only the id-sorted order
                if last is not None and t < last[0] and o.resources.isdisjoint(last[1]):
                    continue
                start = max((self.free.get(r, 0.0) for r in o.resources), default=0.0)
                cands.append((start + o.duration, -o.duration, t, i, c))
        cands.sort()
        for end, _, t, i, c in cands:
            new_cur = max(cur, end)
            if new_cur >= self.best_ms - self.eps:
                break  # candidates are sorted by end time: the rest cannot do better
            o = self.tasks[t].options[i]
            saved = [(r, self.free.get(r)) for r in o.resources]
            for r in o.resources:
                self.free[r] = end
            for r, m in self.forced[t].items():
                self.rem_load[r] -= m
            self.rem_send -= self.send_min[t]
            self.remaining.discard(t)
            self.ptr[c] += 1
            self.seq.append((t, i))
            if self.bound(new_cur) < self.best_ms - self.eps:
                self._rec(new_cur, (t, o.resources))
            self.seq.pop()
            self.ptr[c] -= 1
            self.remaining.add(t)
            self.rem_send += self.send_min[t]
            for r, m in self.forced[t].items():
                self.rem_load[r] += m
            for r, v in saved:
                if v is None:
                    del self.free[r]
                else:
                    self.free[r] = v


def schedule_dfs(tasks: Sequence[SchedTask], time_budget_s: float = 1.0,
                 incumbent: Schedule | None = None) -> Schedule:
    """Depth-first branch and bound over (sender option, order) within a time budget.

    Pruning uses a true lower bound: max of the current makespan, every resource's free
    time plus the load it must still take, the average over NIC send sides, and every
    remaining task's earliest possible end. Symmetry breaking: identical tasks go in
    index order, and two adjacent tasks on disjoint resources (which give the same
    schedule either way) only in index order. The search starts from the best of the
    naive, load-balance and greedy schedules (or `incumbent`); if that already meets
    the root lower bound it is optimal at once. `optimal` is True only when the search
    finished.
    """
    if incumbent is None:
        seeds = [schedule_naive(tasks), schedule_loadbalance(tasks), schedule_greedy(tasks)]
        incumbent = min(seeds, key=lambda s: s.makespan)
    search = _Search(tasks, incumbent, time_budget_s)
    if incumbent.makespan <= search.root_bound() + search.eps:
        finished = True
    elif len(tasks) > _MAX_DFS_TASKS:
        finished = False
    else:
        finished = search.run()
    best = search.best
    assert best is not None
    return Schedule(order=list(best.order), choice=list(best.choice),
                    rounds=rounds_from_order(tasks, best.order, best.choice),
                    makespan=best.makespan, optimal=finished, scheduler="dfs")


class _LoadSearch:
    """Branch and bound over one option per task, minimising `concurrent_cost`.

    Tasks go largest first; each takes its options in the order of the peak they leave,
    so the first descent is the longest-processing-time rule on loads. Prune: the peak so
    far, or any resource's load plus what the remaining tasks must put there whatever
    their options, reaching the incumbent's cost. Identical tasks (same options) are
    interchangeable: their option indices are kept non-decreasing.
    """

    def __init__(self, tasks: Sequence[SchedTask], choice: Sequence[int], budget_s: float) -> None:
        self.tasks = tasks
        self.deadline = time.perf_counter() + budget_s
        self.nodes = 0
        n = len(tasks)
        self.items = [[(r, b) for r, b in o.load_items() if b > 0] for t in tasks for o in t.options]
        self.base = [0] * (n + 1)  # task t's options are items[base[t]: base[t + 1]]
        for t in range(n):
            self.base[t + 1] = self.base[t] + len(tasks[t].options)
        sig = [tuple((o.duration, tuple(sorted(o.load_items(), key=repr))) for o in t.options) for t in tasks]
        size = [max((sum(b for _, b in o.load_items()) for o in t.options), default=0.0) for t in tasks]
        self.seq = sorted(range(n), key=lambda t: (-size[t], repr(sig[t]), t))
        self.same_as_prev = [k > 0 and sig[self.seq[k]] == sig[self.seq[k - 1]] for k in range(n)]
        # forced[k][r]: load the tasks seq[k:] put on r whatever their options
        self.forced: list[dict[Hashable, float]] = [{} for _ in range(n + 1)]
        for k in range(n - 1, -1, -1):
            f = dict(self.forced[k + 1])
            t = self.seq[k]
            opts = tasks[t].options
            for r in {r for o in opts for r, _ in o.load_items()}:
                m = min(dict(o.load_items()).get(r, 0.0) for o in opts)
                if m > 0:
                    f[r] = f.get(r, 0.0) + m
            self.forced[k] = f
        self.floor = max((min(o.duration for o in t.options) for t in tasks), default=0.0)
        self.best_choice = list(choice)
        self.best = concurrent_cost(tasks, choice)
        self.eps = 1e-9 * max(self.best, 1.0)
        self.load: dict[Hashable, float] = {}
        self.choice = [0] * n

    def root_bound(self) -> float:
        return max(self.floor, max(self.forced[0].values(), default=0.0))

    def run(self) -> bool:
        """True if the search finished (`best_choice` is optimal)."""
        if self.best <= self.root_bound() + self.eps:
            return True
        try:
            self._rec(0, 0.0)
        except _Timeout:
            return False
        return True

    def _rec(self, k: int, peak: float) -> None:
        self.nodes += 1
        if self.nodes & 255 == 0 and time.perf_counter() > self.deadline:
            raise _Timeout
        if k == len(self.seq):
            if peak < self.best - self.eps:
                self.best, self.best_choice = peak, list(self.choice)
            return
        t = self.seq[k]
        load, fnext = self.load, self.forced[k + 1]
        lo = self.choice[self.seq[k - 1]] if self.same_as_prev[k] else 0
        cands = []
        for i in range(lo, len(self.tasks[t].options)):
            new_peak = max(peak, self.tasks[t].options[i].duration)
            for r, b in self.items[self.base[t] + i]:
                new_peak = max(new_peak, load.get(r, 0.0) + b)
            cands.append((new_peak, i))
        cands.sort()
        for new_peak, i in cands:
            if new_peak >= self.best - self.eps:
                break  # sorted: the rest leave a higher peak
            items = self.items[self.base[t] + i]
            for r, b in items:
                load[r] = load.get(r, 0.0) + b
            bound = max([new_peak] + [load.get(r, 0.0) + m for r, m in fnext.items()])
            if bound < self.best - self.eps:
                self.choice[t] = i
                self._rec(k + 1, new_peak)
            for r, b in items:
                load[r] -= b


def schedule_concurrent(tasks: Sequence[SchedTask], start: Schedule, time_budget_s: float = 1.0) -> Schedule:
    """Options minimising `concurrent_cost`, by branch and bound from `start`'s options.

    Never worse than `start` under that cost: when the budget runs out the best options
    found so far are kept. The order is `start`'s (under concurrent execution it does not
    change the cost). `optimal` is True only when the search finished.
    """
    search = _LoadSearch(tasks, start.choice, time_budget_s)
    finished = search.run()
    improved = search.best_choice != list(start.choice)
    sched = finish(tasks, list(start.order), list(search.best_choice), "dfs" if improved else start.scheduler,
                    optimal=finished)
    return sched


@dataclass(frozen=True)
class ReshardScheduler:
    """One way to choose a sending host and an order for a boundary's tasks (`--reshard-scheduler`)."""

    name: str
    run: Callable[[Sequence[SchedTask], str, float, int], Schedule]
    """(tasks, the executor's order, search time budget in seconds, seed) -> the schedule."""


RESHARD_SCHEDULERS: Registry[ReshardScheduler] = Registry("reshard scheduler", type_=ReshardScheduler)


def register_scheduler(scheduler: ReshardScheduler) -> ReshardScheduler:
    """Add `scheduler` (the registry rule: `megareshard.registry`)."""
    return RESHARD_SCHEDULERS.register(scheduler)


def get_scheduler(name: str) -> ReshardScheduler:
    """The registered scheduler `name`; an unknown name raises with the names there are."""
    return RESHARD_SCHEDULERS.get(name)


def scheduler_names() -> tuple[str, ...]:
    """The registered schedulers in registration order, the built-ins first."""
    return RESHARD_SCHEDULERS.names()


def _seeds(tasks: Sequence[SchedTask], seed: int) -> list[Schedule]:
    return [schedule_naive(tasks), schedule_loadbalance(tasks), schedule_greedy(tasks, seed)]


def _run_dfs(tasks: Sequence[SchedTask], order: str, time_budget_s: float, seed: int) -> Schedule:
    start = min(_seeds(tasks, seed), key=lambda s: s.makespan)
    return schedule_dfs(tasks, time_budget_s, incumbent=start)


def _run_auto(tasks: Sequence[SchedTask], order: str, time_budget_s: float, seed: int) -> Schedule:
    """``order="plan"``: the makespan; DFS searches from the best of the naive, load-balance and greedy schedules
    and keeps its incumbent if the budget runs out. ``"concurrent"``: the busiest NIC side's load; a branch and
    bound over options (`schedule_concurrent`) starts from the cheapest of those three. Either way never worse
    than any of them under that order's cost."""
    seeds = _seeds(tasks, seed)
    if order == "concurrent":
        start = min(seeds, key=lambda s: concurrent_cost(tasks, s.choice))
        return schedule_concurrent(tasks, start, time_budget_s)
    start = min(seeds, key=lambda s: s.makespan)
    dfs = schedule_dfs(tasks, time_budget_s, incumbent=start)
    if not dfs.makespan < start.makespan:
        dfs.scheduler = start.scheduler  # the search kept its start (optimal or out of time)
    return dfs


for _s in (ReshardScheduler("naive", lambda tasks, order, budget, seed: schedule_naive(tasks)),
           ReshardScheduler("loadbalance", lambda tasks, order, budget, seed: schedule_loadbalance(tasks)),
           ReshardScheduler("dfs", _run_dfs),
           ReshardScheduler("greedy", lambda tasks, order, budget, seed: schedule_greedy(tasks, seed)),
           ReshardScheduler("auto", _run_auto)):
    register_scheduler(_s)


def run_scheduler(name: str, tasks: Sequence[SchedTask], *, order: str = "concurrent",
                  time_budget_s: float = 1.0, seed: int = 0) -> Schedule:
    """The registered scheduler `name` on `tasks` under the executor's `order`. The returned `scheduler` names the
    algorithm whose schedule was kept ("dfs" when `auto`'s search improved on its start); `optimal` says the
    search finished."""
    return get_scheduler(name).run(tasks, check_order(order), time_budget_s, seed)
