"""On-disk format of megareshard checkpoints: torch.distributed.checkpoint (DCP) + a JSON sidecar.

A checkpoint is one directory ``ROOT/iter_0000123/`` holding

* the DCP files (``.metadata`` and one ``__<rank>_0.distcp`` per writing rank);
* ``checkpoint.json``: format version, iteration, the layout it was saved in, the model
  configuration, the size of every file (truncation is caught before anything loads).

``ROOT/latest`` is a text file naming the newest COMPLETE checkpoint directory.

Every tensor is stored under a GLOBAL key (``model.layers.17.attention.qkv.weight``,
``optim.exp_avg.layers.17.attention.qkv.weight``) as the union of the boxes the saving ranks
held: each local piece is written with its global shape and offset (a DCP ``SHARD`` write
item), whatever produced it — a tp slice, a ZeRO row chunk of a tp slice (``torch.chunk``
rows, possibly uneven or empty) or a replicated tensor (boxes with the same offset are
written once). Loading asks for this rank's box in the new layout and DCP reads the
overlapping parts of the saved boxes: a different tp/pp/dp/ZeRO/world size is a different
slice, not a conversion. The vocabulary padding (rows ``>= vocab_size`` of the word
embedding, which differ with tp) is never stored: pieces are cut to the real vocabulary on
save and padding rows are zero-filled on load.

Non-tensor state (iteration, scheduler, sampler, loss scaler, arguments, W&B run id, ...) is
one pickled DCP object ``common``; per-rank RNG states are objects ``rng.rank<r>``.

The two planners (``dcp_io.py``, imported on the first save or load) are the only DCP
extension: they take a side table ``key -> (global_shape, global_offset)`` for the local
tensors and emit/consume the corresponding chunk; everything else is DCP's default
behaviour, so a checkpoint is also readable with plain ``dcp.load`` into full tensors in
one process without a process group.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist

from .errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["FORMAT_VERSION", "CHECKPOINT_JSON", "LATEST_FILE", "CheckpointError", "Piece", "iteration_dirname",
           "write_checkpoint", "resolve_checkpoint_dir", "read_info", "read_metadata", "check_files",
           "read_pieces", "read_full_model", "fsync_dir", "KILL_ENV", "verify_checksum_share", "file_crc32"]

FORMAT_VERSION = 1
CHECKPOINT_JSON = "checkpoint.json"
LATEST_FILE = "latest"
METADATA_FILE = ".metadata"
TMP_PREFIX = ".tmp."
# test hook: SIGKILL this process at a named point of a save (see _maybe_kill)
KILL_ENV = "MEGARESHARD_CHECKPOINT_KILL_AT"


@dataclass
class Piece:
    """One local box of a global tensor: ``tensor`` sits at ``offset`` inside ``global_shape``."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(x) for x in self.global_shape)
        self.offset = tuple(int(x) for x in self.offset)
        if len(self.global_shape) != self.tensor.dim() or len(self.offset) != self.tensor.dim():
            raise ValueError(f"piece of shape {tuple(self.tensor.shape)} does not match global shape "
                             f"{self.global_shape} / offset {self.offset}")
        for d, (o, n, g) in enumerate(zip(self.offset, self.tensor.shape, self.global_shape)):
            if o < 0 or o + n > g:
                raise ValueError(f"piece rows [{o}, {o + n}) of dim {d} exceed the global size {g}")


def iteration_dirname(iteration: int) -> str:
    return f"iter_{int(iteration):07d}"


