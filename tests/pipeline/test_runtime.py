"""The pipeline runtime reproduces the single-process run, for every schedule × delay × strategy.

One 8-rank launch (start-up dominates on 2 cores) loops over three layouts and 22
configurations, reusing each layout's ParallelContext:

* pp 4 · dp 2 and pp 4 · tp 2: every schedule gpipe|1f1b|eager-1f1b × strategy
  sendrecv|allgather|broadcast, delay on in one layout where it is off in the other (9 + 9), so
  every schedule × delay × strategy combination appears;
* pp 2 · tp 2 · dp 2: every schedule and every strategy once (gpipe+sendrecv, 1f1b+allgather with
  delayed weight gradients, eager-1f1b+broadcast), plus sequence parallelism with an uneven 1,3
  layer split (the suite's 10-minute budget on 2 cores: the full cross product of 18 ran here until
  session 8, every schedule × strategy until session 15).

Same seed, same global batch, fp32, dropout 0: the losses of ITERS iterations and the
full gradients after the first step match the single-process trainer within 1e-5
relative, and so does the forward-only evaluation loss. The same launch checks that sent activations are freed, that a wrong-shaped
tensor on an edge raises naming the edge, the per-stage memory records and the trace.
"""
from __future__ import annotations

import io
import itertools
import json
import warnings

import pytest
import torch
import torch.distributed as dist

from megareshard.arguments import ConfigError, parse_args, validate
from megareshard.parallel import ParallelContext, Topology
from megareshard.pipeline import Edge, Timeline, generate, lower
from megareshard.pipeline.posting import held_sends_peak
from megareshard.pipeline.comm import EdgeShapeError
from megareshard.pipeline.stage import split_layers, stage_layouts
from megareshard.tensor_parallel import gather_full_state_dict
from megareshard.training import Trainer
from tests.harness import run_ranks

ITERS = 2
WORLD = 8
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")
STRATEGIES = ("sendrecv", "allgather", "broadcast")


