#!/usr/bin/env python
"""Training throughput of several parallel layouts side by side, in one launch.

    python -m lab.bench.bench_train --nproc 4 --layouts tp1,tp2,tp4,tp2sp --num-layers 4 --hidden-size 256
    python -m lab.bench.bench_train --nproc 1 --device cuda --bf16 --num-layers 24 --hidden-size 1024 ...

For each layout (``tpN`` with dp = nproc / N; ``sp`` adds sequence parallelism) it trains
on mock data for ``--warmup`` + ``--iters`` iterations and reports tokens/s, achieved
TFLOP/s per rank, MFU when ``--peak-tflops`` is given, and the share of forward/backward
time spent in tensor-parallel collectives (wall time inside collectives during forward/backward, where the only collectives are
tp/sp ones; DP averaging comes after). Ratios are
to the first layout. Prints a table; ``--json FILE`` writes the records.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time

from lab import env_with_root

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor")


class CollectiveClock:
    """Adds up wall time spent inside torch.distributed collectives while ``on``.

    Inside forward/backward the only collectives are tensor/sequence-parallel ones; gloo
    runs them synchronously, so the time in the call is the communication (and waiting) time.
    On NCCL calls return early; synchronise with ``--device cuda`` timings in mind.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on, self.seconds = False, 0.0
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def _parse_layout(text: str, nproc: int) -> tuple[int, bool]:
    sp = text.endswith("sp")
    body = text[:-2] if sp else text
    if not body.startswith("tp") or not body[2:].isdigit():
        raise SystemExit(f"bad layout {text!r}: write tpN or tpNsp, e.g. tp2 or tp2sp")
    tp = int(body[2:])
    if tp < 1 or nproc % tp:
        raise SystemExit(f"layout {text!r}: tp {tp} does not divide --nproc {nproc}")
    return tp, sp


