"""The GPU fast path, checked on CPU: regional compilation (--torch-compile), the fused cross-entropy
(--cross-entropy-loss-fusion), Megatron's fusion switches, --attention-backend, the optimizer's kernel.

On CPU the compiled runs use torch.compile's ``aot_eager`` backend: the same dynamo graphs, graph breaks,
AOTAutograd forward/backward split, saved tensors and recomputation as inductor, with PyTorch's own kernels
(inductor compiling C++ on 2 cores takes minutes per graph; lab/bench/gpu_checks.py runs the inductor variants
on CUDA). The arithmetic is then the eager run's up to the order in which a few gradient contributions are
summed (a traced linear's backward, a tensor used twice), so compiled and eager runs are compared with the
bounds of tests/tolerances.py, which cover exactly that (on this machine they agree bitwise).

One 4-rank launch (NCCL's rules checked) trains two configurations, each eagerly and compiled (every rank compiles
its own graphs, so ranks beyond the four a property needs cost the suite compile time for nothing). On tp 2 · pp 2:
zbv (virtual stages, delayed weight gradients: the linear layers stay outside the compiled regions) with selective
recomputation, sequence parallelism, the fused cross-entropy and the Llama-style options; the same launch checks the
fused cross-entropy on tp-2 vocabulary shards. On tp 2 · dp 2: the linear layers compiled between the
tensor-parallel collectives, with ZeRO 2 (its gradient hooks fire on what the compiled backward produced), full
recomputation and dropout (drawn eagerly from the RNG streams, so the masks are the eager run's).
"""
from __future__ import annotations

import io
import math

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.compile_config import CompileOptions, TorchCompileError
from megareshard.models.gpt import GPTModel
from megareshard.optim.zero import adamw_kind
from megareshard.parallel import ParallelContext, Topology
from megareshard.tensor_parallel import gather_full_state_dict, vocab_parallel_cross_entropy
from megareshard.tensor_parallel.fused_cross_entropy import (compiled_kernels, fused_vocab_parallel_cross_entropy)
from megareshard.training import Trainer
from tests.harness import run_ranks
from tests.tolerances import U, element_error_bounds

