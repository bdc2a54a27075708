"""Virtual stages at start-up (pure, no processes): Megatron-LM's flags, the refusals with their numbers,
the layer assignment, and deadlock freedom of every registered schedule for every microbatch count the
arguments allow (pp 2..4, m up to 3·pp), training and forward-only, chain and skip graphs."""
from __future__ import annotations

import itertools

import pytest

from megareshard.arguments import ConfigError, parse_args
from megareshard.arguments import validate as validate_args
from megareshard.parallel import Topology
from megareshard.pipeline import PipelineGraph, generate, get_schedule, lower, placement_of, schedule_names, validate
from megareshard.pipeline.generators import forward_only
from megareshard.pipeline.stage import stage_layouts
from megareshard.pipeline.validate import dry_run


def _argv(*extra, layers=8, pp=2, gbs=8):
    return ["--mock-data", "--vocab-size", "64", "--num-layers", str(layers), "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size",
            str(gbs), "--train-iters", "2", "--lr", "1e-3", "--pipeline-model-parallel-size", str(pp), *extra]


def test_megatron_flags_resolve_the_virtual_stages_and_the_schedule():
    cfg = parse_args(_argv("--num-layers-per-virtual-pipeline-stage", "2"), world_size=2)
    # Megatron-LM: virtual stages = layers / pp / layers per virtual stage; they mean interleaving
    assert (cfg.pipeline.pipeline_schedule, cfg.plan.virtual_stages) == ("interleaved-1f1b", 2)
    assert any("runs --pipeline-schedule 1f1b as interleaved-1f1b" in n for n in cfg.notes)
    notes = list(cfg.notes)
    validate_args(cfg, 2)  # validating again changes nothing (the flags stay as given)
    assert (cfg.pipeline.pipeline_schedule, cfg.plan.virtual_stages, cfg.notes) == ("interleaved-1f1b", 2, notes)
    cfg = parse_args(_argv("--virtual-pipeline-model-parallel-size", "4", "--pipeline-schedule", "eager-1f1b"),
                     world_size=2)
    assert (cfg.pipeline.pipeline_schedule, cfg.plan.virtual_stages) == ("eager-interleaved-1f1b", 4)
    cfg = parse_args(_argv("--num-virtual-stages-per-pipeline-rank", "1"), world_size=2)  # 1: none (Megatron)
    assert (cfg.pipeline.pipeline_schedule, cfg.plan.virtual_stages) == ("1f1b", 1)
    cfg = parse_args(_argv("--pipeline-schedule", "zbv"), world_size=2)
    assert cfg.plan.virtual_stages == 2
    # Megatron's interleaved layer assignment: virtual stage v·P + p on mesh p; zbv the V shape
    cfg = parse_args(_argv("--num-virtual-stages-per-pipeline-rank", "2"), world_size=4)
    lay = stage_layouts(cfg, Topology(4, tp=1, pp=2))
    assert [(x.layer_range, x.mesh.flat_ranks) for x in lay] == [
        ((0, 2), (0, 1)), ((2, 4), (2, 3)), ((4, 6), (0, 1)), ((6, 8), (2, 3))]
    cfg = parse_args(_argv("--pipeline-schedule", "zbv", "--num-layers-per-stage", "1,3,3,1"), world_size=2)
    lay = stage_layouts(cfg, Topology(2, tp=1, pp=2))
    assert [(x.layer_range, x.mesh.flat_ranks) for x in lay] == [
        ((0, 1), (0,)), ((1, 4), (1,)), ((4, 7), (1,)), ((7, 8), (0,))]


