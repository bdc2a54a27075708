"""One resharding run in flight on this rank: its shared state (`RunState`), the handle a caller waits on
(`ReshardHandle`), and `post_together`, which issues several runs' inline operations as one group per
communicator. The `Resharder` (executor.py) makes them; the pipeline's runtime posts and waits them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .streams import GroupKey, Op, issue


__all__ = ["RunState", "ReshardHandle", "post_together", "await_entry"]


def await_entry(entry: list[Any]) -> None:
    """Wait for one operation's ``[work, waited, (watcher event, (error))]`` entry. gloo counts completions (a
    second wait() on a work blocks forever), so a work that a trace watcher waits is waited through its event."""
    if len(entry) > 2:
        entry[2].wait()
        if len(entry) > 3:  # the watcher's wait() raised: raise it here
            raise entry[3]
    elif not entry[1]:
        entry[0].wait()
        entry[1] = True


@dataclass
class RunState:
    """State shared by one run's stream items on this rank."""

    works: list[list[Any]] = field(default_factory=list)  # [work, waited]: wait() waits the others
    side_done: dict[tuple[int, int], threading.Event] = field(default_factory=dict)  # plan: (pos, side)
    tokens_posted: threading.Event = field(default_factory=threading.Event)
    token_works: dict[tuple[int, int], list[list[Any]]] = field(default_factory=dict)
    failed: threading.Event = field(default_factory=threading.Event)
    trace: list[dict[str, Any]] = field(default_factory=list)
    watchers: list[threading.Thread] = field(default_factory=list)  # concurrent order, trace=True: one per wire op
    unwatched: list[tuple[list[Any], dict[str, Any]]] = field(default_factory=list)  # inline ops until issued


class ReshardHandle:
    """An in-flight resharding run; `wait()` returns the destination shard (or None).

    A run started with ``post=False`` holds its inline operations unissued (``pending``): `post` issues them,
    `post_together` issues several runs' at once (one group per communicator), and `wait` issues whatever is
    still pending before waiting. ``owner`` is the `Resharder` that made it (``executor.py``, which imports this
    module: not imported back, not even for the annotation)."""

    def __init__(self, owner: Any, out: torch.Tensor | None, run: RunState, items: list[Any],
                 copies: list[tuple[torch.Tensor, torch.Tensor]], keep: list[Any],
                 bufs: dict[int, torch.Tensor] | None, pending: list[tuple[GroupKey, list[Op]]]) -> None:
        self._owner = owner
        self._out = out
        self._run = run
        self._items = items
        self._copies = copies  # (destination view, flat receive buffer) after the data is in
        self._keep = keep  # send payloads must live until the sends complete
        self._bufs = bufs
        self.pending = pending  # (communicator key, operations) issued inline by post()
        self._done = False
        self.trace = run.trace  # trace=True: filled by the stream threads (plan) or the watchers (concurrent)

    @property
    def _works(self) -> list[Any]:
        return [entry[0] for entry in self._run.works]

    def post(self) -> None:
        """Issue this run's pending operations (one group per communicator); nothing if already posted."""
        post_together([self])

    def wait(self) -> torch.Tensor | None:
        if self._done:
            return self._out
        if self.pending:
            self.post()
        for it in self._items:
            it.done.wait()
        errors = [it.error for it in self._items if it.error is not None]
        if errors:
            raise RuntimeError(f"rank {self._owner.rank}: resharding ({self._owner.name}) failed") from errors[0]
        for entry in self._run.works:
            await_entry(entry)
        for t in self._run.watchers:  # each has set its event: ends at once (joined before any teardown)
            t.join()
        for view, buf in self._copies:
            view.copy_(buf.view(view.shape))
        self._done = True
        self._keep.clear()
        if self._bufs is not None:
            self._owner._release(self._bufs)
            self._bufs = None
        return self._out


def post_together(handles: Sequence[ReshardHandle]) -> None:
    """Issue the pending operations of `handles` from this thread: per communicator one group holding every
    handle's operations on it, in the order the handles are given (on each communicator the operations
    between two ranks pair in issue order: give receives in the order their sender sends them)."""
    by_key: dict[GroupKey, tuple[Any, list[Op]]] = {}
    for h in handles:
        for key, ops in h.pending:
            by_key.setdefault(key, (h._owner._group_of[key], []))[1].extend(ops)
        h.pending = []
    for group, ops in by_key.values():
        issue(group, ops)
    for h in handles:
        h._owner._watch_issued(h._run)
