"""Hugging Face mixtures of experts in and out (issue #52): ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``
through ``tools/checkpoint_util.py import-hf`` / ``export-hf`` against ``transformers`` itself.

Tiny random models (``save_pretrained``: transformers 5 writes the experts one tensor each) are imported; the flags
the tool prints parse into the same architecture; the trainer loads the checkpoint (``--load --finetune``) and
runs its first iteration, ``train_step``, on two sequences (micro-batch 1, two micro-batches at ep 1; on 4 gloo
ranks at ep 2 · tp 2 with sequence parallelism, dp 2, one each, and at ep 2 · tp 2 · pp 2, etp 1, both through the
pipeline). What is compared with transformers' forward of
the same two sequences (``output_router_logits=True``, labels the next tokens via ``shift_labels``):

* the LM loss: our step's loss against transformers' cross-entropy (its ``loss`` less ``router_aux_loss_coef ·
  aux_loss``);
* the routing: every router's logits (captured by a hook: the router's linear of its input) against
  transformers' ``router_logits``, and the experts each token goes to, exactly;
* the load-balancing loss. Ours is Megatron-LM's (per layer ``E/(k·T²)·Σ_e P_e·c_e`` over a micro-batch, the
  trainer logs its mean over the MoE layers and micro-batches); transformers' ``load_balancing_loss_func`` pools
  all layers and both sequences and does not divide by k (``models/hf_moe.py``). So each is checked against its
  own formula evaluated on the other side's router logits: our logged value against Megatron's formula on
  transformers' logits (per sequence, per layer, averaged), and transformers' ``aux_loss`` against its own
  function on our logits (ep 1);
* the total: transformers' ``loss`` (LM + coefficient · its aux loss) against our LM loss + the coefficient ·
  transformers' function on our logits, and the objective our gradient sees (LM + coefficient · Σ over the MoE
  layers of Megatron's loss) against the same from transformers' numbers.

``export-hf`` of the checkpoint gives back a directory ``from_pretrained`` loads, with transformers' logits bit for
bit (same weights, same code). Tolerances from the arithmetic (tests/tolerances.py): the logits differ by a
forward's rounding over the sums they depend on (`forward_tolerance`), the loss by twice that (cross-entropy moves
by at most 2·max|Δlogit|) plus its own vocabulary sum; router logits by their forward's rounding δ, which moves
every softmax probability by a relative 2δ, and so the load-balancing losses (the routing maps being equal).
Refusals are one line naming the key.
"""
from __future__ import annotations

import dataclasses
import io
import json
import shlex

import pytest
import torch
import torch.nn.functional as F

from megareshard.arguments import ConfigError, parse_args
from megareshard.models import hf as hf_map
from megareshard.models.moe import TopKRouter
from megareshard.parallel import ParallelContext
from megareshard.training import Trainer, build_context
from tests.harness import run_ranks
from tests.tolerances import RHO, U, forward_tolerance, gpt_forward_reductions

from ._helpers import load_tool

# transformers is imported where it is used, not here: the ranks of the ep 2 · tp 2 launch import this module to
# find their function, and transformers would cost each of them ~2 CPU-seconds

VOCAB, S, COEF, E, K = 100, 16, 0.02, 4, 2
SHAPES = {"mixtral": dict(layers=2, heads=4, head_dim=8, ffn=48),        # every layer MoE, width 48
          "qwen3_moe": dict(layers=4, heads=4, head_dim=16, ffn=64 + 24)}  # dense 64 (layer 1), experts 24


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights (q/k norms too) start at one: give them values so their mapping is exercised."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + 1.0)


def _mixtral():
    import transformers
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=500.0, router_aux_loss_coef=COEF, tie_word_embeddings=False))


def _qwen3_moe():   # norm_topk_prob False: --moe-router-pre-softmax; layer 1 dense; head_dim 16 != 32 / 4
    import transformers
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=False, mlp_only_layers=[1], max_position_embeddings=64, router_aux_loss_coef=COEF))


MAKERS = {"mixtral": (_mixtral, "MixtralForCausalLM"), "qwen3_moe": (_qwen3_moe, "Qwen3MoeForCausalLM")}


