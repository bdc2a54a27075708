"""Mixture of experts inside pipeline stages (issue #52): every schedule family, expert parallelism per stage, the
expert weights' gradients delayed into W like the dense ones', the router losses of every stage logged.

One launch of 4 gloo ranks in NCCL's checking mode trains a dropless MoE GPT (4 layers, the first two dense and
the last two MoE: one pipeline stage holds no expert, except where said) for 3 iterations in eight layouts, and
each reproduces the single-process run — the LM loss, the load-balancing and z losses (the mean over the model's MoE layers, summed
over the stages as pp 1 logs it), the gradient norm of the first step and every weight after the last:

* pp 2 · dp 2 · ep 2: 1F1B (alltoall, ZeRO 0), eager-1F1B (allgather, ZeRO 1), zb-h1 (delayed W; alltoall,
  ZeRO 2, --overlap-grad-reduce: the expert buckets reduced over the expert-data-parallel group from the R
  action; --recompute-granularity full: every layer replayed in I), interleaved 1F1B with two virtual stages
  per rank and delayed W (alltoall, ZeRO-3: every rank holds an MoE layer), zbv (allgather);
* tp 2 · pp 2 · ep 2 (etp 1, sequence parallel): 1F1B with delayed W (alltoall);
* per-stage layouts tp 2 · dp 1 then tp 1 · dp 2 (--stage-layouts; ep 2, etp 1, sequence parallel, an MoE layer
  in each stage, the load-balancing loss per sequence: the stages' local micro-batches differ);
* ZeRO-3, the expert weights in units of their own sharded over the expert-data-parallel group: the interleaved
  layout above (edp 1: each rank's experts whole) and pp 1 · dp 4 · ep 2 (allgather; edp 2), whose checkpoint
  (the weights saved from their shards) loads into one process bit for bit.

Tolerances (tests/tolerances.py), as tests/test_moe_training.py's: the first step runs the same weights through
other row groupings and reduction orders, so the losses differ by a forward's rounding and the gradient norm by
the gradients' (`RHO_TOKENS`: every gradient element a sum over the batch's tokens, grouped otherwise by each
layout); after t updates each weight element is apart by at most bound[t] (`element_error_bounds`),
which moves a loss by at most the gradient norm times sqrt(n)·bound[t], twice for what first order leaves out; the
router losses are held to the LM loss's relative bound.

In one process, full recomputation of the MoE layers trains bit for bit as without it: the router losses are
logged once and reach the gradient once, though backward runs each layer again.

A single-process check shows the expert GEMMs' weight gradients (one GEMM per expert, and torch._grouped_mm on
16-byte-aligned sizes where this torch runs it) and the router's wait for W under a weight-gradient store and
equal the immediate ones bit for bit.
"""
from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.parallel import ParallelContext, Topology
from megareshard.run_setup import build_context
from megareshard.training import Trainer
from tests.harness import run_ranks
from tests.tolerances import U, element_error_bounds, forward_tolerance, gpt_forward_reductions

ITERS, LR, BETAS = 3, 1e-2, (0.9, 0.999)
H, F, FE, S, L, HEADS, E, GBS = 16, 32, 24, 8, 4, 2, 4, 8
# A gradient element sums products over the global batch's S·GBS tokens, and the layouts group those tokens
# differently (micro-batches per dp rank, sequence halves per tp rank under sequence parallelism, the experts'
# rows gathered from every ep rank into one GEMM): the same terms summed in another order, at most S·GBS·u
# apart relative to their magnitudes, times the cancellation kappa <= 16 of tests/tolerances.py
RHO_TOKENS = S * GBS * 16 * U
NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
# per-stage layouts give the stages different local micro-batches (2 samples at dp 1, 1 at dp 2): the
# load-balancing loss per sequence (seq_aux_loss) is the same whatever the grouping; an MoE layer on each stage
SEQ = "--moe-router-load-balancing-type seq_aux_loss --moe-layer-freq [1,0,0,1]"
PP2 = "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2"
TP2 = f"{PP2} --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1"
# (label, flags): the 4-rank layouts; the tp-2 ones come last (their own context)
LAYOUTS = [
    ("1f1b alltoall zero0", f"{PP2} --pipeline-schedule 1f1b --moe-token-dispatcher-type alltoall"),
    ("eager-1f1b allgather zero1", f"{PP2} --pipeline-schedule eager-1f1b --moe-token-dispatcher-type allgather "
                                   "--zero-stage 1"),
    ("zb-h1 alltoall zero2 R recompute", f"{PP2} --pipeline-schedule zb-h1 --moe-token-dispatcher-type alltoall "
                                         "--zero-stage 2 --overlap-grad-reduce --recompute-granularity full"),
    ("interleaved V2 delayed W alltoall zero3", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 "
                                                "--delay-wgrad-compute --moe-token-dispatcher-type alltoall --zero-stage 3"),
    ("zbv allgather", f"{PP2} --pipeline-schedule zbv --moe-token-dispatcher-type allgather"),
    ("pp1 dp4 allgather zero3", "--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather --zero-stage 3"),
    ("tp2 1f1b delayed W alltoall", f"{TP2} --pipeline-schedule 1f1b --delay-wgrad-compute "
                                    "--moe-token-dispatcher-type alltoall"),
    ("stage layouts tp2dp1,tp1dp2", f"--stage-layouts tp2dp1,tp1dp2 --sequence-parallel --expert-model-parallel-size 2 "
                                    f"--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall {SEQ}"),
]