ITERS = 2
LR = 3e-3
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
WORLD = 4  # one launch trains every configuration (each on its own layout of the 4 ranks)
CONFIGS = {  # name: (tp, pp, flags)
    "zbv (delayed W), selective recomputation, sp, fused CE, Llama-style":
        (2, 2, ["--pipeline-schedule", "zbv", "--recompute-activations", "--sequence-parallel",
                "--cross-entropy-loss-fusion", *LLAMA]),
    "linear layers compiled, ZeRO 2, full recomputation, dropout":
        (2, 1, ["--zero-stage", "2", "--recompute-granularity", "full",
                "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]),
}
COMPILED = ["--torch-compile", "--torch-compile-backend", "aot_eager"]


def _argv(tp: int, pp: int, extra: list[str]) -> list[str]:
    return ["--mock-data", "--vocab-size", "250", "--num-layers", "4", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(ITERS), "--lr", str(LR), "--min-lr", "3e-4", "--lr-warmup-iters", "1",
            "--device", "cpu", "--seed", "5", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--hidden-dropout", "0", "--attention-dropout", "0", *extra]


def _train(world: int, tp: int, pp: int, extra: list[str]):
    cfg = parse_args(_argv(tp, pp, extra), world_size=world)
    ctx = ParallelContext.create(Topology(world, tp=cfg.tp, pp=cfg.pp))
    out = io.StringIO()
    trainer = Trainer(cfg, ctx, torch.device("cpu"), out=out)
    records = trainer.train()
    params = gather_full_state_dict(trainer.model, trainer.ctx)
    regions = list(trainer.compiled_regions)
    trainer.release_communicators()
    return ([r["loss"] for r in records], [(r["lr"], r["grad_norm"]) for r in records], params, regions,
            out.getvalue())


def _ce_on_tp_shards(rank: int, ctx: ParallelContext) -> list[float]:
    """Fused vs unfused cross-entropy on this rank's vocabulary shard (tp 2, padded vocabulary): the largest
    differences of the loss and of the full logits' gradient, relative to their scales."""
    gen = torch.Generator().manual_seed(3)
    vocab, padded, tokens = 250, 256, (7, 3)
    full = torch.randn(*tokens, padded, generator=gen) * 3
    full[..., vocab:] = 0.0  # padding columns (zero embedding rows)
    labels = torch.randint(0, vocab, tokens, generator=gen)
    weights = torch.rand(*tokens, generator=gen)
    tp_rank, per = ctx.tp_rank(), padded // ctx.tp_size
    out = []
    for chunk in (4, 21):  # 21 tokens: chunks of 4 leave a 1-token tail, 21 is one chunk
        grads = []
        losses = []
        for fused in (False, True):
            shard = full[..., tp_rank * per:(tp_rank + 1) * per].clone().requires_grad_(True)
            if fused:
                loss = fused_vocab_parallel_cross_entropy(shard, labels, ctx, vocab, chunk_tokens=chunk)
            else:
                loss = vocab_parallel_cross_entropy(shard, labels, ctx, vocab)
            (loss * weights).sum().backward()
            losses.append(loss.detach())
            grads.append(shard.grad)
        out.append(((losses[1] - losses[0]).abs().max() / losses[0].abs().max()).item())
        out.append(((grads[1] - grads[0]).abs().max() / grads[0].abs().max()).item())
    return out


def _launch(rank: int, world: int):
    ctx = ParallelContext.create(Topology(world, tp=2, pp=2))
    ce = _ce_on_tp_shards(rank, ctx)
    ctx.destroy()
    runs = {}
    for name, (tp, pp, extra) in CONFIGS.items():
        eager = _train(world, tp, pp, extra)
        compiled = _train(world, tp, pp, extra + COMPILED)
        runs[name] = (eager[:3], compiled[:4])
    return ce, runs


@pytest.fixture(scope="module")
def launch():
    """Per-rank (ce, runs) of the launch."""
    return run_ranks(_launch, WORLD, timeout=900, nccl_check=True)


def _assert_close_runs(eager, compiled, label):
    """Compiled within the bounds of tests/tolerances.py of eager (see test_zero_trainer.py for the derivation)."""
    (ref_losses, steps, ref_params), (losses, _, params, regions) = eager, compiled
    assert regions, f"{label}: nothing was compiled"
    bounds = element_error_bounds([lr for lr, _ in steps], (0.9, 0.999))
    n_params = sum(p.numel() for p in ref_params.values())
    assert len(losses) == len(ref_losses) == ITERS
    for t, (loss, ref) in enumerate(zip(losses, ref_losses)):
        tol = 2 * steps[t][1] * math.sqrt(n_params) * bounds[t] + 4 * U * abs(ref)
        assert abs(loss - ref) <= tol, (label, t, loss, ref, tol)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        if name.endswith("attention.qkv.bias"):  # rounding noise that Adam turns into ±lr steps
            assert (params[name] - ref).abs().max() <= 2 * LR * ITERS, (label, name)
            continue
        err = (params[name] - ref).norm().item()
        assert err <= math.sqrt(ref.numel()) * bounds[-1], f"{label}: {name} differs by {err:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_reproduces_eager_on_4_ranks(launch, name):
    for rank, (_, runs) in enumerate(launch):
        eager, compiled = runs[name]
        _assert_close_runs(eager, compiled, f"rank {rank}, {name}")


@pytest.mark.slow
def test_fused_cross_entropy_on_tp_shards(launch):
    for rank, (ce, _) in enumerate(launch):
        # the same operations per element as the unfused version: a few roundings of fp32 apart at most
        assert max(ce) <= 16 * U, (rank, ce)


# ---- one process ------------------------------------------------------------------------------------
def _ce_pair(logits, labels, vocab, weights, **fused_kw):
    out = []
    for fused in (False, True):
        x = logits.detach().clone().requires_grad_(True)
        ctx = ParallelContext.single_process()
        loss = (fused_vocab_parallel_cross_entropy(x, labels, ctx, vocab, **fused_kw) if fused
                else vocab_parallel_cross_entropy(x, labels, ctx, vocab))
        (loss * weights).sum().backward()
        out.append((loss.detach(), x.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 18, 1000])
def test_fused_cross_entropy_equals_unfused(dtype, chunk):
    """18 tokens in chunks of 1, 5 (a 3-token tail), 18 and more; vocabulary 100 padded to 128."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 3, 128, generator=gen) * 4)
    logits[..., 100:] = 0.0
    logits = logits.to(dtype)
    labels = torch.randint(0, 100, (6, 3), generator=gen)
    weights = torch.rand(6, 3, generator=gen)
    (l0, g0), (l1, g1) = _ce_pair(logits, labels, 100, weights, chunk_tokens=chunk)
    assert l1.dtype == torch.float32 and g1.dtype == dtype and l1.shape == labels.shape
    # per element the same fp32 operations: the loss within a few roundings of log(sum(exp)); the gradients
    # within a few roundings of softmax, and (bf16) one rounding of the result
    assert (l1 - l0).abs().max() <= 8 * U * (1 + l0.abs().max())
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 8 * U
    assert ((g1.float() - g0.float()).abs() <= ulp * g0.float().abs() + 8 * U * weights.max()).all()
    assert (g1[..., 100:] == 0).all()  # padding columns get no gradient


def test_fused_cross_entropy_compiled_kernels():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 2, 70, generator=gen)
    labels = torch.randint(0, 64, (5, 2), generator=gen)
    (l0, g0), (l1, g1) = _ce_pair(logits, labels, 64, torch.ones(5, 2),
                                  chunk_tokens=4, kernels=compiled_kernels("aot_eager"))
    torch.testing.assert_close(l1, l0, rtol=0, atol=8 * U * (1 + l0.abs().max().item()))
    torch.testing.assert_close(g1, g0, rtol=8 * U, atol=8 * U)


def test_fused_cross_entropy_fusing_kernels_take_the_whole_input_in_one_call(monkeypatch):
    """Kernels that keep their fp32 values inside (inductor: ``fuses``) get the whole input as one chunk, and the
    backward returns their gradient itself; explicit chunk_tokens still chunk; results equal the unfused ones."""
    from megareshard.tensor_parallel.fused_cross_entropy import CrossEntropyKernels, _grad, _stats
    calls, outs = [], []

    def stats(rows, *a):
        calls.append(("stats", rows.size(0)))
        return _stats(rows, *a)

    def grad(rows, *a):
        calls.append(("grad", rows.size(0)))
        g = _grad(rows, *a)
        outs.append(g.data_ptr())
        return g
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 3, 70, generator=gen)
    labels = torch.randint(0, 64, (7, 3), generator=gen)
    from megareshard.tensor_parallel import fused_cross_entropy as fce
    monkeypatch.setattr(fce, "chunk_tokens_for", lambda local_vocab: 4)   # as if 4 tokens filled DEFAULT_CHUNK_BYTES
    _ce_pair(logits, labels, 64, torch.ones(7, 3), kernels=CrossEntropyKernels(stats, grad, "spy"))
    assert calls == [("stats", 4)] * 5 + [("stats", 1)] + [("grad", 4)] * 5 + [("grad", 1)]
    calls.clear()
    kernels = CrossEntropyKernels(stats, grad, "spy", fuses=True)
    (l0, g0), (l1, g1) = _ce_pair(logits, labels, 64, torch.ones(7, 3), kernels=kernels)
    assert calls == [("stats", 21), ("grad", 21)]
    x, arrived = logits.clone().requires_grad_(True), []
    x.register_hook(lambda g: arrived.append(g.data_ptr()))
    fused_vocab_parallel_cross_entropy(x, labels, ParallelContext.single_process(), 64, kernels=kernels).sum().backward()
    assert arrived == [outs[-1]]          # the kernel's gradient itself: no copy into a buffer of the logits' size
    torch.testing.assert_close(l1, l0, rtol=0, atol=8 * U * (1 + l0.abs().max().item()))
    torch.testing.assert_close(g1, g0, rtol=8 * U, atol=8 * U)
    calls.clear()
    _ce_pair(logits, labels, 64, torch.ones(7, 3), kernels=kernels, chunk_tokens=8)
    assert calls == [("stats", 8), ("stats", 8), ("stats", 5), ("grad", 8), ("grad", 8), ("grad", 5)]
    assert compiled_kernels("inductor").fuses and not compiled_kernels("aot_eager").fuses   # compiled lazily


def _gpt(extra=(), **model_kw):
    cfg = parse_args(_argv(1, 1, list(extra)), world_size=1)
    return GPTModel(cfg.model, ParallelContext.single_process(), seed=9, **model_kw), cfg


def test_compiled_model_keeps_names_and_matches_eager_in_one_process():
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(2))
    results = []
    for compiled in (False, True):
        model, _ = _gpt(LLAMA + ["--cross-entropy-loss-fusion"])
        names = list(model.state_dict())
        if compiled:
            regions = model.compile_regions(CompileOptions("aot_eager"))
            assert regions == ["layers.0", "layers.1", "layers.2", "layers.3", "head", "cross-entropy chunks"]
        assert list(model.state_dict()) == names and not any("_orig_mod" in n for n in names)
        loss = model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert abs(l1 - l0) <= 8 * U * abs(l0)
    for name, g in g0.items():  # one backward: its gradient sums reassociated at most (tests/tolerances.py)
        assert (g1[name] - g).abs().max() <= 128 * U * g.abs().max() + 1e-30, name


def test_traced_linears_refuse_a_weight_gradient_store():
    from megareshard.tensor_parallel import WeightGradStore

    model, _ = _gpt()
    model.compile_regions(CompileOptions("aot_eager", traceable_linears=True))
    model.set_wgrad_store(None)
    with pytest.raises(RuntimeError, match="no weight gradient can be delayed"):
        model.set_wgrad_store(WeightGradStore())
    model, _ = _gpt()
    model.compile_regions(CompileOptions("aot_eager", traceable_linears=False))
    model.set_wgrad_store(WeightGradStore())  # delayable: the linear layers stay outside the regions


def test_compile_failure_names_the_region_and_the_way_out():
    def failing_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    model, _ = _gpt()
    model.compile_regions(CompileOptions(failing_backend))
    tokens = torch.randint(0, 250, (2, 17))
    with pytest.raises(TorchCompileError) as e:
        model(tokens=tokens[:, :-1], labels=tokens[:, 1:])
    msg = str(e.value)
    assert "layers.0" in msg and "--no-torch-compile" in msg and "failing_backend" in msg and "\n" not in msg


def test_compile_failure_is_one_line_from_the_entry_point(capsys):
    import torch._dynamo
    from megareshard.entry import run_entry_point
    from megareshard.training import pretrain

    @torch._dynamo.register_backend(name="megareshard_test_failing")
    def _failing(gm, example_inputs):  # noqa: ARG001
        raise RuntimeError("no kernels today")

    argv = _argv(1, 1, ["--torch-compile", "--torch-compile-backend", "megareshard_test_failing", "--train-iters", "1"])
    rc = run_entry_point("pretrain_gpt.py", lambda: pretrain(parse_args(argv, world_size=1), out=io.StringIO()))
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "layers.0" in err and "--no-torch-compile" in err, err


@pytest.mark.parametrize("extra, message", [
    (["--no-bias-swiglu-fusion"], "--no-bias-swiglu-fusion needs a SwiGLU MLP"),
    (["--no-rope-fusion"], "--no-rope-fusion needs rotary embeddings"),
    (["--use-flash-attn", "--attention-backend", "unfused"], "conflict"),
    (["--cross-entropy-fusion-impl", "te"], "--cross-entropy-fusion-impl te"),
    (["--torch-compile-backend", "no-such-backend"], "is not a torch.compile backend"),
    (["--torch-compile-backend", "aot_eager", "--torch-compile-mode", "max-autotune-no-cudagraphs"], "needs --torch-compile-backend"),
    (["--torch-compile-mode", "reduce-overhead"], "reduce-overhead cannot train here"),
    (["--torch-compile", "--torch-compile-mode", "max-autotune"], "max-autotune cannot train here: it turns on"),
])
def test_bad_fast_path_flags_are_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_args(_argv(1, 1, extra), world_size=1)
    assert "\n" not in str(e.value)


def test_megatron_fusion_flags_take_effect():
    cfg = parse_args(_argv(1, 1, ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--cross-entropy-loss-fusion",
                               "--use-flash-attn"]), world_size=1)
    m = cfg.model
    assert (m.bias_gelu_fusion, m.bias_dropout_fusion, m.cross_entropy_loss_fusion, m.attention_backend) == \
        (False, False, True, "flash")
    assert not any(n.startswith(("--no-bias-gelu-fusion", "--cross-entropy-loss-fusion")) for n in cfg.notes)
    assert "--use-flash-attn (runs as --attention-backend flash)" in cfg.notes
    # switches Megatron-LM's own scripts pass where they change nothing run, named as such
    notes = parse_args(_argv(1, 1, LLAMA + ["--no-bias-gelu-fusion", "--attention-backend", "flash",
                                         "--no-masked-softmax-fusion"]), world_size=1).notes
    assert [n.split(" ")[0] for n in notes] == ["--no-bias-gelu-fusion", "--no-masked-softmax-fusion"], notes
    assert parse_args(_argv(1, 1, []), world_size=1).compile.torch_compile is None  # decided by the device
    assert parse_args(_argv(1, 1, ["--no-torch-compile"]), world_size=1).compile.torch_compile is False


@pytest.mark.parametrize("flags", [[], ["--no-bias-gelu-fusion"], LLAMA + ["--no-bias-swiglu-fusion"],
                                   ["--attention-backend", "unfused", "--no-masked-softmax-fusion"]])
def test_a_fusion_switched_off_runs_outside_the_compiled_layer(flags):
    """A compiled layer is one graph; a chain whose fusion is off splits it where the chain runs op by op (into
    more graphs than two: a break inside a submodule's forward also splits at the submodule's call)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, _ = _gpt(flags + ["--num-layers", "1"])
    model.compile_regions(CompileOptions("aot_eager"))
    tokens = torch.randint(0, 250, (2, 17))
    model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    layer_graphs = counters["stats"]["unique_graphs"] - 1  # less the loss head's
    assert layer_graphs == 1 if not flags or flags == LLAMA else layer_graphs >= 2, dict(counters["stats"])


def test_attention_backends_on_cpu():
    from megareshard.models.fusion import choose_attention_kernel

    shape, cpu = (2, 4, 2, 16, 8), torch.device("cpu")
    assert choose_attention_kernel("auto", shape=shape, dtype=torch.float32, device=cpu, dropout_p=0.1)[0] == "sdpa"
    assert choose_attention_kernel("local", shape=shape, dtype=torch.float32, device=cpu, dropout_p=0.1)[0] == "unfused"
    assert choose_attention_kernel("flash", shape=shape, dtype=torch.float32, device=cpu, dropout_p=0.0)[0] == "flash"
    with pytest.raises(ConfigError, match="--attention-backend flash cannot run .* dropout 0.1"):
        choose_attention_kernel("flash", shape=shape, dtype=torch.float32, device=cpu, dropout_p=0.1)
    with pytest.raises(ConfigError, match="--attention-backend fused is cuDNN's fused attention, which needs CUDA"):
        choose_attention_kernel("fused", shape=shape, dtype=torch.float32, device=cpu, dropout_p=0.0)


def test_a_kernel_that_computes_wrong_attention_is_not_used(monkeypatch):
    """auto (and an explicit choice on CUDA) checks each kernel against softmax(QKᵀ/√d)V in fp32 first."""
    from megareshard.models import fusion

    right = fusion.attention

    def wrong_flash(q, k, v, *, kernel, **kw):
        out = right(q, k, v, kernel=kernel, **kw)
        return out * 1.5 if kernel == "flash" else out
    monkeypatch.setattr(fusion, "attention", wrong_flash)
    q, k, v = fusion._probe_inputs((2, 4, 2, 16, 8), torch.float32, torch.device("cpu"))
    assert fusion._disagreement("sdpa", q, k, v) is None
    assert "its output differs from softmax(QKᵀ/√d)V in fp32" in fusion._disagreement("flash", q, k, v)


@pytest.mark.parametrize("backend", ["flash", "unfused", "local"])
def test_attention_backends_train_like_auto(backend):
    """Every backend CPU can run computes the same loss and gradients as PyTorch's own choice."""
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(4))
    out = []
    for b in ("auto", backend):
        model, _ = _gpt(["--attention-backend", b] + LLAMA)
        model.configure_attention(2)
        loss = model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        out.append((loss.item(), model.layers["0"].attention.qkv.weight.grad))
    (l0, g0), (l1, g1) = out
    assert abs(l1 - l0) <= 1e-5 * abs(l0)  # softmax over 16 keys summed in another order: fp32 roundings
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)


def test_optimizer_kernel_choice():
    assert (adamw_kind(True, True), adamw_kind(True, False), adamw_kind(False, False)) == ("apex", "fused", "foreach")
    model, cfg = _gpt()
    from megareshard.optim.zero import build_zero_optimizer

    for zero in (0, 1, 2):
        cfg.memory.zero_stage = zero
        opt = build_zero_optimizer(model, ParallelContext.single_process(), cfg.training, cfg.memory,
                                   use_apex=False)
        assert opt.kind == "foreach" and opt.inner.defaults["foreach"] is True and not opt.inner.defaults["fused"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: inductor's generated GPU kernels (lab/bench/gpu_checks.py "
                                                          "runs this on the lent GPU)")
@pytest.mark.parametrize("llama", [False, True])
def test_inductor_on_cuda_matches_eager(llama):
    """The compiled path with inductor (Triton kernels, the fused cross-entropy's compiled chunks, the attention
    kernel measured by auto) against eager on the GPU, fp32, one step and its gradients. Inductor fuses and
    reorders: its LayerNorm/softmax reductions sum over at most h = 64 or s = 16 terms in another order and its
    fused element-wise chains round once instead of per op, a few times 64u per activation, which a 4-layer
    forward and its backward amplify by less than 100: 1e-4 of each tensor's scale."""
    cuda = torch.device("cuda")
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(6)).to(cuda)
    extra = (LLAMA if llama else []) + ["--cross-entropy-loss-fusion"]
    out = []
    for compiled in (False, True):
        cfg = parse_args(_argv(1, 1, extra + ["--device", "cuda"]), world_size=1)
        model = GPTModel(cfg.model, ParallelContext.single_process(), seed=9, device=cuda)
        model.configure_attention(2)
        if compiled:
            model.compile_regions(CompileOptions("inductor"))
        loss = model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        out.append((loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = out
    assert abs(l1 - l0) <= 1e-4 * abs(l0)
    for name, g in g0.items():
        assert (g1[name] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-7, name


def test_utransformer_compiled_matches_eager():
    """The U-Transformer's blocks are GPT layers: compiled the same way (its resampling and head stay eager)."""
    from megareshard.arguments import parse_model_args
    from megareshard.training import pretrain

    argv = ["--mock-data", "--vocab-size", "64", "--u-levels", "2", "--u-widths", "16,24", "--u-blocks-per-level",
            "1", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cpu", "--cross-entropy-loss-fusion"]
    runs = []
    for extra in ([], COMPILED):
        cfg, spec = parse_model_args("utransformer", argv + extra, world_size=1)
        out = io.StringIO()
        runs.append([r["loss"] for r in pretrain(cfg, out=out, model_spec=spec)])
        assert ("of 4 regions" in out.getvalue()) == bool(extra), out.getvalue()  # 3 blocks + the CE chunks
    assert runs[1] == pytest.approx(runs[0], rel=16 * U)
