"""Megatron-LM checkpoints in: checked whole before anything is read, then read into a fresh megareshard
checkpoint (``tools/checkpoint_util.py import-megatron``) or straight into a run's model in its layout
(``--load DIR``: ``CheckpointManager.load`` hands a Megatron-LM directory here).

What loads: the model's weights, each rank reading only its box of every tensor (tp slice, pipeline
stage, virtual stages; ZeRO's optimizer takes its fp32 masters from the loaded weights). What does not:
Megatron-LM's optimizer state — its distributed optimizer stores Adam's moments in the layout of its own
gradient buckets (per data-parallel rank), which has no exact counterpart here — nor its iteration, data
position and RNG. A load is therefore ``--finetune``: a fresh optimizer at iteration 0, and it says so.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..models.config import ModelConfig
from .format import CHECKPOINT_JSON, LATEST_FILE, CheckpointError
from .loading import _ADVISORY_FIELDS, LoadResult, architecture_differences
from .state import _all_gather_object, _canonical, _cut, _layout, _tp_box, describe_layout
from .megatron import LAYERS, Source, megatron_shape, model_config_from_args, our_shape, sources, swiglu_rows
from .megatron_io import MegatronCheckpoint, find_megatron_checkpoint, has_fp8_state

__all__ = ["Opened", "open_checked", "read_full", "load_into_model", "megatron_checkpoint_dir"]


def megatron_checkpoint_dir(path: str) -> str | None:
    """The iteration directory when ``path`` names a Megatron-LM checkpoint and not a megareshard one (a
    megareshard ``latest`` or ``checkpoint.json`` wins: a run that saved here resumes its own checkpoints)."""
    if os.path.exists(os.path.join(path, LATEST_FILE)) or os.path.exists(os.path.join(path, CHECKPOINT_JSON)):
        return None
    return find_megatron_checkpoint(path)


@dataclass
class Opened:
    """A checked Megatron-LM checkpoint: its files, this model's configuration of it and the padded vocabulary."""

    ckpt: MegatronCheckpoint
    cfg: ModelConfig
    notes: list[str]
    padded: int
    # name -> (Source, full shape here with the padded vocabulary, stored global shape)
    expected: dict[str, tuple[Source, tuple[int, ...], tuple[int, ...]]]

    def describe(self) -> str:
        a = self.ckpt.args
        return (f"Megatron-LM {self.ckpt.format} checkpoint {self.ckpt.path} (iteration {self.ckpt.iteration}, "
                f"saved at tp {a.get('tensor_model_parallel_size', '?')} · pp "
                f"{a.get('pipeline_model_parallel_size', '?')})")


def _padded_rows(ckpt: MegatronCheckpoint, src: Source) -> int:
    if ckpt.format == "torch_dist":
        key, _ = ckpt.resolve(src)
        return ckpt.shapes[key][0][0]
    key = next((k for k in src.keys if k in ckpt.shapes), None)
    if key is None:
        raise CheckpointError(f"{ckpt.path}: the first pipeline stage's files lack {src.key}")
    return ckpt.shapes[key][0][0] * ckpt.tp


