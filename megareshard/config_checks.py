"""Validation of a parsed configuration, once, before anything is built: every constraint with the numbers in its
message (``ConfigError``). `validate` is a function from a configuration to a new one: Megatron's derived
defaults filled in (the global batch, ``--zero-stage`` from ``--use-distributed-optimizer``, recomputation's
layer count, ...) and the resolved run plan (``.plan``, `run_plan.resolve`); the configuration it is given is
never changed. `arguments.parse_args` returns its result; a configuration built or changed in code is checked by
calling it (validating twice gives the same answer).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import warnings

from . import run_plan
from .compile_config import check_compile_config, check_compile_scope
from .config import Config
from .config.moe import check_moe_config, expert_width, grouped_gemm_refusal
from .config_fields import ConfigError
from .config.generators import trainer_world_size
from .input_checks import validate_checkpoint, validate_data, validate_deterministic, validate_schedule
from .models.config import check_model_shape, fusion_notes
from .parallel.stage_topology import parse_stage_layouts
from .parallel.topology import TopologyError, parse_order
from .pipeline.schedules import schedule_names
from .resharding.strategies import get_strategy, strategy_names


__all__ = ["validate", "resolve_virtual_stages", "SHARDING_STRATEGY_STAGE"]


def validate(cfg: Config, world_size: int) -> Config:
    """Check every constraint before anything is built, once; returns a new configuration with Megatron's derived
    defaults filled in (global batch, --zero-stage from --use-distributed-optimizer, ...) and its resolved run
    plan (``.plan``). ``cfg`` itself is left as it is (validating the result again gives the same answer)."""
    auto_layout = None if cfg.plan is None else cfg.plan.auto_layout
    if cfg.parallel.auto_layout and cfg.plan is None:
        from .planner.auto import apply_auto_layout  # the planner chooses the layout flags first (a new config)

        cfg, auto_layout = apply_auto_layout(cfg, world_size)
    cfg = copy.deepcopy(dataclasses.replace(cfg, plan=None))   # what follows fills defaults in this copy only
    m, p, t, d, lg = cfg.model, cfg.parallel, cfg.training, cfg.data, cfg.logging
    pl, mem = cfg.pipeline, cfg.memory
    positive = [("--tensor-model-parallel-size", p.tensor_model_parallel_size),
                ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
                ("--micro-batch-size", t.micro_batch_size),
                ("--log-interval", lg.log_interval), ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)]
    for name, value in positive:
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if lg.wandb_project and importlib.util.find_spec("wandb") is None:  # every rank refuses, not just the reporter
        raise ConfigError(f"--wandb-project {lg.wandb_project} needs the wandb package, which is not installed: "
                          "pip install wandb, or drop --wandb-project")
    for flag, name, names in (("--pipeline-schedule", pl.pipeline_schedule, schedule_names()),
                              ("--reshard-strategy", pl.reshard_strategy, strategy_names())):
        if name not in names:  # argparse checked a parsed flag; a config built or changed in code is checked here
            raise ConfigError(f"unknown {flag} {name!r}; available: {', '.join(names)}")
    # issue #50: --generator-layouts replicas take the launch's last ranks; the plan is the trainer's (on the rest)
    world_size = trainer_world_size(cfg, world_size)
    tp, pp = cfg.tp, cfg.pp
    if p.stage_layouts:
        _validate_stage_layouts(cfg, world_size)  # sets --pipeline-model-parallel-size from the entries
        pp = cfg.pp
    elif world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tensor-model-parallel-size {tp} × "
                          f"pipeline-model-parallel-size {pp} = {tp * pp}")
    dp = run_plan.data_parallel_size(cfg, world_size)
    if not p.stage_layouts:  # per-stage layouts checked each stage's tp above
        check_model_shape(m, tp, p.sequence_parallel)
    for name, value in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value}")
    if p.sequence_parallel and tp == 1 and not p.stage_layouts:
        warnings.warn("--sequence-parallel with --tensor-model-parallel-size 1 shards nothing; "
                      "it has no effect", stacklevel=2)
    if pp > 1 and not get_strategy(pl.reshard_strategy).carries_data and not t.check_for_nan_in_loss_and_grad:
        warnings.warn(f"--reshard-strategy {pl.reshard_strategy} carries no data: stage inputs are undefined, "
                      "so the loss is meaningless (a communication bound for benchmarks)", stacklevel=2)
    elif pp > 1 and not get_strategy(pl.reshard_strategy).carries_data:
        raise ConfigError(f"--reshard-strategy {pl.reshard_strategy} carries no data, so stage inputs are undefined "
                          "and the loss may be NaN, which --check-for-nan-in-loss-and-grad (on by default) stops on; "
                          "it is a benchmark's bound, not training: add --no-check-for-nan-in-loss-and-grad")
    if p.rank_order is not None:
        try:
            parse_order(p.rank_order)
        except TopologyError as e:
            raise ConfigError(f"--rank-order: {e}") from None
    if p.nproc_per_node is not None and (p.nproc_per_node < 1 or world_size % p.nproc_per_node):
        raise ConfigError(f"world size {world_size} is not a multiple of --nproc-per-node {p.nproc_per_node}")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"global batch {t.global_batch_size} is not divisible by micro batch "
                          f"{t.micro_batch_size} × dp {dp} = {t.micro_batch_size * dp}")
    validate_schedule(t)
    if t.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0 (0 disables), got {t.clip_grad}")
    validate_data(cfg)
    if pp > m.num_layers:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} exceeds --num-layers {m.num_layers}: every "
                          "pipeline stage needs at least one Transformer layer")
    vpp = resolve_virtual_stages(cfg, world_size)  # stages per rank: 1, or the virtual stages (sets the schedule)
    stages = pp * vpp
    what = f"--pipeline-model-parallel-size {pp}" if vpp == 1 else f"pp {pp} × {vpp} virtual stages = {stages}"
    if pl.num_layers_per_stage is not None:
        try:
            per_stage = [int(x) for x in pl.num_layers_per_stage.split(",")]
        except ValueError:
            raise ConfigError(f"--num-layers-per-stage {pl.num_layers_per_stage!r} must be comma-separated "
                              "integers, one per pipeline stage") from None
        if len(per_stage) != stages or sum(per_stage) != m.num_layers or min(per_stage) < 1:
            raise ConfigError(f"--num-layers-per-stage {pl.num_layers_per_stage} must give {stages} positive numbers "
                              f"(one per stage, {what}) adding up to --num-layers {m.num_layers}")
    elif m.num_layers % stages:
        raise ConfigError(f"--num-layers {m.num_layers} is not divisible by {what}; give --num-layers-per-stage "
                          "for an uneven split")
    if pl.delay_wgrad_compute and pp == 1:
        raise ConfigError("--delay-wgrad-compute needs --pipeline-model-parallel-size > 1: delaying weight "
                          "gradients fills the wait for a pipeline send, and one stage sends nothing")
    if pl.reshard_chunks is not None and pl.reshard_chunks < 1:
        raise ConfigError(f"--reshard-chunks must be at least 1, got {pl.reshard_chunks}")
    _validate_zero(cfg, world_size)
    if mem.use_distributed_optimizer:
        if mem.zero_stage == 0:
            mem.zero_stage = 1
        if mem.overlap_grad_reduce and mem.zero_stage == 1 and pp == 1:
            mem.zero_stage = 2
            cfg.notes.append("--use-distributed-optimizer with --overlap-grad-reduce runs as --zero-stage 2 (the "
                             "same reduce-scatter into optimizer shards, issued per bucket during backward; full "
                             "gradients are freed as they are reduced)")
    if mem.overlap_grad_reduce and mem.zero_stage not in (2, 3) and pp == 1:
        raise ConfigError(f"--overlap-grad-reduce needs --use-distributed-optimizer or --zero-stage 2 or 3 (got "
                          f"--zero-stage {mem.zero_stage}) at --pipeline-model-parallel-size 1: gradients are "
                          "reduce-scattered into optimizer shards as their buckets complete (with pp > 1 every "
                          "ZeRO stage overlaps, through the pipeline's R action)")
    _validate_moe(cfg, world_size, dp)
    if pl.pipeline_recv_posting == "early" and t.device == "cuda":
        raise ConfigError("--pipeline-recv-posting early needs gloo (--device cpu): on NCCL a receive posted early on "
                          "a communicator that also carries sends queues in front of them (use auto, mixed or grouped)")
    if pl.pipeline_schedule_file is not None:
        _validate_schedule_file(cfg, world_size)
    if mem.checkpoint_activations:
        if mem.recompute_activations or mem.recompute_granularity == "selective":
            raise ConfigError("--checkpoint-activations (every layer) conflicts with selective recomputation")
        mem.recompute_granularity = "full"
        cfg.notes.append("--checkpoint-activations runs as --recompute-granularity full")
    if mem.bf16 and mem.fp16:
        raise ConfigError("--bf16 and --fp16 conflict: choose one")
    if mem.loss_scale is not None and not mem.fp16:
        raise ConfigError(f"--loss-scale {mem.loss_scale} only applies with --fp16 (bf16 and fp32 need no scaling)")
    if mem.fp16:
        for name, value in (("--loss-scale", mem.loss_scale), ("--initial-loss-scale", mem.initial_loss_scale),
                            ("--min-loss-scale", mem.min_loss_scale)):
            if value is not None and not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if mem.loss_scale_window < 1 or mem.hysteresis < 1:
            raise ConfigError(f"--loss-scale-window {mem.loss_scale_window} and --hysteresis {mem.hysteresis} must "
                              "be at least 1")
    if mem.recompute_activations and mem.recompute_granularity == "full":
        raise ConfigError("--recompute-activations (selective) conflicts with --recompute-granularity full: "
                          "choose one")
    if mem.recompute_activations:
        mem.recompute_granularity = "selective"
    if mem.recompute_num_layers is not None and mem.recompute_granularity != "full":
        raise ConfigError(f"--recompute-num-layers {mem.recompute_num_layers} needs --recompute-granularity full")
    if mem.recompute_granularity == "full" and mem.recompute_num_layers is None:
        mem.recompute_num_layers = m.num_layers // pp
    d.split = d.split.strip("'\"")  # Megatron scripts pass "--split '99,1,0'" through word splitting
    parts = d.split.split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        raise ConfigError(f"--split {d.split!r} must be comma-separated numbers such as 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {d.split!r} must be 1 to 3 non-negative numbers with a positive sum")
    minutes = cfg.launch.distributed_timeout_minutes
    if minutes is not None:
        if minutes <= 0:
            raise ConfigError(f"--distributed-timeout-minutes must be positive, got {minutes}")
        if cfg.launch.comm_timeout not in (600.0, minutes * 60):
            raise ConfigError(f"--distributed-timeout-minutes {minutes} and --comm-timeout {cfg.launch.comm_timeout} "
                              "disagree: give one")
        cfg.launch.comm_timeout = minutes * 60.0
    if cfg.launch.preflight_timeout <= 0 or cfg.launch.comm_timeout <= 0:
        raise ConfigError(f"--preflight-timeout {cfg.launch.preflight_timeout} and --comm-timeout "
                          f"{cfg.launch.comm_timeout} must be positive seconds")
    if (lg.eval_interval is not None and lg.eval_interval < 0) or lg.eval_iters < 0:
        raise ConfigError(f"--eval-interval {lg.eval_interval} and --eval-iters {lg.eval_iters} must be >= 0")
    check_device_options(cfg, cfg.training.device)  # an unset device: checked again once the trainer resolves it
    if lg.tensorboard_log_interval < 1:
        raise ConfigError(f"--tensorboard-log-interval must be at least 1, got {lg.tensorboard_log_interval}")
    if cfg.training.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval must be >= 0 (0: collect only at start-up and around evaluations), "
                          f"got {cfg.training.manual_gc_interval}")
    if lg.profile and not 0 <= lg.profile_step_start < lg.profile_step_end:
        raise ConfigError(f"--profile needs 0 <= --profile-step-start {lg.profile_step_start} < "
                          f"--profile-step-end {lg.profile_step_end}")
    check_compile_config(cfg.compile)
    check_compile_scope(cfg)
    cfg.notes += [note for note in fusion_notes(m) if note not in cfg.notes]
    if cfg.checkpoint.ckpt_format != "torch_dist":
        raise ConfigError(f"--ckpt-format {cfg.checkpoint.ckpt_format} is not supported: megareshard writes one "
                          "format, torch_dist (sharded, loadable into any layout)")
    validate_checkpoint(cfg.checkpoint)
    validate_deterministic(cfg)
    cfg.plan = run_plan.resolve(cfg, world_size, auto_layout)
    m = cfg.plan.num_microbatches
    if pp > 1 and m < pp:
        warnings.warn(f"{m} microbatch(es) for {pp} pipeline stages: the bubble is at least "
                      f"{(pp - 1) / (m + pp - 1):.0%} of the step; raise --global-batch-size to at least "
                      f"{pp * t.micro_batch_size * dp} to fill the pipeline", stacklevel=2)
    return cfg


def check_device_options(cfg: Config, device_type: str | None) -> None:
    """Options that need a CUDA device, against the device's type (None: not resolved yet, nothing to check)."""
    if cfg.logging.log_memory_to_tensorboard and device_type not in (None, "cuda"):
        raise ConfigError("--log-memory-to-tensorboard writes CUDA's caching-allocator statistics "
                          f"(torch.cuda.memory_stats); device {device_type} has none")


