"""Virtual stages in the runtime: every schedule that holds several stages per rank, or splits B into I/W,
reproduces the single-process run; checkpoints of model chunks load into other layouts.

One 4-rank launch (start-up dominates on 2 cores) runs a pairwise covering of
schedule (interleaved-1f1b, eager-interleaved-1f1b, zb-h1, zbv) × strategy (sendrecv, allgather,
broadcast) × delayed W (the interleaved kinds; the zero-bubble kinds are I/W schedules) × layout
(uniform pp 2 · dp 2, per-stage ``tp1dp2,tp2dp1``) × model (GPT, U-Transformer): every schedule
meets every strategy, both layouts and both models; the interleaved kinds meet both delay settings;
sequence parallelism runs on the tp-2 mesh of two per-stage cases (zb-h1, zbv), ZeRO 2 with its
reductions started from gradient hooks in two uniform ones (zb-h1, zbv). Five cases post receives as on NCCL
(`pipeline/posting.py`): grouped (zb-h1) or mixed (interleaved and zbv, whose two meshes exchange both ways:
their pair keeps a communicator per direction where grouping cannot run under NCCL's ordering).
pp 2 with 2 virtual stages: 4 stages, the edge 1->2 goes from the last mesh back to the first
(interleaved), or 1->2 is a local hand-off on mesh 1 and 3 is the last stage on mesh 0 (zbv: the
tied word embedding is one Parameter there). The U-Transformer's skip edges cross meshes, or are local
hand-offs too (interleaved, blocks 1,1,1,2: skip1 joins stages 1 and 3 on mesh 1).

Same seed, same global batch, fp32, dropout 0: the losses of ITERS iterations, every gradient after
the first step, the gradient norm and the forward-only (evaluation) loss match the single-process
trainer within 1e-5 relative — the bound `tests/pipeline/test_runtime.py` uses: the dp and tied-
embedding reductions sum in another order than one process does (a few roundings of fp32 sums
of <= 8 terms), so bitwise equality is not expected.

Checkpoints: the zbv GPT run saves (one Parameter for the tied pair, chunks under model names); the
same launch loads it into the interleaved layout on the other stage layouts, and one process loads
it too: both hold exactly the saved parameters.
"""
from __future__ import annotations

import io

import pytest
import torch

from megareshard.arguments import parse_args, parse_model_args
from megareshard.parallel import ParallelContext, StageTopology, Topology
from megareshard.pipeline import get_schedule
from megareshard.pipeline.chunks import ModelChunks
from megareshard.tensor_parallel import gather_full_state_dict
from megareshard.training import Trainer
from tests.harness import run_ranks

ITERS = 2
WORLD = 4
STAGES = "tp1dp2,tp2dp1"

GPT = ["--vocab-size", "200", "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
       "--global-batch-size", "8", "--seed", "7"]
UT = ["--vocab-size", "96", "--u-levels", "3", "--u-widths", "16,24,32", "--u-blocks-per-level", "1",
      "--u-shorten-factor", "2", "--u-skip-merge", "add", "--num-attention-heads", "2", "--global-batch-size", "4",
      "--seed", "11"]

# (model, layout, config): every schedule × {strategy, layout, model}; interleaved kinds × delay
CASES = [
    ("gpt", "uniform", dict(schedule="interleaved-1f1b", strategy="sendrecv", posting="mixed")),
    ("gpt", "stages", dict(schedule="interleaved-1f1b", strategy="allgather", delay=True)),
    ("gpt", "uniform", dict(schedule="eager-interleaved-1f1b", strategy="broadcast", delay=True)),
    ("gpt", "stages", dict(schedule="eager-interleaved-1f1b", strategy="sendrecv")),
    ("gpt", "uniform", dict(schedule="zb-h1", strategy="allgather", zero2=True, posting="grouped")),
    ("gpt", "stages", dict(schedule="zb-h1", strategy="broadcast", sp=True)),
    ("gpt", "stages", dict(schedule="zbv", strategy="sendrecv", sp=True)),
    ("gpt", "uniform", dict(schedule="zbv", strategy="broadcast", save=True, zero2=True, posting="mixed")),
    ("ut", "uniform", dict(schedule="interleaved-1f1b", strategy="broadcast", per_stage="1,1,1,2")),
    ("ut", "stages", dict(schedule="eager-interleaved-1f1b", strategy="allgather", delay=True, per_stage="1,1,2,1")),
    ("ut", "uniform", dict(schedule="zb-h1", strategy="sendrecv", per_stage="2,3", posting="grouped")),
    ("ut", "stages", dict(schedule="zbv", strategy="allgather", per_stage="1,1,1,2", posting="mixed")),
]