def _megatron_lb(logits: torch.Tensor) -> float:
    """Megatron-LM's load-balancing loss (switch_load_balancing_loss_func, coefficient 1) of one layer's
    ``[T, E]`` router logits."""
    p = torch.softmax(logits.double(), dim=-1)
    counts = torch.zeros(E, dtype=torch.float64).scatter_add_(
        0, p.topk(K, dim=-1).indices.reshape(-1), torch.ones(logits.size(0) * K, dtype=torch.float64))
    return float(E / (K * logits.size(0) ** 2) * (p.sum(0) * counts).sum())


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Per model: the transformers model, its reference numbers on two sequences, the imported checkpoint and the
    command line the tool printed."""
    tool, out = load_tool(), {}
    tokens = torch.randint(0, VOCAB, (2, S + 1), generator=torch.Generator().manual_seed(5))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for kind, (make, _) in MAKERS.items():
        root = tmp_path_factory.mktemp(kind)
        torch.manual_seed(0)
        model = make().eval()
        _randomize_norms(model)
        model.save_pretrained(root / "hf")
        with torch.no_grad():
            ref = model(x, labels=x, shift_labels=y, output_router_logits=True)
        buf = io.StringIO()
        from contextlib import redirect_stdout
        with redirect_stdout(buf):
            assert tool.main(["import-hf", str(root / "hf"), str(root / "ck")]) == 0
        flags = shlex.split(buf.getvalue().split("--finetune ", 1)[1])
        argv = ["--mock-data", "--seq-length", str(S), "--load", str(root / "ck"), "--finetune", "--device", "cpu",
                "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", *flags]
        out[kind] = dict(model=model, root=root, argv=argv, tokens=tokens, logits=ref.logits,
                         lm=float(ref.loss - COEF * ref.aux_loss), aux=float(ref.aux_loss), total=float(ref.loss),
                         router=[r.detach() for r in ref.router_logits])
    return out


def _tolerances(kind: str, ref: dict) -> dict:
    s = SHAPES[kind]
    reductions = gpt_forward_reductions(s["layers"], 32, s["ffn"], s["heads"], s["head_dim"], S)
    logit = forward_tolerance(reductions, ref["logits"].abs().max().item())
    delta = forward_tolerance(reductions, max(r.abs().max().item() for r in ref["router"]))
    lm = 2 * logit + forward_tolerance(VOCAB, ref["lm"])
    lb_rel = 2 * delta + 4 * (2 * S + E) * U         # softmax's relative error, then the sums over tokens and experts
    return dict(logit=logit, delta=delta, lm=lm, lb_rel=lb_rel)


def _expected_megatron_lb(ref: dict) -> tuple[float, float]:
    """(what our step logs: the mean over sequences and MoE layers, what our gradient sees: Σ over layers, mean
    over sequences) of Megatron's formula on transformers' router logits, one sequence per micro-batch."""
    per = [[_megatron_lb(r[b * S:(b + 1) * S]) for r in ref["router"]] for b in range(2)]
    n = len(ref["router"])
    return sum(map(sum, per)) / (2 * n), sum(map(sum, per)) / 2


def _first_step(trainer: Trainer, microbatches: list[torch.Tensor]):
    """The trainer's first iteration, with every router's logits captured (per router, in micro-batch order)."""
    captured: dict[int, list[torch.Tensor]] = {}
    routers = [m for m in trainer.model.modules() if isinstance(m, TopKRouter)]
    hooks = [r.register_forward_hook(lambda mod, args, _out, i=i: captured.setdefault(i, []).append(
        F.linear(args[0].detach(), mod.weight.detach()))) for i, r in enumerate(routers)]
    trainer.model.train()
    res = trainer.train_step([{"tokens": t} for t in microbatches])
    for h in hooks:
        h.remove()
    return res, [torch.cat(captured[i]) for i in range(len(routers))]


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_import_first_iteration_and_export_against_transformers(imported, kind, tmp_path):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    ref, tool = imported[kind], load_tool()
    tol = _tolerances(kind, ref)
    cfg = parse_args(ref["argv"], world_size=1)
    saved = json.loads((ref["root"] / "hf" / "config.json").read_text())
    assert cfg.model == dataclasses.replace(hf_map.model_config_from_hf(saved), seq_length=S)   # flags say it all
    trainer = Trainer(cfg, ParallelContext.single_process(), torch.device("cpu"), out=io.StringIO())
    with torch.no_grad():
        logits = trainer.model.eval()(ref["tokens"][:, :-1])[..., :VOCAB]
    assert (logits - ref["logits"]).abs().max().item() <= tol["logit"]
    res, router = _first_step(trainer, [ref["tokens"][:1], ref["tokens"][1:]])

    assert abs(res.loss - ref["lm"]) <= tol["lm"], (res.loss, ref["lm"], tol["lm"])
    assert len(router) == len(ref["router"])
    for ours, theirs in zip(router, ref["router"]):
        assert (ours - theirs).abs().max().item() <= tol["delta"]
        assert torch.equal(ours.topk(K).indices.sort().values, theirs.topk(K).indices.sort().values)
    logged, summed = _expected_megatron_lb(ref)
    assert abs(res.moe["load_balancing_loss"] - logged) <= tol["lb_rel"] * logged, (res.moe, logged)
    hf_formula_on_ours = float(load_balancing_loss_func(tuple(router), E, K))
    assert abs(hf_formula_on_ours - ref["aux"]) <= tol["lb_rel"] * ref["aux"], (hf_formula_on_ours, ref["aux"])
    # the totals: transformers' loss, and the objective our gradient sees (the two formulas differ: both reported)
    assert abs(res.loss + COEF * hf_formula_on_ours - ref["total"]) <= tol["lm"] + COEF * tol["lb_rel"] * ref["aux"]
    ours_objective = res.loss + COEF * res.moe["load_balancing_loss"] * len(router)
    assert abs(ours_objective - (ref["lm"] + COEF * summed)) <= tol["lm"] + COEF * tol["lb_rel"] * summed

    back = tmp_path / "back"
    assert tool.main(["export-hf", str(ref["root"] / "ck"), str(back)]) == 0
    reloaded = getattr(transformers, MAKERS[kind][1]).from_pretrained(back).eval()
    with torch.no_grad():
        again = reloaded(ref["tokens"][:, :-1]).logits
    assert torch.equal(again, ref["logits"])
    assert hf_map.model_config_from_hf(json.loads((back / "config.json").read_text())) == hf_map.model_config_from_hf(
        saved)


def _keep_qk_norm_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The query/key norm weights' gradients as the optimizer's step sees them (reduced and clipped; replicated
    over tp: whole on every rank), filled in by the trainer's next step."""
    kept, step = {}, trainer.optimizer.step

    def keep_then_step():
        kept.update({e.name: e.master.grad.clone() for e in trainer.optimizer.entries
                     if e.name.endswith(("q_layernorm.weight", "k_layernorm.weight"))})
        return step()
    trainer.optimizer.step = keep_then_step
    return kept


