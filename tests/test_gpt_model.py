"""GPTModel: every tp / sequence-parallel / dp layout matches the single-process model.

Same seed, same global batch, fp32, dropout 0: per-token losses and full gradients
(tp shards all-gathered, vocabulary padding removed) agree within 1e-5 relative, and
the full initial weights agree bit for bit. One ``run_ranks`` launch per world size runs
the GPT-2 configuration and a Llama-style one (RMSNorm, RoPE, SwiGLU, grouped-query
attention with the key/value heads split over tp, untied output layer, no biases).
"""
from __future__ import annotations

import logging

import pytest
import torch

from megareshard.arguments import ConfigError, ModelConfig
from megareshard.models import GPTModel, check_gpt_config, gpt_flops_per_token, model_flops_per_iteration
from megareshard.parallel import ParallelContext, Topology
from megareshard.tensor_parallel import WeightGradStore, gather_full_state_dict, sync_sequence_parallel_grads
from tests.harness import run_ranks

SEED = 1234
RTOL = 1e-5


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


def _batch(cfg: ModelConfig, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g)
    return tokens, labels


def _run(model: GPTModel, ctx: ParallelContext, cfg: ModelConfig):
    """Per-token losses, full parameters and full gradients of one forward/backward."""
    tokens, labels = _batch(cfg)
    params = gather_full_state_dict(model, ctx)
    loss = model(tokens, labels)
    loss.mean().backward()
    sync_sequence_parallel_grads(model, ctx)
    grads = gather_full_state_dict(model, ctx, grads=True)
    return loss.detach(), params, grads


def _llama(**kw) -> ModelConfig:
    """Llama-style: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied, no biases."""
    return _cfg(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, group_query_attention=True,
                untie_embeddings_and_output_weights=True, disable_bias_linear=True, **kw)


def _layouts_worker(rank: int, world_size: int, layouts: list[tuple[int, bool]], cfg: ModelConfig | list):
    """For each config and (tp, sequence_parallel): build, run, gather. Rank 0 returns the full results."""
    import torch.distributed as dist
    out = []
    contexts = {}
    for c in (cfg if isinstance(cfg, list) else [cfg]):
        for tp, sp in layouts:
            if tp not in contexts:
                contexts[tp] = ParallelContext.create(Topology(world_size=world_size, tp=tp))
            ctx = contexts[tp]
            assert dist.get_rank(ctx.tp_group) == ctx.tp_rank()
            model = GPTModel(c, ctx, sequence_parallel=sp, seed=SEED)
            loss, params, grads = _run(model, ctx, c)
            out.append((tp, sp, ctx.dp_rank(), loss, params if rank == 0 else None, grads if rank == 0 else None))
    return out


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(cfg: ModelConfig):
        key = repr(cfg)
        if key not in cache:
            ctx = ParallelContext.single_process()
            cache[key] = _run(GPTModel(cfg, ctx, seed=SEED), ctx, cfg)
        return cache[key]
    return get


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert err <= RTOL * max(scale, 1e-30), f"{what}: max abs error {err:.3g} > {RTOL} × max |ref| {scale:.3g}"


def _check_against(results, ref, world_size: int) -> None:
    ref_loss, ref_params, ref_grads = ref
    for tp, sp, dp_rank, loss, params, grads in results:
        where = f"tp {tp} sp {sp} of world {world_size} (dp rank {dp_rank})"
        _assert_close(loss, ref_loss, f"{where}: per-token loss")
        if params is None:
            continue
        assert params.keys() == ref_params.keys()
        for name in ref_params:
            assert torch.equal(params[name], ref_params[name]), f"{where}: initial {name} differs"
            _assert_close(grads[name], ref_grads[name], f"{where}: grad {name}")


def _flatten(per_rank):
    return [r for rank_results in per_rank for r in rank_results]


def _check_configs(per_rank, cfgs, reference, world_size: int) -> None:
    """Results of one launch over ``cfgs`` (each over the same layouts), config by config."""
    per_cfg = len(per_rank[0]) // len(cfgs)
    for i, cfg in enumerate(cfgs):
        _check_against([r for rank_results in per_rank for r in rank_results[i * per_cfg:(i + 1) * per_cfg]],
                       reference(cfg), world_size)


