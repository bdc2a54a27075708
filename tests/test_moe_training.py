"""Mixture of experts trained end to end (issue #52, pp 1): Megatron-LM's MoE flags on the command line, expert
parallelism in the trainer, expert gradients over the expert-data-parallel group, the router losses logged, and
expert weights saved as boxes of the global expert tensors.

One launch of 4 gloo ranks (NCCL's rules checked): a dropless MoE GPT at ep 2 × dp 4 with the alltoall
dispatcher (ZeRO 0) and with the allgather dispatcher (ZeRO 1: optimizer state sharded over the
expert-data-parallel pairs) reproduces the single-process run's losses, the load-balancing and z losses
included; the ZeRO-1 run saves at iteration 2, which one process (ep 1, dp 1) loads: the same weights, bit for
bit, and the same third iteration.

Tolerances (tests/tolerances.py): the first iteration runs the same weights through other row groupings of the
expert GEMMs and other reduction orders, so the losses differ by a forward's rounding (`forward_tolerance` over
the GPT's sums, the experts' included) and the gradient norms by the gradients' roundoff (`RHO`); after t updates the parameters are apart by at most sqrt(n)·bound[t]
(`element_error_bounds`: Adam's step bound times the roundoff of gradients summed in another order), which
moves the LM loss by at most the gradient norm times that (twice, for what first order leaves out). The router
losses are held to the same relative bound as the LM loss.
"""
from __future__ import annotations

import io
import math

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.parallel import ParallelContext, Topology
from megareshard.training import Trainer
from tests.harness import run_ranks
from tests.tolerances import RHO, element_error_bounds, forward_tolerance, gpt_forward_reductions

ITERS, LR, BETAS = 3, 1e-2, (0.9, 0.999)
H, F, FE, S, L, HEADS, E = 16, 32, 24, 8, 2, 2, 4
NAMES = ("load_balancing_loss", "z_loss")


def _argv(dispatcher="alltoall", ep=1, zero=0, iters=ITERS, save=None, load=None):
    argv = (f"--mock-data --vocab-size 64 --num-layers {L} --hidden-size {H} --ffn-hidden-size {F} "
            f"--num-attention-heads {HEADS} --seq-length {S} --micro-batch-size 1 --global-batch-size 4 "
            f"--train-iters {iters} --lr {LR} --min-lr {LR} --device cpu --seed 5 --hidden-dropout 0 "
            f"--attention-dropout 0 --swiglu --disable-bias-linear --clip-grad 0 "
            f"--num-experts {E} --moe-router-topk 2 --moe-ffn-hidden-size {FE} --moe-aux-loss-coeff 0.01 "
            f"--moe-z-loss-coeff 0.001 --moe-token-dispatcher-type {dispatcher} "
            f"--expert-model-parallel-size {ep} --zero-stage {zero}").split()
    if save:
        argv += ["--save", save, "--save-interval", "100"]
    if load:
        argv += ["--load", load]
    return argv


def _records(trainer: Trainer) -> list[dict]:
    return [{k: r[k] for k in ("loss", "grad_norm", "lr", *NAMES)} for r in trainer.train()]


def _full_weights(trainer: Trainer, ctx) -> dict[str, torch.Tensor]:
    from megareshard.models.moe import gather_full_expert_tensor

    out = {}
    for name, p in trainer.model.named_parameters():   # tp 1: dense weights are whole; experts gathered over ep
        out[name] = (gather_full_expert_tensor(p.data, p, ctx) if getattr(p, "expert_parallel", False)
                     else p.detach().clone())
    return out


def _ranks(rank, world, save_dir):
    ctx = ParallelContext.create(Topology(world, tp=1), expert_model_parallel_size=2)
    assert (ctx.ep_size, ctx.etp_size, ctx.edp_size) == (2, 1, 2)
    out = {}
    t = Trainer(parse_args(_argv("alltoall", 2, 0), world_size=world), ctx, torch.device("cpu"), out=io.StringIO())
    out["alltoall"] = _records(t)
    t.close()
    log = io.StringIO()
    t = Trainer(parse_args(_argv("allgather", 2, 1, iters=2, save=save_dir), world_size=world), ctx,
                torch.device("cpu"), out=log)
    out["allgather"] = _records(t)
    t.close()
    out["saved"] = _full_weights(t, ctx)
    out["log"] = log.getvalue()
    ctx.destroy()
    return out if rank == 0 else None


def _single(argv):
    trainer = Trainer(parse_args(argv, world_size=1), ParallelContext.single_process(), torch.device("cpu"),
                      out=io.StringIO())
    return trainer, _records(trainer)


