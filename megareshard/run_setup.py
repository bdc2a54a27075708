"""A run's job around the trainer: the device, the process group, the parallel context and where ranks sit, the
memory each stage measured, the forward/backward of one process, the pipeline runtime of a model spec, and one
verdict every rank agrees on. The `Trainer` (``training.py``) and ``pretrain`` use these; the lab's tools too
(re-exported by ``training``).
"""
from __future__ import annotations

import os
import resource
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError
from .config import Config
from .config.moe import moe_layer_pattern
from .config_fields import ConfigError
from .launch import RankInfo, preflight_rendezvous
from .memory import MemoryReport
from .model_spec.protocol import ModelSpec
from .parallel import CommVolume, ParallelContext, StageTopology, Topology, nccl_check, parse_stage_layouts
from .pipeline.runtime import PipelineRuntime
from .run_plan import data_parallel_size

__all__ = ["pick_device", "init_distributed", "build_context", "peak_memory_mb", "peak_memory_per_stage",
           "memory_per_stage", "forward_backward", "build_pipeline", "agreed"]


def pick_device(requested: str | None) -> torch.device:
    """cuda when available unless told otherwise; asking for cuda without one is an error."""
    if requested == "cuda" or (requested is None and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but torch.cuda.is_available() is False")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device, preflight_timeout: float = 300.0,
                     comm_timeout: float = 600.0) -> tuple[int, list[RankInfo]]:
    """Initialise torch.distributed from torchrun's environment (nccl on GPU, gloo on CPU) through the
    pre-flight rendezvous: missing ranks are named within ``preflight_timeout`` instead of hanging.
    Returns the world size and every rank's (host, local rank, pid)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    infos: list[RankInfo] = []
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        infos = preflight_rendezvous("nccl" if device.type == "cuda" else "gloo", preflight_timeout, comm_timeout)
        nccl_check.maybe_install()  # MEGARESHARD_NCCL_CHECK=DIR: NCCL's rules checked on every operation
    return world, infos


def _moe_share(m) -> float:
    """The share of the model's layers that are MoE layers (`--moe-layer-freq`)."""
    pattern = moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    return sum(pattern) / max(1, len(pattern))


