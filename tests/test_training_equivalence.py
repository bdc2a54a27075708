"""Every tp / dp / sequence-parallel layout reproduces the single-process run.

Same seed, same global batch, fp32, dropout 0: the losses of 6 iterations and the full
gradients after the first step must match the single-process trainer within 1e-5 relative; so must the
parameters' norm after each step (--log-params-norm), and the count of zero gradient elements
(--log-num-zeros-in-grad) agrees: exactly for the Llama-style model, up to the key bias's rounding noise for
the GPT (_assert_close says why).
The GPT-2 configuration and a Llama-style one (RMSNorm, RoPE, SwiGLU, grouped-query
attention, untied output layer, no biases) run in the same launches.
"""
import io

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.parallel import ParallelContext, Topology
from megareshard.tensor_parallel import gather_full_state_dict
from megareshard.training import Trainer
from tests.harness import run_ranks

ITERS = 6
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def _config(world_size, tp, sp=False, hidden=64, heads=4, llama=False, zero=0):
    argv = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-2", "--min-lr", "1e-3",
            "--lr-warmup-iters", "3", "--clip-grad", "1.0", "--device", "cpu", "--seed", "7",
            "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", str(tp), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--log-params-norm", "--log-num-zeros-in-grad", "--zero-stage", str(zero)]
    return parse_args(argv + (["--sequence-parallel"] if sp else []) + (LLAMA if llama else []), world_size=world_size)


def _run(cfg, ctx):
    trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
    indices = next(trainer._train_iter)
    first = trainer.train_step(trainer._microbatches(trainer.train_data, indices))
    trainer.iteration = 1
    if ctx.world_size == 1:   # the logged count is the zero elements of the clipped gradients the step used
        assert first.num_zeros == sum(int((e.master.grad == 0).sum()) for e in trainer.optimizer.entries)
    trainer.optimizer.materialize_param_grads()  # ZeRO keeps reduced gradients on its shards
    grads = gather_full_state_dict(trainer.model, ctx, grads=True)
    records = trainer.train()
    if ctx.world_size == 1:   # the logged norm is the model's: every parameter once (the tied embedding too)
        direct = torch.stack([p.detach().double().pow(2).sum() for p in trainer.model.parameters()]).sum().sqrt()
        assert records[-1]["params_norm"] == pytest.approx(direct.item(), rel=1e-6)
    return ([first.loss] + [r["loss"] for r in records], first.grad_norm, grads,
            [(first.params_norm, first.num_zeros)] + [(r["params_norm"], r["num_zeros"]) for r in records])


def _layouts(rank, world_size, layouts):
    out, contexts = [], {}
    for tp, sp, *rest in layouts:
        llama, zero = bool(rest and rest[0]), rest[1] if len(rest) > 1 else 0
        if tp not in contexts:
            contexts[tp] = ParallelContext.create(Topology(world_size, tp=tp))
        losses, norm, grads, logged = _run(_config(world_size, tp, sp, llama=bool(llama), zero=zero), contexts[tp])
        out.append((losses, norm, grads if rank == 0 else None, logged))
    return out


@pytest.fixture(scope="module")
def reference():
    return _run(_config(1, 1), ParallelContext.single_process())


@pytest.fixture(scope="module")
def llama_reference():
    return _run(_config(1, 1, llama=True), ParallelContext.single_process())


def _assert_close(ref, got, label):
    ref_losses, ref_norm, ref_grads, ref_logged = ref
    losses, norm, grads, logged = got
    # the zero count: the vocabulary padding's 24 rows × 64 in every layout, plus any key-bias gradient element that
    # came out exactly 0 (GPT: softmax ignores the key bias, so its gradient, 2 layers × 64, is pure rounding noise,
    # which another order of the same sums may round to 0 or not); the Llama-style model has no biases and an untied
    # input embedding, whose rows of the tokens not in the batch are zero too: whole rows, equal in every layout
    zeros, ref_zeros = [z for _, z in logged], [z for _, z in ref_logged]
    if "Llama" in label:
        assert zeros == ref_zeros and all(z % 64 == 0 and z > 24 * 64 for z in zeros), (label, zeros, ref_zeros)
    else:
        assert all(24 * 64 <= z <= 24 * 64 + 2 * 64 and abs(z - r) <= 2 * 64 for z, r in zip(zeros, ref_zeros)), \
            (label, zeros, ref_zeros)
    torch.testing.assert_close(torch.tensor([p for p, _ in logged]), torch.tensor([p for p, _ in ref_logged]),
                               rtol=1e-5, atol=0, msg=label)
    assert len(losses) == len(ref_losses) == ITERS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=label)
    assert norm == pytest.approx(ref_norm, rel=1e-5), label
    assert grads.keys() == ref_grads.keys(), label
    for name, g in ref_grads.items():
        scale = g.abs().max().item()
        err = (grads[name] - g).abs().max().item()
        assert err <= 1e-5 * max(scale, 1e-12), f"{label}: gradient of {name} differs by {err:.3g} (max {scale:.3g})"


def test_loss_falls_in_reference(reference):
    losses = reference[0]
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_tp2_dp2_and_sequence_parallel_on_2_ranks(reference, llama_reference):
    # tp 2; tp 2 + sp; dp 2; dp 2 at ZeRO-3 (norms and counts over the dp shards); then the Llama-style model:
    # tp 2 + sp (one key/value head per rank); dp 2
    layouts = [(2, False), (2, True), (1, False), (1, False, False, 3), (2, True, True), (1, False, True)]
    results = run_ranks(_layouts, 2, layouts, timeout=300)[0]
    for (tp, sp, *rest), got in zip(layouts, results):
        llama = bool(rest and rest[0])
        ref = llama_reference if llama else reference
        _assert_close(ref, got, f"world 2, tp {tp}, sp {sp}{', Llama-style' if llama else ''}"
                                f"{f', ZeRO-{rest[1]}' if len(rest) > 1 else ''}")


@pytest.mark.slow
def test_tp2_x_dp2_on_4_ranks(reference, llama_reference):
    layouts = [(2, False), (2, True), (2, True, True)]
    results = run_ranks(_layouts, 4, layouts, timeout=300, nccl_check=True)[0]
    for (tp, sp, *llama), got in zip(layouts, results):
        ref = llama_reference if llama else reference
        _assert_close(ref, got, f"world 4, tp {tp} × dp 2, sp {sp}{', Llama-style' if llama else ''}")


def _vocab_padding(rank, world_size):
    ctx = ParallelContext.create(Topology(world_size, tp=3))
    cfg = _config(world_size, 3, hidden=48, heads=3)
    trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
    return trainer.model.padded_vocab_size, [r["loss"] for r in trainer.train()]


@pytest.mark.slow
def test_vocab_padding_tp3_same_loss():
    """vocab 1000 is padded to 1152 (a multiple of 128 × tp 3) without changing the loss."""
    ref = Trainer(_config(1, 1, hidden=48, heads=3), ParallelContext.single_process(), torch.device("cpu"),
                  out=io.StringIO())
    assert ref.model.padded_vocab_size == 1024
    ref_losses = [r["loss"] for r in ref.train()]
    padded, losses = run_ranks(_vocab_padding, 3, timeout=300)[0]
    assert padded == 1152
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
