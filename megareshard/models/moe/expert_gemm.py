"""The experts' GEMMs with delayable weight gradients (the MoE counterpart of ``LinearWithWeightGradStore``).

``expert_linear(x, weight, bias, counts, owner)``: rows ``x [N, in]`` grouped by local expert (``counts[e]``
rows each), ``weight [E, out, in]``, ``bias [E, out]`` or None -> ``[N, out]``, row block e times expert e's
matrix. One GEMM per expert (a loop over experts, never over tokens) or, with ``grouped``, one
``torch._grouped_mm`` for all of them. Backward computes the input gradient at once; the weight (and bias)
gradient at once, or — when ``owner.wgrad_store`` is set at backward time (a pipeline's I under delayed weight
gradients, ``pipeline/step_actions.py``) — later, queued in that store and run by the schedule's W, which
accumulates it into ``weight.grad`` / ``bias.grad``. Both paths run the same ``wgrad`` function, so a delayed
gradient equals an immediate one bit for bit, as the dense linear layers' do.

Weight gradient: expert e's ``g_eᵀ x_e`` (``[out, in]``, zeros for an expert that got no row), stacked; grouped,
``_grouped_mm(gᵀ, x, offs)`` (the ragged-K form, one ``[out, in]`` block per expert). Bias gradient: each
expert's rows of ``g`` summed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ExpertLinear", "expert_linear"]


def _accumulate(param: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(param.dtype)
    if param.grad is None:
        param.grad = g
    else:
        param.grad += g


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor(counts, device=device, dtype=torch.int64).cumsum(0).to(torch.int32)


def _row_experts(counts: list[int], device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device),
                                   output_size=sum(counts))


class ExpertLinear(torch.autograd.Function):
    """``x [N, in]``, ``weight [E, out, in]``, ``bias [E, out]`` | None -> ``[N, out]`` (module docstring)."""

    @staticmethod
    def forward(fctx, x, weight, bias, counts, owner, grouped):
        dev = x.device.type
        xc, wc, bc = x, weight, bias
        if torch.is_autocast_enabled(dev):   # autocast does not reach a Function's backward: cast here, as
            dtype = torch.get_autocast_dtype(dev)   # LinearWithWeightGradStore does
            xc, wc, bc = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        with torch.autocast(dev, enabled=False):
            if grouped:
                out = torch._grouped_mm(xc, wc.transpose(1, 2), offs=_offsets(counts, x.device))
                if bc is not None:
                    out = out + bc[_row_experts(counts, x.device)]
            else:
                outs = [F.linear(xe, wc[e], None if bc is None else bc[e]) for e, xe in enumerate(xc.split(counts))]
                out = torch.cat(outs)
        fctx.save_for_backward(xc, wc)
        fctx.x_dtype = x.dtype
        # the parameters themselves, for the delayed accumulation (a saved tensor unpacks as another object)
        fctx.params = (weight, bias)
        fctx.counts, fctx.owner, fctx.grouped = list(counts), owner, grouped
        return out

    @staticmethod
    def backward(fctx, grad_out):
        x, w = fctx.saved_tensors
        weight, bias = fctx.params
        counts, grouped = fctx.counts, fctx.grouped
        grad_out = grad_out.to(w.dtype).contiguous()
        grad_x = None
        if fctx.needs_input_grad[0]:
            if grouped:
                grad_x = torch._grouped_mm(grad_out, w, offs=_offsets(counts, x.device))
            else:
                grad_x = torch.cat([ge.matmul(w[e]) for e, ge in enumerate(grad_out.split(counts))])
            grad_x = grad_x.to(fctx.x_dtype)
        need_w = fctx.needs_input_grad[1]
        need_b = bias is not None and fctx.needs_input_grad[2]
        if not (need_w or need_b):
            return grad_x, None, None, None, None, None

        def wgrad() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            gw = gb = None
            if grouped:
                if need_w:
                    gw = torch._grouped_mm(grad_out.t(), x, offs=_offsets(counts, x.device))
                if need_b:
                    gb = torch.zeros_like(bias).index_add_(0, _row_experts(counts, x.device), grad_out.to(bias.dtype))
            else:
                pairs = list(zip(grad_out.split(counts), x.split(counts)))
                if need_w:
                    gw = torch.stack([ge.t().matmul(xe) for ge, xe in pairs])
                if need_b:
                    gb = torch.stack([ge.sum(dim=0) for ge, _ in pairs])
            return (None if gw is None else gw.to(weight.dtype)), (None if gb is None else gb.to(bias.dtype))

        store = getattr(fctx.owner, "wgrad_store", None)
        if store is None:
            gw, gb = wgrad()
            return grad_x, gw, gb, None, None, None

        def delayed() -> None:
            gw, gb = wgrad()
            if gw is not None:
                _accumulate(weight, gw)
            if gb is not None:
                _accumulate(bias, gb)
        store.put(delayed)
        return grad_x, None, None, None, None, None


def expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: list[int],
                  owner: object, grouped: bool = False) -> torch.Tensor:
    """``ExpertLinear`` (module docstring); ``owner.wgrad_store`` is read at backward time. Called from the MoE
    layer's routed part, which runs outside compiled regions (``layer._routed``)."""
    return ExpertLinear.apply(x, weight, bias, list(counts), owner, grouped)
