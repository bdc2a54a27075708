"""`PipelineConfig`: the schedule and stage-boundary resharding flags (Megatron-LM's names where it has them;
parsed by `arguments`). A configuration type: its choices name the registries, it imports none of them."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import config_field as _f, registry_choices

schedule_names = registry_choices("megareshard.pipeline.schedules", "schedule_names")
strategy_names = registry_choices("megareshard.resharding.strategies", "strategy_names")
scheduler_names = registry_choices("megareshard.resharding.schedulers", "scheduler_names")


@dataclass
class PipelineConfig:
    """Pipeline schedule and the cross-mesh resharding of stage boundaries."""

    pipeline_schedule: str = _f("1f1b", "pipeline schedule (the registry's names; with virtual stages 1f1b and "
                                        "eager-1f1b run as their interleaved kinds)", choices=schedule_names)
    delay_wgrad_compute: bool = _f(False, "split backward into input-grad now and weight-grad later (fills waits)")
    num_layers_per_stage: str | None = _f(None, "comma list of layers per pipeline stage, one per virtual stage "
                                                "with virtual stages (default: even split)")
    num_layers_per_virtual_pipeline_stage: int | None = _f(None, "layers per virtual pipeline stage (Megatron-LM): "
                                                                 "virtual stages per rank = layers / pp / this")
    virtual_pipeline_model_parallel_size: int | None = _f(None, "virtual pipeline stages (model chunks) per "
                                                                "pipeline rank (Megatron-LM's older name)")
    num_virtual_stages_per_pipeline_rank: int | None = _f(None, "virtual pipeline stages (model chunks) per pipeline "
                                                                "rank (Megatron-LM's current name of the above)")
    reshard_strategy: str = _f("broadcast", "how tensors cross stages (the registered resharding strategies)",
                               choices=strategy_names)
    reshard_scheduler: str = _f("auto", "how resharding tasks are ordered and assigned to sender hosts",
                                choices=scheduler_names)
    reshard_chunks: int | None = _f(None, "chunks per pipelined broadcast task (default: chosen per task by the "
                                          "network model)")
    pipeline_trace: str | None = _f(None, "write the measured timeline of the last iteration (JSON) here, "
                                          "for tools/plot_schedule.py --trace; it also holds every stage's "
                                          "measured and simulated peak activations (MEMORY records)")
    pipeline_recv_posting: str = _f("auto", "when a stage posts its receives: early (at the lowering's RECV, gloo "
                                            "only), grouped (with the last send to the same peer before the wait, "
                                            "one group, as torch's 1F1B exchanges; a schedule that would hang so "
                                            "under NCCL's ordering is refused at start-up), mixed (grouped where "
                                            "NCCL's ordering allows it, a communicator per direction with early "
                                            "receives elsewhere); auto: mixed on NCCL, early on gloo",
                                    choices=("auto", "early", "grouped", "mixed"))
    pipeline_schedule_file: str | None = _f(None, "run the schedule written in this file (the schedule IR's text "
                                                  "form, or CSV if it ends in .csv: one row per stage, one action "
                                                  "per cell); validated at start-up; excludes --pipeline-schedule")
