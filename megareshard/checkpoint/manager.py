"""CheckpointManager: what the trainer calls to save and load a run in any parallel layout.

    mgr = CheckpointManager(ctx, async_save=False, out=sys.stdout)
    mgr.save(root, iteration, model=model, optimizer=opt, scheduler=sched, sampler=sampler,
             config=cfg, wandb_run_id=tracker.run_id)
    res = mgr.load(root, model=model, optimizer=opt, scheduler=sched, sampler=sampler, config=cfg,
                   finetune=False, no_load_optim=False, no_load_rng=False)
    res.iteration, res.consumed_samples, res.wandb_run_id, res.messages

Both are collective over the world (every rank calls them). See ``format.py`` for the files.

What a checkpoint holds: model weights (global names, tp slices — at ZeRO-3 each rank's row
shard of them, the only copy it holds —, vocabulary unpadded; the tied output-layer copy of a
last pipeline stage is not stored: it loads from the word embedding), optimizer state keyed by
parameter name (fp32 master, Adam moments, step — ZeRO row chunks or full tp slices), LR
scheduler, iteration, sampler (consumed samples), loss scaler, per-rank RNG (CPU, CUDA,
tensor-parallel streams), W&B run id, the arguments and the layout it was saved in.

What loads exactly across a layout change (tp, pp, dp, ZeRO stage, world size, dtype of the
parameters aside): every weight and every piece of optimizer state, bitwise; the iteration,
LR schedule, loss scale; the data position (``consumed_samples``) — the sampler's global
batch ``[consumed, consumed + global_batch)`` does not depend on dp, so iteration k trains on
the same samples in any layout with the same global batch size (losses then agree to float
summation order: dp changes the order of the gradient reduction and microbatch split).
What cannot be exact, and is reported on load (a WARNING line, never silent):

* RNG (dropout masks) when tp or pp changed: the streams belong to (pp stage, tp rank)
  coordinates that no longer exist; they are re-seeded from ``(seed + iteration)``.
  When only dp changed, each rank takes the streams of the saved rank with the same
  (pp, tp) coordinates and dp rank ``dp mod saved_dp`` (dp replicas draw identical streams),
  but a different number of microbatches per rank changes how many masks each draws, so
  with dropout on the run is a statistically equivalent, not identical, continuation.
* The data order when the global batch size changed (position kept, batches differ), and
  with ``--data-path`` when train-iters × global batch changed (the shuffle is built for the
  total number of samples).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.distributed as dist

from ..data.tokenizer import tokenizer_record
from ..tensor_parallel.random import RNGStreams
from .format import (FORMAT_VERSION, CheckpointError, Piece, check_files, prepare_tmp_dir, read_info,
                     read_metadata, read_pieces, resolve_checkpoint_dir, verify_checksum_share, write_checkpoint)

__all__ = ["CheckpointManager", "LoadResult", "ARCHITECTURE_FIELDS", "model_key", "optim_key"]

logger = logging.getLogger("megareshard")

# model-config fields that change a tensor's shape or meaning: a mismatch is an error
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                       "max_position_embeddings", "normalization", "position_embedding_type", "rotary_base",
                       "rotary_percent", "swiglu", "openai_gelu", "group_query_attention", "num_query_groups",
                       "kv_channels", "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias",
                       "apply_layernorm_1p")
# architecture fields that checkpoints written before them lack: their value then
_LATER_FIELD_DEFAULTS = {"apply_layernorm_1p": False}
# fields that only change numerics / the data: a mismatch is a warning
_ADVISORY_FIELDS = ("seq_length", "hidden_dropout", "attention_dropout", "init_method_std", "norm_epsilon")


def model_key(name: str) -> str:
    return "model." + name


def optim_key(kind: str, name: str) -> str:
    """``kind``: ``master`` or an optimizer state name (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    return f"optim.{kind}.{name}"


def _canonical(name: str, param: torch.Tensor) -> str:
    """The tied output-layer copy on a last pipeline stage (marked ``shared_embedding_duplicate``) is the
    word embedding: the model names it in ``checkpoint_name``; an untied output layer is its own tensor."""
    if getattr(param, "shared_embedding_duplicate", False):
        canonical = getattr(param, "checkpoint_name", None)
        if canonical is None:
            raise CheckpointError(f"parameter {name} is marked shared_embedding_duplicate but names no "
                                  "checkpoint_name (the name of the weight it duplicates)")
        return canonical
    return name


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_gather_object(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _tp_box(param: torch.Tensor, tp: int, tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global (padded) shape and offset of this rank's tp slice of ``param``."""
    shape, off = list(param.shape), [0] * param.dim()
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        d = param.partition_dim
        off[d] = tp_rank * shape[d]
        shape[d] *= tp
    return tuple(shape), tuple(off)


def _cut(tensor: torch.Tensor, gshape, goff, unpadded_rows: int | None) -> Piece | None:
    """The piece of ``tensor`` (at ``goff`` in ``gshape``) inside the real vocabulary (rows < unpadded_rows);
    None when it holds nothing stored (only padding, or empty)."""
    gshape, goff = tuple(gshape), tuple(goff)
    if unpadded_rows is not None and tensor.dim() >= 1:
        keep = max(0, min(tensor.shape[0], unpadded_rows - goff[0]))
        tensor = tensor.narrow(0, 0, keep)
        gshape = (unpadded_rows, *gshape[1:])
    if tensor.numel() == 0 and tensor.dim() > 0:
        return None
    return Piece(tensor, gshape, goff)


@dataclass
class _OptEntry:
    name: str           # canonical (checkpoint) name
    own_name: str
    param: torch.nn.Parameter
    master: torch.Tensor  # the tensor the inner optimizer steps (fp32 master shard or the param)
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    inner: torch.optim.Optimizer
    duplicate: bool


def _optimizer_entries(optimizer, model: torch.nn.Module, tp: int, tp_rank: int) -> list[_OptEntry]:
    if optimizer is None:
        return []
    if hasattr(optimizer, "entries") and hasattr(optimizer, "inner"):        # ZeroOptimizer
        return [_OptEntry(_canonical(e.name, e.param), e.name, e.param, e.master, tuple(e.info.global_shape),
                          tuple(e.info.global_offset), optimizer.inner, _canonical(e.name, e.param) != e.name)
                for e in optimizer.entries]
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups:                                         # a plain torch optimizer
        for p in g["params"]:
            n = names[id(p)]
            gs, go = _tp_box(p, tp, tp_rank)
            out.append(_OptEntry(_canonical(n, p), n, p, p, gs, go, optimizer, _canonical(n, p) != n))
    return out


def _param_shards(optimizer) -> dict[int, Any]:
    """ZeRO-3 (``params_sharded``): parameter id -> its shard entry (``shard`` holds the parameter's rows, ``info``
    their box); the model's own parameters hold no data between uses. Empty otherwise."""
    if not getattr(optimizer, "params_sharded", False):
        return {}
    return {id(e.param): e for e in optimizer.entries}


def _model_box(p: torch.Tensor, shards: dict[int, Any], tp: int, tp_rank: int):
    """(tensor to save from / load into, its global shape, its global offset): the parameter's tp slice, or at
    ZeRO-3 its shard's box (the tp slice's rows this dp rank holds)."""
    e = shards.get(id(p))
    if e is not None:
        return e.shard, e.info.global_shape, e.info.global_offset
    gs, go = _tp_box(p, tp, tp_rank)
    return p, gs, go


def _zero_stage(optimizer) -> int | None:
    if optimizer is None:
        return None
    return int(getattr(optimizer, "stage", 0))


def _loss_scaler(optimizer):
    return getattr(optimizer, "loss_scaler", None)


def _layout(ctx, optimizer, model) -> dict[str, Any]:
    # "tp"/"dp": the layout's (uniform layouts) or the largest stage's (--stage-layouts);
    # "stage_layouts": every stage's [tp, dp], what layout comparisons use
    if ctx.per_stage_layouts:
        stages = [[int(t), int(d)] for t, d in ctx.topology.layouts]
        tp, dp = ctx.topology.tp, ctx.topology.dp
    else:
        stages = [[ctx.tp_size, ctx.dp_size] for _ in range(ctx.pp_size)]
        tp, dp = ctx.tp_size, ctx.dp_size
    return {"world_size": ctx.world_size, "tp": tp, "pp": ctx.pp_size, "dp": dp, "stage_layouts": stages,
            "zero_stage": _zero_stage(optimizer),
            "sequence_parallel": bool(getattr(model, "sequence_parallel", False)),
            "param_dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


def stage_layouts_of(lay: dict[str, Any]) -> list[list[int]] | None:
    """Every stage's [tp, dp] of a saved layout (older checkpoints: uniform from tp/pp/dp)."""
    if lay.get("stage_layouts"):
        return [[int(t), int(d)] for t, d in lay["stage_layouts"]]
    if lay.get("tp") is None:
        return None
    return [[int(lay["tp"]), int(lay["dp"])] for _ in range(int(lay["pp"]))]


def describe_layout(lay: dict[str, Any]) -> str:
    if lay.get("tp") is None:
        return f"no parallel layout (imported from {lay.get('imported_from', '?')})"
    z = lay.get("zero_stage")
    stages = stage_layouts_of(lay) or []
    if len({tuple(x) for x in stages}) > 1:
        shape = f"stage layouts {','.join(f'tp{t}dp{d}' for t, d in stages)} (pp {lay['pp']})"
    else:
        shape = f"tp {lay['tp']} · pp {lay['pp']} · dp {lay['dp']}"
    return (shape + (f" · zero {z}" if z is not None else "")
            + f" ({lay['world_size']} rank{'s' if lay['world_size'] != 1 else ''}, {lay.get('param_dtype', '?')})")


def _sizes(stages: list[list[int]] | None, axis: int) -> str:
    """tp (axis 0) or dp (axis 1) of a layout for messages: '2', or '1,2' per stage when they differ."""
    vals = [st[axis] for st in stages or []]
    return "?" if not vals else str(vals[0]) if len(set(vals)) == 1 else ",".join(map(str, vals))


def dp_changed(saved: list[list[int]] | None, cur: list[list[int]]) -> bool:
    """Whether the data-parallel sizes differ between two layouts ([tp, dp] per stage).

    A uniform dp is one number whatever the stage count (pp 2 -> 4 at dp 2 keeps dp 2);
    per-stage dps compare stage by stage. An unknown saved layout counts as changed.
    """
    return saved is None or _sizes(saved, 1) != _sizes(cur, 1)


@dataclass
class LoadResult:
    """What ``CheckpointManager.load`` restored (the trainer sets its counters from it)."""

    path: str
    iteration: int
    consumed_samples: int
    wandb_run_id: str | None
    args: dict[str, Any] | None
    saved_layout: dict[str, Any]
    loaded_optimizer: bool
    loaded_rng: bool
    finetune: bool
    messages: list[str] = field(default_factory=list)


class CheckpointManager:
    """Save/load through torch.distributed.checkpoint; collective over the world. See the module docstring.

    ``async_save``: ``save`` copies the state to CPU memory (the only synchronous part besides
    a barrier) and writes it in a background thread over a dedicated gloo process group, so
    training continues during the write; the directory is renamed and ``latest`` updated
    by that thread when every rank's files are on disk. The next ``save``/``load``/``wait``/
    ``close`` waits for it (and re-raises its error). Creating a manager with
    ``async_save=True`` is collective (it creates the process group).
    """

    def __init__(self, ctx=None, *, async_save: bool = False, out: TextIO | None = sys.stdout,
                 retain_latest: int = 0, retain_interval: int | None = None) -> None:
        self.ctx = ctx
        self.async_save = async_save
        # retention.py: after each complete save rank 0 removes the checkpoints this policy does not keep
        self.retain_latest, self.retain_interval = retain_latest, retain_interval
        self.out = out
        self._thread: threading.Thread | None = None
        self._async_error: BaseException | None = None
        self._async_pg = None
        if async_save and _distributed():
            self._async_pg = dist.new_group(backend="gloo")
        self.last_saved: str | None = None

    # ---- reporting ----------------------------------------------------------------------------
    def _rank(self) -> int:
        return dist.get_rank() if _distributed() else 0

    def _say(self, msg: str, warning: bool = False) -> None:
        if self._rank() != 0:
            return
        if self.out is None:
            (logger.warning if warning else logger.info)("checkpoint: %s", msg)
        else:
            print(("WARNING: checkpoint: " if warning else "checkpoint: ") + msg, file=self.out, flush=True)

    # ---- save ---------------------------------------------------------------------------------
    def _collect(self, model, optimizer, scheduler, sampler, config, iteration, wandb_run_id, extra):
        ctx = self.ctx or model.ctx
        tp, tp_rank = ctx.tp_size, ctx.tp_rank()
        pieces: dict[str, Piece] = {}
        shards = _param_shards(optimizer)
        for name, p in model.named_parameters():
            if _canonical(name, p) != name:
                continue                    # the tied copy: stored once, as the word embedding
            t, gs, go = _model_box(p, shards, tp, tp_rank)
            piece = _cut(t.detach(), gs, go, getattr(p, "unpadded_rows", None))
            if piece is not None:
                pieces[model_key(name)] = piece
        entries = _optimizer_entries(optimizer, model, tp, tp_rank)
        for e in entries:
            if e.duplicate:
                continue
            rows = getattr(e.param, "unpadded_rows", None)
            piece = _cut(e.master.detach(), e.global_shape, e.global_offset, rows)
            if piece is not None:
                pieces[optim_key("master", e.name)] = piece
            for k, v in e.inner.state.get(e.master, {}).items():
                if not torch.is_tensor(v):
                    continue
                if v.dim() == 0:            # e.g. Adam's step: the same on every shard
                    pieces[optim_key(k, e.name)] = Piece(v.detach(), (), ())
                elif tuple(v.shape) == tuple(e.master.shape):
                    piece = _cut(v.detach(), e.global_shape, e.global_offset, rows)
                    if piece is not None:
                        pieces[optim_key(k, e.name)] = piece
        streams = getattr(model, "streams", None)
        rng = {"rank": self._rank(), "coords": {"pp": ctx.pp_rank(), "tp": tp_rank, "dp": ctx.dp_rank()},
               "cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
               else None,
               "streams": streams.state_dict() if streams is not None else None}
        gathered = _all_gather_object({"rank": self._rank(), "coords": rng["coords"], "wandb": wandb_run_id,
                                       "layers": list(getattr(model, "layer_range", ())) or None})
        run_ids = [g["wandb"] for g in gathered if g["wandb"]]
        stages = {}
        for g in gathered:
            if g["layers"] is not None:
                stages[g["coords"]["pp"]] = g["layers"]
        layout = _layout(ctx, optimizer, model)
        layout["stage_layers"] = [stages.get(i) for i in range(ctx.pp_size)]
        layout["rank_coords"] = [[g["rank"], g["coords"]["pp"], g["coords"]["tp"], g["coords"]["dp"]]
                                 for g in gathered]
        scaler = _loss_scaler(optimizer)
        groups = None
        if optimizer is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        model_cfg = dataclasses.asdict(model.cfg) if dataclasses.is_dataclass(getattr(model, "cfg", None)) else None
        args = config.to_dict() if config is not None and hasattr(config, "to_dict") else config
        seed = getattr(model, "seed", None)
        common = {"format_version": FORMAT_VERSION, "iteration": int(iteration),
                  "consumed_samples": int(sampler.consumed_samples) if sampler is not None else None,
                  "scheduler": scheduler.state_dict() if scheduler is not None else None,
                  "sampler": sampler.state_dict() if sampler is not None else None,
                  "loss_scaler": scaler.state_dict() if scaler is not None else None,
                  "num_skipped_steps": int(getattr(optimizer, "num_skipped_steps", 0) or 0),
                  "optimizer_param_groups": groups, "wandb_run_id": run_ids[0] if run_ids else None,
                  "args": args, "model_config": model_cfg, "layout": layout, "seed": seed,
                  "extra": extra or {}}
        info = {"layout": layout, "model_config": model_cfg, "args": args,
                "tokenizer": tokenizer_record(getattr(config, "data", None)),
                "has_optimizer": optimizer is not None, "has_rng": True,
                "consumed_samples": common["consumed_samples"], "wandb_run_id": common["wandb_run_id"],
                "global_batch_size": sampler.global_batch_size if sampler is not None else None}
        objects = {"common": common, f"rng.rank{self._rank()}": rng}
        return pieces, objects, info

    def save(self, root: str, iteration: int, *, model, optimizer=None, scheduler=None, sampler=None,
             config=None, wandb_run_id: str | None = None, extra: dict | None = None) -> str:
        """Save a checkpoint of this iteration under ``root`` (atomic; updates ``root/latest``).
        Collective. Returns the checkpoint directory (with ``async_save``: where it will be)."""
        self.wait()
        start = time.monotonic()
        pieces, objects, info = self._collect(model, optimizer, scheduler, sampler, config, iteration,
                                              wandb_run_id, extra)
        final = os.path.join(root, f"iter_{int(iteration):07d}")
        if not self.async_save:
            write_checkpoint(root, iteration, pieces, objects, info)
            self._say(f"saved iteration {iteration} to {final} in {time.monotonic() - start:.1f} s "
                      f"({describe_layout(info['layout'])})")
            self._prune(root)
            self.last_saved = final
            return final
        # async: copy to CPU now (the model keeps training), write in a thread
        staged = {k: Piece(p.tensor.detach().to("cpu", copy=True), p.global_shape, p.offset)
                  for k, p in pieces.items()}
        objects = copy.deepcopy(objects)
        prepare_tmp_dir(root, iteration)

        def work() -> None:
            try:
                write_checkpoint(root, iteration, staged, objects, info, process_group=self._async_pg,
                                 prepared=True)
                self._prune(root)        # complete, `latest` updated; the next save waits for this thread
            except BaseException as e:   # re-raised by wait()
                self._async_error = e

        self._thread = threading.Thread(target=work, name=f"checkpoint-save-{iteration}", daemon=True)
        self._thread.start()
        self._say(f"saving iteration {iteration} to {final} in the background (state copied in "
                  f"{time.monotonic() - start:.1f} s; {describe_layout(info['layout'])})")
        self.last_saved = final
        return final

    def _prune(self, root: str) -> None:
        """Rank 0, after a complete save: the retention policy (``retention.prune``; I/O errors are warnings)."""
        if self._rank() == 0:
            from .retention import prune
            prune(root, self.retain_latest, self.retain_interval, say=lambda line, warning=False:
                  self._say(line, warning))

    def wait(self) -> None:
        """Block until a background save is complete (renamed, ``latest`` updated); re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            err, self._async_error = self._async_error, None
            if err is not None:
                raise CheckpointError(f"background checkpoint save failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        self.wait()

    # ---- load ---------------------------------------------------------------------------------
    def load(self, root: str, *, model, optimizer=None, scheduler=None, sampler=None, config=None,
             finetune: bool = False, no_load_optim: bool = False, no_load_rng: bool = False) -> LoadResult:
        """Load the checkpoint ``root`` names (its ``latest``, or ``root`` itself) into this layout. Collective.

        Everything is validated before any state is touched: files (missing, truncated), the model
        configuration (each differing field named), keys (missing and unexpected listed) and global
        shapes. ``finetune``: weights only — the optimizer, scheduler and data position stay fresh,
        the returned iteration is 0 and the RNG is not loaded. ``no_load_optim``: fresh optimizer,
        everything else restored. ``no_load_rng``: keep this run's RNG seeds.
        """
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # DCP loads with the first load

        self.wait()
        ctx = self.ctx or model.ctx
        tp, tp_rank = ctx.tp_size, ctx.tp_rank()
        ckpt, info, md = _agreed_precheck(root)
        saved_md = md.state_dict_metadata
        saved_tensors = {k for k, v in saved_md.items() if isinstance(v, TensorStorageMetadata)}
        saved_layout = info.get("layout", {})
        errors: list[str] = []
        messages: list[str] = []

        # -- model configuration
        saved_cfg = info.get("model_config")
        cur_cfg = dataclasses.asdict(model.cfg) if dataclasses.is_dataclass(getattr(model, "cfg", None)) else None
        if saved_cfg is None:
            messages.append(f"{ckpt} records no model configuration (imported weights?): only key names and "
                            "shapes are checked")
        elif cur_cfg is not None:
            saved_cfg = {**_LATER_FIELD_DEFAULTS, **saved_cfg}
            for f in ARCHITECTURE_FIELDS:
                if f in saved_cfg and f in cur_cfg and saved_cfg[f] != cur_cfg[f]:
                    errors.append(f"model config {f}: checkpoint {saved_cfg[f]}, this run {cur_cfg[f]}")
            for f in _ADVISORY_FIELDS:
                if f in saved_cfg and f in cur_cfg and saved_cfg[f] != cur_cfg[f]:
                    messages.append(f"model config {f} differs: checkpoint {saved_cfg[f]}, this run {cur_cfg[f]} "
                                    "(weights load; numerics follow this run's value)")

        # -- what this rank needs
        want_optim = optimizer is not None and not finetune and not no_load_optim
        has_optim = bool(info.get("has_optimizer")) and any(k.startswith("optim.") for k in saved_tensors)
        if want_optim and not has_optim:
            messages.append(f"{ckpt} has no optimizer state: the optimizer starts fresh (Adam moments zero)")
            want_optim = False
        requests: dict[str, Piece] = {}
        model_targets = []        # (param or ZeRO-3 shard, key, piece)
        shards = _param_shards(optimizer)
        for name, p in model.named_parameters():
            key = model_key(_canonical(name, p))
            t, gs, go = _model_box(p, shards, tp, tp_rank)
            piece = _cut(torch.empty(t.shape, dtype=t.dtype), gs, go, getattr(p, "unpadded_rows", None))
            model_targets.append((t, key, piece))
            if piece is not None:
                requests[key] = piece
        entries = _optimizer_entries(optimizer, model, tp, tp_rank) if want_optim else []
        optim_targets = []        # (entry, {kind: piece or None}, step_key)
        for e in entries:
            rows = getattr(e.param, "unpadded_rows", None)
            kinds = {}
            for kind in ["master"] + sorted({k.split(".", 2)[1] for k in saved_tensors
                                             if k.startswith("optim.") and k.split(".", 2)[2] == e.name}
                                            - {"master"}):
                key = optim_key(kind, e.name)
                smd = saved_md.get(key)
                if isinstance(smd, TensorStorageMetadata) and len(smd.size) == 0:
                    kinds[kind] = Piece(torch.empty((), dtype=smd.properties.dtype), (), ())
                    requests[key + "@" + e.own_name] = kinds[kind]   # a duplicate reads the same key
                else:
                    piece = _cut(torch.empty(e.master.shape, dtype=torch.float32), e.global_shape,
                                 e.global_offset, rows)
                    kinds[kind] = piece
                    if piece is not None:
                        requests[key + "@" + e.own_name] = piece
            optim_targets.append((e, kinds))
        local_errors = []        # (key, checkpoint shape, this model's shape)
        for rkey, piece in requests.items():
            key = rkey.split("@", 1)[0]
            smd = saved_md.get(key)
            if isinstance(smd, TensorStorageMetadata) and tuple(smd.size) != tuple(piece.global_shape):
                local_errors.append((key, tuple(smd.size), tuple(piece.global_shape)))
        needed = sorted({k.split("@", 1)[0] for k in requests})
        gathered = _all_gather_object({"needed": needed, "errors": local_errors})
        needed_all = set().union(*(g["needed"] for g in gathered))
        shapes = sorted({e for g in gathered for e in g["errors"]})
        missing = sorted(needed_all - saved_tensors)
        relevant = {k for k in saved_tensors if k.startswith("model.") or (want_optim and k.startswith("optim."))}
        unexpected = sorted(relevant - needed_all)
        errors.extend(_tensor_mismatches(shapes, missing, unexpected, named=not errors))
        if errors:
            raise CheckpointError(f"checkpoint {ckpt} does not fit this model (nothing was loaded): "
                                  + "; ".join(errors))

        # -- layout change: what is exact and what is not
        cur_layout = _layout(ctx, optimizer, model)
        sl = saved_layout
        # decided from every stage's (tp, dp), so all ranks take the same branch (per-stage layouts too)
        saved_stages, cur_stages = stage_layouts_of(sl), cur_layout["stage_layouts"]
        same_mp = saved_stages is not None and [t for t, _ in saved_stages] == [t for t, _ in cur_stages]
        same_layout = same_mp and saved_stages == cur_stages
        saved_dp = saved_stages[ctx.pp_rank()][1] if same_mp else None  # this stage's saved dp
        changed = [k for k in ("stage_layouts", "zero_stage", "world_size", "param_dtype")
                   if (saved_stages if k == "stage_layouts" else sl.get(k)) != cur_layout.get(k)
                   and not (k == "zero_stage" and optimizer is None)]
        if changed and sl.get("tp") is not None:
            messages.append(f"layout changed: saved {describe_layout(sl)} -> now {describe_layout(cur_layout)}; "
                            "weights" + (" and optimizer state (masters, Adam moments, step)" if want_optim else "")
                            + " are re-sliced exactly")
        common_key = "common"
        rng_key = None
        loaded_rng = False
        if not (finetune or no_load_rng):
            coords = {(int(p_), int(t_), int(d_)): int(r) for r, p_, t_, d_ in sl.get("rank_coords", [])}
            if not info.get("has_rng", False) or not coords:
                messages.append(f"{ckpt} has no RNG state: RNG streams keep this run's seeds")
            elif same_layout:
                rng_key = f"rng.rank{coords[(ctx.pp_rank(), tp_rank, ctx.dp_rank())]}"
            elif same_mp:
                rng_key = f"rng.rank{coords[(ctx.pp_rank(), tp_rank, ctx.dp_rank() % saved_dp)]}"
                messages.append(f"RNG: dp changed {_sizes(saved_stages, 1)} -> {_sizes(cur_stages, 1)}: each rank takes the "
                                f"streams of the saved rank with its (pp, tp) and dp rank mod the saved dp; with "
                                "dropout the masks differ from the saved run's continuation (ranks draw per microbatch)")
            else:
                messages.append(f"RNG: tp/pp changed (tp {_sizes(saved_stages, 0)} -> {_sizes(cur_stages, 0)}, pp {sl.get('pp')} -> "
                                f"{ctx.pp_size}): per-(stage, tp rank) streams cannot carry over; re-seeded "
                                "from seed + iteration (dropout masks differ from the saved run's)")
        objects = [common_key] + ([rng_key] if rng_key else [])

        # -- read everything into fresh buffers (nothing touched yet)
        read_requests = {}
        alias: dict[str, list[str]] = {}
        for rkey, piece in requests.items():
            key = rkey.split("@", 1)[0]
            if key in read_requests:        # same box wanted twice (cannot happen across ranks; here a duplicate)
                alias.setdefault(key, []).append(rkey)
                continue
            read_requests[key] = piece
            alias.setdefault(key, []).append(rkey)
        loaded = read_pieces(ckpt, read_requests, objects)
        for key, rkeys in alias.items():
            for rk in rkeys[1:]:
                requests[rk].tensor.copy_(read_requests[key].tensor)
        common = loaded[common_key]

        # -- data position and schedule checks (messages only)
        if sampler is not None and not finetune and common.get("sampler"):
            s = common["sampler"]
            if s.get("global_batch_size") != sampler.global_batch_size:
                messages.append(f"data: global batch size changed {s.get('global_batch_size')} -> "
                                f"{sampler.global_batch_size}: training continues at sample {s['consumed_samples']}, "
                                "but iterations no longer see the saved run's batches")
            elif dp_changed(saved_stages, cur_stages):
                messages.append(f"data: dp changed {_sizes(saved_stages, 1)} -> {_sizes(cur_stages, 1)}: each iteration trains on the same "
                                "global batch as before (the sampler's global order does not depend on dp); the "
                                "per-rank split and reduction order change, so losses agree to rounding, not bitwise")
            if s.get("total_samples") != sampler.total_samples:
                messages.append(f"data: the dataset size changed {s.get('total_samples')} -> {sampler.total_samples} "
                                "(train-iters × global batch): with --data-path the shuffled order is built for the "
                                "total, so later samples may differ from the saved run's")

        # -- apply
        with torch.no_grad():
            for p, key, piece in model_targets:
                rows = piece.tensor.shape[0] if piece is not None and piece.tensor.dim() else None
                if piece is None:
                    p.zero_()
                elif rows is not None and rows < p.shape[0]:
                    p[:rows].copy_(piece.tensor)
                    p[rows:].zero_()
                else:
                    p.copy_(piece.tensor.view(p.shape))
            for e, kinds in optim_targets:
                new_state = {}
                for kind, piece in kinds.items():
                    if kind == "master":
                        dst = e.master
                    elif piece is not None and piece.tensor.dim() == 0:
                        dev = e.master.device if _fused(e.inner) else torch.device("cpu")
                        new_state[kind] = piece.tensor.to(dev).clone()
                        continue
                    else:
                        dst = torch.zeros_like(e.master, dtype=torch.float32)
                        new_state[kind] = dst
                    if piece is None:
                        dst.zero_()
                    else:
                        rows = piece.tensor.shape[0]
                        dst[:rows].copy_(piece.tensor)
                        dst[rows:].zero_()
                if new_state:
                    order = ["step", "exp_avg", "exp_avg_sq"]
                    e.inner.state[e.master] = {k: new_state[k] for k in sorted(new_state, key=lambda k: (
                        order.index(k) if k in order else len(order), k))}
        if want_optim:
            scaler = _loss_scaler(optimizer)
            if scaler is not None and common.get("loss_scaler"):
                scaler.load_state_dict(common["loss_scaler"])
            if hasattr(optimizer, "num_skipped_steps"):
                optimizer.num_skipped_steps = int(common.get("num_skipped_steps") or 0)
        elif optimizer is not None and hasattr(optimizer, "reload_master_from_model"):
            optimizer.reload_master_from_model()      # separate fp32 masters follow the loaded weights
        if scheduler is not None and not finetune and common.get("scheduler"):
            scheduler.load_state_dict(common["scheduler"])
        if sampler is not None and not finetune and common.get("sampler"):
            sampler.load_state_dict(common["sampler"])
        iteration = 0 if finetune else int(common.get("iteration") or 0)
        streams = getattr(model, "streams", None)
        if rng_key is not None:
            rng = loaded[rng_key]
            torch.set_rng_state(rng["cpu"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            if streams is not None and rng.get("streams") is not None:
                streams.load_state_dict(rng["streams"])
            loaded_rng = True
        elif not (finetune or no_load_rng) and streams is not None:
            seed = int(getattr(model, "seed", 0) or 0) + iteration
            fresh = RNGStreams(seed, tp_rank=tp_rank, pp_rank=ctx.pp_rank(), device=streams.device)
            streams.load_state_dict(fresh.state_dict())
            torch.manual_seed(seed + 1_000_003 * ctx.pp_rank() + 7919 * tp_rank)

        what = ("weights only (--finetune: fresh optimizer, iteration 0)" if finetune else
                "weights" + (", optimizer" if want_optim else " (optimizer fresh)")
                + ", scheduler, data position" + (", RNG" if loaded_rng else ""))
        self._say(f"loaded {ckpt} (iteration {common.get('iteration')}, saved in {describe_layout(sl)}) into "
                  f"{describe_layout(cur_layout)}: {what}")
        for m in messages:
            self._say(m, warning=True)
        return LoadResult(path=ckpt, iteration=iteration,
                          consumed_samples=0 if finetune else int(common.get("consumed_samples") or 0),
                          wandb_run_id=None if finetune else common.get("wandb_run_id"),
                          args=common.get("args"), saved_layout=sl, loaded_optimizer=want_optim,
                          loaded_rng=loaded_rng, finetune=finetune, messages=messages)


def _tensor_mismatches(shapes: list, missing: list[str], unexpected: list[str], *, named: bool) -> list[str]:
    """The tensors that do not fit, counted, for the one-line error: with the configuration fields that differ
    already named (``named`` False) the counts say enough; without them (an imported checkpoint that records
    no configuration) the first few are named."""
    def first(keys: list[str]) -> str:
        return f": {', '.join(keys[:3])}" + (" …" if len(keys) > 3 else "") if named else ""

    out = []
    if shapes:
        k, saved, now = shapes[0]
        out.append(f"{len(shapes)} tensor(s) of another shape" + (
            f" (first {k}: checkpoint {saved}, this model {now})" if named else ""))
    if missing:
        out.append(f"{len(missing)} key(s) missing from the checkpoint{first(missing)}")
    if unexpected:
        out.append(f"{len(unexpected)} unexpected key(s) in the checkpoint (not in this model){first(unexpected)}")
    return out


def _agreed_precheck(root: str):
    """(checkpoint dir, checkpoint.json, DCP metadata) after every rank checked them: ``latest``, the files'
    presence and sizes, and (each rank a share of the files) their CRC-32 checksums. Collective: a problem
    any rank sees raises the same one-line ``CheckpointError`` on every rank, before any state changed."""
    rank = dist.get_rank() if _distributed() else 0
    world = dist.get_world_size() if _distributed() else 1
    found = None
    try:
        ckpt = resolve_checkpoint_dir(root)
        info = read_info(ckpt)
        md = read_metadata(ckpt)
        check_files(ckpt, info, md)
        problems = verify_checksum_share(ckpt, info, rank, world)
        if problems:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: " + "; ".join(problems))
    except CheckpointError as e:
        found = str(e)
    except OSError as e:
        found = f"cannot read checkpoint {root}: {e}"
    seen = [(r, p) for r, p in enumerate(_all_gather_object(found)) if p]
    if seen:
        texts = list(dict.fromkeys(p for _, p in seen))
        who = "" if len(seen) in (0, world) else f" (seen by rank(s) {', '.join(str(r) for r, _ in seen)})"
        raise CheckpointError("; ".join(texts) + who + "; nothing was loaded")
    return ckpt, info, md


def _fused(opt: torch.optim.Optimizer) -> bool:
    return any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
