"""The GPT's Llama-family options against straightforward references, single process.

* RMSNorm, rotary embeddings (an explicit per-position, per-pair rotation), SwiGLU, the tanh
  GELU and grouped-query attention against textbook formulas;
* the whole Llama-style model (RMSNorm, RoPE, SwiGLU, GQA, untied, no bias; and a variant with
  kv_channels, partial rotary and a QKV bias) against a reference forward written from the
  gathered weights with einsum, complex rotations and an explicit causal softmax;
* untied output layer, pipeline stages, delayed weight gradients, recomputation, autocast;
* ``--apply-layernorm-1p``: LayerNorm and RMSNorm store gamma − 1 (zeros at init) and compute exactly
  what the plain norm computes with the scale weight + 1;
* configuration errors name the numbers (model fields and command-line flags).

Tolerances: fp32 with different summation orders; relative 1e-5 of the largest value
(the reductions are over at most a few hundred terms of O(1) values, so rounding stays
orders of magnitude below that).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megareshard.arguments import ConfigError, parse_args
from megareshard.models import GPTModel, check_gpt_config, gpt_flops_per_token
from megareshard.models.components import LayerNorm1P, RMSNorm, apply_rotary, gelu, rotary_cos_sin, swiglu
from megareshard.models.config import ModelConfig, swiglu_ffn_hidden_size
from megareshard.parallel import ParallelContext
from megareshard.tensor_parallel import WeightGradStore, gather_full_state_dict

SEED = 1234
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, group_query_attention=True,
             num_query_groups=2, untie_embeddings_and_output_weights=True, disable_bias_linear=True)
# wider variant: head width not h / heads, half the channels rotated, a QKV bias despite no other bias
LLAMA_WIDE = dict(LLAMA, num_attention_heads=8, num_query_groups=4, kv_channels=12, rotary_percent=0.5,
                  add_qkv_bias=True, rotary_base=500.0, norm_epsilon=1e-6)


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


def _batch(cfg: ModelConfig, b: int = 2):
    g = torch.Generator().manual_seed(7)
    return (torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g),
            torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g))


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= rtol * max(scale, 1e-30), f"{what}: max abs error {err:.3g} > {rtol} × {scale:.3g}"


# ---- building blocks ---------------------------------------------------------------------------
def test_rmsnorm_matches_formula_and_keeps_input_dtype_before_the_scale():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    _close(norm(x), ref, "RMSNorm fp32")
    assert [n for n, _ in norm.named_parameters()] == ["weight"]          # no bias
    out = norm(x.bfloat16())                                            # normalised in fp32, cast, then scaled
    _close(out.float(), ref, "RMSNorm bf16", rtol=2 ** -7)


def _rotary_loops(t: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """Reference: rotate channel pairs (i, i + rot/2) of position m by m·base^(-2i/rot), one at a time."""
    out = t.clone().double()
    s = t.shape[-2]
    for m in range(s):
        for i in range(rot // 2):
            theta = m * base ** (-2.0 * i / rot)
            a, b = t[..., m, i].double(), t[..., m, i + rot // 2].double()
            out[..., m, i] = a * math.cos(theta) - b * math.sin(theta)
            out[..., m, i + rot // 2] = a * math.sin(theta) + b * math.cos(theta)
    return out


def test_layernorm_1p_is_the_plain_norm_with_weight_plus_one():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=g) * 3 + 1
    ln1p, rms1p = LayerNorm1P(64, eps=1e-5), RMSNorm(64, 1e-5, zero_centered_gamma=True)
    assert not ln1p.weight.any() and not ln1p.bias.any() and not rms1p.weight.any()   # gamma − 1 starts at 0
    with torch.no_grad():
        for p in (ln1p.weight, ln1p.bias, rms1p.weight):
            p.copy_(torch.randn(64, generator=g) * 0.1)
    ln, rms = torch.nn.LayerNorm(64, eps=1e-5), RMSNorm(64, 1e-5)
    with torch.no_grad():
        ln.weight.copy_(ln1p.weight + 1)
        ln.bias.copy_(ln1p.bias)
        rms.weight.copy_(rms1p.weight + 1)
    assert torch.equal(ln1p(x), ln(x)) and torch.equal(rms1p(x), rms(x))    # the same arithmetic
    for norm in ("LayerNorm", "RMSNorm"):
        cfg = parse_args(["--mock-data", "--vocab-size", "100", "--normalization", norm, "--apply-layernorm-1p"],
                         world_size=1).model
        model = GPTModel(cfg, ParallelContext.single_process())
        names = [n for n, _ in model.named_parameters() if "layernorm.weight" in n]
        assert len(names) == 2 * cfg.num_layers + 1 and all(not dict(model.named_parameters())[n].any()
                                                            for n in names)


@pytest.mark.parametrize("rot, base", [(16, 10000.0), (8, 500.0)])
def test_rotary_matches_pairwise_rotation(rot, base):
    t = torch.randn(2, 3, 12, 16, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary_cos_sin(12, rot, base)
    got = apply_rotary(t, cos, sin)
    _close(got, _rotary_loops(t, rot, base), f"rotary rot {rot}")
    assert torch.equal(got[..., rot:], t[..., rot:])                     # partial rotary: the rest passes


def test_rotary_scores_depend_on_relative_position_only():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    cos, sin = rotary_cos_sin(12, 16, 10000.0, dtype=torch.float64)
    qs = apply_rotary(q.double().expand(12, 16), cos, sin)
    ks = apply_rotary(k.double().expand(12, 16), cos, sin)
    # same offset 4 (angles are computed in fp32: equal to its rounding, ~1e-7 × the largest angle)
    assert torch.allclose(qs[7] @ ks[3], qs[5] @ ks[1], rtol=1e-5)
    assert not torch.allclose(qs[7] @ ks[3], qs[7] @ ks[2], rtol=1e-3)


def test_rotary_refuses_an_odd_width():
    with pytest.raises(ValueError, match="rotary_dim must be an even number >= 2, got 5"):
        rotary_cos_sin(4, 5, 10000.0)


def test_swiglu_and_gelus_match_their_formulas():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 32, generator=g).double(), torch.randn(4, 32, generator=g).double()
    _close(swiglu(a, b), a * torch.sigmoid(a) * b, "swiglu")
    tanh_ref = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
    _close(gelu(a, openai=True), tanh_ref, "openai gelu")
    _close(gelu(a), 0.5 * a * (1 + torch.erf(a / math.sqrt(2))), "exact gelu")
    assert (gelu(a, openai=True) - gelu(a)).abs().max() > 1e-6             # they do differ


def _attention_reference(q, k, v):
    """Causal softmax attention with every key/value head repeated for its query heads, explicitly."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.size(2)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v.double()


