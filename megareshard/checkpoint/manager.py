"""CheckpointManager: what the trainer calls to save and load a run in any parallel layout.

    mgr = CheckpointManager(ctx, async_save=False, out=sys.stdout)
    mgr.save(root, iteration, model=model, optimizer=opt, scheduler=sched, sampler=sampler,
             config=cfg, wandb_run_id=tracker.run_id)
    res = mgr.load(root, model=model, optimizer=opt, scheduler=sched, sampler=sampler, config=cfg,
                   finetune=False, no_load_optim=False, no_load_rng=False)
    res.iteration, res.consumed_samples, res.wandb_run_id, res.messages

Both are collective over the world (every rank calls them). See ``format.py`` for the files. This module holds
the manager and its save side; the load side is ``loading.py``, the state as pieces and the layout record ``state.py``.

What a checkpoint holds: model weights (global names, tp slices — at ZeRO-3 each rank's row
shard of them, the only copy it holds —, vocabulary unpadded; the tied output-layer copy of a
last pipeline stage is not stored: it loads from the word embedding), optimizer state keyed by
parameter name (fp32 master, Adam moments, step — ZeRO row chunks or full tp slices), LR
scheduler, iteration, sampler (consumed samples), loss scaler, per-rank RNG (CPU, CUDA,
tensor-parallel streams), W&B run id, the arguments and the layout it was saved in, and the kernels the run
chose (``kernel_choices``, in ``checkpoint.json`` too: a resumed run runs them instead of measuring again).

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
from typing import TextIO

import torch
import torch.distributed as dist

from ..data.tokenizer import tokenizer_record
from .format import FORMAT_VERSION, CheckpointError, Piece, prepare_tmp_dir, write_checkpoint
from .loading import ARCHITECTURE_FIELDS, LoadResult, load_checkpoint
from .state import (_all_gather_object, _canonical, _cut, _distributed, _layout, _loss_scaler, _model_box,
                    _optimizer_entries, _param_shards, describe_layout, model_key, optim_key)
from .state import dp_changed, stage_layouts_of  # noqa: F401  (importable from here, as before)

__all__ = ["CheckpointManager", "LoadResult", "ARCHITECTURE_FIELDS", "model_key", "optim_key"]

logger = logging.getLogger("megareshard")


def _merged_kernel_choices(per_rank: list) -> dict | None:
    """The kernels the ranks chose (the trainer's fast path sets ``model.kernel_choices``: {"attention": {shape key:
    {"kernel", "why"}}}), merged by key, the lowest rank's first; None when no rank recorded any."""
    merged: dict[str, dict] = {}
    for choices in per_rank:
        for kind, entries in (choices or {}).items():
            for key, entry in (entries or {}).items():
                merged.setdefault(kind, {}).setdefault(key, entry)
    return merged or None


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
                                       "layers": list(getattr(model, "layer_range", ())) or None,
                                       "kernels": getattr(model, "kernel_choices", None)})
        run_ids = [g["wandb"] for g in gathered if g["wandb"]]
        stages = {}
        for g in gathered:
            if g["layers"] is not None:
                stages[g["coords"]["pp"]] = g["layers"]
        layout = _layout(ctx, optimizer, model)
        layout["stage_layers"] = [stages.get(i) for i in range(ctx.pp_size)]
        layout["rank_coords"] = [[g["rank"], g["coords"]["pp"], g["coords"]["tp"], g["coords"]["dp"]]
                                 for g in gathered]
        kernel_choices = _merged_kernel_choices([g["kernels"] for g in gathered])
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
                  "kernel_choices": kernel_choices, "extra": extra or {}}
        info = {"layout": layout, "model_config": model_cfg, "args": args,
                "tokenizer": tokenizer_record(getattr(config, "data", None)),
                "has_optimizer": optimizer is not None, "has_rng": True,
                "consumed_samples": common["consumed_samples"], "wandb_run_id": common["wandb_run_id"],
                "kernel_choices": kernel_choices,
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

    # ---- load (loading.py) -------------------------------------------------------------------
    def load(self, root: str, *, model, optimizer=None, scheduler=None, sampler=None, config=None,
             finetune: bool = False, no_load_optim: bool = False, no_load_rng: bool = False) -> LoadResult:
        """Load the checkpoint ``root`` names (its ``latest``, or ``root`` itself) into this layout. Collective.

        Everything is validated before any state is touched: files (missing, truncated), the model
        configuration (each differing field named), keys (missing and unexpected listed) and global
        shapes. ``finetune``: weights only — the optimizer, scheduler and data position stay fresh,
        the returned iteration is 0 and the RNG is not loaded. ``no_load_optim``: fresh optimizer,
        everything else restored. ``no_load_rng``: keep this run's RNG seeds.
        """
        self.wait()
        return load_checkpoint(self.ctx or model.ctx, root, model=model, optimizer=optimizer, scheduler=scheduler,
                               sampler=sampler, config=config, finetune=finetune, no_load_optim=no_load_optim,
                               no_load_rng=no_load_rng, say=self._say)