# the layouts of the 4-rank launch: (name, flags, (tp, pp, dp, ep, etp))
LAYOUTS = (("ep 2 · tp 2", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                            "2"], (2, 1, 2, 2, 2)),
           ("ep 2 · tp 2 · pp 2", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                   "--expert-tensor-parallel-size", "1"], (2, 2, 1, 2, 1)))


def _four_ranks(rank: int, world: int, runs: dict) -> dict:
    out = {}
    for kind, (argv, tokens) in runs.items():
        for name, flags, sizes in LAYOUTS:
            cfg = parse_args(argv + flags, world_size=world)
            ctx, _ = build_context(cfg, world)
            assert (ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.ep_size, ctx.etp_size) == sizes
            trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
            trainer.model.train()
            grads = _keep_qk_norm_grads(trainer)
            per = 2 // ctx.dp_size          # the two sequences, one per micro-batch, split over dp
            res = trainer.train_step([{"tokens": tokens[i:i + 1]}
                                      for i in range(ctx.dp_rank() * per, (ctx.dp_rank() + 1) * per)])
            out[kind, name] = (ctx.is_last_stage(), res.loss, res.moe["load_balancing_loss"], res.grad_norm, grads)
            trainer.close()
            ctx.destroy()
    return out


def test_import_first_iteration_at_ep2_tp2_and_pp2(imported):
    """The imported checkpoints load at ep 2 · tp 2 (sequence parallelism, dp 2: one sequence per dp rank) and at
    ep 2 · tp 2 · pp 2 (etp 1, dp 1: both sequences through the pipeline), the same micro-batches as at ep 1, with
    the same first-iteration LM loss (on the last stage) and load-balancing loss (every rank: reduced over the
    stages), and the gradient norm and query/key norm gradients of the single process's first step (the same
    contributions summed in another order, grouped by tp rank: `RHO`; Qwen3's q/k norm weights get their
    gradients from every tp rank's heads)."""
    runs = {kind: (ref["argv"], ref["tokens"]) for kind, ref in imported.items()}
    results = run_ranks(_four_ranks, 4, runs, timeout=300)
    for kind, ref in imported.items():
        tol = _tolerances(kind, ref)
        logged, _ = _expected_megatron_lb(ref)
        single = Trainer(parse_args(ref["argv"], world_size=1), ParallelContext.single_process(), torch.device("cpu"),
                         out=io.StringIO())
        grads = _keep_qk_norm_grads(single)
        norm = _first_step(single, [ref["tokens"][:1], ref["tokens"][1:]])[0].grad_norm
        assert len(grads) == (2 * SHAPES[kind]["layers"] if kind == "qwen3_moe" else 0)
        for name, _, _ in LAYOUTS:
            seen = set()
            for last, loss, lb, grad_norm, got in (r[kind, name] for r in results):
                if last:
                    assert abs(loss - ref["lm"]) <= tol["lm"], (kind, name, loss, ref["lm"])
                assert abs(lb - logged) <= tol["lb_rel"] * logged, (kind, name, lb, logged)
                assert abs(grad_norm - norm) <= RHO * norm, (kind, name, grad_norm, norm)
                for n, g in got.items():
                    assert (g - grads[n]).abs().max().item() <= RHO * grads[n].abs().max().item(), (kind, name, n)
                seen.update(got)
            assert seen == grads.keys(), (kind, name)


