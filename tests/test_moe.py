"""The MoE layer on one process (megareshard/models/moe): Megatron-Core's routing, capacity and losses on
hand-computed cases, equality with transformers' Mixtral and Qwen3-MoE blocks, a GPT with MoE layers, the
one-line refusals. The expert-parallel layouts: tests/test_moe_parallel.py."""
from __future__ import annotations

import io
import math

import pytest
import torch

from megareshard.config_fields import ConfigError
from megareshard.models.config import ModelConfig
from megareshard.models.gpt import GPTModel, _normal_init
from megareshard.models.moe import (MoELayer, TopKRouter, apply_token_dropping, check_moe_config, get_capacity,
                                    grouped_gemm_refusal, moe_layer_pattern, moe_losses, topk_routing)
from megareshard.parallel import ParallelContext
from tests.tolerances import forward_tolerance


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64, hidden_dropout=0.0,
                attention_dropout=0.0, num_experts=4, moe_router_topk=2, swiglu=True, disable_bias_linear=True,
                ffn_hidden_size=32, moe_ffn_hidden_size=24)
    base.update(kw)
    return ModelConfig(**base)


def _layer(cfg: ModelConfig, seed: int = 7) -> MoELayer:
    return MoELayer(cfg, ParallelContext.single_process(), "layers.0.mlp",
                    lambda name, std: _normal_init(seed, name, std), 0.02)


# ---- capacity: which tokens are dropped ------------------------------------------------------------------
def _hand_routing():
    """6 tokens, 3 experts, top-1: expert 0 is chosen by tokens 0-3 (probabilities .5 .9 .7 .6), expert 1 by
    token 4, expert 2 by token 5. Capacity ceil(6·1/3 · 1.0) = 2."""
    probs = torch.zeros(6, 3)
    probs[:4, 0] = torch.tensor([0.5, 0.9, 0.7, 0.6])
    probs[4, 1], probs[5, 2] = 0.8, 0.4
    return probs, probs > 0


@pytest.mark.parametrize("policy, kept", [("probs", [1, 2]), ("position", [0, 1])])
def test_capacity_drops_what_megatrons_policy_drops(policy, kept):
    probs, rmap = _hand_routing()
    assert get_capacity(6 * 1, 3, 1.0) == 2
    p, m = apply_token_dropping(probs, rmap, 1, 1.0, policy)
    assert m[:, 0].nonzero().flatten().tolist() == kept           # expert 0 over capacity: the others dropped
    assert m[:, 1].nonzero().flatten().tolist() == [4] and m[:, 2].nonzero().flatten().tolist() == [5]
    assert torch.equal(p, probs * m)
    # padded to capacity: every expert exactly 2 rows, the padding rows (the earliest unrouted tokens) at p = 0
    p, m = apply_token_dropping(probs, rmap, 1, 1.0, policy, pad_to_capacity=True)
    assert m.sum(0).tolist() == [2, 2, 2]
    assert m[:, 0].nonzero().flatten().tolist() == kept
    assert m[:, 1].nonzero().flatten().tolist() == [0, 4] and m[:, 2].nonzero().flatten().tolist() == [0, 5]
    assert p[0, 1] == 0 and p[0, 2] == 0
    # capacity above the token count drops nothing
    p, m = apply_token_dropping(probs, rmap, 1, 4.0, policy)
    assert torch.equal(m, rmap)


