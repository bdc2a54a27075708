"""Gradient reduction as an action (R, --overlap-grad-reduce), schedule files, and peak activations shown.

Pure half: R's text form, placement by the lowering pass, the validator's rules, the simulator's
cost; the schedule file's forms and its one-line errors naming the offending action.

One 4-rank launch (pp 2 × dp 2, NCCL's rules checked): with and without --overlap-grad-reduce the
trained parameters are bitwise equal — the same buckets reduced with the same arithmetic, only
earlier — at ZeRO 0, 1 and 2, with delayed weight gradients, and with tp 2 and sequence parallelism
(the tp and tied-embedding reductions R runs between the buckets); the overlapped reductions are really
in flight when the pipeline's program ends; a schedule file written from the generated 1f1b trains
bitwise equal to --pipeline-schedule 1f1b; and the trace holds every stage's measured and simulated
peak activations, in the order 1F1B implies.
"""
from __future__ import annotations

import io
import json

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.parallel import ParallelContext, Topology
from megareshard.pipeline import (Action, ActionKind, Costs, PipelineGraph, Schedule, ScheduleError, generate, lower,
                                  simulate, validate)
from megareshard.pipeline.grad_reduce import insert_grad_reduce
from megareshard.pipeline.schedule import parse_action
from megareshard.pipeline.schedule_io import load_schedule_file
from megareshard.training import Trainer
from tests.harness import run_ranks

WORLD, PP, M = 4, 2, 4  # pp 2 × dp 2, global batch 8 / (micro batch 1 × dp 2) = 4 microbatches


# ---- pure ----------------------------------------------------------------------------------------
def test_r_text_form_and_placement():
    assert parse_action("R", 1) == Action(ActionKind.R, 0, 1) and parse_action("R@3", 0).stage == 3
    assert Action(ActionKind.R, 0, 2).text() == "R" and Action(ActionKind.R, 0, 2).text(True) == "R@2"
    with pytest.raises(ScheduleError, match="covers every microbatch"):
        Action(ActionKind.R, 3, 0)
    sched = insert_grad_reduce(generate("1f1b", 2, M))
    assert [acts[-1].kind for acts in sched.actions] == [ActionKind.R, ActionKind.R]
    low = lower(sched)
    validate(low)
    # stage 1's R follows its last B and that B's gradient send (the previous stage waits for it)
    assert [str(a) for a in low.actions[1][-3:]] == ["B3", "SB3->0", "R"]
    dw = insert_grad_reduce(generate("eager-1f1b", 2, M, delay_wgrad=True))
    for acts in dw.actions:
        last_bwd = max(i for i, a in enumerate(acts) if a.kind in (ActionKind.B, ActionKind.W))
        assert acts[last_bwd + 1].kind == ActionKind.R
    assert insert_grad_reduce(low) is low  # already placed: kept as written
    assert Schedule.loads(low.dumps()) == low and Schedule.from_csv(low.to_csv()) == low


def test_validator_rules_for_r():
    acts = generate("1f1b", 2, M).actions
    early = Schedule(generate("1f1b", 2, M).graph, M, [acts[0][:-1] + [Action(ActionKind.R, 0, 0), acts[0][-1]],
                                                       acts[1] + [Action(ActionKind.R, 0, 1)]])
    with pytest.raises(ScheduleError, match=r"R before B3 .*must follow the stage's last backward") as ei:
        validate(early)
    assert (ei.value.mesh, ei.value.index, ei.value.action) == (0, len(acts[0]) - 1, "R@0")
    one = Schedule(early.graph, M, [acts[0] + [Action(ActionKind.R, 0, 0)], list(acts[1])])
    with pytest.raises(ScheduleError, match=r"stage\(s\) \[1\] have no R"):
        validate(one)
    two = Schedule(early.graph, M, [acts[0] + [Action(ActionKind.R, 0, 0)] * 2, acts[1] + [Action(ActionKind.R, 0, 1)]])
    with pytest.raises(ScheduleError, match="a second R of stage 0"):
        validate(two)


