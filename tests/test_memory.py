"""Memory accounting: measured from tensors, ZeRO shrinks state and gradients, MAX over ranks."""
import pytest
import torch

from megareshard.memory import ActivationMeter, MemoryReport, format_report, max_over, memory_report, tensor_bytes
from megareshard.models import GPTModel
from megareshard.optim.zero import ZeroOptimizer
from megareshard.parallel import ParallelContext, Topology
from tests.harness import run_ranks
from tests.test_zero import batches, fwd_bwd, tiny_cfg


def test_tensor_bytes_counts_storages_once():
    a = torch.zeros(10, 4)
    assert tensor_bytes([a, a[2:5], a.view(-1), None]) == 160
    assert tensor_bytes([a, torch.zeros(3, dtype=torch.bfloat16)]) == 166


def test_activation_meter_excludes_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationMeter(exclude=lin.parameters()) as m:
        lin(x).relu().sum()
    # saved: x (input of the linear), the relu output; the weight is excluded
    assert m.peak_bytes == 2 * 4 * 8 * 4
    line = format_report(MemoryReport(params=2 ** 20, activations=2 ** 21), "max over stages")
    assert line.startswith("memory (max over stages): params 1.00 MiB") and "total 3.00 MiB" in line


def _stages(rank, world_size):
    ctx = ParallelContext.create(Topology(world_size))
    out = {}
    for stage in (0, 1, 2):
        model = GPTModel(tiny_cfg(), ctx, seed=3, params_dtype=torch.bfloat16)
        opt = ZeroOptimizer(model.named_parameters(), ctx, stage=stage, lr=1e-3, bucket_bytes=4096)
        for mbs in batches(ctx.dp_rank(), 2):
            opt.zero_grad()
            fwd_bwd(model, mbs)
            opt.finish_grad_sync()
            rep = memory_report(model, opt)       # after the reduction: what the step sees
            opt.step()
        out[stage] = rep
    mine = MemoryReport(params=rank + 1, grads=10 - rank, optimizer=5, activations=rank)
    return out, max_over(mine)


@pytest.mark.slow
def test_zero_memory_per_rank():
    results = run_ranks(_stages, 2, timeout=120)
    for reports, maxed in results:
        r0, r1, r2 = reports[0], reports[1], reports[2]
        assert r0.params == r1.params == r2.params
        # bf16 params: optimizer = fp32 master + 2 moments = 12 B/param, sharded over dp 2 (± padding)
        assert r0.optimizer == pytest.approx(6 * r0.params, rel=0.01)
        assert r1.optimizer == pytest.approx(r0.optimizer / 2, rel=0.1)
        assert r2.optimizer == r1.optimizer
        # grads: stage 0 keeps the reduced fp32 full gradient; stage 1 the bf16 full grads + fp32 shard;
        # stage 2 only the fp32 shard
        assert r0.grads == pytest.approx(2 * r0.params, rel=0.01)
        assert r2.grads == pytest.approx(r0.grads / 2, rel=0.1)
        assert r1.grads == pytest.approx(r0.params + r2.grads, rel=0.01)
        assert maxed == MemoryReport(params=2, grads=10, optimizer=5, activations=1)
