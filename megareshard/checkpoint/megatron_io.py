"""Megatron-LM checkpoint files: find them, read their arguments and tensors, write ``torch_dist``.

A Megatron-LM checkpoint root holds ``latest_checkpointed_iteration.txt`` (an iteration number or
``release``) and ``iter_NNNNNNN/`` (or ``release/``) directories. An iteration directory is either

* ``torch_dist``: ``metadata.json`` (``sharded_backend`` torch_dist), DCP's ``.metadata`` and
  ``__R_I.distcp`` files, ``common.pt`` (the arguments, iteration, ...), read through DCP: each rank
  reads only its boxes of the stored global tensors;
* ``torch``: ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per tensor/pipeline-parallel rank, memory-mapped;
  a tensor is assembled from the ranks' slices.

Pickled objects (``args``, ``common.pt``, the per-rank files) are read as data by ``safe_pickle``: tensors,
containers, ``argparse.Namespace`` and numbers are built, Megatron's and Transformer Engine's classes become
inert records, and any other class is refused: nothing from the file runs. Every problem is one
``CheckpointError`` line naming the file and, where there is one, the tensor.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import warnings
from typing import Any

import torch

from .format import CheckpointError, _first_failure
from .safe_pickle import load_torch
from .megatron import LAYERS, TRACKER_FILE, Source, megatron_box, refused_key

__all__ = ["find_megatron_checkpoint", "MegatronCheckpoint", "write_torch_dist", "load_pickle"]

_ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
# bytes that only Transformer Engine's delayed-scaling fp8 state holds (Megatron-LM's own test for fp8
# extra state that a fresh model cannot rebuild): the scales and amax history of every fp8 GEMM
FP8_STATE_MARKERS = (b"amax_history_fwd", b"scale_fwd", b"scale_bwd")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def load_pickle(path: str, *, mmap: bool = False) -> Any:
    """``torch.load`` of a Megatron-LM file, read as data (``safe_pickle``; tensors memory-mapped with ``mmap``)."""
    try:
        return load_torch(path, mmap=mmap)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{path} is truncated or corrupt: {type(e).__name__}: "
                              f"{text[0] if text else ''}") from None


def _as_dict(args: Any) -> dict[str, Any]:
    if args is None:
        return {}
    if isinstance(args, dict):
        return dict(args)
    return dict(vars(args))


# ---- finding a checkpoint ---------------------------------------------------------------------------
def find_megatron_checkpoint(path: str) -> str | None:
    """The iteration directory of the Megatron-LM checkpoint ``path`` names (a root with
    ``latest_checkpointed_iteration.txt``, or an ``iter_NNNNNNN`` / ``release`` directory), or None when
    ``path`` is not one. A root whose tracker names a missing directory is an error."""
    if not os.path.isdir(path):
        return None
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
        if text == "release":
            name = "release"
        elif text.isdigit():
            name = f"iter_{int(text):07d}"
        else:
            raise CheckpointError(f"{tracker} is corrupt: it should hold an iteration number or 'release', found "
                                  f"{text[:40]!r}")
        target = os.path.join(path, name)
        if not os.path.isdir(target):
            raise CheckpointError(f"{tracker} names iteration {text}, but {target} is missing")
        return target
    if _ITER_DIR.match(os.path.basename(os.path.normpath(path))) and (
            os.path.exists(os.path.join(path, "metadata.json"))
            or any(_RANK_DIR.match(n) for n in os.listdir(path))):
        return path
    return None


# ---- reading ----------------------------------------------------------------------------------------
class MegatronCheckpoint:
    """One Megatron-LM checkpoint (an iteration directory): its format (``torch_dist`` or ``torch``), saved
    arguments (a dict), iteration and tensors.

    ``shapes``: stored tensor name -> (shape, dtype): for ``torch_dist`` the stacked global names and shapes;
    for ``torch`` files the per-layer names (local layer numbers) and slice shapes of each pipeline stage's
    first tensor-parallel rank. ``read`` fills boxes of this model's tensors (``Source`` says where they are).
    """

    def __init__(self, path: str) -> None:
        found = find_megatron_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path} is not a Megatron-LM checkpoint (no {TRACKER_FILE}, not an iter_NNNNNNN "
                                  "directory with metadata.json or mp_rank_* directories)")
        self.path = found
        names = os.listdir(found)
        ranks = {m.groups(): n for n in names if (m := _RANK_DIR.match(n))}
        if os.path.exists(os.path.join(found, "metadata.json")):
            with open(os.path.join(found, "metadata.json"), encoding="utf-8") as f:
                try:
                    meta = json.load(f)
                except ValueError as e:
                    raise CheckpointError(f"{os.path.join(found, 'metadata.json')} is corrupt: {e}") from None
            backend = meta.get("sharded_backend")
            if backend != "torch_dist":
                raise CheckpointError(f"{found}: sharded backend {backend!r} is not read (only torch_dist and the "
                                      "per-rank torch format; resave with --ckpt-format torch_dist)")
            self.format = "torch_dist"
            common = load_pickle(os.path.join(found, "common.pt"))
            self._read_dcp_metadata()
        elif ranks:
            self.format = "torch"
            self._files = {(int(t), int(p or 0)): os.path.join(found, n, "model_optim_rng.pt")
                           for (t, p), n in ranks.items()}
            self._loaded: dict[tuple[int, int], dict[str, Any]] = {}
            common = self._file(min(self._files))
        else:
            raise CheckpointError(f"{found} holds neither metadata.json (torch_dist) nor mp_rank_* directories "
                                  "(torch): only those two Megatron-LM formats are read")
        if not isinstance(common, dict):
            raise CheckpointError(f"{found}: the checkpoint's common state is a {type(common).__name__}, not a dict")
        self.args = _as_dict(common.get("args"))
        self.iteration = common.get("iteration")
        version = common.get("checkpoint_version", 0)
        if not isinstance(version, (int, float)) or version < 3.0:
            raise CheckpointError(f"{found}: checkpoint_version {version!r} (Megatron-LM before 2021) stores query, "
                                  "key and value rows in another order: only version 3.0 is read")
        if self.format == "torch":
            self._layout_from_files()

    # -- torch_dist
    def _read_dcp_metadata(self) -> None:
        md_path = os.path.join(self.path, ".metadata")
        if not os.path.exists(md_path):
            raise CheckpointError(f"{md_path} is missing: the save of {self.path} did not finish")
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        from .dcp_io import read_metadata
        try:
            self.metadata = read_metadata(self.path)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{md_path} is corrupt: {type(e).__name__}: {e}") from None
        self.shapes = {k: (tuple(v.size), v.properties.dtype) for k, v in self.metadata.state_dict_metadata.items()
                       if isinstance(v, TensorStorageMetadata)}
        self.objects = [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]

    def check_files(self) -> None:
        """Every stored item lies inside its file (a truncated file names the file and the tensor)."""
        if self.format == "torch":
            for key in sorted(self._files):
                self._file(key)
            return
        sizes: dict[str, int | None] = {}
        for index, info in sorted((self.metadata.storage_data or {}).items(), key=lambda kv: kv[0].fqn):
            rel = getattr(info, "relative_path", None)
            if rel is None:
                continue
            full = os.path.join(self.path, rel)
            if rel not in sizes:
                sizes[rel] = os.path.getsize(full) if os.path.exists(full) else None
            end = int(info.offset) + int(info.length)
            if sizes[rel] is None:
                raise CheckpointError(f"{full} is missing: it holds {index.fqn}")
            if sizes[rel] < end:
                where = f" at offsets {tuple(index.offset)}" if index.offset is not None else ""
                raise CheckpointError(f"{full} is truncated: {sizes[rel]} bytes, but {index.fqn}{where} is stored "
                                      f"up to byte {end}")

    def extra_state(self) -> dict[str, bytes]:
        """The raw bytes of every stored ``_extra_state`` object (Transformer Engine's fp8 state, or empty)."""
        if self.format == "torch":
            out = {}
            for key in sorted(self._files):
                for chunk in self._chunks(key).values():
                    for k, v in chunk.items():
                        if k.endswith("_extra_state") and v is not None:
                            out[f"{os.path.relpath(self._files[key], self.path)}:{k}"] = _raw(v)
            return out
        keys = [k for k in self.objects if "_extra_state" in k]
        return self._read_dcp({}, keys, no_dist=True) if keys else {}

    def _read_dcp(self, requests: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]],
                  objects: list[str], no_dist: bool) -> dict[str, bytes]:
        from .dcp_io import load_boxes
        state = {rid: r[3] for rid, r in requests.items()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                raw = load_boxes(state, self.path, {rid: r[:3] for rid, r in requests.items()}, objects,
                                 no_dist=no_dist)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:      # DCP's CheckpointException is a BaseException
            inner = _first_failure(e)[1]
            if isinstance(inner, CheckpointError):          # a refused pickle: its own line
                raise CheckpointError(str(inner)) from None
            text = str(e).strip().splitlines()
            raise CheckpointError(f"reading {self.path} failed: {type(e).__name__}: "
                                  f"{text[-1] if text else ''}") from None
        return raw

    # -- torch (per-rank files)
    def _file(self, key: tuple[int, int]) -> dict[str, Any]:
        if key not in self._loaded:
            sd = load_pickle(self._files[key], mmap=True)
            if not isinstance(sd, dict):
                raise CheckpointError(f"{self._files[key]} holds a {type(sd).__name__}, not Megatron-LM's state dict")
            self._loaded[key] = sd
        return self._loaded[key]

    def _chunks(self, key: tuple[int, int]) -> dict[int, dict[str, Any]]:
        """The model chunks (virtual stages) of one file: {0: model} or {v: model<v>}."""
        sd = self._file(key)
        if "model" in sd:
            return {0: sd["model"]}
        chunks = {int(k[5:]): v for k, v in sd.items() if re.fullmatch(r"model\d+", str(k))}
        if not chunks:
            raise CheckpointError(f"{self._files[key]} holds no model state (keys {sorted(map(str, sd))[:8]})")
        return chunks

    def _layout_from_files(self) -> None:
        tps = sorted({t for t, _ in self._files})
        pps = sorted({p for _, p in self._files})
        self.tp, self.pp = len(tps), len(pps)
        missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 or p else "")
                   for t in range(self.tp) for p in range(self.pp) if (t, p) not in self._files]
        if tps != list(range(self.tp)) or pps != list(range(self.pp)) or missing:
            raise CheckpointError(f"{self.path}: rank directories are missing: "
                                  f"{', '.join(missing) or 'gaps in the ranks'}")
        saved_tp = self.args.get("tensor_model_parallel_size")
        if saved_tp not in (None, self.tp):
            raise CheckpointError(f"{self.path}: the arguments say tensor parallelism {saved_tp}, the files are "
                                  f"{self.tp} ranks")
        # global layer index -> (pp rank, chunk, local index): chunk v of stage p is model stage v·pp + p
        counts = {}
        for p in range(self.pp):
            for v, chunk in self._chunks((0, p)).items():
                idx = [int(m.group(1)) for k in chunk if (m := re.match(re.escape(LAYERS) + r"(\d+)\.", k))]
                counts[(p, v)] = max(idx) + 1 if idx else 0
        vs = 1 + max(v for _, v in counts)
        self.layer_at: list[tuple[int, int, int]] = []
        for v in range(vs):
            for p in range(self.pp):
                self.layer_at += [(p, v, i) for i in range(counts.get((p, v), 0))]
        self.chunks_per_stage = vs
        self.shapes = {}
        for (t, p), _ in sorted(self._files.items()):
            for chunk in self._chunks((t, p)).values():
                for k, v in chunk.items():
                    if torch.is_tensor(v) and (t, p) == (0, p):
                        self.shapes.setdefault(k, (tuple(v.shape), v.dtype))

    def _legacy_tensor(self, name: str, src: Source, full: tuple[int, ...], *,
                       data: bool = True) -> torch.Tensor | None:
        """The tensor of this model's ``name`` (vocabulary padding still in) assembled from the rank files, after
        checking every slice against ``full``, its expected shape (``data=False``: the check only)."""
        if src.layer is not None:
            p, v, local = self.layer_at[src.layer]
            keys = tuple(f"{LAYERS}{local}.{k[len(LAYERS):]}" for k in src.keys)
        else:
            first = src.key.startswith("embedding.")
            p, v = (0, 0) if first else (self.pp - 1, self.chunks_per_stage - 1)
            keys = src.keys
        shards = []
        for t in range(self.tp if src.tp_dim is not None else 1):
            chunk = self._chunks((t, p)).get(v, {})
            key = next((k for k in keys if k in chunk), None)
            if key is None:
                raise CheckpointError(f"{self._files[(t, p)]} lacks {keys[0]} (for {name})")
            shard = chunk[key]
            if not torch.is_tensor(shard):
                raise CheckpointError(f"{self._files[(t, p)]}: {key} is a {type(shard).__name__}, not a tensor")
            want = list(full)
            if src.tp_dim is not None:
                want[src.tp_dim] //= self.tp
            if src.part is not None:
                want[0] *= 2
            if shard.dtype not in _FLOATS:
                raise CheckpointError(f"{self._files[(t, p)]}: {key} is stored as {shard.dtype}: quantized (fp8) "
                                      "weights are not read")
            if tuple(shard.shape) != tuple(want):
                raise CheckpointError(f"{self._files[(t, p)]}: {key} has shape {tuple(shard.shape)}, the checkpoint's "
                                      f"arguments at tensor parallelism {self.tp} need {tuple(want)} (for {name})")
            if src.part is not None:
                shard = shard.chunk(2, dim=0)[src.part]
            shards.append(shard)
        if not data:
            return None
        return shards[0] if len(shards) == 1 else torch.cat(shards, dim=src.tp_dim)

    # -- reading boxes of this model's tensors
    def read(self, requests: dict[str, tuple[Source, tuple[int, ...], torch.Tensor]],
             shapes: dict[str, tuple[int, ...]], rows: dict[str, int], no_dist: bool) -> None:
        """Fill each request's tensor (this model's ``name``: Source, box offset, tensor of the box's size).
        ``shapes``: name -> its full shape here (padded vocabulary); ``rows``: name -> rows of one SwiGLU half.
        Collective over the world for ``torch_dist`` unless ``no_dist``."""
        if self.format == "torch":
            for name, (src, offset, target) in requests.items():
                box = self._legacy_tensor(name, src, shapes[name])
                for d, (o, n) in enumerate(zip(offset, target.shape)):
                    box = box.narrow(d, o, n)
                target.copy_(box)
            return
        dcp_requests = {}
        for name, (src, offset, target) in requests.items():
            key, src = self.resolve(src)
            m_off, m_size = megatron_box(src, offset, tuple(target.shape), rows.get(name, 0))
            dcp_requests[name] = (key, m_off, m_size, target.view(m_size))
        self._read_dcp(dcp_requests, [], no_dist)

    def check_shapes(self, expected: dict[str, tuple[Source, tuple[int, ...], tuple[int, ...]]]) -> None:
        """Every tensor is stored with the shape the arguments give (name -> (Source, this model's full shape with
        the padded vocabulary, the stored global shape)); a mismatch names the file and the tensor."""
        if self.format == "torch":
            layers = sum(1 for s, _, _ in expected.values()
                         if s.layer is not None and s.key.endswith("linear_qkv.weight"))
            if len(self.layer_at) != layers:
                raise CheckpointError(f"{self.path}: the rank files hold {len(self.layer_at)} layers, the arguments "
                                      f"say {layers}")
            for name, (src, full, _) in expected.items():
                self._legacy_tensor(name, src, full, data=False)
            return
        for name, (src, _, stored) in expected.items():
            key, resolved = self.resolve(src)
            if resolved is not src:     # one SwiGLU half stored on its own
                stored = (stored[0], stored[1] // 2, *stored[2:])
            shape, dtype = self.shapes[key]
            if shape != stored:
                raise CheckpointError(f"{os.path.join(self.path, '.metadata')}: {key} has shape {shape}, the "
                                      f"checkpoint's arguments need {stored} (for {name})")
            if dtype not in _FLOATS:
                raise CheckpointError(f"{os.path.join(self.path, '.metadata')}: {key} is stored as {dtype}: quantized "
                                      "(fp8) weights are not read")

    def resolve(self, src: Source) -> tuple[str, Source]:
        """The stored name of ``src``'s tensor (its current or an older name) and the Source to cut boxes by:
        with Megatron-Core's ``singleton_local_shards`` the SwiGLU halves are stored apart (``…weight_w`` gate,
        ``…weight_v`` up), each a whole tensor."""
        for k in src.keys:
            if k in self.shapes:
                return k, src
        half = src.key + ("_w", "_v")[src.part] if src.part is not None else None
        if half in self.shapes:
            return half, dataclasses.replace(src, part=None)
        raise CheckpointError(f"{self.path} has no tensor {src.key}"
                              + (f" (nor {', '.join(src.alt)})" if src.alt else ""))

    def refused_tensors(self) -> list[str]:
        """'name: feature' for stored tensors of features this model does not build."""
        return [f"{k} ({what})" for k in sorted(self.shapes) if (what := refused_key(k))]


def _raw(v: Any) -> bytes:
    if isinstance(v, io.BytesIO):
        return v.getvalue()
    if torch.is_tensor(v):
        return v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b""
    try:
        return pickle.dumps(v)
    except Exception:          # a stand-in for a class this reader does not build: its recorded state
        return repr(getattr(v, "__dict__", v)).encode()


def has_fp8_state(raw: bytes) -> bool:
    return any(m in raw for m in FP8_STATE_MARKERS)


# ---- writing torch_dist --------------------------------------------------------------------------------
def write_torch_dist(root: str, iteration: int, tensors: dict[str, torch.Tensor], objects: dict[str, Any],
                     common: dict[str, Any]) -> str:
    """A Megatron-LM ``torch_dist`` checkpoint ``root/iter_N`` (and the tracker file), written single-process:
    the data files into a temp directory renamed into place, the tracker last. Returns the directory."""
    name = f"iter_{int(iteration):07d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp.{name}")
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state: dict[str, Any] = {k: v.contiguous() for k, v in tensors.items()}
    state.update(objects)
    from .dcp_io import save_whole
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_whole(state, tmp)
    torch.save(common, os.path.join(tmp, "common.pt"))
    with open(os.path.join(tmp, "metadata.json"), "w", encoding="utf-8") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    os.replace(tmp, final)
    with open(os.path.join(root, TRACKER_FILE), "w", encoding="utf-8") as f:
        f.write(str(int(iteration)))
    return final
