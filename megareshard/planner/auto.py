"""``--auto-layout``: the trainers ask the planner for tp, pp, micro batch, schedule, resharding strategy,
sequence parallelism, recomputation and ZeRO, before anything is validated or built.

The model comes from the model flags, the cluster from the launch (world size, processes per
host) and the device (its memory), plus the ``--auto-layout-*`` flags for what cannot be
measured at start-up (FLOP/s, network). Planning is pure and deterministic, so every rank
chooses the same layout without communicating. Degrees given by hand are refused next to
``--auto-layout`` rather than silently overridden.
"""
from __future__ import annotations

import os
from typing import Any

from ..config_fields import ConfigError
from .costs import ClusterSpec, ModelShape
from .search import PlanError, plan_layouts

__all__ = ["apply_auto_layout", "device_memory_gib"]


def device_memory_gib(nproc_per_node: int) -> float:
    """Memory of one device: the GPU's, or on CPU the host's RAM shared by its processes."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / max(1, nproc_per_node)


def apply_auto_layout(cfg: Any, world_size: int) -> str:
    """Set the layout flags of `cfg` from the planner's best layout; returns the start-up line."""
    p, pl, t, mem, m = cfg.parallel, cfg.pipeline, cfg.training, cfg.memory, cfg.model
    given = [f for f, v, default in (("--tensor-model-parallel-size", p.tensor_model_parallel_size, 1),
                                     ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size, 1),
                                     ("--stage-layouts", p.stage_layouts, None), ("--rank-order", p.rank_order, None),
                                     ("--sequence-parallel", p.sequence_parallel, False),
                                     ("--num-layers-per-stage", pl.num_layers_per_stage, None)) if v != default]
    if given:
        raise ConfigError(f"--auto-layout chooses the layout itself; drop {', '.join(given)} (or drop --auto-layout)")
    if t.global_batch_size is None:
        raise ConfigError("--auto-layout needs --global-batch-size (the planner splits it into micro batches × dp)")
    if m.vocab_size is None:
        raise ConfigError("--auto-layout needs --vocab-size (the planner costs the embedding and the logits)")
    nproc = p.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % nproc:
        raise ConfigError(f"world size {world_size} is not a multiple of {nproc} processes per host")
    model = ModelShape(m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size,
                       ffn_hidden_size=m.ffn_hidden_size,
                       num_query_groups=m.num_query_groups if m.group_query_attention else None, swiglu=m.swiglu,
                       untied=m.untie_embeddings_and_output_weights,
                       learned_positions=m.position_embedding_type == "learned_absolute")
    memory = p.auto_layout_device_memory_gib or device_memory_gib(nproc)
    cluster = ClusterSpec(world_size // nproc, nproc, memory, p.auto_layout_device_tflops,
                          nic_gbps=p.auto_layout_nic_gbps, intra_gbps=p.auto_layout_intra_gbps)
    stats: dict[str, int] = {}
    mbs = [b for b in (1, 2, 4, 8, 16) if t.global_batch_size % b == 0]
    try:
        best = plan_layouts(model, cluster, t.global_batch_size, micro_batches=mbs,
                            stats=stats)[0]
    except PlanError as e:
        raise ConfigError(f"--auto-layout: {e}") from None
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = best.tp, best.pp
    p.sequence_parallel, p.rank_order = best.sequence_parallel, best.order
    t.micro_batch_size = best.micro_batch
    pl.pipeline_schedule, pl.delay_wgrad_compute, pl.reshard_strategy = best.schedule, best.delay_wgrad, best.strategy
    mem.zero_stage = best.zero
    if best.recompute:
        mem.recompute_granularity = "full"
    return (f"auto layout: {best.name} — predicted {best.step_s:.3g} s/step on {cluster.hosts} host(s) × {nproc}, "
            f"{memory:.1f} GiB per device ({stats['enumerated']} candidates, {stats['pruned_memory']} pruned by "
            f"memory, {stats['simulated']} pipelines simulated); same as: {best.flags()}")
