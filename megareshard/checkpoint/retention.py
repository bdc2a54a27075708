"""Which checkpoints a run keeps: ``--save-retain-latest N`` and ``--save-retain-interval K``.

After each complete save (renamed into place, ``latest`` updated), the saving rank (global rank 0)
removes the checkpoints of ``--save`` that the policy does not keep:

* the newest ``N`` checkpoints are kept, counted down from the one ``latest`` names (torchtitan's
  ``checkpoint.keep_latest_k``, the Hugging Face Trainer's ``save_total_limit``); ``0``: no limit;
* so is every checkpoint whose iteration is divisible by ``K`` (Megatron-LM's ``--save-retain-interval``,
  which alone keeps the latest checkpoint besides those: ``K`` without ``N`` is ``N = 1``);
* the checkpoint ``latest`` names is always kept, and so is every checkpoint NEWER than it (left by a run
  that was killed after renaming it but before writing ``latest``, or by another run of the root: a
  later save of that iteration replaces it, and nothing here second-guesses which timeline is wanted).

``to_prune`` is that rule on iteration numbers alone. ``prune`` applies it to a directory, and is safe
under kill -9 at any point:

* candidates are only directories named exactly ``iter_NNNNNNN`` (``format.iteration_dirname``) that hold
  ``checkpoint.json`` and are not symbolic links; ``.tmp.*`` entries (a save being written, a killed save)
  and anything else in the root are never touched;
* a victim is first RENAMED to ``.tmp.pruned.iter_NNNNNNN`` (atomic; the directory fsynced) and only then
  deleted: a loader, which picks a checkpoint through ``latest`` or by an ``iter_*`` directory holding
  ``checkpoint.json`` (``format.resolve_checkpoint_dir``), never sees a half-deleted checkpoint under a
  checkpoint's name, and ``checkpoint/detect.py`` counts ``.tmp.*`` names as this package's leftovers;
* what a killed prune left (``.tmp.pruned.*``) is removed by the next prune, which runs after every
  save whether or not retention is on.

Test hook: ``MEGARESHARD_CHECKPOINT_KILL_AT=prune`` SIGKILLs the process between a victim's rename and
its deletion (``format._maybe_kill``).
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Callable, Iterable

from .format import CHECKPOINT_JSON, TMP_PREFIX, _latest_name, _maybe_kill, fsync_dir, iteration_dirname

__all__ = ["to_prune", "prune", "describe_policy", "TRASH_PREFIX"]

#: what a checkpoint being removed is renamed to first (a ``.tmp.`` name: never loaded, a leftover to detect.py)
TRASH_PREFIX = TMP_PREFIX + "pruned."

_ITER = re.compile(r"^iter_(\d+)$")


def to_prune(iterations: Iterable[int], latest: int | None, keep_latest: int = 0,
             keep_every: int | None = None) -> list[int]:
    """The iterations to remove, oldest first, of the complete checkpoints ``iterations`` when ``latest``
    names the newest complete one: all but the newest ``keep_latest`` up to ``latest`` (``latest``
    included), those divisible by ``keep_every``, and any newer than ``latest``. ``keep_latest`` 0 with
    no ``keep_every``: keep everything; ``keep_every`` with ``keep_latest`` 0 keeps ``latest`` besides
    (Megatron-LM's ``--save-retain-interval``). No ``latest``: nothing is removed."""
    its = sorted(set(int(i) for i in iterations))
    keep_latest = int(keep_latest or 0)
    if keep_latest < 0 or (keep_every is not None and keep_every < 0):
        raise ValueError(f"retention counts must not be negative: keep_latest {keep_latest}, keep_every "
                         f"{keep_every}")
    if latest is None or (keep_latest == 0 and not keep_every):
        return []
    keep_latest = max(keep_latest, 1)
    older = [i for i in its if i <= latest]
    if latest not in older:      # `latest` names no complete checkpoint here: nothing is removed on its word
        return []
    kept = set(older[-keep_latest:])
    if keep_every:
        kept.update(i for i in older if i % keep_every == 0)
    return [i for i in older if i not in kept]


def describe_policy(keep_latest: int, keep_every: int | None) -> str:
    """``keeping the newest 2 and those of iterations divisible by 100`` (for the line of each removal)."""
    n = max(int(keep_latest or 0), 1)
    text = "keeping the newest" + (f" {n}" if n > 1 else " one")
    if keep_every:
        text += f" and those of iterations divisible by {keep_every}"
    return text


def _iteration_dirs(root: str) -> dict[int, str]:
    """iteration -> name of every complete checkpoint directory of ours directly under ``root``."""
    found = {}
    for name in os.listdir(root):
        m = _ITER.match(name)
        if not m or iteration_dirname(int(m.group(1))) != name:
            continue
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, CHECKPOINT_JSON)):
            continue
        found[int(m.group(1))] = name
    return found


def _latest_iteration(root: str) -> int | None:
    name = _latest_name(root)
    m = _ITER.match(name or "")
    return int(m.group(1)) if m and iteration_dirname(int(m.group(1))) == name else None


def prune(root: str, keep_latest: int = 0, keep_every: int | None = None,
          say: Callable[[str, bool], None] | None = None) -> list[str]:
    """Remove what a killed prune left, then the checkpoints of ``root`` that ``to_prune`` names (rank 0,
    after a complete save). Returns the paths removed. Never raises for an I/O error: the save it follows
    succeeded, so a checkpoint that cannot be removed is reported (``say(line, True)``) and kept."""
    say = say or (lambda line, warning=False: print(("WARNING: " if warning else "") + line, flush=True))
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError as e:
        say(f"cannot list {root} to apply the retention policy: {e.strerror or e}", True)
        return removed
    for name in names:                       # a prune killed after its rename: finish the deletion
        if name.startswith(TRASH_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if not keep_latest and not keep_every:
        return removed
    try:
        found = _iteration_dirs(root)
    except OSError as e:
        say(f"cannot list {root} to apply the retention policy: {e.strerror or e}", True)
        return removed
    for it in to_prune(found, _latest_iteration(root), keep_latest, keep_every):
        path = os.path.join(root, found[it])
        trash = os.path.join(root, TRASH_PREFIX + found[it])
        try:
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(path, trash)           # atomic: from here no loader can take it for a checkpoint
            fsync_dir(root)
        except OSError as e:
            say(f"could not remove checkpoint {path} ({e.strerror or e}); it is kept", True)
            continue
        _maybe_kill("prune")
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
        say(f"removed {path} ({describe_policy(keep_latest, keep_every)})", False)
    return removed
