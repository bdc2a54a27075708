"""ZeRO-3 (parameters sharded over data parallelism) through the trainer.

Two launches cover the compositions (each case ZeRO 0 and ZeRO 3 on the same data, in NCCL's checking mode):

* 4 ranks: dp 4 in fp16 with loss scaling (with --overlap-grad-reduce); tp 2 · dp 2 with sequence parallelism
  (the parameters under the persistence threshold gathered once per step, the others per use); pp 2 · dp 2
  eager-1F1B with delayed weight gradients, --overlap-grad-reduce (R actions) and an evaluation; pp 2 · dp 2
  1F1B in bf16 with full recomputation, keeping each stage's parameters gathered for the step
  (--torch-fsdp2-no-reshard-after-forward); and ZeRO 3 under the other runtime schedules (GPipe, interleaved
  1F1B, eager interleaved with delayed W, ZB-H1) against the eager-1F1B ZeRO-0 run.
* 8 ranks: tp 2 · pp 2 · dp 2 zbv (virtual stages, the tied embedding one Parameter on mesh 0) with sequence
  parallelism and --overlap-grad-reduce, saving a checkpoint; it resumes bitwise; it loads into ZeRO 1 at
  tp 1 · pp 1 · dp 8 and that back into ZeRO 3 at tp 2 · pp 2 · dp 2, each continuing the loss curve, and every
  re-save right after loading equals the source's checkpoint bitwise; per-stage layouts tp1dp4,tp2dp2.

ZeRO 3 reduces gradients in another order than ZeRO 0 (per layer and microbatch, reduce-scatter), so fp32 runs
agree to rounding: the tolerances follow from the arithmetic (tests/tolerances.py), as for ZeRO 1/2
(tests/test_zero_trainer.py). bf16/fp16: ZeRO 0 sums a parameter's microbatch gradients in the parameter's
dtype, ZeRO 3 (per microbatch) in fp32 — a larger relative error of the gradients, in the same bound —; the
fp32 masters then agree to that, and the low-precision parameters made from them may differ by one unit in
the last place where a master sits at a rounding boundary.
"""
from __future__ import annotations

import io
import math
import os

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.tensor_parallel import gather_full_state_dict
from megareshard.training import Trainer, build_context
from tests.checkpoint._helpers import no_saves_after
from tests.harness import run_ranks
from tests.tolerances import RHO, U, element_error_bounds

MODEL = ["--mock-data", "--vocab-size", "96", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-3", "--min-lr",
         "3e-4", "--lr-warmup-iters", "1", "--clip-grad", "0.5", "--device", "cpu", "--seed", "11",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100"]
STEPS = 3  # the 4-rank cases; the zbv source trains 4 (save at 2, resume for 2)
ZBV_STEPS = 4
ULP = {"--bf16": 2.0 ** -7, "--fp16": 2.0 ** -10}  # relative spacing of the numbers (8 / 11 significant bits)

# name: (tp, pp, flags of both runs, flags of the ZeRO-3 run only)
CASES_4 = {
    "dp4 fp16 overlap": (1, 1, ["--fp16", "--initial-loss-scale", "1024"], ["--overlap-grad-reduce"]),
    "tp2 dp2 sp persistence": (2, 1, ["--sequence-parallel"], ["--zero3-param-persistence-threshold", "1000"]),
    "pp2 dp2 eager-1f1b delayed-W overlap eval": (1, 2, ["--pipeline-schedule", "eager-1f1b", "--delay-wgrad-compute",
                                                         "--overlap-grad-reduce", "--eval-interval", "2",
                                                         "--eval-iters", "1"], []),
    "pp2 dp2 1f1b bf16 recompute keep-for-step": (1, 2, ["--pipeline-schedule", "1f1b", "--bf16",
                                                         "--recompute-granularity", "full"],
                                                  ["--torch-fsdp2-no-reshard-after-forward"]),
}
# the other runtime schedules, ZeRO-3 only, against the ZeRO-0 eager-1F1B run of the same layout (every schedule
# computes the same gradients; only the order of the microbatches' sums differs, which RHO covers)
SCHEDULES = {"gpipe": ["--pipeline-schedule", "gpipe"],
             "interleaved-1f1b": ["--pipeline-schedule", "interleaved-1f1b",
                                  "--num-layers-per-virtual-pipeline-stage", "1"],
             "eager-interleaved-1f1b dW": ["--pipeline-schedule", "eager-interleaved-1f1b", "--delay-wgrad-compute",
                                           "--num-layers-per-virtual-pipeline-stage", "1"],
             "zb-h1": ["--pipeline-schedule", "zb-h1"]}
ZBV = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
       "--sequence-parallel", "--overlap-grad-reduce"]
