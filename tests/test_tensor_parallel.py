"""Tensor-parallel building blocks against their single-process equivalents.

The multi-rank checks share one 2-rank launch (``_tp2_worker``); each check asserts on
its rank, so a failure shows the rank's traceback.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megareshard.parallel import ParallelContext, Topology
from megareshard.tensor_parallel import (ColumnParallelLinear, RNGStreams, RowParallelLinear, VocabParallelEmbedding,
                                         WeightGradStore, all_gather_dim, copy_to_tp_region,
                                         gather_from_sequence_parallel_region, gather_from_tp_region,
                                         gather_full_tensor, padded_vocab_size, reduce_from_tp_region,
                                         reduce_scatter_to_sequence_parallel_region,
                                         scatter_to_sequence_parallel_region, scatter_to_tp_region,
                                         sync_sequence_parallel_grads, vocab_parallel_cross_entropy)
from tests.harness import run_ranks

RTOL = 1e-5


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the reference's largest magnitude (fp32 sums differ in order across layouts)."""
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


def _ref_linear(inp: int, out: int, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(inp, out)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out, inp, generator=g))
        lin.bias.copy_(torch.randn(out, generator=g))
    return lin


def _load_bias(layer: nn.Module, full_bias: torch.Tensor, ctx: ParallelContext) -> None:
    from megareshard.tensor_parallel import split_dim
    with torch.no_grad():
        b = split_dim(full_bias, ctx, 0) if getattr(layer.bias, "tensor_model_parallel", False) else full_bias
        layer.bias.copy_(b)


def _full_grad(p: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    return gather_full_tensor(p.grad, p, ctx)


# ---- multi-rank checks ---------------------------------------------------------------------
def _check_linear_pair(ctx: ParallelContext, sequence_parallel: bool) -> None:
    """x -> ColumnParallel(h->f) -> RowParallel(f->h) equals two nn.Linear, values and grads."""
    s, b, h, f = 8, 3, 12, 20
    ref1, ref2 = _ref_linear(h, f, 1), _ref_linear(f, h, 2)
    col = ColumnParallelLinear(h, f, ctx, sequence_parallel=sequence_parallel,
                               init_method=lambda shape: ref1.weight.detach().clone())
    row = RowParallelLinear(f, h, ctx, sequence_parallel=sequence_parallel,
                            init_method=lambda shape: ref2.weight.detach().clone())
    _load_bias(col, ref1.bias.detach(), ctx)
    _load_bias(row, ref2.bias.detach(), ctx)
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(s, b, h, generator=torch.Generator().manual_seed(4))

    x_ref = x.clone().requires_grad_()
    y_ref = ref2(F.gelu(ref1(x_ref)))
    y_ref.backward(dy)

    x_loc = x.clone().requires_grad_()
    x_in = scatter_to_sequence_parallel_region(x_loc, ctx) if sequence_parallel else x_loc
    y = row(F.gelu(col(x_in)))
    y_full = gather_from_sequence_parallel_region(y, ctx, tensor_parallel_output_grad=False) \
        if sequence_parallel else y
    _close(y_full, y_ref)
    y_full.backward(dy)
    if sequence_parallel:
        assert row.bias.sequence_parallel == (ctx.tp_size > 1) and not col.bias.sequence_parallel
        sync_sequence_parallel_grads(nn.ModuleList([col, row]), ctx)
    # without sp the gradient of a replicated input is complete on every rank (copy_to all-reduces it)
    _close(x_loc.grad, x_ref.grad)
    for mine, ref in ((col.weight, ref1.weight), (col.bias, ref1.bias), (row.weight, ref2.weight),
                      (row.bias, ref2.bias)):
        _close(_full_grad(mine, ctx), ref.grad)
    assert col.weight.partition_dim == 0 and row.weight.partition_dim == 1 and row.bias.partition_dim == -1


def _check_gather_output(ctx: ParallelContext) -> None:
    ref = _ref_linear(6, 10, 5)
    col = ColumnParallelLinear(6, 10, ctx, gather_output=True, init_method=lambda shape: ref.weight.detach().clone())
    _load_bias(col, ref.bias.detach(), ctx)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(6))
    _close(col(x), ref(x))
    col(x).sum().backward()
    ref(x).sum().backward()
    _close(_full_grad(col.weight, ctx), ref.weight.grad)
    # row-parallel with a full input (split inside)
    row = RowParallelLinear(6, 10, ctx, input_is_parallel=False, init_method=lambda shape: ref.weight.detach().clone())
    _load_bias(row, ref.bias.detach(), ctx)
    _close(row(x), ref(x))