def test_dropped_tokens_get_no_expert_output():
    """Top-1 with capacity factor 0.5 on 8 tokens and 4 experts (capacity 1): the layer's output is zero exactly
    on the tokens the router's map dropped."""
    layer = _layer(_cfg(moe_router_topk=1, moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"))
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(3))
    probs, rmap = layer.router(x.reshape(-1, 16), 4, 2)
    out = layer(x).reshape(-1, 16)
    dropped = ~rmap.any(dim=1)
    assert 0 < int(dropped.sum()) < 8 and (rmap.sum(0) <= 1).all()
    assert (out[dropped] == 0).all() and (out[~dropped].abs().sum(1) > 0).all()


# ---- the router's scores and losses ------------------------------------------------------------------------
LOGITS = torch.tensor([[1.0, 0.0, -1.0], [0.2, 0.4, 0.1], [-0.5, 2.0, 0.3], [0.0, 0.1, 1.5]])


def test_topk_scores():
    p, m = topk_routing(LOGITS, 2)                                            # softmax over the top 2 logits
    e = math.exp(1.0) + 1.0
    assert m[0].tolist() == [True, True, False] and p[0].tolist() == pytest.approx([math.exp(1) / e, 1 / e, 0])
    p, _ = topk_routing(LOGITS, 2, pre_softmax=True)                         # softmax over all 3, then top 2
    z = math.exp(1) + 1 + math.exp(-1)
    assert p[0].tolist() == pytest.approx([math.exp(1) / z, 1 / z, 0], rel=1e-6)
    p, _ = topk_routing(LOGITS, 2, "sigmoid")                                # sigmoid of the top 2, renormalised
    s = [1 / (1 + math.exp(-1)), 0.5]
    assert p[0].tolist() == pytest.approx([s[0] / sum(s), s[1] / sum(s), 0], rel=1e-6)


def _hand_aux(logits: torch.Tensor, k: int, coeff: float) -> float:
    """E·coeff/(k·T²) · Σ_e (Σ_t softmax_t,e) · (tokens whose top-k holds e), in float64 by loops."""
    T, E = logits.shape
    sm = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.double().tolist()]
    count = [0] * E
    for row in sm:
        for e in sorted(range(E), key=lambda e: -row[e])[:k]:
            count[e] += 1
    return E * coeff / (k * T * T) * sum(sum(sm[t][e] for t in range(T)) * count[e] for e in range(E))


def _hand_z(logits: torch.Tensor, coeff: float) -> float:
    rows = logits.double().tolist()
    return coeff * sum(math.log(sum(math.exp(v) for v in r)) ** 2 for r in rows) / len(rows)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_router_losses_equal_hand_computed_and_reach_the_gradient(kind):
    """The logged losses equal the formulas; the gradient is that of LM-ish loss + aux + z (the autoscaler)."""
    cfg = _cfg(hidden_size=3, num_experts=3, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
               moe_router_load_balancing_type=kind)
    router = TopKRouter(cfg, ParallelContext.single_process(), "r", lambda n, s: (lambda shape: torch.eye(3)), False)
    x = LOGITS.clone()                                          # weight = I: the logits are the input
    s, b = (2, 2) if kind == "seq_aux_loss" else (4, 1)       # 4 tokens: [s, b] flattened s-major
    probs, _ = router(x, s, b)
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    (probs * g).sum().backward()
    if kind == "aux_loss":
        aux = _hand_aux(LOGITS, 2, 1.0)
    else:  # per sequence: rows t·b + j of sequence j; averaged over the b sequences
        aux = sum(_hand_aux(LOGITS[j::b], 2, 1.0) for j in range(b)) / b
    name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
    assert router.losses[name].item() == pytest.approx(aux, rel=1e-6)
    assert router.losses["z_loss"].item() == pytest.approx(_hand_z(LOGITS, 1.0), rel=1e-6)
    # the same gradient from the losses written out (no autoscaler)
    w = torch.eye(3, requires_grad=True)
    lg = x @ w.t()
    p_ref, m_ref = topk_routing(lg, 2)
    sm = torch.softmax(lg, -1)
    top = torch.zeros_like(sm).scatter(1, sm.topk(2, 1).indices, 1.0)
    if kind == "aux_loss":
        aux_t = 3 * 0.1 / (2 * 16) * (sm.sum(0) * top.sum(0)).sum()
    else:
        aux_t = sum(3 * 0.1 / (2 * 4) * (sm[j::b].sum(0) * top[j::b].sum(0)).sum() for j in range(b)) / b
    z_t = 0.01 * torch.logsumexp(lg, -1).square().mean()
    ((p_ref * g).sum() + aux_t + z_t).backward()
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-5, atol=1e-7)


