"""The training loop: microbatches, ZeRO-sharded AdamW, LR schedule, clipping, loss scaling, eval, logging.

One iteration = one global batch = ``global_batch / (micro_batch × dp)`` microbatches per dp
rank. The loss of a global batch is the mean per-token loss over all of its tokens, so
every layout (tp, dp, sequence parallel) computes the same number as one process does.
The forward/backward over the microbatches is a replaceable function
(``forward_backward``): with pp > 1 the pipeline runtime (``megareshard.pipeline.runtime``)
is that function; it also starts the gradient reductions after each stage's last
backward, so the trainer does not reduce again.

The model comes through its spec (``megareshard.model_spec.ModelSpec``: the modules, the stage graph,
the forward step, the FLOPs); this module imports no model. The `Trainer` assembles the run's pieces from the
spec's builders (``components.py``: tokenizer, optimizer, learning-rate schedule, data, checkpointer, trackers)
and holds the loop; the job around it (device, process group, context, pipeline runtime) is ``run_setup.py``,
its reports beside the log line ``train_report.py``.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TextIO

import torch

from . import plugins
from .config import Config
from .config_checks import check_device_options, validate
from .config_fields import ConfigError
from .checkpoint import CheckpointError, LoadResult
from .checkpoint.detect import KIND_ABSENT, KIND_EMPTY, load_decision
from .checkpoint.lock import lock_save_dir
from .checkpoint.megatron_load import load_into_model as load_megatron, megatron_checkpoint_dir
from .compile_config import TorchCompileError, compiler_failure
from .components import DEFAULTS
from .fast_path import apply_deterministic_mode, set_up_fast_path
from .data.sampler import GlobalBatchSampler, collate
from .launch import PeerFailure, RankInfo, Watchdog, exit_with_launcher, rank_map_table, tp_placement_warnings
from .inputs import resume_plan
from .memory import ActivationMeter, MemoryReport, memory_report, optimizer_state_bytes
from .model_spec.protocol import DEFAULT_MODEL_SPEC, ModelSpec, get_model_spec
from .optim.numerics import NonFiniteError, check_loss_and_grad, nonfinite_anywhere
from .parallel import ParallelContext
from .pipeline.runtime import PipelineRuntime
from .pipeline.chunks import build_chunks
from .run_setup import (agreed, build_context, build_pipeline, forward_backward,  # noqa: F401 (re-exported)
                        init_distributed, memory_per_stage, peak_memory_mb, peak_memory_per_stage, pick_device)
from .tensor_parallel import RNGStreams
from .tracking import cuda_memory_fields, format_log_line
from .train_checkpoints import Checkpointing
from .train_grads import GradientReductions
from .train_report import Reporting


#: errors that stop a run on every rank together, with a one-line message (the entry points print it, exit 1)
RunStopped = (CheckpointError, NonFiniteError, TorchCompileError)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: bool = False
    moe: dict[str, float] = field(default_factory=dict)  # the router losses (MoE runs: train_report.MOE_LOSS_NAMES)
    num_zeros: float | None = None     # --log-num-zeros-in-grad: zero elements of the clipped gradients
    params_norm: float | None = None   # --log-params-norm: the parameters' L2 norm after the step


@dataclass
class Trainer(Checkpointing, GradientReductions, Reporting):
    """Owns the model, optimizer, data and reporting of one run on one rank."""

    cfg: Config
    ctx: ParallelContext
    device: torch.device
    out: TextIO = sys.stdout
    # the forward/backward over one step's microbatches; None: ``forward_backward`` with the model's spec
    # (the pipeline runtime with pp > 1)
    forward_backward_fn: Callable[..., torch.Tensor] | None = None
    watchdog: Watchdog | None = None  # names this rank's activity if one outlasts --comm-timeout
    records: list[dict[str, Any]] = field(default_factory=list)
    # the model (``get_model_spec(name)``): its modules, stage graph, forward step and FLOPs; None = the
    # default model, DEFAULT_MODEL_SPEC (the GPT)
    model_spec: ModelSpec | None = None
    # fn(trainer, record) after each optimizer step, before the record is logged (it may add fields): e.g. the
    # weight transfer to same-job generator replicas (generators.py, issue #50)
    step_end_actions: list[Callable[["Trainer", dict[str, Any]], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        if cfg.plan is None or cfg.plan.world_size != ctx.world_size:  # a config built by hand, or for another world
            self.cfg = cfg = validate(cfg, ctx.world_size)
        self.plan = plan = cfg.plan  # every derived number (run_plan.py), resolved once by the validation
        self.world_size = ctx.world_size
        self.dp = ctx.dp_size
        # samples per microbatch on this rank: per-stage layouts shard one global microbatch of
        # micro batch × (largest dp) samples over each stage's own dp
        self.local_micro_batch_size = plan.local_micro_batch(self.dp)
        self.reporting = ctx.is_last_stage() and ctx.tp_rank() == 0 and ctx.dp_rank() == 0
        check_device_options(cfg, self.device.type)
        if self.model_spec is None:
            self.model_spec = get_model_spec(DEFAULT_MODEL_SPEC)
        spec = self.model_spec
        spec.check(cfg)
        parts = spec.components or DEFAULTS  # the builders of the run's pieces (components.py)
        self._phase_started: tuple[str, float] | None = None  # start-up phases, said by rank 0 as they begin
        self._phase_times: list[tuple[str, float]] = []
        self.cfg = cfg = parts.build_tokenizer(cfg)[0]  # the tokenizer's vocabulary, in the trainer's own config
        m = cfg.model
        self._phase("model", f"building the model ({m.num_layers} layers, hidden {m.hidden_size}, vocabulary "
                             f"{m.vocab_size}) and its optimizer")
        self._nonfinite_before_reduction: tuple[str, str] | None = None  # --check-for-nan-in-loss-and-grad
        torch.manual_seed(cfg.training.seed)
        self.pipeline: PipelineRuntime | None = None
        mem = cfg.memory
        # bf16/fp16 parameters for compute, fp32 masters in the optimizer (real memory savings)
        self.params_dtype = torch.bfloat16 if mem.bf16 else torch.float16 if mem.fp16 else torch.float32
        model_kwargs = dict(params_dtype=self.params_dtype, recompute_granularity=mem.recompute_granularity,
                            recompute_num_layers=mem.recompute_num_layers)
        placement = plan.pipeline.placement
        layouts = spec.stage_layouts(cfg, ctx.topology, placement) if cfg.pp > 1 else None
        if layouts is not None and len(layouts) > cfg.pp:
            # virtual stages: this rank's model chunks (one part per stage on its mesh), one RNG stream set
            streams = RNGStreams.for_context(cfg.training.seed, ctx, self.device)
            self.model = build_chunks(layouts, placement, ctx.pp_rank(),
                                      lambda lay: spec.build_model(cfg, ctx, lay, num_stages=len(layouts),
                                                                   seed=cfg.training.seed, device=self.device,
                                                                   streams=streams, **model_kwargs))
        else:
            self.model = spec.build_model(cfg, ctx, layouts[ctx.pp_rank()] if layouts is not None else None,
                                          num_stages=len(layouts) if layouts is not None else 1,
                                          seed=cfg.training.seed, device=self.device, **model_kwargs)
        # attention kernel, cross-entropy, regional compilation (before the optimizer: norms may be swapped)
        self.fast_path, self.compiled_regions = set_up_fast_path(self.model, cfg, self.device,
                                                                 self.local_micro_batch_size, spec.name)
        self.optimizer = parts.build_optimizer(self.model, cfg, ctx, self.device)
        self.scheduler = parts.build_lr_schedule(self.optimizer, cfg)
        self.memory: list[MemoryReport] | None = None
        self._grad_reduce_started = False  # an R action started this step's dp reductions (--overlap-grad-reduce)
        self._stages_reduced: set[int] = set()  # stages whose R ran this step (several per rank: virtual stages)
        if cfg.pp > 1:
            self._phase("resharding", f"planning the resharding between the {cfg.pp} pipeline stages "
                                      f"(--reshard-strategy {cfg.pipeline.reshard_strategy}) and building its groups")
            # collective over all ranks: every edge's resharders, built once
            self.pipeline = build_pipeline(spec, cfg, ctx, layouts, finalize_grads=self.finalize_grads,
                                           record_trace=cfg.pipeline.pipeline_trace is not None,
                                           dtype=self.params_dtype)
            if self.watchdog is not None:
                self.pipeline.watch(self.watchdog)
            if mem.overlap_grad_reduce:  # R actions: each stage's dp reduction starts after its last backward
                self.pipeline.grad_reduce_handler = self.start_stage_grad_reduce
            if self.forward_backward_fn is None:
                self.forward_backward_fn = self.pipeline
            if ctx.rank == 0:
                print(self.pipeline.describe(), file=self.out, flush=True)
        if ctx.rank == 0:
            print(f"megareshard: fast path: {'; '.join(self.fast_path + [self.optimizer.implementation])}",
                  file=self.out, flush=True)
        if self.forward_backward_fn is None:
            self.forward_backward_fn = functools.partial(forward_backward, spec=spec)
        self._phase("data", "building mock datasets" if cfg.data.mock_data else
                    "checking the datasets and building their sample indices")
        data = parts.build_data(cfg, ctx, self.local_micro_batch_size, self.out)
        self.train_data, self.valid_data, self.sampler = data.train, data.valid, data.sampler
        self.eval_interval = data.eval_interval
        self._train_iter: Iterator[list[list[int]]] = data.batches()
        self._prefetched: tuple[list[list[int]], list[dict[str, torch.Tensor]]] | None = None
        self.iteration = 0
        # checkpoints (megareshard/checkpoint): --load restores model, optimizer, schedule, data position,
        # RNG and the W&B run id in any layout, before the tracker starts (it resumes the saved run)
        ck = cfg.checkpoint
        self.checkpoints = parts.build_checkpointer(cfg, ctx, self.out)
        self.loaded: LoadResult | None = None
        if ck.save and megatron_checkpoint_dir(ck.save):
            raise CheckpointError(f"--save {ck.save} holds a Megatron-LM checkpoint "
                                  f"({megatron_checkpoint_dir(ck.save)}): megareshard's iter_N directories would mix "
                                  "with (and could replace) it; load it with --load and save elsewhere")
        if ck.load:
            self._phase("checkpoint", f"loading {ck.load}")
        megatron_dir = megatron_checkpoint_dir(ck.load) if ck.load else None
        if megatron_dir:   # a Megatron-LM checkpoint (a root or an iteration directory): its weights, as --finetune
            self.loaded = load_megatron(ck.load, ctx=ctx, model=self.model, cfg=cfg.model,
                                        optimizer=self.optimizer, say=self._say_checkpoint)
        # what --load holds, decided by rank 0 for all: from scratch only when it is --save and holds no
        # checkpoint yet (Megatron-LM scripts pass --load = --save on the first run too); else a checkpoint
        elif ck.load and agreed(ctx, lambda: load_decision(ck.load, ck.save)).kind in (KIND_EMPTY, KIND_ABSENT):
            if ctx.rank == 0:
                print(f"WARNING: --load {ck.load} holds no checkpoint (no latest file, no iter_* directory): training "
                      "starts from scratch", file=self.out, flush=True)
        elif ck.load:
            self.loaded = self.checkpoints.load(ck.load, model=self.model, optimizer=self.optimizer,
                                                scheduler=self.scheduler, sampler=self.sampler, config=cfg,
                                                finetune=ck.finetune, no_load_optim=ck.no_load_optim,
                                                no_load_rng=ck.no_load_rng)
            self.iteration = self.loaded.iteration
        self._last_saved = self.iteration if ck.load and not ck.finetune else None
        self._sigterm = False
        self.step_hooks = plugins.step_hooks()  # fn(trainer, iteration) at each iteration's start (--custom-import)
        self.save_failures = 0  # checkpoint saves that failed under --on-save-failure continue
        if ck.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if cfg.logging.wandb_project:
            self._phase("W&B", "starting the W&B run")
        trackers = parts.build_trackers(cfg, ctx, self.reporting, self.out,
                                        self.loaded.wandb_run_id if self.loaded is not None else None)
        self.metrics, self.tracker, self.tensorboard = trackers.metrics, trackers.wandb, trackers.tensorboard
        self._phase(None)

    def _phase(self, label: str | None, what: str = "") -> None:
        """Start-up phase ``label`` begins (rank 0 says ``what`` it does: the first minute is otherwise silent) and
        the previous one ends; None ends the last and prints how long each took."""
        now = time.monotonic()
        if self._phase_started is not None:
            self._phase_times.append((self._phase_started[0], now - self._phase_started[1]))
        self._phase_started = (label, now) if label is not None else None
        if self.ctx.rank != 0:
            return
        if label is not None:
            print(f" > {what} ...", file=self.out, flush=True)
        elif self._phase_times:
            took = ", ".join(f"{name} {dt:.1f} s" for name, dt in self._phase_times)
            print(f" > set-up done in {sum(dt for _, dt in self._phase_times):.1f} s ({took})", file=self.out,
                  flush=True)

    # ---- set-up ---------------------------------------------------------------------
    # ---- one iteration -------------------------------------------------------------------
    def _microbatches(self, dataset, indices: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        mbs = [collate([dataset[i] for i in mb]) for mb in indices]
        vocab = self.cfg.model.vocab_size
        for mb in mbs:  # data made with another tokenizer would index past the embedding
            tokens = mb["tokens"]
            top = int(tokens.numpy().max() if tokens.device.type == "cpu" else tokens.max())  # host: no device read
            if top >= vocab:
                data = " ".join(self.cfg.data.data_path or self.cfg.data.train_data_path or ["the data"])
                raise ConfigError(f"token id {top} in {data} is outside the "
                                  f"model's vocabulary of {vocab}: was the dataset made with another tokenizer?")
        if self.device.type == "cuda":  # page-locked: the copy to the device (non_blocking) leaves the host free
            mbs = [{k: v.pin_memory() if v.device.type == "cpu" else v for k, v in mb.items()} for mb in mbs]
        return mbs

    def _prefetch_next_batch(self) -> None:
        """Read and collate the next iteration's microbatches now, while the device still runs this iteration's
        backward (``train_step`` calls it right before the iteration's host read), instead of after it with the
        device idle. The sampler is not advanced: the next iteration draws its indices as always and takes these
        tensors when they are the same samples. A batch that fails its checks is dropped here and read (and
        refused) again at its own iteration."""
        s, t = self.sampler, self.cfg.training
        if not isinstance(s, GlobalBatchSampler) or self.iteration + 1 >= t.train_iters \
                or s.consumed_samples + s.global_batch_size > s.total_samples:
            return
        indices = s.global_batch(s.consumed_samples)
        try:
            self._prefetched = (indices, self._microbatches(self.train_data, indices))
        except ConfigError:
            self._prefetched = None

    def train_step(self, microbatches: list[dict[str, torch.Tensor]],
                   prefetch: Callable[[], None] | None = None) -> StepResult:
        """One iteration: forward and backward over ``microbatches``, gradient reductions, clipping, the non-finite
        check, the optimizer step. Reads the device once (the logged loss and gradient norm, and the check's
        flags, in one transfer), after calling ``prefetch`` (the loop's: the next batch read meanwhile); once more
        after the step with --log-params-norm (the updated parameters' norm, as Megatron-LM reads it)."""
        lr = self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        meter = ActivationMeter(exclude=self.model.parameters(), device=self.device,  # ZeRO-3: gathered params
                                exclude_live=self.optimizer.gathered_ptrs) if self.memory is None else None
        for hook in self.step_hooks:
            hook(self, self.iteration + 1)
        self._start_moe_step(len(microbatches))  # MoE: the router losses' gradient scale, a fresh record
        with meter if meter is not None else contextlib.nullcontext():
            try:
                loss = self.forward_backward_fn(self.model, microbatches, self.device,
                                                scale_loss=self.optimizer.scale_loss)
            except Exception as e:  # a compiled region's backward compiled lazily (older torch) and failed
                if not self.compiled_regions or isinstance(e, TorchCompileError) or not compiler_failure(e):
                    raise
                what = str(e).strip().splitlines()
                raise TorchCompileError(f"torch.compile failed in the backward of a compiled region: "
                                        f"{what[0] if what else type(e).__name__}; pass --no-torch-compile to run "
                                        "without compiling") from e
        if not getattr(self.forward_backward_fn, "finalizes_grads", False):
            self.finalize_grads()
        elif self._grad_reduce_started:  # R actions started them: wait before the step
            self._grad_reduce_started = False
            self.optimizer.finish_grad_sync()
        self._empty_unused_memory(1)
        with self._activity(f"stage {self.ctx.pp_rank()} optimizer step (gradient-norm all-reduce over all "
                            f"{self.world_size} ranks, parameter all-gathers over data-parallel ranks "
                            f"{list(self.ctx.group_ranks.get('dp', ()))})"):
            norm = self.optimizer.clip_grads(self.cfg.training.clip_grad)   # on the device: nothing read yet
            local = loss.detach().float().reshape(())
            check = self.cfg.training.check_for_nan_in_loss_and_grad
            # the iteration's one host read: the loss to log (its dp mean), the gradient norm and, for the
            # non-finite check, this rank's loss and the flag of every rank's (collectives launched first)
            reads = [self._dp_mean_tensor(local), norm.float().reshape(())]
            if check:
                reads += [local, nonfinite_anywhere(local).reshape(())]
            zeros, wide = len(reads), self.cfg.logging.log_num_zeros_in_grad
            if wide:   # an exact count: fp64, and so the whole read (fp32 values widen exactly)
                reads.append(self.optimizer.grad_zeros_tensor())
            dtype = torch.float64 if wide else torch.float32   # fp32: no cast kernels
            moe = self._moe_step_loss_sums(len(microbatches))   # MoE: the router losses, reduced (None: dense)
            if prefetch is not None:
                prefetch()
            values = torch.cat([torch.stack([r.to(dtype).reshape(()) for r in reads])]
                               + ([moe.to(dtype)] if moe is not None else [])).tolist()
            mean_loss, grad_norm = values[0], values[1]
            if check:  # collective when it raises: every rank stops together
                entries = getattr(self.optimizer, "entries", ())
                check_loss_and_grad(iteration=self.iteration + 1, rank=self.ctx.rank, local_loss=values[2],
                                    bad_loss_anywhere=values[3] > 0, grad_norm=grad_norm,
                                    overflow_skips=getattr(self.optimizer, "loss_scaler", None) is not None,
                                    named_params=self.model.named_parameters(),
                                    master_grads={e.name: e.master.grad for e in entries},
                                    before_reduction=self._nonfinite_before_reduction)
                self._nonfinite_before_reduction = None
            # first iteration: params, gradients and activations now; the optimizer's state after its step
            report = memory_report(self.model, self.optimizer, meter.peak_bytes) if meter is not None else None
            stepped = self.optimizer.step()  # every rank: it agrees on fp16 overflow over the world
            self._empty_unused_memory(2)
            if report is not None:  # AdamW allocates its moments in its first step (a skipped one: counted ahead)
                report.optimizer = optimizer_state_bytes(self.optimizer, self.model.parameters())
                self.memory = memory_per_stage(self.ctx, report, self.device)
        if not stepped:  # Megatron-LM: the learning-rate schedule advances only with an applied update
            self.scheduler.skipped()
        params_norm = None
        if self.cfg.logging.log_params_norm:   # of the updated parameters: a second read, as Megatron-LM's
            params_norm = self.optimizer.param_norm_tensor().item()
        return StepResult(loss=mean_loss, grad_norm=grad_norm, lr=lr, skipped=not stepped,
                          moe=self.moe_losses(values[len(reads):]) if moe is not None else {},
                          num_zeros=values[zeros] if wide and stepped else None,
                          params_norm=params_norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        lg, t = self.cfg.logging, self.cfg.training
        start = (self.iteration // self.eval_interval) * lg.eval_iters * t.global_batch_size \
            if self.eval_interval else 0
        sampler = GlobalBatchSampler(len(self.valid_data), t.global_batch_size, self.local_micro_batch_size, self.dp,
                                     self.ctx.dp_rank(), consumed_samples=start, order="megatron")
        total = torch.zeros((), device=self.device)
        for _, indices in zip(range(lg.eval_iters), sampler):
            total += self.forward_backward_fn(self.model, self._microbatches(self.valid_data, indices),
                                              self.device, backward=False)
            self._empty_unused_memory(1)
        self.model.train()
        return self._dp_mean(total / max(lg.eval_iters, 1))

    # ---- the loop --------------------------------------------------------------------------
    def train(self) -> list[dict[str, Any]]:
        """Train to --train-iters (or an exit condition); returns the records of the iterations run. With
        --manual-gc, Python's garbage collector is off inside (collected at start, every --manual-gc-interval
        iterations and around evaluations, as Megatron-LM does, so that no rank stops for a collection while the
        others wait in a collective) and back as it was afterwards."""
        t = self.cfg.training
        was_enabled = gc.isenabled()
        if t.manual_gc:
            gc.disable()
            gc.collect()
        try:
            return self._train()
        finally:
            if t.manual_gc and was_enabled:
                gc.enable()

    def _train(self) -> list[dict[str, Any]]:
        cfg, t, lg = self.cfg, self.cfg.training, self.cfg.logging
        tokens_per_iter = t.global_batch_size * cfg.model.seq_length
        flops = self.model_spec.flops_per_iteration(cfg, t.global_batch_size)
        self.model.train()
        self._train_start = time.monotonic()
        first_iteration = self.iteration
        skipped = nans = 0  # since the previous log line, as Megatron-LM counts them
        totals = {"skipped": 0, "nan": 0}
        if self.reporting and self.iteration < t.train_iters:
            print(f" training iterations {self.iteration + 1}-{t.train_iters}; the first one also pays one-time "
                  "costs (allocations, communicator set-up)", file=self.out, flush=True)
        profiler = None
        # An iteration's time runs from the previous iteration's end to its own (as Megatron-LM's interval timer,
        # less evaluations and checkpoint saves): on a GPU the optimizer step is still running when train_step
        # returns, and it is the next iteration's host read that waits for it.
        mark = time.perf_counter()
        while self.iteration < t.train_iters:
            if lg.profile and self.iteration == lg.profile_step_start:
                profiler = self._start_profiler()
            indices = next(self._train_iter)
            ready, self._prefetched = self._prefetched, None
            with self._activity(f"iteration {self.iteration + 1}"):
                batch = ready[1] if ready is not None and ready[0] == indices else \
                    self._microbatches(self.train_data, indices)
                res = self.train_step(batch, prefetch=self._prefetch_next_batch)
            end = time.perf_counter()
            elapsed, mark = end - mark, end
            self.iteration += 1
            self._report_compile_time(elapsed)
            if t.manual_gc and t.manual_gc_interval and self.iteration % t.manual_gc_interval == 0:
                gc.collect()
            if profiler is not None and self.iteration >= lg.profile_step_end:
                self._stop_profiler(profiler)
                profiler = None
            rec = {"iteration": self.iteration, "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm,
                   "batch_size": t.global_batch_size,
                   "consumed_samples": self.sampler.consumed_samples, "tokens_per_s": tokens_per_iter / elapsed,
                   "ms_per_iter": 1e3 * elapsed, "tflops_per_rank": flops / elapsed / self.world_size / 1e12,
                   "loss_scale": self.optimizer.loss_scale, "skipped": res.skipped, **res.moe}
            rec.update({k: v for k, v in (("num_zeros", res.num_zeros), ("params_norm", res.params_norm))
                        if v is not None})
            if lg.log_memory_to_tensorboard and self.reporting:   # host counters: no device read
                rec.update(cuda_memory_fields(torch.cuda.memory_stats(self.device)))
            nan = not res.skipped and not math.isfinite(res.loss)
            skipped, nans = skipped + res.skipped, nans + nan
            totals["skipped"] += res.skipped
            totals["nan"] += nan
            run_s = time.monotonic() - self._train_start
            rec.update(skipped_iterations=skipped, nan_iterations=nans, elapsed_s=run_s,
                       eta_s=run_s / (self.iteration - first_iteration) * (t.train_iters - self.iteration))
            if self.iteration == 1:
                rec["memory_per_stage"] = [m.to_dict() for m in self.memory]
                if self.reporting:
                    print(self._memory_lines(), file=self.out, flush=True)
            log_line = self.iteration % lg.log_interval == 0 or self.iteration in (1, t.train_iters)
            if log_line:  # a collective and, on a GPU, a host read: at log lines only (every rank the same)
                self._record_peak_memory(rec)
            if self.eval_interval and self.iteration % self.eval_interval == 0 and self.valid_data is not None:
                with self._activity(f"evaluation at iteration {self.iteration}"):
                    if t.manual_gc and t.manual_gc_eval:
                        gc.collect()
                    rec["eval_loss"] = self.evaluate()
                    if t.manual_gc and t.manual_gc_eval:   # what the evaluation made (Megatron-LM's generation 0)
                        gc.collect(generation=0)
                rec["eval_ppl"] = math.exp(min(rec["eval_loss"], 50.0))
                mark = time.perf_counter()
            for action in self.step_end_actions:
                action(self, rec)
            self.records.append(rec)
            if self.reporting:
                self.metrics.write(rec)
                self.tracker.log(rec, step=self.iteration)
                self.tensorboard.log(rec if lg.log_throughput else
                                     {k: v for k, v in rec.items() if k != "tflops_per_rank"}, step=self.iteration)
                # the first and the last iteration too: a run shorter than --log-interval (Megatron's 100) still
                # shows its first loss, time per iteration and ETA, and where it ended
                if log_line:
                    print(self._with_moe_losses(format_log_line(rec, t.train_iters), rec), file=self.out, flush=True)
                    skipped = nans = 0
                if "eval_loss" in rec:
                    print(f" validation at iteration {self.iteration} | lm loss: {rec['eval_loss']:.6E} | "
                          f"lm loss PPL: {rec['eval_ppl']:.3f}", file=self.out, flush=True)
            saved = self._last_saved
            if self._checkpoint_and_maybe_exit():
                break
            if self._last_saved != saved:
                mark = time.perf_counter()
        else:
            if self.cfg.checkpoint.save and self._last_saved != self.iteration:
                self.save_checkpoint()
        if profiler is not None:
            self._stop_profiler(profiler)
        if self.reporting and self.iteration > first_iteration:
            self._print_summary(first_iteration, totals)
        if self.records and "peak_mem_mb_per_stage" not in self.records[-1]:  # stopped between log lines
            self._record_peak_memory(self.records[-1])
        if self.records and self.reporting:
            kind = "max allocated" if self.device.type == "cuda" else "max RSS"
            per_stage = ", ".join(f"stage {i} {v:.1f}" for i, v in enumerate(self.records[-1]["peak_mem_mb_per_stage"]))
            print(f" peak memory per pipeline stage (MiB, {kind}, MAX over the stage's ranks): {per_stage}",
                  file=self.out, flush=True)
        self._show_activations()
        return self.records

    def _empty_unused_memory(self, level: int) -> None:
        """--empty-unused-memory-level: where Megatron-LM empties the CUDA cache (a no-op without CUDA)."""
        if self.cfg.memory.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    def _record_peak_memory(self, rec: dict[str, Any]) -> None:
        per_stage = peak_memory_per_stage(self.ctx, self.device)
        rec["peak_mem_mb"], rec["peak_mem_mb_per_stage"] = max(per_stage), per_stage

    def _activity(self, what: str, timed: bool = True):
        return self.watchdog.activity(what, timed) if self.watchdog is not None else contextlib.nullcontext()

    # ---- checkpoints ------------------------------------------------------------------------
    def release_communicators(self) -> None:
        """Destroy the pipeline's and the parallel context's process groups (every rank, after its last step):
        a process that trains again (tests, the planner's validation) would otherwise keep each run's gloo
        threads and connections, and every later run would pay for them."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.ctx.destroy()

    def close(self) -> None:
        try:
            self.checkpoints.close()  # waits for a background save (its error is reported here)
        except CheckpointError as e:
            self._save_failed(e)
        self.metrics.close()
        self.tracker.finish()
        self.tensorboard.finish()


def pretrain(cfg: Config, out: TextIO | None = None, model_spec: ModelSpec | None = None, *,
             launch_split: Callable[..., list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Entry point shared by ``pretrain_gpt.py``, ``pretrain_utransformer.py`` and tests: trains the model of
    ``model_spec`` (``get_model_spec(name)``; None: the default model, DEFAULT_MODEL_SPEC). ``out``: where the log
    goes (None: ``sys.stdout`` as it is at the call). ``launch_split``: runs a launch whose last ranks are not the
    trainer's (``megareshard.generators.pretrain_with_generators`` for --generator-layouts; pretrain_gpt.py passes
    it) as ``launch_split(cfg, out, model_spec, device, world, infos, _pretrain)``."""
    out = sys.stdout if out is None else out
    device = pick_device(cfg.training.device)
    apply_deterministic_mode(cfg, device)  # --deterministic-mode: CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO before NCCL
    exit_with_launcher()  # a torchrun worker stops when its agent is gone (kill -9 of torchrun)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") == "0":
        print(f"megareshard: waiting for all {os.environ['WORLD_SIZE']} ranks to join (--preflight-timeout "
              f"{cfg.launch.preflight_timeout:g} s)", file=out, flush=True)
    world, infos = init_distributed(device, cfg.launch.preflight_timeout, cfg.launch.comm_timeout)
    if cfg.generators.generator_layouts:  # the last ranks are generator replicas (issue #50)
        if launch_split is None:
            raise ConfigError("--generator-layouts needs pretrain_gpt.py (megareshard.generators splits the launch)")
        return launch_split(cfg, out, model_spec, device, world, infos, _pretrain)
    save_lock = lock_save_dir(cfg.checkpoint.save, out) if cfg.checkpoint.save else None  # one job per --save
    try:
        return _pretrain(cfg, out, model_spec, device, world, infos)
    finally:
        if save_lock is not None:
            save_lock.release()


def _pretrain(cfg: Config, out: TextIO, model_spec: ModelSpec | None, device: torch.device, world: int,
              infos: list[RankInfo], prepare: Callable[[Trainer], None] | None = None) -> list[dict[str, Any]]:
    """The run on this rank; ``prepare(trainer)`` (if given) once the trainer is built, before it trains."""
    ctx, placement = build_context(cfg, world)
    # a resume against its plan, from the checkpoint.json --load names (rank 0 reads it, for all), before anything
    # is built: past --train-iters is one line (a ConfigError); at it, nothing is left to train (exit 0)
    finished = agreed(ctx, lambda: resume_plan(cfg))
    if finished is not None:
        if ctx.rank == 0:
            print(f"megareshard: {finished}", file=out, flush=True)
        ctx.destroy()
        return []
    if ctx.rank == 0:
        note = cfg.plan.auto_layout
        if note:
            print(f"megareshard: {note}", file=out, flush=True)
        print(f"megareshard: {placement}; device {device}, {cfg.plan.num_microbatches} microbatch(es) "
              f"per iteration", file=out, flush=True)
        if cfg.notes:
            print(f"megareshard: Megatron-LM flags without effect or mapped here: {'; '.join(cfg.notes)}", file=out,
                  flush=True)
        if infos:
            etp = cfg.parallel.expert_tensor_parallel_size if ctx.per_stage_layouts else ctx.etp_size  # None: stage tp
            experts = (ctx.ep_size, etp, cfg.model.num_experts) if cfg.model.num_experts is not None else None
            print(rank_map_table(infos, ctx.topology, experts), file=out, flush=True)
            for warning in tp_placement_warnings(infos, ctx.topology):
                print(f"WARNING: {warning}", file=out, flush=True)
    watchdog = Watchdog(cfg.launch.comm_timeout, ctx.rank) if world > 1 else None
    try:
        trainer = Trainer(cfg, ctx, device, out=out, watchdog=watchdog, model_spec=model_spec)
        if prepare is not None:
            prepare(trainer)
        try:
            records = trainer.train()
        finally:
            trainer.close()
        trainer.release_communicators()  # only after success: a failed collective could hang their shutdown
        return records
    except BaseException as e:
        # a peer died, stalled or was cut off: the watchdog printed this rank's report; one line, exit 1
        if watchdog is not None and watchdog.failure is not None and not isinstance(e, PeerFailure):
            raise PeerFailure(watchdog.failure) from None
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
