"""Activation recomputation: same losses and gradients (dropout on), less activation memory."""
import pytest
import torch

from megareshard.arguments import ConfigError, ModelConfig
from megareshard.memory import ActivationMeter
from megareshard.models import GPTModel
from megareshard.parallel import ParallelContext, Topology
from tests.harness import run_ranks


def _cfg():
    return ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=32,
                       vocab_size=64, make_vocab_size_divisible_by=1, hidden_dropout=0.1, attention_dropout=0.1)


def _run(ctx, granularity, num_layers=None, steps=2, sp=False):
    """Two iterations (so the RNG streams advance between them); losses, grads, activation bytes."""
    model = GPTModel(_cfg(), ctx, seed=5, recompute_granularity=granularity, recompute_num_layers=num_layers,
                     sequence_parallel=sp)
    g = torch.Generator().manual_seed(11)
    losses, grads, act = [], None, 0
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 33), generator=g)
        model.zero_grad(set_to_none=True)
        with ActivationMeter(exclude=model.parameters()) as meter:
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
        act = meter.peak_bytes
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads, act


def _assert_same(a, b, label):
    assert a[0] == b[0], label              # bitwise: the same computation replayed
    for n in a[1]:
        torch.testing.assert_close(b[1][n], a[1][n], rtol=1e-6, atol=1e-7, msg=f"{label}: {n}")


def test_recompute_single_process():
    ctx = ParallelContext.single_process()
    base = _run(ctx, None)
    # dropout really is on: another seed of the streams gives other losses
    selective = _run(ctx, "selective")
    full_all = _run(ctx, "full")
    full_one = _run(ctx, "full", 1)
    _assert_same(base, selective, "selective")
    _assert_same(base, full_all, "full")
    _assert_same(base, full_one, "full, 1 layer")
    # activation memory measured by the accounting: full < selective < none; 1 layer in between
    assert full_all[2] < full_one[2] < base[2]
    assert selective[2] < base[2]
    # dropout is on: eval mode (no dropout) gives a different loss
    model = GPTModel(_cfg(), ctx, seed=5).eval()
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        assert model(tokens[:, :-1], labels=tokens[:, 1:]).mean().item() != base[0][0]


def test_recompute_bad_options():
    ctx = ParallelContext.single_process()
    with pytest.raises(ConfigError):
        GPTModel(_cfg(), ctx, recompute_granularity="block")


def _tp(rank, world_size):
    ctx = ParallelContext.create(Topology(world_size, tp=world_size))
    out = []
    for sp in (False, True):
        base = _run(ctx, None, sp=sp)
        for gran in ("selective", "full"):
            got = _run(ctx, gran, sp=sp)
            _assert_same(base, got, f"tp2 sp={sp} {gran}")
            out.append(got[2] < base[2])
    return out


@pytest.mark.slow
def test_recompute_tensor_parallel():
    assert all(all(r) for r in run_ranks(_tp, 2, timeout=120))
