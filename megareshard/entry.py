"""The training entry points' error contract (`pretrain_gpt.py`, `pretrain_utransformer.py`): a bad input ends
in one ``PROG: error: ...`` line and exit code 2; a run that stops — a missing, dead, stalled or cut-off rank,
a failed pre-flight, a failed checkpoint save, a non-finite loss or gradient — in one such line on every rank
and exit code 1."""
from __future__ import annotations

import os
import sys
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
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (PeerFailure, PreflightError, *RunStopped) as e:  # RunStopped is a tuple: unpacked, since `except`
        # refuses a nested tuple (TypeError) the moment an exception reaches it
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if hard_exit_after_peer_failure and isinstance(e, PeerFailure):
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0