def test_fused_expert_tensors_read_as_the_saved_ones(imported):
    """transformers 5's modules hold the experts fused (``mlp.experts.gate_up_proj``, ``down_proj``; the router
    ``mlp.gate``): a state dict in that form maps to the same tensors as the saved per-expert form."""
    import safetensors.torch as st

    for kind, ref in imported.items():
        saved = st.load_file(str(ref["root"] / "hf" / "model.safetensors"))
        cfg = hf_map.model_config_from_hf(json.loads((ref["root"] / "hf" / "config.json").read_text()))
        fused = {k: v for k, v in ref["model"].state_dict().items() if not k.endswith("inv_freq")}
        assert any(k.endswith("experts.gate_up_proj") for k in fused)
        a, b = hf_map.state_dict_from_hf(saved, cfg), hf_map.state_dict_from_hf(fused, cfg)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


MIXTRAL = {"model_type": "mixtral", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 48, "vocab_size": 10, "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN3 = {**MIXTRAL, "model_type": "qwen3_moe", "num_local_experts": None, "num_experts": 4,
         "moe_intermediate_size": 8}


@pytest.mark.parametrize("hf, match", [
    ({**MIXTRAL, "router_jitter_noise": 0.1}, r"^router_jitter_noise 0.1: .*--moe-input-jitter-eps\)$"),
    ({**MIXTRAL, "sliding_window": 4096}, r"^sliding_window 4096: sliding-window attention is not built here$"),
    ({**MIXTRAL, "num_experts_per_tok": 5}, r"^config.json: num_experts_per_tok 5 is more than the 4 experts$"),
    ({**MIXTRAL, "num_local_experts": 0}, r"^mixtral config with 0 experts and no MoE layer: a dense model"),
    ({**QWEN3, "attention_bias": True}, r"^attention_bias true: Qwen3-MoE's q/k/v/o projections with biases"),
    ({**QWEN3, "use_sliding_window": True, "sliding_window": 64}, r"^use_sliding_window with sliding_window 64: "),
    ({**QWEN3, "mlp_only_layers": [0, 1]}, r"^qwen3_moe config with 4 experts and no MoE layer"),
    ({**QWEN3, "num_local_experts": 8}, r"^config.json: num_experts 4 and num_local_experts 8 disagree$"),
    ({**QWEN3, "moe_intermediate_size": None}, r"^config.json has no moe_intermediate_size \(a qwen3_moe config"),
], ids=["jitter", "sliding-window", "topk", "no-experts", "attention-bias", "qwen-sliding", "all-dense",
        "experts-disagree", "no-moe-width"])