def _check_wgrad_store(ctx: ParallelContext) -> None:
    def build():
        col = ColumnParallelLinear(8, 16, ctx, init_method=lambda shape: torch.ones(shape) * 0.1)
        row = RowParallelLinear(16, 8, ctx, init_method=lambda shape: torch.arange(128.0).view(shape) / 100)
        return col, row
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(9))
    plain = build()
    for _ in range(2):                       # two microbatches: accumulation into .grad
        plain[1](plain[0](x)).pow(2).sum().backward()
    delayed = build()
    store = WeightGradStore()
    for layer in delayed:
        layer.wgrad_store = store
    for _ in range(2):
        delayed[1](delayed[0](x)).pow(2).sum().backward()
    assert delayed[0].weight.grad is None and delayed[1].weight.grad is None and len(store) == 4
    assert delayed[1].bias.grad is not None    # row bias: added after the reduction, never delayed
    assert store.flush() == 4 and len(store) == 0
    for a, b in zip(plain, delayed):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad)


def _check_embedding_and_ce(ctx: ParallelContext) -> None:
    vocab, h = 250, 6
    padded = padded_vocab_size(vocab, 4, ctx.tp_size)                       # 256: 6 padding rows
    full = torch.randn(vocab, h, generator=torch.Generator().manual_seed(11))
    emb = VocabParallelEmbedding(vocab, h, ctx, padded_num_embeddings=padded, init_method=lambda shape: full.clone())
    tokens = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(12))
    out = emb(tokens)
    _close(out, F.embedding(tokens, full))
    out.sum().backward()
    ref_w = full.clone().requires_grad_()
    F.embedding(tokens, ref_w).sum().backward()
    _close(_full_grad(emb.weight, ctx), ref_w.grad)

    # cross-entropy over a vocab shard with padding columns full of junk
    logits_full = torch.randn(3, 7, padded, generator=torch.Generator().manual_seed(13)) * 5
    logits_full[..., vocab:] = 50.0                                            # must be ignored
    labels = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(14))
    shard = scatter_to_tp_region(logits_full.clone(), ctx).detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, ctx, vocab_size=vocab)
    ref_logits = logits_full[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(3, 7)
    assert loss.dtype == torch.float32
    _close(loss, ref)
    w = torch.rand(3, 7, generator=torch.Generator().manual_seed(15))
    (loss * w).sum().backward()
    (ref * w).sum().backward()
    g = all_gather_dim(shard.grad, ctx, -1)
    _close(g[..., :vocab], ref_logits.grad)
    assert torch.count_nonzero(g[..., vocab:]) == 0
    # bf16 logits: loss still fp32, gradient in bf16
    shard16 = shard.detach().bfloat16().requires_grad_()
    loss16 = vocab_parallel_cross_entropy(shard16, labels, ctx, vocab_size=vocab)
    assert loss16.dtype == torch.float32
    loss16.sum().backward()
    assert shard16.grad.dtype == torch.bfloat16


def _check_mappings(ctx: ParallelContext) -> None:
    """Forward values and gradients of every mapping, from rank-dependent inputs."""
    import torch.distributed as dist
    r, tp = ctx.tp_rank(), ctx.tp_size
    gen = torch.Generator().manual_seed(100 + r)

    def gathered(t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=ctx.tp_group)
        return parts

    # general collectives: the backward is the adjoint, sum_r <f(x)_r, dy_r> = sum_r <x_r, grad_r>
    for fn in (gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region):
        x = torch.randn(4, 3, 6, generator=gen, dtype=torch.float64).requires_grad_()
        y = fn(x, ctx)
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        y.backward(dy)
        dots = torch.stack([(y.detach() * dy).sum(), (x.detach() * x.grad).sum()])
        dist.all_reduce(dots, group=ctx.tp_group)
        assert torch.allclose(dots[0], dots[1], rtol=1e-10), (fn.__name__, dots.tolist())
    x = torch.randn(4, 3, 6, generator=gen).requires_grad_()
    y = gather_from_sequence_parallel_region(x, ctx)
    assert torch.equal(y, torch.cat(gathered(x.detach()), 0))
    y = reduce_scatter_to_sequence_parallel_region(x, ctx)
    torch.testing.assert_close(y, sum(gathered(x.detach()))[r * 2:(r + 1) * 2])

    # leaving a tp region: output replicated, so its gradient is the same on every rank
    dy = torch.arange(72.0).view(4, 3, 6)
    x = torch.randn(4, 3, 6, generator=gen).requires_grad_()
    y = reduce_from_tp_region(x, ctx)
    torch.testing.assert_close(y, sum(gathered(x.detach())))
    y.backward(dy)
    assert torch.equal(x.grad, dy)
    x = torch.randn(4, 3, 3, generator=gen).requires_grad_()
    y = gather_from_tp_region(x, ctx)
    assert torch.equal(y, torch.cat(gathered(x.detach()), -1))
    y.backward(dy)
    assert torch.equal(x.grad, dy[..., r * 3:(r + 1) * 3])
    # entering a tp region: input replicated, the partial gradients are summed / gathered
    x = torch.ones(4, 3, 6, requires_grad=True)
    copy_to_tp_region(x, ctx).backward(torch.full((4, 3, 6), float(r + 1)))
    assert torch.equal(x.grad, torch.full((4, 3, 6), float(sum(range(1, tp + 1)))))
    x = torch.arange(72.0).view(4, 3, 6).requires_grad_()
    y = scatter_to_tp_region(x, ctx)
    assert torch.equal(y, x.detach()[..., r * 3:(r + 1) * 3])
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    assert torch.equal(x.grad, torch.cat(gathered(g), -1))
    x = torch.arange(24.0).view(4, 1, 6).requires_grad_()
    y = scatter_to_sequence_parallel_region(x, ctx)
    assert torch.equal(y, x.detach()[r * 2:(r + 1) * 2])
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    assert torch.equal(x.grad, torch.cat(gathered(g), 0))


def _check_rng(ctx: ParallelContext) -> None:
    import torch.distributed as dist
    streams = RNGStreams.for_context(42, ctx)
    before = torch.get_rng_state()
    with streams.fork("default"):
        d = torch.rand(8)
    with streams.fork("model-parallel"):
        m = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), before)              # global RNG untouched
    ds, ms = [torch.empty(8) for _ in range(2)], [torch.empty(8) for _ in range(2)]
    dist.all_gather(ds, d, group=ctx.tp_group)
    dist.all_gather(ms, m, group=ctx.tp_group)
    assert torch.equal(ds[0], ds[1]) and not torch.equal(ms[0], ms[1])


