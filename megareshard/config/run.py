"""The run-level configuration sections (memory, training, logging, launch, checkpoint) and `Config`, which
gathers every section (the others: ``model.py``, ``parallel.py``, ``pipeline.py``, ``data.py``, ``compile.py``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .compile import CompileConfig
from .fields import config_field as _f
from .data import DataConfig
from .generators import GeneratorConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .pipeline import PipelineConfig

__all__ = ["MemoryConfig", "TrainingConfig", "LoggingConfig", "LaunchConfig", "CheckpointConfig", "Config",
           "SECTIONS"]


@dataclass
class MemoryConfig:
    """ZeRO, mixed precision and activation recomputation."""

    zero_stage: int = _f(0, "0: none, 1: shard optimizer state over dp, 2: also gradients, 3: also parameters "
                            "(each layer gathered around its forward and backward)", choices=(0, 1, 2, 3))
    use_distributed_optimizer: bool = _f(False, "Megatron's distributed optimizer: shard the optimizer state over "
                                                "dp and reduce-scatter gradients (= --zero-stage 1)")
    use_torch_fsdp2: bool = _f(False, "Megatron-LM's PyTorch FSDP2: parameters, gradients and optimizer state "
                                      "sharded over dp (= --zero-stage 3, megareshard's own parameter sharding: see "
                                      "docs/design.md, ZeRO-3)")
    torch_fsdp2_reshard_after_forward: bool = _f(True, "ZeRO-3: free each layer's gathered parameters after its "
                                                       "forward and gather them again for its backward; the flag "
                                                       "keeps them from forward to backward instead (with pp > 1: "
                                                       "gathered once for the whole step, gradients reduced once)",
                                                 flag="--torch-fsdp2-no-reshard-after-forward")
    zero3_param_persistence_threshold: int = _f(0, "ZeRO-3: parameters of fewer elements than this stay gathered "
                                                   "for the whole step, their gradients reduced once (DeepSpeed's "
                                                   "stage3_param_persistence_threshold; 0: none)")
    data_parallel_sharding_strategy: str | None = _f(
        None, "Megatron-FSDP's sharding: no_shard, optim, optim_grads, optim_grads_params = --zero-stage 0, 1, 2, 3",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    use_custom_fsdp: bool = _f(False, "Megatron-FSDP (older name): the sharding of --data-parallel-sharding-strategy "
                                      "(default no_shard), run as that --zero-stage")
    use_megatron_fsdp: bool = _f(False, "Megatron-FSDP: the sharding of --data-parallel-sharding-strategy (default "
                                        "no_shard), run as that --zero-stage")
    overlap_grad_reduce: bool = _f(False, "overlap the data-parallel gradient reduction with the backward. With "
                                          "pp > 1: each stage starts its reduction (all-reduce, or ZeRO's "
                                          "reduce-scatter) as an action right after its last backward, waited "
                                          "before the optimizer step (any --zero-stage). With pp 1: each bucket "
                                          "is reduce-scattered as soon as it is complete (every microbatch); "
                                          "needs --use-distributed-optimizer (then run as --zero-stage 2) or "
                                          "--zero-stage 2")
    bf16: bool = _f(False, "bf16 compute with fp32 master weights")
    fp16: bool = _f(False, "fp16 compute with fp32 master weights and dynamic loss scaling")
    loss_scale: float | None = _f(None, "static loss scale for fp16 (default: dynamic)")
    initial_loss_scale: float = _f(2.0 ** 32, "initial dynamic loss scale")
    min_loss_scale: float = _f(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = _f(1000, "overflow-free iterations before the scale doubles")
    hysteresis: int = _f(2, "overflows tolerated before the scale halves")
    recompute_activations: bool = _f(False, "selective recomputation: the attention core")
    recompute_granularity: str | None = _f(None, "full: recompute whole layers", choices=("full", "selective"))
    recompute_num_layers: int | None = _f(None, "layers per stage recomputed with --recompute-granularity full")
    checkpoint_activations: bool = _f(False, "old Megatron-LM name for recomputing every layer "
                                             "(= --recompute-granularity full)")
    empty_unused_memory_level: int = _f(0, "Megatron-LM's: 1 returns the CUDA caching allocator's unused blocks "
                                           "to the device after each forward-backward and each evaluation batch, "
                                           "2 also after the optimizer step (each a host synchronisation: fewer "
                                           "fragmentation OOMs, a slower step); 0 never", choices=(0, 1, 2))


@dataclass
class TrainingConfig:
    """Batch sizes, optimiser and schedule."""

    micro_batch_size: int = _f(4, "samples per microbatch per dp rank")
    global_batch_size: int | None = _f(None, "samples per iteration (default micro-batch-size × dp)")
    train_iters: int | None = _f(None, "iterations to train (default 100 unless --train-samples is given)")
    train_samples: int | None = _f(None, "samples to train, instead of --train-iters (iterations = samples / "
                                         "global batch)")
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = _f("linear", "decay after the warm-up", choices=("constant", "linear", "cosine",
                                                                            "inverse-square-root", "WSD"))
    lr_decay_iters: int | None = _f(None, "iterations of warm-up plus decay (default: all of training)")
    lr_decay_samples: int | None = _f(None, "samples of warm-up plus decay, instead of --lr-decay-iters")
    lr_warmup_iters: int = _f(0, "linear warm-up iterations")
    lr_warmup_samples: int = _f(0, "linear warm-up samples, instead of --lr-warmup-iters")
    lr_warmup_fraction: float | None = _f(None, "warm-up as a fraction of the decay steps, instead of the above")
    lr_warmup_init: float = _f(0.0, "learning rate the warm-up starts from")
    lr_wsd_decay_style: str = _f("exponential", "shape of the WSD anneal",
                                 choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: int | None = _f(None, "iterations of the WSD anneal (at the end of the decay steps)")
    lr_wsd_decay_samples: int | None = _f(None, "samples of the WSD anneal, instead of --lr-wsd-decay-iters")
    decoupled_lr: float | None = _f(None, "peak learning rate of the input embedding and output layer (their own "
                                          "schedule, the same shape)")
    decoupled_min_lr: float | None = _f(None, "minimum learning rate of the input embedding and output layer "
                                              "(default --min-lr)")
    weight_decay: float = _f(0.01, "AdamW weight decay (not on biases and LayerNorm)")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_eps: float = _f(1e-8, "AdamW epsilon")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0 disables)")
    seed: int = _f(1234, "seed for weights, data order and dropout")
    device: str | None = _f(None, "cpu or cuda (default: cuda when available)", choices=("cpu", "cuda"))
    deterministic_mode: bool = _f(False, "Megatron-LM's: bitwise-identical runs of the same command, slower "
                                         "(torch.use_deterministic_algorithms, cuDNN deterministic and not "
                                         "benchmarking, CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring unless "
                                         "set, inductor without on-device benchmarking, --attention-backend auto "
                                         "not measured: memory-efficient attention on CUDA); refuses --attention-"
                                         "backend flash and fused and the max-autotune compile modes")
    exit_duration_in_mins: float | None = _f(None, "save (with --save) and exit once training has run this long")
    manual_gc: bool = _f(False, "turn Python's garbage collector off during training and collect at fixed "
                                "iterations instead (--manual-gc-interval), so that no rank pauses for a collection "
                                "while the others wait for it in a collective (Megatron-LM's flag)")
    manual_gc_interval: int = _f(0, "with --manual-gc: collect every N iterations (0: only at start-up and around "
                                    "evaluations)", metavar="N")
    manual_gc_eval: bool = _f(True, "with --manual-gc: collect before and after each evaluation; "
                                    "--no-manual-gc-eval leaves the collector off there too",
                              flag="--no-manual-gc-eval")
    check_for_nan_in_loss_and_grad: bool = _f(True, "stop at the first non-finite loss or gradient, naming the "
                                                    "iteration, the rank and the parameter (fp16 overflows with a "
                                                    "loss scaler still skip the step); "
                                                    "--no-check-for-nan-in-loss-and-grad disables the check",
                                              flag="--no-check-for-nan-in-loss-and-grad")


@dataclass
class LoggingConfig:
    """What is reported, where and how often."""

    log_interval: int = _f(100, "iterations between log lines")
    eval_interval: int | None = _f(None, "iterations between evaluations (default 1000, skipped when there is no "
                                         "validation data; 0 disables)")
    eval_iters: int = _f(100, "batches per evaluation")
    metrics_file: str | None = _f(None, "write one JSON object per iteration to this file")
    wandb_project: str | None = _f(None, "W&B project (offline when there is no network)")
    wandb_exp_name: str | None = _f(None, "W&B run name")
    wandb_save_dir: str | None = _f(None, "directory for W&B files")
    tensorboard_dir: str | None = _f(None, "write TensorBoard event files (loss, learning rate, ...) here")
    tensorboard_log_interval: int = _f(1, "iterations between TensorBoard records")
    log_throughput: bool = _f(False, "also write TFLOP/s per rank to TensorBoard (the log line always shows it)")
    log_params_norm: bool = _f(False, "log the L2 norm of the model's parameters (the fp32 master weights, each "
                                      "element once whatever the layout) after every step: one more device read "
                                      "an iteration, as in Megatron-LM")
    log_num_zeros_in_grad: bool = _f(False, "log how many elements of the (reduced, clipped) gradients are zero, "
                                            "each element once whatever the layout (read with the gradient norm)")
    log_memory_to_tensorboard: bool = _f(False, "write this rank's CUDA caching-allocator statistics to TensorBoard "
                                                "with each record (Megatron-LM's mem-reserved-bytes, "
                                                "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count); "
                                                "a GPU's only: refused on cpu")
    profile: bool = _f(False, "record a PyTorch profiler trace of iterations [--profile-step-start, "
                              "--profile-step-end) into --tensorboard-dir (or the current directory)")
    profile_step_start: int = _f(10, "first profiled iteration")
    profile_step_end: int = _f(12, "iteration the profiler stops at")


@dataclass
class LaunchConfig:
    """Start-up checks and hang protection on real clusters."""

    preflight_timeout: float = _f(300.0, "seconds to wait for every rank to join before naming the missing ones")
    comm_timeout: float = _f(600.0, "seconds one collective or pipeline action may take before the watchdog "
                                    "dumps every rank's activity and exits")
    distributed_timeout_minutes: float | None = _f(None, "Megatron's name for the collective timeout, in minutes "
                                                         "(sets --comm-timeout)")
    custom_import: list[str] | None = _f(None, "import these modules before the flags are read: what they register "
                                               "(a schedule, a resharding strategy, a model, a step hook) becomes "
                                               "a valid choice (torchtitan's --experimental.custom_import)",
                                         metavar="MODULE")
    validate_only: bool = _f(False, "check the arguments for $WORLD_SIZE ranks, the tokenizer and the data files, "
                                    "print one line and exit without training (the launch scripts run this once "
                                    "before torchrun, so a bad argument is one line, not one per rank)")


@dataclass
class CheckpointConfig:
    """Saving and loading checkpoints (megareshard/checkpoint: any saved layout loads into any other)."""

    save: str | None = _f(None, "directory to save checkpoints in (ROOT/iter_N, ROOT/latest)")
    save_interval: int | None = _f(None, "iterations between checkpoints (one is also saved at the end with --save)")
    save_retain_latest: int = _f(0, "keep only the newest N checkpoints in --save (counted down from the one "
                                    "`latest` names) and remove the older ones after each complete save "
                                    "(torchtitan's keep_latest_k, HF's save_total_limit); 0: keep every one",
                                 metavar="N")
    save_retain_interval: int | None = _f(None, "Megatron-LM's flag: also keep the checkpoints of iterations "
                                                "divisible by K; alone, it keeps those and the latest one "
                                                "(= --save-retain-latest 1) and removes the rest after each save",
                                          metavar="K")
    load: str | None = _f(None, "checkpoint root (its `latest`) or checkpoint directory to start from")
    finetune: bool = _f(False, "load weights only: fresh optimizer and scheduler, iteration 0, no RNG")
    no_load_optim: bool = _f(False, "do not load the optimizer state (fresh Adam moments)")
    no_load_rng: bool = _f(False, "do not load the RNG states (keep this run's seeds)")
    attention_backend_rechoose: bool = _f(False, "with --load: choose the attention kernel of --attention-backend "
                                                 "auto again (measured on CUDA) instead of running the one the "
                                                 "checkpoint records (a resumed run runs the recorded kernel)")
    exit_interval: int | None = _f(None, "save (with --save) and exit after an iteration divisible by this")
    exit_signal_handler: bool = _f(False, "on SIGTERM: finish the iteration, save, exit (schedulers preempt)")
    async_save: bool = _f(False, "write checkpoints in a background thread (state copied to CPU first)")
    on_save_failure: str = _f("stop", "when a checkpoint save fails (disk full, I/O error): stop with the error, or "
                                      "continue training (the previous checkpoint stays the latest)",
                              choices=("stop", "continue"))
    ckpt_format: str = _f("torch_dist", "checkpoint format: torch_dist, megareshard's sharded format that any "
                                        "layout loads (the only one)")


@dataclass
class Config:
    """Everything a training run is configured with."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    generators: GeneratorConfig = field(default_factory=GeneratorConfig)  # issue #50: same-job generator replicas
    #: Megatron-LM flags given that change nothing here, and flags mapped to megareshard's own ('--flag (why)')
    notes: list[str] = field(default_factory=list)
    #: the `run_plan.RunPlan` the validated flags resolve to on the run's world (`config_checks.validate` returns
    #: the configuration with it): every derived number and registered object, computed once. Typed loosely: the
    #: plan sits above the configuration, which imports nothing above it.
    plan: Any = field(default=None, compare=False, repr=False)

    @property
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    def to_dict(self) -> dict[str, Any]:
        """The flags (what a run records of its configuration; the plan is derived from them)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "plan"}


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "pipeline": PipelineConfig,
             "memory": MemoryConfig, "training": TrainingConfig,
             "data": DataConfig, "logging": LoggingConfig, "launch": LaunchConfig,
             "checkpoint": CheckpointConfig, "compile": CompileConfig, "generators": GeneratorConfig}