def build_context(cfg: Config, world_size: int) -> tuple[ParallelContext, str]:
    """The ParallelContext for this run and a line saying how ranks were placed and why."""
    nproc = cfg.parallel.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    m, t = cfg.model, cfg.training
    ep, etp = cfg.parallel.expert_model_parallel_size, cfg.parallel.expert_tensor_parallel_size
    if cfg.parallel.stage_layouts:  # every stage its own (tp, dp), on consecutive rank blocks
        stopo = StageTopology(world_size, parse_stage_layouts(cfg.parallel.stage_layouts), nproc_per_node=nproc)
        if world_size == 1:
            return ParallelContext.single_process(), stopo.describe()
        if m.num_experts is None:
            return ParallelContext.create(stopo), f"{stopo.describe()}; given by --stage-layouts"
        # MoE: each stage's expert grid over its own ranks (etp None: the stage's tp)
        ctx = ParallelContext.create(stopo, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        return ctx, (f"{stopo.describe()}; given by --stage-layouts; experts: ep {ep}, etp "
                     f"{etp if etp is not None else 'each stage tp'}")
    moe = m.num_experts is not None and ep > 1
    volume = CommVolume.for_gpt(m.hidden_size, m.seq_length, t.micro_batch_size, tp=cfg.tp,
                                dp=data_parallel_size(cfg, world_size), pp=cfg.pp, ep=ep if moe else 1,
                                topk=m.moe_router_topk if moe else 0,
                                moe_share=_moe_share(m) if moe else 0.0)
    order = cfg.parallel.rank_order or volume.order()
    why = "given by --rank-order" if cfg.parallel.rank_order else f"chosen by {volume.describe()}"
    experts = m.num_experts is not None and (ep > 1 or (etp is not None and etp != cfg.tp))
    if experts and not cfg.parallel.rank_order and isinstance(order, (tuple, list)) and \
            list(order).index("dp") < list(order).index("tp"):   # expert groups read tp inside dp (Megatron's tp-dp)
        order = tuple(a for a in order if a != "dp")
        order = order[:order.index("tp") + 1] + ("dp",) + order[order.index("tp") + 1:]
        why += ", with tp kept inside dp for the expert groups"
    topo = Topology(world_size, tp=cfg.tp, pp=cfg.pp, nproc_per_node=nproc, order=order)
    if world_size == 1:
        return ParallelContext.single_process(), topo.describe()
    if m.num_experts is None:
        return ParallelContext.create(topo), f"{topo.describe()}; order {why}"
    ctx = ParallelContext.create(topo, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return ctx, (f"{topo.describe()}; order {why}; experts: ep {ctx.ep_size} × etp {ctx.etp_size} × edp "
                 f"{ctx.edp_size}")


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory: allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def peak_memory_per_stage(ctx: ParallelContext, device: torch.device) -> list[float]:
    """Peak memory (MiB) of every pipeline stage, MAX over the stage's ranks — on every rank.

    One MAX all-reduce over the world of a pp-long vector holding this rank's peak in its
    stage's slot (the first stage usually runs out first: it holds the most activations).
    """
    if not (dist.is_initialized() and ctx.world_size > 1):  # nothing to reduce: host values, no device read
        return [round(peak_memory_mb(device), 1) if s == ctx.pp_rank() else 0.0 for s in range(ctx.pp_size)]
    vec = torch.zeros(ctx.pp_size, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    vec[ctx.pp_rank()] = peak_memory_mb(device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return [round(v, 1) for v in vec.tolist()]


def memory_per_stage(ctx: ParallelContext, report: MemoryReport, device: torch.device) -> list[MemoryReport]:
    """Every stage's memory breakdown, each field the MAX over that stage's ranks — on every rank."""
    fields = ("params", "grads", "optimizer", "activations")
    mat = torch.zeros(ctx.pp_size, len(fields), dtype=torch.float64, device=device)
    mat[ctx.pp_rank()] = torch.tensor([float(getattr(report, f)) for f in fields], dtype=torch.float64)
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(mat, op=dist.ReduceOp.MAX)
    return [MemoryReport(*(int(v) for v in row)) for row in mat.tolist()]


def forward_backward(model: torch.nn.Module, microbatches: list[dict[str, torch.Tensor]], device: torch.device,
                     autocast_dtype: torch.dtype | None = None, backward: bool = True,
                     scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                     spec: ModelSpec) -> torch.Tensor:
    """Run the microbatches through the whole model; returns this rank's mean loss (detached).

    ``spec.forward_step`` gives each microbatch's share of the loss (for the language models its
    mean token loss divided by the number of microbatches), so the gradients accumulate to those
    of the mean over this rank's share of the global batch. ``scale_loss`` (fp16 loss scaling)
    multiplies the loss that backward starts from.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    n = len(microbatches)
    for mb in microbatches:
        loss = spec.forward_step(model, mb, device, num_microbatches=n, autocast_dtype=autocast_dtype)
        if backward:
            (scale_loss(loss) if scale_loss is not None else loss).backward()
        total += loss.detach()
    return total


def build_pipeline(spec: ModelSpec, cfg: Config, ctx: ParallelContext, layouts: Sequence[Any], *,
                   finalize_grads: Callable[[], None] | None = None, record_trace: bool = False,
                   dtype: torch.dtype = torch.float32) -> PipelineRuntime:
    """The pipeline runtime of a model spec: its stage graph, its edges' declared tensors and its forward step
    (the spec reads the model's config), everything else from the resolved plan (``cfg.plan.pipeline``).

    Every edge carries the global microbatch (``PipelinePlan.edge_batch``), whatever the two stages' layouts:
    each end shards it over its own dp. Collective over the default group: every rank calls it with the same
    config. ``layouts`` has one entry per stage (``pp × V`` with virtual stages)."""
    plan = cfg.plan.pipeline
    return PipelineRuntime.from_edges(ctx, spec.graph(cfg, layouts), layouts,
                                      spec.edge_tensors(cfg, layouts, batch=plan.edge_batch, dtype=dtype), plan,
                                      forward_step=spec.forward_step, finalize_grads=finalize_grads,
                                      record_trace=record_trace)


def agreed(ctx: ParallelContext, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0, its result (or its ConfigError / CheckpointError, raised) on every rank: one
    verdict even where the ranks' views of a file system could differ."""
    verdict: tuple[Any, Any] = (None, None)
    if ctx.rank == 0:
        try:
            verdict = (decide(), None)
        except (ConfigError, CheckpointError) as e:
            verdict = (None, (type(e) is ConfigError, str(e)))
    if dist.is_initialized() and ctx.world_size > 1:
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    if verdict[1] is not None:
        raise (ConfigError if verdict[1][0] else CheckpointError)(verdict[1][1])
    return verdict[0]
