"""docs/extending.md's worked examples run (pure, no processes): every file under examples/extending/ appears in
the doc verbatim, and each does what the doc says it does.

A new pipeline schedule (`examples/extending/looped_bfs.py`), registered from outside the package, is at once
a choice of the command line, checked by the arguments, generated, proved deadlock-free by the validator,
simulated to the peak its own live bound gives, and planned; a kind without a live bound is refused by the
planner, by name. The registry is restored after each test (`Registry.scoped`), so no other test sees the toy.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
from pathlib import Path

import pytest

from megareshard.arguments import ConfigError, parse_args
from megareshard.pipeline import generate, lower, register_schedule, schedule_names, simulate, validate
from megareshard.pipeline.schedules import registry
from megareshard.planner import ClusterSpec, ModelShape, PlanError, plan_layouts
from megareshard.planner.variants import live_bound

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "extending"


def _example(name: str):
    """The example file as a module (loaded from its path: examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"extending_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fresh_registry():
    """The schedule registry for one test: what it registers goes with it."""
    with registry.SCHEDULES.scoped():
        yield


def test_the_doc_shows_every_example_file_verbatim() -> None:
    doc = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    files = sorted(EXAMPLES.glob("*.py"))
    assert files
    for path in files:
        assert f"```python\n{path.read_text(encoding='utf-8')}```" in doc, f"docs/extending.md lacks {path.name}"


def _argv(*extra: str) -> list[str]:
    return ["--mock-data", "--vocab-size", "64", "--num-layers", "8", "--hidden-size", "16", "--num-attention-heads",
            "2", "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
            "--lr", "1e-3", "--pipeline-model-parallel-size", "2", *extra]


SMALL = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256)
PLAN = dict(micro_batches=(1,), zero_stages=(0,), recompute_options=(False,), uneven_splits=False,
            stage_meshes=False)


def test_a_schedule_registered_from_outside_is_everywhere(fresh_registry) -> None:
    kind = _example("looped_bfs").LOOPED_BFS
    flags = _argv("--pipeline-schedule", "looped-bfs", "--num-virtual-stages-per-pipeline-rank", "2")
    with pytest.raises(ConfigError, match="invalid choice"):  # not yet a choice of the command line
        parse_args(flags, world_size=2)
    assert register_schedule(kind) is kind and schedule_names()[-1] == "looped-bfs"
    assert register_schedule(kind) is kind       # the same kind again (a module imported twice): accepted
    with pytest.raises(ValueError, match="schedule 'looped-bfs' is registered already .* registers another"):
        register_schedule(dataclasses.replace(kind, live_bound=None))

    # the command line and the arguments' checks
    cfg = parse_args(flags, world_size=2)
    assert (cfg.pipeline.pipeline_schedule, cfg.plan.virtual_stages, cfg.plan.pipeline.placement) == (
        "looped-bfs", 2, (0, 1, 0, 1))
    with pytest.raises(ConfigError, match="looped-bfs interleaves virtual stages: give"):
        parse_args(_argv("--pipeline-schedule", "looped-bfs"), world_size=2)

    # generated, deadlock-free (the validator's dry run), its simulated peak exactly the kind's live bound
    for P, m, V, dw in itertools.product((2, 3), (1, 3, 4), (2, 3), (False, True)):
        sched = generate("looped-bfs", P, m, dw, virtual_stages=V)
        validate(lower(sched))
        peak = simulate(sched, costs={"f": 1.0, "b": 2.0, "comm": 0.3}).peak_activations
        assert peak == live_bound("looped-bfs", dw, P, m, V) == [m * V] * P, (P, m, V, dw)

    # planned: its candidates carry the kind's live bound and flags the trainer parses
    ranked = plan_layouts(SMALL, ClusterSpec(hosts=2, devices_per_host=1), 4, schedules=["looped-bfs", "1f1b"],
                          keep=None, **PLAN)
    ours = [c for c in ranked if c.schedule == "looped-bfs"]
    assert ours and {c.schedule for c in ranked} == {"looped-bfs", "1f1b"}
    for c in ours:
        assert (c.pp, c.virtual_stages) == (2, 2) and c.live_microbatches == [c.num_microbatches * 2] * 2, c.name
    assert "--pipeline-schedule looped-bfs --reshard-strategy" in ours[0].flags(4)
    assert "--num-layers-per-virtual-pipeline-stage 1" in ours[0].flags(4)


