"""``--auto-layout``: the trainers ask the planner for tp, pp, micro batch, schedule, resharding strategy,
sequence parallelism, recomputation and ZeRO, before anything is validated or built.

The model comes from the model flags, the cluster from the launch (world size, processes per
host) and the device (its memory), plus the ``--auto-layout-*`` flags for what cannot be
measured at start-up (FLOP/s, network), or ``--auto-layout-cluster FILE``: the cluster JSON that
``tools/calibrate_cluster.py`` measured. Every registered schedule is a candidate (the runtime executes
each); the start-up line names any the config cannot carry the virtual stages of. Planning is pure and
deterministic, so every rank chooses the same layout without communicating. Degrees given by hand are
refused next to ``--auto-layout`` rather than silently overridden.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from ..config_fields import ConfigError
from .costs import ClusterSpec, ModelShape
from ..pipeline.schedules import get_schedule, schedule_names
from .cluster_file import load_cluster
from .search import PlanError, plan_layouts

__all__ = ["apply_auto_layout", "device_memory_gib"]


def device_memory_gib(nproc_per_node: int) -> float:
    """Memory of one device: the GPU's, or on CPU the host's RAM shared by its processes."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / max(1, nproc_per_node)


def apply_auto_layout(cfg: Any, world_size: int) -> tuple[Any, str]:
    """A copy of `cfg` whose layout flags are the planner's best layout, and the start-up line (`cfg` is left as
    it is)."""
    cfg = copy.deepcopy(cfg)
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
                       learned_positions=m.position_embedding_type == "learned_absolute",
                       dtype_bytes=2 if (mem.bf16 or mem.fp16) else 4)
    if p.auto_layout_cluster:
        clash = [f for f, v, default in (("--auto-layout-device-tflops", p.auto_layout_device_tflops, 989.0),
                                         ("--auto-layout-nic-gbps", p.auto_layout_nic_gbps, 100.0),
                                         ("--auto-layout-intra-gbps", p.auto_layout_intra_gbps, 3600.0))
                 if v != default]
        if clash:
            raise ConfigError(f"--auto-layout-cluster {p.auto_layout_cluster} gives the measured speeds; drop "
                              f"{', '.join(clash)}")
        try:
            cluster = load_cluster(p.auto_layout_cluster, hosts=world_size // nproc, devices_per_host=nproc)
        except ValueError as e:
            raise ConfigError(f"--auto-layout-cluster: {e}") from None
        memory = p.auto_layout_device_memory_gib or cluster.device_memory_gib
        cluster = dataclasses.replace(cluster, device_memory_gib=memory)
        source = f"measured cluster {p.auto_layout_cluster}"
    else:
        memory = p.auto_layout_device_memory_gib or device_memory_gib(nproc)
        cluster = ClusterSpec(world_size // nproc, nproc, memory, p.auto_layout_device_tflops,
                              nic_gbps=p.auto_layout_nic_gbps, intra_gbps=p.auto_layout_intra_gbps)
        source = "--auto-layout-* flags"
    # virtual-stage kinds need the config to carry their V
    holder = next(((o, f) for o in (pl, p) for f in ("num_layers_per_virtual_pipeline_stage",
                                                     "num_virtual_stages_per_pipeline_rank") if hasattr(o, f)), None)
    names = [n for n in schedule_names() if get_schedule(n).stages_per_mesh is not None or holder]
    skipped = [n for n in schedule_names() if n not in names]
    stats: dict[str, int] = {}
    mbs = [b for b in (1, 2, 4, 8, 16) if t.global_batch_size % b == 0]
    try:
        best = plan_layouts(model, cluster, t.global_batch_size, micro_batches=mbs, schedules=names,
                            runtime_only=True, stats=stats)[0]
    except PlanError:  # nothing fits with ZeRO 0-2: shard the parameters too (slower per step, never chosen else)
        try:
            stats.clear()
            best = plan_layouts(model, cluster, t.global_batch_size, micro_batches=mbs, schedules=names,
                                runtime_only=True, stats=stats, zero_stages=(0, 1, 2, 3))[0]
        except PlanError as e:
            raise ConfigError(f"--auto-layout: {e}") from None
    if best.stage_layouts:
        p.stage_layouts = best.stage_layouts
        p.tensor_model_parallel_size = 1
    else:
        p.tensor_model_parallel_size, p.rank_order = best.tp, best.order
    p.pipeline_model_parallel_size = best.pp
    p.sequence_parallel = best.sequence_parallel
    pl.num_layers_per_stage = ",".join(map(str, best.layers_per_stage)) if best.layers_per_stage else None
    if best.virtual_stages > 1 and get_schedule(best.schedule).stages_per_mesh is None and holder:
        obj, name = holder  # Megatron's flag for V: layers per virtual stage, or virtual stages per rank
        setattr(obj, name, m.num_layers // (best.pp * best.virtual_stages) if name.startswith("num_layers")
                else best.virtual_stages)
    t.micro_batch_size = best.micro_batch
    pl.pipeline_schedule, pl.reshard_strategy = best.schedule, best.strategy
    pl.delay_wgrad_compute = best.delay_wgrad and not get_schedule(best.schedule).zero_bubble
    mem.zero_stage = best.zero
    if best.recompute:
        mem.recompute_granularity = "full"
    return cfg, (f"auto layout: {best.name} — predicted {best.step_s:.3g} s/step on {cluster.hosts} host(s) × {nproc}, "
            f"{memory:.1f} GiB per device, from {source} ({stats['enumerated']} candidates, {stats['pruned_memory']} "
            f"pruned by memory, {stats['simulated']} pipelines simulated; schedules applied: {', '.join(names)}"
            f"{'; not applied (no flag carries their virtual stages): ' + ', '.join(skipped) if skipped else ''})"
            f"; same as: {best.flags(m.num_layers)}")
