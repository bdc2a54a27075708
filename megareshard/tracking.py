"""Where training metrics go: the log line, a JSON-lines metrics file, and Weights & Biases.

Only one rank reports (the caller decides which: the last pipeline stage holds the loss).
W&B runs offline when ``WANDB_MODE=offline`` is set or no API key is configured, and says
so; it never blocks on a missing network.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    """``1:02:03`` (hours:minutes:seconds), ``2:03`` under an hour."""
    total = int(round(max(seconds, 0.0)))
    h, rest = divmod(total, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def format_log_line(rec: dict[str, Any], train_iters: int) -> str:
    """A Megatron-like iteration line (its fields, in its order, then throughput, elapsed time and ETA)."""
    parts = [f" iteration {rec['iteration']:8d}/{train_iters:8d}",
             f"consumed samples: {rec['consumed_samples']:10d}",
             f"elapsed time per iteration (ms): {rec['ms_per_iter']:.1f}",
             f"learning rate: {rec['lr']:.6E}"]
    if "batch_size" in rec:
        parts.append(f"global batch size: {rec['batch_size']:5d}")
    parts += [f"lm loss: {rec['loss']:.6E}",
              f"grad norm: {rec['grad_norm']:.3f}"]
    if "num_zeros" in rec:     # --log-num-zeros-in-grad, --log-params-norm: Megatron-LM's fields after the norm
        parts.append(f"num zeros: {rec['num_zeros']:.1f}")
    if "params_norm" in rec:
        parts.append(f"params norm: {rec['params_norm']:.3f}")
    parts += [f"tokens/s: {rec['tokens_per_s']:.1f}",
              f"TFLOP/s per rank: {rec['tflops_per_rank']:.3f}"]
    if rec.get("loss_scale", 1.0) != 1.0:  # fp16 only
        parts.append(f"loss scale: {rec['loss_scale']:.1f}")
    if rec.get("skipped"):
        parts.append("step skipped (gradient overflow)")
    if "skipped_iterations" in rec:  # since the previous log line, as Megatron-LM counts them
        parts.append(f"number of skipped iterations: {rec['skipped_iterations']:3d}")
        parts.append(f"number of nan iterations: {rec['nan_iterations']:3d}")
    if "transfer_bytes" in rec:  # a weight transfer to generator replicas after this step (issue #50)
        frac = rec.get("transfer_bound_fraction")
        parts.append(f"weight transfer: {rec['transfer_bytes'] / 2**20:.2f} MiB in {rec['transfer_s'] * 1e3:.1f} ms "
                     f"({rec['transfer_gbps'] or 0:.3f} Gbit/s" + (f", {frac:.0%} of the network bound)" if frac
                                                                  else ")"))
    if "elapsed_s" in rec:
        parts.append(f"elapsed: {format_duration(rec['elapsed_s'])}")
        parts.append(f"ETA: {format_duration(rec['eta_s'])}")
    return " | ".join(parts) + " |"


class MetricsFile:
    """One JSON object per line, flushed each write so a crash loses at most one record."""

    def __init__(self, path: str | None) -> None:
        self._f: TextIO | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def write(self, rec: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def wandb_mode() -> tuple[str, str]:
    """(mode, why): respects WANDB_MODE; without it, offline unless an API key is configured."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return env, f"WANDB_MODE={env}"
    if os.environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc) and "api.wandb.ai" in open(netrc, encoding="utf-8", errors="replace").read():
        return "online", "a W&B login is configured"
    return "offline", "no W&B API key is configured (sync later with `wandb sync`)"


class WandbTracker:
    """A W&B run on the reporting rank; a no-op elsewhere or without --wandb-project."""

    def __init__(self, project: str | None, name: str | None, save_dir: str | None, config: dict[str, Any],
                 enabled: bool, run_id: str | None = None, log: TextIO = sys.stdout) -> None:
        self.run = None
        if not (enabled and project):
            return
        import wandb

        mode, why = wandb_mode()
        save_dir = save_dir or os.path.join(os.getcwd(), "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, config=config, mode=mode,
                              id=run_id, resume="allow" if run_id else None)
        where = getattr(self.run, "dir", save_dir)
        print(f"W&B: run {self.run.id} ({mode}: {why}) writing to {where}", file=log, flush=True)

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def log(self, rec: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


#: --log-memory-to-tensorboard: record key (Megatron-LM's tag, with dashes) -> its ``torch.cuda.memory_stats()`` entry
CUDA_MEMORY_STATS = {"mem_reserved_bytes": "reserved_bytes.all.current",
                     "mem_allocated_bytes": "allocated_bytes.all.current",
                     "mem_max_allocated_bytes": "allocated_bytes.all.peak",
                     "mem_allocated_count": "allocation.all.current"}


def cuda_memory_fields(stats: dict[str, Any]) -> dict[str, int]:
    """The record's --log-memory-to-tensorboard fields from ``torch.cuda.memory_stats()`` (an allocator that has
    allocated nothing yet has no entries: 0)."""
    return {key: int(stats.get(entry, 0)) for key, entry in CUDA_MEMORY_STATS.items()}


class TensorBoardWriter:
    """TensorBoard event files (``torch.utils.tensorboard``) under ``--tensorboard-dir``, with Megatron-LM's tags
    and units (its ``training_log``): ``lm loss``, ``learning-rate``, ``grad-norm``, ``loss-scale``, ``batch-size``,
    ``num-zeros`` and ``params-norm`` (when logged), the ``mem-...`` allocator statistics (against the iteration
    only; with --log-memory-to-tensorboard),
    each also against consumed samples (``... vs samples``); ``iteration-time`` in seconds and, with
    --log-throughput, ``throughput`` (TFLOP/s per rank), against the iteration only; ``lm loss validation`` and
    ``lm loss validation ppl``, each also ``vs samples``. A no-op without a directory."""

    #: record key -> (Megatron-LM's tag, factor from the record's unit to Megatron-LM's, also written vs samples)
    TAGS = {"loss": ("lm loss", 1.0, True), "lr": ("learning-rate", 1.0, True),
            "grad_norm": ("grad-norm", 1.0, True), "loss_scale": ("loss-scale", 1.0, True),
            "batch_size": ("batch-size", 1.0, True), "tflops_per_rank": ("throughput", 1.0, False),
            "num_zeros": ("num-zeros", 1.0, True), "params_norm": ("params-norm", 1.0, True),
            "ms_per_iter": ("iteration-time", 1e-3, False),  # milliseconds in the record, seconds in Megatron-LM
            **{key: (key.replace("_", "-"), 1.0, False) for key in CUDA_MEMORY_STATS}}
    VALIDATION = {"eval_loss": "lm loss validation", "eval_ppl": "lm loss validation ppl"}

    def __init__(self, log_dir: str | None, interval: int = 1) -> None:
        self.writer = None
        self.interval = interval
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def log(self, rec: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        samples = rec.get("consumed_samples", step)
        if step % self.interval == 0 or step == 1:
            for key, (tag, factor, vs_samples) in self.TAGS.items():
                if isinstance(rec.get(key), (int, float)):
                    self.writer.add_scalar(tag, rec[key] * factor, step)
                    if vs_samples:
                        self.writer.add_scalar(f"{tag} vs samples", rec[key] * factor, samples)
        for key, tag in self.VALIDATION.items():
            if key in rec:
                self.writer.add_scalar(tag, rec[key], step)
                self.writer.add_scalar(f"{tag} vs samples", rec[key], samples)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
