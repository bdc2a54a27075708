"""A lean single-file peer for the GPU speed grid (issue #53 part 2), written here, importing nothing of megareshard's
model code: a nanoGPT-style GPT (learned positions, LayerNorm with bias, exact-GELU MLP of width ffn, biases, the
output tied to the word embedding) or a Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention, an untied output, no biases).

fp32 parameters, the forward under ``torch.autocast(bf16)``, ``F.scaled_dot_product_attention(is_causal=True)``
(grouped keys/values through its ``enable_gqa``, as megareshard's SDPA kernel does), ``F.cross_entropy`` on the
logits, ``torch.optim.AdamW`` (fused on CUDA) with megareshard's defaults read from the parsed config (lr, betas,
eps, weight decay on the ≥2-D parameters only, as Megatron-LM), ``clip_grad_norm_`` at ``--clip-grad`` (1.0),
gradients accumulated over the global batch's micro batches, and the whole model under one ``torch.compile``.
The shapes are those of megareshard's parsed config for the grid point (`Shape.from_config`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    llama: bool
    vocab: int
    seq: int
    positions: int
    hidden: int
    layers: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    eps: float
    rope_base: float

    @classmethod
    def from_config(cls, m, family: str) -> "Shape":
        """The shapes of megareshard's ModelConfig ``m``; its architecture must be the family's (else ValueError)."""
        llama = family == "llama"
        want = (("RMSNorm", "rope", True, True, True) if llama else ("LayerNorm", "learned_absolute", False, False,
                                                                      False))
        got = (m.normalization, m.position_embedding_type, m.swiglu, m.untie_embeddings_and_output_weights,
               m.disable_bias_linear)
        if (got != want or m.apply_layernorm_1p or m.qk_layernorm or m.add_qkv_bias or m.openai_gelu or m.num_experts
                or m.rotary_percent != 1.0):
            raise ValueError(f"the lean {family} peer has no counterpart of this config: {got} (wanted {want})")
        pad = m.make_vocab_size_divisible_by  # megareshard pads the vocabulary (tp 1) as Megatron-LM does
        return cls(llama, -(-m.vocab_size // pad) * pad, m.seq_length, m.max_position_embeddings or m.seq_length,
                   m.hidden_size, m.num_layers, m.num_attention_heads,
                   m.query_groups if m.group_query_attention else m.num_attention_heads,
                   m.kv_channels or m.hidden_size // m.num_attention_heads, m.ffn_hidden_size, m.norm_epsilon,
                   m.rotary_base)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves rotated (Megatron-LM's and Llama's non-interleaved form); x: (b, heads, s, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s, bias = s, not s.llama
        Norm = (lambda n: nn.RMSNorm(n, eps=s.eps)) if s.llama else (lambda n: nn.LayerNorm(n, eps=s.eps))
        self.norm1, self.norm2 = Norm(s.hidden), Norm(s.hidden)
        self.qkv = nn.Linear(s.hidden, (s.heads + 2 * s.groups) * s.head_dim, bias=bias)
        self.proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=bias)
        self.fc1 = nn.Linear(s.hidden, (2 if s.llama else 1) * s.ffn, bias=bias)  # SwiGLU: gate and up, one matrix
        self.fc2 = nn.Linear(s.ffn, s.hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        s, (b, t, _) = self.s, x.shape
        q, k, v = self.qkv(self.norm1(x)).split([s.heads * s.head_dim, s.groups * s.head_dim,
                                                 s.groups * s.head_dim], dim=-1)
        q, k, v = (y.view(b, t, -1, s.head_dim).transpose(1, 2) for y in (q, k, v))
        if cos is not None:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.groups != s.heads)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.fc1(self.norm2(x))
        if s.llama:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.fc2(h)


class LeanModel(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.wte = nn.Embedding(s.vocab, s.hidden)
        self.wpe = None if s.llama else nn.Embedding(s.positions, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden, eps=s.eps) if s.llama else nn.LayerNorm(s.hidden, eps=s.eps)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False) if s.llama else None  # GPT: tied to wte
        if s.llama:
            inv = 1.0 / s.rope_base ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim)
            ang = torch.outer(torch.arange(s.seq, dtype=torch.float32), inv).repeat(1, 2)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation: residual outputs scaled by 1/√(2L)
            if p.ndim >= 2:
                std = 0.02 / math.sqrt(2 * s.layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe.weight[: idx.size(1)]
        cos, sin = (self.cos, self.sin) if self.s.llama else (None, None)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.norm(x)
        logits = self.head(x) if self.head is not None else x @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def build(cfg, family: str, device: torch.device, *, compile_backend: str | None = "inductor"):
    """(model, step): the lean model of megareshard's config ``cfg`` on ``device`` (compiled whole with
    ``compile_backend``, None: eager) and ``step()``, one training iteration of the global batch on mock tokens."""
    s = Shape.from_config(cfg.model, family)
    t = cfg.training
    torch.manual_seed(t.seed)
    with device:
        model = LeanModel(s)
    model.train()
    run = torch.compile(model, backend=compile_backend, dynamic=False) if compile_backend else model
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                            fused=True if device.type == "cuda" else None)
    mbs, n_micro = t.micro_batch_size, t.global_batch_size // t.micro_batch_size
    gen = torch.Generator(device=device).manual_seed(t.seed)

    def step() -> torch.Tensor:
        for _ in range(n_micro):
            tokens = torch.randint(0, s.vocab, (mbs, s.seq + 1), device=device, generator=gen)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = run(tokens[:, :-1], tokens[:, 1:]) / n_micro
            loss.backward()
        if t.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, t.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return model, step
