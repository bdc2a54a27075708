"""One writer per checkpoint directory: a lock on ``--save`` that lives exactly as long as the job.

Two jobs saving into one directory replace each other's ``latest`` and iterations, and each one
reports every save as a success. So a job takes ``SAVE/.megareshard.lock`` at start-up: global rank 0
opens the file and holds a POSIX record lock on it (``fcntl.lockf``) for as long as the process
lives; the other ranks learn the outcome from a broadcast, so every rank of a refused job stops with
the same line, naming the holder (host, pid, start time, Slurm job) that the holding rank wrote into
the file. ``--load`` alone takes no lock; ``tools/checkpoint_util.py`` takes it while it writes into a
checkpoint root.

Why a kernel lock and not a marker file: the kernel drops it when the holding process ends, however
it ends (exit, SIGKILL, OOM kill, node crash: the file server reclaims a dead client's locks), and no
lock outlives a reboot, so there is never a stale lock to clean up by hand. The file itself stays
behind with the last holder's details; it means nothing while unlocked. POSIX record locks rather than
``flock``: they are the locks every shared file system in use forwards to its server (NFS via NLM or
NFSv4 — unless mounted with ``local_lock``; Lustre mounted with ``-o flock``; GPFS; BeeGFS with global
locks), and a forked child does not inherit them. What this relies on: on a file system that keeps
locks per node (Lustre ``-o localflock``, BeeGFS without global locks, NFS ``local_lock=posix``) two
jobs on different nodes are not told apart; on one that refuses locks (Lustre's default ``noflock``)
the job goes on with a WARNING saying that a second writer would not be refused. The lock is released
by closing its descriptor, and a POSIX lock is also released when the holding process closes ANY
descriptor of the file: nothing in the holding process opens it again.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from typing import TextIO

from .detect import LOCK_FILE
from .format import CheckpointError

__all__ = ["LOCK_FILE", "CheckpointDirBusy", "DirLock", "busy_message", "try_lock_dir", "lock_save_dir"]


class CheckpointDirBusy(CheckpointError):
    """Another job (or tool) holds the lock of the checkpoint directory; the message names it."""


@dataclass
class DirLock:
    """A held lock (``fd`` open) or the record of a file system that refused locks (``fd`` None)."""

    path: str
    fd: int | None
    unsupported: str | None = None

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)          # closing the descriptor drops the lock


def _holder_record() -> dict:
    rec = {"host": socket.gethostname(), "pid": os.getpid(),
           "since": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z").strip()}
    if os.environ.get("SLURM_JOB_ID"):
        rec["slurm_job"] = os.environ["SLURM_JOB_ID"]
    return rec


def _describe_holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:  # another process holds it: reading cannot release its lock
            rec = json.loads(f.read(4096) or "{}")
    except (OSError, ValueError):
        rec = {}
    if not rec.get("pid"):
        return "a process that has not written its details yet"
    return (f"pid {rec['pid']} on host {rec.get('host', '?')} since {rec.get('since', '?')}"
            + (f" (Slurm job {rec['slurm_job']})" if rec.get("slurm_job") else ""))


def try_lock_dir(root: str) -> tuple[DirLock | None, str | None]:
    """Take ``root``'s lock in this process (creating ``root``). (lock, None) when taken or when the file
    system refuses locks (``lock.unsupported`` says why); (None, holder) when another process holds it."""
    path = os.path.join(root, LOCK_FILE)
    os.makedirs(root, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return None, _describe_holder(path)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return DirLock(path, None, unsupported=f"{e.strerror} (errno {e.errno})"), None
        raise
    data = json.dumps(_holder_record()).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
    return DirLock(path, fd), None


def busy_message(root: str, holder: str, *, training: bool = True) -> str:
    """The one line for a held lock: who holds it, and what to do (a training run, or a tool writing there)."""
    return (f"{'--save ' if training else ''}{root} is in use by another job: {holder} holds its lock ({LOCK_FILE}); "
            "two writers would overwrite each other's checkpoints: wait for it to end or stop it"
            + (", or give this run another --save" if training else " (nothing was written)"))


def lock_save_dir(root: str, out: TextIO | None = None) -> DirLock | None:
    """Collective when torch.distributed is initialised: global rank 0 takes the lock of ``--save root``
    and every rank learns the outcome; a held lock, or a directory that cannot be created, raises the
    same ``CheckpointError`` on every rank. Returns rank 0's lock (None on the other ranks); a file system
    without locks gives a WARNING line on ``out`` (rank 0) and the run goes on."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    lock, outcome = None, None  # outcome: (error class name, message) when the run must stop
    if rank == 0:
        try:
            lock, holder = try_lock_dir(root)
            if holder is not None:
                outcome = ("busy", busy_message(root, holder))
        except OSError as e:
            outcome = ("error", f"--save {root}: cannot create the directory or its lock file: {e.strerror} "
                                f"(errno {e.errno})")
    if distributed:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if outcome is not None:
        raise (CheckpointDirBusy if outcome[0] == "busy" else CheckpointError)(outcome[1])
    if lock is not None and lock.unsupported and out is not None:
        print(f"WARNING: --save {root}: the file system refuses locks ({lock.unsupported}): a second job saving "
              "into this directory would not be refused", file=out, flush=True)
    return lock