def _tp2_worker(rank: int, world_size: int) -> str:
    ctx = ParallelContext.create(Topology(world_size=world_size, tp=2))
    torch.manual_seed(rank)  # the layers must not depend on the global RNG
    _check_linear_pair(ctx, sequence_parallel=False)
    _check_linear_pair(ctx, sequence_parallel=True)
    _check_gather_output(ctx)
    _check_wgrad_store(ctx)
    _check_embedding_and_ce(ctx)
    _check_mappings(ctx)
    _check_rng(ctx)
    return "ok"


def test_tp2_layers_mappings_ce_rng():
    assert run_ranks(_tp2_worker, 2, timeout=120) == ["ok", "ok"]


# ---- single process (tp 1: no torch.distributed) ---------------------------------------------
def test_tp1_layers_need_no_process_group():
    import torch.distributed as dist
    assert not dist.is_initialized()
    ctx = ParallelContext.single_process()
    _check_linear_pair(ctx, sequence_parallel=False)
    _check_linear_pair(ctx, sequence_parallel=True)     # sequence parallel is a no-op at tp 1
    _check_gather_output(ctx)
    _check_wgrad_store(ctx)
    _check_embedding_and_ce(ctx)


def test_weight_grad_store_fifo():
    store, seen = WeightGradStore(), []
    for i in range(3):
        store.put(lambda i=i: seen.append(i))
    assert len(store) == 3 and store.flush() == 3 and seen == [0, 1, 2] and len(store) == 0


@pytest.mark.parametrize("vocab, div, tp, padded", [(1000, 128, 3, 1152), (1000, 128, 1, 1024), (1024, 128, 2, 1024),
                                                    (50257, 128, 8, 51200), (7, 1, 1, 7)])
def test_padded_vocab_size(vocab, div, tp, padded, caplog):
    with caplog.at_level(logging.INFO, logger="megareshard"):
        assert padded_vocab_size(vocab, div, tp) == padded
    if padded != vocab:
        assert f"padded vocab {vocab} -> {padded} (multiple of {div} × tp {tp})" in caplog.text
    else:
        assert "padded vocab" not in caplog.text


def test_rng_streams_per_tp_rank_and_checkpointable():
    a, b = RNGStreams(5, tp_rank=0), RNGStreams(5, tp_rank=1)
    with a.fork("default"):
        da = torch.rand(4)
    with b.fork("default"):
        db = torch.rand(4)
    with a.fork("model-parallel"):
        ma = torch.rand(4)
    with b.fork("model-parallel"):
        mb = torch.rand(4)
    assert torch.equal(da, db) and not torch.equal(ma, mb)
    state = a.state_dict()
    with a.fork("model-parallel"):
        x = F.dropout(torch.ones(100), 0.5)
    with a.fork("model-parallel"):
        assert not torch.equal(F.dropout(torch.ones(100), 0.5), x)   # the stream advanced
    a.load_state_dict(state)
    with a.fork("model-parallel"):
        assert torch.equal(F.dropout(torch.ones(100), 0.5), x)       # replay (recomputation)
    with pytest.raises(KeyError, match="unknown RNG stream 'nope'"):
        with a.fork("nope"):
            pass


def test_layer_shape_errors_name_numbers():
    ctx = ParallelContext(topology=Topology(world_size=4, tp=4), rank=1)   # no groups needed to fail
    with pytest.raises(ValueError, match="output size 10 is not divisible by tensor-parallel size 4"):
        ColumnParallelLinear(6, 10, ctx)
    with pytest.raises(ValueError, match="input size 6 is not divisible by tensor-parallel size 4"):
        RowParallelLinear(6, 8, ctx)
    with pytest.raises(ValueError, match="padded vocabulary 250"):
        VocabParallelEmbedding(250, 4, ctx)