def test_losses_only_in_training():
    layer = _layer(_cfg(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    x = torch.randn(4, 2, 16)
    layer(x)
    assert set(layer.router.losses) == {"load_balancing_loss", "z_loss"}
    layer.eval()
    layer(x)
    assert layer.router.losses == {}


# ---- equality with transformers' blocks -----------------------------------------------------------------------
def _copy_hf_experts(layer: MoELayer, gate_w, gate_up, down, f: int) -> None:
    with torch.no_grad():
        layer.router.weight.copy_(gate_w)
        layer.experts.fc1_gate.weight.copy_(gate_up[:, :f])
        layer.experts.fc1_up.weight.copy_(gate_up[:, f:])
        layer.experts.fc2.weight.copy_(down)


@pytest.mark.parametrize("family, norm_topk", [("mixtral", True), ("qwen3", True), ("qwen3", False)])
def test_layer_equals_transformers_block(family, norm_topk):
    """Same weights, same tokens: Mixtral's block (softmax, top-2, renormalised = our default) and Qwen3-MoE's
    (norm_topk_prob; without it the top-k of the full softmax = moe_router_pre_softmax)."""
    h, f, E, k = 16, 24, 4, 2
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        hf_cfg = MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=E, num_experts_per_tok=k)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        hf_cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=f, num_experts=E, num_experts_per_tok=k,
                                norm_topk_prob=norm_topk)
    torch.manual_seed(0)
    block = Block(hf_cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    layer = _layer(_cfg(hidden_size=h, moe_ffn_hidden_size=f, num_experts=E, moe_router_topk=k,
                        moe_router_pre_softmax=not norm_topk)).eval()
    _copy_hf_experts(layer, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, f)
    x = torch.randn(3, 5, h, generator=gen)                                    # [b, s, h]
    with torch.no_grad():
        ref = block(x)
        out = layer(x.transpose(0, 1)).transpose(0, 1)
    # sums of h (router, fc1), f (fc2) and k (combine) products; terms of the size of the outputs
    tol = forward_tolerance(2 * h + f + k, ref.abs().max().item())
    assert (out - ref).abs().max().item() <= tol, ((out - ref).abs().max().item(), tol)


# ---- the GPT with MoE layers -------------------------------------------------------------------------------------
def test_gpt_with_moe_layers_forward_backward():
    cfg = _cfg(moe_layer_freq=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
               moe_shared_expert_intermediate_size=16, moe_token_dispatcher_type="alltoall")
    ctx = ParallelContext.single_process()
    model = GPTModel(cfg, ctx)
    assert type(model.layers["0"].mlp).__name__ == "MoELayer" and type(model.layers["1"].mlp).__name__ == "ParallelMLP"
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, tokens).mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [n for n, g in grads.items()
                                                                                     if g is None]
    assert grads["layers.0.mlp.router.weight"].abs().sum() > 0
    losses = moe_losses(model, ctx)
    assert set(losses) == {"load_balancing_loss", "z_loss"} and losses["load_balancing_loss"].shape == (1,)
    # a dense model's parameters are unchanged by the MoE fields' defaults
    dense = GPTModel(_cfg(num_experts=None), ctx)
    assert not any(".router." in n or ".experts." in n for n, _ in dense.named_parameters())


def test_layer_pattern():
    assert moe_layer_pattern(1, 3) == [1, 1, 1] and moe_layer_pattern(2, 4) == [1, 0, 1, 0]
    assert moe_layer_pattern("([1]*2+[0])*2", 6) == [1, 1, 0, 1, 1, 0] and moe_layer_pattern("[0,1]", 2) == [0, 1]
    with pytest.raises(ConfigError, match=r"one 0 or 1 per layer \(3 layers\)"):
        moe_layer_pattern("[1,0]", 3)


