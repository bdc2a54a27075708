"""The load side of ``CheckpointManager``: validate a checkpoint against this run, then read and apply it.

``load_checkpoint`` is what ``CheckpointManager.load`` runs (collective over the world): every rank checks
the files (``_agreed_precheck``), the model configuration (``ARCHITECTURE_FIELDS`` must match, the advisory
fields only warn), the keys and the global shapes before any state is touched; then it reads its pieces into
fresh buffers, reports what a layout change cannot carry over exactly (RNG, data order), and applies them.
What loads exactly across a layout change is in ``manager.py``'s docstring.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..config.moe import moe_layer_pattern
from ..tensor_parallel.random import RNGStreams
from .format import (CheckpointError, Piece, check_files, read_info, read_metadata, read_pieces,
                     resolve_checkpoint_dir, verify_checksum_share)
from .state import (_all_gather_object, _canonical, _cut, _distributed, _layout, _loss_scaler, _model_box,
                    _optimizer_entries, _param_shards, _sizes, describe_layout, dp_changed, model_key, optim_key,
                    stage_layouts_of)

__all__ = ["load_checkpoint", "LoadResult", "ARCHITECTURE_FIELDS", "MOE_ARCHITECTURE_FIELDS", "moe_architecture",
           "architecture_differences"]


# model-config fields that change a tensor's shape or meaning: a mismatch is an error
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                       "max_position_embeddings", "normalization", "position_embedding_type", "rotary_base",
                       "rotary_percent", "swiglu", "openai_gelu", "group_query_attention", "num_query_groups",
                       "kv_channels", "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias",
                       "apply_layernorm_1p", "qk_layernorm")
# architecture fields that checkpoints written before them lack: their value then
_LATER_FIELD_DEFAULTS = {"apply_layernorm_1p": False, "qk_layernorm": False}
# the mixture-of-experts shape (``moe_architecture``: compared normalised; a configuration without them is dense)
MOE_ARCHITECTURE_FIELDS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size",
                           "moe_shared_expert_intermediate_size")


def moe_architecture(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts shape of a model configuration (its fields as a dict), normalised so that equal
    models compare equal: the MoE layers as one 0/1 per layer (``--moe-layer-freq 2`` = ``[1,0,1,0]``), each
    expert's width resolved (``--moe-ffn-hidden-size`` defaults to ``--ffn-hidden-size``); {} for a dense model."""
    if cfg.get("num_experts") is None:
        return {}
    return {"num_experts": cfg["num_experts"],
            "moe_layer_freq": moe_layer_pattern(cfg.get("moe_layer_freq", 1), cfg["num_layers"]),
            "moe_ffn_hidden_size": cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
            "moe_shared_expert_intermediate_size": cfg.get("moe_shared_expert_intermediate_size")}


def architecture_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                             skip: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """(field, saved value, this run's) for every architecture field that differs: ``ARCHITECTURE_FIELDS`` both
    configurations hold (less ``skip``), then the MoE shape (a differing expert count alone, the rest following)."""
    out = [(f, saved[f], current[f]) for f in ARCHITECTURE_FIELDS
           if f not in skip and f in saved and f in current and saved[f] != current[f]]
    a, b = moe_architecture(saved), moe_architecture(current)
    if a.get("num_experts") != b.get("num_experts"):
        return out + [("num_experts", a.get("num_experts"), b.get("num_experts"))]
    return out + [(f, a[f], b[f]) for f in MOE_ARCHITECTURE_FIELDS if a.get(f) != b.get(f)]
# fields that only change numerics / the data: a mismatch is a warning
_ADVISORY_FIELDS = ("seq_length", "hidden_dropout", "attention_dropout", "init_method_std", "norm_epsilon")


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


def load_checkpoint(ctx, root: str, *, model, optimizer=None, scheduler=None, sampler=None, config=None,
                    finetune: bool = False, no_load_optim: bool = False, no_load_rng: bool = False,
                    say: Callable[..., None]) -> LoadResult:
    """What ``CheckpointManager.load`` runs once a background save is done (see it for the arguments);
    ``ctx``: the parallel context, ``say(line, warning=False)``: the manager's report (rank 0)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # DCP loads with the first load

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
        for f, a, b in architecture_differences(saved_cfg, cur_cfg):
            errors.append(f"model config {f}: checkpoint {a}, this run {b}")
        for f in _ADVISORY_FIELDS if not finetune else ():   # a fine-tune chooses its own (no one to warn)
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
    say(f"loaded {ckpt} (iteration {common.get('iteration')}, saved in {describe_layout(sl)}) into "
              f"{describe_layout(cur_layout)}: {what}")
    for m in messages:
        say(m, warning=True)
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