def test_simulator_cost_of_r():
    sched = lower(generate("1f1b", 2, M))
    plain = simulate(sched, costs=Costs(f=1, b=2))
    free = simulate(insert_grad_reduce(sched), costs=Costs(f=1, b=2))
    assert free.makespan == plain.makespan and len(free.reduce) == 2 and free.bubble_fraction == plain.bubble_fraction
    # not overlapped at all: stage 0's R is the last action, so the step grows by its reduction time
    slow = simulate(insert_grad_reduce(sched), costs=Costs(f=1, b=2, reduce=[0.5, 0.25]))
    assert slow.makespan == plain.makespan + 0.5
    assert {r.action.stage: r.end - r.start for r in slow.reduce} == {0: 0.5, 1: 0.25}


def test_schedule_file_forms_and_errors(tmp_path):
    sched = generate("1f1b", PP, M)
    for name in ("s.txt", "s.csv"):
        sched.save(tmp_path / name)
        assert load_schedule_file(str(tmp_path / name), num_meshes=PP, num_microbatches=M) == sched
    bare = tmp_path / "bare.csv"  # hand-written CSV: no header rows
    bare.write_text("\n".join(",".join([str(s)] + [str(a) for a in acts]) for s, acts in enumerate(sched.actions)))
    assert load_schedule_file(str(bare), num_meshes=PP, num_microbatches=M) == Schedule(sched.graph, M, sched.actions)
    text = sched.dumps()
    bad = tmp_path / "bad.txt"  # hand-edited: stage 1 runs B2 before F2
    bad.write_text(text.replace("stage 1: F0 B0 F1 B1 F2 B2", "stage 1: F0 B0 F1 B1 B2 F2"))
    with pytest.raises(ConfigError) as ei:
        load_schedule_file(str(bad), num_meshes=PP, num_microbatches=M)
    msg = str(ei.value)
    assert msg == (f"--pipeline-schedule-file {bad}: mesh 1 action 4 'B2@1': backward before its forward "
                   "(F2@1 is not earlier)") and "\n" not in msg
    garbled = tmp_path / "garbled.csv"
    garbled.write_text(sched.to_csv().replace("0,F0,F1,B0", "0,F0,X1,B0"))
    with pytest.raises(ConfigError, match=r"mesh 0 action 1 'X1': cannot parse action"):
        load_schedule_file(str(garbled), num_meshes=PP, num_microbatches=M)
    stuck = tmp_path / "stuck.txt"  # stage 0 waits for B0's gradient, stage 1 for F1's activation first
    stuck.write_text(text.replace("stage 0: F0 F1 B0", "stage 0: F0 B0 F1")
                     .replace("stage 1: F0 B0 F1", "stage 1: F0 F1 B0"))
    with pytest.raises(ConfigError, match=r"mesh 0 action 1 'B0@0': deadlock: waits for B0/I0 on stage 1"):
        load_schedule_file(str(stuck), num_meshes=PP, num_microbatches=M)
    with pytest.raises(ConfigError, match="written for 4 microbatches but this run has 8"):
        load_schedule_file(str(tmp_path / "s.txt"), num_meshes=PP, num_microbatches=8)
    with pytest.raises(ConfigError, match="2 stage program"):
        load_schedule_file(str(tmp_path / "s.txt"), num_meshes=4, num_microbatches=M)
    with_r = tmp_path / "r.txt"
    insert_grad_reduce(sched).save(with_r)
    with pytest.raises(ConfigError, match=r"mesh 0 action 8 'R@0': gradient-reduction actions need --overlap"):
        load_schedule_file(str(with_r), num_meshes=PP, num_microbatches=M)
    assert load_schedule_file(str(with_r), num_meshes=PP, num_microbatches=M, overlap_grad_reduce=True)


