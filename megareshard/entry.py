"""The training entry points' error contract (`pretrain_gpt.py`, `pretrain_utransformer.py`): a bad input ends
in one ``PROG: error: ...`` line and exit code 2; a run that stops — a missing, dead, stalled or cut-off rank,
a failed pre-flight, a failed checkpoint save, a non-finite loss or gradient — in one such line on every rank
and exit code 1.

Under torchrun every rank parses the same arguments and meets the same error before any process group
exists: that line is printed by the first process of each node only (``LOCAL_RANK`` 0), so one node prints
it once, and a cause that only one node has (a file missing there) is still reported by that node.

Imports no torch: the entry points parse their arguments (and answer ``--help``) before the trainer loads.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from .arguments import ConfigError

__all__ = ["run_entry_point", "prints_argument_errors"]


def prints_argument_errors() -> bool:
    """Whether this process prints an error every rank of its node meets alike (see the module docstring):
    outside torchrun always, inside it only the node's first process. Errors met after the process group
    exists may differ between ranks: every rank prints those."""
    dist = sys.modules.get("torch.distributed")  # imported by then if a process group exists
    if dist is not None and dist.is_available() and dist.is_initialized():
        return True
    return os.environ.get("LOCAL_RANK", "0") == "0"


def run_entry_point(prog: str, body: Callable[[], object], *, hard_exit_after_peer_failure: bool = False) -> int:
    """Run `body` and turn the errors above into their line and exit code. `hard_exit_after_peer_failure` (as a
    script): after a peer failure the process ends with ``os._exit(1)`` — the process group broke
    mid-operation, and tearing it down at exit can abort in C++ ("terminate called without an active
    exception", SIGABRT) instead of exiting 1."""
    try:
        body()
    except ConfigError as e:
        if prints_argument_errors():
            print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from .launch import PeerFailure, PreflightError
        from .training import RunStopped

        if not isinstance(e, (PeerFailure, PreflightError, *RunStopped)):  # RunStopped is a tuple: unpacked
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if hard_exit_after_peer_failure and isinstance(e, PeerFailure):
            sys.stdout.flush()
            os._exit(1)
        return 1
    return 0