def _maybe_kill(point: str) -> None:
    """Test hook: ``MEGARESHARD_CHECKPOINT_KILL_AT=<point>`` SIGKILLs the process there (rank 0 only,
    or ``<point>@<rank>``). Points: ``before_metadata`` (data files written, DCP metadata not),
    ``before_rename`` (complete temp dir), ``before_latest`` (renamed, ``latest`` not updated), ``prune``
    (retention.py: an old checkpoint renamed to ``.tmp.pruned.*``, not yet deleted)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    name, _, rank = spec.partition("@")
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if name == point and me == int(rank or 0):
        os.kill(os.getpid(), signal.SIGKILL)


# ---- files ---------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def write_checkpoint(root: str, iteration: int, pieces: dict[str, Piece], objects: dict[str, Any],
                     info: dict[str, Any], *, process_group=None, prepared: bool = False) -> str:
    """Write one checkpoint atomically; collective over ``process_group`` (default: world) when
    torch.distributed is initialised, single-process otherwise. Returns the final directory.

    Protocol: rank 0 (re)creates ``ROOT/.tmp.iter_N``; every rank writes its pieces there through
    DCP (files fsynced); the ranks checksum the files (CRC-32, each rank a share); rank 0 writes
    ``checkpoint.json`` (with every file's size and checksum), fsyncs all files and the directory,
    renames it to ``ROOT/iter_N`` and then replaces ``ROOT/latest`` atomically (write + fsync + rename).
    A process killed at any point leaves ``latest`` naming the previous complete checkpoint.
    A save that fails (disk full, I/O error) on any rank raises the same ``CheckpointError`` on every
    rank (DCP reports a failed write to all of them; rank 0's own steps are agreed on after), the
    temp directory is removed and ``latest`` is unchanged. ``prepared``: the caller already created
    the temp dir and synchronised (async saves do that on the main thread).
    """
    distributed = _distributed()
    rank = dist.get_rank(process_group) if distributed else 0
    world = dist.get_world_size(process_group) if distributed else 1
    name = iteration_dirname(iteration)
    tmp = os.path.join(root, TMP_PREFIX + name)
    final = os.path.join(root, name)
    if not prepared:
        prepare_tmp_dir(root, iteration, process_group)
    boxes = {k: (p.global_shape, p.offset) for k, p in pieces.items()}
    state: dict[str, Any] = {k: p.tensor.detach() for k, p in pieces.items()}
    state.update(objects)
    need = sum(p.tensor.numel() * p.tensor.element_size() for p in pieces.values())  # this rank's tensor bytes
    from .dcp_io import save_pieces   # DCP (and DTensor under it) loads with the first save or load
    error: str | None = None
    full: tuple[int, str] | None = None   # (rank, file) of a write that found the disk full
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # DCP's "single process" notice
            save_pieces(state, tmp, boxes, process_group=process_group, no_dist=not distributed,
                        before_metadata=lambda: _maybe_kill("before_metadata"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:   # CheckpointException (a BaseException) on every rank when any rank failed
        error = f"writing the shards failed: {_reason(e)}"
        bad_rank, bad = _first_failure(e)
        if _out_of_space(bad):
            # DCP's writer names no file: rank r writes __r_0.distcp (one file per rank), rank 0 also .metadata
            r = rank if bad_rank is None else bad_rank
            full = (r, getattr(bad, "filename", None) or os.path.join(tmp, f"__{r}_0.distcp"))
    crcs: dict[str, int] = {}
    if error is None:            # every rank checksums a share of the files (they are all on disk now)
        try:
            crcs = checksum_share(tmp, sorted(fn for fn in os.listdir(tmp) if os.path.isfile(os.path.join(tmp, fn))),
                                  rank, world)
        except OSError as e:
            error = f"checksumming {tmp} failed on rank {rank}: {_reason(e)}"
    needs = [need]
    if distributed:
        shares: list = [None] * world
        dist.all_gather_object(shares, (crcs, error, need), group=process_group)
        errors = [e for _, e, _ in shares if e]
        error = errors[0] if errors else None
        for c, _, _ in shares:
            crcs.update(c)
        needs = [n for _, _, n in shares]
    if rank == 0 and error is None:
        try:
            _finish_checkpoint(root, tmp, final, name, iteration, info, crcs)
        except OSError as e:
            error = f"finishing {tmp} failed: {_reason(e)}"
            if _out_of_space(e):
                full = (0, e.filename or os.path.join(tmp, CHECKPOINT_JSON))
    if rank == 0 and error is not None and full is not None:
        _rmtree(tmp)             # the partial save's bytes count as free again
        error = (f"rank {full[0]} ran out of space writing {full[1]}: No space left on device; the checkpoint needs "
                 f"about {_human(sum(needs))}, {_human(_free_bytes(root))} free in {root} without it")
    if distributed:              # rank 0's steps, agreed on by every rank
        box = [error]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group is not None
                                   else 0, group=process_group)
        error = box[0]
    if error is not None:
        if rank == 0:
            _rmtree(tmp)
            for fn in os.listdir(root) if os.path.isdir(root) else ():
                if fn.startswith(LATEST_FILE + ".tmp."):
                    _remove_quietly(os.path.join(root, fn))
        latest = _latest_name(root)
        raise CheckpointError(f"saving iteration {iteration} to {final} failed: {error}; "
                              + (f"{os.path.join(root, LATEST_FILE)} still names {latest}" if latest else
                                 f"{root} has no complete checkpoint"))
    return final


def _finish_checkpoint(root: str, tmp: str, final: str, name: str, iteration: int, info: dict[str, Any],
                       crcs: dict[str, int]) -> None:
    """Rank 0: checkpoint.json, fsyncs, rename into place, then ``latest``."""
    files = {}
    for fn in sorted(os.listdir(tmp)):
        full = os.path.join(tmp, fn)
        if os.path.isfile(full):
            _fsync_file(full)
            files[fn] = os.path.getsize(full)
    info = {**info, "format_version": FORMAT_VERSION, "iteration": int(iteration), "files": files,
            "crc32": {fn: crcs[fn] for fn in files if fn in crcs}}
    with open(os.path.join(tmp, CHECKPOINT_JSON), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    _maybe_kill("before_rename")
    if os.path.exists(final):       # re-saving an iteration: move the old one aside first
        old = os.path.join(root, TMP_PREFIX + name + ".old")
        _rmtree(old)
        os.replace(final, old)
        fsync_dir(root)
        os.replace(tmp, final)
        fsync_dir(root)
        _rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    _maybe_kill("before_latest")
    _atomic_write_text(os.path.join(root, LATEST_FILE), name + "\n")


def _first_failure(e: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception) of the first rank's failure inside DCP's ``CheckpointException`` (whose ``failures``
    map a rank to ``(exception, stack summary)``), or (None, ``e``) for any other exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = inner[0] if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException) else inner
        inner = getattr(inner, "exc", inner)    # older torch: a _WrappedException
        if isinstance(inner, BaseException):
            return int(rank), _first_failure(inner)[1]
    return None, e


def _reason(e: BaseException) -> str:
    """One line for an I/O failure: DCP wraps the rank's exception with its stack, whose text is a traceback."""
    rank, inner = _first_failure(e)
    if rank is not None:
        return f"rank {rank}: {_reason(inner)}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} (errno {e.errno}{', ' + e.filename if e.filename else ''})"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1][:300] if text else ''}"


