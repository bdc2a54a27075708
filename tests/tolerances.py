"""Tolerances derived from the arithmetic for comparing two fp32 training runs that reduce
gradients in different orders (ZeRO vs plain data parallelism, buckets, reduce-scatter).

Such runs agree to rounding, not bitwise, and by how much depends on the CPU's kernels, so
a fixed relative tolerance is either loose or fails on another machine. What is bounded
here is the parameter error Adam can build up:

* Adam's step lr·m̂/(sqrt(v̂)+eps) does not depend on the scale of the gradients, so its
  relative error is that of the gradient elements. Each is the sum of dp × microbatches
  (<= 8 in these tests) contributions made by the same arithmetic in both runs and reduced
  in another order: <= 8 units of roundoff, magnified by cancellation between contributions
  of opposite sign (kappa = sum|g_r| / |sum g_r|). Allowing kappa <= 16 gives `RHO` = 128u.
  A gradient of pure rounding noise (kappa -> infinity, e.g. the attention key bias, which
  softmax ignores) is not covered: tests check it apart. The clip coefficient scales a
  step's gradients alike, which the normalisation cancels.
* |m̂/sqrt(v̂)| <= `adam_step_bound(t)` at step t whatever the gradients, so one update moves
  an element by at most lr·that, and its error is at most RHO times it; weight decay only
  contracts errors. Over n elements the norm-wise error is at most sqrt(n) times the
  per-element bound.
* A loss evaluated at parameters that differ by at most D (norm) moves, to first order, by
  |gradient|·D.
"""
from __future__ import annotations

import math
from typing import Sequence

U = 2.0 ** -24  # unit roundoff of fp32
RHO = 128 * U  # relative error of one Adam update (module docstring)


def adam_step_bound(t: int, betas: tuple[float, float]) -> float:
    """max |m̂/sqrt(v̂)| at step t (1-based), by Cauchy-Schwarz on the moment sums:
    (1-b1)/(1-b1^t) · sqrt((1-b2^t)/(1-b2)) · sqrt(sum_{k<t} (b1²/b2)^k)."""
    b1, b2 = betas
    r = b1 * b1 / b2
    return (1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2)) * math.sqrt(sum(r ** k for k in range(t)))


def element_error_bounds(lrs: Sequence[float], betas: tuple[float, float], rho: float = RHO) -> list[float]:
    """Per-element parameter error bound before each step (index t: after t updates, so
    [0] == 0) and, last, after all of them; `lrs` the learning rate of each step; `rho` the relative
    error of the gradient elements (default `RHO`: fp32 sums in another order)."""
    out = [0.0]
    for t, lr in enumerate(lrs, start=1):
        out.append(out[-1] + lr * rho * adam_step_bound(t, betas))
    return out


def forward_tolerance(reductions: int, scale: float, kappa: float = 4.0) -> float:
    """Largest difference expected between two fp32 forwards of the same model and weights through different
    kernels (another library's, another summation order).

    Each sum of n products is computed to within n·u of the sum of its terms' magnitudes, whatever the order;
    along the forward the first-order errors of the sums one output depends on add up, so an output differs by
    at most u · (the lengths of those sums, ``reductions``) · the size of its terms. That size is taken as the
    outputs' largest magnitude, ``scale``, times ``kappa`` for the cancellation between terms (norms and
    softmax keep activations of order one, so terms exceed their sums by a small factor)."""
    return kappa * reductions * U * scale


def gpt_forward_reductions(num_layers: int, hidden: int, ffn: int, heads: int, head_dim: int, seq: int) -> int:
    """The summed lengths of the sums a GPT logit depends on: per layer the two norms (hidden each), QKV
    (hidden), the scores (head_dim), softmax and its weighted sum (seq, twice), the projection (heads·head_dim),
    the MLP (hidden, ffn); then the final norm and the output layer (hidden each)."""
    per_layer = 2 * hidden + hidden + head_dim + 2 * seq + heads * head_dim + hidden + ffn
    return num_layers * per_layer + 2 * hidden
