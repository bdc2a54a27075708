"""Paced compute: emulate one dedicated device per rank on shared CPU cores (benchmarks only).

Ranks that time-share a few cores lend a stage's core to the other stages while it waits
for the network, which hides communication under *any* schedule — no GPU stage can do
that. With pacing, every compute action of a stage takes a fixed wall time (a faster one
sleeps the rest: the runtime's action hook `Pacer`, `pacer(runtime).budgets = ...`), the same in every
configuration, so only communication and scheduling differ. Pure Python: parsing, calibration, the padding
and its counters; no processes.
"""
from __future__ import annotations

import math
import time
from typing import Any, Iterable, Sequence

from megareshard.pipeline.hooks import ActionHook

PACE_KINDS = ("F", "B", "I", "W")


def note_action(stats: dict[str, int], kind: str, t0: float, c0: float | None = None) -> None:
    """Count one action of a paced run in `stats`, per kind: ``paced_n_K`` actions, ``paced_wall_us_K`` µs of wall
    time since `t0` and, for compute (`c0`: its ``time.thread_time()`` at the start), ``paced_cpu_us_K`` µs of CPU.
    A compute action is noted before its padding: what the emulated device's budget had to cover."""
    done = [("n", 1), ("wall_us", int((time.time() - t0) * 1e6))]
    if c0 is not None:
        done.append(("cpu_us", int((time.thread_time() - c0) * 1e6)))
    for what, v in done:
        stats[f"paced_{what}_{kind}"] = stats.get(f"paced_{what}_{kind}", 0) + v


def pad_action(pace: dict[str, Any] | None, stats: dict[str, int], kind: str, stage: int, t0: float,
               where: str) -> None:
    """Sleep until a compute action of `kind` on virtual `stage`, started at `t0`, has taken its budget: `pace`
    gives one per kind, or per kind and stage ({"F": {stage: seconds}}). Counts in `stats` the budgets granted
    (``paced_budget_us_K``) and the actions that took longer (``pace_overruns``, ``pace_overrun_us``). `where`
    names the action in the error when it has no budget."""
    budget = pace.get(kind) if pace else None
    if isinstance(budget, dict):  # per virtual stage
        budget = budget.get(stage)
    if budget is None:  # an unpaced action would run at CPU speed beside paced ones: refuse, don't guess
        raise ValueError(f"{where} has no pacing budget for kind {kind!r} (budgets given: {pace}); give every "
                         "compute kind the schedule runs a budget")
    key = f"paced_budget_us_{kind}"  # what the emulated device granted, per kind (validate_planner)
    stats[key] = stats.get(key, 0) + int(budget * 1e6)
    left = budget - (time.time() - t0)
    if left > 0:
        time.sleep(left)
    else:  # how many, and by how much in total (µs): what the padding could not equalise
        stats["pace_overruns"] = stats.get("pace_overruns", 0) + 1
        stats["pace_overrun_us"] = stats.get("pace_overrun_us", 0) + int(-left * 1e6)


def needed_kinds(delay_wgrad: Iterable[bool]) -> tuple[str, ...]:
    """The compute kinds that runs with these delayed-W settings execute: F always, B for a run
    without delayed W, I and W for a run with it."""
    dw = set(delay_wgrad)
    return tuple(k for k in PACE_KINDS if k == "F" or (k == "B" and False in dw) or (k in "IW" and True in dw))


def _fmt(budgets: dict[str, float]) -> str:
    return ", ".join(f"{k}={1e3 * v:g} ms" for k, v in budgets.items()) or "none"


def check_budgets(budgets: dict[str, float], needed: Sequence[str], where: str) -> None:
    """Raise unless every kind in `needed` has a budget: an unpaced action in a paced run would
    give that configuration a device of its own, the comparison paced compute exists to prevent."""
    missing = [k for k in needed if k not in budgets]
    if missing:
        raise ValueError(f"--pace: {where} has no budget for {', '.join(missing)} (the configurations run "
                         f"execute {', '.join(needed)}); budgets given: {_fmt(budgets)}")


