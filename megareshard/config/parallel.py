"""`ParallelConfig`: the parallel degrees and placement flags (Megatron-LM's names; parsed by `arguments`)."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import config_field as _f


@dataclass
class ParallelConfig:
    """Degrees and placement of the parallel axes."""

    tensor_model_parallel_size: int = _f(1, "tensor-parallel degree (tp)")
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel degree (pp)")
    sequence_parallel: bool = _f(False, "shard activations along the sequence over tp between blocks")
    expert_model_parallel_size: int = _f(1, "expert-parallel degree (ep): every MoE layer's experts split over ep "
                                            "ranks taken from tp × dp (Megatron-LM's rule: ep × etp divides them)")
    expert_tensor_parallel_size: int | None = _f(None, "expert-tensor-parallel degree (etp): each expert's width split "
                                                       "over etp ranks (default: --tensor-model-parallel-size)")
    rank_order: str | None = _f(None, "placement order, innermost first, e.g. tp-dp-pp (default: by volume)")
    nproc_per_node: int | None = _f(None, "processes per host (default: torchrun's LOCAL_WORLD_SIZE)")
    stage_layouts: str | None = _f(None, "per-stage (tp, dp), one entry per pipeline stage, e.g. "
                                         "tp1dp4,tp2dp2: stage i on its own contiguous block of ranks, tp innermost; "
                                         "the global microbatch is --micro-batch-size × the largest dp")
    auto_layout: bool = _f(False, "let the layout planner choose tp, pp, micro batch, schedule, resharding "
                                  "strategy, sequence parallelism, recomputation and ZeRO (tools/plan_layout.py)")
    auto_layout_device_memory_gib: float | None = _f(None, "--auto-layout: memory per device, GiB (default: the "
                                                           "device's; on CPU the RAM per process)")
    auto_layout_device_tflops: float = _f(989.0, "--auto-layout: peak dense bf16 TFLOP/s per device")
    auto_layout_nic_gbps: float = _f(100.0, "--auto-layout: NIC bandwidth per host and direction, Gbit/s")
    auto_layout_intra_gbps: float = _f(3600.0, "--auto-layout: intra-host bandwidth per device, Gbit/s")
    auto_layout_cluster: str | None = _f(None, "--auto-layout: the cluster JSON tools/calibrate_cluster.py measured "
                                               "(FLOP/s, per-layer times, intra-host and NIC bandwidth) instead of "
                                               "the --auto-layout-* speeds")