def test_grouped_query_attention_core_matches_repeated_heads():
    cfg = _cfg(**LLAMA_WIDE)
    model = GPTModel(cfg, ParallelContext.single_process(), seed=SEED)
    attn = model.layers["0"].attention
    assert (attn.heads_local, attn.groups_local, attn.heads_per_group, attn.head_dim) == (8, 4, 2, 12)
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 8, 16, 12, generator=g), torch.randn(2, 4, 16, 12, generator=g), \
        torch.randn(2, 4, 16, 12, generator=g)
    _close(attn._core(q, k, v), _attention_reference(q, k, v), "GQA core")


# ---- the whole model against a reference forward ---------------------------------------------------
def _reference_logits(cfg: ModelConfig, p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Llama-style decoder from the gathered full weights, in float64, written independently of the model."""
    p = {k: v.double() for k, v in p.items()}
    H, G, d, eps = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.norm_epsilon
    rot = cfg.rotary_dim
    b, s = tokens.shape

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(t):                       # [b, heads, s, d]: pairs (i, i + rot/2) as complex numbers
        z = torch.complex(t[..., :rot // 2], t[..., rot // 2:rot])
        inv = cfg.rotary_base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        z = z * torch.polar(torch.ones(s, rot // 2, dtype=torch.float64), torch.arange(s)[:, None] * inv)
        return torch.cat([z.real, z.imag, t[..., rot:]], dim=-1)

    x = p["embedding.word_embeddings.weight"][tokens]                          # [b, s, h]
    for layer in range(cfg.num_layers):
        pre = f"layers.{layer}."
        y = rms(x, p[pre + "input_layernorm.weight"])
        qkv = y @ p[pre + "attention.qkv.weight"].t()
        if pre + "attention.qkv.bias" in p:
            qkv = qkv + p[pre + "attention.qkv.bias"]
        qkv = qkv.view(b, s, G, H // G + 2, d)                                  # Megatron's per-group layout
        q = qkv[:, :, :, :H // G].reshape(b, s, H, d).transpose(1, 2)
        k, v = qkv[:, :, :, H // G].transpose(1, 2), qkv[:, :, :, H // G + 1].transpose(1, 2)
        ctx = _attention_reference(rope(q), rope(k), v)                           # [b, H, s, d]
        x = x + ctx.transpose(1, 2).reshape(b, s, H * d) @ p[pre + "attention.proj.weight"].t()
        y = rms(x, p[pre + "post_attention_layernorm.weight"])
        gate, up = y @ p[pre + "mlp.fc1_gate.weight"].t(), y @ p[pre + "mlp.fc1_up.weight"].t()
        x = x + (gate * torch.sigmoid(gate) * up) @ p[pre + "mlp.fc2.weight"].t()
    return rms(x, p["final_layernorm.weight"]) @ p["output_layer.weight"].t()


@pytest.mark.parametrize("variant", [LLAMA, LLAMA_WIDE], ids=["llama", "llama-wide"])
def test_llama_model_matches_reference_forward(variant):
    cfg = _cfg(**variant)
    ctx = ParallelContext.single_process()
    model = GPTModel(cfg, ctx, seed=SEED)
    params = gather_full_state_dict(model, ctx)
    assert not any("bias" in n for n in params if "qkv" not in n)              # --disable-bias-linear
    assert ("layers.0.attention.qkv.bias" in params) == cfg.add_qkv_bias
    assert "embedding.position_embeddings.weight" not in params                # rope: no table
    assert params["layers.0.attention.qkv.weight"].shape == ((cfg.num_attention_heads + 2 * cfg.query_groups)
                                                             * cfg.head_dim, 64)
    if cfg.add_qkv_bias:                        # a bias starts at zero: give it values so it is exercised
        with torch.no_grad():
            for name, prm in model.named_parameters():
                if name.endswith("qkv.bias"):
                    prm.normal_(0, 0.5, generator=torch.Generator().manual_seed(9))
        params = gather_full_state_dict(model, ctx)
    tokens, labels = _batch(cfg)
    ref_logits = _reference_logits(cfg, params, tokens)
    logits = model(tokens)[..., :cfg.vocab_size]
    _close(logits, ref_logits, "logits")
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none")
    _close(model(tokens, labels), ref_loss.view_as(labels), "per-token loss")


def test_swiglu_default_width_and_flops_count():
    assert ModelConfig(hidden_size=4096, swiglu=True).ffn_hidden_size == swiglu_ffn_hidden_size(4096) == 10880
    assert ModelConfig(hidden_size=64, swiglu=False).ffn_hidden_size == 256
    cfg = _cfg(**LLAMA_WIDE)                    # h 64, 8 heads × 12, 4 groups, f 128, V 1000, s 16, 2 layers
    per_layer = 2 * 64 * (96 + 2 * 48) + 2 * 96 * 64 + 3 * 2 * 64 * 128 + 4 * 16 * 96
    assert gpt_flops_per_token(cfg) == 3 * (2 * per_layer + 2 * 64 * 1000)


# ---- untied output layer, stages, delayed W, recomputation, autocast --------------------------------
def test_untied_output_layer_has_its_own_padded_weight():
    cfg = _cfg(**LLAMA)
    ctx = ParallelContext.single_process()
    model = GPTModel(cfg, ctx, seed=SEED)
    assert model.tied_embedding is False
    out, emb = model.output_layer.weight, model.embedding.word_embeddings.weight
    assert out is not emb and out.shape == emb.shape == (1024, 64)
    assert not torch.equal(out[:1000], emb[:1000]) and torch.count_nonzero(out[1000:]) == 0
    assert not getattr(out, "shared_embedding_duplicate", False)
    tokens, labels = _batch(cfg)
    model(tokens, labels).sum().backward()
    assert torch.count_nonzero(out.grad[1000:]) == 0 and out.grad[:1000].abs().sum() > 0
    last = GPTModel(cfg, ctx, seed=SEED, pre_process=False, layer_range=(1, 2))
    assert torch.equal(last.output_layer.weight, out)                        # same global name, same init
    assert not getattr(last.output_layer.weight, "shared_embedding_duplicate", False)
    tied_last = GPTModel(_cfg(), ctx, seed=SEED, pre_process=False, layer_range=(1, 2))
    assert tied_last.output_layer.weight.shared_embedding_duplicate is True


def test_llama_pipeline_split_equals_full_model():
    cfg = _cfg(**LLAMA_WIDE, num_layers=4)
    ctx = ParallelContext.single_process()
    tokens, labels = _batch(cfg)
    full = GPTModel(cfg, ctx, seed=SEED)
    s0 = GPTModel(cfg, ctx, seed=SEED, post_process=False, layer_range=(0, 1))
    s1 = GPTModel(cfg, ctx, seed=SEED, pre_process=False, layer_range=(1, 4))
    whole = full.state_dict()
    for part in (s0, s1):
        for k, v in part.state_dict().items():
            assert torch.equal(v, whole[k]), k
    torch.testing.assert_close(s1(labels=labels, hidden=s0(tokens)), full(tokens, labels), rtol=1e-6, atol=1e-6)


def test_delayed_wgrad_covers_both_swiglu_projections():
    cfg = _cfg(**LLAMA_WIDE, num_layers=1)
    ctx = ParallelContext.single_process()
    tokens, labels = _batch(cfg)
    plain = GPTModel(cfg, ctx, seed=SEED)
    plain(tokens, labels).mean().backward()
    delayed = GPTModel(cfg, ctx, seed=SEED)
    store = WeightGradStore()
    delayed.set_wgrad_store(store)
    delayed(tokens, labels).mean().backward()
    mlp = delayed.layers["0"].mlp
    assert mlp.fc1_gate.weight.grad is None and mlp.fc1_up.weight.grad is None
    assert delayed.output_layer.weight.grad is None                          # the untied head too
    assert store.flush() == 6                                                # qkv, proj, gate, up, fc2, output
    for (n, a), (_, b) in zip(plain.named_parameters(), delayed.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_recomputation_replays_llama_layers_bitwise():
    cfg = _cfg(**LLAMA_WIDE, hidden_dropout=0.1, attention_dropout=0.1)
    ctx = ParallelContext.single_process()
    tokens, labels = _batch(cfg)

    def run(granularity):
        model = GPTModel(cfg, ctx, seed=SEED, recompute_granularity=granularity)
        loss = model(tokens, labels).mean()
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}
    base = run(None)
    for granularity in ("selective", "full"):
        loss, grads = run(granularity)
        assert loss == base[0], granularity
        for n, g in base[1].items():
            torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-7, msg=f"{granularity}: {n}")


def test_bf16_autocast_with_rope_and_gqa():
    cfg = _cfg(**LLAMA_WIDE)
    model = GPTModel(cfg, ParallelContext.single_process(), seed=SEED)
    tokens, labels = _batch(cfg)
    ref = model(tokens, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels)
    assert loss.dtype == torch.float32
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert (loss - ref).abs().max() < 0.1


def test_openai_gelu_and_no_positions_change_the_model_as_asked():
    ctx = ParallelContext.single_process()
    tokens, labels = _batch(_cfg())
    base = GPTModel(_cfg(), ctx, seed=SEED)(tokens, labels)
    tanh = GPTModel(_cfg(openai_gelu=True), ctx, seed=SEED)(tokens, labels)
    assert 0 < (tanh - base).abs().max() < 1e-2                               # same weights, other GELU
    nopos = GPTModel(_cfg(position_embedding_type="none"), ctx, seed=SEED)
    assert nopos.embedding.position_embeddings is None
    assert "embedding.position_embeddings.weight" not in dict(nopos.named_parameters())
    assert not torch.equal(nopos(tokens, labels), base)


# ---- configuration errors --------------------------------------------------------------------------
@pytest.mark.parametrize("kw, tp, message", [
    (dict(LLAMA, num_query_groups=2), 4, "num_query_groups 2 is not divisible by tensor-parallel size 4: each "
                                         "tensor-parallel rank holds whole key/value heads \\(4 query heads in 2"),
    (dict(LLAMA, num_query_groups=3), 1, "num_attention_heads 4 is not divisible by num_query_groups 3"),
    (dict(swiglu=True, openai_gelu=True), 1, "swiglu and openai_gelu conflict"),
    (dict(position_embedding_type="rope", kv_channels=10, rotary_percent=0.5), 1,
     "rotary_percent 0.5 of 10 channels per head rotates 5: it must be an even number"),
    (dict(position_embedding_type="rope", rotary_percent=1.5), 1, r"rotary_percent must be in \(0, 1\], got 1.5"),
    (dict(normalization="BatchNorm"), 1, "normalization must be one of LayerNorm, RMSNorm, got 'BatchNorm'"),
    (dict(hidden_size=66), 1, r"hidden_size 66 is not divisible by num_attention_heads 4 \(or give kv_channels\)"),
])
def test_model_config_errors_name_the_numbers(kw, tp, message):
    with pytest.raises(ConfigError, match=message):
        check_gpt_config(_cfg(**kw), tp)


def test_kv_channels_lifts_the_width_rule():
    check_gpt_config(_cfg(hidden_size=66, kv_channels=16, ffn_hidden_size=64), 1)   # 4 heads × 16 != 66: allowed


_ARGV = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "16", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def test_llama_flags_parse_with_megatron_names_and_defaults():
    m = parse_args(_ARGV + ["--tensor-model-parallel-size", "2", "--rotary-base", "500000", "--norm-epsilon", "1e-6"],
                   world_size=2).model
    assert (m.normalization, m.position_embedding_type, m.swiglu, m.query_groups, m.tied_embeddings,
            m.add_bias_linear, m.rotary_base, m.norm_epsilon, m.ffn_hidden_size) == \
        ("RMSNorm", "rope", True, 2, False, False, 500000.0, 1e-6, 128)
    d = parse_args(["--mock-data", "--vocab-size", "10"], world_size=1).model
    assert (d.normalization, d.norm_epsilon, d.position_embedding_type, d.rotary_base, d.rotary_percent,
            d.swiglu, d.openai_gelu, d.group_query_attention, d.num_query_groups, d.kv_channels,
            d.untie_embeddings_and_output_weights, d.disable_bias_linear, d.add_qkv_bias, d.init_method_std,
            d.hidden_dropout, d.attention_dropout) == \
        ("LayerNorm", 1e-5, "learned_absolute", 10000.0, 1.0, False, False, False, 1, None, False, False, False,
         0.02, 0.1, 0.1)                                                    # Megatron-LM's defaults
    assert d.query_groups == 4 and d.head_dim == 64


@pytest.mark.parametrize("extra, world, message", [
    (["--tensor-model-parallel-size", "4"], 4,
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--num-query-groups", "3"], 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--openai-gelu"], 1, "--swiglu and --openai-gelu conflict"),
    (["--stage-layouts", "tp1dp2,tp4dp1", "--pipeline-model-parallel-size", "2"], 6,
     "--stage-layouts tp1dp2,tp4dp1: --num-query-groups 2 is not divisible by stage 1's tp 4"),
])
def test_llama_flag_errors_name_the_flags_and_numbers(extra, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(_ARGV + extra, world_size=world)
