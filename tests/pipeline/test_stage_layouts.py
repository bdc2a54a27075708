"""Per-stage layouts (--stage-layouts): every pipeline stage its own (tp, dp).

* GPT with ``tp1dp4,tp2dp2`` and ``tp2dp2,tp4dp1`` (8 ranks, pp 2) equals the single-process
  run: losses of the iterations, the forward-only loss, the gradient norm and every gradient
  after the first step (1e-5 relative, fp32, dropout 0). Covered on the way: activations
  resharded between meshes of different shapes (batch over each stage's dp, sequence over
  each stage's tp under --sequence-parallel), each stage's dp group reducing its own
  gradients (ZeRO 1 in one case), the tied embedding between a first and last stage with
  different tp (and vocabulary padding), the global norm counting every element once.
* A Llama-style GPT (RMSNorm, RoPE, SwiGLU, grouped-query attention with 4 key/value groups
  split over each stage's tp, untied output layer, no biases) in both layouts, in the same
  launch: delayed weight gradients with ZeRO 1, and sequence parallelism with selective
  recomputation and ZeRO 2.
* StageTopology placement and groups; validation errors name the numbers.
"""
from __future__ import annotations

import io

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.parallel import ParallelContext, StageTopology, TopologyError
from megareshard.pipeline.stage import stage_layouts
from megareshard.training import Trainer
from tests.harness import run_ranks
from tests.pipeline.test_runtime import ITERS, _argv, _check, _run, reference  # noqa: F401 (fixture)

WORLD = 8
CASES = [("tp1dp4,tp2dp2", dict(schedule="1f1b", strategy="broadcast"), []),
         ("tp1dp4,tp2dp2", dict(schedule="eager-1f1b", delay=True, strategy="sendrecv"),
          ["--zero-stage", "1", "--pipeline-recv-posting", "grouped"]),
         ("tp2dp2,tp4dp1", dict(schedule="eager-1f1b", delay=True, strategy="broadcast", sp=True),
          ["--pipeline-recv-posting", "mixed"]),
         ("tp2dp2,tp4dp1", dict(schedule="1f1b", strategy="allgather"), ["--zero-stage", "2"])]
# Llama-style: 8 query heads in 4 key/value groups (tp 4: one group per rank), 4 channels per head
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
         "--num-attention-heads", "8", "--num-query-groups", "4", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear"]
LLAMA_CASES = [("tp1dp4,tp2dp2", dict(schedule="eager-1f1b", delay=True, strategy="sendrecv"), LLAMA + ["--zero-stage", "1"]),
               ("tp2dp2,tp4dp1", dict(schedule="1f1b", delay=True, strategy="broadcast", sp=True),
                LLAMA + ["--zero-stage", "2", "--recompute-activations"])]


def _stage_argv(layouts: str, kw: dict, extra: list[str]) -> list[str]:
    return _argv(pp=2, **kw) + ["--stage-layouts", layouts] + extra


def _worker(rank, world_size, cases):
    out, ctxs = [], {}
    for layouts, kw, extra in cases:
        if layouts not in ctxs:
            ctxs[layouts] = ParallelContext.create(StageTopology(world_size, layouts))
        ctx = ctxs[layouts]
        cfg = parse_args(_stage_argv(layouts, kw, extra), world_size=world_size)
        trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
        losses, norm, grads, records = _run(trainer, ctx)
        extra_out = {"eval": records[-1]["eval_loss"], "m": cfg.plan.num_microbatches,
                     "mem": records[-1]["peak_mem_mb_per_stage"]}
        keep = ctx.tp_rank() == 0 and ctx.dp_rank() == 0
        out.append((ctx.pp_rank(), (losses, norm, grads, extra_out) if keep else None))
    return out


@pytest.fixture(scope="module")
def llama_reference():
    cfg = parse_args(_argv() + LLAMA, world_size=1)
    ctx = ParallelContext.single_process()
    trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
    losses, norm, grads, records = _run(trainer, ctx)
    return losses, norm, grads, records[-1]["eval_loss"]


def _check_untied(ref, per_stage: dict[int, tuple], label: str) -> None:
    """Like ``_check``, for an untied output layer: every parameter, the head included, lives on one stage."""
    ref_losses, ref_norm, ref_grads, ref_eval = ref
    losses, norm, _, extra = per_stage[1]
    assert extra["eval"] == pytest.approx(ref_eval, rel=1e-5), f"{label}: forward-only (evaluation) loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=label)
    assert per_stage[0][0] == losses and norm == pytest.approx(ref_norm, rel=1e-5), label
    grads = {**per_stage[0][2], **per_stage[1][2]}
    assert len(grads) == len(per_stage[0][2]) + len(per_stage[1][2]) and grads.keys() == ref_grads.keys(), label
    for name, want in ref_grads.items():
        scale = want.abs().max().item()
        err = (grads[name] - want).abs().max().item()
        assert err <= 1e-5 * max(scale, 1e-12), f"{label}: gradient of {name} differs by {err:.3g} (max {scale:.3g})"


