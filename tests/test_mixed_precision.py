"""Mixed precision: low-precision parameters with fp32 masters, fp16 loss scaling, with ZeRO 0/1/2."""
import math

import pytest
import torch

from megareshard.models import GPTModel
from megareshard.optim.grad_scaler import ConstantLossScaler, DynamicLossScaler
from megareshard.optim.zero import ZeroOptimizer
from megareshard.parallel import ParallelContext, Topology
from tests.harness import run_ranks
from tests.test_zero import BETAS, EPS, WD, batches, fwd_bwd, tiny_cfg


def test_dynamic_scaler_rules():
    s = DynamicLossScaler(initial_scale=1024, min_scale=256, window=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024                      # hysteresis: first overflow tolerated
    s.update(True)
    assert s.scale == 512
    for _ in range(2):
        s.update(False)
    assert s.scale == 512
    s.update(False)
    assert s.scale == 1024                      # window clean steps -> doubled
    for _ in range(6):
        s.update(True)
    assert s.scale == 256                       # floored at min_scale
    c = ConstantLossScaler(8.0)
    c.update(True)
    assert c.scale == 8.0
    s2 = DynamicLossScaler()
    s2.load_state_dict(s.state_dict())
    assert s2.state_dict() == s.state_dict()


def _train(ctx, dtype, stage, steps, lr=3e-3):
    model = GPTModel(tiny_cfg(), ctx, seed=3, params_dtype=dtype)
    opt = ZeroOptimizer(model.named_parameters(), ctx, stage=stage, lr=lr, weight_decay=WD, betas=BETAS, eps=EPS,
                        bucket_bytes=4096)
    data = batches(ctx.dp_rank(), 4)        # 4 batches, cycled: the loss must come down
    losses = []
    for i in range(steps):
        opt.zero_grad()
        losses.append(fwd_bwd(model, data[i % 4]))
        opt.finish_grad_sync()
        opt.clip_grad_norm(1.0)
        opt.step()
    return losses


def _bf16(rank, world_size):
    ctx = ParallelContext.create(Topology(world_size))
    return {"fp32": _train(ctx, torch.float32, 0, 30), "bf16-2": _train(ctx, torch.bfloat16, 2, 30)}


@pytest.mark.slow
def test_bf16_trains_like_fp32():
    res = run_ranks(_bf16, 2, timeout=180)[0]
    fp32 = res["fp32"]
    assert fp32[-1] < 0.8 * fp32[0]
    for key in ("bf16-2",):
        last_bf = sum(res[key][-4:]) / 4
        last_fp = sum(fp32[-4:]) / 4
        assert abs(last_bf - last_fp) / last_fp < 0.02, (key, last_bf, last_fp)


def _fp16_overflow(rank, world_size):
    """Per stage: overflow injected on dp rank 1 only -> every rank skips, params unchanged, scale
    halves after `hysteresis` overflows and doubles after `window` clean steps."""
    ctx = ParallelContext.create(Topology(world_size))
    report = {}
    for stage in (0, 1, 2):
        model = GPTModel(tiny_cfg(), ctx, seed=3, params_dtype=torch.float16)
        scaler = DynamicLossScaler(initial_scale=2.0 ** 10, min_scale=1.0, window=3, hysteresis=2)
        opt = ZeroOptimizer(model.named_parameters(), ctx, stage=stage, lr=1e-3, weight_decay=WD, betas=BETAS,
                            eps=EPS, loss_scaler=scaler, bucket_bytes=4096)
        data = batches(ctx.dp_rank(), 8)
        events = []
        for i, mbs in enumerate(data):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            fwd_bwd(model, mbs, scale_loss=opt.scale_loss)
            if i in (1, 2) and ctx.dp_rank() == 1:      # injected overflow on ONE rank
                model.layers["0"].mlp.fc1.weight.grad[0, 0] = float("inf")
            opt.finish_grad_sync()
            norm = opt.clip_grad_norm(1.0)
            stepped = opt.step()
            unchanged = all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
            events.append((stepped, unchanged, scaler.scale, math.isfinite(norm)))
        report[stage] = events
    return report


@pytest.mark.slow
def test_fp16_overflow_skips_everywhere_and_rescales():
    results = run_ranks(_fp16_overflow, 2, timeout=180)
    for stage in (0, 1, 2):
        a, b = results[0][stage], results[1][stage]
        assert [e[:3] for e in a] == [e[:3] for e in b], "ranks disagree on skipping or the scale"
        stepped = [e[0] for e in a]
        assert stepped == [True, False, False, True, True, True, True, True], stepped
        for s, unchanged, _, _ in a:
            assert unchanged == (not s)         # skipped steps leave parameters untouched
        scales = [e[2] for e in a]
        # step 0 clean (1 of window 3); step 1 overflow (hysteresis 2 -> 1): scale kept;
        # step 2 overflow: halved; steps 3,4,5 clean -> doubled after the third
        assert scales == [1024, 1024, 512, 512, 512, 1024, 1024, 1024], scales
