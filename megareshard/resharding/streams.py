"""Communicators of cross-mesh resharding, who drives each, and how operations are issued on them.

**Communicators by participant set.** A unit task runs on the communicator of its participants — its
sending rank and the receivers it serves over the network — and of the ranks that *forward* in it (a
broadcast chain hop, an intra-host fan-out, an all-gather exchange): the key is ``(participants,
forwarders)``, sorted rank tuples, the same on every rank (it is a function of the agreed plan). Tasks of
any `Resharder` sharing one `CommStreams` with the same key share the communicator, so their number is
bounded by the distinct sets, never by tasks or microbatches. The two directions of a pipeline edge between
two one-rank ends have the same key, ``((a, b), ())``, and share one communicator: that is what lets a
send and a receive with the same peer go out as **one grouped operation** (torch's ``batch_isend_irecv``
takes operations of one process group only). Which receives may be posted when on such a shared
communicator, under NCCL's issue-order rule, is the pipeline's posting plan (`pipeline/posting.py`), proven
by its NCCL-model dry run. A communicator with forwarders always has at least two receivers, so it is never
shared by the two directions of an edge. Tasks run as one NCCL ``broadcast`` collective get
``("bcast", sender, participants)``: a collective's order must be the same on every member, which two
directions posted independently could not keep. `order="plan"` runs get their own ``("plan", ...)``
communicators (gloo only: see the executor).

**Who drives a communicator.** On a rank, every operation of one communicator is issued by one thread
(NCCL's rule; the checking mode records the thread of every operation). A rank that forwards in a
communicator's tasks — it must wait for data before sending it on — drives it from that communicator's own
*stream thread* (a CUDA stream's semantics: FIFO, and the wait blocks only this communicator). Every other
rank — pure receivers, direct senders — issues inline, from the thread that calls ``start()`` (the
pipeline's schedule thread): no hand-off. The key names the forwarders, so the choice is fixed per
(communicator, rank) whatever `Resharder` uses it.

**Issuing.** `issue` posts one communicator's operations as one group: ``batch_isend_irecv`` (NCCL's
ncclGroupStart/End; on gloo the same posting, one operation after another) for several point-to-point
operations, a plain ``isend``/``irecv`` for one, ``broadcast`` for a collective task. Nothing here blocks.

**Teardown.** `CommStreams.close` stops *and joins* every stream thread before the communicators are
destroyed: a thread still alive when the interpreter finalizes can be killed inside a C++ call that released
the GIL (torch releases it while destroying a ``Work``), which aborts the process ("terminate called without
an active exception").
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..parallel.nccl_check import set_label, set_op_labels

__all__ = ["CommStreams", "GroupKey", "Op", "issue"]

GroupKey = tuple  # ((participants...), (forwarders...)), ("bcast", sender, (participants...)), ("plan", ...)


# ---------------------------------------------------------------------------------- streams
class _Item:
    """One unit of work on a stream; `done` is set when it has run (or failed)."""

    __slots__ = ("fn", "done", "error")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Stream:
    """The one thread that issues every operation of one communicator on this rank, in FIFO order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> _Item:
        item = _Item(fn)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put(item)
        return item

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                item.fn()
            except BaseException as e:  # surfaced by ReshardHandle.wait()
                item.error = e
            item.done.set()
            del item  # drop the run's works and buffers here, not at the next get()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread and join it; False if it did not end within `timeout` (an operation never completed)."""
        if self._thread is None:
            return True
        self._queue.put(None)
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive:
            self._thread = None
        return not alive