def test_tp2_and_sequence_parallel_match_single_process(reference):
    cfgs = [_cfg(), _llama(num_query_groups=2)]            # tp 2: one key/value head per rank
    results = run_ranks(_layouts_worker, 2, [(2, False), (2, True)], cfgs, timeout=120)
    _check_configs(results, cfgs, reference, 2)


def test_tp4_and_tp2_dp2_match_single_process(reference):
    # Llama at tp 4 and tp 2: 4 groups of 2 query heads, 12 channels per head (8 × 12 != h), half of them rotated
    cfgs = [_cfg(), _llama(num_attention_heads=8, num_query_groups=4, kv_channels=12, rotary_percent=0.5,
                           add_qkv_bias=True)]
    results = run_ranks(_layouts_worker, 4, [(4, False), (4, True), (2, False)], cfgs, timeout=120)
    _check_configs(results, cfgs, reference, 4)


def test_vocab_padding_tp3_matches_tp1(reference, caplog):
    cfg = _cfg(num_layers=1, num_attention_heads=3, hidden_size=48)
    results = run_ranks(_layouts_worker, 3, [(3, False)], cfg, timeout=120)
    _check_against(_flatten(results), reference(cfg), 3)
    ctx = ParallelContext.single_process()
    with caplog.at_level(logging.INFO, logger="megareshard"):
        model = GPTModel(cfg, ctx, seed=SEED)
    assert model.padded_vocab_size == 1024
    assert "padded vocab 1000 -> 1024 (multiple of 128 × tp 1)" in caplog.text


def test_padded_rows_are_zero_and_get_no_gradient():
    cfg = _cfg(num_layers=1)
    model = GPTModel(cfg, ParallelContext.single_process(), seed=SEED)
    w = model.embedding.word_embeddings.weight
    assert w.shape[0] == 1024 and torch.count_nonzero(w[1000:]) == 0
    tokens, labels = _batch(cfg)
    model(tokens, labels).sum().backward()
    assert torch.count_nonzero(w.grad[1000:]) == 0
    logits = model(tokens)                      # [b, s, V_pad]
    assert logits.shape == (2, cfg.seq_length, 1024)


def test_stage_models_have_global_names_and_same_values():
    cfg = _cfg(num_layers=4)
    ctx = ParallelContext.single_process()
    full = GPTModel(cfg, ctx, seed=SEED).state_dict()
    first = GPTModel(cfg, ctx, seed=SEED, post_process=False, layer_range=(0, 2)).state_dict()
    middle = GPTModel(cfg, ctx, seed=SEED, pre_process=False, post_process=False, layer_range=(1, 3)).state_dict()
    last = GPTModel(cfg, ctx, seed=SEED, pre_process=False, layer_range=(2, 4)).state_dict()
    assert {k.split(".")[1] for k in middle} == {"1", "2"} and all(k.startswith("layers.") for k in middle)
    assert "layers.3.attention.qkv.weight" in last and "layers.0.attention.qkv.weight" not in last
    assert "embedding.word_embeddings.weight" in first and "final_layernorm.weight" not in first
    for part in (first, middle):
        for k, v in part.items():
            assert torch.equal(v, full[k]), k
    for k, v in last.items():
        if k == "output_layer.weight":       # the last stage's own copy of the tied embedding
            assert torch.equal(v, full["embedding.word_embeddings.weight"])
        else:
            assert torch.equal(v, full[k]), k


def test_pipeline_split_forward_equals_full_model():
    cfg = _cfg(num_layers=4)
    ctx = ParallelContext.single_process()
    tokens, labels = _batch(cfg)
    full = GPTModel(cfg, ctx, seed=SEED)(tokens, labels)
    s0 = GPTModel(cfg, ctx, seed=SEED, post_process=False, layer_range=(0, 2))
    s1 = GPTModel(cfg, ctx, seed=SEED, pre_process=False, layer_range=(2, 4))
    hidden = s0(tokens)
    assert hidden.shape == (cfg.seq_length, 2, cfg.hidden_size)     # [s, b, h]
    torch.testing.assert_close(s1(labels=labels, hidden=hidden), full, rtol=1e-6, atol=1e-6)