STAGE_LAYOUTS = ["--pipeline-model-parallel-size", "2", "--stage-layouts", "tp1dp4,tp2dp2"]


def _trainer(world, argv, last_save=None):
    """A Trainer of MODEL + argv; with ``last_save`` N it saves nothing after iteration N (`no_saves_after`)."""
    cfg = parse_args(MODEL + ["--nproc-per-node", str(world)] + list(argv), world_size=world)
    ctx, _ = build_context(cfg, world)
    t = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
    return t if last_save is None else no_saves_after(t, last_save)


def _run(world, argv, full=True, last_save=None):
    """Train; return the records' (loss, grad norm, lr), the full parameters, the first iteration's memory
    per stage, the all-gathers issued and the units of this rank (ZeRO-3)."""
    t = _trainer(world, argv, last_save)
    start = t.iteration
    recs = t.train()
    sharder = t.optimizer.sharder
    out = {"start": start, "steps": [(r["loss"], r["grad_norm"], r["lr"]) for r in recs],
           "evals": [(i, r["eval_loss"]) for i, r in enumerate(recs, start=1) if "eval_loss" in r],
           "memory": recs[0]["memory_per_stage"] if recs and "memory_per_stage" in recs[0] else None,
           "gathers": sharder.gathers if sharder else None, "units": len(sharder.units) if sharder else None,
           "messages": t.loaded.messages if t.loaded else None, "params": None}
    if full:
        with t.optimizer.full_params():
            out["params"] = gather_full_state_dict(t.model, t.ctx)
    t.close()
    t.release_communicators()
    return out


def _four(rank, world):
    torch.set_num_threads(1)
    out = {}
    for name, (tp, pp, both, only3) in CASES_4.items():
        lay = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
               "--train-iters", str(STEPS)]
        out[name] = (_run(world, lay + both + ["--zero-stage", "0"]),
                     _run(world, lay + both + only3 + ["--zero-stage", "3"]))
    lay = ["--pipeline-model-parallel-size", "2", "--train-iters", str(STEPS), "--zero-stage", "3"]
    out["schedules"] = {name: _run(world, lay + flags) for name, flags in SCHEDULES.items()}
    return out


def _eight(rank, world, root):
    torch.set_num_threads(1)
    out = {"zbv0": _run(world, ZBV + ["--zero-stage", "0", "--train-iters", str(ZBV_STEPS)]),
           "zbv3": _run(world, ZBV + ["--use-torch-fsdp2", "--train-iters", str(ZBV_STEPS), "--save", f"{root}/src",
                                      "--save-interval", "2"], last_save=2)}
    src = f"{root}/src/iter_0000002"
    out["resume"] = _run(world, ZBV + ["--use-torch-fsdp2", "--train-iters", str(ZBV_STEPS), "--load", src])
    t = _trainer(world, ["--zero-stage", "1", "--train-iters", str(ZBV_STEPS), "--load", src, "--save",
                         f"{root}/z1"], last_save=2)
    t.save_checkpoint()  # right after loading: the source's iteration-2 state, re-sliced
    out["z1"] = {"start": 2, "steps": [(r["loss"], r["grad_norm"], r["lr"]) for r in t.train()],
                 "messages": t.loaded.messages}
    t.close()
    t.release_communicators()
    t = _trainer(world, ZBV + ["--data-parallel-sharding-strategy", "optim_grads_params", "--train-iters",
                               str(ZBV_STEPS), "--load", f"{root}/z1/iter_0000002", "--save", f"{root}/back"],
                 last_save=2)
    t.save_checkpoint()
    out["back"] = {"start": t.iteration, "steps": [(r["loss"], r["grad_norm"], r["lr"]) for r in t.train()],
                   "messages": t.loaded.messages}
    t.close()
    t.release_communicators()
    for z in (0, 3):
        out[f"stages{z}"] = _run(world, STAGE_LAYOUTS + ["--zero-stage", str(z), "--train-iters", "2"])
    return out


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four, 4, timeout=600, nccl_check=True)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero3"))
    return run_ranks(_eight, 8, root, timeout=900, nccl_check=True), root


