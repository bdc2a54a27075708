"""LR schedule, global gradient norm across model-parallel ranks, bucketed DP averaging."""
import math

import pytest
import torch

from megareshard.optim import LRScheduler, WarmupCosine, build_adamw, clip_grad_norm_, global_grad_norm
from megareshard.parallel import ParallelContext, Topology
from megareshard.parallel.data_parallel import GradAverager
from tests.harness import run_ranks


def test_warmup_then_cosine():
    s = WarmupCosine(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    assert s(1) == pytest.approx(0.1) and s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.5 * 0.9)  # half way through the cosine
    assert s(110) == pytest.approx(0.1) and s(500) == 0.1
    assert all(s(i) >= s(i + 1) for i in range(10, 200))


def test_scheduler_state_round_trip():
    model = torch.nn.Linear(4, 4)
    opt = build_adamw(model, 1.0, 0.1, (0.9, 0.95), 1e-8)
    sched = LRScheduler(opt, WarmupCosine(1.0, 0.0, 5, 20))
    lrs = [sched.step() for _ in range(7)]
    state = sched.state_dict()
    sched2 = LRScheduler(opt, WarmupCosine(1.0, 0.0, 5, 20))
    sched2.load_state_dict(state)
    assert sched2.step() == sched.step() and lrs[4] == 1.0


def test_adamw_groups_exempt_vectors_from_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    decay, no_decay = opt.param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def _norm_and_average(rank, world_size):
    """tp 2 × pp 2 × dp 2: a sharded matrix, a tp-replicated vector, a tied duplicate on the last stage."""
    topo = Topology(world_size, tp=2, pp=2)
    ctx = ParallelContext.create(topo)
    c = topo.coords(rank)
    g = torch.Generator().manual_seed(0)
    full = {s: torch.randn(6, 4, generator=g) for s in range(2)}     # per stage, sharded over tp by rows
    vec = {s: torch.randn(4, generator=g) for s in range(2)}         # per stage, replicated over tp
    emb = torch.randn(5, generator=g)                                # tied: on stage 0 and a duplicate on stage 1
    params = []
    w = torch.nn.Parameter(torch.zeros(3, 4)); w.grad = full[c.pp].chunk(2)[c.tp].clone()
    w.tensor_model_parallel = True
    v = torch.nn.Parameter(torch.zeros(4)); v.grad = vec[c.pp].clone()
    e = torch.nn.Parameter(torch.zeros(5)); e.grad = emb.clone()
    if c.pp == 1:
        e.shared_embedding_duplicate = True
    params = [w, v, e]
    expected = math.sqrt(sum(full[s].pow(2).sum() + vec[s].pow(2).sum() for s in range(2)) + emb.pow(2).sum())
    norm = global_grad_norm(params, ctx)
    clipped = clip_grad_norm_(params, 1.0, ctx)
    after = global_grad_norm(params, ctx)
    # DP averaging in buckets small enough to force several buckets
    a = torch.nn.Parameter(torch.zeros(10)); a.grad = torch.full((10,), float(c.dp))
    b = torch.nn.Parameter(torch.zeros(3, 3)); b.grad = torch.full((3, 3), 10.0 * c.dp)
    unused = torch.nn.Parameter(torch.zeros(2))
    GradAverager([a, b, unused], ctx.dp_group, ctx.dp_size, bucket_bytes=40).average()
    return norm, expected, clipped, after, a.grad.tolist(), b.grad.flatten().tolist(), unused.grad.tolist()


def test_grad_norm_counts_each_element_once_and_dp_average():
    # n = 61 squares summed in two orders (per shard then across groups; all at once): the terms are
    # non-negative, so each sum is within n·u relative whatever the order, each square root within
    # half that plus its own rounding; the two results within (n + 2)·u of each other
    n, u = 2 * 6 * 4 + 2 * 4 + 5, 2.0 ** -24
    rel = (n + 2) * u
    for norm, expected, clipped, after, a, b, unused in run_ranks(_norm_and_average, 8):
        assert norm == pytest.approx(expected, rel=rel) and clipped == pytest.approx(expected, rel=rel)
        assert after == pytest.approx(1.0, rel=1e-5)
        assert a == [0.5] * 10 and b == [5.0] * 9 and unused == [0.0, 0.0]