def _argv(tp=1, pp=1, schedule="1f1b", delay=False, strategy="sendrecv", sp=False, trace=None, per_stage=None,
          posting=None):
    argv = ["--mock-data", "--vocab-size", "200", "--num-layers", "4", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-2", "--min-lr", "1e-3",
            "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--device", "cpu", "--seed", "7",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--pipeline-schedule", schedule, "--reshard-strategy", strategy, "--reshard-chunks", "3",
            "--eval-interval", str(ITERS), "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    argv += ["--delay-wgrad-compute"] if delay else []
    argv += ["--sequence-parallel"] if sp else []
    argv += ["--pipeline-trace", trace] if trace else []
    argv += ["--num-layers-per-stage", per_stage] if per_stage else []
    argv += ["--pipeline-recv-posting", posting] if posting else []
    return argv


def _cases() -> list[tuple[int, int, list[dict]]]:
    """(tp, pp, configs) per layout; each config is _argv's keyword arguments."""
    pairs = list(itertools.product(SCHEDULES, STRATEGIES))
    # tp · pp · dp together: each schedule once, with another strategy each, both delays among them
    a = [dict(schedule=s, delay=i == 1, strategy=x) for i, (s, x) in enumerate(zip(SCHEDULES, STRATEGIES))]
    a.append(dict(schedule="eager-1f1b", delay=True, strategy="broadcast", sp=True, per_stage="1,3"))
    # receive posting: gloo's early posting, and NCCL's (grouped with the last send to the same peer) on the
    # layout where an edge's two directions share a communicator (tp 1: one rank per end), mixed on the others
    b = [dict(schedule=s, delay=i % 2 == 0, strategy=x, posting=("grouped", "mixed", None)[i % 3])
         for i, (s, x) in enumerate(pairs)]
    c = [dict(schedule=s, delay=i % 2 == 1, strategy=x, posting="mixed" if i % 2 else None)
         for i, (s, x) in enumerate(pairs)]
    a[1]["posting"] = "mixed"
    return [(2, 2, a), (1, 4, b), (2, 4, c)]


def _run(trainer: Trainer, ctx: ParallelContext):
    indices = next(trainer._train_iter)
    first = trainer.train_step(trainer._microbatches(trainer.train_data, indices))
    trainer.iteration = 1
    trainer.optimizer.materialize_param_grads()  # ZeRO keeps reduced gradients on its shards
    grads = gather_full_state_dict(trainer.model, ctx, grads=True)
    records = trainer.train()
    return [first.loss] + [r["loss"] for r in records], first.grad_norm, grads, records


def _shape_errors(trainer: Trainer, ctx: ParallelContext) -> list[str]:
    """Send wrong shapes/dtypes on edge 0->1 from both ends: a local check, no message is posted."""
    comm = trainer.pipeline.comms[Edge(0, 1)]
    msgs = []
    try:
        if ctx.pp_rank() == 0:
            comm.send_forward(torch.zeros(8, 3, 32), mb=5)
        elif ctx.pp_rank() == 1:
            comm.send_backward(torch.zeros(8, 1, 32, dtype=torch.float64), mb=2)
    except EdgeShapeError as e:
        msgs.append(str(e))
    return msgs


def _worker(rank, world_size, layouts, trace_path):
    out = []
    groups_before = len(dist.distributed_c10d._world.pg_map)
    for tp, pp, configs in layouts:
        ctx = ParallelContext.create(Topology(world_size, tp=tp, pp=pp))
        keep = ctx.tp_rank() == 0 and ctx.dp_rank() == 0
        trainers = []
        for i, kw in enumerate(configs):
            trace = trace_path if (pp == 4 and tp == 2 and i == len(configs) - 1) else None
            cfg = parse_args(_argv(tp, pp, trace=trace, **kw), world_size=world_size)
            trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
            trainers.append(trainer)
            losses, norm, grads, records = _run(trainer, ctx)
            extra = {"stats": trainer.pipeline.last_stats, "mem": records[-1]["peak_mem_mb_per_stage"],
                     "m": cfg.plan.num_microbatches, "eval": records[-1]["eval_loss"]}
            out.append((tp, pp, kw, ctx.pp_rank(), (losses, norm, grads, extra) if keep else None))
        out.append(("shape", tp, pp, _shape_errors(trainer, ctx)))
        for t in trainers:  # every pipeline's communicators and the context's, shared by the trainers
            t.release_communicators()
        out.append(("left", tp, pp, len(dist.distributed_c10d._world.pg_map) - groups_before))
    return out


@pytest.fixture(scope="module")
def reference():
    cfg = parse_args(_argv(), world_size=1)
    ctx = ParallelContext.single_process()
    trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
    losses, norm, grads, records = _run(trainer, ctx)
    return losses, norm, grads, records[-1]["eval_loss"]


def _check(ref, per_stage: dict[int, tuple], pp: int, label: str) -> None:
    ref_losses, ref_norm, ref_grads, ref_eval = ref
    losses, norm, _, extra = per_stage[pp - 1]
    assert extra["eval"] == pytest.approx(ref_eval, rel=1e-5), f"{label}: forward-only (evaluation) loss"
    assert len(losses) == ITERS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=label)
    for s, (ls, n, _, _) in per_stage.items():  # the loss reaches every stage
        assert ls == losses and n == pytest.approx(norm, rel=1e-6), f"{label}: stage {s} disagrees"
    assert norm == pytest.approx(ref_norm, rel=1e-5), label
    grads: dict[str, torch.Tensor] = {}
    for s in sorted(per_stage):
        for name, g in per_stage[s][2].items():
            assert name not in grads, f"{label}: {name} on two stages"
            grads[name] = g
    tied = grads.pop("output_layer.weight")  # the last stage's copy of the tied word embedding
    assert grads.keys() == ref_grads.keys(), label
    grads_tied = dict(grads, **{"embedding.word_embeddings.weight (output copy)": tied})
    for name, g in grads_tied.items():
        want = ref_grads[name.split(" ")[0]]
        scale = want.abs().max().item()
        err = (g - want).abs().max().item()
        assert err <= 1e-5 * max(scale, 1e-12), f"{label}: gradient of {name} differs by {err:.3g} (max {scale:.3g})"


