"""Greedy generation with a key/value cache, tensor-parallel: the generator replicas' sampler (issue #50).

    ids = greedy_kv(model, prompt_ids, max_new_tokens=16)     # every rank of the model's tp group calls it

``model`` is a whole `GPTModel` (pp 1) at any tp, built on a context whose tp group holds the replica's ranks;
eval mode, no dropout. The prompt is run once (prefill) and every new token then costs one position: each
layer keeps its keys and values (``[b, groups/tp, s, d]``, this rank's key/value heads) and attends the new
query to them. Every tp rank computes its heads and the row-parallel projections sum over the tp group as in
training; the last position's logits shards are all-gathered so that every rank picks the same token.

The result equals `megareshard.generation.generate_ids` (no cache, one process) on the same weights: within the
model's ``seq_length`` the positions are the same; past it `generate_ids` runs the last ``seq_length`` tokens
afresh at positions 0.., so the cache is rebuilt from that window at every such step (prefill of the window).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .models import GPTModel
from .models import fusion
from .models.components import apply_rotary, rotary_cos_sin

__all__ = ["KVCache", "forward_cached", "greedy_kv"]


class KVCache:
    """Per layer: this rank's keys and values so far, ``[b, groups/tp, s, d]``; ``length`` positions."""

    def __init__(self) -> None:
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.length = 0


def _attention_step(attn, x: torch.Tensor, cache: KVCache, key: str, pos: int) -> torch.Tensor:
    """`ParallelAttention.forward` for the positions ``pos .. pos + s - 1`` of ``x [s, b, h]`` given the cached
    keys and values of positions ``0 .. pos - 1`` (which it extends)."""
    qkv = attn.qkv(x)
    s, b, _ = qkv.shape
    per = attn.heads_per_group
    qkv = qkv.view(s, b, attn.groups_local, per + 2, attn.head_dim)
    q = qkv[:, :, :, :per].reshape(s, b, attn.heads_local, attn.head_dim)
    k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]
    q, k = attn.norm_qk(q, k)                                      # --qk-layernorm (the identity without)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))          # [b, heads (groups), s, d]
    if attn.rotary_dim:
        cos, sin = rotary_cos_sin(pos + s, attn.rotary_dim, attn.rotary_base, device=q.device, dtype=q.dtype)
        cos, sin = cos[pos:], sin[pos:]
        rotary = apply_rotary if attn.rope_fusion else fusion.apply_rotary_unfused
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
    if pos:
        k = torch.cat((cache.k[key], k), dim=2)
        v = torch.cat((cache.v[key], v), dim=2)
    cache.k[key], cache.v[key] = k, v
    if pos == 0:   # the prompt: causal attention, the model's own kernel
        ctx = fusion.attention(q, k, v, kernel=attn.kernel, fused_softmax=attn.masked_softmax_fusion)
    else:          # new positions see every cached one and the earlier new ones
        total = k.size(2)
        mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(diagonal=total - s)
        gqa = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=None if s == 1 else mask, **gqa)
    ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, attn.heads_local * attn.head_dim)
    return attn.proj(ctx)


@torch.no_grad()
def forward_cached(model: GPTModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The logits shard ``[b, s, V_pad/tp]`` of ``tokens [b, s]`` at positions ``cache.length ..``; extends the
    cache. The model must be whole (pp 1), without sequence parallelism, in eval mode."""
    if not (model.pre_process and model.post_process) or model.sequence_parallel:
        raise ValueError("greedy_kv needs a whole model (pp 1) without sequence parallelism")
    pos = cache.length
    b, s = tokens.shape
    emb = model.embedding
    x = emb.word_embeddings(tokens.t())                             # [s, b, h]
    if emb.position_embeddings is not None:
        x = x + emb.position_embeddings.weight[pos:pos + s].unsqueeze(1)
    for key, layer in model.layers.items():
        x = layer._dropout_add(_attention_step(layer.attention, layer.input_layernorm(x), cache, key, pos), x)
        x = layer._dropout_add(layer.mlp(layer.post_attention_layernorm(x)), x)
    cache.length = pos + s
    return model._logits(x).transpose(0, 1)


def _next_token(model: GPTModel, logits_shard: torch.Tensor) -> int:
    """Greedy pick over the whole vocabulary from this rank's shard of the last position's logits: the shards are
    all-gathered over the tp group, so every rank picks the same token (padding columns cut)."""
    last = logits_shard[:, -1].float().contiguous()                 # [b, V_pad/tp]
    ctx = model.ctx
    if ctx.tp_size > 1:
        parts = [torch.empty_like(last) for _ in range(ctx.tp_size)]
        dist.all_gather(parts, last, group=ctx.tp_group)
        last = torch.cat(parts, dim=-1)
    return int(torch.argmax(last[0, :model.vocab_size].cpu()))


@torch.no_grad()
def greedy_kv(model: GPTModel, prompt: list[int], *, max_new_tokens: int, eod: int | None = None) -> list[int]:
    """Extend ``prompt`` by up to ``max_new_tokens`` greedy tokens with a key/value cache (module docstring);
    returns prompt + continuation. Every rank of the model's tp group calls it with the same prompt."""
    if not prompt:
        raise ValueError("the prompt encodes to no tokens: give some text")
    device = next(model.parameters()).device
    window = model.cfg.seq_length
    ids = list(prompt)
    cache, fed = KVCache(), 0      # fed: how many of ids the cache holds (from ids[-window:] when it slid)
    for _ in range(max_new_tokens):
        if len(ids) > window or fed == 0:   # (re)prefill: the prompt, or the window once it slides
            cache, ctx_ids = KVCache(), ids[-window:]
            logits = forward_cached(model, torch.tensor([ctx_ids], dtype=torch.long, device=device), cache)
        else:
            logits = forward_cached(model, torch.tensor([ids[fed:]], dtype=torch.long, device=device), cache)
        fed = len(ids)
        nxt = _next_token(model, logits)
        ids.append(nxt)
        if eod is not None and nxt == eod:
            break
    return ids
