"""Live weight transfer, the public API (issue #50): a running trainer's weights to generator replicas in other
layouts, planned by the resharding library (`resharding/weight_transfer/`), after every step if you like.

    from megareshard.transfer import Destination, WeightTransfer

    # every rank of `group` (trainer ranks and generator ranks; default: the world) calls, in the same order:
    wt = WeightTransfer([Destination("gen_tp2", ranks=(4, 5), tp=2), Destination("gen_tp1", ranks=(6,), tp=1)],
                        model=trainer.model, ctx=trainer.ctx, optimizer=trainer.optimizer,   # None on generators
                        group=group, bucket_mb=64)
    print(wt.plan.describe())                 # rank 0, say
    report = wt.run(into=generator_model)     # trainer ranks: wt.run(); a generator: fills its GPTModel
    pairs = wt.hf_pairs()                     # or: [(hugging_face_name, tensor)] for vLLM's/SGLang's load_weights

* **Sources** are read from the model as a checkpoint saves it (`checkpoint/state.py`): each parameter's tp
  slice — at ZeRO-3 the rank's row shard, the only copy it holds — with the vocabulary padding cut, under its
  global name; the tied output-layer copy of a last pipeline stage is skipped (it is the word embedding). Model
  chunks (virtual stages) and per-stage layouts come for free: only the boxes matter.
* **Construction** is collective over ``group``: one object all-gather of every rank's boxes, host and model
  configuration (a generator needs to know nothing of the trainer), the same pure plan on every rank (cached:
  rebuilding after a layout change, a resume or another bucket size plans anew only when something changed),
  one all-gather that checks every rank holds the same plan.
* **run** is one call on every rank of ``group``; it returns the report (bytes, seconds of the slowest rank,
  effective rate, the network model's lower bound and the fraction of it reached). ``into``: a destination
  rank's GPTModel built at its destination layout, filled exactly as a checkpoint of the same weights loads
  into that layout (padding rows zero). Without it the received tensors stay in ``received`` (global name ->
  this rank's box) and `hf_pairs` hands them out under Hugging Face names and layouts (a tp > 1 rank gets its
  shard of each: ``q_proj`` rows of its heads, ``o_proj`` columns, ...; GPT-2's ``c_attn`` its q|k|v columns).
* The group is the caller's; plan ranks are ranks of that group; the trainer's own groups are never used. Nothing
  else may use ``group`` during ``run``.

**Generators in another job** (an RL framework's inference workers): both jobs join a transfer group through a
rendezvous of their own, the trainer's ranks first; every member then builds the `WeightTransfer` on it::

    from megareshard.transfer import join_transfer_group, leave_transfer_group

    # trainer job, each of its T ranks (its own world untouched):
    group = join_transfer_group("trainer-0", 29700, rank=dist.get_rank(), world_size=T + G, timeout=300)
    # generator job, each of its G ranks (its own world, or none at all):
    group = join_transfer_group("trainer-0", 29700, rank=T + gen_rank, world_size=T + G, timeout=300)
    wt = WeightTransfer([Destination("vllm", ranks=tuple(range(T, T + G)), tp=G)], ..., group=group)
    wt.run()  /  wt.run(into=model)           # trainer / generator (its GPTModel on its own tp group), every step
    leave_transfer_group(group)               # every member, after its last transfer

The group is made on a ``TCPStore`` of its own (rank 0 serves it on ``host:port``), gloo or NCCL (``backend``),
and is not registered in torch's world: ``dist.get_world_size()`` and every group each job has stay as they were,
and a process with no default group can join (`resharding/weight_transfer/group.py` says how and why). Under
``MEGARESHARD_NCCL_CHECK=DIR`` its operations are recorded in ``DIR/group-<name>/`` in transfer-group ranks.

**A member that dies** (or stops answering) fails every other member's `run` with `TransferFailed` (naming its rank
and the step, or the final all-reduce): at once where it talks to the dead rank, within the group's ``timeout``
otherwise (a joined group's is `join_transfer_group`'s; gloo keeps a failed member's connections open until its
process ends). The sources were only read, and the callers' own groups are untouched: a trainer can carry on, and
join a new group with the generators that are left.
"""
from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .checkpoint.state import _canonical, _cut, _model_box, _param_shards
from .config.moe import expert_width
from .models.config import ModelConfig
from .models.hf import hf_model_type, state_dict_to_hf
from .resharding.network import NetworkModel
from .resharding.weight_transfer import (Box, ParamInfo, Replica, TransferExecutor, TransferPlan, layout_boxes,
                                         plan_weight_transfer)