def _betas():
    t = parse_args(MODEL, world_size=1).training
    return t.adam_beta1, t.adam_beta2


def _assert_close(ref, got, label, ulp=0.0, lowp_sums=0, evals=True):
    """Losses and full parameters of two runs of the same layout and data within the bound that rounding in
    another reduction order allows (module docstring); ``ulp``: the relative spacing of bf16/fp16 parameters
    (0: fp32); ``lowp_sums``: additions one run makes in that precision and the other in fp32 (ZeRO 0
    accumulates a parameter's microbatch gradients in its dtype, ZeRO 3 reduce-scatters each in fp32), each
    a relative error of ulp/2, magnified by cancellation up to 16 as in RHO."""
    steps = len(ref["steps"])
    rho = RHO + lowp_sums * ulp / 2 * 16
    bounds = element_error_bounds([lr for _, _, lr in ref["steps"]], _betas(), rho)
    n = sum(p.numel() for p in ref["params"].values())
    top = max(p.abs().max().item() for p in ref["params"].values())
    assert max(norm for _, norm, _ in ref["steps"]) > 0.5, f"{label}: clipping never triggered"
    for t, ((loss, norm, _), (ref_loss, ref_norm, _)) in enumerate(zip(got["steps"], ref["steps"])):
        if not ulp:  # the clipped norm over tp, pp and the dp shards: gradients carrying RHO each step
            assert abs(norm - ref_norm) <= RHO * (1 + t) * ref_norm, (label, "grad norm", t, norm, ref_norm)
        # parameters apart by <= sqrt(n)·bound (bf16/fp16: plus one unit in the last place each) move the loss
        # by |gradient|·that to first order, twice for the rest, plus the loss's own rounding
        per_elem = bounds[t] + (ulp * top if t else 0.0)
        tol = 2 * ref_norm * math.sqrt(n) * per_elem + 4 * (ulp or U) * abs(ref_loss)
        assert abs(loss - ref_loss) <= tol, (label, t, loss, ref_loss, tol)
    assert not evals or [i for i, _ in got["evals"]] == [i for i, _ in ref["evals"]], label
    # an evaluation after step i sees the parameters of step i
    for (i, ev), (_, ref_ev) in zip(got["evals"] if evals else [], ref["evals"]):
        tol = 2 * ref["steps"][i - 1][1] * math.sqrt(n) * (bounds[i] + ulp * top) + 4 * (ulp or U) * abs(ref_ev)
        assert abs(ev - ref_ev) <= tol, (label, "eval", i, ev, ref_ev, tol)
    for name, r in ref["params"].items():
        g = got["params"][name]
        if name.endswith("attention.qkv.bias"):  # the key bias: rounding noise that Adam turns into ±lr steps
            assert (g - r).abs().max() <= 2 * 3e-3 * steps, (label, name)
            continue
        per_elem = bounds[-1] + ulp * r.abs().max().item()
        err = (g.float() - r.float()).norm().item()
        assert err <= math.sqrt(r.numel()) * per_elem, (label, name, err)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES_4))
