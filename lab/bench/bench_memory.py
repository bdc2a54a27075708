#!/usr/bin/env python
"""Step time and memory per rank: ZeRO 0/1/2 × activation recomputation, and DeepSpeed ZeRO.

One run, one fixed dp-only GPT config, every variant side by side on the same ranks (gloo,
CPU): a step is zero_grad → microbatches forward/backward → finish_grad_sync → clip → step.
Memory is measured from tensors (``megareshard.memory``): parameters, gradients after the
dp reduction (what the step sees), optimizer state, and activations saved for backward
over one iteration's forwards (all microbatches in flight, i.e. a GPipe-like worst case).
DeepSpeed (when importable) runs the same model, data and AdamW/clipping settings with
its ZeRO stages 1 and 2; its optimizer-state bytes are measured from its tensors too.

    python -m lab.bench.bench_memory [--dp 2] [--steps 6] [--json out.json]

Timings on 2 shared CPU cores vary run to run: compare ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch  # noqa: E402

CFG = dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=128,
           vocab_size=1024, make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
MB, NMB, LR, WD, BETAS, EPS, CLIP = 4, 2, 1e-3, 0.1, (0.9, 0.95), 1e-8, 1.0


def _data(dp_rank, steps):
    g = torch.Generator().manual_seed(100 + dp_rank)
    return [[torch.randint(0, CFG["vocab_size"], (MB, CFG["seq_length"] + 1), generator=g) for _ in range(NMB)]
            for _ in range(steps)]


def _ours(ctx, stage, recompute, steps):
    from megareshard.arguments import ModelConfig
    from megareshard.memory import ActivationMeter, memory_report
    from megareshard.models import GPTModel
    from megareshard.optim.zero import ZeroOptimizer

    model = GPTModel(ModelConfig(**CFG), ctx, seed=1, recompute_granularity="full" if recompute else None)
    opt = ZeroOptimizer(model.named_parameters(), ctx, stage=stage, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    times, rep, act, losses = [], None, 0, []
    for mbs in _data(ctx.dp_rank(), steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        outs = []
        with ActivationMeter(exclude=model.parameters()) as meter:
            for tokens in mbs:
                outs.append(model(tokens[:, :-1], labels=tokens[:, 1:]).mean() / len(mbs))
        for loss in outs:
            loss.backward()
        opt.finish_grad_sync()
        rep = memory_report(model, opt)
        opt.clip_grad_norm(CLIP)
        opt.step()
        times.append(time.perf_counter() - t0)
        act = meter.peak_bytes
        losses.append(sum(o.item() for o in outs))
    rep.activations = act
    return {"step_s": statistics.median(times[1:]), **rep.to_dict(), "final_loss": losses[-1]}


def _deepspeed(ctx, stage, steps):
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    from megareshard.arguments import ModelConfig
    from megareshard.memory import tensor_bytes
    from megareshard.models import GPTModel

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None   # no JIT-compiled shm op on CPU

    class LossModule(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, tokens):
            return self.m(tokens[:, :-1], labels=tokens[:, 1:]).mean()

    module = LossModule(GPTModel(ModelConfig(**CFG), ctx, seed=1))
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": NMB,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                       "weight_decay": WD, "torch_adam": True}},
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, dist_init_required=False,
                                           model_parameters=[{"params": decay, "weight_decay": WD},
                                                             {"params": no_decay, "weight_decay": 0.0}])
    times, losses = [], []
    for mbs in _data(ctx.dp_rank(), steps):
        t0 = time.perf_counter()
        total = 0.0
        for tokens in mbs:
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            total += loss.item() / len(mbs)
        times.append(time.perf_counter() - t0)
        losses.append(total)
    zopt = engine.optimizer
    state = [t for st in zopt.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    state += list(getattr(zopt, "single_partition_of_fp32_groups", []))
    params = list(module.parameters())
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    state = [t for t in state if t.untyped_storage().data_ptr() not in ptrs]
    return {"step_s": statistics.median(times[1:]), "params": tensor_bytes(params), "grads": None,
            "optimizer": tensor_bytes(state), "activations": None, "total": None, "final_loss": losses[-1]}


def _bench(rank, world_size, steps, ext_dir):
    os.environ.update(TORCH_EXTENSIONS_DIR=ext_dir, LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    from megareshard.parallel import ParallelContext, Topology

    ctx = ParallelContext.create(Topology(world_size))
    rows = []
    for stage in (0, 1, 2):
        for recompute in (False, True):
            rows.append({"impl": "megareshard", "zero": stage, "recompute": "full" if recompute else "off",
                         **_ours(ctx, stage, recompute, steps)})
    try:
        import deepspeed  # noqa: F401
        have_ds = True
    except Exception as e:  # the comparison is optional, but its absence is said, not hidden
        have_ds = False
        if ctx.rank == 0:
            print(f"[bench_memory] WARNING: deepspeed is not importable ({type(e).__name__}: {e}); the DeepSpeed "
                  "rows are left out. Install the extra: pip install -c constraints-cpu.txt -e '.[deepspeed]'",
                  file=sys.stderr, flush=True)
    if have_ds:
        for stage in (1, 2):
            rows.append({"impl": "deepspeed", "zero": stage, "recompute": "off", **_deepspeed(ctx, stage, steps)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    from tests.harness import run_ranks

    with tempfile.TemporaryDirectory(prefix="mr-bench-ext-") as ext:
        per_rank = run_ranks(_bench, args.dp, args.steps, ext, timeout=1800)
    rows = []
    for i, row in enumerate(per_rank[0]):
        merged = dict(row)
        for key in ("step_s", "params", "grads", "optimizer", "activations", "total"):
            vals = [r[i][key] for r in per_rank if r[i][key] is not None]
            merged[key] = max(vals) if vals else None   # max over ranks
        rows.append(merged)
    base = rows[0]["step_s"]
    mib = lambda v: "-" if v is None else f"{v / 2 ** 20:8.2f}"  # noqa: E731
    print(f"config: GPT {CFG['num_layers']}L h{CFG['hidden_size']} s{CFG['seq_length']} V{CFG['vocab_size']}, "
          f"micro-batch {MB} × {NMB}, dp {args.dp} (gloo, CPU), fp32; max over ranks; MiB")
    print(f"{'impl':<12}{'zero':>5}{'recomp':>8}{'step s':>9}{'×zero0':>8}{'params':>9}{'grads':>9}"
          f"{'optim':>9}{'activ':>9}{'total':>9}{'loss':>8}")
    for r in rows:
        print(f"{r['impl']:<12}{r['zero']:>5}{r['recompute']:>8}{r['step_s']:>9.3f}{r['step_s'] / base:>8.2f}"
              f"{mib(r['params']):>9}{mib(r['grads']):>9}{mib(r['optimizer']):>9}{mib(r['activations']):>9}"
              f"{mib(r['total']):>9}{r['final_loss']:>8.3f}")
    out = {"config": {**CFG, "micro_batch": MB, "microbatches": NMB, "dp": args.dp, "steps": args.steps},
           "rows": rows}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