def _argv(*extra, schedule: str | None = "1f1b"):
    argv = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-2", "--min-lr", "1e-3",
            "--lr-warmup-iters", "1", "--device", "cpu", "--seed", "5", "--pipeline-model-parallel-size", str(PP),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--reshard-strategy", "sendrecv"]
    return argv + (["--pipeline-schedule", schedule] if schedule else []) + list(extra)


def test_flags(tmp_path):
    path = tmp_path / "s.txt"
    generate("1f1b", PP, M).save(path)
    with pytest.raises(ConfigError, match="--pipeline-schedule 1f1b and --pipeline-schedule-file .* conflict"):
        parse_args(_argv("--pipeline-schedule-file", str(path)), world_size=WORLD)
    with pytest.raises(ConfigError, match="--delay-wgrad-compute conflicts with --pipeline-schedule-file"):
        parse_args(_argv("--pipeline-schedule-file", str(path), "--delay-wgrad-compute", schedule=None),
                   world_size=WORLD)
    assert parse_args(_argv("--pipeline-schedule-file", str(path), schedule=None),
                      world_size=WORLD).pipeline.pipeline_schedule_file == str(path)
    bad = tmp_path / "bad.csv"  # refused at start-up, before any process group or model exists
    bad.write_text(generate("1f1b", PP, M).to_csv().replace("1,F0,B0,F1,B1,F2,B2", "1,F0,B0,F1,B1,B2,F2"))
    with pytest.raises(ConfigError, match=r"bad.csv: mesh 1 action 4 'B2@1': backward before its forward"):
        parse_args(_argv("--pipeline-schedule-file", str(bad), schedule=None), world_size=WORLD)
    with pytest.raises(ConfigError, match="written for 4 microbatches but this run has 2"):
        parse_args(_argv("--pipeline-schedule-file", str(path), "--global-batch-size", "4", schedule=None),
                   world_size=WORLD)
    # the model's stage graph (a U-Transformer has skip edges) is checked when the runtime is built
    with pytest.raises(ConfigError, match=r"its skip edges \(none\) are not the model's \(0->1:skip0\)"):
        load_schedule_file(str(path), num_meshes=PP, num_microbatches=M,
                           graph=PipelineGraph(PP, ((0, 1, "skip0"),)))
    # receive posting: early posting would queue receives in front of sends on NCCL: refused with cuda
    with pytest.raises(ConfigError, match="--pipeline-recv-posting early needs gloo"):
        parse_args(_argv("--pipeline-recv-posting", "early", "--device", "cuda"), world_size=WORLD)
    assert parse_args(_argv("--pipeline-recv-posting", "grouped"), world_size=WORLD).plan.pipeline.recv_posting == \
        "grouped"
    from megareshard.pipeline.runtime import resolve_recv_posting

    assert (resolve_recv_posting("auto", "nccl"), resolve_recv_posting("auto", "gloo")) == ("mixed", "early")
    with pytest.raises(ConfigError, match="early needs gloo"):
        resolve_recv_posting("early", "nccl")
    for zero in ("0", "1", "2"):  # pp > 1: every ZeRO stage overlaps through R
        cfg = parse_args(_argv("--overlap-grad-reduce", "--zero-stage", zero), world_size=WORLD)
        assert cfg.memory.zero_stage == int(zero)
    cfg = parse_args(_argv("--overlap-grad-reduce", "--use-distributed-optimizer"), world_size=WORLD)
    assert cfg.memory.zero_stage == 1  # no longer mapped to 2: R reduces once, after the last backward


# ---- one launch: pp 2 × dp 2 ------------------------------------------------------------------------
CONFIGS = {
    "zero0": [], "zero0+overlap": ["--overlap-grad-reduce"],
    "zero1": ["--zero-stage", "1"], "zero1+overlap": ["--zero-stage", "1", "--overlap-grad-reduce"],
    "zero2": ["--zero-stage", "2"], "zero2+overlap": ["--zero-stage", "2", "--overlap-grad-reduce"],
    "dw": ["--delay-wgrad-compute"], "dw+overlap": ["--delay-wgrad-compute", "--overlap-grad-reduce"],
}
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--delay-wgrad-compute"]  # tp 2 × pp 2, dp 1