@pytest.mark.slow
def test_gpt_with_per_stage_layouts_matches_single_process(reference, llama_reference):
    results = run_ranks(_worker, WORLD, CASES + LLAMA_CASES, timeout=400, nccl_check=True)
    for k, (layouts, kw, extra) in enumerate(CASES + LLAMA_CASES):
        label = f"{layouts} {kw} {extra}"
        per_stage = {r[k][0]: r[k][1] for r in results if r[k][1] is not None}
        assert sorted(per_stage) == [0, 1], label
        if k < len(CASES):
            _check(reference, per_stage, 2, label)
        else:
            assert "output_layer.weight" in per_stage[1][2] and "output_layer.weight" not in per_stage[0][2]
            _check_untied(llama_reference, per_stage, label)
        assert len(per_stage[1][0]) == ITERS
        assert per_stage[1][3]["m"] == 8 // (1 * 4 if layouts.startswith("tp1dp4") else 2), label


# ---- placement, groups, validation (no processes) ----------------------------------------------
def test_stage_topology_places_stages_on_consecutive_blocks_tp_innermost():
    topo = StageTopology(12, "tp1dp4,tp2dp2,tp4dp1", nproc_per_node=4)
    assert topo.pp == 3 and topo.offsets == (0, 4, 8) and topo.max_dp == 4
    for r in range(12):
        c = topo.coords(r)
        assert topo.rank_of(tp=c.tp, dp=c.dp, pp=c.pp) == r
    assert [topo.coords(r).pp for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert topo.groups("tp") == [(0,), (1,), (2,), (3,), (4, 5), (6, 7), (8, 9, 10, 11)]
    assert topo.groups("dp") == [(0, 1, 2, 3), (4, 6), (5, 7), (8,), (9,), (10,), (11,)]
    assert topo.groups(("tp", "dp")) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert topo.embedding_groups() == [(0, 1, 2, 3, 8, 9, 10, 11)]
    for fam in ("tp", "dp", ("tp", "dp")):  # every family partitions the world
        flat = sorted(r for g in topo.groups(fam) for r in g)
        assert flat == list(range(12))
    assert {topo.coords(r).host for r in topo.stage_ranks(1)} == {1}  # a stage per host


def test_stage_layouts_give_each_stage_its_mesh_and_spec():
    cfg = parse_args(_stage_argv("tp2dp2,tp4dp1", dict(sp=True), []), world_size=8)
    lay = stage_layouts(cfg, StageTopology(8, "tp2dp2,tp4dp1"))
    assert [(x.mesh.shape, str(x.hidden_spec), list(x.mesh.flat_ranks)) for x in lay] == [
        ((2, 2), "S1,S0,R", [0, 1, 2, 3]), ((1, 4), "S1,S0,R", [4, 5, 6, 7])]
    cfg = parse_args(_stage_argv("tp1dp4,tp2dp2", {}, []), world_size=8)
    assert cfg.pp == 2 and cfg.plan.dp == 4 and cfg.plan.num_microbatches == 2


@pytest.mark.parametrize("layouts, extra, world, match", [
    ("tp1dp4,tp2dp2", ["--pipeline-model-parallel-size", "3"], 8,
     r"has 2 entries but --pipeline-model-parallel-size is 3"),
    ("tp1dp4,tp2dp4", [], 8, r"the stages need 1×4 \+ 2×4 = 12 ranks but the world size is 8"),
    ("tp2dp2,tp8dp1", ["--hidden-size", "36"], 12, r"--hidden-size 36 is not divisible by stage 1's tp 8"),
    ("tp1dp4,tp4dp1", ["--num-attention-heads", "2"], 8, r"--num-attention-heads 2 is not divisible by stage 1's tp 4"),
    ("tp1dp3,tp1dp2", [], 5, r"stage 1's dp 2 does not divide the largest dp 3"),
    ("tp1dp4,tp2", [], 8, r"entry 1 'tp2' is not of the form tp<N>dp<M>"),
    ("tp1dp4,tp2dp2", ["--tensor-model-parallel-size", "2"], 8, r"conflicts with --stage-layouts"),
])
def test_bad_stage_layouts_are_refused_with_the_numbers(layouts, extra, world, match):
    argv = [a for a in _argv(pp=1) if a not in ()] + ["--stage-layouts", layouts] + extra
    with pytest.raises(ConfigError, match=match):
        parse_args(argv, world_size=world)


def test_stage_topology_refuses_a_wrong_world():
    with pytest.raises(TopologyError, match=r"need 1×4 \+ 2×2 = 8 ranks but the world size is 6"):
        StageTopology(6, "tp1dp4,tp2dp2")