from .resharding.weight_transfer.execute import TransferFailed
from .resharding.weight_transfer.group import group_rank, join_transfer_group, leave_transfer_group

__all__ = ["Destination", "WeightTransfer", "TransferFailed", "source_boxes", "destination_boxes",
           "join_transfer_group", "leave_transfer_group"]


@dataclass(frozen=True)
class Destination:
    """One destination replica: its name, its ranks (of the transfer group), its layout. Ranks are placed tp
    innermost, then pp; ``layer_ranges`` the layers of each pipeline stage (default: even). An MoE model's experts
    are split inside each stage's tp ranks over ``ep`` (default 1: every rank holds all experts) and ``etp``
    (default tp, Megatron's default), as `ParallelContext.create` splits them (``ep × etp`` divides tp)."""

    name: str
    ranks: tuple[int, ...]
    tp: int = 1
    pp: int = 1
    layer_ranges: tuple[tuple[int, int], ...] | None = None
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        """The expert-tensor-parallel size in force (``etp``, default tp)."""
        return self.tp if self.etp is None else self.etp


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def source_boxes(model: torch.nn.Module, ctx, optimizer=None) -> tuple[list[ParamInfo], list[Box],
                                                                       dict[str, torch.Tensor]]:
    """This rank's parameters (global name, unpadded global shape, dtype, tp dim), the boxes it holds and the
    tensors holding them (views, no copy), read as a checkpoint saves them."""
    tp, tp_rank = ctx.tp_size, ctx.tp_rank()
    shards = _param_shards(optimizer)
    infos, boxes, tensors = [], [], {}
    for name, p in model.named_parameters():
        if _canonical(name, p) != name:
            continue
        t, gs, go = _model_box(p, shards, tp, tp_rank)
        rows = getattr(p, "unpadded_rows", None)
        shape = (rows, *tuple(gs)[1:]) if rows is not None else tuple(gs)
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
        expert = getattr(p, "expert_width_dim", None) if getattr(p, "expert_parallel", False) else None
        if expert is not None:   # described layout-independently: [E, ...], the dim etp splits (boxes.py)
            dim = -1
        infos.append(ParamInfo(name, tuple(int(s) for s in shape), _dtype_name(t), int(dim), rows is not None,
                               None if expert is None else int(expert)))
        piece = _cut(t.detach(), gs, go, rows)
        if piece is None:
            continue
        region = tuple((int(o), int(o) + int(s)) for o, s in zip(piece.offset, piece.tensor.shape))
        boxes.append(Box(name, region))
        tensors[name] = piece.tensor
    return infos, boxes, tensors


def _check_destination(d: Destination, cfg: ModelConfig) -> None:
    heads, groups = cfg.num_attention_heads, cfg.query_groups
    if d.tp < 1 or d.pp < 1:
        raise ValueError(f"destination {d.name}: tp {d.tp} and pp {d.pp} must be >= 1")
    if heads % d.tp or groups % d.tp:
        raise ValueError(f"destination {d.name}: tensor-parallel size {d.tp} does not divide num_attention_heads "
                         f"{heads} and num_query_groups {groups}")
    if len(d.ranks) != d.tp * d.pp:
        raise ValueError(f"destination {d.name}: tp {d.tp} × pp {d.pp} needs {d.tp * d.pp} ranks, got "
                         f"{len(d.ranks)} ({list(d.ranks)})")
    if d.pp > cfg.num_layers:
        raise ValueError(f"destination {d.name}: pp {d.pp} exceeds the model's {cfg.num_layers} layers")
    ep, etp = d.ep, d.expert_tp
    if ep < 1 or etp < 1:
        raise ValueError(f"destination {d.name}: ep {ep} and etp {etp} must be >= 1")
    if cfg.num_experts is None:
        if ep != 1 or d.etp is not None:
            raise ValueError(f"destination {d.name}: ep {ep} / etp {etp} given but the model has no experts")
        return
    f = expert_width(cfg)
    if d.tp % (ep * etp):
        raise ValueError(f"destination {d.name}: ep {ep} × etp {etp} = {ep * etp} does not divide its tp {d.tp} (the "
                         f"experts are split inside each stage's tp ranks; e.g. ep {ep} with etp {d.tp // ep or 1})")
    if cfg.num_experts % ep or f % etp:
        raise ValueError(f"destination {d.name}: {cfg.num_experts} experts of width {f} cannot be split over ep {ep} "
                         f"× etp {etp}")