def test_a_kind_without_a_live_bound_is_refused_by_the_planner_by_name(fresh_registry) -> None:
    register_schedule(dataclasses.replace(_example("looped_bfs").LOOPED_BFS, name="no-bound", live_bound=None))
    validate(lower(generate("no-bound", 2, 4, virtual_stages=2)))  # it still generates (its name aside, looped BFS)
    with pytest.raises(ValueError, match="schedule 'no-bound' gives no live-activation bound"):
        live_bound("no-bound", False, 2, 4, 2)
    cluster = ClusterSpec(hosts=2, devices_per_host=1)
    for schedules in (["no-bound"], None):  # asked for, or among every registered schedule: never a default formula
        with pytest.raises(PlanError, match=r"schedule\(s\) \['no-bound'\] give no live-activation bound"):
            plan_layouts(SMALL, cluster, 4, schedules=schedules, **PLAN)


# ---- a new resharding strategy -----------------------------------------------------------------------
@pytest.fixture
def fresh_strategies():
    """The strategy registry for one test: what it registers goes with it."""
    from megareshard.resharding.strategies import base

    with base.STRATEGIES.scoped():
        yield


def test_a_strategy_registered_from_outside_is_everywhere(fresh_strategies) -> None:
    from megareshard.resharding import Mesh, NetworkModel, ShardingSpec, plan_resharding, register_strategy
    from megareshard.resharding.messages import build_messages

    star = _example("star").STAR
    with pytest.raises(ConfigError, match="invalid choice"):  # not yet a choice of the command line
        parse_args(_argv("--reshard-strategy", "star"), world_size=2)
    register_strategy(star)
    assert parse_args(_argv("--reshard-strategy", "star"), world_size=2).plan.pipeline.strategy == "star"
    # its messages: one copy per other host, forwarded inside it
    host_of = {r: r // 2 for r in range(6)}
    msgs = build_messages("star", 10, 0, [1, 2, 3, 4, 5], host_of, chunks=1)
    assert [(m.src, m.dst, m.forward) for m in msgs] == [(0, 1, False), (0, 2, False), (2, 3, True),
                                                         (0, 4, False), (4, 5, True)]
    # its cost in the network model: the sender's NIC carries the slice once per receiving host
    shape, one, six = (64, 64), Mesh.grid(1, 1), Mesh([[0, 1], [2, 3], [4, 5]], host_of)
    plan = plan_resharding(shape, one, ShardingSpec.parse("R,R"), six, ShardingSpec.parse("R,R"), strategy="star")
    net = NetworkModel(nic_gbps=1.0)
    assert net.host_bytes(plan)[0] == (2 * 64 * 64 * 4, 0)
    assert net.lower_bound(plan) <= net.predict(plan, "concurrent")
    # the planner considers it beside the built-in strategies
    ranked = plan_layouts(SMALL, ClusterSpec(hosts=2, devices_per_host=2), 4, schedules=["1f1b"], keep=None,
                          **PLAN)
    assert "star" in {c.strategy for c in ranked}


def _star_on_ranks(rank: int, world: int, path: str) -> bool:
    """Rank 0's tensor replicated on a 2 × 2 mesh of 2 hosts by the star, under NCCL's rules (checking mode)."""
    import importlib.util

    import torch

    from megareshard.resharding import Mesh, ShardingSpec, local_slices, plan_resharding, register_strategy
    from megareshard.resharding.executor import Resharder

    spec = importlib.util.spec_from_file_location("extending_star", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register_strategy(module.STAR)
    src, dst = Mesh.grid(1, 1), Mesh.grid(2, 2)
    shape = (6, 5)
    full = torch.arange(30, dtype=torch.float32).reshape(shape)
    plan = plan_resharding(shape, src, ShardingSpec.parse("R,R"), dst, ShardingSpec.parse("R,R"), strategy="star")
    out = Resharder(plan, torch.float32).run(full.clone() if local_slices(shape, src, plan.src_spec, rank) else None)
    return bool(torch.equal(out, full))


def test_the_strategy_example_moves_the_data_under_nccl_rules() -> None:
    from tests.harness import run_ranks

    assert run_ranks(_star_on_ranks, 4, str(EXAMPLES / "star.py"), nccl_check=True) == [True] * 4


# ---- a new model ---------------------------------------------------------------------------------------------
MLP_FLAGS = ["--mock-data", "--vocab-size", "50", "--num-layers", "4", "--hidden-size", "16", "--num-attention-heads",
             "2", "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
             "--lr", "1e-2", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
             "--eval-interval", "0", "--device", "cpu"]


def _mlp_losses(rank: int, world: int, path: str, flags: list[str]) -> list[float]:
    """The example model trained for three iterations in the layout `flags` gives; its loss curve."""
    import importlib.util
    import io
    import os

    from megareshard.model_spec import get_model_spec, register_model_spec
    from megareshard.training import pretrain

    spec = importlib.util.spec_from_file_location("extending_mlp_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register_model_spec(module.MLP_LM)  # the registry line
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    cfg = parse_args(MLP_FLAGS + flags, world_size=world)
    return [r["loss"] for r in pretrain(cfg, out=io.StringIO(), model_spec=get_model_spec("mlp-lm"))]


def test_the_model_example_trains_and_every_layout_reproduces_one_process() -> None:
    """The example model (one file, registered by name) trains on one process, and split over two pipeline
    stages (eager-1F1B, broadcast boundaries) and over tensor parallelism it gives the same losses: its blocks
    are seeded by their global index, the arithmetic per element is the same up to the tp reductions' order."""
    from tests.harness import run_ranks

    path = str(EXAMPLES / "mlp_lm.py")
    (one,) = run_ranks(_mlp_losses, 1, path, [])
    pipe = run_ranks(_mlp_losses, 2, path, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                            "eager-1f1b"], nccl_check=True)
    tp = run_ranks(_mlp_losses, 2, path, ["--tensor-model-parallel-size", "2"])
    assert len(one) == 3 and one[-1] < one[0]  # it learns
    assert pipe[0] == pipe[1] == one  # the same arithmetic, element for element
    # tp 2: the row-parallel sums and the cross entropy's reductions add in another order; a few ulps per step
    assert tp[0] == pytest.approx(one, rel=1e-5)


# ---- a step hook ---------------------------------------------------------------------------------------------
def test_the_step_hook_example_sees_every_iteration(tmp_path, monkeypatch) -> None:
    """``--custom-import lr_trace`` (the examples directory on the path, as the doc's command puts it) registers the
    hook; one run calls it at each iteration's start with the learning rate that iteration uses; importing the
    module again registers nothing twice, another function under its name is refused."""
    import io
    import json
    import sys

    from megareshard.plugins import STEP_HOOKS, register_step_hook
    from megareshard.training import pretrain

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("LR_TRACE_FILE", str(tmp_path / "lr.jsonl"))
    monkeypatch.setenv("RANK", "0")
    with STEP_HOOKS.scoped():
        flags = [*MLP_FLAGS, "--custom-import", "lr_trace", "--lr-warmup-iters", "2"]
        records = pretrain(parse_args(flags, world_size=1), out=io.StringIO())
        parse_args(flags, world_size=1)                        # imported again: the same hook, registered once
        assert [h.__qualname__ for h in STEP_HOOKS.items()].count("trace_lr") == 1   # (others: other tests')
        other = lambda trainer, iteration: None  # noqa: E731
        other.__module__, other.__qualname__ = "lr_trace", "trace_lr"
        with pytest.raises(ValueError, match="step hook 'lr_trace.trace_lr' is registered already"):
            register_step_hook(other)
    sys.modules.pop("lr_trace", None)
    lines = [json.loads(ln) for ln in (tmp_path / "lr.jsonl").read_text().splitlines()]
    assert [ln["iteration"] for ln in lines] == [1, 2, 3]
    assert [ln["lr"] for ln in lines] == [r["lr"] for r in records] and lines[0]["lr"] < lines[1]["lr"]   # warm-up


# ---- components a model spec replaces ------------------------------------------------------------------------
def test_a_spec_replaces_the_data_and_the_lr_schedule_builders(monkeypatch) -> None:
    """``ModelSpec.components`` (torchtitan's train spec): a spec that swaps the data builder for its own samples
    and wraps the learning-rate schedule's builder trains on those samples with that schedule; the default
    builders run for the rest, and a run without the spec is unchanged."""
    import copy
    import io

    import torch

    from megareshard.components import DEFAULTS, build_data
    from megareshard.data.mock import MockGPTDataset
    from megareshard.model_spec import get_model_spec
    from megareshard.optim.lr_scheduler import LRScheduler
    from megareshard.training import Trainer, build_context

    monkeypatch.setenv("RANK", "0")
    calls = []

    def my_data(cfg, ctx, local_micro_batch, out):
        data = build_data(cfg, ctx, local_micro_batch, out)
        data.train = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, len(data.train), seed=99)
        calls.append("data")
        return data

    def my_schedule(optimizer, cfg):
        calls.append("lr")
        return DEFAULTS.build_lr_schedule(optimizer, cfg)

    spec = copy.copy(get_model_spec("gpt"))
    spec.components = DEFAULTS.replace(build_data=my_data, build_lr_schedule=my_schedule)
    cfg = parse_args([*MLP_FLAGS, "--num-attention-heads", "2"], world_size=1)
    losses = {}
    for name, s in (("spec", spec), ("default", None)):
        ctx, _ = build_context(cfg, 1)
        trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO(), model_spec=s)
        try:
            losses[name] = [r["loss"] for r in trainer.train()]
            if s is spec:
                assert trainer.train_data[0]["tokens"].tolist() == MockGPTDataset(
                    cfg.model.vocab_size, cfg.model.seq_length, 1, seed=99)[0]["tokens"].tolist()
                assert isinstance(trainer.scheduler, LRScheduler)
        finally:
            trainer.close()
    assert calls == ["lr", "data"] and losses["spec"] != losses["default"] and len(losses["spec"]) == 3


def test_cost_terms_are_registered_kinds() -> None:
    """The planner takes cost terms of registered kinds only (the registry rule): an unregistered kind is one
    line listing what is registered; registered, the same class again is accepted and another under its name
    refused."""
    from dataclasses import dataclass

    from megareshard.planner.terms import COST_TERMS, register_cost_term

    @dataclass(frozen=True)
    class Idle:
        name: str = "idle_s"

        def measure(self, at):
            return 0.0

        def apply(self, step_s, quantity, at):
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match=r"unknown cost term 'idle_s' \(a Idle\); registered: "):
        plan_layouts(SMALL, ClusterSpec(hosts=2, devices_per_host=1), 4, terms=[Idle()], **PLAN)
    with COST_TERMS.scoped():
        assert register_cost_term(Idle) is Idle and register_cost_term(Idle) is Idle
        with pytest.raises(ValueError, match="cost term 'idle_s' is registered already"):
            register_cost_term(type("Other", (), {"name": "idle_s"}))