def _moe_flags_given(cfg: Config) -> list[str]:
    """The MoE flags whose value differs from its default (``--flag value``), expert parallelism included."""
    from .models.config import ModelConfig

    given = [f"--{f.name.replace('_', '-')} {getattr(cfg.model, f.name)}" for f in dataclasses.fields(ModelConfig)
             if f.name.startswith("moe_") and getattr(cfg.model, f.name) != f.default]
    p = cfg.parallel
    if p.expert_model_parallel_size != 1:
        given.append(f"--expert-model-parallel-size {p.expert_model_parallel_size}")
    if p.expert_tensor_parallel_size is not None:
        given.append(f"--expert-tensor-parallel-size {p.expert_tensor_parallel_size}")
    return given


def _validate_moe(cfg: Config, world_size: int, dp: int) -> None:
    """Mixture of experts (Megatron-LM's flags): one line with the numbers for what cannot run. Pipeline
    parallelism composes (expert groups per stage, every schedule, expert weight gradients delayed into W), and
    so do per-stage layouts (each stage's tp × dp tiled by ep × etp, etp defaulting to the stage's tp), full
    recomputation (the replay records no router loss again) and ZeRO-3 (expert weights sharded over the
    expert-data-parallel group)."""
    m, p = cfg.model, cfg.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    for flag, v in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be at least 1, got {v}")
    if m.num_experts is None:
        given = _moe_flags_given(cfg)
        if given:
            raise ConfigError(f"{', '.join(given)} without --num-experts: the model has no MoE layer (give "
                              "--num-experts, or drop the MoE flags)")
        return
    E, k, tp, pp = m.num_experts, m.moe_router_topk, cfg.tp, cfg.pp
    if E < 1:
        raise ConfigError(f"--num-experts must be at least 1, got {E}")
    if not 1 <= k <= E:
        raise ConfigError(f"--moe-router-topk {k} must be between 1 and --num-experts {E} (a token is routed to k "
                          "distinct experts)")
    if E % ep:
        raise ConfigError(f"--num-experts {E} is not divisible by --expert-model-parallel-size {ep} (every "
                          "expert-parallel rank holds the same number of experts)")
    # (tp, dp) of every stage: per-stage layouts give each its own, and etp defaults to each stage's tp
    stages = parse_stage_layouts(p.stage_layouts) if p.stage_layouts else ((tp, dp),)
    for i, (stp, sdp) in enumerate(stages):
        setp = stp if etp is None else etp
        if (stp * sdp) % (ep * setp) == 0:
            continue
        if p.stage_layouts:
            raise ConfigError(f"--expert-model-parallel-size {ep} × --expert-tensor-parallel-size {setp} = "
                              f"{ep * setp} does not divide the {stp * sdp} ranks of pipeline stage {i} "
                              f"(--stage-layouts entry tp{stp}dp{sdp})")
        raise ConfigError(f"--expert-model-parallel-size {ep} × --expert-tensor-parallel-size {setp} = {ep * setp} "
                          f"does not divide the {stp * sdp} ranks of a pipeline stage (--tensor-model-parallel-size "
                          f"{tp} × data-parallel {dp}; Megatron-LM's rule: world size / pp = {world_size // pp} must "
                          "be a multiple of ep × etp)")
    if m.moe_pad_expert_input_to_capacity and (m.moe_expert_capacity_factor is None
                                               or m.moe_expert_capacity_factor < 0):
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity to "
                          "pad to); without it routing is dropless")
    if m.moe_token_drop_policy != "probs" and (m.moe_expert_capacity_factor is None
                                               or m.moe_expert_capacity_factor < 0):
        raise ConfigError(f"--moe-token-drop-policy {m.moe_token_drop_policy} needs --moe-expert-capacity-factor: "
                          "without a capacity no token is dropped")
    for i, (stp, _) in enumerate(stages):
        where = f" (pipeline stage {i}, --stage-layouts entry tp{stp})" if p.stage_layouts else ""
        try:
            check_moe_config(m, stp, ep, stp if etp is None else etp, p.sequence_parallel and stp > 1)
        except ConfigError as e:
            raise ConfigError(f"--num-experts {E}{where}: {e}") from None
        if m.moe_grouped_gemm:   # after the width is known to split over etp
            why = grouped_gemm_refusal(m.hidden_size, expert_width(m) // (stp if etp is None else etp),
                                       2 if cfg.memory.bf16 or cfg.memory.fp16 else 4)
            if why is not None:
                raise ConfigError(f"{why}{where}")


