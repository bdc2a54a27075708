"""The training entry points' error contract (`pretrain_gpt.py`, `pretrain_utransformer.py`): a bad input ends
in one ``PROG: error: ...`` line and exit code 2; a run that stops — a missing, dead, stalled or cut-off rank,
a failed pre-flight, a failed checkpoint save, a non-finite loss or gradient — in one such line and exit code 1.
A line several ranks raise alike (an agreed error) is printed once, by the first rank to report it (a key
in the job's rendezvous store); each line is written whole, so ranks sharing a terminal never run together."""
from __future__ import annotations

import hashlib
import os
import sys
from datetime import timedelta
from typing import Callable

from .arguments import ConfigError
from .launch import PeerFailure, PreflightError
from .training import RunStopped

__all__ = ["run_entry_point"]


def run_entry_point(prog: str, body: Callable[[], object], *, hard_exit_after_peer_failure: bool = False) -> int:
    """Run `body` and turn the errors above into their line and exit code. `hard_exit_after_peer_failure` (as a
    script): after a peer failure the process ends with ``os._exit(1)`` — the process group broke
    mid-operation, and tearing it down at exit can abort in C++ ("terminate called without an active
    exception", SIGABRT) instead of exiting 1."""
    try:
        body()
    except ConfigError as e:
        _report(f"{prog}: error: {e}")
        return 2
    except (PeerFailure, PreflightError, *RunStopped) as e:  # RunStopped is a tuple: unpacked, since `except`
        # refuses a nested tuple (TypeError) the moment an exception reaches it; a peer failure's line names its
        # own rank, and its store may be the part that failed: printed without asking it
        _report(f"{prog}: error: {e}", once=not isinstance(e, PeerFailure))
        if hard_exit_after_peer_failure and isinstance(e, PeerFailure):
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0


def _report(line: str, once: bool = True) -> None:
    """Write ``line`` to stderr in one piece, unless (``once``) another rank of this job already reported it."""
    if not once or _first_to_report(line):
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _first_to_report(line: str) -> bool:
    """True on the first rank to report ``line`` (an atomic add on the job's store), and whenever that cannot
    be told — one process, no process group, a store that is gone or silent for 10 s: a line is printed twice
    rather than lost."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return True
        from torch.distributed.distributed_c10d import _get_default_store  # the store the job rendezvoused on

        store = _get_default_store()
        store.set_timeout(timedelta(seconds=10))
        key = "megareshard/reported/" + hashlib.sha1(line.encode("utf-8", "replace")).hexdigest()[:20]
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 (the job is ending: any failure here means "print it")
        return True