def test_zero3_matches_zero0(four, case):
    tp, pp, both, only3 = CASES_4[case]
    dp = 4 // (tp * pp)
    for rank_out in four:
        ref, got = rank_out[case]
        lowp = next((f for f in ULP if f in both), None)
        per_microbatch = "--torch-fsdp2-no-reshard-after-forward" not in only3
        microbatches = 16 // (2 * dp)  # --global-batch-size 16, --micro-batch-size 2
        _assert_close(ref, got, case, ULP.get(lowp, 0.0), microbatches if lowp and per_microbatch else 0)
        # the parameter, gradient and (bf16/fp16: fp32 master) optimizer bytes per rank are 1/dp of ZeRO 0's
        for m0, m3 in zip(ref["memory"], got["memory"]):
            for kind in ("params", "grads") + (("optimizer",) if lowp else ()):
                assert m3[kind] == pytest.approx(m0[kind] / dp, rel=0.1), (case, kind, m0, m3)
    gathers, units = four[0][case][1]["gathers"], four[0][case][1]["units"]
    if "--torch-fsdp2-no-reshard-after-forward" in only3:
        assert gathers == units * STEPS, (gathers, units)  # once per unit and step
    else:  # per layer and microbatch, forward and backward
        assert gathers > 2 * units * STEPS, (gathers, units)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_zero3_every_runtime_schedule(four, schedule):
    def whole(runs):  # virtual stages place other layers on a rank: the model from every rank's parameters
        return {**runs[0], "params": {k: v for r in runs for k, v in r["params"].items()}}

    ref = whole([r["pp2 dp2 eager-1f1b delayed-W overlap eval"][0] for r in four])
    _assert_close(ref, whole([r["schedules"][schedule] for r in four]), schedule, evals=False)


@pytest.mark.slow
def test_zero3_zbv_checkpoint_resume_and_relayout(eight):
    results, root = eight
    r = results[0]
    _assert_close(r["zbv0"], r["zbv3"], "tp2 pp2 dp2 zbv sp overlap")
    src = r["zbv3"]["steps"]
    assert r["resume"]["start"] == 2 and r["resume"]["steps"] == src[2:], (r["resume"]["steps"], src)  # bitwise
    assert r["resume"]["params"].keys() == r["zbv3"]["params"].keys()
    for name, p in r["zbv3"]["params"].items():
        assert torch.equal(p, r["resume"]["params"][name]), name
    for name in ("z1", "back"):
        got = r[name]
        assert got["start"] == 2
        for (a, _, _), (b, _, _) in zip(got["steps"], src[2:]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got["steps"], src[2:])
        text = "\n".join(got["messages"])
        assert "layout changed" in text and "re-sliced exactly" in text, text
    assert "zero 3" in "\n".join(r["z1"]["messages"]) and "zero 1" in "\n".join(r["back"]["messages"])
    from tests.checkpoint._helpers import load_tool

    tool = load_tool()
    s = tool.export(os.path.join(root, "src", "iter_0000002"), os.path.join(root, "s.pt"))
    for name in ("z1", "back"):
        o = tool.export(os.path.join(root, name, "iter_0000002"), os.path.join(root, name + ".pt"))
        assert s["model"].keys() == o["model"].keys()
        for k, t in s["model"].items():
            assert torch.equal(t, o["model"][k]), (name, k)
        for k, kinds in s["optimizer"].items():
            for kind, t in kinds.items():
                assert torch.equal(t, o["optimizer"][k][kind]), (name, k, kind)


@pytest.mark.slow
def test_zero3_per_stage_layouts(eight):
    results, _ = eight
    for rank_out in results:
        _assert_close(rank_out["stages0"], rank_out["stages3"], "stage layouts tp1dp4,tp2dp2")


@pytest.mark.parametrize("argv,world,needle", [
    (["--zero-stage", "3"], 1, "dp is 1 (world size 1 = tp 1 × pp 1 × dp 1)"),
    (["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4,
     "dp is 1 (world size 4 = tp 2 × pp 2 × dp 1)"),
    (["--zero-stage", "3", "--pipeline-model-parallel-size", "2", "--stage-layouts", "tp1dp2,tp2dp1"], 4,
     "stage(s) 1 of --stage-layouts tp1dp2,tp2dp1 have dp 1"),
    (["--use-torch-fsdp2", "--zero-stage", "2"], 4, "--use-torch-fsdp2 shards parameters (ZeRO stage 3), but "
                                                   "--zero-stage 2"),
    (["--data-parallel-sharding-strategy", "optim", "--zero-stage", "2"], 4, "is ZeRO stage 1, but --zero-stage 2"),
    (["--torch-fsdp2-no-reshard-after-forward", "--zero-stage", "2"], 4, "not --zero-stage 2"),
    (["--zero3-param-persistence-threshold", "100", "--zero-stage", "1"], 4, "needs --zero-stage 3 (got 1)"),
])
def test_zero3_bad_combinations_refused_in_one_line(argv, world, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(MODEL + argv, world_size=world)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("argv,stage", [(["--use-torch-fsdp2"], 3), (["--zero-stage", "3"], 3),
                                        (["--data-parallel-sharding-strategy", "optim_grads_params"], 3),
                                        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                          "optim_grads"], 2),
                                        (["--use-custom-fsdp"], 0),
                                        (["--data-parallel-sharding-strategy", "optim"], 1)])
