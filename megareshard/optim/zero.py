"""ZeRO stages 0/1/2/3 as one optimizer wrapper, with fp32 master weights and loss scaling.

Every parameter is sharded along its first dimension over dp (``zero_shards.py`` gives the layout
and the buffers), so every piece of optimizer state, and at stage 3 the parameters themselves, is a
regular box of the full tensor: what reshardable checkpoints need.

Stages (``stage`` argument):

* 0 — no sharding: gradients all-reduced (averaged) over dp, every rank steps the full
  parameter. Same numbers as ``build_adamw`` + ``GradAverager``.
* 1 — optimizer state (fp32 master, exp_avg, exp_avg_sq) only for this rank's shard.
  Gradients are reduce-scattered into the shard (the full local ``param.grad`` buffers
  stay allocated, as in DeepSpeed stage 1 / Megatron's distributed optimizer); after the
  step the updated shards are all-gathered into the model parameters.
* 2 — as 1, and the full gradients are freed as soon as their bucket is packed for the
  reduce-scatter: only the fp32 shard gradient remains. With ``overlap_grad_reduce`` the
  reduce-scatter of a bucket starts from a post-accumulate-grad hook as soon as all of
  its gradients are produced (every microbatch, accumulating into the shard), so full
  gradients never pile up during backward.
* 3 — as 2, and the parameters too: between uses each parameter keeps only its rows (``shard``);
  a layer's parameters are all-gathered just before its forward and again before its backward,
  freed after, and its gradients reduce-scattered as soon as its backward (or its delayed weight
  gradients) has produced them. ``megareshard.optim.zero3`` holds that mechanism; it needs the
  model (``module``) to hook its layers. No all-gather follows the step: the next use gathers.

Master weights: when the model parameter is fp32, the master shard IS a view of the
parameter's own rows (no copy; at stage 3 it is the parameter's shard); when it is bf16/fp16
(mixed precision with low-precision parameters) the master is a separate fp32 copy of the shard
and the model's rows (stage 3: its shard) are refreshed from it after every step. The inner
optimizer is ``torch.optim.AdamW`` on the master shards (fused on GPU, foreach on CPU; apex
``FusedAdam`` when importable on GPU and asked for), with the decay / no-decay groups of
``build_adamw`` — so the step semantics are exactly AdamW's.

Per iteration::

    opt.zero_grad()
    for mb in microbatches: opt.scale_loss(loss(mb)).backward()   # scale_loss: ×loss scale (fp16), else identity
    sync_sequence_parallel_grads(model, ctx)   # (and tied-embedding all-reduce) BEFORE the dp reduction
    opt.finish_grad_sync()                     # dp reduction (bucketed), unscale, fp32 shard grads
    grad_norm = opt.clip_grads(max_norm)       # fp32 0-d tensor, across dp shards and model-parallel ranks
    stepped = opt.step()                       # False when an overflow skipped it on every rank
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..parallel import ParallelContext
from ..parallel.collectives import all_gather_into, reduce_scatter_into
from .grad_scaler import LossScaler
from .zero_norms import count_zeros, over_the_model, sum_of_squares
from .zero_shards import Bucket, ShardEntry, ShardInfo, pack_grads, unpack_rows

__all__ = ["ZeroOptimizer", "ShardInfo", "apex_fused_adam_available", "adamw_kind", "build_zero_optimizer"]

logger = logging.getLogger("megareshard")

#: gradient reductions a hook-driven stage (2 with overlap, 3) keeps in flight before it waits for the oldest:
#: each holds its bucket's packed gradients, which would otherwise pile up over the microbatches
MAX_INFLIGHT_REDUCTIONS = 2  # planner/costs.py holds the same number


def apex_fused_adam_available() -> bool:
    """True when apex's FusedAdam can be imported and a GPU is present (never required)."""
    if not torch.cuda.is_available():
        return False
    try:
        from apex.optimizers import FusedAdam  # noqa: F401
    except Exception:
        return False
    return True