CROSSING = """stages 2 microbatches 4
stage 0: F0 F1 F2 F3 B0 B1 B2 B3
stage 1: F0 F1 B0 B1 F2 F3 B2 B3
"""  # both stages send twice before they receive: fine on gloo, a hang under NCCL's ordering if grouped


def _grouped(world, ctx, crossing_path):
    """NCCL's receive posting on gloo: trains like early posting, every exchange one group (counted in the
    checking mode's record); the crossing file is refused at start-up with --pipeline-recv-posting grouped and
    runs with mixed (its pair keeps a communicator per direction)."""
    from megareshard.parallel.nccl_check import recorded_batches

    trainer = Trainer(parse_args(_argv("--pipeline-recv-posting", "grouped"), world_size=world), ctx,
                      torch.device("cpu"), out=io.StringIO())
    before = len(recorded_batches())
    trainer.train()
    got = sorted(recorded_batches()[before:])
    pipe = trainer.pipeline
    plan = pipe.posting_plan(M)
    prog = pipe.program(M)
    sends, posts = plan.sends[pipe.stage], plan.posts[pipe.stage]
    want = sorted([len(sends.get(i, ())) + len(posts.get(i, ())) for i in range(len(prog))
                   if len(sends.get(i, ())) + len(posts.get(i, ())) > 1] * 2)  # two training steps
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    refused = None
    try:
        Trainer(parse_args(_argv("--pipeline-schedule-file", crossing_path, "--pipeline-recv-posting", "grouped",
                                 schedule=None), world_size=world), ctx, torch.device("cpu"), out=io.StringIO())
    except ConfigError as e:
        refused = str(e)
    mixed = Trainer(parse_args(_argv("--pipeline-schedule-file", crossing_path, "--pipeline-recv-posting", "mixed",
                                     schedule=None), world_size=world), ctx, torch.device("cpu"), out=io.StringIO())
    mixed.train()
    return params, got, want, refused, sorted(map(sorted, mixed.pipeline.shared_pairs)), pipe.stage


def _worker(rank, world, file_path, trace_path, crossing_path):
    ctx = ParallelContext.create(Topology(world, tp=1, pp=PP))
    out = {"grouped": _grouped(world, ctx, crossing_path)}
    runs = [(k, _argv(*v), ctx) for k, v in CONFIGS.items()]
    runs.append(("file", _argv("--pipeline-schedule-file", file_path, "--pipeline-trace", trace_path, schedule=None),
                 ctx))
    # R's sequence-parallel (tp) and tied-embedding reductions between the launched buckets
    sp_ctx = ParallelContext.create(Topology(world, tp=2, pp=PP))
    runs += [("sp", _argv(*SP), sp_ctx), ("sp+overlap", _argv(*SP, "--overlap-grad-reduce"), sp_ctx)]
    for name, argv, ctx in runs:
        buf = io.StringIO()
        trainer = Trainer(parse_args(argv, world_size=world), ctx, torch.device("cpu"), out=buf)
        in_flight = []
        finish = trainer.optimizer.finish_grad_sync

        def waited(finish=finish, opt=trainer.optimizer):
            in_flight.append(len(opt._pending))  # reductions launched and not yet waited for
            finish()
        trainer.optimizer.finish_grad_sync = waited
        trainer.train()
        params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        out[name] = (params, in_flight, buf.getvalue(), trainer.pipeline.last_stats.get("peak_inflight"))
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    d = tmp_path_factory.mktemp("gradreduce")
    file_path, trace_path, crossing_path = str(d / "1f1b.txt"), str(d / "trace.json"), str(d / "crossing.txt")
    generate("1f1b", PP, M).save(file_path)
    open(crossing_path, "w").write(CROSSING)
    results = run_ranks(_worker, WORLD, file_path, trace_path, crossing_path, timeout=300, nccl_check=True)
    return results, json.loads(open(trace_path).read())