def test_megatron_spellings_of_the_zero_stage(argv, stage):
    cfg = parse_args(MODEL + argv, world_size=4)
    assert cfg.memory.zero_stage == stage
    assert cfg.memory.torch_fsdp2_reshard_after_forward


def test_zero3_needs_the_model_and_dp():
    from megareshard.optim.zero import ZeroOptimizer
    from megareshard.parallel import ParallelContext

    lin = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="needs the model"):
        ZeroOptimizer(lin.named_parameters(), ParallelContext.single_process(), stage=3)
    with pytest.raises(ValueError, match="dp is 1"):
        ZeroOptimizer(lin.named_parameters(), ParallelContext.single_process(), stage=3, module=lin)


def test_planner_knows_zero3():
    """Per device: ZeRO 3 holds about 1/dp of ZeRO 0's weights, gradients and optimizer state plus what a step
    gathers; its forward and backward pay the per-layer collectives' fixed cost; no all-gather after the step."""
    from megareshard.optim import zero
    from megareshard.planner import costs
    from tests.planner.test_planner import LLAMA_8B

    assert costs.MAX_INFLIGHT_REDUCTIONS == zero.MAX_INFLIGHT_REDUCTIONS
    c = costs.ClusterSpec(2, 8, 80.0, 989.0)
    kw = dict(layers=16, first=False, last=False, tp=1, dp=8, micro_batch=1, sequence_parallel=False,
              recompute=False, dp_crosses_hosts=True, dp_ring_edges_per_nic=1)
    z = {k: costs.stage_costs(LLAMA_8B, c, zero=k, **kw) for k in range(4)}
    layer = costs.layer_params(LLAMA_8B)
    assert z[3].static_bytes < z[2].static_bytes < z[0].static_bytes
    held = 2 * (2 * 0 + 3 * layer) + 4 * zero.MAX_INFLIGHT_REDUCTIONS * layer  # no stage module in a middle stage
    assert z[3].static_bytes == pytest.approx(z[0].static_bytes / 8 + held, rel=1e-6)
    assert z[3].forward_s > z[2].forward_s and z[3].backward_s > z[2].backward_s
    assert z[3].dp_seconds < z[2].dp_seconds


def test_planner_searches_zero3_and_ranks_it_behind_zero2():
    """Asked for, ZeRO 3 candidates are searched and carry --zero-stage 3; at the same shape one is never faster
    than its ZeRO 2 twin (same traffic at best, plus its collectives' fixed cost), so it is chosen only where
    memory asks for it."""
    from megareshard.planner.costs import ClusterSpec, ModelShape
    from megareshard.planner.search import plan_layouts

    model = ModelShape(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=4096)
    ranked = plan_layouts(model, ClusterSpec(hosts=1, devices_per_host=4), 8, micro_batches=(2,), zero_stages=(2, 3),
                          recompute_options=(False,), schedules=["1f1b"], stage_meshes=False, uneven_splits=False)
    z3 = [c for c in ranked if c.zero == 3]
    assert z3 and all("--zero-stage 3" in c.flags() for c in z3)
    for c in z3:
        twin = next(x for x in ranked if x.zero == 2 and (x.tp, x.pp, x.micro_batch, x.strategy) ==
                    (c.tp, c.pp, c.micro_batch, c.strategy))
        assert c.step_s >= twin.step_s and max(c.memory_gib) <= max(twin.memory_gib) * 1.5