@pytest.mark.parametrize("kw, tp, ep, etp, sp, message", [
    (dict(moe_router_topk=5), 1, 1, 1, False, "moe_router_topk 5 must be between 1 and num_experts 4"),
    ({}, 1, 3, 1, False, "num_experts 4 is not divisible by expert-model-parallel-size 3"),
    ({}, 2, 1, 2, False, "MoE layers with tensor-parallel size 2 need sequence parallelism"),
    (dict(disable_bias_linear=False), 2, 1, 2, True, "expert biases with expert-tensor-parallel size 2"),
    (dict(moe_pad_expert_input_to_capacity=True), 1, 1, 1, False, "needs moe_expert_capacity_factor"),
])
def test_one_line_refusals(kw, tp, ep, etp, sp, message):
    with pytest.raises(ConfigError) as e:
        check_moe_config(_cfg(**kw), tp, ep, etp, sp)
    assert message in str(e.value) and "\n" not in str(e.value)


def _run_layer(layer: MoELayer, x: torch.Tensor, store=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    layer.experts.wgrad_store = store
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype))
    if store is not None:
        assert store.flush() > 0
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("swiglu, bias", [(True, False), (False, False), (False, True)])
def test_grouped_gemm_equals_one_gemm_per_expert(swiglu, bias):
    """``--moe-grouped-gemm`` (one ``torch._grouped_mm`` per matrix) against one GEMM per expert, forward, input
    and weight gradients, immediate and delayed (a pipeline's W). On CPU torch runs the grouped op as its own loop
    of ``mm`` over the same row blocks, so without biases the arithmetic is the same: bitwise. With biases the
    grouped path adds the bias after the product where ``F.linear`` adds it inside, one rounding apart at most
    per addition (and the bias gradient is an ``index_add`` of the same rows): a tolerance for sums of a few
    terms. An expert that gets no row (routing below) gives a zero weight gradient either way."""
    from megareshard.tensor_parallel.layers import WeightGradStore

    kw = dict(hidden_size=16, moe_ffn_hidden_size=24, swiglu=swiglu, disable_bias_linear=not bias, num_experts=4, moe_router_topk=1)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    loop, grouped = _layer(_cfg(**kw)), _layer(_cfg(moe_grouped_gemm=True, **kw))
    assert grouped.experts.grouped_gemm and not loop.experts.grouped_gemm
    for store in (None, WeightGradStore()):
        ref, got = _run_layer(loop, x, store), _run_layer(grouped, x, store)
        if not bias:
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
            assert all(torch.equal(ref[2][n], got[2][n]) for n in ref[2]), [n for n in ref[2]
                                                                            if not torch.equal(ref[2][n], got[2][n])]
        else:
            for a, b in [(ref[0], got[0]), (ref[1], got[1])] + [(ref[2][n], got[2][n]) for n in ref[2]]:
                assert torch.allclose(a, b, rtol=0, atol=8 * torch.finfo(a.dtype).eps * max(a.abs().max().item(), 1.0))
        loop.zero_grad(set_to_none=True)
        grouped.zero_grad(set_to_none=True)


@pytest.mark.parametrize("hidden, width, nbytes, says", [
    (16, 24, 2, None), (12, 20, 4, None),
    (12, 24, 2, "--hidden-size 12 not a multiple of 8 at 2-byte precision"),
    (16, 22, 4, "a rank's expert width 22 not a multiple of 4 at 4-byte precision"),
])
def test_grouped_gemm_refuses_rows_it_cannot_align(hidden, width, nbytes, says):
    why = grouped_gemm_refusal(hidden, width, nbytes)
    assert why is None if says is None else (says in why and "\n" not in why), why
    if says is not None and nbytes == 4:   # the layer refuses it in the same line
        with pytest.raises(ConfigError, match="multiple of 16 bytes"):
            _layer(_cfg(moe_grouped_gemm=True, hidden_size=hidden, moe_ffn_hidden_size=width))


