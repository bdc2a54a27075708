"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding.

Every parameter is created from its FULL tensor (``init_method(full_shape)``, generated
deterministically on the CPU) and then sliced to this tp rank, so any layout built from
the same initialiser holds the same full model (Megatron's CPU-initialisation idea).

Parameters carry the attributes downstream code (optimiser, checkpoints, grad sync)
needs instead of guessing from names:

* ``tensor_model_parallel`` (bool), ``partition_dim`` (int, -1 when replicated),
  ``partition_stride`` (int; always 1 here),
* ``sequence_parallel`` (bool): replicated over tp but, under sequence parallelism, its
  gradient is computed from this rank's sequence chunk only and must be all-reduced
  over tp (``sync_sequence_parallel_grads``).

The linear core is ``LinearWithWeightGradStore``, an autograd Function whose backward
computes the input gradient at once and the weight gradient either at once or, when the
layer has a ``wgrad_store`` attached, later: it enqueues a closure that accumulates
into ``param.grad`` (delayed weight gradients for zero-bubble style pipeline schedules).
Inside a compiled region (``--torch-compile``) that Function runs eagerly, as a graph break
(``compile_boundary``); a layer marked ``traceable`` (no weight gradient of the run is ever
delayed) is a plain ``F.linear`` instead, which the compiler traces with its neighbours.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..compile_boundary import outside_compiled_regions
from ..parallel import ParallelContext
from .mappings import (copy_to_tp_region, gather_from_sequence_parallel_region, gather_from_tp_region,
                       reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region, scatter_to_tp_region,
                       split_dim)

__all__ = ["WeightGradStore", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "LinearWithWeightGradStore", "linear_with_wgrad_store", "padded_vocab_size",
           "set_tensor_model_parallel_attributes", "InitMethod", "default_init", "scaled_init_std"]

logger = logging.getLogger("megareshard")

InitMethod = Callable[[tuple[int, ...]], torch.Tensor]
"""Returns the FULL (unsharded) fp32 CPU tensor of the given shape."""


def default_init(std: float = 0.02, seed: int = 0) -> InitMethod:
    """Normal(0, std) from a private generator: deterministic and independent of global RNG."""
    def init(shape: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.empty(shape).normal_(0.0, std, generator=g)
    return init


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Smallest multiple of ``divisible_by × tp`` that is >= ``vocab`` (logged when it pads)."""
    if vocab < 1 or divisible_by < 1 or tp < 1:
        raise ValueError(f"vocab {vocab}, divisible_by {divisible_by} and tp {tp} must all be >= 1")
    multiple = divisible_by * tp
    padded = -(-vocab // multiple) * multiple
    if padded != vocab:
        logger.info("padded vocab %d -> %d (multiple of %d × tp %d)", vocab, padded, divisible_by, tp)
    return padded


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1, sequence_parallel: bool = False) -> None:
    param.tensor_model_parallel = bool(is_parallel)
    param.partition_dim = int(dim) if is_parallel else -1
    param.partition_stride = int(stride)
    param.sequence_parallel = bool(sequence_parallel)


def _shard_param(full: torch.Tensor, ctx: ParallelContext, dim: int, device, dtype) -> nn.Parameter:
    """This rank's shard of ``full`` in its own storage: a view (a dim-0 slice, on the device ``full`` is already
    on) would keep the whole unsharded tensor alive with it."""
    local = split_dim(full, ctx, dim) if dim >= 0 else full
    return nn.Parameter(local.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True))


# ---- delayed weight gradients ------------------------------------------------------------
class WeightGradStore:
    """FIFO of weight-gradient closures enqueued by backward, run later by ``flush()``.

    A pipeline schedule attaches one store per stage (``layer.wgrad_store = store``);
    the input-gradient backward (I) then returns at once and ``flush()`` (W) computes
    every queued weight gradient. Results equal a plain backward exactly.
    """

    def __init__(self) -> None:
        self._queue: deque[Callable[[], None]] = deque()

    def put(self, fn: Callable[[], None]) -> None:
        self._queue.append(fn)

    def flush(self) -> int:
        """Run every queued closure in FIFO order; returns how many ran. Without autograd: the saved inputs
        still require grad, and a weight-gradient GEMM recorded would keep them (and build a graph) for
        nothing."""
        n = 0
        with torch.no_grad():
            while self._queue:
                self._queue.popleft()()
                n += 1
        return n

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)


def _accumulate(param: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(param.dtype)
    if param.grad is None:
        param.grad = g
    else:
        param.grad += g


class LinearWithWeightGradStore(torch.autograd.Function):
    """``y = x @ W.T + b`` whose weight gradient may be delayed into ``owner.wgrad_store``.

    ``owner`` is any object with a ``wgrad_store`` attribute, read at *backward* time so a
    schedule can switch delaying on and off between microbatches. Under autocast the
    inputs are cast to the autocast dtype here (autocast does not reach a Function's
    backward), and gradients are returned in the parameters' own dtype.
    """

    @staticmethod
    def forward(fctx, x, weight, bias, owner):
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dtype = torch.get_autocast_dtype(dev)
            xc, wc = x.to(dtype), weight.to(dtype)
            bc = bias.to(dtype) if bias is not None else None
        else:
            xc, wc, bc = x, weight, bias
        with torch.autocast(dev, enabled=False):
            out = F.linear(xc, wc, bc)
        fctx.save_for_backward(xc, wc)
        fctx.params = (weight, bias)
        fctx.owner = owner
        fctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(fctx, grad_out):
        xc, wc = fctx.saved_tensors
        weight, bias = fctx.params
        grad_out = grad_out.to(wc.dtype)
        grad_x = None
        if fctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(wc).to(fctx.x_dtype)
        need_w = fctx.needs_input_grad[1]
        need_b = bias is not None and fctx.needs_input_grad[2]
        if not (need_w or need_b):
            return grad_x, None, None, None

        def wgrad() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            g2 = grad_out.reshape(-1, grad_out.size(-1))
            gw = g2.t().matmul(xc.reshape(-1, xc.size(-1))).to(weight.dtype) if need_w else None
            gb = g2.sum(dim=0).to(bias.dtype) if need_b else None
            return gw, gb

        store = getattr(fctx.owner, "wgrad_store", None)
        if store is None:
            gw, gb = wgrad()
            return grad_x, gw, gb, None

        def delayed() -> None:
            gw, gb = wgrad()
            if gw is not None:
                _accumulate(weight, gw)
            if gb is not None:
                _accumulate(bias, gb)
        store.put(delayed)
        return grad_x, None, None, None


@outside_compiled_regions
def linear_with_wgrad_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            owner: object) -> torch.Tensor:
    return LinearWithWeightGradStore.apply(x, weight, bias, owner)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner) -> torch.Tensor:
    """The layer's product: traced ``F.linear`` when the layer is ``traceable``, else the delayable Function."""
    if owner.traceable:
        return F.linear(x, weight, bias)
    return linear_with_wgrad_store(x, weight, bias, owner)


# ---- layers --------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with A split along its output columns: rank r computes ``Y[..., r-th chunk]``.

    Input ``[s, b, in]`` replicated over tp (or ``[s/tp, b, in]`` sequence-sharded when
    ``sequence_parallel``: it is all-gathered along s first, and the input gradient is
    reduce-scattered back). Output ``[s, b, out/tp]``, or the full ``[s, b, out]`` with
    ``gather_output``. ``skip_weight_param_allocation`` lets the caller pass a weight at
    forward time (the output layer tied to the word embedding).
    """

    def __init__(self, input_size: int, output_size: int, ctx: ParallelContext, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, skip_weight_param_allocation: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp = ctx.tp_size
        if output_size % tp:
            raise ValueError(f"ColumnParallelLinear: output size {output_size} is not divisible by "
                             f"tensor-parallel size {tp}")
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output with sequence_parallel is not supported")
        self.ctx, self.input_size, self.output_size = ctx, input_size, output_size
        self.output_size_per_partition = output_size // tp
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel and tp > 1
        self.wgrad_store: WeightGradStore | None = None
        self.traceable = False  # set by regional compilation when no weight gradient is ever delayed
        init_method = init_method or default_init()
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = _shard_param(init_method((output_size, input_size)), ctx, 0, device, dtype)
            set_tensor_model_parallel_attributes(self.weight, True, 0)
        if bias:
            self.bias = _shard_param(torch.zeros(output_size), ctx, 0, device, dtype)
            set_tensor_model_parallel_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)

    def map_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as every tp rank needs it: all-gathered along s (sequence parallel), else the
        identity whose backward all-reduces the input gradient over tp.

        Column-parallel layers sharing one input (SwiGLU's gate and up projections) map it once
        and pass ``input_mapped=True``: one all-gather forward and one reduction backward (the
        input gradients of both layers are summed by autograd before it)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.ctx, tensor_parallel_output_grad=True)
        return copy_to_tp_region(x, self.ctx)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, *,
                input_mapped: bool = False) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("ColumnParallelLinear built with skip_weight_param_allocation needs a weight")
        if weight.shape != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"weight shape {tuple(weight.shape)} != expected "
                             f"({self.output_size_per_partition}, {self.input_size})")
        if not input_mapped:
            x = self.map_input(x)
        out = _linear(x, weight, self.bias, self)
        return gather_from_tp_region(out, self.ctx) if self.gather_output else out

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (local {self.output_size_per_partition}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with A split along its input rows: rank r computes a partial ``X_r A_r``.

    Input ``[s, b, in/tp]`` (already split, e.g. a column-parallel output) or, without
    ``input_is_parallel``, the full input which is split here. The partial products are
    all-reduced (output ``[s, b, out]`` replicated) or, with ``sequence_parallel``,
    reduce-scattered along s (output ``[s/tp, b, out]``). The bias is replicated and
    added after the reduction; under sequence parallelism its gradient covers only this
    rank's sequence chunk, so it is marked ``sequence_parallel`` (all-reduce over tp).
    The bias gradient is never delayed (it is a cheap reduction, not a GEMM).
    """

    def __init__(self, input_size: int, output_size: int, ctx: ParallelContext, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp = ctx.tp_size
        if input_size % tp:
            raise ValueError(f"RowParallelLinear: input size {input_size} is not divisible by "
                             f"tensor-parallel size {tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.ctx, self.input_size, self.output_size = ctx, input_size, output_size
        self.input_size_per_partition = input_size // tp
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel and tp > 1
        self.wgrad_store: WeightGradStore | None = None
        self.traceable = False  # set by regional compilation when no weight gradient is ever delayed
        init_method = init_method or default_init()
        self.weight = _shard_param(init_method((output_size, input_size)), ctx, 1, device, dtype)
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            self.bias = _shard_param(torch.zeros(output_size), ctx, -1, device, dtype)
            set_tensor_model_parallel_attributes(self.bias, False, -1, sequence_parallel=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.ctx)
        partial = _linear(x, self.weight, None, self)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.ctx)
        else:
            out = reduce_from_tp_region(partial, self.ctx)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (local {self.input_size_per_partition}), out={self.output_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary rows are split over tp.

    Each rank looks up the tokens in its row range, writes zeros for the others, and the
    partial embeddings are all-reduced (or, with ``reduce_scatter_output``, reduce-
    scattered along dim 0 straight into the sequence-parallel region — then pass
    ``[s, b]`` tokens). Rows ``>= num_embeddings`` are padding: initialised to zero and
    never looked up, so they never change the model's function.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext, *,
                 padded_num_embeddings: int | None = None, init_method: InitMethod | None = None,
                 reduce_scatter_output: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp = ctx.tp_size
        padded = padded_num_embeddings if padded_num_embeddings is not None else num_embeddings
        if padded < num_embeddings or padded % tp:
            raise ValueError(f"VocabParallelEmbedding: padded vocabulary {padded} must be >= {num_embeddings} "
                             f"and divisible by tensor-parallel size {tp}")
        self.ctx, self.num_embeddings, self.padded_num_embeddings = ctx, num_embeddings, padded
        self.embedding_dim = embedding_dim
        self.reduce_scatter_output = reduce_scatter_output and tp > 1
        per = padded // tp
        self.vocab_start, self.vocab_end = ctx.tp_rank() * per, (ctx.tp_rank() + 1) * per
        init_method = init_method or default_init()
        full = torch.zeros(padded, embedding_dim)
        full[:num_embeddings] = init_method((num_embeddings, embedding_dim))
        self.weight = _shard_param(full, ctx, 0, device, dtype)
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        self.weight.unpadded_rows = num_embeddings  # gather_full_state_dict drops the padding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size > 1:
            outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
            local = (tokens - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(tokens, self.weight)
        if self.reduce_scatter_output:
            return reduce_scatter_to_sequence_parallel_region(out, self.ctx)
        return reduce_from_tp_region(out, self.ctx)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local rows "
                f"[{self.vocab_start}, {self.vocab_end})), dim={self.embedding_dim}")


def scaled_init_std(std: float, num_layers: int) -> float:
    """GPT-2/Megatron: residual-output projections get std / sqrt(2 · num_layers)."""
    return std / math.sqrt(2.0 * num_layers)
