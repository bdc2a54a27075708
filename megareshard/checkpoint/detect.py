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

A Hugging Face model directory (``KIND_HF``) is told apart too: ``--load`` of one names the converter
(``tools/checkpoint_util.py import-hf``). ``megatron_iteration(path)`` is which Megatron-LM directories a
run's ``--load`` reads directly (``megatron_load.megatron_checkpoint_dir``, without torch), and
``resume_source(load, save)`` is ``load_decision`` with those accepted: what ``--validate-only`` checks.

What a resume will train, before anything is built: ``read_progress(path)`` reads the iteration and data
position a megareshard checkpoint records in its ``checkpoint.json`` (JSON only: nothing is unpickled) and
``check_progress`` sets them against the new run's ``--train-iters`` × global batch: past it is one line
(a ConfigError), exactly at it is "nothing left to train".

Imports no torch (nor does ``megareshard/checkpoint/__init__.py`` until one of its names is used):
``pretrain_gpt.py --validate-only`` runs all of this in a fraction of a second.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ..config_fields import ConfigError
from .errors import CheckpointError

__all__ = ["PathContents", "describe_path", "load_decision", "check_destination", "same_directory",
           "megatron_iteration", "resume_source", "check_save", "Progress", "read_progress", "check_progress",
           "MEGATRON_TRACKER", "KIND_ABSENT", "KIND_EMPTY", "KIND_CHECKPOINT", "KIND_ROOT", "KIND_MEGATRON_ROOT",
           "KIND_MEGATRON_ITERATION", "KIND_HF", "KIND_FILE", "KIND_OTHER"]

# format.py's names (format.py imports torch, this module must not; tests/test_resume_plan_checks.py checks
# that they agree)
CHECKPOINT_JSON = "checkpoint.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp."

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
KIND_HF = "hf"                              # a Hugging Face model directory: config.json and its weights
KIND_FILE = "file"                          # a file, not a directory
KIND_OTHER = "other"                        # a directory of something else

_ITER = re.compile(r"^iter_\d+$")
_MP_RANK = re.compile(r"^mp_rank_\d+(_\d+)*$")
# what megatron_io.find_megatron_checkpoint reads: iteration directories so named, per-rank directories
_MEGATRON_ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")
_MEGATRON_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
# a Hugging Face model's weights (one file, shards, or the index of shards) beside its config.json
_HF_WEIGHTS = re.compile(r"^(.+\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin|.+\.safetensors\.index\.json|"
                         r"pytorch_model\.bin\.index\.json)$")
IMPORT_HF = "python tools/checkpoint_util.py import-hf"
IMPORT_MEGATRON = "python tools/checkpoint_util.py import-megatron"


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
    weights = [n for n in names if _HF_WEIGHTS.match(n)]
    if "config.json" in names and weights:
        return PathContents(path, KIND_HF, f"is a Hugging Face model directory (config.json, {_names(weights, 2)})")
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
    if found.kind == KIND_HF:
        raise ConfigError(f"{where}, not a checkpoint: convert it once with {IMPORT_HF} {load} OUT, then --load OUT")
    if found.kind == KIND_MEGATRON_ITERATION:
        parent = os.path.dirname(os.path.abspath(load.rstrip(os.sep)))
        root = parent if os.path.exists(os.path.join(parent, MEGATRON_TRACKER)) else None
        if root:
            raise ConfigError(f"{where}: pass its root, --load {root}, not one of its iterations")
        raise ConfigError(f"{where}: give --load (or {IMPORT_MEGATRON} ROOT OUT) its root, the directory with "
                          f"{MEGATRON_TRACKER}")
    if found.kind == KIND_MEGATRON_ROOT:   # a run's --load reads one directly (megatron_iteration): not here
        raise ConfigError(f"{where}: not a megareshard checkpoint; convert it once with {IMPORT_MEGATRON} {load} "
                          "OUT, then --load OUT")
    if found.kind == KIND_ABSENT:
        raise ConfigError(f"{where}: is the path mistyped? (only --load equal to --save may name a directory "
                          "that holds no checkpoint yet: the first run of an auto-resuming job)")
    if found.kind == KIND_EMPTY:
        raise ConfigError(f"{where}: nothing to load (an empty --load starts from scratch only when it is "
                          "also --save, the first run of an auto-resuming job)")
    raise ConfigError(f"{where}: not a checkpoint")