def open_checked(path: str, vocab_size: int | None = None) -> Opened:
    """Open the Megatron-LM checkpoint ``path`` names and check it whole: the architecture its arguments give
    (features not built here refused), Transformer Engine fp8 scaling state, the files (truncation names the
    file and the tensor), every tensor's presence and shape, and stored tensors this model has no place for."""
    ckpt = MegatronCheckpoint(path)
    cfg, notes = model_config_from_args(ckpt.args, vocab_size)
    if cfg.num_experts is not None and ckpt.format != "torch_dist":
        raise CheckpointError(f"{ckpt.path}: an MoE model in per-rank torch files (one per expert-parallel rank) is "
                              "not read: resave it with --ckpt-format torch_dist")
    refused = ckpt.refused_tensors()
    if refused:
        raise CheckpointError(f"{ckpt.path} holds tensors of what megareshard does not build: {', '.join(refused[:4])}")
    ckpt.check_files()
    fp8 = sorted(k for k, raw in ckpt.extra_state().items() if has_fp8_state(raw))
    if fp8:
        raise CheckpointError(f"{ckpt.path} holds Transformer Engine fp8 scaling state (delayed scaling: amax history "
                              f"and scales) in {len(fp8)} extra state(s), e.g. {fp8[0]}: fp8 training is not built "
                              "here, so the run's fp8 numerics cannot be continued")
    table = sources(cfg)
    padded = _padded_rows(ckpt, table["embedding.word_embeddings.weight"])
    saved_padded = ckpt.args.get("padded_vocab_size")
    if saved_padded not in (None, padded):
        raise CheckpointError(f"{ckpt.path}: embedding.word_embeddings.weight has {padded} rows, the arguments' "
                              f"padded_vocab_size is {saved_padded}")
    if cfg.vocab_size > padded:
        raise CheckpointError(f"vocabulary {cfg.vocab_size} is larger than the checkpoint's {padded} embedding rows")
    expected = {}
    for name, src in table.items():
        full = list(our_shape(name, cfg))
        if src.vocab:
            full[0] = padded
        expected[name] = (src, tuple(full), megatron_shape(name, src, cfg, padded))
    ckpt.check_shapes(expected)
    used = {k for src, _, _ in expected.values() for k in src.keys}
    used |= {k + s for k in used for s in ("_w", "_v")}
    if ckpt.format == "torch_dist":
        stored = {k for k in ckpt.shapes if not k.startswith("optimizer.")}
        where = os.path.join(ckpt.path, ".metadata")
    else:
        stored = {re.sub(re.escape(LAYERS) + r"\d+\.", LAYERS, k) for k in ckpt.shapes}
        where = ckpt.path
    if cfg.tied_embeddings:
        stored.discard("output_layer.weight")   # a last pipeline stage's copy of the word embedding
    unplaced = sorted(stored - used)
    if unplaced:
        raise CheckpointError(f"{where} holds {len(unplaced)} tensor(s) with no place in this model "
                              f"({cfg.normalization}, swiglu {cfg.swiglu}, bias {cfg.add_bias_linear}): "
                              f"{', '.join(unplaced[:6])}")
    return Opened(ckpt, cfg, notes, padded, expected)


def read_full(opened: Opened) -> dict[str, torch.Tensor]:
    """Every tensor of the model, full and unpadded, read in this process alone (the import tool)."""
    requests = {}
    for name, (src, _, stored) in opened.expected.items():
        shape = our_shape(name, opened.cfg)
        dtype = opened.ckpt.shapes[opened.ckpt.resolve(src)[0]][1] if opened.ckpt.format == "torch_dist" else None
        requests[name] = (src, (0,) * len(shape), torch.empty(shape, dtype=dtype or _legacy_dtype(opened, src)))
    opened.ckpt.read(requests, {n: e[1] for n, e in opened.expected.items()}, _rows(opened.cfg), no_dist=True)
    return {name: t for name, (_, _, t) in requests.items()}


def _legacy_dtype(opened: Opened, src: Source) -> torch.dtype:
    for k in opened.ckpt.shapes:
        if re.sub(re.escape(LAYERS) + r"\d+\.", LAYERS, k) in src.keys:
            return opened.ckpt.shapes[k][1]
    return torch.float32


