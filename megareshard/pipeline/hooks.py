"""Action hooks: what watches or shapes the pipeline runtime's actions from outside its loop.

The runtime (`runtime.py`) runs a mesh's action list and does nothing else per action; whatever else
happens around an action — the hang watchdog naming it, the measured timeline, a benchmark's paced
compute (`lab.cluster.pacing`) — is a hook given to the runtime (``runtime.hooks``). A hook overrides
the methods it needs; the runtime calls only those (a training run without a trace pays for the
watchdog's two calls per action and nothing else):

=================================  =================================================================
``start_step(stats, train)``       a step begins (``stats``: the step's counters, kept as
                                   ``runtime.last_stats`` after a training step)
``before(action, stats)``          an action is about to run
``after(action, stats, error)``    it ran (``error``: what it raised, then re-raised by the runtime)
``send_done(record)``              a stage-boundary send was retired: known complete (``record``: stage,
                                   vstage, kind SEND_F/SEND_B, mb, start = posted, end = retired, edge,
                                   peer; `posting.py` says where a send is retired)
``end_step(stats)``                the step's program ran, its sends completed; before the loss sum
=================================  =================================================================

Hooks run on the thread that runs the schedule, in the order given (``after`` in reverse order).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # annotations only: the hooks module stays free of torch
    from .schedule import Action

__all__ = ["ActionHook", "HookSet", "TraceHook", "WatchdogHook"]


class ActionHook:
    """Base class: every method does nothing; override the ones a hook needs."""

    def start_step(self, stats: dict[str, Any], train: bool) -> None:
        pass

    def before(self, action: Action, stats: dict[str, Any]) -> None:
        pass

    def after(self, action: Action, stats: dict[str, Any], error: BaseException | None) -> None:
        pass

    def send_done(self, record: dict[str, Any]) -> None:
        pass

    def end_step(self, stats: dict[str, Any]) -> None:
        pass


class HookSet:
    """The bound methods the runtime calls, resolved once from a list of hooks (overridden ones only)."""

    def __init__(self, hooks: Sequence[ActionHook]) -> None:
        self.hooks = tuple(hooks)

        def bound(name: str, reverse: bool = False) -> tuple[Callable[..., None], ...]:
            hs = reversed(self.hooks) if reverse else self.hooks
            return tuple(getattr(h, name) for h in hs if getattr(type(h), name) is not getattr(ActionHook, name))

        self.start_step, self.before, self.send_done, self.end_step = (bound(n) for n in (
            "start_step", "before", "send_done", "end_step"))
        self.after = bound("after", reverse=True)


class WatchdogHook(ActionHook):
    """Marks each action as this rank's current activity, so the hang watchdog (`launch.Watchdog`) names the
    action that outlasts ``--comm-timeout`` or fails with a communication error. `describe(action)` names it
    (e.g. 'stage 1 action WF3<-0 (microbatch 3, peer stage 0 on ranks [0, 1])'); it is called only when a
    report is printed."""

    def __init__(self, watchdog: Any, describe: Callable[[Action], str]) -> None:
        self.watchdog, self.describe = watchdog, describe
        self._token: tuple | None = None

    def before(self, action: Action, stats: dict[str, Any]) -> None:
        describe = self.describe
        self._token = self.watchdog.begin(lambda: describe(action))

    def after(self, action: Action, stats: dict[str, Any], error: BaseException | None) -> None:
        token, self._token = self._token, None
        if token is not None:
            self.watchdog.end(token, error)


class TraceHook(ActionHook):
    """The measured timeline of the last training step (``--pipeline-trace``): one record per compute action
    and R (stage = mesh, vstage, kind, mb, start, end; wall seconds) and per completed send."""

    def __init__(self, mesh: int) -> None:
        self.mesh = mesh
        self.records: list[dict[str, Any]] = []
        self._t0 = 0.0

    def start_step(self, stats: dict[str, Any], train: bool) -> None:
        self.records = []  # an evaluation step's records are dropped: the runtime keeps a training step's

    def before(self, action: Action, stats: dict[str, Any]) -> None:
        self._t0 = time.time()

    def after(self, action: Action, stats: dict[str, Any], error: BaseException | None) -> None:
        k = action.kind
        if k.is_compute or k.is_reduce:
            self.records.append({"stage": self.mesh, "vstage": action.stage, "kind": k.value,
                                 "mb": action.mb if k.is_compute else 0, "start": self._t0, "end": time.time()})

    def send_done(self, record: dict[str, Any]) -> None:
        self.records.append(record)