SAVED = "pp1 dp4 allgather zero3"


def _argv(flags: str = "", iters: int = ITERS) -> list[str]:
    return (f"--mock-data --vocab-size 64 --num-layers {L} --hidden-size {H} --ffn-hidden-size {F} "
            f"--num-attention-heads {HEADS} --seq-length {S} --micro-batch-size 1 --global-batch-size {GBS} "
            f"--train-iters {iters} --lr {LR} --min-lr {LR} --device cpu --seed 5 --hidden-dropout 0 "
            f"--attention-dropout 0 --swiglu --disable-bias-linear --clip-grad 0 "
            f"--num-experts {E} --moe-router-topk 2 --moe-ffn-hidden-size {FE} --moe-aux-loss-coeff 0.01 "
            f"--moe-z-loss-coeff 0.001 --moe-layer-freq [0,0,1,1] {flags}").split()


@contextlib.contextmanager
def _one_thread():
    """The single-process runs on one intra-op thread, as the ranks run (tiny GEMMs: a second thread only spins)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _records(trainer: Trainer) -> list[dict]:
    return [{k: r[k] for k in ("loss", "grad_norm", "lr", *NAMES) if k in r} for r in trainer.train()]


def _model_flags(flags: str) -> str:
    """The flags of a layout that change the model (the single-process reference runs with them)."""
    return SEQ if SEQ in flags else ""


def _full_weights(trainer: Trainer, ctx) -> dict[str, torch.Tensor]:
    """This stage's weights, whole: dense ones gathered over tp, experts over etp and ep (collective in the stage)."""
    from megareshard.models.moe import gather_full_expert_tensor
    from megareshard.tensor_parallel import gather_full_tensor

    return {name: (gather_full_expert_tensor(p.data, p, ctx) if getattr(p, "expert_parallel", False)
                   else gather_full_tensor(p.data, p, ctx)) for name, p in trainer.model.named_parameters()}


def _ranks(rank, world, save_dir):
    out, ctx, shape = {}, None, None
    for label, flags in LAYOUTS:
        if label == SAVED:   # saves at its last iteration (ZeRO-3: the expert weights from their edp shards)
            flags += f" --save {save_dir} --save-interval 100"
        cfg = parse_args(_argv(flags), world_size=world)
        if (cfg.tp, cfg.pp, cfg.parallel.stage_layouts) != shape:   # a context per layout shape, in LAYOUTS order
            if ctx is not None:
                ctx.destroy()
            shape = cfg.tp, cfg.pp, cfg.parallel.stage_layouts
            if cfg.parallel.stage_layouts:   # the trainer's own: every stage its expert grid
                ctx = build_context(cfg, world)[0]
            else:
                ctx = ParallelContext.create(Topology(world, tp=cfg.tp, pp=cfg.pp), expert_model_parallel_size=2,
                                             expert_tensor_parallel_size=cfg.parallel.expert_tensor_parallel_size)
        log = io.StringIO()
        t = Trainer(cfg, ctx, torch.device("cpu"), out=log)
        records = _records(t)
        t.close()
        with t.optimizer.full_params():   # ZeRO-3: every unit gathered (collective over dp and edp)
            weights = _full_weights(t, ctx)
        if t.pipeline is not None:
            t.pipeline.close()
        sharder = t.optimizer.sharder   # ZeRO-3: the expert weights' units and the ranks sharing their rows
        out[label] = {"records": records, "log": log.getvalue() if t.reporting else "",
                      "expert_units": [u.D for u in sharder.units if u.entries[0].expert] if sharder else None,
                      "weights": weights if ctx.tp_rank() == 0 and ctx.dp_rank() == 0 else {}}
    ctx.destroy()
    return out


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe-zero3-save"))


