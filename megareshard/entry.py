"""The training entry points' error contract (`pretrain_gpt.py`, `pretrain_utransformer.py`): a bad input ends
in one ``PROG: error: ...`` line and exit code 2; a run that stops — a missing, dead, stalled or cut-off rank,
a failed pre-flight, a failed checkpoint save, a non-finite loss or gradient — in one such line and exit code 1.

Printed once, never two ranks' lines run together:

* Under torchrun every rank parses the same arguments and meets the same error before any process group
  exists: that line is printed by the first process of each node only (``LOCAL_RANK`` 0), so one node prints
  it once, and a cause that only one node has (a file missing there) is still reported by that node.
* Once the process group exists, a line several ranks raise alike (an agreed error) is printed by the first
  rank to report it (a key in the job's rendezvous store); a peer failure's line names its own rank and is
  printed by each. Each line is written whole.

Imports no torch: the entry points parse their arguments (and answer ``--help``) before the trainer loads.
"""
from __future__ import annotations

import hashlib
import os
import sys
from datetime import timedelta
from typing import Callable

from .arguments import ConfigError

__all__ = ["run_entry_point", "prints_argument_errors"]


def _process_group() -> object | None:
    """torch.distributed if a process group exists (it was imported by then), else None."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def prints_argument_errors() -> bool:
    """Whether this process prints an error every rank of its node meets alike before a process group exists:
    outside torchrun always, inside it only the node's first process."""
    return _process_group() is not None or os.environ.get("LOCAL_RANK", "0") == "0"


def run_entry_point(prog: str, body: Callable[[], object], *, hard_exit_after_peer_failure: bool = False) -> int:
    """Run `body` and turn the errors above into their line and exit code. `hard_exit_after_peer_failure` (as a
    script): after a peer failure the process ends with ``os._exit(1)`` — the process group broke
    mid-operation, and tearing it down at exit can abort in C++ ("terminate called without an active
    exception", SIGABRT) instead of exiting 1."""
    try:
        body()
    except ConfigError as e:
        if prints_argument_errors():
            _report(f"{prog}: error: {e}")
        return 2
    except Exception as e:
        from .launch import PeerFailure, PreflightError
        from .training import RunStopped

        if not isinstance(e, (PeerFailure, PreflightError, *RunStopped)):  # RunStopped is a tuple: unpacked
            raise
        # a peer failure's line names its own rank, and its store may be the part that failed: printed by each
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
        dist = _process_group()
        if dist is None or dist.get_world_size() == 1:
            return True
        from torch.distributed.distributed_c10d import _get_default_store  # the store the job rendezvoused on

        store = _get_default_store()
        store.set_timeout(timedelta(seconds=10))
        key = "megareshard/reported/" + hashlib.sha1(line.encode("utf-8", "replace")).hexdigest()[:20]
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 (the job is ending: any failure here means "print it")
        return True
