"""What a directory holds, told before anything reads or writes it: the ``--load`` decision and the
checkpoint tool's refusal to overwrite.

``describe_path(path)`` classifies a path in one pass over its names (no file is opened but
Megatron-LM's one-line tracker file); the two policies built on it:

* ``load_decision(load, save)``: ``--load`` starts from a megareshard checkpoint or root; it starts
  from scratch only in Megatron-LM's auto-resume pattern — ``--load`` is the run's own ``--save`` and
  that directory holds no checkpoint yet (nothing at all, or only this package's own leftovers: the
  directory lock and the temp directory of a save that was killed). Anything else that is not a
  checkpoint — a missing path, a directory of other files, a Megatron-LM checkpoint — stops with one
  line saying what was found. Megatron-LM checkpoints are told apart here (``KIND_MEGATRON_ROOT``,
  ``KIND_MEGATRON_ITERATION``) so that a loader for them hooks into this one function.
* ``check_destination(path, force=...)``: a writing tool refuses a destination that exists and is not
  empty (saying what is there) unless forced.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..config_fields import ConfigError
from .format import CHECKPOINT_JSON, LATEST_FILE, TMP_PREFIX, CheckpointError

__all__ = ["PathContents", "describe_path", "load_decision", "check_destination", "same_directory",
           "MEGATRON_TRACKER", "KIND_ABSENT", "KIND_EMPTY", "KIND_CHECKPOINT", "KIND_ROOT", "KIND_MEGATRON_ROOT",
           "KIND_MEGATRON_ITERATION", "KIND_FILE", "KIND_OTHER"]

#: Megatron-LM's name for ``latest`` (its content: an iteration number, or ``release``)
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
#: the lock file of ``--save`` (``lock.py``); named here so that a directory holding only it counts as empty
LOCK_FILE = ".megareshard.lock"

KIND_ABSENT = "absent"                      # nothing at the path
KIND_EMPTY = "empty"                        # a directory with nothing (or only this package's leftovers)
KIND_CHECKPOINT = "checkpoint"              # a megareshard checkpoint directory (checkpoint.json)
KIND_ROOT = "root"                          # a megareshard root: `latest`, or iter_* directories
KIND_MEGATRON_ROOT = "megatron-root"        # a Megatron-LM root: latest_checkpointed_iteration.txt
KIND_MEGATRON_ITERATION = "megatron-iteration"  # one Megatron-LM iteration directory (iter_N, release)
KIND_FILE = "file"                          # a file, not a directory
KIND_OTHER = "other"                        # a directory of something else

_ITER = re.compile(r"^iter_\d+$")
_MP_RANK = re.compile(r"^mp_rank_\d+(_\d+)*$")


@dataclass(frozen=True)
class PathContents:
    """``kind`` (one of the ``KIND_*``) and ``what``: a short description for messages."""

    path: str
    kind: str
    what: str


def _leftover(name: str) -> bool:
    """This package's own files that are not a checkpoint: the lock, a killed save's temp directory or
    half-written ``latest``."""
    return name == LOCK_FILE or name.startswith(TMP_PREFIX) or name.startswith(LATEST_FILE + ".tmp.")


def _names(names: list[str], n: int = 4) -> str:
    shown = ", ".join(sorted(names)[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _megatron_iteration_files(names: list[str]) -> str | None:
    """What marks ``names`` (one directory's) as a Megatron-LM iteration directory, or None."""
    ranks = [n for n in names if _MP_RANK.match(n)]
    if ranks:
        return f"legacy format: {_names(ranks, 2)}"
    if "common.pt" in names or "metadata.json" in names:
        return "distributed format: " + ", ".join(n for n in ("metadata.json", "common.pt", ".metadata") if n in names)
    return None


def describe_path(path: str) -> PathContents:
    """Classify ``path`` (see the ``KIND_*`` constants); never raises for an unreadable directory (it is
    ``KIND_OTHER`` with the reason)."""
    if not os.path.lexists(path):
        return PathContents(path, KIND_ABSENT, "does not exist")
    if not os.path.isdir(path):
        return PathContents(path, KIND_FILE, f"is a file of {os.path.getsize(path)} bytes, not a directory")
    try:
        names = os.listdir(path)
    except OSError as e:
        return PathContents(path, KIND_OTHER, f"cannot be listed ({e.strerror})")
    if CHECKPOINT_JSON in names:
        return PathContents(path, KIND_CHECKPOINT, "is a megareshard checkpoint")
    if MEGATRON_TRACKER in names:
        try:
            with open(os.path.join(path, MEGATRON_TRACKER), encoding="utf-8", errors="replace") as f:
                it = f.read(64).strip()
        except OSError:
            it = "?"
        return PathContents(path, KIND_MEGATRON_ROOT, f"is a Megatron-LM checkpoint root ({MEGATRON_TRACKER} names "
                                                      f"{it!r})")
    marks = _megatron_iteration_files(names)
    if marks is not None:
        return PathContents(path, KIND_MEGATRON_ITERATION, f"is a Megatron-LM checkpoint iteration directory ({marks})")
    iters = [n for n in names if _ITER.match(n)]
    if LATEST_FILE in names or iters:
        return PathContents(path, KIND_ROOT, "is a megareshard checkpoint root" + (
            f" ({len(iters)} iteration director{'y' if len(iters) == 1 else 'ies'})" if iters else ""))
    rest = [n for n in names if not _leftover(n)]
    if not rest:
        return PathContents(path, KIND_EMPTY, "holds no checkpoint" + (" (only a lock or an interrupted save's "
                                                                        "temp directory)" if names else ""))
    return PathContents(path, KIND_OTHER, f"holds {len(rest)} entr{'y' if len(rest) == 1 else 'ies'} and no checkpoint "
                                          f"({_names(rest)}; no {LATEST_FILE}, {CHECKPOINT_JSON} or iter_* directory)")


def same_directory(a: str | None, b: str | None) -> bool:
    """Whether two paths name one directory (the same file when both exist, else the same real path)."""
    if not a or not b:
        return False
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def load_decision(load: str, save: str | None) -> PathContents:
    """What ``--load`` finds. Returns it when the run may go on: ``KIND_CHECKPOINT`` or ``KIND_ROOT`` (load
    it; the loader checks the rest), ``KIND_EMPTY`` or ``KIND_ABSENT`` only when ``load`` is ``save``
    (start from scratch). Raises ``ConfigError`` (a bad --load: exit status 2) with one line for everything else."""
    found = describe_path(load)
    own = same_directory(load, save)
    if found.kind in (KIND_CHECKPOINT, KIND_ROOT):
        return found
    if found.kind in (KIND_EMPTY, KIND_ABSENT) and own:
        return found
    where = f"--load {load} {found.what}"
    if found.kind == KIND_MEGATRON_ITERATION:
        parent = os.path.dirname(os.path.abspath(load.rstrip(os.sep)))
        root = parent if os.path.exists(os.path.join(parent, MEGATRON_TRACKER)) else None
        raise ConfigError(f"{where}: pass its root" + (f", --load {root}" if root else f" (the directory with "
                                                       f"{MEGATRON_TRACKER})") + ", not one of its iterations")
    if found.kind == KIND_MEGATRON_ROOT:
        raise ConfigError(f"{where}: loading Megatron-LM checkpoints is not built here (megareshard loads "
                          f"ROOT/{LATEST_FILE} and ROOT/iter_N/{CHECKPOINT_JSON})")
    if found.kind == KIND_ABSENT:
        raise ConfigError(f"{where}: is the path mistyped? (only --load equal to --save may name a directory "
                          "that holds no checkpoint yet: the first run of an auto-resuming job)")
    if found.kind == KIND_EMPTY:
        raise ConfigError(f"{where}: nothing to load (an empty --load starts from scratch only when it is "
                          "also --save, the first run of an auto-resuming job)")
    raise ConfigError(f"{where}: not a checkpoint")


def check_destination(path: str, *, force: bool, flag: str = "--force") -> None:
    """A writing tool's guard: ``path`` must not exist, or be a directory that holds nothing (or only this
    package's leftovers, ``KIND_EMPTY``); otherwise raise one line saying what is there, unless ``force``."""
    if force:
        return
    found = describe_path(path)
    if found.kind in (KIND_ABSENT, KIND_EMPTY):
        return
    what = found.what
    if found.kind == KIND_FILE:
        what = f"exists ({os.path.getsize(path)} bytes)"
    elif found.kind == KIND_ROOT:
        what += _latest_note(path)
    elif found.kind == KIND_OTHER and found.what.startswith("holds"):
        what = f"holds {_names([n for n in os.listdir(path) if not _leftover(n)])}"
    raise CheckpointError(f"{path} {what}: refusing to overwrite it (nothing was written); give a new or empty "
                          f"destination, or {flag} to write there anyway")


def _latest_note(root: str) -> str:
    try:
        with open(os.path.join(root, LATEST_FILE), encoding="utf-8", errors="replace") as f:
            return f"; its {LATEST_FILE} names {f.read(80).strip()}"
    except OSError:
        return ""