@pytest.mark.slow
def test_every_schedule_delay_and_strategy_matches_single_process(reference, tmp_path):
    layouts = _cases()
    trace_path = str(tmp_path / "trace.json")
    results = run_ranks(_worker, WORLD, layouts, trace_path, timeout=400, nccl_check=True)
    n = len(results[0])
    checked = 0
    for k in range(n):
        entries = [r[k] for r in results]
        if entries[0][0] == "left":  # every process group the layout's trainers made was destroyed
            assert [e[3] for e in entries] == [0] * WORLD, entries
            continue
        if entries[0][0] == "shape":
            _, tp, pp, _ = entries[0]
            msgs = [m for e in entries for m in e[3]]
            assert len(msgs) == WORLD // pp * 2, msgs  # every rank of stages 0 and 1
            fwd = [m for m in msgs if "activation" in m]
            bwd = [m for m in msgs if "gradient" in m]
            assert fwd and "edge 0->1 (activation, mb 5)" in fwd[0] and "got (8, 3, 32)" in fwd[0], fwd
            assert bwd and "edge 0->1 (gradient, mb 2)" in bwd[0] and "torch.float64" in bwd[0], bwd
            continue
        tp, pp, kw, _, _ = entries[0]
        label = f"tp {tp} · pp {pp} · dp {WORLD // (tp * pp)} {kw}"
        per_stage = {e[3]: e[4] for e in entries if e[4] is not None}
        assert sorted(per_stage) == list(range(pp)), label
        _check(reference, per_stage, pp, label)
        for s, (_, _, _, extra) in per_stage.items():
            assert len(extra["mem"]) == pp and min(extra["mem"]) > 0, label
            if s < pp - 1:  # every sent activation's data was freed when its send was retired, before its B
                assert extra["stats"]["outputs_freed"] == extra["stats"]["freed_before_backward"] == extra["m"], \
                    (label, s, extra["stats"])
            # sends are retired where the receiver's reply shows them complete: as many held as posting.py says
            low = lower(generate(kw["schedule"], pp, extra["m"], delay_wgrad=kw.get("delay", False)))
            assert extra["stats"]["sent_held_peak"] == held_sends_peak(low)[s], (label, s, extra["stats"])
        checked += 1
    assert checked == sum(len(c) for _, _, c in layouts)
    trace = json.loads(open(trace_path).read())
    kinds = {r["kind"] for r in trace}
    traced = layouts[-1][2][-1]  # tp 2 · pp 4, its last config writes the trace (see _worker)
    compute, absent = ({"F", "I", "W"}, set()) if traced["delay"] else ({"F", "B"}, {"I", "W"})
    assert compute | {"SEND_F", "SEND_B"} <= kinds and not absent & kinds, (traced, kinds)
    tl = Timeline.from_trace(trace)
    assert tl.num_stages == 4 and all(len([iv for iv in row if iv.action.kind.value == "F"]) == 8
                                      for row in tl.compute)


# ---- start-up validation (no processes) --------------------------------------------------------
def test_more_stages_than_layers_is_refused_at_startup():
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 8 exceeds --num-layers 4"):
        parse_args(_argv(pp=8), world_size=8)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 3 exceeds --num-layers 2"):
        split_layers(2, 3)


def test_layer_splits():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(5, 3, "1,3,1") == [(0, 1), (1, 4), (4, 5)]
    with pytest.raises(ConfigError, match="must give 3 positive numbers .*got 2 numbers summing to 5"):
        split_layers(5, 3, "2,3")
    with pytest.raises(ConfigError, match="not divisible by --pipeline-model-parallel-size 3"):
        split_layers(5, 3)
    cfg = parse_args(_argv(tp=2, pp=2, sp=True), world_size=8)
    lay = stage_layouts(cfg, Topology(8, tp=2, pp=2))
    assert [(x.layer_range, str(x.hidden_spec), x.mesh.shape) for x in lay] == [
        ((0, 2), "S1,S0,R", (2, 2)), ((2, 4), "S1,S0,R", (2, 2))]


def test_unknown_schedule_and_strategy_are_refused():
    with pytest.raises(ConfigError, match="invalid choice: 'zigzag'"):  # one line, not argparse's usage and exit
        parse_args(_argv(pp=2, schedule="zigzag"), world_size=2)
    cfg = parse_args(_argv(pp=2), world_size=2)
    cfg.pipeline.pipeline_schedule = "interleaved"
    with pytest.raises(ConfigError, match="unknown --pipeline-schedule 'interleaved'; available: gpipe, 1f1b"):
        validate(cfg, 2)
    cfg.pipeline.pipeline_schedule, cfg.pipeline.reshard_strategy = "1f1b", "pigeon"
    with pytest.raises(ConfigError, match="unknown --reshard-strategy 'pigeon'"):
        validate(cfg, 2)


def test_fewer_microbatches_than_stages_warns_with_the_bubble():
    cfg = parse_args(_argv(pp=4) + ["--global-batch-size", "2"], world_size=4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        validate(cfg, 4)
    assert any("2 microbatch(es) for 4 pipeline stages" in str(x.message) for x in w)