def _argv(model, layout=None, schedule=None, strategy="sendrecv", delay=False, per_stage=None, save=None,
          load=None, sp=False, zero2=False, posting=None):
    argv = ["--mock-data", "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", str(ITERS),
            "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--device", "cpu",
            "--eval-interval", str(ITERS), "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    argv += GPT if model == "gpt" else UT
    if layout == "uniform":
        argv += ["--pipeline-model-parallel-size", "2"]
    elif layout == "stages":
        argv += ["--stage-layouts", STAGES]
    if schedule is not None:
        argv += ["--pipeline-schedule", schedule, "--reshard-strategy", strategy, "--reshard-chunks", "2"]
        if get_schedule(schedule).stages_per_mesh is None:  # V is the user's
            argv += ["--num-virtual-stages-per-pipeline-rank", "2"]
    argv += ["--delay-wgrad-compute"] if delay else []
    argv += ["--sequence-parallel"] if sp else []  # on the tp-2 mesh of the per-stage layouts
    # ZeRO 2 with the reductions started by R actions (a mesh's buckets at the R of its last stage)
    argv += ["--use-distributed-optimizer", "--overlap-grad-reduce"] if zero2 else []
    argv += ["--num-layers-per-stage", per_stage] if per_stage else []
    argv += ["--save", save] if save else []
    argv += ["--load", load] if load else []
    argv += ["--pipeline-recv-posting", posting] if posting else []  # NCCL's posting, run on gloo
    return argv


def _parse(model, argv, world_size):
    if model == "gpt":
        return parse_args(argv, world_size=world_size), None
    return parse_model_args("utransformer", argv, world_size=world_size)


def _run(trainer: Trainer, ctx: ParallelContext):
    indices = next(trainer._train_iter)
    first = trainer.train_step(trainer._microbatches(trainer.train_data, indices))
    trainer.iteration = 1
    trainer.optimizer.materialize_param_grads()  # ZeRO keeps reduced gradients on its shards
    grads = gather_full_state_dict(trainer.model, ctx, grads=True)
    records = trainer.train()
    return [first.loss] + [r["loss"] for r in records], first.grad_norm, grads, records[-1]["eval_loss"]


def _worker(rank, world_size, cases, ckpt):
    out = []
    ctxs = {"uniform": ParallelContext.create(Topology(world_size, tp=1, pp=2)),
            "stages": ParallelContext.create(StageTopology(world_size, STAGES))}
    for model, layout, kw in cases:
        ctx = ctxs[layout]
        kw = dict(kw, save=ckpt if kw.get("save") else None)
        cfg, spec = _parse(model, _argv(model, layout, **kw), world_size)
        trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO(), model_spec=spec)
        pipe = trainer.pipeline
        info = {"stages": pipe.stages, "placement": pipe.placement, "local": sorted(map(str, pipe.local_edges)),
                "comm_edges": sorted(map(str, pipe.comms)), "chunks": isinstance(trainer.model, ModelChunks)}
        keep = ctx.tp_rank() == 0 and ctx.dp_rank() == 0
        res = _run(trainer, ctx)
        params = gather_full_state_dict(trainer.model, ctx) if kw.get("save") else None
        out.append((model, layout, kw, ctx.pp_rank(), info, res if keep else None, params if keep else None))
    # the zbv checkpoint (uniform layout) into interleaved chunks on the per-stage layouts
    ctx = ctxs["stages"]
    cfg, _ = _parse("gpt", _argv("gpt", "stages", schedule="interleaved-1f1b", load=ckpt), world_size)
    trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
    loaded = gather_full_state_dict(trainer.model, ctx)
    out.append(("load", ctx.pp_rank(), trainer.loaded.iteration, loaded if ctx.tp_rank() == 0 and ctx.dp_rank() == 0
                else None))
    return out


def _reference(model):
    cfg, spec = _parse(model, _argv(model), 1)
    ctx = ParallelContext.single_process()
    return _run(Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO(), model_spec=spec), ctx)