class CommStreams:
    """The communicators of cross-mesh resharding, one per distinct key, and the stream threads of those this
    rank drives through one.

    Share one instance between every Resharder of a job (the pipeline does): tasks with the same key then
    share a communicator. Creation is collective over the parent group and must happen in the same order on
    every rank (Resharder construction guarantees it); `pipeline.comm.communicator_keys` counts them without
    processes.
    """

    def __init__(self) -> None:
        self._groups: dict[Any, Any] = {}
        self._streams: dict[Any, _Stream] = {}
        self._rank = dist.get_rank()
        self._pg = dist.distributed_c10d._get_default_group()
        self._built = 0
        _LIVE.add(self)

    @classmethod
    def shared(cls) -> "CommStreams":
        """The process's default instance for the current default process group (created on first use)."""
        pg = dist.distributed_c10d._get_default_group()
        inst = _SHARED.get("streams")
        if inst is None or inst._pg is not pg:
            inst = _SHARED["streams"] = cls()
        return inst

    def group(self, key: Any, ranks: list[int]) -> Any:
        """The communicator for `key` over global `ranks`; created on first use (collective: every rank calls)."""
        if key not in self._groups:
            self._groups[key] = dist.new_group(sorted(ranks))
        return self._groups[key]

    def next_index(self) -> int:
        """A serial number per Resharder built on this instance (identical on every rank)."""
        self._built += 1
        return self._built - 1

    def stream(self, key: Any) -> _Stream:
        if key not in self._streams:
            self._streams[key] = _Stream(f"reshard-stream-r{self._rank}-{key}")
        return self._streams[key]

    def threads(self) -> list[threading.Thread]:
        """The stream threads running now (for tests and teardown checks)."""
        return [s._thread for s in self._streams.values() if s._thread is not None]

    def close(self, destroy_groups: bool = False, timeout: float = 60.0) -> None:
        """Stop and join the stream threads; with ``destroy_groups`` then destroy the communicators (every rank,
        after the last run on them has completed). A thread that does not end within `timeout` (one of its
        operations never completed: a peer died) is reported, and its communicator is not destroyed under it."""
        stuck = [k for k, s in self._streams.items() if not s.close(timeout)]
        self._streams = {k: s for k, s in self._streams.items() if k in stuck}
        if destroy_groups:
            for k in [k for k in self._groups if k not in stuck]:
                dist.destroy_process_group(self._groups.pop(k))
        if stuck:
            raise RuntimeError(f"rank {self._rank}: resharding stream thread(s) of communicator(s) {stuck} did not "
                               f"end within {timeout:g} s: an operation on them never completed")


_SHARED: dict[str, CommStreams] = {}  # CommStreams.shared(): a cache per default group, like torch's group registry
_LIVE: "weakref.WeakSet[CommStreams]" = weakref.WeakSet()  # every instance, for the exit hook below


@atexit.register
def _stop_streams_at_exit() -> None:
    """The safety net for a job that never closed its streams: stop and join their idle threads while the
    interpreter is still whole (atexit runs before finalization kills daemon threads). A thread stuck in an
    operation that never completes is left alone (a short timeout), as before."""
    for inst in list(_LIVE):
        for s in list(inst._streams.values()):
            s.close(timeout=1.0)


# ---------------------------------------------------------------------------------- issuing
@dataclass
class Op:
    """One operation a rank issues: ``kind`` 'send' | 'recv' | 'bcast' (the task's NCCL broadcast, `peer` its
    root), on ``flat``; ``entry`` is the ``[work, waited]`` pair the run waits on (work None until issued)."""

    kind: str
    flat: torch.Tensor
    peer: int  # global rank
    label: str
    entry: list


def issue(group: Any, ops: Sequence[Op]) -> None:
    """Post `ops` on the communicator `group` as one group (point-to-point), or one by one (collectives)."""
    p2p = [op for op in ops if op.kind != "bcast"]
    for op in ops:
        if op.kind == "bcast":
            set_label(op.label)
            op.entry[0] = dist.broadcast(op.flat, src=op.peer, group=group, async_op=True)
    if len(p2p) == 1:
        op = p2p[0]
        set_label(op.label)
        fn = dist.isend if op.kind == "send" else dist.irecv
        op.entry[0] = fn(op.flat, op.peer, group=group)
    elif p2p:
        set_op_labels([op.label for op in p2p])
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.flat,
                                                   op.peer, group) for op in p2p])
        set_op_labels(None)
        for op, w in zip(p2p, works):
            op.entry[0] = w
    set_label(None)