def _rows(cfg: ModelConfig) -> dict[str, int]:
    return {n: swiglu_rows(n, cfg) for n, s in sources(cfg).items() if s.part is not None}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def load_into_model(path: str, *, ctx, model, cfg: ModelConfig, optimizer,
                    say: Callable[[str, bool], None]) -> LoadResult:
    """Load the Megatron-LM checkpoint ``path`` names into this rank's part of ``model`` of configuration ``cfg``
    (a GPT's stage or model chunks; collective).

    Checked on every rank before anything is read, the same one-line error everywhere: the checkpoint
    (``open_checked``) and its architecture against this run's (each differing flag named)."""
    tp, tp_rank = ctx.tp_size, ctx.tp_rank()
    cur = cfg
    problem, opened, messages = None, None, []
    try:
        opened = open_checked(path, vocab_size=cur.vocab_size)
        given, _ = model_config_from_args(opened.ckpt.args) if opened.ckpt.args.get("vocab_size") else (None, None)
        errors = []
        if given is not None and given.vocab_size != cur.vocab_size:
            errors.append(f"vocabulary: checkpoint {given.vocab_size}, this run {cur.vocab_size}")
        for f, a, b in architecture_differences(dataclasses.asdict(opened.cfg), dataclasses.asdict(cur),
                                                skip=("vocab_size",)):
            errors.append(f"{_flag(f)}: checkpoint {a}, this run {b}")
        if errors:
            raise CheckpointError(f"{opened.describe()} does not fit this model (nothing was loaded): "
                                  + "; ".join(errors) + " (tools/checkpoint_util.py import-megatron prints the flags)")
        for f in _ADVISORY_FIELDS:
            a, b = getattr(opened.cfg, f), getattr(cur, f)
            if a != b:
                messages.append(f"model config {f} differs: checkpoint {a}, this run {b} (weights load; numerics "
                                "follow this run's value)")
    except CheckpointError as e:
        problem = str(e)
    except OSError as e:
        problem = f"cannot read Megatron-LM checkpoint {path}: {e}"
    seen = [p for p in _all_gather_object(problem) if p]
    if seen:
        raise CheckpointError(seen[0] + "; nothing was loaded")

    table = sources(cur)
    requests, targets = {}, []
    for name, p in model.named_parameters():
        key = _canonical(name, p)
        if key not in table:
            raise CheckpointError(f"parameter {key} of this model has no place in a Megatron-LM checkpoint")
        gs, go = _tp_box(p, tp, tp_rank)
        piece = _cut(torch.empty(p.shape, dtype=p.dtype), gs, go, getattr(p, "unpadded_rows", None))
        targets.append((p, piece))
        if piece is not None:
            requests[f"{key}@{name}"] = (table[key], piece.offset, piece.tensor)
    # requests are keyed 'stored name@parameter name': a tied copy on a last stage reads the embedding's box
    shapes = {rkey: opened.expected[rkey.split("@", 1)[0]][1] for rkey in requests}
    rows = {rkey: swiglu_rows(rkey.split("@", 1)[0], cur) for rkey, (src, _, _) in requests.items()
            if src.part is not None}
    distributed = dist.is_available() and dist.is_initialized()
    opened.ckpt.read(requests, shapes, rows, no_dist=not distributed)
    with torch.no_grad():
        for p, piece in targets:
            if piece is None:
                p.zero_()
                continue
            rows_here = piece.tensor.shape[0] if piece.tensor.dim() else None
            if rows_here is not None and rows_here < p.shape[0]:
                p[:rows_here].copy_(piece.tensor)
                p[rows_here:].zero_()
            else:
                p.copy_(piece.tensor)
    if optimizer is not None and hasattr(optimizer, "reload_master_from_model"):
        optimizer.reload_master_from_model()
    lay = _layout(ctx, optimizer, model)
    say(f"loaded {opened.describe()} into {describe_layout(lay)}: weights only, as --finetune (fresh optimizer, "
        "iteration 0, data from the start); Megatron-LM's optimizer state is not carried (it is laid out by "
        "Megatron's own gradient buckets and model chunks)", False)
    for m in opened.notes + messages:
        say(m, True)
    saved = {"megatron_format": opened.ckpt.format, "tp": opened.ckpt.args.get("tensor_model_parallel_size"),
             "pp": opened.ckpt.args.get("pipeline_model_parallel_size"), "iteration": opened.ckpt.iteration}
    return LoadResult(path=opened.ckpt.path, iteration=0, consumed_samples=0, wandb_run_id=None, args=None,
                      saved_layout=saved, loaded_optimizer=False, loaded_rng=False, finetune=True,
                      messages=opened.notes + messages)