@pytest.fixture(scope="module")
def runs(save_dir):
    """The single-process references (records, whole weights) by model flags, and every rank's results."""
    refs = {}
    with _one_thread():
        for model in dict.fromkeys(_model_flags(flags) for _, flags in LAYOUTS):
            ref = Trainer(parse_args(_argv(model), world_size=1), ParallelContext.single_process(),
                          torch.device("cpu"), out=io.StringIO())
            # the vocabulary's padding rows dropped, as the ranks' gathers drop them
            refs[model] = _records(ref), _full_weights(ref, ref.ctx)
    return refs, run_ranks(_ranks, 4, save_dir, timeout=400, nccl_check=True)


def _loss_tolerances(ref, n_params):
    bounds = element_error_bounds([r["lr"] for r in ref], BETAS, RHO_TOKENS)
    fwd = forward_tolerance(gpt_forward_reductions(L, H, F + FE, HEADS, H // HEADS, S), 1.0)
    return [2 * r["grad_norm"] * math.sqrt(n_params) * bounds[t] + fwd for t, r in enumerate(ref)], bounds[-1]


@pytest.mark.parametrize("label, flags", LAYOUTS)
def test_moe_pipeline_matches_single_process(runs, label, flags):
    refs, per_rank = runs
    ref, ref_weights = refs[_model_flags(flags)]
    names = [n for n in NAMES if n in ref[0]]
    assert len(names) == 2 and all(r[name] > 0 for r in ref for name in names)
    tols, per_element = _loss_tolerances(ref, sum(w.numel() for w in ref_weights.values()))
    weights = {}
    for rank, res in enumerate(per_rank):
        got = res[label]["records"]
        assert len(got) == len(ref), (label, rank)
        # the first step, at the same weights: the gradient norm apart by the gradients' rounding only
        assert abs(got[0]["grad_norm"] - ref[0]["grad_norm"]) <= RHO_TOKENS * ref[0]["grad_norm"], (label, rank, got[0])
        for t, (g, r) in enumerate(zip(got, ref)):
            assert abs(g["loss"] - r["loss"]) <= tols[t], (label, rank, t, g["loss"], r["loss"], tols[t])
            rel = tols[t] / abs(r["loss"])
            for name in names:   # every rank logs the model's mean over its MoE layers, both stages' summed
                assert abs(g[name] - r[name]) <= rel * abs(r[name]) + 4 * 2.0 ** -24, (label, rank, t, name, g, r)
        weights.update(res[label]["weights"])
        if "zero3" in label:   # expert weights in units of their own, sharded over edp: a stage's ranks / ep 2
            edp = 4 // (1 if "pp1" in label else 2) // 2
            assert res[label]["expert_units"] and set(res[label]["expert_units"]) == {edp}, (label, rank, res[label])
    log = "".join(res[label]["log"] for res in per_rank)   # the last stage's first rank reports
    assert all(f"{name}: " in log for name in names), log
    tied = weights.pop("output_layer.weight", None)   # the last stage's copy of the tied word embedding
    assert weights.keys() == ref_weights.keys(), label
    if tied is not None:
        assert torch.equal(tied, weights["embedding.word_embeddings.weight"]), label
    for name, w in ref_weights.items():
        err = (weights[name] - w).norm().item()
        assert err <= math.sqrt(w.numel()) * per_element, (label, name, err)


def test_zero3_expert_shards_save_and_load_in_one_process(runs, save_dir):
    """The ZeRO-3 run's checkpoint (expert weights saved from their edp shards, each its box of the [E, ...]
    tensor) loads into one process: every weight the ranks held after the last step, bit for bit."""
    weights = {}
    for res in runs[1]:
        weights.update(res[SAVED]["weights"])
    with _one_thread():
        loaded = Trainer(parse_args(_argv(f"--load {save_dir}"), world_size=1), ParallelContext.single_process(),
                         torch.device("cpu"), out=io.StringIO())
        assert loaded.iteration == ITERS
        got = _full_weights(loaded, loaded.ctx)
    assert got.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(got[name], w), name


def test_expert_and_router_weight_gradients_wait_for_w():
    from megareshard.models.gpt import _normal_init
    from megareshard.models.config import ModelConfig
    from megareshard.models.moe import MoELayer
    from megareshard.tensor_parallel import WeightGradStore

    single = ParallelContext.single_process()
    grouped = [False] + ([True] if hasattr(torch, "_grouped_mm") else [])
    for use_grouped in grouped:
        cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=S,
                          vocab_size=64, swiglu=True, num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=32,
                          moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
        layer = MoELayer(cfg, single, "layers.0.mlp", lambda name, std: _normal_init(5, name, std), 0.01)
        layer.experts.grouped_gemm = use_grouped   # torch._grouped_mm: on CPU where its strides are 16-byte aligned
        x = torch.randn(S, 2, 16, generator=torch.Generator().manual_seed(3))
        g = torch.randn(S, 2, 16, generator=torch.Generator().manual_seed(4))

        def backward(store):
            for m in layer.modules():
                if hasattr(m, "wgrad_store"):
                    m.wgrad_store = store
            inp = x.clone().requires_grad_(True)
            (layer(inp) * g).sum().backward()
            for m in layer.modules():
                if hasattr(m, "wgrad_store"):
                    m.wgrad_store = None
            return inp.grad

        layer.zero_grad(set_to_none=True)
        xg = backward(None)
        now = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        store = WeightGradStore()
        xg_delayed = backward(store)
        waiting = [n for n, p in layer.named_parameters() if p.grad is None]
        # the expert matrices, their fc1 biases and the router wait for W; fc2's bias, which the routing
        # probability scales, is autograd's
        assert sorted(waiting) == sorted(n for n, _ in layer.named_parameters() if n != "experts.fc2.bias"), waiting
        assert torch.equal(xg, xg_delayed) and store.flush() == 4   # three expert GEMMs' closures, the router's
        for n, p in layer.named_parameters():
            assert torch.equal(p.grad, now[n]), (use_grouped, n)


def test_full_recomputation_counts_router_losses_once():
    def run(flags):
        t = Trainer(parse_args(_argv(flags, iters=2), world_size=1), ParallelContext.single_process(),
                    torch.device("cpu"), out=io.StringIO())
        return _records(t)

    with _one_thread():
        plain, recomputed = run(""), run("--recompute-granularity full")
    assert plain == recomputed, (plain, recomputed)


def test_stage_layouts_whose_expert_grid_does_not_tile_a_stage_one_line():
    from megareshard.arguments import ConfigError

    with pytest.raises(ConfigError) as err:   # stage 0: ep 2 × etp (its tp) 2 = 4 over its 2 ranks
        parse_args(_argv("--stage-layouts tp2dp1,tp1dp2 --sequence-parallel --expert-model-parallel-size 2"),
                   world_size=4)
    text = str(err.value)
    assert "\n" not in text and ("--expert-model-parallel-size 2 × --expert-tensor-parallel-size 2 = 4 does not divide "
                                 "the 2 ranks of pipeline stage 0 (--stage-layouts entry tp2dp1)") in text, text


def test_expert_gemm_equals_autograd_per_expert_linear():
    """The experts' Function against autograd through one F.linear per expert (the layer before it), an expert
    without rows included: one GEMM per expert runs the same kernels (bit for bit); torch._grouped_mm may sum in
    another order, so it is held to the longest reduction's rounding (32 products: 4·32·u of the largest value)."""
    from megareshard.models.moe.expert_gemm import expert_linear

    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(12, 16, generator=g), torch.randn(3, 32, 16, generator=g), torch.randn(3, 32, generator=g)
    grad, counts = torch.randn(12, 32, generator=g), [4, 0, 8]
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    ref = torch.cat([torch.nn.functional.linear(xe, leaves[1][e], leaves[2][e])
                     for e, xe in enumerate(leaves[0].split(counts))])
    ref.backward(grad)
    for grouped in [False] + ([True] if hasattr(torch, "_grouped_mm") else []):
        mine = [t.clone().requires_grad_(True) for t in (x, w, b)]
        out = expert_linear(*mine, counts, object(), grouped)
        out.backward(grad)
        for got, want in [(out, ref)] + [(a.grad, r.grad) for a, r in zip(mine, leaves)]:
            tol = 4 * 32 * U * want.abs().max().item() if grouped else 0.0
            assert (got - want).abs().max().item() <= tol, grouped
