"""A hang watchdog: if one activity (a collective, a resharding wait, a pipeline action)
runs longer than ``--comm-timeout``, this rank says what it was doing and where its
threads stand, then exits non-zero. Every stuck rank fires on its own, so the job's log
shows the whole picture (who waits for whom) instead of a silent hang.

The same per-rank report is printed when an activity ends with a communication error
instead of hanging: a peer killed mid-iteration closes its sockets, and gloo fails the
survivors' pending operations at once ("Connection closed by peer"); a peer that stops
answering (SIGSTOP, a dead network) ends in gloo's own timeout (``--comm-timeout``, given to
``init_process_group``) or in this watchdog, whichever comes first. The entry points turn
such an error into one line and exit status 1 (``PeerFailure``).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

import torch.distributed as dist


class PeerFailure(RuntimeError):
    """This rank stopped because a collective or pipeline transfer failed: a peer died, stalled or
    was cut off. The message holds the rank, the activity (stage, action, microbatch, peer) and the error."""


# what gloo's and the store's errors say when a peer is gone (older torch raises plain RuntimeError)
_GLOO_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Socket Timeout",
                 "gloo/transport", "Broken pipe", "Connection refused")


def is_communication_error(exc: BaseException) -> bool:
    """Errors that a dead, stopped or unreachable peer produces in torch.distributed (gloo/NCCL, the
    store) — including DCP's CheckpointException (a BaseException) that wraps one during a save."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return False
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and any(k in text for k in _GLOO_MARKERS):
            return True
        failures = getattr(exc, "failures", None)   # DCP CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            for inner in failures.values():
                inner = inner[0] if isinstance(inner, tuple) else inner
                if isinstance(inner, BaseException) and is_communication_error(inner):
                    return True
        exc = exc.__cause__ or exc.__context__
    return False


class Watchdog:
    """Tracks the current activity of this rank from a daemon thread."""

    def __init__(self, timeout_s: float, rank: int, out: TextIO | None = None,
                 on_fire: Callable[[int], None] = os._exit) -> None:
        if timeout_s <= 0:
            raise ValueError(f"--comm-timeout must be positive, got {timeout_s}")
        self.timeout_s, self.rank = timeout_s, rank
        self.out = out or sys.stderr
        self.on_fire = on_fire
        self._current: tuple[str | Callable[[], str], float, bool] | None = None  # (what, since, timed)
        self.failure: str | None = None  # the report of the first activity that ended in a communication error
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megareshard-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def activity(self, what: str, timed: bool = True) -> Iterator[None]:
        """Mark ``what`` (e.g. 'stage 1 WAIT_F mb 3 from stage 0') as running on this rank. ``timed=False``:
        no time limit (a checkpoint save may rightly outlast --comm-timeout), errors are still reported."""
        token = self.begin(what, timed=timed)
        try:
            yield
        except BaseException as e:
            self.end(token, e)
            raise
        self.end(token)

    def begin(self, what: str | Callable[[], str], timed: bool = True) -> tuple:
        """Start an activity (the split form of `activity`, for a hot loop): ``what`` may be a callable that
        names it, called only if a report is printed. Returns the token `end` takes."""
        start = time.monotonic()
        with self._lock:
            previous = self._current
            self._current = (what, start, timed)
        return previous, what, start

    def end(self, token: tuple, error: BaseException | None = None) -> None:
        """End the activity `begin` started; an `error` from a dead or unreachable peer is reported once."""
        previous, what, start = token
        if error is not None and self.failure is None and is_communication_error(error):
            waited = time.monotonic() - start
            first = (str(error).strip().splitlines() or [""])[0][:300]
            self.failure = (f"rank {self.rank}: '{_name(what)}' failed after {waited:.1f}s: {type(error).__name__}: "
                            f"{first} (a peer rank died, stalled or lost its network)")
            print(f"[watchdog] {self.failure}", file=self.out, flush=True)
        with self._lock:
            self._current = previous

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            with self._lock:
                current = self._current
            if current is None:
                continue
            what, since, timed = current
            waited = time.monotonic() - since
            if timed and waited > self.timeout_s:
                print(f"[watchdog] rank {self.rank}: '{_name(what)}' has run for {waited:.1f}s, over --comm-timeout "
                      f"{self.timeout_s:g}s; stacks follow, then exit", file=self.out, flush=True)
                try:
                    faulthandler.dump_traceback(file=self.out, all_threads=True)
                except (ValueError, OSError, AttributeError):  # stream without a file descriptor
                    pass
                self.out.flush()
                self.on_fire(1)
                return

    def stop(self) -> None:
        self._stop.set()


def _name(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()