def destination_boxes(d: Destination, params: Sequence[ParamInfo], cfg: ModelConfig) -> dict[int, list[Box]]:
    """The boxes each rank of destination ``d`` needs: a GPTModel of ``cfg`` at (tp, pp) on its ranks, its experts
    at (ep, etp) (a context of ``ParallelContext.create(Topology(tp · pp, tp=tp, pp=pp), expert_model_parallel_size=ep,
    expert_tensor_parallel_size=etp)``)."""
    _check_destination(d, cfg)
    return layout_boxes(params, list(d.ranks), tp=d.tp, pp=d.pp, divisible_by=cfg.make_vocab_size_divisible_by,
                        num_layers=cfg.num_layers, tied=cfg.tied_embeddings, layer_ranges=d.layer_ranges, ep=d.ep,
                        etp=d.expert_tp)


def _model_cfg(model) -> ModelConfig | None:
    if model is None:
        return None
    cfg = getattr(model, "cfg", None)
    if cfg is None and hasattr(model, "chunks"):
        cfg = getattr(next(iter(model.chunks.values())), "cfg", None)
    return cfg


class WeightTransfer:
    """A planned transfer from the source ranks' model to ``destinations``; collective construction (module
    docstring). ``host_of``: rank -> host (default: each rank's host name); ``nic_gbps``: the network model's rate
    for the bound; ``allow_overlap``: destinations may use source ranks (an in-memory relayout)."""

    def __init__(self, destinations: Sequence[Destination], *, model: torch.nn.Module | None = None, ctx=None,
                 optimizer=None, group: Any = None, bucket_mb: float = 64.0, host_of: dict[int, int] | None = None,
                 strategy: str = "auto", scheduler: str = "loadbalance", allow_overlap: bool = True,
                 nic_gbps: float | None = None) -> None:
        if (model is None) != (ctx is None):
            raise ValueError("a source rank passes both model and ctx (a destination-only rank neither)")
        self.group = group
        self.rank = group_rank(group)
        self.destinations = list(destinations)
        mine = source_boxes(model, ctx, optimizer) if model is not None else None
        self._tensors = mine[2] if mine else {}
        cfg = _model_cfg(model)
        info = {"infos": mine[0] if mine else None, "boxes": mine[1] if mine else None, "host": socket.gethostname(),
                "cfg": dataclasses.asdict(cfg) if cfg is not None else None}
        world = dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, info, group=group)
        params: dict[str, ParamInfo] = {}
        source: dict[int, list[Box]] = {}
        cfgs = [g["cfg"] for g in gathered if g["cfg"] is not None]
        if not cfgs:
            raise ValueError("no rank of the transfer group passed a model: nothing to send")
        if any(c != cfgs[0] for c in cfgs):
            raise ValueError("the source ranks' model configurations differ")
        self.model_config = ModelConfig(**cfgs[0])
        for r, g in enumerate(gathered):
            if g["infos"] is None:
                continue
            source[r] = g["boxes"]
            for p in g["infos"]:
                if params.setdefault(p.name, p) != p:
                    raise ValueError(f"ranks disagree on parameter {p.name}: {params[p.name]} vs {p}")
        names = {g["host"] for g in gathered}
        hosts = host_of if host_of is not None else {
            r: sorted(names).index(g["host"]) for r, g in enumerate(gathered)}
        plist = sorted(params.values(), key=lambda p: p.name)
        replicas = [Replica(d.name, destination_boxes(d, plist, self.model_config)) for d in self.destinations]
        net = NetworkModel(nic_gbps) if nic_gbps is not None else None
        self.plan: TransferPlan = plan_weight_transfer(plist, source, replicas, hosts, bucket_mb=bucket_mb,
                                                       strategy=strategy, scheduler=scheduler,
                                                       allow_overlap=allow_overlap, network=net)
        self.executor = TransferExecutor(self.plan, group)
        self.received: dict[str, torch.Tensor] = {}

    def refresh_sources(self, model: torch.nn.Module, ctx, optimizer=None) -> None:
        """Read this source rank's tensors (views) from ``model`` again, for a transfer after the optimizer may
        have replaced parameter storage (ZeRO-3's shards, a resume); the plan stays (the boxes cannot change)."""
        self._tensors = source_boxes(model, ctx, optimizer)[2]

    def destination(self) -> Destination | None:
        """The destination replica this rank belongs to (None on a source-only rank)."""
        return next((d for d in self.destinations if self.rank in d.ranks), None)

    def run(self, into: torch.nn.Module | None = None) -> dict[str, Any]:
        """Move the weights (every rank of the group calls it). ``into``: this destination rank's GPTModel at its
        layout, filled in place; otherwise fresh tensors, kept in ``received``. Returns the report."""
        boxes = self.plan.dest.get(self.rank, {})
        aliases = self.plan.aliases.get(self.rank, [])
        dtypes = {p.name: p.dtype for p in self.plan.params}
        dests: dict[str, torch.Tensor] = {}
        zero: list[tuple[torch.Tensor, int | None]] = []
        if into is not None:
            if not boxes:
                raise ValueError(f"rank {self.rank} is in no destination replica but was given a model to fill")
            by_local = {b.local_name: b for b in (*boxes.values(), *aliases)}
            for name, p in into.named_parameters():
                b = by_local.get(name)
                if b is None:
                    zero.append((p, 0))          # only vocabulary padding here: zeros, as a checkpoint load
                    continue
                if _dtype_name(p) != dtypes[b.name]:
                    raise ValueError(f"rank {self.rank}: {name} is {p.dtype} but the source sends {dtypes[b.name]}")
                view = p.detach()
                for d, s in enumerate(b.shape):
                    if view.shape[d] < s:
                        raise ValueError(f"rank {self.rank}: {name} has shape {tuple(p.shape)}, smaller than its box "
                                         f"{list(b.region)}: was the model built at this destination's layout?")
                    view = view.narrow(d, 0, s)
                dests[b.local_name] = view
                if p.dim() and b.shape[0] < p.shape[0]:
                    zero.append((p, b.shape[0]))
            missing = sorted(n for n in by_local if n not in dests)
            if missing:
                raise ValueError(f"rank {self.rank}: the model to fill has no parameter {missing[0]} "
                                 f"({len(missing)} missing)")
        else:
            for n, b in boxes.items():
                dests[n] = torch.empty(b.shape, dtype=getattr(torch, dtypes[n]), device=self.executor.device)
            for b in aliases:
                dests[b.local_name] = torch.empty(b.shape, dtype=getattr(torch, dtypes[b.name]),
                                                  device=self.executor.device)
        report = self.executor.run(self._tensors, dests)
        with torch.no_grad():
            for p, rows in zero:
                p.detach()[rows or 0:].zero_()
        self.received = dests if into is None else {}
        return report

    def hf_pairs(self) -> list[tuple[str, torch.Tensor]]:
        """This destination rank's weights from the last `run` (without ``into``) as ``(hugging_face_name, tensor)``
        pairs (Llama or GPT-2 names and layouts, fp32 as `state_dict_to_hf` gives them); a tp > 1 rank gets its
        shard of each tensor. pp > 1 destinations hand out no pairs (a stage is not a loadable model). An MoE model's
        pairs are Mixtral's or Qwen3-MoE's names (`models/hf_moe.py`) and need whole experts on the rank (ep 1,
        etp 1: per-expert Hugging Face tensors have no expert-parallel or width shard)."""
        d = self.destination()
        if d is None or not self.received:
            raise ValueError(f"rank {self.rank} received no weights (not a destination, or run(into=...) was used)")
        if d.pp != 1:
            raise ValueError(f"destination {d.name} has pp {d.pp}: Hugging Face pairs need pp 1")
        cfg = self.model_config
        kind = hf_model_type(cfg)
        if cfg.num_experts is not None:
            if kind not in ("mixtral", "qwen3_moe"):
                raise ValueError(f"destination {d.name}: Hugging Face pairs of an MoE model need the Mixtral / "
                                 f"Qwen3-MoE mapping, which models/hf.py does not have here (it maps it as {kind})")
            if d.ep != 1 or d.expert_tp != 1:
                raise ValueError(f"destination {d.name}: Hugging Face pairs of an MoE model need whole experts on "
                                 f"every rank (ep 1, etp 1); it has ep {d.ep}, etp {d.expert_tp}")
        sd = {n: t for n, t in self.received.items() if n in {p.name for p in self.plan.params}}
        if d.tp > 1:
            # the rank's shard: its heads and groups, the same head width
            cfg = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // d.tp,
                                      num_query_groups=cfg.query_groups // d.tp if cfg.group_query_attention else 1,
                                      kv_channels=cfg.head_dim)
        return list(state_dict_to_hf(sd, cfg).items())