def _out_of_space(e: BaseException | None) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _latest_name(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST_FILE), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def file_crc32(path: str, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def checksum_share(ckpt_dir: str, names: list[str], rank: int, world: int) -> dict[str, int]:
    """CRC-32 of the files ``names[i]`` with ``i % world == rank`` (the ranks split the reading)."""
    return {fn: file_crc32(os.path.join(ckpt_dir, fn)) for i, fn in enumerate(names) if i % world == rank}


def verify_checksum_share(ckpt_dir: str, info: dict[str, Any], rank: int, world: int) -> list[str]:
    """This rank's share of the checksum comparison: one problem line per file whose bytes changed.
    Checkpoints written before checksums were recorded have none to compare (nothing is reported)."""
    crcs = info.get("crc32") or {}
    names = sorted(crcs)
    problems = []
    for fn, crc in checksum_share(ckpt_dir, [n for n in names if os.path.exists(os.path.join(ckpt_dir, n))],
                                  rank, world).items():
        if crc != crcs[fn]:
            problems.append(f"{os.path.join(ckpt_dir, fn)} is corrupt: CRC-32 {crc:08x}, {crcs[fn]:08x} was "
                            "written")
    return problems


def _rmtree(path: str) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def prepare_tmp_dir(root: str, iteration: int, process_group=None) -> str:
    """Rank 0 removes any stale temp dir of this iteration (a killed save) and creates it empty; a failure
    (no space, no permission) raises the same ``CheckpointError`` on every rank."""
    tmp = os.path.join(root, TMP_PREFIX + iteration_dirname(iteration))
    rank = dist.get_rank(process_group) if _distributed() else 0
    error = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            _rmtree(tmp)
            os.makedirs(tmp)
        except OSError as e:
            error = _reason(e)
    if _distributed():
        box = [error]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group is not None
                                   else 0, group=process_group)
        error = box[0]
    if error is not None:
        latest = _latest_name(root)
        raise CheckpointError(f"saving iteration {iteration}: cannot create {tmp}: {error}; "
                              + (f"{os.path.join(root, LATEST_FILE)} still names {latest}" if latest else
                                 f"{root} has no complete checkpoint"))
    return tmp