def megatron_iteration(path: str) -> str | None:
    """The Megatron-LM iteration directory a run's ``--load path`` reads directly, or None when ``path`` is not
    one it reads (``megatron_load.megatron_checkpoint_dir`` over ``megatron_io.find_megatron_checkpoint``,
    without torch: a megareshard ``latest`` or ``checkpoint.json`` wins; a root's tracker names ``iter_NNNNNNN``
    or ``release``; an iteration directory so named holds ``metadata.json`` or ``mp_rank_*`` directories). A root
    whose tracker is corrupt or names a missing directory is a ConfigError."""
    if not os.path.isdir(path) or any(os.path.exists(os.path.join(path, n)) for n in (LATEST_FILE, CHECKPOINT_JSON)):
        return None
    tracker = os.path.join(path, MEGATRON_TRACKER)
    if os.path.isfile(tracker):
        try:
            with open(tracker, encoding="utf-8", errors="replace") as f:
                text = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read {tracker}: {e.strerror}") from None
        if text != "release" and not text.isdigit():
            raise ConfigError(f"{tracker} is corrupt: it should hold an iteration number or 'release', found "
                              f"{text[:40]!r}")
        target = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}")
        if not os.path.isdir(target):
            raise ConfigError(f"{tracker} names iteration {text}, but {target} is missing")
        return target
    if _MEGATRON_ITER_DIR.match(os.path.basename(os.path.normpath(path))):
        try:
            names = os.listdir(path)
        except OSError:
            return None
        if "metadata.json" in names or any(_MEGATRON_RANK_DIR.match(n) for n in names):
            return path
    return None


def resume_source(load: str, save: str | None) -> PathContents:
    """What a run's ``--load`` starts from, decided without torch: a Megatron-LM checkpoint it reads directly
    (``megatron_iteration``; its weights, as ``--finetune``), else ``load_decision``'s verdict."""
    found = describe_path(load)
    if found.kind in (KIND_MEGATRON_ROOT, KIND_MEGATRON_ITERATION) and megatron_iteration(load) is not None:
        return found
    return load_decision(load, save)


def check_save(save: str) -> None:
    """``--save`` is a directory, or a path where one can be made, that holds no Megatron-LM checkpoint (the run
    would mix its ``iter_N`` directories with it); a ConfigError line otherwise."""
    found = describe_path(save)
    if found.kind == KIND_FILE:
        raise ConfigError(f"--save {save} {found.what}: checkpoints are saved into a directory; give a new "
                          "directory or this run's own")
    if found.kind in (KIND_MEGATRON_ROOT, KIND_MEGATRON_ITERATION) and megatron_iteration(save) is not None:
        raise ConfigError(f"--save {save} {found.what}: megareshard's iter_N directories would mix with (and could "
                          "replace) it; load it with --load and save elsewhere")
    parent = os.path.dirname(os.path.abspath(save.rstrip(os.sep) or save))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"--save {save}: {parent} is a file, so the directory cannot be made there")


@dataclass(frozen=True)
class Progress:
    """How far the run that saved a megareshard checkpoint got, as its ``checkpoint.json`` records it:
    ``consumed_samples`` and ``global_batch_size`` are None when the checkpoint records no data position."""

    directory: str
    iteration: int
    consumed_samples: int | None
    global_batch_size: int | None
    #: the kernels the run chose (the trainer's fast path: {"attention": {shape key: {"kernel", "why"}}}); None in
    #: checkpoints from before the record
    kernel_choices: dict | None = None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def read_progress(path: str) -> Progress:
    """The iteration and data position the megareshard checkpoint ``path`` names records (``path`` itself, or
    the directory its ``latest`` names), read from ``checkpoint.json`` as JSON: nothing is unpickled. A
    ConfigError line when they cannot be read (the checks of ``format.resolve_checkpoint_dir`` and ``read_info``)."""
    directory = path
    latest = os.path.join(path, LATEST_FILE)
    if not os.path.isfile(os.path.join(path, CHECKPOINT_JSON)):
        try:
            with open(latest, encoding="utf-8") as f:
                name = f.read(256).strip()
        except FileNotFoundError:
            iters = sorted(n for n in os.listdir(path) if _ITER.match(n)) if os.path.isdir(path) else []
            raise ConfigError(f"--load {path} is neither a checkpoint ({CHECKPOINT_JSON} missing) nor a checkpoint "
                              f"root ({LATEST_FILE} missing)" + (f"; it holds {_names(iters, 3)}: pass one of them"
                                                                 if iters else "")) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {latest}: {e}") from None
        if not name or "/" in name or name.startswith(".") or not name.startswith("iter_"):
            raise ConfigError(f"{latest} is corrupt: it should name a checkpoint directory like iter_0000100, "
                              f"found {name[:80]!r}")
        directory = os.path.join(path, name)
    info_path = os.path.join(directory, CHECKPOINT_JSON)
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{latest} names {os.path.basename(directory)}, but {directory} is missing or incomplete "
                          f"(no {CHECKPOINT_JSON})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{info_path} is corrupt ({e})") from None
    if not isinstance(info, dict):
        raise ConfigError(f"{info_path} is corrupt (a JSON {type(info).__name__}, not an object)")
    iteration = _count(info.get("iteration"))
    if iteration is None:
        raise ConfigError(f"{info_path} records no iteration (found {str(info.get('iteration'))[:40]!r})")
    choices = info.get("kernel_choices")
    return Progress(directory, iteration, _count(info.get("consumed_samples")), _count(info.get("global_batch_size")),
                    choices if isinstance(choices, dict) else None)