@pytest.mark.parametrize("base", ["zero0", "zero1", "zero2", "dw", "sp"])
def test_overlap_grad_reduce_is_bitwise_equal(launched, base):
    results, _ = launched
    for rank, out in enumerate(results):
        plain, overlap = out[base], out[base + "+overlap"]
        for k, v in plain[0].items():
            assert torch.equal(v, overlap[0][k]), f"rank {rank} {base}: {k} differs with --overlap-grad-reduce"
        assert all(n == 0 for n in plain[1]), (rank, base, plain[1])  # finalize_grads waited inside the pipeline
        # R launched every bucket asynchronously; train_step waited for them (2 iterations)
        assert len(overlap[1]) == 2 and min(overlap[1]) > 0, (rank, base, overlap[1])
        assert "started by an R action" in overlap[2] if rank == 0 else True


def test_grouped_posting_issues_each_exchange_as_one_group(launched):
    """A rank whose send and receive with one peer are both ready issues them as one grouped operation: the
    checking mode's record holds exactly the posting plan's groups (1F1B on 2 stages: 3 exchanges per step
    and stage), and the training is bitwise that of early posting."""
    results, _ = launched
    for rank, out in enumerate(results):
        params, got, want, refused, shared, stage = out["grouped"]
        # 3 exchanges per step on each stage (2 steps): a send with one receive (stage 0's last one also carries
        # the last gradient's receive: no send comes between)
        assert got == want and len(got) == 6 and sorted(set(got)) == ([2, 3] if stage == 0 else [2]), (rank, got, want)
        for k, v in out["zero0"][0].items():
            assert torch.equal(v, params[k]), f"rank {rank}: {k} differs with grouped receive posting"
        assert refused is not None and "crossing.txt: mesh 0 action 9 'WB0<-1@0': deadlock under NCCL's ordering" \
            in refused and "queued behind the send of activation 2" in refused and "\n" not in refused, refused
        assert shared == [], (rank, shared)  # mixed: the crossing pair keeps its directions apart


def test_schedule_file_trains_like_the_generated_schedule(launched):
    results, _ = launched
    for rank, out in enumerate(results):
        for k, v in out["zero0"][0].items():
            assert torch.equal(v, out["file"][0][k]), f"rank {rank}: {k} differs when the schedule comes from a file"
    assert "the schedule file's 1f1b" in results[0]["file"][2]


def test_trace_and_summary_show_peak_activations(launched):
    results, trace = launched
    mem = sorted((r for r in trace if r["kind"] == "MEMORY"), key=lambda r: r["stage"])
    assert [r["stage"] for r in mem] == [0, 1]
    assert all(r["activation_bytes"] > 0 for r in mem)
    # 1F1B: stage i holds min(m, P - i) microbatches; measured by the runtime and predicted by the simulator
    assert [r["inflight_simulated"] for r in mem] == [2, 1] == [r["inflight_measured"] for r in mem]
    assert sorted(out["file"][3] for out in results) == [1, 1, 2, 2]  # per rank: two ranks per stage
    line = [ln for r in results for ln in r["file"][2].splitlines() if "peak activations per pipeline stage" in ln]
    assert len(line) == 1 and "2/2" in line[0] and "1/1" in line[0], line


def test_plot_schedule_simulates_a_schedule_file(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import plot_schedule

    path = tmp_path / "mine.csv"
    insert_grad_reduce(generate("1f1b", PP, M)).save(path)
    (tl,) = plot_schedule.build_timelines(plot_schedule.parse_args(["--schedule-file", str(path)]))
    assert tl.name == "mine" and tl.peak_activations == [2, 1] and len(tl.reduce) == PP