def test_configs_we_cannot_represent_are_one_line(hf, match):
    with pytest.raises(hf_map.HFInteropError, match=match) as e:
        hf_map.model_config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_import_tool_refuses_in_one_line(imported, tmp_path, capsys):
    src = imported["mixtral"]["root"] / "hf"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "router_jitter_noise": 0.5}))
    assert load_tool().main(["import-hf", str(bad), str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "router_jitter_noise 0.5" in err, err


def test_exports_that_cannot_be_expressed_are_refused():
    base = ("--mock-data --vocab-size 10 --num-layers 2 --hidden-size 16 --ffn-hidden-size 32 --num-attention-heads 2 "
            "--normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear "
            "--num-experts 4").split()
    for extra, match in ((["--moe-shared-expert-intermediate-size", "8"], "have no shared experts"),
                         (["--moe-router-score-function", "sigmoid"], "no --moe-router-score-function sigmoid"),
                         (["--moe-layer-freq", "2"], "without --qk-layernorm an MoE model exports as Mixtral"),
                         (["--moe-router-pre-softmax"], "renormalises the top-k probabilities")):
        cfg = parse_args(base + extra, world_size=1).model
        with pytest.raises(hf_map.HFInteropError, match=match):
            hf_map.hf_model_type(cfg)
    assert hf_map.hf_model_type(parse_args(base, world_size=1).model) == "mixtral"
    assert hf_map.hf_model_type(parse_args(base + ["--qk-layernorm", "--moe-layer-freq", "[1,0]"],
                                           world_size=1).model) == "qwen3_moe"
    dense_qk = [f for f in base if f not in ("--num-experts", "4")] + ["--qk-layernorm"]
    with pytest.raises(hf_map.HFInteropError, match="a dense Qwen3"):
        hf_map.hf_model_type(parse_args(dense_qk, world_size=1).model)


def test_qk_layernorm_with_tp_needs_sequence_parallelism():
    """Training at tp > 1 needs sequence parallelism (the query/key norm gradients are summed over tp with the
    sequence-parallel ones): the command line says so in one line; a model built without it (for inference) runs
    in eval and refuses a training forward (shown on one process with the attention's flag set as tp 2 sets it)."""
    argv = ("--mock-data --vocab-size 10 --num-layers 1 --hidden-size 16 --num-attention-heads 2 "
            "--qk-layernorm --tensor-model-parallel-size 2").split()
    with pytest.raises(ConfigError, match=r"^--qk-layernorm with --tensor-model-parallel-size 2 needs "
                                          r"--sequence-parallel: [^\n]*$"):
        parse_args(argv, world_size=2)
    parse_args(argv + ["--sequence-parallel"], world_size=2)
    from megareshard.models.gpt import GPTModel

    model = GPTModel(parse_args(argv[:-2], world_size=1).model, ParallelContext.single_process())
    model.layers["0"].attention._qk_norm_untrainable = True
    tokens = torch.zeros((1, 4), dtype=torch.long)
    with torch.no_grad():
        model.eval()(tokens)
    with pytest.raises(RuntimeError, match="trains with sequence parallelism only"):
        model.train()(tokens)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_generation_greedy_with_and_without_the_cache_equals_transformers(imported, kind):
    """tools/generate.py's loader on the imported checkpoint: greedy decoding with the key/value cache (the
    generator replicas' path, where the query/key norms are applied too) and without it continue a prompt as
    transformers' ``generate`` does (argmax of logits that agree to rounding: no near-tie in these tiny models)."""
    from megareshard.generation import generate_ids, load_for_generation
    from megareshard.generation_kv import greedy_kv

    ref = imported[kind]
    model, cfg = load_for_generation(str(ref["root"] / "ck"))
    prompt = ref["tokens"][0, :5].tolist()
    with torch.no_grad():
        theirs = ref["model"].generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                       pad_token_id=0)[0].tolist()
    assert generate_ids(model, cfg, prompt, max_new_tokens=6) == theirs
    assert greedy_kv(model, prompt, max_new_tokens=6) == theirs