# ---- reading -------------------------------------------------------------------------------
def resolve_checkpoint_dir(path: str) -> str:
    """``path`` is a checkpoint directory (has ``checkpoint.json``) or a root with ``latest``."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path} does not exist or is not a directory")
    if os.path.exists(os.path.join(path, CHECKPOINT_JSON)):
        return path
    latest = os.path.join(path, LATEST_FILE)
    if not os.path.exists(latest):
        found = sorted(d for d in os.listdir(path) if d.startswith("iter_"))
        raise CheckpointError(f"{path} is neither a checkpoint ({CHECKPOINT_JSON} missing) nor a checkpoint root "
                              f"({latest} missing)" + (f"; it holds {found}: pass one of them" if found else ""))
    try:
        with open(latest, encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {latest}: {e}") from None
    if not name or "/" in name or name.startswith(".") or not name.startswith("iter_"):
        raise CheckpointError(f"{latest} is corrupt: it should name a checkpoint directory like iter_0000100, "
                              f"found {name[:80]!r}")
    target = os.path.join(path, name)
    if not os.path.isdir(target) or not os.path.exists(os.path.join(target, CHECKPOINT_JSON)):
        raise CheckpointError(f"{latest} names {name}, but {target} is missing or incomplete (no {CHECKPOINT_JSON})")
    return target


def read_info(ckpt_dir: str) -> dict[str, Any]:
    path = os.path.join(ckpt_dir, CHECKPOINT_JSON)
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete megareshard checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt ({e})") from None
    version = info.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointError(f"{path}: format version {version!r} is not supported by this megareshard "
                              f"(reads versions 1..{FORMAT_VERSION})")
    return info


def read_metadata(ckpt_dir: str) -> Metadata:
    path = os.path.join(ckpt_dir, METADATA_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the DCP metadata of {ckpt_dir} was never written (interrupted "
                              "save?) or was deleted")
    from .dcp_io import read_metadata as dcp_metadata
    try:
        return dcp_metadata(ckpt_dir)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt: {type(e).__name__}: {e}") from None


def check_files(ckpt_dir: str, info: dict[str, Any], metadata: Metadata) -> None:
    """Every data file exists with the size recorded at save time and covers every stored item."""
    problems = []
    for fn, size in sorted(info.get("files", {}).items()):
        full = os.path.join(ckpt_dir, fn)
        if not os.path.exists(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{full} has {os.path.getsize(full)} bytes, {size} were written (truncated or modified)")
    storage = getattr(metadata, "storage_data", None) or {}
    ends: dict[str, int] = {}
    for _, si in storage.items():
        rel = getattr(si, "relative_path", None)
        if rel is not None:
            ends[rel] = max(ends.get(rel, 0), int(si.offset) + int(si.length))
    for rel, end in sorted(ends.items()):
        full = os.path.join(ckpt_dir, rel)
        if not os.path.exists(full):
            if f"{full} is missing" not in problems:
                problems.append(f"{full} is missing")
        elif os.path.getsize(full) < end:
            problems.append(f"{full} is truncated: {os.path.getsize(full)} bytes, items reach byte {end}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: " + "; ".join(dict.fromkeys(problems)))


def read_pieces(ckpt_dir: str, tensors: dict[str, Piece], objects: Iterable[str], *, process_group=None,
                no_dist: bool | None = None) -> dict[str, Any]:
    """Fill every ``Piece.tensor`` (its box of the saved global tensor) and return the requested objects.

    Collective when torch.distributed is initialised (unless ``no_dist``). DCP failures (a
    ``CheckpointException`` is a BaseException) become a ``CheckpointError`` naming the directory.
    """
    if no_dist is None:
        no_dist = not _distributed()
    state: dict[str, Any] = {k: p.tensor for k, p in tensors.items()}
    for k in objects:
        state[k] = None
    boxes = {k: (p.global_shape, p.offset) for k, p in tensors.items()}
    from .dcp_io import load_pieces
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_pieces(state, ckpt_dir, boxes, process_group=process_group, no_dist=no_dist)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:   # CheckpointException derives from BaseException
        inner = _first_failure(e)[1]
        if isinstance(inner, CheckpointError):        # a refused pickle, a recorded shape not stored: our line
            raise CheckpointError(str(inner)) from None
        raise CheckpointError(f"reading checkpoint {ckpt_dir} failed: {type(e).__name__}: {e}") from None
    return {k: state[k] for k in objects}


def read_full_model(ckpt_dir: str, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's weights of a checkpoint as full tensors by name (without the ``model.`` prefix), read in
    this process alone after the files are checked against `info`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = read_metadata(ckpt_dir)
    check_files(ckpt_dir, info, md)
    tensors = {k: Piece(torch.empty(tuple(v.size), dtype=v.properties.dtype), tuple(v.size), (0,) * len(v.size))
               for k, v in md.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata) and k.startswith("model.")}
    read_pieces(ckpt_dir, tensors, [], no_dist=True)
    return {k[len("model."):]: p.tensor for k, p in tensors.items()}


def metadata_summary(metadata: Metadata) -> dict[str, dict[str, Any]]:
    """key -> {"kind": "tensor"/"object", "shape", "dtype", "chunks", "bytes"}."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    out = {}
    for k, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            n = 1
            for s in md.size:
                n *= int(s)
            dtype = md.properties.dtype
            out[k] = {"kind": "tensor", "shape": list(md.size), "dtype": str(dtype).replace("torch.", ""),
                      "chunks": len(md.chunks), "bytes": n * torch.empty((), dtype=dtype).element_size()}
        else:
            out[k] = {"kind": "object"}
    return out