def adamw_kind(on_gpu: bool, apex_usable: bool) -> str:
    """The AdamW implementation for the master shards: apex's FusedAdam when usable on a GPU, else PyTorch's
    fused kernel on a GPU, PyTorch's foreach on a CPU (where fused AdamW is slower than foreach)."""
    if on_gpu:
        return "apex" if apex_usable else "fused"
    return "foreach"


def default_defer(name: str, p: torch.nn.Parameter, pipeline: bool = True) -> bool:
    """Gradients that get another all-reduce before the dp reduction: sequence-parallel parameters (over tp),
    the tied word embedding and its output-layer copy (between the first and the last stage: ``pipeline``)."""
    return bool(getattr(p, "sequence_parallel", False)) or (
        pipeline and ("word_embeddings" in name or name.startswith("output_layer")))


class ZeroOptimizer:
    """AdamW over dp-sharded fp32 master weights (ZeRO stage 0, 1, 2 or 3). See the module docstring.

    Stage 3 takes the model as ``module`` (the parameters of ``named_params`` must be its own) and
    ``reshard_after_forward`` / ``keep_params_for_step`` / ``param_persistence_threshold`` (see
    ``megareshard.optim.zero3``).
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], ctx: ParallelContext, *,
                 stage: int = 1, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 bucket_bytes: int = 25 * 2 ** 20, grad_reduce_dtype: torch.dtype = torch.float32,
                 loss_scaler: LossScaler | None = None, overlap_grad_reduce: bool = False,
                 is_no_decay: Callable[[str, torch.nn.Parameter], bool] | None = None,
                 defer_grad_reduce: Callable[[str, torch.nn.Parameter], bool] | None = None,
                 decoupled: Callable[[str, torch.nn.Parameter], bool] | None = None,
                 use_apex: bool = False, module: torch.nn.Module | None = None,
                 reshard_after_forward: bool = True, keep_params_for_step: bool = False,
                 param_persistence_threshold: int = 0) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        if overlap_grad_reduce and stage not in (2, 3):
            raise ValueError("overlap_grad_reduce needs ZeRO stage 2 or 3 (it frees each gradient once reduced; "
                             "stages 0/1 reduce once, in finish_grad_sync)")
        if stage == 3 and module is None:
            raise ValueError("ZeRO stage 3 needs the model (module=...): it gathers each layer's parameters around "
                             "the layer's forward and backward")
        if stage == 3 and ctx.dp_size < 2:
            raise ValueError(f"ZeRO stage 3 shards parameters over data parallelism, but dp is {ctx.dp_size}")
        named_params = list(named_params)
        self.ctx, self.stage = ctx, stage
        self.dp = ctx.dp_size
        self.shard_dp = self.dp if stage >= 1 else 1
        self.shard_rank = ctx.dp_rank() if stage >= 1 else 0
        # MoE expert weights (``expert_box`` set: models/moe/experts.py) are replicated over the expert-data-parallel
        # group only: their gradients are summed there (divided by dp, like every gradient: Megatron's scaling) and,
        # at stages 1/2, their optimizer state is sharded over it; at stage 3 the weights themselves (zero3.py: units
        # of their own, gathered from that group)
        self.edp = ctx.edp_size
        self.expert_shard_dp = self.edp if stage >= 1 else 1
        self.expert_shard_rank = ctx.edp_rank() if stage >= 1 else 0
        self.grad_reduce_dtype = grad_reduce_dtype
        self.loss_scaler = loss_scaler
        # stage 3 reduces each layer's gradients from its hooks whatever the flag: the flag changes nothing there
        self.overlap_grad_reduce = overlap_grad_reduce and stage == 2
        self.num_skipped_steps = 0
        self.last_step_skipped = False
        is_no_decay = is_no_decay or (lambda name, p: p.ndim < 2)
        # by default, gradients that get another all-reduce before the dp reduction never start early
        defer_grad_reduce = defer_grad_reduce or (lambda name, p: default_defer(name, p, ctx.pp_size > 1))
        tp, tp_rank = ctx.tp_size, ctx.tp_rank()
        self.entries: list[ShardEntry] = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            expert = getattr(p, "expert_box", None) is not None
            D, r = (self.expert_shard_dp, self.expert_shard_rank) if expert else (self.shard_dp, self.shard_rank)
            e = ShardEntry(name, p, D, r, tp, tp_rank, decay=not is_no_decay(name, p), sharded_params=stage == 3)
            e.defer = defer_grad_reduce(name, p)
            self.entries.append(e)
        if not self.entries:
            raise ValueError("ZeroOptimizer got no trainable parameters")
        self.by_name = {e.name: e for e in self.entries}
        self.sharder = None
        self._row_copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # _refresh_params's, below stage 3
        if stage == 3:  # units (one per layer): each one gather bucket and one reduce bucket (deferred: below)
            from .zero3 import ParamSharder

            self.sharder = ParamSharder(self, module, reshard_after_forward=reshard_after_forward,
                                        keep_params_for_step=keep_params_for_step,
                                        persistence_threshold=param_persistence_threshold)
            self.buckets = [b for u in self.sharder.units for b in u.reduce_buckets]
            rest = [e for e in self.entries if e.defer]
        else:
            self.buckets, rest = [], self.entries
        # buckets in reverse registration order (roughly the order backward produces gradients); expert weights
        # in buckets of their own (another group)
        self.has_experts = any(e.expert for e in self.entries)
        esize = torch.empty((), dtype=grad_reduce_dtype).element_size()
        for part in ([e for e in rest if not e.expert], [e for e in rest if e.expert]):
            current: list[ShardEntry] = []
            size = 0
            for e in reversed(part):
                nbytes = e.seg * self._dims(e)[0] * esize
                if current and (size + nbytes > bucket_bytes or e.param.dtype != current[0].param.dtype):
                    self.buckets.append(Bucket(current))
                    current, size = [], 0
                current.append(e)
                size += nbytes
            if current:
                self.buckets.append(Bucket(current))
        self._bucket_of = {id(e): (bi, k) for bi, b in enumerate(self.buckets) for k, e in enumerate(b.entries)}
        self._pending: list[tuple[Bucket, torch.Tensor, object]] = []

        decay = [e.master for e in self.entries if e.info.decay]
        no_decay = [e.master for e in self.entries if not e.info.decay]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if decoupled is not None:  # Megatron's --decoupled-lr: own groups (own learning rate) for these parameters
            own = {e.name for e in self.entries if decoupled(e.name, e.param)}
            groups = [{"params": [e.master for e in self.entries if (e.name in own) == dec and e.info.decay == d],
                       "weight_decay": weight_decay if d else 0.0, "decoupled": dec}
                      for dec in (False, True) for d in (True, False)]
        on_gpu = self.entries[0].param.is_cuda
        self.kind = adamw_kind(on_gpu, use_apex and on_gpu and apex_fused_adam_available())
        if self.kind == "apex":
            from apex.optimizers import FusedAdam
            self.inner = FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        else:
            self.inner = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=self.kind == "fused" or None,
                                           foreach=True if self.kind == "foreach" else None)
        self._hooks = []
        if self.overlap_grad_reduce:
            for e in self.entries:
                self._hooks.append(e.param.register_post_accumulate_grad_hook(self._make_hook(e)))

    @property
    def implementation(self) -> str:
        """Which AdamW steps the shards, in words (the start-up line)."""
        return {"apex": "optimizer step: apex's FusedAdam (one fused kernel)",
                "fused": "optimizer step: PyTorch's fused AdamW (one fused kernel)",
                "foreach": "optimizer step: PyTorch's foreach AdamW (multi-tensor ops)"}[self.kind] + \
            f", ZeRO stage {self.stage}"

    # ---- torch.optim-like surface (LRScheduler sets param_groups[i]["lr"]) ---------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def shard_infos(self) -> dict[str, ShardInfo]:
        return {e.name: e.info for e in self.entries}

    @property
    def params_sharded(self) -> bool:
        """Stage 3: the model's parameters hold no data between uses; their rows live in ``entry.shard``."""
        return self.sharder is not None

    @property
    def gathered_ptrs(self) -> set[int]:
        """Data pointers of the parameter storages gathered right now (stage 3; a live set, for activation
        meters to tell parameters from activations); empty below stage 3."""
        return self.sharder.gathered_ptrs if self.sharder is not None else set()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply by the loss scale (fp16); identity otherwise. Call on the loss before backward."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise RuntimeError("zero_grad with gradient reductions still in flight: call finish_grad_sync() first")
        for e in self.entries:
            e.param.grad = None
            e.master.grad = None
        for b in self.buckets:
            b.ready.clear()
            b.launched = 0

    @contextlib.contextmanager
    def full_params(self) -> Iterator[None]:
        """Stage 3: every parameter gathered inside the block (inspection, export); nothing to do below stage 3.
        Collective over the dp group."""
        if self.sharder is None:
            yield
            return
        with self.sharder.gathered():
            yield

    # ---- gradient reduction -------------------------------------------------------------------
    def _dims(self, x: ShardEntry | Bucket) -> tuple[int, int, object, int]:
        """(shard count, this rank's shard, the reduction group, its size) of an entry or a bucket: the dp group's,
        or for MoE expert weights the expert-data-parallel group's."""
        if x.expert:
            return self.expert_shard_dp, self.expert_shard_rank, self.ctx.edp_group, self.edp
        return self.shard_dp, self.shard_rank, self.ctx.dp_group, self.dp

    def _make_hook(self, entry: ShardEntry):
        def hook(param: torch.Tensor) -> None:
            bi, k = self._bucket_of[id(entry)]
            b = self.buckets[bi]
            if b.defer:
                return
            b.ready.add(k)
            if len(b.ready) == len(b.entries):
                self._launch(b, bounded=True)
        return hook

    def _launch(self, b: Bucket, bounded: bool = False) -> None:
        """Pack the bucket's local gradients (zero-padded chunks), start its async reduction. ``bounded`` (from
        hooks, every microbatch): first wait for the oldest reductions beyond ``MAX_INFLIGHT_REDUCTIONS``."""
        D, _, group, n = self._dims(b)
        if bounded:
            while len(self._pending) >= MAX_INFLIGHT_REDUCTIONS:
                self._retire_oldest()
        flat = pack_grads(b, D, self.grad_reduce_dtype, b.entries[0].param.device)
        if self.stage != 1:
            for e in b.entries:
                e.param.grad = None         # stages 0, 2, 3: the reduced buffer replaces it
        b.ready.clear()
        b.launched += 1
        if n == 1:
            out, work = flat, None
        elif D == 1:                        # stage 0: all-reduce
            out, work = flat, dist.all_reduce(flat, group=group, async_op=True)
        else:
            out = torch.empty(b.seg, dtype=flat.dtype, device=flat.device)
            work = reduce_scatter_into(out, flat, group=group, async_op=True)
        self._pending.append((b, out, work))

    def _retire_oldest(self) -> None:
        b, out, work = self._pending.pop(0)
        if work is not None:
            work.wait()
        self._unpack(b, out)

    def _unpack(self, b: Bucket, out: torch.Tensor) -> None:
        if self.dp > 1:
            out.div_(self.dp)
        if self.loss_scaler is not None:
            out.mul_(self.loss_scaler.inv_scale)
        for e, rows in zip(b.entries, torch.split(out, b.split)[::2]):
            piece = rows.view(e.master.shape)
            if e.master.grad is None:
                e.master.grad = piece.to(torch.float32) if piece.dtype != torch.float32 else piece
            else:
                e.master.grad.add_(piece)

    def launch_reduction(self, b: Bucket) -> None:
        """Start the reduction of ``b`` now if it holds gradients (ZeRO-3: a layer's backward finished)."""
        if b.has_grads():
            self._launch(b, bounded=True)

    def start_grad_sync(self, deferred: bool | None = None) -> None:
        """Launch the reduction of every bucket holding gradients not yet launched (non-blocking), in bucket
        order. ``deferred=False``: only the buckets free of parameters that get another reduction first
        (sequence-parallel, tied embedding: ``defer_grad_reduce``); ``True``: only those; None: all.
        At stage 3 this ends the step's use of the parameters: any layer kept gathered is freed first."""
        if self.sharder is not None:
            self.sharder.end_step()
        for b in self.buckets:
            if deferred is not None and b.defer != deferred:
                continue
            if b.has_grads() and (self.stage != 1 or b.launched == 0):
                self._launch(b)

    def finish_grad_sync(self) -> None:
        """Reduce all remaining gradients over dp and wait: afterwards every master shard has its fp32,
        dp-averaged, unscaled gradient (zeros for parameters that got none). Call once per iteration,
        after the last backward (under delayed weight gradients: after the stage's last W)."""
        self.start_grad_sync()
        while self._pending:
            self._retire_oldest()
        for e in self.entries:
            if e.master.grad is None:
                e.master.grad = torch.zeros_like(e.master)

    def materialize_param_grads(self) -> None:
        """For inspection (tests, debugging): after ``finish_grad_sync``, put every local parameter's
        dp-averaged, unscaled gradient on ``param.grad`` in the parameter's dtype — all-gathering
        the row shards over dp at stages 1/2/3. Costs a full gradient of memory; not for the hot path."""
        for e in self.entries:
            D, _, group, _ = self._dims(e)
            grad = e.master.grad if e.master.grad is not None else torch.zeros_like(e.master)
            if D > 1:
                padded = torch.zeros(e.chunk, e.row_size, dtype=grad.dtype, device=grad.device)
                padded[:e.stop - e.start] = grad.reshape(-1, e.row_size)
                full = torch.empty(D * e.chunk, e.row_size, dtype=grad.dtype, device=grad.device)
                all_gather_into(full, padded, group=group)
                grad = full[:e.rows]
            e.param.grad = grad.reshape(e.param.shape).to(e.param.dtype).clone()

    # ---- norm, overflow, step -------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        return [e.master.grad for e in self.entries if e.master.grad is not None]

    def grad_norm_tensor(self) -> torch.Tensor:
        """Global L2 norm (fp32, a 0-d tensor on the gradients' device, no host read) of the gradients of the full
        model, each element counted once (`zero_norms.over_the_model`). Per-shard norms come from one multi-tensor kernel
        (``torch._foreach_norm``, as ``torch.nn.utils.clip_grad_norm_`` computes them), not two kernels a shard."""
        return over_the_model(self, lambda e: e.master.grad, sum_of_squares).sqrt()

    def param_norm_tensor(self) -> torch.Tensor:
        """Global L2 norm (fp32, 0-d, no host read) of the model's parameters — the fp32 master weights, each
        element once (Megatron-LM's ``calc_params_l2_norm`` for ``--log-params-norm``)."""
        return over_the_model(self, lambda e: e.master, sum_of_squares).sqrt()

    def grad_zeros_tensor(self) -> torch.Tensor:
        """How many elements of the gradients of the full model are exactly zero (fp64, 0-d, no host read), each
        element once (Megatron-LM's ``count_zeros_fp32`` for ``--log-num-zeros-in-grad``)."""
        return over_the_model(self, lambda e: e.master.grad, count_zeros)

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Clip the sharded gradients to ``max_norm`` (0 disables) without reading anything on the host; returns
        the norm before clipping (a 0-d fp32 tensor). The gradients are multiplied by
        ``max_norm / (norm + 1e-6)`` (computed in fp64, as the host would) when the norm is finite and above
        ``max_norm``, else by exactly 1: a non-finite norm (fp16 overflow) leaves them alone, ``step()`` skips."""
        total = self.grad_norm_tensor()
        if max_norm > 0:
            wide = total.double()
            coef = torch.where(torch.isfinite(wide) & (wide > max_norm), max_norm / (wide + 1e-6),
                               torch.ones_like(wide)).float()
            torch._foreach_mul_(self._master_grads(), coef)
        return total

    def clip_grad_norm(self, max_norm: float) -> float:
        """``clip_grads`` with the norm read on the host."""
        return self.clip_grads(max_norm).item()

    def found_inf(self) -> bool:
        """Any inf/nan in any rank's gradient shard (all-reduced MAX over the whole world): one multi-tensor
        check of every shard (``torch._amp_foreach_non_finite_check_and_unscale_`` at scale 1), one host read."""
        grads = [g for g in self._master_grads() if g.numel()]
        dev = self.entries[0].master.device
        flag = torch.zeros((), dtype=torch.float32, device=dev)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, torch.ones((), device=dev))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @torch.no_grad()
    def step(self) -> bool:
        """One AdamW step on the shards, then refresh the model parameters (all-gather for stages 1/2; the
        shards at stage 3). With a loss scaler: an overflow anywhere skips the step on every rank, lowers the
        scale and returns False."""
        if self._pending:
            raise RuntimeError("step() with gradient reductions in flight: call finish_grad_sync() first")
        if self.loss_scaler is not None:
            overflow = self.found_inf()
            old = self.loss_scaler.scale
            self.loss_scaler.update(overflow)
            if overflow:
                self.num_skipped_steps += 1
                self.last_step_skipped = True
                logger.warning("gradient overflow: step skipped on all ranks; loss scale %g -> %g",
                               old, self.loss_scaler.scale)
                for e in self.entries:
                    e.master.grad = None
                return False
        self.last_step_skipped = False
        self.inner.step()
        self._refresh_params()
        return True

    def _refresh_params(self) -> None:
        """Copy master shards into the model's rows (when not views) and all-gather over dp; at stage 3 into the
        parameters' shards, which the next use gathers."""
        if self.sharder is not None:
            copies = [(e.shard, e.master) for e in self.entries if not e.master_is_view]
        else:   # views made once: a parameter's storage stays (an fp32 parameter's master is a view of it too)
            if self._row_copies is None:
                self._row_copies = [(e.param_rows()[e.start:e.stop], e.master.view(e.stop - e.start, e.row_size))
                                    for e in self.entries if not e.master_is_view and e.stop > e.start]
            copies = self._row_copies
        if copies:  # one multi-tensor copy (fp32 masters into bf16/fp16 rows), not a kernel per parameter
            torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])
        if self.sharder is not None:
            return
        pending = []
        for b in self.buckets:
            D, rank, group, _ = self._dims(b)
            if D == 1:
                continue
            dev = b.entries[0].param.device
            send = torch.empty(b.seg, dtype=b.dtype, device=dev)
            for e, off in zip(b.entries, b.offsets):
                n = e.stop - e.start
                if n:
                    send[off:off + n * e.row_size].copy_(e.param_rows()[e.start:e.stop].reshape(-1))
                if n < e.chunk:  # padding: never read back, but defined bytes on the wire
                    send[off + n * e.row_size:off + e.seg].zero_()
            recv = torch.empty(D * b.seg, dtype=b.dtype, device=dev)
            pending.append((b, recv, D, rank, all_gather_into(recv, send, group=group, async_op=True)))
        for b, recv, D, rank, work in pending:
            work.wait()
            unpack_rows(recv.view(D, b.seg), b, D, skip_rank=rank)

    @torch.no_grad()
    def reload_master_from_model(self) -> None:
        """After loading model weights into low-precision params (stage 3: their shards): refresh the separate
        fp32 masters."""
        for e in self.entries:
            if not e.master_is_view:
                src = e.shard if self.sharder is not None else e.param_rows()[e.start:e.stop]
                e.master.copy_(src.reshape(e.master.shape))

    # ---- accounting -----------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        """Stage 3: the parameters' shards held between uses (a parameter's own storage is empty then); none
        below stage 3, where the model's parameters hold the data."""
        return self.sharder.shard_buffers() if self.sharder is not None else []

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors that exist only for the optimizer: separate fp32 masters and the Adam state."""
        out = [e.master for e in self.entries if not e.master_is_view]
        for st in self.inner.state.values():
            out.extend(v for v in st.values() if torch.is_tensor(v))
        return out

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient this optimizer holds: model ``.grad`` buffers and the fp32 shard grads."""
        seen, out = set(), []
        for e in self.entries:
            for g in (e.param.grad, e.master.grad):
                if g is not None and id(g) not in seen:
                    seen.add(id(g))
                    out.append(g)
        return out

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Keyed by parameter NAME; every tensor is this rank's shard, described by ``shards[name]``
        (global shape and offset of the box, see ``ShardInfo``) so it can be resharded."""
        state = {}
        for e in self.entries:
            st = self.inner.state.get(e.master, {})
            entry = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            entry["master"] = e.master.detach().clone()
            state[e.name] = entry
        groups = []
        for g in self.inner.param_groups:
            names = [e.name for e in self.entries if any(e.master is q for q in g["params"])]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        return {"zero_stage": self.stage, "dp_size": self.shard_dp, "state": state, "param_groups": groups,
                "shards": {e.name: asdict(e.info) for e in self.entries},
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
                "num_skipped_steps": self.num_skipped_steps}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Load a state dict of the SAME sharding (names and shard shapes must match); also writes the
        masters into the model parameters (stage 3: their shards) and all-gathers them. Resharding to another
        layout is the checkpoint layer's job (it uses ``shards`` / ``shard_infos``)."""
        missing = [e.name for e in self.entries if e.name not in sd["state"]]
        if missing:
            raise KeyError(f"optimizer state lacks parameters {missing[:5]}{'…' if len(missing) > 5 else ''}")
        for e in self.entries:
            st = sd["state"][e.name]
            if tuple(st["master"].shape) != tuple(e.master.shape):
                raise ValueError(f"{e.name}: saved shard shape {tuple(st['master'].shape)} != this rank's "
                                 f"{tuple(e.master.shape)} (different dp/tp layout: reshard first)")
            e.master.copy_(st["master"])
            new = {}
            for k, v in st.items():
                if k == "master":
                    continue
                new[k] = v.detach().clone().to(e.master.device) if torch.is_tensor(v) and k != "step" else \
                    (v.detach().clone() if torch.is_tensor(v) else v)
            if new:
                self.inner.state[e.master] = new
        for g, sg in zip(self.inner.param_groups, sd["param_groups"]):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        if self.loss_scaler is not None and sd.get("loss_scaler"):
            self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.num_skipped_steps = int(sd.get("num_skipped_steps", 0))
        self._refresh_params()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.sharder is not None:
            self.sharder.remove_hooks()