@pytest.mark.parametrize("extra, message", [
    (("--pipeline-schedule", "interleaved-1f1b", "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size",
      "6"), r"interleaved-1f1b: 6 microbatches \(global batch 6 / \(micro batch 1 × dp 1\)\) are not a multiple of "
            r"--pipeline-model-parallel-size 4"),
    (("--num-layers-per-virtual-pipeline-stage", "3"),
     r"--num-layers 8 is not divisible into virtual stages of --num-layers-per-virtual-pipeline-stage 3 on "
     r"--pipeline-model-parallel-size 4 \(8 / \(4 × 3\)"),
    (("--num-virtual-stages-per-pipeline-rank", "3"), r"--num-layers 8 is not divisible by pp 4 × 3 virtual stages"),
    (("--pipeline-schedule", "zbv", "--virtual-pipeline-model-parallel-size", "3"),
     "zbv holds exactly 2 stages per rank .* --virtual-pipeline-model-parallel-size 3 asks for 3"),
    (("--pipeline-schedule", "interleaved-1f1b"),
     "interleaved-1f1b interleaves virtual stages: give --num-layers-per-virtual-pipeline-stage"),
    (("--pipeline-schedule", "zb-h1", "--num-virtual-stages-per-pipeline-rank", "2"),
     "zb-h1 holds one stage per rank but --num-virtual-stages-per-pipeline-rank 2 asks for 2"),
    (("--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
     "--num-layers-per-virtual-pipeline-stage 1 and --num-virtual-stages-per-pipeline-rank 2 conflict"),
    (("--pipeline-schedule", "zbv", "--num-layers-per-stage", "2,2,2,2"),
     r"--num-layers-per-stage 2,2,2,2 must give 8 positive numbers \(one per stage, pp 4 × 2 virtual stages"),
], ids=["microbatches-off-groups", "layers-per-virtual-stage", "virtual-stage-count", "zbv-count", "interleaved-no-v",
        "zb-h1-with-v", "two-flags", "zbv-layer-list"])
def test_bad_combinations_are_refused_at_startup_with_the_numbers(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(_argv(*extra, pp=4), world_size=4)


def test_interleaving_with_one_pipeline_rank_is_refused():
    with pytest.raises(ConfigError, match="need --pipeline-model-parallel-size >= 2, got 1"):
        parse_args(_argv("--num-virtual-stages-per-pipeline-rank", "2", pp=1), world_size=1)


def test_validation_refuses_a_microbatch_count_off_the_groups():
    cfg = parse_args(_argv("--num-virtual-stages-per-pipeline-rank", "2", pp=2, gbs=8), world_size=2)
    cfg.training.global_batch_size = 5  # changed after the arguments were validated (e.g. by a tool)
    with pytest.raises(ConfigError, match=r"5 microbatches \(global batch 5 .*\) are not a multiple of --pipeline-model-parallel-size 2"):
        validate_args(cfg, 2)


def _allowed(name: str):
    """(P, V, m) the arguments accept for schedule `name`: pp 2..4, m 1..3·pp (multiples of pp when
    interleaving), V 2..3 for the interleaved kinds."""
    kind = get_schedule(name)
    for P in (2, 3, 4):
        for V in ((2, 3) if kind.stages_per_mesh is None else (kind.stages_per_mesh,)):
            for m in range(1, 3 * P + 1):
                if not (kind.microbatch_multiple_of_pp and m % P):
                    yield P, V, m


def test_arguments_accept_exactly_the_enumerated_microbatch_counts():
    """`_allowed` is the arguments' rule, not a guess: check each schedule at pp 2 against parse_args."""
    for name, kind in ((n, get_schedule(n)) for n in schedule_names()):
        flag = ["--num-virtual-stages-per-pipeline-rank", "2"] if kind.stages_per_mesh is None else []
        V = kind.stages_per_mesh or 2
        for m in (1, 2, 3, 4):
            argv = _argv("--pipeline-schedule", name, *flag, pp=2, gbs=m)
            if (2, V, m) in set(_allowed(name)):
                assert parse_args(argv, world_size=2).plan.num_microbatches == m
            else:
                with pytest.raises(ConfigError, match=f"{m} microbatches .* not a multiple"):
                    parse_args(argv, world_size=2)


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_is_deadlock_free_for_every_allowed_microbatch_count(name):
    """Chain graphs with and without delayed W; a skip edge first stage -> last stage (the U-Transformer's
    longest) with delayed W at V <= 2 (more dependencies and channels; keeps the test's time down)."""
    kind = get_schedule(name)
    seen = set()
    for (P, V, m), delay, skip in itertools.product(_allowed(name), (False, True), (False, True)):
        if (kind.zero_bubble and delay) or (skip and (V > 2 or not (delay or kind.zero_bubble))):
            continue  # zero-bubble kinds are I/W schedules already: delayed W changes nothing
        S = P * V
        graph = PipelineGraph(S, [(0, S - 1)] if skip else ())
        sched = generate(name, P, m, delay, graph=graph, virtual_stages=V if kind.stages_per_mesh is None else None)
        assert sched.placement == placement_of(name, P, V)
        validate(lower(sched))  # includes the dry run: every WAIT is satisfied
        evaluation = lower(forward_only(graph, m, sched.placement))
        assert dry_run(evaluation) == [], (name, P, V, m, skip)
        seen.add((P, m, skip))
    assert {P for P, _, _ in seen} == {2, 3, 4} and max(m for _, m, _ in seen) == 12 and {s for *_, s in seen} == {
        False, True}


def test_megatron_microbatch_group_size_is_refused_as_not_built():
    with pytest.raises(ConfigError, match="not supported by megareshard: --microbatch-group-size-per-virtual-pipeline"
                                          r"-stage \(microbatch groups other than pp"):
        parse_args(_argv("--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-"
                         "pipeline-stage", "4"), world_size=2)