def test_delayed_wgrad_gives_identical_model_grads():
    cfg = _cfg(num_layers=1)
    ctx = ParallelContext.single_process()
    tokens, labels = _batch(cfg)
    plain = GPTModel(cfg, ctx, seed=SEED)
    plain(tokens, labels).mean().backward()
    delayed = GPTModel(cfg, ctx, seed=SEED)
    store = WeightGradStore()
    delayed.set_wgrad_store(store)
    delayed(tokens, labels).mean().backward()
    assert delayed.layers["0"].mlp.fc1.weight.grad is None and len(store) > 0
    store.flush()
    for (n, a), (_, b) in zip(plain.named_parameters(), delayed.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_dropout_reproducible_with_restored_streams():
    cfg = _cfg(num_layers=1, hidden_dropout=0.1, attention_dropout=0.1)
    ctx = ParallelContext.single_process()
    model = GPTModel(cfg, ctx, seed=SEED)
    tokens, labels = _batch(cfg)
    state = model.streams.state_dict()
    a = model(tokens, labels)
    b = model(tokens, labels)
    assert not torch.equal(a, b)             # streams advanced: new masks
    model.streams.load_state_dict(state)
    torch.manual_seed(999)                   # the global RNG does not matter
    assert torch.equal(model(tokens, labels), a)
    model.eval()
    assert torch.equal(model(tokens, labels), model(tokens, labels))


def test_bf16_autocast_keeps_fp32_loss():
    cfg = _cfg(num_layers=1)
    model = GPTModel(cfg, ParallelContext.single_process(), seed=SEED)
    tokens, labels = _batch(cfg)
    ref = model(tokens, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels)
    assert loss.dtype == torch.float32
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert (loss - ref).abs().max() < 0.1


@pytest.mark.parametrize("kw, tp, sp, message", [
    (dict(hidden_size=66, num_attention_heads=4), 1, False, "hidden_size 66 is not divisible by num_attention_heads 4"),
    (dict(hidden_size=48, num_attention_heads=4), 3, False, "num_attention_heads 4 is not divisible by tensor-parallel size 3"),
    (dict(num_attention_heads=4, ffn_hidden_size=250), 4, False, "ffn_hidden_size 250 is not divisible"),
    (dict(seq_length=18, num_attention_heads=4), 4, True, "seq_length 18 divisible by tensor-parallel size 4"),
    (dict(vocab_size=None), 1, False, "vocab_size must be a positive integer"),
])
def test_config_errors_name_the_numbers(kw, tp, sp, message):
    with pytest.raises(ConfigError, match=message):
        check_gpt_config(_cfg(**kw), tp, sp)


def test_model_checks_its_config_and_layer_range():
    ctx = ParallelContext.single_process()
    with pytest.raises(ConfigError, match="hidden_size 66"):
        GPTModel(_cfg(hidden_size=66), ctx)
    with pytest.raises(ConfigError, match=r"layer_range \(2, 5\)"):
        GPTModel(_cfg(num_layers=4), ctx, layer_range=(2, 5))


def test_flops_formula_matches_megatron():
    cfg = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=51200)
    b, s, l, h, v = 8, 2048, 24, 2048, 51200
    megatron = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert model_flops_per_iteration(cfg, b) == pytest.approx(megatron, rel=1e-12)
    assert gpt_flops_per_token(cfg, recompute=True) == pytest.approx(4 / 3 * megatron / (b * s), rel=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
def test_cuda_matches_cpu_and_bf16_autocast_keeps_fp32_loss(llama):
    kw = dict(num_layers=1, attention_dropout=0.1, hidden_dropout=0.1)
    cfg = _llama(num_query_groups=2, **kw) if llama else _cfg(**kw)   # llama: SDPA's fused kernels with GQA
    ctx = ParallelContext.single_process()
    tokens, labels = _batch(cfg)
    cpu = GPTModel(cfg, ctx, seed=SEED).eval()
    gpu = GPTModel(cfg, ctx, seed=SEED, device="cuda").eval()
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    ref = cpu(tokens, labels)
    got = gpu(tokens.cuda(), labels.cuda())
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)
    gpu.train()
    state = gpu.streams.state_dict()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = gpu(tokens.cuda(), labels.cuda())
    assert loss.dtype == torch.float32
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in gpu.parameters())
    gpu.streams.load_state_dict(state)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        again = gpu(tokens.cuda(), labels.cuda())
    assert torch.equal(again, loss)                      # dropout replayed from the streams