def _merge(per_stage: dict[int, dict[str, torch.Tensor]], label: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for s in sorted(per_stage):
        for name, g in per_stage[s].items():
            assert name not in merged, f"{label}: {name} on two meshes"
            merged[name] = g
    return merged


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * max(scale, 1e-12), f"{what} differs by {err:.3g} (max {scale:.3g})"


EXPECTED = {  # (schedule, layout-independent): placement, local hand-offs, edges with resharders
    "interleaved-1f1b": ((0, 1, 0, 1), [], ["0->1", "1->2", "2->3"]),
    "eager-interleaved-1f1b": ((0, 1, 0, 1), [], ["0->1", "1->2", "2->3"]),
    "zb-h1": ((0, 1), [], ["0->1"]),
    "zbv": ((0, 1, 1, 0), ["1->2"], ["0->1", "2->3"]),
}


@pytest.mark.slow
def test_virtual_and_zero_bubble_schedules_match_single_process(tmp_path):
    refs = {m: _reference(m) for m in ("gpt", "ut")}
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(_worker, WORLD, CASES, ckpt, timeout=400, nccl_check=True)
    assert all(len(r) == len(CASES) + 1 for r in results)
    saved = None
    for k, (model, layout, kw) in enumerate(CASES):
        entries = [r[k] for r in results]
        label = f"{model} {layout} {kw}"
        place, local, comm = EXPECTED[kw["schedule"]]
        info = entries[0][4]
        chain = [e for e in info["comm_edges"] if ":" not in e]
        assert info["placement"] == place and [e for e in info["local"] if ":" not in e] == local and chain == comm, \
            (label, info)
        if model == "ut" and kw["schedule"] == "interleaved-1f1b":  # skip1 joins stages 1 and 3, both on mesh 1
            assert info["local"] == ["1->3:skip1"], (label, info)
        assert all(e[4]["chunks"] == (len(place) > 2) for e in entries), label  # chunks exactly with virtual stages
        per_mesh = {e[3]: e[5] for e in entries if e[5] is not None}
        assert sorted(per_mesh) == [0, 1], label
        ref_losses, ref_norm, ref_grads, ref_eval = refs[model]
        for mesh, (losses, norm, _, ev) in per_mesh.items():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                       msg=f"{label}: mesh {mesh} losses")
            assert norm == pytest.approx(ref_norm, rel=1e-5), f"{label}: mesh {mesh} grad norm"
            assert ev == pytest.approx(ref_eval, rel=1e-5), f"{label}: mesh {mesh} forward-only (evaluation) loss"
        grads = _merge({m: r[2] for m, r in per_mesh.items()}, label)
        tied = grads.pop("output_layer.weight", None)  # the last stage's copy of the tied word embedding
        if model == "gpt":
            # zbv: first and last stage share mesh 0 and one Parameter; otherwise the last mesh holds a copy
            assert (tied is None) == (kw["schedule"] == "zbv"), label
            if tied is not None:
                _close(tied, ref_grads["embedding.word_embeddings.weight"], f"{label}: tied output copy")
        elif tied is not None:
            grads["output_layer.weight"] = tied
        assert grads.keys() == ref_grads.keys(), (label, sorted(set(grads) ^ set(ref_grads)))
        for name, g in grads.items():
            _close(g, ref_grads[name], f"{label}: gradient of {name}")
        if kw.get("save"):
            saved = _merge({e[3]: e[6] for e in entries if e[6] is not None}, label)
    assert saved is not None and "output_layer.weight" not in saved
    # the zbv checkpoint, loaded into interleaved chunks on other stage layouts ...
    entries = [r[-1] for r in results]
    assert all(e[0] == "load" and e[2] == ITERS for e in entries)
    loaded = _merge({e[1]: e[3] for e in entries if e[3] is not None}, "load")
    loaded_tied = loaded.pop("output_layer.weight")
    assert loaded.keys() == saved.keys()
    for name, p in loaded.items():
        assert torch.equal(p, saved[name]), f"interleaved load: {name}"
    assert torch.equal(loaded_tied, saved["embedding.word_embeddings.weight"])
    # ... and into one process
    cfg, _ = _parse("gpt", _argv("gpt", load=ckpt), 1)
    ctx = ParallelContext.single_process()
    single = gather_full_state_dict(Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO()).model, ctx)
    assert single.keys() == saved.keys()
    for name, p in single.items():
        assert torch.equal(p, saved[name]), f"single-process load: {name}"