def parse_pace(text: str | None, *, warmup: int = 1, quantile: float = 0.9, margin: float = 1.25,
               needed: Sequence[str] = ()) -> dict[str, float] | str | None:
    """``--pace``: None ("none"), "auto", or {kind: seconds} for every stage from "F=60,B=120" (ms).

    Errors name the bad part; "auto" calibrates on warm-up rounds, so it needs ``warmup >= 1``;
    explicit budgets must cover every kind in `needed` (`needed_kinds`).
    """
    text = (text or "none").strip()
    if text == "none":
        return None
    if text == "auto":
        if warmup < 1:
            raise ValueError("--pace auto calibrates on the warm-up rounds: give --warmup >= 1")
        if not (0 < quantile <= 1) or margin < 1:
            raise ValueError(f"--pace-quantile must be in (0, 1] (got {quantile}) and --pace-margin >= 1 "
                             f"(got {margin})")
        return "auto"
    out: dict[str, float] = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        k = k.strip().upper()
        try:
            ms = float(v)
        except ValueError:
            ms = -1.0
        if k not in PACE_KINDS or ms <= 0:
            raise ValueError(f"--pace {text!r}: {part!r} is not KIND=MS with KIND in {'/'.join(PACE_KINDS)} "
                             "and MS > 0 (or use 'auto' / 'none')")
        out[k] = ms / 1e3
    check_budgets(out, needed, f"{text!r}")
    return out


def calibrate_pace(traces: Sequence[list[dict[str, Any]] | None], pp: int, quantile: float,
                   margin: float, needed: Sequence[str] = ()) -> list[dict[str, float]]:
    """Per stage {kind: seconds}: the quantile of the traced durations × margin.

    A stage without a traced duration for a kind in `needed` raises (naming stage and kind).

    `traces` are runtime traces (records with stage, kind, start, end). B's budget is at
    least I's + W's (a backward split into I and W does the same work), and I and W are
    scaled up together to fill B's budget, so delayed-W configurations get the same device
    time per microbatch as plain ones.
    """
    out = []
    for s in range(pp):
        q: dict[str, float] = {}
        for kind in PACE_KINDS:
            d = sorted(r["end"] - r["start"] for tr in traces if tr for r in tr
                       if r["stage"] == s and r["kind"] == kind)
            if d:
                q[kind] = d[min(len(d) - 1, max(0, math.ceil(quantile * len(d)) - 1))] * margin
        if "I" in q and "W" in q:
            q["B"] = max(q.get("B", 0.0), q["I"] + q["W"])
            scale = q["B"] / (q["I"] + q["W"])
            q["I"], q["W"] = q["I"] * scale, q["W"] * scale
        check_budgets(q, needed, f"auto calibration of stage {s} (from {sum(1 for t in traces if t)} warm-up traces)")
        out.append(q)
    return out


class Pacer(ActionHook):
    """The runtime hook that paces compute: every compute action sleeps until it has taken its budget
    (`pad_action`); every action, and the step's tail (what follows the last action: the gradient reductions,
    the last sends), is counted per kind in the step's stats (`note_action`: ``paced_n_K``, ``paced_wall_us_K``,
    and for compute ``paced_cpu_us_K``). ``budgets`` None: nothing paced or counted (an unpaced round)."""

    def __init__(self, mesh: int) -> None:
        self.mesh = mesh
        self.budgets: dict[str, float | dict[int, float]] | None = None
        self._t0 = self._c0 = self._last = 0.0

    def before(self, action: Any, stats: dict[str, Any]) -> None:
        if self.budgets is not None:
            self._t0 = time.time()
            if action.kind.is_compute:
                self._c0 = time.thread_time()

    def after(self, action: Any, stats: dict[str, Any], error: BaseException | None) -> None:
        if self.budgets is None or error is not None:
            return
        kind = action.kind.value
        if action.kind.is_compute:  # noted before its padding: what the emulated device's budget had to cover
            note_action(stats, kind, self._t0, self._c0)
            pad_action(self.budgets, stats, kind, action.stage, self._t0, f"stage {self.mesh}: action {action}")
        else:
            note_action(stats, kind, self._t0)
        self._last = time.time()

    def end_step(self, stats: dict[str, Any]) -> None:
        if self.budgets is not None:
            note_action(stats, "tail", self._last)


def pacer(runtime: Any) -> Pacer:
    """`runtime`'s pacing hook, added to its hooks on first use (set ``.budgets`` to pace, None to stop)."""
    for h in runtime.hooks:
        if isinstance(h, Pacer):
            return h
    h = Pacer(runtime.stage)
    runtime.hooks.append(h)
    return h
