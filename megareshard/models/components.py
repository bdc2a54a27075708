"""Building blocks of the GPT's architecture options: RMSNorm, rotary embeddings, MLP activations.

All are whole-tensor operations (no Python loop over tokens or heads):

* ``RMSNorm`` — Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019):
  ``x / sqrt(mean(x²) + eps) · weight``, computed in fp32 and cast back (as Megatron-LM and
  Hugging Face's Llama do).
* Rotary position embeddings — Su et al., "RoFormer: Enhanced Transformer with Rotary
  Position Embedding" (2021), in the non-interleaved ("rotate half") form Megatron-LM and
  Llama use: channel ``i`` of the first half pairs with channel ``i + rot/2``; with
  ``rotary_percent < 1`` only the first ``rot`` channels of a head rotate.
* SwiGLU — Shazeer, "GLU Variants Improve Transformer" (2020): ``silu(gate) · up``.
* Zero-centred gamma (Megatron-LM's ``--apply-layernorm-1p``): the norm's stored scale is ``gamma − 1``,
  initialised to zeros, and the forward multiplies by ``weight + 1``. Weight decay then pulls the scale
  towards one, not zero; the stored tensor is what Megatron-LM stores, so its checkpoints map as they are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "LayerNorm1P", "rotary_cos_sin", "apply_rotary", "swiglu", "gelu"]


class RMSNorm(nn.Module):
    """Root-mean-square normalization over the last dim with a learned scale (no bias, no centring).

    ``zero_centered_gamma``: the parameter holds ``scale − 1`` (zeros at init) and the forward uses
    ``weight + 1`` (``--apply-layernorm-1p``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, device=None, dtype: torch.dtype = torch.float32,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps)
        return normed.to(x.dtype) * (self.weight + 1 if self.zero_centered_gamma else self.weight)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}" + (", zero_centered_gamma" if self.zero_centered_gamma else "")


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm whose stored scale is zero-centred (``--apply-layernorm-1p``): the parameter holds
    ``gamma − 1`` (zeros at init), the forward scales by ``weight + 1``; the bias is as usual. The
    parameters keep ``nn.LayerNorm``'s names (``weight``, ``bias``)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def rotary_cos_sin(seq_length: int, rotary_dim: int, base: float, *, device=None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` tables ``[seq_length, rotary_dim]`` for positions ``0..seq_length-1``.

    Frequencies ``base^(-2i/rot)`` for ``i < rot/2``, each used by two channels (``i`` and
    ``i + rot/2``); computed in fp32 and cast to ``dtype``.
    """
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even number >= 2, got {rotary_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    positions = torch.arange(seq_length, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.size(-1)`` channels of ``t [..., s, d]`` by position; the rest pass through."""
    rot = cos.size(-1)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    first, second = t_rot.chunk(2, dim=-1)
    rotated = t_rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, t_pass), dim=-1) if t_pass.size(-1) else rotated


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: ``silu(gate) · up``."""
    return F.silu(gate) * up


def gelu(x: torch.Tensor, openai: bool = False) -> torch.Tensor:
    """GELU: exact (erf), or GPT-2's tanh approximation with ``openai=True`` (Megatron's ``--openai-gelu``)."""
    return F.gelu(x, approximate="tanh" if openai else "none")