def check_progress(progress: Progress, *, train_iters: int, global_batch_size: int,
                   train_samples: int | None = None) -> str | None:
    """A resume's plan (``--train-iters`` or ``--train-samples``, and the global batch) against what the checkpoint
    records (not for ``--finetune``, which starts at iteration 0). None: training goes on. A line saying there is
    nothing left to train when the checkpoint is at the last iteration (the run ends, exit 0). A ConfigError line
    when it is past it, or when the samples left in the plan cannot cover the iterations left (the data position
    is saved in samples: a smaller global batch than the saved one runs out of them)."""
    it, done, gb = progress.iteration, progress.consumed_samples, global_batch_size
    total = train_iters * gb
    if train_samples is not None:
        plan = (f"--train-samples {train_samples}: {train_iters} iteration{'s' if train_iters != 1 else ''} × global "
                f"batch {gb} = {total} samples")
        flag, more = "--train-samples", f"to at least {(it + 1) * gb}"
    else:
        plan = f"--train-iters {train_iters} × global batch {gb} = {total} samples"
        flag, more = "--train-iters", f"above {it}"
    where = f"the checkpoint in {progress.directory}"
    if it == train_iters:
        given = f"--train-iters {train_iters}" if train_samples is None else f"--train-samples {train_samples} / {gb}"
        return f"nothing left to train: {where} is at iteration {it} = {given}; raise {flag} to train on"
    if it > train_iters:
        if done is not None and done > total:
            saved = f"has consumed {done} samples (iteration {it}); {plan}"
        else:
            saved = (f"is at iteration {it}" + (f" ({done} samples consumed)" if done is not None else "")
                     + f", past {plan}")
        raise ConfigError(f"{where} {saved}: nothing is left to train; raise {flag} {more}")
    left = train_iters - it
    if done is not None and done + left * gb > total:   # the data position is in samples: a smaller batch runs out
        raise ConfigError(f"{where} has consumed {done} samples (iteration {it}); {plan}, too few for the {left} "
                          f"iteration{'s' if left > 1 else ''} left (samples {done}-{done + left * gb - 1})"
                          + _smaller_batch(progress, gb))
    return None


def _smaller_batch(progress: Progress, global_batch_size: int) -> str:
    """The way out of a resume whose global batch is smaller than the saved run's."""
    saved = progress.global_batch_size
    if saved is not None and saved != global_batch_size and progress.consumed_samples is not None \
            and progress.consumed_samples <= progress.iteration * saved:
        return (f"; it was saved at global batch {saved}: resume with --global-batch-size {saved}, or start a new "
                "schedule from its weights with --finetune")
    return "; start a new schedule from its weights with --finetune"


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
    elif found.kind == KIND_HF or (found.kind == KIND_OTHER and found.what.startswith("holds")):
        what = f"holds {_names([n for n in os.listdir(path) if not _leftover(n)])}"
    raise CheckpointError(f"{path} {what}: refusing to overwrite it (nothing was written); give a new or empty "
                          f"destination, or {flag} to write there anyway")


def _latest_note(root: str) -> str:
    try:
        with open(os.path.join(root, LATEST_FILE), encoding="utf-8", errors="replace") as f:
            return f"; its {LATEST_FILE} names {f.read(80).strip()}"
    except OSError:
        return ""