def _model_args(a: argparse.Namespace, world: int, tp: int, sp: bool) -> list[str]:
    argv = ["--mock-data", "--vocab-size", str(a.vocab_size), "--num-layers", str(a.num_layers),
            "--hidden-size", str(a.hidden_size), "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.global_batch_size or a.micro_batch_size * (world // tp)),
            "--train-iters", str(a.warmup + a.iters), "--lr-warmup-iters", "1", "--tensor-model-parallel-size", str(tp),
            "--device", a.device, "--log-interval", "1000000",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    argv += a.model_args.split() if a.model_args else []   # e.g. Llama's --swiglu --normalization RMSNorm ...
    return argv + (["--sequence-parallel"] if sp else [])


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from megareshard.arguments import parse_args
    from megareshard.models.gpt import model_flops_per_iteration
    from megareshard.model_spec import get_model_spec
    from megareshard.training import Trainer, build_context, forward_backward, init_distributed, pick_device

    device = pick_device(a.device)
    world, _ = init_distributed(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    autocast = torch.bfloat16 if a.bf16 else None
    clock = CollectiveClock()
    records = []
    for text in a.layouts.split(","):
        tp, sp = _parse_layout(text, world)
        cfg = parse_args(_model_args(a, world, tp, sp), world_size=world)
        ctx, _ = build_context(cfg, world)
        comm_s, fb_s = [], []

        def timed_fb(model, microbatches, dev, backward=True, scale_loss=None, **_):
            # time forward/backward only: its collectives are the tensor-parallel ones
            clock.on, clock.seconds = True, 0.0
            t0 = time.perf_counter()
            loss = forward_backward(model, microbatches, dev, autocast_dtype=autocast, backward=backward,
                                    scale_loss=scale_loss, spec=get_model_spec("gpt"))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            fb_s.append(time.perf_counter() - t0)
            clock.on = False
            comm_s.append(clock.seconds)
            return loss

        trainer = Trainer(cfg, ctx, device, out=io.StringIO(), forward_backward_fn=timed_fb)
        recs = trainer.train()
        trainer.close()
        steady = recs[a.warmup:]
        ms = statistics.median(r["ms_per_iter"] for r in steady)
        flops = model_flops_per_iteration(cfg.model, cfg.training.global_batch_size)
        tflops = flops / (ms / 1e3) / world / 1e12
        rec = {"layout": text, "tp": tp, "dp": world // tp, "sequence_parallel": sp, "world_size": world,
               "ms_per_iter": ms, "tokens_per_s": cfg.training.global_batch_size * cfg.model.seq_length / (ms / 1e3),
               "tflops_per_rank": tflops, "mfu": tflops / a.peak_tflops if a.peak_tflops else None,
               "tp_comm_share": statistics.median(c / f for c, f in zip(comm_s[a.warmup:], fb_s[a.warmup:])),
               "loss_last": steady[-1]["loss"], "device": str(device), "bf16": a.bf16}
        records.append(rec)
        if rank == 0:
            print(f"[bench_train] {text}: {ms:.1f} ms/iter", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.barrier()
    if rank == 0:
        base = records[0]["tokens_per_s"]
        for r in records:
            r["speedup_vs_first"] = r["tokens_per_s"] / base
        print(json.dumps(records), file=open(a.json_out, "w") if a.json_out else sys.stdout)


def _table(records: list[dict]) -> str:
    cols = [("layout", "{}"), ("tp", "{}"), ("dp", "{}"), ("ms_per_iter", "{:.1f}"), ("tokens_per_s", "{:.0f}"),
            ("tflops_per_rank", "{:.4f}"), ("mfu", "{}"), ("tp_comm_share", "{:.1%}"), ("speedup_vs_first", "{:.2f}x")]
    rows = [[c for c, _ in cols]]
    for r in records:
        rows.append([("-" if r[c] is None else f.format(r[c])) if c != "mfu" or r[c] is None
                     else f"{r[c]:.1%}" for c, f in cols])
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks) on this machine")
    p.add_argument("--layouts", default="tp1,tp2", help="comma list of tpN[sp]; dp = nproc / N")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=None, help="default micro batch × dp")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10, help="timed iterations per layout")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per layout")
    p.add_argument("--model-args", default="", help="more model flags, one string (e.g. \"--swiglu --normalization "
                   "RMSNorm --position-embedding-type rope\")")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak, for MFU (H100 bf16 dense: 989)")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--plot", default=None, help="bar chart PNG: time per iteration split into tp comm and the rest")
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    worker_argv = os.environ.get("MR_BENCH_TRAIN_ARGV")
    if worker_argv is not None:  # inside torchrun: arguments come through the environment, since
        _worker(p.parse_args(json.loads(worker_argv)))  # torchrun's own parser would claim --nproc
        return 0
    a = p.parse_args(argv)
    for text in a.layouts.split(","):
        _parse_layout(text, a.nproc)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        out = os.path.join(tmp, "records.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
               "-m", "lab.bench.bench_train"]
        worker = _strip_json(argv if argv is not None else sys.argv[1:]) + ["--json-out", out]
        print(f"[bench_train] torchrun, {a.nproc} ranks, layouts {a.layouts}", file=sys.stderr)
        env = env_with_root(TMPDIR=tmp, WANDB_MODE="disabled", MR_BENCH_TRAIN_ARGV=json.dumps(worker))
        proc = subprocess.run(cmd, env=env)
        if proc.returncode:
            return proc.returncode
        records = json.load(open(out))
    print(_table(records))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    if a.plot:
        _plot(records, a.plot)
        print(f"[bench_train] picture: {a.plot}", file=sys.stderr)
    return 0


def _plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["layout"] for r in records]
    ms = [r["ms_per_iter"] for r in records]
    comm = [m * r["tp_comm_share"] for m, r in zip(ms, records)]
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(records), 3.6))
    ax.bar(names, [m - c for m, c in zip(ms, comm)], color="#4c72b0", label="compute + other")
    ax.bar(names, comm, bottom=[m - c for m, c in zip(ms, comm)], color="#dd8452", label="tp collectives")
    for i, r in enumerate(records):
        ax.text(i, ms[i], f"{r['tokens_per_s']:.0f} tok/s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per iteration (median)")
    ax.set_title(f"GPT training by layout ({records[0]['world_size']} ranks, {records[0]['device']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _strip_json(argv: list[str]) -> list[str]:
    """Drop --json FILE / --json=FILE: the worker writes to a temp file instead."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--json":
            skip = True
        elif not x.startswith("--json="):
            out.append(x)
    return out


if __name__ == "__main__":
    sys.exit(main())
