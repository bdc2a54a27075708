"""A hang watchdog: if one activity (a collective, a resharding wait, a pipeline action)
runs longer than ``--comm-timeout``, this rank says what it was doing and where its
threads stand, then exits non-zero. Every stuck rank fires on its own, so the job's log
shows the whole picture (who waits for whom) instead of a silent hang.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO


class Watchdog:
    """Tracks the current activity of this rank from a daemon thread."""

    def __init__(self, timeout_s: float, rank: int, out: TextIO | None = None,
                 on_fire: Callable[[int], None] = os._exit) -> None:
        if timeout_s <= 0:
            raise ValueError(f"--comm-timeout must be positive, got {timeout_s}")
        self.timeout_s, self.rank = timeout_s, rank
        self.out = out or sys.stderr
        self.on_fire = on_fire
        self._current: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megareshard-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def activity(self, what: str) -> Iterator[None]:
        """Mark ``what`` (e.g. 'stage 1 WAIT_F mb 3 from stage 0') as running on this rank."""
        with self._lock:
            previous = self._current
            self._current = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._current = previous

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            with self._lock:
                current = self._current
            if current is None:
                continue
            what, since = current
            waited = time.monotonic() - since
            if waited > self.timeout_s:
                print(f"[watchdog] rank {self.rank}: '{what}' has run for {waited:.1f}s, over --comm-timeout "
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