def test_training_with_grouped_gemm_is_the_same_run():
    """``pretrain_gpt.py --bf16 --moe-grouped-gemm`` on CPU trains the same run as one GEMM per expert, bitwise
    (the same arithmetic: ``test_grouped_gemm_equals_one_gemm_per_expert``) — losses, router losses, gradient
    norms. The 16-byte rule is 8 elements a row in bf16 (hidden 32 and width 24 meet it) and 4 in fp32: a width
    that misses it is refused in one line before anything is built."""
    from megareshard.arguments import parse_args
    from megareshard.training import Trainer, build_context

    argv = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
            "--device", "cpu", "--train-iters", "3", "--no-torch-compile", "--num-experts", "4", "--moe-router-topk",
            "2", "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear", "--log-interval", "100"]
    runs = []
    for extra in ([], ["--moe-grouped-gemm"]):
        cfg = parse_args(argv + ["--bf16", "--moe-ffn-hidden-size", "24"] + extra, world_size=1)
        trainer = Trainer(cfg, build_context(cfg, 1)[0], torch.device("cpu"), out=io.StringIO())
        assert trainer.model.layers["0"].mlp.experts.grouped_gemm == bool(extra)
        runs.append([(r["loss"], r["grad_norm"], r["load_balancing_loss"]) for r in trainer.train()])
        trainer.close()
    assert runs[0] == runs[1] and len(runs[0]) == 3, runs
    for precision, width, says in (["--bf16"], 20, "not a multiple of 8 at 2-byte"), ([], 22, "not a multiple of 4 "
                                                                                            "at 4-byte"):
        with pytest.raises(ConfigError) as e:
            parse_args(argv + precision + ["--moe-ffn-hidden-size", str(width), "--moe-grouped-gemm"], world_size=1)
        assert f"a rank's expert width {width} {says} precision" in str(e.value) and "\n" not in str(e.value)
    parse_args(argv + ["--moe-ffn-hidden-size", "20", "--moe-grouped-gemm"], world_size=1)   # fp32: 80-byte rows


def test_tp_without_sequence_parallelism_is_for_generation_only():
    """tp 2 without sequence parallelism: built (generation runs it, eval mode), refused by a training forward in
    one line before any communication (Megatron-Core's rule, in its MoE layer's forward); the start-up check of a
    training run keeps refusing it (test_one_line_refusals)."""
    from megareshard.parallel import Topology
    topo = Topology(2, tp=2, nproc_per_node=2)
    ranks = {n: (0, 1) for n in ("tp", "mp", "stage", "etp", "etp_ep")} | {n: (0,) for n in ("pp", "dp", "ep", "edp")}
    ctx = ParallelContext(topology=topo, rank=0, groups={n: None for n in ranks}, group_ranks=ranks)
    layer = MoELayer(_cfg(), ctx, "layers.0.mlp", lambda name, std: _normal_init(7, name, std), 0.02)
    with pytest.raises(ConfigError) as e:
        layer.train()(torch.zeros(4, 1, 16))
    assert "need sequence parallelism in training" in str(e.value) and "\n" not in str(e.value)


def test_grouped_gemm_refused_where_this_torch_has_no_kernel(monkeypatch):
    """torch 2.8 has ``torch._grouped_mm`` but no CPU kernel for it: the layer probes the op once per device type and
    dtype (the one its GEMMs run in) and refuses in one line, instead of failing at the first forward."""
    from megareshard.models.moe import layer as moe_layer

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_grouped_mm' with arguments from the 'CPU' backend.\nmore")

    monkeypatch.setattr(torch, "_grouped_mm", no_kernel)
    monkeypatch.setattr(moe_layer, "_GROUPED_MM_RUNS", {})
    with pytest.raises(ConfigError) as e:
        _layer(_cfg(moe_grouped_gemm=True))
    assert "cannot run torch._grouped_mm on cpu in float32 (Could not run 'aten::_grouped_mm'" in str(e.value)
    assert "\n" not in str(e.value)
