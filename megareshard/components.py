"""What a training run is assembled from, each piece made by a builder a model spec may replace (torchtitan's
``TrainSpec`` idea): the tokenizer, the optimizer, the learning-rate schedule, the data, the checkpointer and the
trackers. The `Trainer` asks its model spec for its `Components` (``ModelSpec.components``; None: `DEFAULTS`),
calls each builder once at set-up and holds the loop; it builds none of these itself.

A builder takes the run's configuration and what it needs of the running job, and returns the piece::

    build_tokenizer(cfg) -> (cfg with the tokenizer's vocabulary, tokenizer or None)
    build_optimizer(model, cfg, ctx, device) -> optimizer (the ZeRO optimizer's surface: step, clip_grads,
                                                           finish_grad_sync, scale_loss, ...)
    build_lr_schedule(optimizer, cfg) -> scheduler (step() -> lr, skipped(), state_dict())
    build_data(cfg, ctx, local_micro_batch, out) -> TrainData
    build_checkpointer(cfg, ctx, out) -> CheckpointManager
    build_trackers(cfg, ctx, reporting, out, run_id) -> Trackers

Replace one with ``dataclasses.replace(DEFAULTS, build_optimizer=my_builder)`` as a spec's ``components``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TextIO

import torch.distributed as dist

from .checkpoint import CheckpointManager
from .config import Config
from .config_fields import ConfigError
from .data.blended import build_blend, build_train_valid_test_datasets
from .data.mock import MockGPTDataset
from .data.sampler import GlobalBatchSampler
from .inputs import dataset_prefixes, resolve_vocab
from .optim.grad_scaler import build_loss_scaler
from .optim.lr_scheduler import LRScheduler, decoupled_schedule_from_config, schedule_from_config
from .optim.zero import build_zero_optimizer
from .parallel import ParallelContext
from .tracking import MetricsFile, TensorBoardWriter, WandbTracker

__all__ = ["Components", "DEFAULTS", "TrainData", "Trackers", "build_optimizer", "build_lr_schedule", "build_data",
           "validate_data", "build_checkpointer", "build_trackers"]


@dataclass
class TrainData:
    """The datasets of a run and this rank's sampler over the training set."""

    train: Any
    """Training samples (``len`` and ``[i]`` -> a sample dict)."""
    valid: Any | None
    """Validation samples (None: no evaluation)."""
    sampler: GlobalBatchSampler
    """This rank's microbatches of every iteration, in Megatron's order (resumable: ``consumed_samples``)."""
    eval_interval: int
    """Iterations between evaluations (0: none)."""

    def batches(self) -> Iterator[list[list[int]]]:
        return iter(self.sampler)


@dataclass
class Trackers:
    """Where a run's records go (each a no-op where it is off or on a rank that does not report)."""

    metrics: MetricsFile
    wandb: WandbTracker
    tensorboard: TensorBoardWriter


def build_optimizer(model: Any, cfg: Config, ctx: ParallelContext, device: Any) -> Any:
    """One ZeroOptimizer for every --zero-stage (stage 0 all-reduces, 1/2 shard state and gradients over dp, 3 also
    parameters); apex's FusedAdam on GPU when importable (never required; PyTorch's fused AdamW otherwise)."""
    mem = cfg.memory
    return build_zero_optimizer(model, ctx, cfg.training, mem, loss_scaler=build_loss_scaler(mem),
                                # pp > 1: the pipeline's R actions overlap instead
                                overlap_grad_reduce=mem.overlap_grad_reduce and cfg.pp == 1,
                                use_apex=device.type == "cuda", pipeline=cfg.pp > 1)


def build_lr_schedule(optimizer: Any, cfg: Config) -> LRScheduler:
    """Megatron's warm-up and decay (and the decoupled schedule of the embedding and output layer)."""
    t = cfg.training
    return LRScheduler(optimizer, schedule_from_config(t), decoupled_schedule_from_config(t))


def validate_data(cfg: Config, ctx: ParallelContext) -> None:
    """Start-up checks of every dataset file (data/validate.py), agreed by all ranks: each opens every dataset (index
    against .bin, not empty) and scans its share of the token chunks against the vocabulary; any rank's finding
    becomes the same ConfigError on every rank."""
    d = cfg.data
    if d.mock_data:
        return
    from .data.indexed_dataset import IndexedDataset
    from .data.validate import check_not_empty, check_token_range, chunk_count

    found = None
    try:
        for prefix in dataset_prefixes(d):
            ds = IndexedDataset(prefix)
            check_not_empty(ds)
            if d.data_validation:
                check_token_range(ds, cfg.model.vocab_size, chunks=range(ctx.rank, chunk_count(ds), ctx.world_size))
    except (OSError, ValueError) as e:
        found = str(e)
    every = [found]
    if dist.is_initialized() and ctx.world_size > 1:
        every = [None] * ctx.world_size
        dist.all_gather_object(every, found)
    seen = [(r, e) for r, e in enumerate(every) if e]
    if seen:
        who = f" (found by rank {seen[0][0]})" if ctx.world_size > 1 else ""
        raise ConfigError(seen[0][1] + who)


