"""The trainer's gradient reductions after the backward (`GradientReductions`, a mix-in of the `Trainer`, which
holds the state they read: ``cfg``, ``ctx``, ``model``, ``optimizer``, ``pipeline``, ``dp``): sequence-parallel over
tp, the tied embedding over its two ends, data-parallel through the optimizer (at once, or started by the pipeline's
R action), and the data-parallel mean of a logged value.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .optim.numerics import grad_norms
from .pipeline.stage import reduce_tied_grad_across_layouts
from .tensor_parallel import sync_sequence_parallel_grads

__all__ = ["GradientReductions"]


class GradientReductions:
    def _dp_mean_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the data-parallel replicas (a new tensor; the all-reduce launched, not read)."""
        if self.dp > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.ctx.dp_group)
            value = value / self.dp
        return value

    def _dp_mean(self, value: torch.Tensor) -> float:
        return self._dp_mean_tensor(value).item()

    def finalize_grads(self) -> None:
        """Gradient reductions after the backward: sequence-parallel (tp), data-parallel, tied embedding.

        With pp > 1 the pipeline runtime calls this right after the stage's last W (or B).
        """
        ctx = self.ctx
        with self._activity(f"stage {ctx.pp_rank()} gradient reduction (peers: data-parallel ranks "
                            f"{list(ctx.group_ranks.get('dp', ()))}, tied-embedding ranks "
                            f"{list(ctx.group_ranks.get('embedding', ()))})"):
            if self.model.sequence_parallel:
                sync_sequence_parallel_grads(self.model, ctx)
            self._reduce_tied_embedding()  # before the dp reduction, which may free full gradients (ZeRO 2)
            if self.cfg.training.check_for_nan_in_loss_and_grad and not self.cfg.memory.overlap_grad_reduce:
                # this rank's gradient norms (on the device, read only if the check fails): its own first
                # non-finite gradient, before the reduction spreads it to every replica
                self._nonfinite_before_reduction = grad_norms(self.model.named_parameters())
            self.optimizer.finish_grad_sync()

    def start_stage_grad_reduce(self, stage: int) -> None:
        """The pipeline's R action (--overlap-grad-reduce, pp > 1): start stage ``stage``'s data-parallel gradient
        reduction without waiting; ``train_step`` waits for it before clipping and the step.

        The same reductions as ``finalize_grads``, bucket for bucket: first the buckets that need no other
        reduction, so they travel while the blocking ones run — the sequence-parallel all-reduce (tp) and the
        tied-embedding all-reduce (first + last stage, which waits for the other end) — then the rest.
        """
        held = self.pipeline.stages
        if stage not in held:
            raise RuntimeError(f"rank {self.ctx.rank} holds pipeline stage(s) {list(held)}, not stage {stage}")
        # with virtual stages one mesh's buckets span all of its chunks: the reduction starts at the R of the
        # mesh's last stage to finish (per-chunk buckets are not built)
        self._stages_reduced.add(stage)
        if len(self._stages_reduced) < len(held):
            return
        self._stages_reduced.clear()
        self.optimizer.start_grad_sync(deferred=False)
        if self.model.sequence_parallel:
            sync_sequence_parallel_grads(self.model, self.ctx)
        self._reduce_tied_embedding()
        self.optimizer.start_grad_sync()
        self._grad_reduce_started = True

    def _reduce_tied_embedding(self) -> None:
        """Sum the two copies' gradients of the word embedding tied to the output layer.

        The first stage's lookup and the last stage's output layer each produce part of
        the gradient of one tied weight; after the sum both copies take identical steps.
        """
        ctx = self.ctx
        if ctx.pp_size == 1 or not (ctx.is_first_stage() or ctx.is_last_stage()):
            return
        if not getattr(self.model, "tied_embedding", True):  # e.g. the U-Transformer: untied head
            return
        place = self.pipeline.placement if self.pipeline is not None else None
        if place is not None and place[0] == place[-1]:  # zbv: both ends on one mesh share one Parameter
            return
        if place is not None and (place[0], place[-1]) != (0, ctx.pp_size - 1):  # pragma: no cover
            raise RuntimeError(f"the first and last stage sit on meshes {place[0]} and {place[-1]}; the tied "
                               f"embedding is reduced over pp ranks 0 and {ctx.pp_size - 1}")
        w = self.model.output_weight()
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        if ctx.per_stage_layouts:  # first and last stage shard the vocabulary over different tp
            reduce_tied_grad_across_layouts(w, ctx, self.cfg.model.vocab_size)
            return
        dist.all_reduce(w.grad, group=ctx.embedding_group)
