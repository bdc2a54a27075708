"""The pipelined U-Transformer (skip edges across non-adjacent stages) equals the single-process one.

One 4-rank launch (start-up dominates on 2 cores) loops over layouts, reusing each
layout's ParallelContext:

* pp 4 · tp 1 · dp 1, blocks split 1,1,1,2: skip0 goes 0->3 (across 3 stage boundaries),
  skip1 goes 1->3 (across 2); split 1,1,2,1: skip0 0->3, skip1 1->2 (a named edge beside the
  chain edge). Schedules 1f1b and eager-1f1b with delayed W, strategies broadcast and
  sendrecv, skip merges add and concat.
* pp 2 · tp 2: both skips go 0->1 next to the chain edge, tensor-parallel blocks.
* gpipe with allgather resharding at pp 4 once;
* per-stage layouts tp1dp2,tp2dp1 (pp 2): the skip and chain tensors are resharded
  between a dp-2 mesh and a tp-2 mesh.

Same seed, same global batch, fp32, dropout 0: the losses of ITERS iterations and every
gradient after the first step match the single-process trainer within 1e-5 relative, and
so do the gradient norm and the forward-only (evaluation) loss.
"""
from __future__ import annotations

import io

import pytest
import torch

from megareshard.arguments import parse_model_args
from megareshard.parallel import ParallelContext, StageTopology, Topology
from megareshard.tensor_parallel import gather_full_state_dict
from megareshard.training import Trainer
from tests.harness import run_ranks

ITERS = 2
WORLD = 4


def _argv(tp=1, pp=1, schedule="1f1b", delay=False, strategy="broadcast", merge="add", per_stage=None,
          stage_layouts=None, posting=None):
    argv = ["--mock-data", "--vocab-size", "96", "--u-levels", "3", "--u-widths", "16,24,32",
            "--u-blocks-per-level", "1", "--u-shorten-factor", "2", "--u-skip-merge", merge,
            "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-2", "--min-lr", "1e-3",
            "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--device", "cpu", "--seed", "11",
            "--pipeline-schedule", schedule, "--reshard-strategy", strategy, "--reshard-chunks", "2",
            "--eval-interval", str(ITERS), "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    if stage_layouts:
        argv += ["--stage-layouts", stage_layouts]
    else:
        argv += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    argv += ["--delay-wgrad-compute"] if delay else []
    argv += ["--num-layers-per-stage", per_stage] if per_stage else []
    argv += ["--pipeline-recv-posting", posting] if posting else []  # NCCL's receive posting, run on gloo
    return argv


def _run(trainer: Trainer, ctx: ParallelContext):
    indices = next(trainer._train_iter)
    first = trainer.train_step(trainer._microbatches(trainer.train_data, indices))
    trainer.iteration = 1
    trainer.optimizer.materialize_param_grads()
    grads = gather_full_state_dict(trainer.model, ctx, grads=True)
    records = trainer.train()
    return [first.loss] + [r["loss"] for r in records], first.grad_norm, grads, records[-1]["eval_loss"]


def _cases():
    pp4 = [dict(per_stage="1,1,1,2", schedule="1f1b", strategy="broadcast", merge="add", posting="mixed"),
           dict(per_stage="1,1,1,2", schedule="eager-1f1b", delay=True, strategy="sendrecv", merge="concat",
                posting="mixed"),
           dict(per_stage="1,1,2,1", schedule="eager-1f1b", delay=True, strategy="broadcast", merge="add"),
           dict(per_stage="1,1,2,1", schedule="1f1b", strategy="sendrecv", merge="concat"),
           dict(per_stage="1,1,1,2", schedule="gpipe", strategy="allgather", merge="add", posting="grouped")]
    pp2 = [dict(per_stage="2,3", schedule="eager-1f1b", delay=True, strategy="broadcast", merge="concat")]
    mixed = [dict(per_stage="2,3", schedule="1f1b", strategy="sendrecv", merge="add", stage_layouts="tp1dp2,tp2dp1"),
             dict(per_stage="1,4", schedule="eager-1f1b", delay=True, strategy="broadcast", merge="concat",
                  stage_layouts="tp1dp2,tp2dp1")]
    return [(("uniform", 1, 4), pp4), (("uniform", 2, 2), pp2), (("stages", "tp1dp2,tp2dp1", 2), mixed)]


def _worker(rank, world_size, cases):
    out = []
    for (kind, a, pp), configs in cases:
        topo = Topology(world_size, tp=a, pp=pp) if kind == "uniform" else StageTopology(world_size, a)
        ctx = ParallelContext.create(topo)
        keep = ctx.tp_rank() == 0 and ctx.dp_rank() == 0
        for kw in configs:
            tp = a if kind == "uniform" else 1
            cfg, spec = parse_model_args("utransformer", _argv(tp=tp, pp=pp, **kw), world_size=world_size)
            trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO(), model_spec=spec)
            edges = [str(e) for e in trainer.pipeline.graph.edges]
            res = _run(trainer, ctx)
            out.append((kw, ctx.pp_rank(), edges, res if keep else None))
    return out


def _reference(merge):
    cfg, spec = parse_model_args("utransformer", _argv(merge=merge), world_size=1)
    ctx = ParallelContext.single_process()
    return _run(Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO(), model_spec=spec), ctx)


EXPECTED_EDGES = {"1,1,1,2": ["0->1", "0->3:skip0", "1->2", "1->3:skip1", "2->3"],
                  "1,1,2,1": ["0->1", "0->3:skip0", "1->2", "1->2:skip1", "2->3"],
                  "2,3": ["0->1", "0->1:skip0", "0->1:skip1"],
                  "1,4": ["0->1", "0->1:skip0"]}


def test_pipelined_utransformer_matches_single_process():
    refs = {m: _reference(m) for m in ("add", "concat")}
    cases = _cases()
    results = run_ranks(_worker, WORLD, cases, timeout=300, nccl_check=True)
    n = sum(len(c) for _, c in cases)
    assert all(len(r) == n for r in results)
    for k in range(n):
        entries = [r[k] for r in results]
        kw, _, edges, _ = entries[0]
        label = str(kw)
        assert edges == EXPECTED_EDGES[kw["per_stage"]], (label, edges)
        per_stage = {e[1]: e[3] for e in entries if e[3] is not None}
        ref_losses, ref_norm, ref_grads, ref_eval = refs[kw["merge"]]
        last = per_stage[max(per_stage)]
        torch.testing.assert_close(torch.tensor(last[0]), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=label)
        grads = {}
        for s in sorted(per_stage):
            for name, g in per_stage[s][2].items():
                assert name not in grads, f"{label}: {name} on two stages"
                grads[name] = g
        assert grads.keys() == ref_grads.keys(), (label, sorted(set(grads) ^ set(ref_grads)))
        for name, g in grads.items():
            want = ref_grads[name]
            scale = want.abs().max().item()
            err = (g - want).abs().max().item()
            assert err <= 1e-5 * max(scale, 1e-12), f"{label}: gradient of {name} differs by {err:.3g} (max {scale:.3g})"
        for s, (losses, norm, _, ev) in per_stage.items():
            assert ev == pytest.approx(ref_eval, rel=1e-5), f"{label}: stage {s} forward-only (evaluation) loss"
            assert losses == pytest.approx(last[0], rel=1e-6), f"{label}: stage {s} reports another loss"
            assert norm == pytest.approx(ref_norm, rel=1e-5), f"{label}: stage {s} grad norm"