def build_data(cfg: Config, ctx: ParallelContext, local_micro_batch: int, out: TextIO) -> TrainData:
    """The datasets (checked first: `validate_data`) and this rank's sampler."""
    validate_data(cfg, ctx)
    t, lg = cfg.training, cfg.logging
    gb = t.global_batch_size
    n_train = t.train_iters * gb
    # Megatron's default: every 1000 iterations, skipped (with a note) when there is no validation data
    eval_interval = lg.eval_interval if lg.eval_interval is not None else 1000
    n_evals = (t.train_iters // eval_interval + 1) if eval_interval > 0 and lg.eval_iters > 0 else 0
    n_valid = n_evals * lg.eval_iters * gb
    if cfg.data.mock_data:
        train = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, n_train, seed=t.seed)
        valid = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, n_valid, seed=t.seed + 1) \
            if n_valid else None
    else:
        d = cfg.data
        try:
            if d.data_path:
                train, valid, _ = build_train_valid_test_datasets(d.data_path, d.split, cfg.model.seq_length,
                                                                  [n_train, n_valid, 0], t.seed, d.data_cache_path)
            else:  # one blend per split, each dataset used whole
                train = build_blend(d.train_data_path, None, cfg.model.seq_length, [n_train, 0, 0], t.seed,
                                    d.data_cache_path)[0]
                valid = build_blend(d.valid_data_path, None, cfg.model.seq_length, [0, n_valid, 0], t.seed,
                                    d.data_cache_path)[1] if d.valid_data_path else None
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from None
        if n_valid and valid is None:
            where = (f"--split {d.split} leaves no validation documents in {' '.join(d.data_path)}" if d.data_path
                     else "no --valid-data-path was given")
            if lg.eval_interval is not None:
                raise ConfigError(f"--eval-interval {lg.eval_interval} needs validation data, but {where}")
            eval_interval = 0
            if ctx.rank == 0:
                print(f" no evaluation: {where}", file=out, flush=True)
    # "megatron" order: global microbatch k is the same samples whatever the dp, which pipeline stages with
    # different dp sizes rely on
    sampler = GlobalBatchSampler(len(train), gb, local_micro_batch, ctx.dp_size, ctx.dp_rank(), order="megatron")
    return TrainData(train, valid, sampler, eval_interval)


def build_checkpointer(cfg: Config, ctx: ParallelContext, out: TextIO) -> CheckpointManager:
    """Saves and loads in any layout (megareshard/checkpoint), with --async-save and the retention flags."""
    ck = cfg.checkpoint
    return CheckpointManager(ctx, async_save=ck.async_save, out=out, retain_latest=ck.save_retain_latest,
                             retain_interval=ck.save_retain_interval)


def build_trackers(cfg: Config, ctx: ParallelContext, reporting: bool, out: TextIO, run_id: str | None) -> Trackers:
    """The metrics file, W&B (resuming `run_id`) and TensorBoard, on the reporting rank."""
    lg = cfg.logging
    return Trackers(metrics=MetricsFile(lg.metrics_file if reporting else None),
                    wandb=WandbTracker(lg.wandb_project, lg.wandb_exp_name, lg.wandb_save_dir,
                                       {**cfg.to_dict(), "layout": ctx.topology.describe()}, enabled=reporting,
                                       log=out, run_id=run_id),
                    tensorboard=TensorBoardWriter(lg.tensorboard_dir if reporting else None,
                                                  lg.tensorboard_log_interval))


@dataclass(frozen=True)
class Components:
    """The builders of a run's pieces (module docstring); a model spec's ``components`` replaces any of them."""

    build_tokenizer: Callable[[Config], tuple[Config, Any]] = resolve_vocab
    build_optimizer: Callable[[Any, Config, ParallelContext, Any], Any] = build_optimizer
    build_lr_schedule: Callable[[Any, Config], Any] = build_lr_schedule
    build_data: Callable[[Config, ParallelContext, int, TextIO], TrainData] = build_data
    build_checkpointer: Callable[[Config, ParallelContext, TextIO], CheckpointManager] = build_checkpointer
    build_trackers: Callable[[Config, ParallelContext, bool, TextIO, str | None], Trackers] = build_trackers

    def replace(self, **builders: Callable[..., Any]) -> Components:
        """These components with some builders replaced."""
        return dataclasses.replace(self, **builders)


DEFAULTS = Components()