#: Megatron-FSDP's --data-parallel-sharding-strategy values and the ZeRO stage each is
SHARDING_STRATEGY_STAGE = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _validate_zero(cfg: Config, world_size: int) -> None:
    """Megatron's spellings of the ZeRO stage (FSDP2, Megatron-FSDP's sharding strategy) mapped onto
    --zero-stage, and ZeRO-3's needs: more than one data-parallel rank in every stage."""
    mem, notes = cfg.memory, cfg.notes
    strategy = mem.data_parallel_sharding_strategy
    fsdp = "--use-megatron-fsdp" if mem.use_megatron_fsdp else "--use-custom-fsdp" if mem.use_custom_fsdp else None
    if strategy is not None or fsdp:
        stage = SHARDING_STRATEGY_STAGE[strategy or "no_shard"]
        spelled = f"--data-parallel-sharding-strategy {strategy}" if strategy else f"{fsdp} (sharding no_shard)"
        if mem.zero_stage not in (0, stage):
            raise ConfigError(f"{spelled} is ZeRO stage {stage}, but --zero-stage {mem.zero_stage} was given: give one")
        if mem.use_torch_fsdp2 and stage != 3:
            raise ConfigError(f"--use-torch-fsdp2 shards parameters (ZeRO stage 3) but {spelled} is stage {stage}")
        mem.zero_stage = stage
        notes.append(f"{spelled} runs as --zero-stage {stage}" + (f" ({fsdp} selects nothing more)" if fsdp else ""))
    if mem.use_torch_fsdp2:
        if mem.zero_stage not in (0, 3):
            raise ConfigError(f"--use-torch-fsdp2 shards parameters (ZeRO stage 3), but --zero-stage {mem.zero_stage} "
                              "was given: give one")
        mem.zero_stage = 3
        notes.append("--use-torch-fsdp2 runs as --zero-stage 3 (megareshard's own parameter sharding, which composes "
                     "with its pipeline and delayed weight gradients; see docs/design.md)")
    if mem.zero3_param_persistence_threshold < 0 or (mem.zero3_param_persistence_threshold and mem.zero_stage != 3):
        raise ConfigError(f"--zero3-param-persistence-threshold {mem.zero3_param_persistence_threshold} needs "
                          f"--zero-stage 3 (got {mem.zero_stage}) and a count >= 0")
    if not mem.torch_fsdp2_reshard_after_forward and mem.zero_stage != 3:
        raise ConfigError(f"--torch-fsdp2-no-reshard-after-forward applies to sharded parameters (--zero-stage 3 or "
                          f"--use-torch-fsdp2), not --zero-stage {mem.zero_stage}")
    if mem.zero_stage != 3:
        return
    if cfg.parallel.stage_layouts:
        from .parallel.stage_topology import parse_stage_layouts

        ones = [i for i, (_, d) in enumerate(parse_stage_layouts(cfg.parallel.stage_layouts)) if d < 2]
        if ones:
            raise ConfigError(f"--zero-stage 3 shards parameters over each stage's data-parallel ranks, but stage(s) "
                              f"{', '.join(map(str, ones))} of --stage-layouts {cfg.parallel.stage_layouts} have dp 1: "
                              "give every stage dp >= 2, or use --zero-stage 0-2")
        return
    dp = run_plan.data_parallel_size(cfg, world_size)
    if dp < 2:
        raise ConfigError(f"--zero-stage 3 shards parameters over data parallelism, but dp is {dp} (world size "
                          f"{world_size} = tp {cfg.tp} × pp {cfg.pp} × dp {dp}): nothing to shard over; use "
                          "--zero-stage 0-2, or more ranks")