def build_zero_optimizer(model: torch.nn.Module, ctx: ParallelContext, training_cfg, memory_cfg,
                         loss_scaler: LossScaler | None = None, *, pipeline: bool = False,
                         **kwargs) -> ZeroOptimizer:
    """The trainer's constructor: hyper-parameters from ``TrainingConfig``, stage from ``MemoryConfig``.
    ``pipeline`` (pp > 1): at stage 3 without resharding after forward, a stage keeps its parameters gathered
    for the whole step (``keep_params_for_step``)."""
    t = training_cfg
    if getattr(t, "decoupled_lr", None) is not None:  # Megatron's --decoupled-lr: the input embedding and output layer
        kwargs.setdefault("decoupled", lambda name, p: "word_embeddings" in name or name.startswith("output_layer"))
    if memory_cfg.zero_stage == 3:
        reshard = getattr(memory_cfg, "torch_fsdp2_reshard_after_forward", True)
        kwargs.update(module=model, reshard_after_forward=reshard, keep_params_for_step=pipeline and not reshard,
                      param_persistence_threshold=getattr(memory_cfg, "zero3_param_persistence_threshold", 0))
    return ZeroOptimizer(model.named_parameters(), ctx, stage=memory_cfg.zero_stage, lr=t.lr,
                         weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                         loss_scaler=loss_scaler, **kwargs)
