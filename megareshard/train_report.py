"""What the trainer reports beside each iteration's log line: the closing summary, the compile time, the
profiler's trace, memory per stage, measured and simulated activations and the pipeline trace (`Reporting`,
a mix-in of the `Trainer`, which holds the state it reads: ``cfg``, ``ctx``, ``records``, ``memory``,
``pipeline``, ``out``).
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .pipeline import memory_view
from .pipeline.traces import gather_trace, write_trace
from .tracking import format_duration

__all__ = ["Reporting", "MOE_LOSS_NAMES"]

#: the router losses an MoE run logs beside the LM loss (Megatron-LM's names, its tracker's order)
MOE_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


class Reporting:
    """The trainer's reports (module docstring)."""

    # ---- mixture of experts: the router losses (Megatron-Core's aux-loss tracker) ----------------------------
    def _moe_routers(self) -> list[Any]:
        """The model's MoE routers (modules with an ``aux_loss_scale`` and a ``tracked`` record: models/moe)."""
        if getattr(self, "_routers", None) is None:
            self._routers = [m for m in self.model.modules() if hasattr(m, "aux_loss_scale") and hasattr(m, "tracked")]
        return self._routers

    def _start_moe_step(self, num_microbatches: int) -> None:
        """Before a step's forwards: the gradient the router losses get, Megatron's ``MoEAuxLossAutoScaler.
        set_loss_scale(loss scale / micro-batches)`` (the LM loss of a micro-batch is divided by their number
        too), and a fresh record of the losses."""
        scale = self.optimizer.loss_scale / num_microbatches
        for r in self._moe_routers():
            r.aux_loss_scale = scale
            r.tracked = {}

    def _moe_step_loss_sums(self, num_microbatches: int) -> torch.Tensor | None:
        """After the backward: each router loss as Megatron's tracker reduces it — per layer the sum over the
        micro-batches divided by their number, summed over tp (load balancing: each tp rank holds its part) or
        averaged over it (z-loss), averaged over dp, then the mean over the model's MoE layers, those of every
        pipeline stage (a stage sums its layers' values and counts them; the sums and counts are added over pp).
        Returns the sums then the counts, on the device (the reductions launched, nothing read: the trainer reads
        them with the iteration's other numbers; `moe_losses` makes the record); None without MoE.
        Collective over tp, dp and pp: every rank of an MoE run calls it, a stage without MoE layers too."""
        if self.cfg.model.num_experts is None:
            return None
        routers, ctx = self._moe_routers(), self.ctx
        sums = torch.zeros(len(MOE_LOSS_NAMES), dtype=torch.float32, device=self.device)
        counts = torch.zeros(len(MOE_LOSS_NAMES), dtype=torch.float32, device=self.device)
        for r in routers:
            for i, n in enumerate(MOE_LOSS_NAMES):
                if n in r.tracked:
                    sums[i] += torch.stack(r.tracked[n]).float().sum() / num_microbatches
                    counts[i] += 1
        if ctx.tp_size > 1:
            dist.all_reduce(sums, group=ctx.tp_group)
            sums[MOE_LOSS_NAMES.index("z_loss")] /= ctx.tp_size
        if ctx.dp_size > 1:
            dist.all_reduce(sums, group=ctx.dp_group)
            sums /= ctx.dp_size
        if ctx.pp_size > 1:
            both = torch.cat([sums, counts])
            if ctx.per_stage_layouts:   # the pp group is the world: each stage's values once, from one rank
                if ctx.tp_rank() != 0 or ctx.dp_rank() != 0:
                    both.zero_()
                dist.all_reduce(both)
            else:
                dist.all_reduce(both, group=ctx.pp_group)
            return both
        return torch.cat([sums, counts])

    @staticmethod
    def moe_losses(values: list[float]) -> dict[str, float]:
        """The router losses of the record from `_moe_step_loss_sums`'s values, read: each sum over its count."""
        k = len(MOE_LOSS_NAMES)
        return {n: float(s / c) for n, s, c in zip(MOE_LOSS_NAMES, values[:k], values[k:]) if c > 0}

    @staticmethod
    def _with_moe_losses(line: str, rec: dict[str, Any]) -> str:
        """The log line with the router losses after the LM loss, where Megatron-LM prints them."""
        parts = [f"{n}: {rec[n]:.6E}" for n in MOE_LOSS_NAMES if n in rec]
        return line.replace(" | grad norm:", " | " + " | ".join(parts) + " | grad norm:", 1) if parts else line

    def _print_summary(self, first_iteration: int, totals: dict[str, int]) -> None:
        """The closing line: iterations, tokens, time, the final loss (and validation loss), skipped and NaN counts."""
        t = self.cfg.training
        ran = self.iteration - first_iteration
        seconds = time.monotonic() - self._train_start
        tokens = ran * t.global_batch_size * self.cfg.model.seq_length
        last = self.records[-1]
        evals = [r["eval_loss"] for r in self.records if "eval_loss" in r]
        how = "done" if self.iteration >= t.train_iters else f"stopped at iteration {self.iteration} of {t.train_iters}"
        print(f" training {how}: {ran} iterations ({first_iteration + 1}-{self.iteration}), {tokens:,} tokens in "
              f"{format_duration(seconds)} ({tokens / max(seconds, 1e-9):,.0f} tokens/s); final lm loss "
              f"{last['loss']:.6E}" + (f", last validation lm loss {evals[-1]:.6E}" if evals else "")
              + f"; {totals['skipped']} skipped and {totals['nan']} nan iterations", file=self.out, flush=True)

    def _report_compile_time(self, elapsed: float) -> None:
        """With compiled regions: the first iteration's time (it compiles them), and after the second, how much of
        it was compiling (the first iteration's time less the second's)."""
        if not self.compiled_regions or not self.reporting or self.iteration > 2:
            return
        if self.iteration == 1:
            self._first_iteration_s = elapsed
            print(f" torch.compile: the first iteration took {elapsed:.1f} s, compiling included", file=self.out,
                  flush=True)
        elif hasattr(self, "_first_iteration_s"):
            print(f" torch.compile: about {self._first_iteration_s - elapsed:.1f} s of the first iteration was "
                  f"compiling (first {self._first_iteration_s:.2f} s, second {elapsed:.2f} s)", file=self.out,
                  flush=True)

    def _start_profiler(self):
        """--profile: a PyTorch profiler trace of iterations [--profile-step-start, --profile-step-end)."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        profiler.__enter__()
        return profiler

    def _stop_profiler(self, profiler) -> None:
        profiler.__exit__(None, None, None)
        out_dir = self.cfg.logging.tensorboard_dir or os.getcwd()
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"profile_rank{self.ctx.rank}.json")
        profiler.export_chrome_trace(path)
        if self.ctx.rank == 0:
            print(f" profiler trace of iterations {self.cfg.logging.profile_step_start + 1}-{self.iteration} written "
                  f"to {path} (one file per rank; open in Perfetto or chrome://tracing)", file=self.out, flush=True)

    def _memory_lines(self) -> str:
        """Measured memory per stage (MAX over each stage's ranks): the first stage usually runs out first."""
        mib = 2 ** 20
        lines = [" memory per rank after the first iteration (MiB, MAX over each stage's ranks; optimizer = separate "
                 "fp32 masters and AdamW's moments; activations = peak saved for backward):"]
        for i, m in enumerate(self.memory):
            lines.append(f"   stage {i}: params {m.params / mib:.1f} | grads {m.grads / mib:.1f} | optimizer "
                         f"{m.optimizer / mib:.1f} | activations {m.activations / mib:.1f} | total {m.total / mib:.1f}")
        worst = max(range(len(self.memory)), key=lambda i: self.memory[i].total)
        if len(self.memory) > 1:
            lines.append(f"   largest: stage {worst} ({self.memory[worst].total / mib:.1f} MiB)")
        return "\n".join(lines)

    def _show_activations(self) -> None:
        """Pipeline runs: every stage's measured and simulated peak activations in one line and in the trace."""
        records: list[dict[str, Any]] = []
        if self.pipeline is not None and self.records and self.memory is not None:
            measured = memory_view.inflight_per_stage(self.ctx, self.pipeline.last_stats, self.device)  # collective
            if self.reporting or self.cfg.pipeline.pipeline_trace is not None:  # where the numbers are shown
                simulated = memory_view.simulated_inflight(self.pipeline, self.plan.num_microbatches)
                nbytes = [m.activations for m in self.memory]
                if self.reporting:
                    print(memory_view.summary_line(nbytes, measured, simulated), file=self.out, flush=True)
                records = memory_view.memory_records(nbytes, measured, simulated)
        self._write_trace(records)

    def _write_trace(self, memory: list[dict[str, Any]] = ()) -> None:
        path = self.cfg.pipeline.pipeline_trace
        if path is None or self.pipeline is None:
            return
        merged = gather_trace(self.ctx, self.pipeline.last_trace)
        if merged is not None:
            write_trace(path, merged + list(memory))
            print(f" pipeline trace of the last iteration ({len(merged)} records) written to {path}; draw it with "
                  f"tools/plot_schedule.py --trace {path}", file=self.out, flush=True)