def _validate_schedule_file(cfg: Config, world_size: int) -> None:
    """--pipeline-schedule-file: the flags it cannot go with, then the file itself against pp and the
    microbatch count (its stage graph is checked against the model's when the runtime is built)."""
    pl, path = cfg.pipeline, cfg.pipeline.pipeline_schedule_file
    if cfg.pp == 1:
        raise ConfigError(f"--pipeline-schedule-file {path} needs --pipeline-model-parallel-size > 1")
    if pl.delay_wgrad_compute:
        raise ConfigError(f"--delay-wgrad-compute conflicts with --pipeline-schedule-file {path}: the file says "
                          "where weight gradients run (write I and W actions instead of B)")
    if cfg.parallel.auto_layout:
        raise ConfigError(f"--auto-layout chooses the schedule itself; drop --pipeline-schedule-file {path} "
                          "(or drop --auto-layout)")
    from .pipeline.schedule_io import load_schedule_file

    load_schedule_file(path, num_meshes=cfg.pp, num_microbatches=run_plan.microbatch_count(cfg, world_size),
                       overlap_grad_reduce=cfg.memory.overlap_grad_reduce)


def resolve_virtual_stages(cfg: Config, world_size: int) -> int:
    """Virtual pipeline stages per rank (1: none) from Megatron-LM's flags, checked against the schedule.

    Megatron-LM's meaning: ``--num-layers-per-virtual-pipeline-stage N`` gives ``layers / pp / N``
    chunks per rank, ``--num-virtual-stages-per-pipeline-rank`` (older: ``--virtual-pipeline-model-
    parallel-size``) gives the count; one of them at most; 1 means no virtual stages; several mean the
    interleaved schedule, so a one-stage-per-rank schedule runs as its interleaved twin
    (`ScheduleKind.interleaved_twin`: 1f1b as interleaved-1f1b, eager-1f1b as eager-interleaved-1f1b).
    A kind with its own count (zbv: 2) holds exactly that many stages per rank. Sets only the schedule (the
    flags stay as given, so validating twice gives the same answer; `pipeline.stage.virtual_stages` reads the
    count back); the microbatch count must be a multiple of pp where the kind says so (the interleaved ones).
    """
    from .pipeline.schedules import get_schedule, schedule_names

    pl, pp, m = cfg.pipeline, cfg.pp, cfg.model
    given = [(f, v) for f, v in (("--num-layers-per-virtual-pipeline-stage", pl.num_layers_per_virtual_pipeline_stage),
                                 ("--virtual-pipeline-model-parallel-size", pl.virtual_pipeline_model_parallel_size),
                                 ("--num-virtual-stages-per-pipeline-rank", pl.num_virtual_stages_per_pipeline_rank))
             if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{given[0][0]} {given[0][1]} and {given[1][0]} {given[1][1]} conflict: give one")
    for f, v in given:
        if v < 1:
            raise ConfigError(f"{f} must be at least 1, got {v}")
    vpp = None
    if given and given[0][0] == "--num-layers-per-virtual-pipeline-stage":
        n = given[0][1]
        if m.num_layers % (pp * n):
            raise ConfigError(f"--num-layers {m.num_layers} is not divisible into virtual stages of "
                              f"--num-layers-per-virtual-pipeline-stage {n} on --pipeline-model-parallel-size {pp} "
                              f"({m.num_layers} / ({pp} × {n}) is not an integer)")
        vpp = m.num_layers // (pp * n)
    elif given:
        vpp = given[0][1]
    vpp = None if vpp == 1 else vpp
    name = pl.pipeline_schedule
    kind = get_schedule(name)
    if vpp is not None and kind.stages_per_mesh == 1:
        if kind.interleaved_twin is not None:
            new = kind.interleaved_twin
            cfg.notes.append(f"{given[0][0]} {given[0][1]} ({vpp} virtual stages per rank) runs --pipeline-schedule "
                             f"{name} as {new} (Megatron-LM interleaves whenever there are virtual stages)")
            pl.pipeline_schedule = name = new
            kind = get_schedule(name)
        else:
            several = [n for n in schedule_names() if get_schedule(n).stages_per_mesh != 1]
            raise ConfigError(f"--pipeline-schedule {name} holds one stage per rank but {given[0][0]} "
                              f"{given[0][1]} asks for {vpp} virtual stages per rank; use "
                              f"{', '.join(several[:-1])} or {several[-1]}")
    if kind.stages_per_mesh is not None and kind.stages_per_mesh > 1:
        if vpp is not None and vpp != kind.stages_per_mesh:
            raise ConfigError(f"--pipeline-schedule {name} holds exactly {kind.stages_per_mesh} stages per rank (its "
                              f"placement), but {given[0][0]} {given[0][1]} asks for {vpp}")
        vpp = kind.stages_per_mesh
    elif kind.stages_per_mesh is None and vpp is None:
        raise ConfigError(f"--pipeline-schedule {name} interleaves virtual stages: give "
                          "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank (>= 2)")
    if vpp is not None and pp < 2:
        raise ConfigError(f"virtual pipeline stages ({vpp} per rank, --pipeline-schedule {name}) need "
                          f"--pipeline-model-parallel-size >= 2, got {pp}")
    t = cfg.training
    if kind.microbatch_multiple_of_pp and t.global_batch_size is not None:
        dp, mbs = run_plan.data_parallel_size(cfg, world_size), run_plan.microbatch_count(cfg, world_size)
        if mbs % pp:
            raise ConfigError(f"--pipeline-schedule {name}: {mbs} microbatches (global batch {t.global_batch_size} / "
                              f"(micro batch {t.micro_batch_size} × dp {dp})) are not a multiple of "
                              f"--pipeline-model-parallel-size {pp}: interleaving sends microbatches through the "
                              "chunks in groups of pp")
    return vpp or 1


def _validate_stage_layouts(cfg: "Config", world_size: int) -> None:
    """--stage-layouts: one tpNdpM entry per stage, ranks adding up to the world, shapes divisible per stage."""
    from .parallel.stage_topology import parse_stage_layouts

    p, m = cfg.parallel, cfg.model
    try:
        layouts = parse_stage_layouts(p.stage_layouts)
    except TopologyError as e:
        raise ConfigError(str(e)) from None
    n = len(layouts)
    if p.pipeline_model_parallel_size not in (1, n):
        raise ConfigError(f"--stage-layouts {p.stage_layouts} has {n} entries but --pipeline-model-parallel-size is "
                          f"{p.pipeline_model_parallel_size}: give one entry per pipeline stage")
    if p.tensor_model_parallel_size != 1:
        raise ConfigError(f"--tensor-model-parallel-size {p.tensor_model_parallel_size} conflicts with --stage-layouts "
                          f"{p.stage_layouts}: each stage's tp comes from its entry")
    if p.rank_order is not None:
        raise ConfigError(f"--rank-order {p.rank_order} conflicts with --stage-layouts: stages sit on consecutive "
                          "rank blocks with tp innermost")
    total = sum(t * d for t, d in layouts)
    if total != world_size:
        parts = " + ".join(f"{t}×{d}" for t, d in layouts)
        raise ConfigError(f"--stage-layouts {p.stage_layouts}: the stages need {parts} = {total} ranks but the world "
                          f"size is {world_size}")
    p.pipeline_model_parallel_size = n
    max_dp = max(d for _, d in layouts)
    for i, (t, d) in enumerate(layouts):
        if max_dp % d:
            raise ConfigError(f"--stage-layouts {p.stage_layouts}: stage {i}'s dp {d} does not divide the largest dp "
                              f"{max_dp}, so it cannot take an equal share of every global microbatch "
                              f"(--micro-batch-size {cfg.training.micro_batch_size} × {max_dp} samples)")
        try:
            check_model_shape(m, t, p.sequence_parallel, tp_name=f"stage {i}'s tp")
        except ConfigError as e:
            raise ConfigError(f"--stage-layouts {p.stage_layouts}: {e}") from None