def _tolerances(ref, n_params):
    bounds = element_error_bounds([r["lr"] for r in ref], BETAS)
    fwd = forward_tolerance(gpt_forward_reductions(L, H, F + FE, HEADS, H // HEADS, S), 1.0)
    return [2 * r["grad_norm"] * math.sqrt(n_params) * bounds[t] + fwd for t, r in enumerate(ref)]


def _assert_runs_close(got, ref, tols, label, first_step=True):
    assert len(got) == len(ref), label
    if first_step:   # the first step, at the same weights: the gradient norm apart by the gradients' rounding only
        assert abs(got[0]["grad_norm"] - ref[0]["grad_norm"]) <= RHO * ref[0]["grad_norm"], (label, got[0], ref[0])
    for t, (g, r) in enumerate(zip(got, ref)):
        rel = tols[t] / abs(r["loss"])
        assert abs(g["loss"] - r["loss"]) <= tols[t], (label, t, g["loss"], r["loss"], tols[t])
        for name in NAMES:   # the router losses: the same relative bound
            assert abs(g[name] - r[name]) <= rel * abs(r[name]) + 4 * 2.0 ** -24, (label, t, name, g[name], r[name])


def test_moe_expert_parallel_training_matches_single_process_and_checkpoints_relayout(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    got = run_ranks(_ranks, 4, save_dir, timeout=300, nccl_check=True)[0]
    reference, ref = _single(_argv())
    n_params = sum(p.numel() for p in reference.model.parameters())
    tols = _tolerances(ref, n_params)
    assert all(r[name] > 0 for r in ref for name in NAMES)
    _assert_runs_close(got["alltoall"], ref, tols, "ep 2 × dp 4, alltoall, ZeRO 0")
    _assert_runs_close(got["allgather"], ref[:2], tols, "ep 2 × dp 4, allgather, ZeRO 1 over edp")
    assert "load_balancing_loss: " in got["log"] and "z_loss: " in got["log"]
    # the ep-2 save (ZeRO 1 over edp 2) loads at ep 1 in one process: the same weights, and the same next step
    loaded = Trainer(parse_args(_argv(load=save_dir), world_size=1), ParallelContext.single_process(),
                     torch.device("cpu"), out=io.StringIO())
    assert loaded.iteration == 2
    weights = dict(loaded.model.named_parameters())
    assert weights.keys() == got["saved"].keys()
    for name, w in got["saved"].items():
        assert torch.equal(weights[name].detach(), w), name
    third = _records(loaded)
    _assert_runs_close(third, ref[2:], tols[2:], "loaded at ep 1 after an ep-2 save", first_step=False)


@pytest.mark.parametrize("flags, message", [
    ("--num-experts 6 --expert-model-parallel-size 4", "--num-experts 6 is not divisible by "
                                                       "--expert-model-parallel-size 4"),
    ("--num-experts 4 --expert-model-parallel-size 4", "--expert-model-parallel-size 4 × "
                                                       "--expert-tensor-parallel-size 1 = 4 does not divide the 2 "
                                                       "ranks of a pipeline stage"),
    ("--num-experts 2 --moe-router-topk 3", "--moe-router-topk 3 must be between 1 and --num-experts 2"),
    ("--moe-aux-loss-coeff 0.01", "--moe-aux-loss-coeff 0.01 without --num-experts"),
    ("--expert-model-parallel-size 2", "--expert-model-parallel-size 2 without --num-experts"),
    ("--num-experts 2 --moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-capacity needs "
                                                           "--moe-expert-capacity-factor"),
])
def test_moe_bad_input_one_line(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_args(["--mock-data", "--vocab-size", "64", "--num-layers", "2", *flags.split()], world_size=2)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_moe_flags_parse_with_megatron_defaults():
    cfg = parse_args("--mock-data --vocab-size 64 --num-layers 4 --num-experts 8 --moe-layer-freq ([1]*1+[0])*2 "
                     "--expert-model-parallel-size 2".split(), world_size=2)
    m, p = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (8, 2, 0.0, None)
    assert (m.moe_router_load_balancing_type, m.moe_token_dispatcher_type) == ("aux_loss", "allgather")
    assert m.moe_layer_freq == "([1]*1+[0])*2" and m.moe_expert_capacity_factor is None
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size) == (2, None)
    assert parse_args("--mock-data --vocab-size 64 --num-experts 2 --moe-layer-freq 2".split()).model.moe_layer_freq == 2
