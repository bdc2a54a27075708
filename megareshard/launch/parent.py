"""A torchrun worker ends when its launcher does.

torchrun starts every worker in a session of its own, so when the agent itself is killed
(``kill -9``, an OOM kill of the agent, a node agent that crashed) nothing reaches the workers: they
go on training and saving, and collide with the next job started on the same directories. Each worker
therefore watches its parent, the agent: a daemon thread waits on the parent's pidfd (Linux 5.3+;
polling ``getppid`` twice a second elsewhere) and, the moment the parent is gone, prints one line (from
local rank 0: the node's workers share the cause) and ends the process with exit status 1.

Why not the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) alone: it fires when the
*thread* that started the worker exits, not the launcher process, and a signal's Python handler runs
only when the main thread leaves a blocking collective — the default action, in turn, kills without a
word. A thread that waits on the parent sees the death within milliseconds, whatever the main thread is
blocked in.

Only torchrun's workers (``TORCHELASTIC_RUN_ID`` set) watch: a run started by hand from a shell that
goes away (``nohup``) must go on.
"""
from __future__ import annotations

import os
import select
import sys
import threading
from typing import Callable

__all__ = ["exit_with_launcher"]

ENV = "TORCHELASTIC_RUN_ID"


def _wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` (this process's parent) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            if os.getppid() == pid:   # still ours after opening: the pidfd is not a reused pid's
                select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    stop = threading.Event()
    while os.getppid() == pid:
        stop.wait(0.5)


def exit_with_launcher(prog: str | None = None, *, on_exit: Callable[[int], None] = os._exit,
                       env: dict[str, str] | None = None) -> threading.Thread | None:
    """Under torchrun, start the thread that ends this worker (exit 1) when its launcher is gone; returns it
    (None outside torchrun)."""
    env = os.environ if env is None else env
    if not env.get(ENV):
        return None
    parent = os.getppid()
    prog = prog or os.path.basename(sys.argv[0] or "worker")

    def watch() -> None:
        if parent != 1:
            _wait_for_exit(parent)
        if env.get("LOCAL_RANK", "0") == "0":
            line = (f"{prog}: error: the launcher (torchrun agent, pid {parent}) is gone: its workers on this node "
                    f"stop (exit 1) instead of training on unsupervised\n")
            try:
                os.write(2, line.encode())
            except OSError:
                pass
        on_exit(1)

    t = threading.Thread(target=watch, name="megareshard-launcher-watch", daemon=True)
    t.start()
    return t
