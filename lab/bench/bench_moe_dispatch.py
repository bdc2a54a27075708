#!/usr/bin/env python3
"""MoE token dispatch, all-to-all against all-gather, at two expert-parallel sizes, side by side in one launch
(issue #52; docs/benchmarks.md, "Mixture of experts: token dispatch").

    # the emulated cluster: 4 hosts × 2 ranks behind 1 Gbit/s NICs (docs/design.md §7)
    python -m lab.cluster.emulate_cluster --hosts 4 --procs-per-host 2 --nic-rate 1gbit -- \
        -m lab.bench.bench_moe_dispatch --out docs/results/moe_dispatch_1gbit.json
    # plain torchrun: a check that it runs (hosts are labels only)
    torchrun --nproc-per-node 8 -m lab.bench.bench_moe_dispatch --hidden 64 --seq 64 --iters 2

A GPT whose every layer is an MoE layer (``--num-experts``, top-2, dropless), data parallel over all 8 ranks,
trains on mock data through the trainer (`Trainer`) for ``--warmup`` + ``--iters`` iterations per
configuration: ``--moe-token-dispatcher-type`` alltoall and allgather at ``--expert-model-parallel-size`` 2 (an
expert group inside a host: ranks 2h, 2h+1) and 4 (across two hosts). Reported per configuration: tokens/s
(the global batch's tokens over the median iteration time), and the share of the iteration spent in dispatch
— the wall time inside the dispatcher's ``dispatch`` and ``combine`` (its permutations and communication) plus
the time inside its collectives during the backward (`models/moe/comm.py`, gloo runs them synchronously), over
the iteration's. The wrapping is this file's (the lab's), installed before the trainer is built.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = [(2, "alltoall"), (2, "allgather"), (4, "alltoall"), (4, "allgather")]


class DispatchClock:
    """Wall time inside the dispatchers' dispatch/combine and, outside them (the backward), inside the MoE
    collectives."""

    def __init__(self) -> None:
        from megareshard.models.moe import comm, dispatch

        self.seconds, self.inside = 0.0, 0
        for name in ("_a2a", "_gather", "_reduce_scatter", "all_gather_counts"):
            setattr(comm, name, self._wrap(getattr(comm, name), outer=False))
        for cls in (dispatch.AlltoAllDispatcher, dispatch.AllGatherDispatcher):
            for meth in ("dispatch", "combine"):
                setattr(cls, meth, self._wrap(getattr(cls, meth), outer=True))

    def _wrap(self, fn, outer: bool):
        def timed(*args, **kwargs):
            if self.inside and not outer:
                return fn(*args, **kwargs)  # counted by the dispatch/combine around it
            t0 = time.perf_counter()
            self.inside += outer
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= outer
                self.seconds += time.perf_counter() - t0
        return timed


def argv_for(a: argparse.Namespace, world: int, ep: int, kind: str) -> list[str]:
    return ["--mock-data", "--vocab-size", str(a.vocab), "--num-layers", str(a.layers), "--hidden-size",
            str(a.hidden), "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq), "--micro-batch-size",
            str(a.micro_batch), "--global-batch-size", str(a.micro_batch * world), "--train-iters",
            str(a.warmup + a.iters), "--lr", "1e-4", "--lr-warmup-iters", "1", "--device", "cpu", "--log-interval",
            "1000000", "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--num-experts", str(a.experts), "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(a.ffn),
            "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
            "--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", kind]


def table(doc: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md shows (``--table JSON``): tokens/s, ratios to alltoall at the same
    ep, and the dispatch share (the median rank's median iteration)."""
    lines = ["| ep | dispatcher | ms / iteration (median) | tokens/s | vs alltoall at this ep | dispatch share of the "
             "iteration |", "|---|---|---|---|---|---|"]
    base = {r["ep"]: r["tokens_per_s"] for r in doc["rows"] if r["dispatcher"] == "alltoall"}
    for r in doc["rows"]:
        lines.append(f"| {r['ep']} | {r['dispatcher']} | {r['ms_per_iter']:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s'] / base[r['ep']]:.2f}× | {100 * r['dispatch_share_median_rank']:.0f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=512, help="--moe-ffn-hidden-size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--nic-gbps", type=float, default=1.0, help="the emulator's NIC rate (reported)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, metavar="JSON", help="print the table of a run's JSON and exit")
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0

    import torch.distributed as dist

    from megareshard.arguments import parse_args
    from megareshard.training import Trainer, build_context, init_distributed, pick_device

    device = pick_device("cpu")
    world, _ = init_distributed(device)
    rank = dist.get_rank()
    clock = DispatchClock()
    rows: list[dict[str, Any]] = []
    for ep, kind in CONFIGS:
        cfg = parse_args(argv_for(a, world, ep, kind), world_size=world)
        ctx, _ = build_context(cfg, world)
        shares: list[float] = []
        last = [clock.seconds]

        def step_end(trainer, rec) -> None:
            # the dispatch seconds since the previous step ended, over this step's time
            shares.append((clock.seconds - last[0]) / (rec["ms_per_iter"] / 1e3))
            last[0] = clock.seconds

        trainer = Trainer(cfg, ctx, device, out=io.StringIO())
        trainer.step_end_actions.append(step_end)
        recs = trainer.train()
        trainer.close()
        steady = recs[a.warmup:]
        ms = statistics.median(r["ms_per_iter"] for r in steady)
        row = {"ep": ep, "dispatcher": kind, "ms_per_iter": ms, "iters_ms": [r["ms_per_iter"] for r in steady],
               "tokens_per_s": cfg.training.global_batch_size * cfg.model.seq_length / (ms / 1e3),
               "dispatch_share": statistics.median(shares[a.warmup:]), "loss_last": steady[-1]["loss"],
               "aux_loss_last": steady[-1].get("load_balancing_loss")}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, row["dispatch_share"])
        row["dispatch_share_ranks"] = gathered
        row["dispatch_share_median_rank"] = statistics.median(gathered)
        rows.append(row)
        if rank == 0:
            print(f"ep {ep} {kind:9s}: {ms:.0f} ms/iter, {row['tokens_per_s']:.0f} tokens/s, dispatch "
                  f"{100 * row['dispatch_share_median_rank']:.0f} % of the iteration", flush=True)
        dist.barrier()
    if rank == 0:
        doc = {"world": world, "nic_gbps": a.nic_gbps, "model": {k: getattr(a, k) for k in (
            "layers", "hidden", "heads", "ffn", "experts", "seq", "micro_batch", "vocab")}, "topk": 2,
            "warmup": a.warmup, "iters": a.iters, "rows": rows}
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {a.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
