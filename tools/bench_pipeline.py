#!/usr/bin/env python
"""Pipeline schedules × cross-stage resharding strategies, side by side in one launch (paper §4–§5).

    # emulated cluster: one pipeline stage per host, tp 2 inside each host, slow NICs
    tools/emulate_cluster.py --hosts 4 --procs-per-host 2 --nic-rate 100mbit -- \\
        tools/bench_pipeline.py --tp 2 --pp 4 --nic-gbps 0.1 --json out.json --plot bars.png \\
        --trace-dir traces/ --compare-plot timelines.png
    # plain torchrun on this machine (no rate limit; a smoke run)
    python tools/bench_pipeline.py --nproc 4 --tp 1 --pp 4 --configs 1f1b+sendrecv,1f1b+broadcast
    # no processes: the simulator with per-action costs (measured: --costs-from a JSON of a real run)
    python tools/bench_pipeline.py --simulate --costs-from out.json --nic-gbps 0.1
    # redraw the table and pictures of a finished run
    python tools/bench_pipeline.py --from-json out.json --trace-dir traces/ --plot bars.png --compare-plot cmp.png
    # the U-Transformer (skip edges across stages): same flags, --u-* for its shape
    tools/emulate_cluster.py ... -- tools/bench_pipeline.py --model utransformer --nic-gbps 0.2 ...

A configuration is ``SCHEDULE+STRATEGY[+dw]``: schedule gpipe|1f1b|eager-1f1b, strategy
sendrecv|allgather|broadcast|signal, ``+dw`` = delayed weight gradients. For every
(schedule, dw) pair used, ``SCHEDULE+signal[+dw]`` is added (unless ``--no-signal``): the
same run with 1-byte transfers, the upper bound of what communication can cost.

All configurations share ONE model, optimizer and batch; each has its own
``PipelineRuntime`` (its own resharders). Iterations are interleaved — round r runs one
iteration of every configuration — so slow drift of the machine's load hits all alike.
An iteration is timed between a barrier and the end of the optimizer step, as the max
over ranks; the median over ``--iters`` rounds after ``--warmup`` is reported.

Per configuration: ms/iteration, tokens/s, speedup over the baseline (``--baseline``,
default 1f1b+sendrecv), fraction of the signal upper bound = t(signal, same schedule) / t
and = min over all signal runs / t — each from medians, from the fastest round (``_min``)
and as the median of per-round ratios (``_paired``) —, the model's seconds per transfer at
``--nic-gbps`` (all edges a stage sends, for the busiest stage), and
the measured per-action times (F/B/I/W medians per stage, from the runtime's trace of
the last round). Rank 0 prints progress and the table, writes ``--json``, ``--plot``,
``--trace-dir`` (one ``CONFIG.json`` per config for ``tools/plot_schedule.py --trace``) and
``--compare-plot`` (measured timelines of ``--compare A,B`` stacked, paper Figure 4).

``--pace auto`` emulates one dedicated device per rank: after the (unpaced) warm-up rounds,
every F/B/I/W of a stage is given a fixed wall time — a quantile of its warm-up durations ×
a margin, the same for every configuration — and an action that finishes early sleeps the
rest. Without it, ranks that share a few CPU cores lend a stage's core to the other stages
while it waits for the network, which hides communication under *any* schedule and is
what no GPU stage can do. Compute then costs the same in every configuration and only
communication and scheduling differ; actions that outlast their budget are counted
(``pace_overruns``) and reported. Results of a paced run are labelled as such.

Inside torchrun (``RANK`` set, e.g. under ``tools/emulate_cluster.py``) this script is the
worker; otherwise it starts ``torchrun --standalone --nproc-per-node N`` on itself and
hands the arguments over in the environment (torchrun's own parser would claim
``--nproc``), or with ``--simulate`` runs no processes at all.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # plot_schedule.draw

from megareshard.pipeline.pacing import calibrate_pace, parse_pace  # noqa: E402 (no torch import)

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager-1f1b")
STRATEGY_NAMES = ("sendrecv", "allgather", "broadcast", "signal")
MODELS = ("gpt", "utransformer")
DEFAULT_CONFIGS = ("1f1b+sendrecv,1f1b+allgather,1f1b+broadcast,eager-1f1b+broadcast,"
                   "eager-1f1b+broadcast+dw,gpipe+broadcast")
ENV_ARGV = "MR_BENCH_PIPELINE_ARGV"


@dataclass(frozen=True)
class BenchConfig:
    schedule: str
    strategy: str
    dw: bool

    @property
    def name(self) -> str:
        return f"{self.schedule}+{self.strategy}{'+dw' if self.dw else ''}"

    @property
    def signal(self) -> "BenchConfig":
        return BenchConfig(self.schedule, "signal", self.dw)

    def flags(self) -> list[str]:
        return (["--pipeline-schedule", self.schedule, "--reshard-strategy", self.strategy]
                + (["--delay-wgrad-compute"] if self.dw else []))


def parse_config(text: str) -> BenchConfig:
    """``SCHEDULE+STRATEGY[+dw]`` (``+delayw``/``+delayed`` accepted for ``+dw``)."""
    parts = text.strip().split("+")
    dw = False
    if parts and parts[-1] in ("dw", "delayw", "delayed"):
        dw, parts = True, parts[:-1]
    if len(parts) != 2 or parts[0] not in SCHEDULE_NAMES or parts[1] not in STRATEGY_NAMES:
        raise ValueError(f"bad configuration {text!r}: write SCHEDULE+STRATEGY[+dw] with SCHEDULE in "
                         f"{'|'.join(SCHEDULE_NAMES)} and STRATEGY in {'|'.join(STRATEGY_NAMES)}, "
                         "e.g. eager-1f1b+broadcast+dw")
    return BenchConfig(parts[0], parts[1], dw)


def expand_configs(text: str, with_signal: bool = True) -> list[BenchConfig]:
    """The listed configurations (duplicates dropped), then one signal run per (schedule, dw) pair."""
    out: list[BenchConfig] = []
    for t in text.split(","):
        if t.strip():
            c = parse_config(t)
            if c not in out:
                out.append(c)
    if not out:
        raise ValueError("--configs is empty")
    if with_signal:
        for c in list(out):
            if c.signal not in out:
                out.append(c.signal)
    return out


# ---- arguments ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", choices=MODELS)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of SCHEDULE+STRATEGY[+dw]")
    p.add_argument("--no-signal", action="store_true", help="do not add the signal upper-bound runs")
    p.add_argument("--baseline", default="1f1b+sendrecv", help="speedups are relative to this configuration")
    p.add_argument("--nproc", type=int, default=8, help="ranks when this tool starts torchrun itself")
    p.add_argument("--procs-per-host", type=int, default=None,
                   help="ranks per (emulated) host for placement and the network model; default: "
                        "torchrun's LOCAL_WORLD_SIZE (plain torchrun: all ranks on one host)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size inside a stage")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per iteration (per dp rank)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--num-layers-per-stage", default=None,
                   help="comma list (default: even split; utransformer with 5 blocks on 4 stages: 1,1,1,2)")
    u = p.add_argument_group("utransformer", "--model utransformer: the U's shape (--num-layers and "
                                             "--hidden-size are derived from it)")
    u.add_argument("--u-levels", type=int, default=3)
    u.add_argument("--u-widths", default="128,256,512")
    u.add_argument("--u-blocks-per-level", default="1")
    u.add_argument("--u-shorten-factor", type=int, default=2)
    u.add_argument("--u-skip-merge", default="add", choices=("add", "concat"))
    p.add_argument("--reshard-scheduler", default="auto")
    p.add_argument("--reshard-chunks", type=int, default=4)
    p.add_argument("--iters", type=int, default=10, help="timed rounds (one iteration of every config each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--nic-gbps", type=float, default=1.0,
                   help="NIC rate for the network model's per-transfer time (set it to the emulated rate)")
    p.add_argument("--json", default=None, help="write the records (a JSON list) here")
    p.add_argument("--plot", default=None, help="bar chart PNG of ms/iteration per configuration")
    p.add_argument("--trace-dir", default=None, help="write each configuration's measured timeline here")
    p.add_argument("--compare", default="1f1b+sendrecv,eager-1f1b+broadcast+dw",
                   help="two (or more) configurations for --compare-plot")
    p.add_argument("--compare-plot", default=None, help="PNG: their timelines (last round) stacked")
    p.add_argument("--simulate", action="store_true", help="no processes: megareshard.pipeline.simulate")
    p.add_argument("--from-json", default=None,
                   help="no run: redraw the table, --plot and --compare-plot (traces from --trace-dir) from records")
    p.add_argument("--costs-from", default=None,
                   help="--simulate: per-action costs from this JSON (action_ms of a measured run)")
    p.add_argument("--cost-f", type=float, default=None, help="--simulate: ms per F (default 10 or measured)")
    p.add_argument("--cost-b", type=float, default=None, help="--simulate: ms per B (default 2×F or measured)")
    p.add_argument("--cost-i", type=float, default=None, help="--simulate: ms per I (default B/2 or measured)")
    p.add_argument("--cost-w", type=float, default=None, help="--simulate: ms per W (default B−I or measured)")
    p.add_argument("--hosts", type=int, default=None, help="--simulate: hosts (default pp: one stage per host)")
    p.add_argument("--timeout", type=float, default=900.0, help="plain torchrun launch: kill after this long")
    p.add_argument("--pace", default="none",
                   help="emulate a dedicated device per rank: every F/B/I/W takes at least a fixed wall time "
                        "(a faster one sleeps the rest). 'none' (default); 'auto': after the warm-up rounds, "
                        "per stage and kind, --pace-quantile of the warm-up durations × --pace-margin; or "
                        "'F=60,B=120,I=90,W=30' (ms, every stage)")
    p.add_argument("--pace-quantile", type=float, default=0.9, help="--pace auto: quantile of warm-up durations")
    p.add_argument("--pace-margin", type=float, default=1.25, help="--pace auto: budget = quantile × this")
    return p


def check_args(a: argparse.Namespace, world: int | None = None) -> list[BenchConfig]:
    configs = expand_configs(a.configs, not a.no_signal)
    base = parse_config(a.baseline)
    if base not in configs:
        raise ValueError(f"--baseline {a.baseline} is not among the configurations "
                         f"({', '.join(c.name for c in configs)})")
    if world is not None and world % (a.tp * a.pp):
        raise ValueError(f"{world} ranks are not divisible by tp {a.tp} × pp {a.pp}")
    if a.iters < 1 or a.warmup < 0 or a.microbatches < 1:
        raise ValueError("--iters must be >= 1, --warmup >= 0, --microbatches >= 1")
    parse_pace(a.pace, warmup=a.warmup, quantile=a.pace_quantile, margin=a.pace_margin)
    return configs


def model_argv(a: argparse.Namespace, cfg: BenchConfig, world: int) -> list[str]:
    dp = world // (a.tp * a.pp)
    if a.model == "gpt":
        argv = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size)]
        per_stage = a.num_layers_per_stage
    else:
        argv = ["--u-levels", str(a.u_levels), "--u-widths", a.u_widths, "--u-blocks-per-level",
                a.u_blocks_per_level, "--u-shorten-factor", str(a.u_shorten_factor), "--u-skip-merge", a.u_skip_merge]
        blocks = len(a.u_blocks_per_level.split(",")) == 1 and 2 * a.u_levels - 1 == 5
        per_stage = a.num_layers_per_stage or ("1,1,1,2" if blocks and a.pp == 4 and a.u_blocks_per_level == "1"
                                               else None)
    if per_stage:
        argv += ["--num-layers-per-stage", per_stage]
    argv += ["--mock-data", "--vocab-size", str(a.vocab_size), "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * dp * a.microbatches),
            "--train-iters", "1000000", "--lr-warmup-iters", "1", "--device", "cpu", "--log-interval", "1000000",
            "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
            "--reshard-scheduler", a.reshard_scheduler, "--reshard-chunks", str(a.reshard_chunks),
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    if a.procs_per_host:
        argv += ["--nproc-per-node", str(a.procs_per_host)]
    return argv + cfg.flags()


def parse_model_config(a: argparse.Namespace, c: BenchConfig, world: int):
    """(Config, model spec or None for the GPT) of one configuration."""
    if a.model == "gpt":
        from megareshard.arguments import parse_args

        return parse_args(model_argv(a, c, world), world_size=world), None
    from megareshard.models.utransformer import parse_utransformer_args

    return parse_utransformer_args(model_argv(a, c, world), world_size=world)


def graph_and_shapes(cfg, spec, layouts, batch: int):
    """The stage graph (chain + skip edges) and every edge's global tensor shape."""
    if spec is not None:
        return spec.graph(cfg, layouts), spec.edge_shapes(cfg, layouts, batch)
    from megareshard.pipeline.stage import chain_graph

    graph = chain_graph(len(layouts))
    shape = (cfg.model.seq_length, batch, cfg.model.hidden_size)
    return graph, {e: shape for e in graph.edges}


# ---- the network model's view of the stage boundaries ---------------------------------------------------
def edge_transfer_model(a: argparse.Namespace, configs: Sequence[BenchConfig], world: int,
                        procs_per_host: int) -> dict[str, dict[str, float]]:
    """Per strategy, for one microbatch's forward tensors: bytes out of the busiest NIC (all edges
    added up), and the model's seconds to send everything one stage sends (edges of a stage added up,
    the busiest stage). For the GPT that is one edge 0->1."""
    from megareshard.parallel import CommVolume, Topology
    from megareshard.pipeline.stage import stage_layouts
    from megareshard.resharding import plan_resharding
    from megareshard.resharding.network import NetworkModel

    cfg, spec = parse_model_config(a, configs[0], world)
    m, t = cfg.model, cfg.training
    dp = cfg.dp(world)
    order = cfg.parallel.rank_order or CommVolume.for_gpt(m.hidden_size, m.seq_length, t.micro_batch_size,
                                                           tp=cfg.tp, dp=dp, pp=cfg.pp).order()
    topo = Topology(world, tp=cfg.tp, pp=cfg.pp, nproc_per_node=procs_per_host, order=order)
    lay = spec.stage_layouts(cfg, topo) if spec is not None else stage_layouts(cfg, topo)
    graph, shapes = graph_and_shapes(cfg, spec, lay, t.micro_batch_size * dp)
    net = NetworkModel(a.nic_gbps)
    out = {}
    for strategy in sorted({c.strategy for c in configs}):
        host_out: dict[int, int] = {}
        stage_s: dict[int, float] = {}
        per_edge: dict[str, float] = {}
        total = 0
        for e in graph.edges:
            plan = plan_resharding(shapes[e], lay[e.src].mesh, lay[e.src].hidden_spec, lay[e.dst].mesh,
                                   lay[e.dst].hidden_spec, strategy=strategy, scheduler=a.reshard_scheduler,
                                   itemsize=4, broadcast_chunks=a.reshard_chunks, time_budget_s=0.2)
            for h, (o, i) in net.host_bytes(plan).items():
                host_out[h] = host_out.get(h, 0) + max(o, i)
            per_edge[str(e)] = net.predict(plan)
            stage_s[e.src] = stage_s.get(e.src, 0.0) + per_edge[str(e)]
            total = max(total, math.prod(shapes[e]) * 4)
        out[strategy] = {"nic_bytes": max(host_out.values(), default=0), "model_s": max(stage_s.values(), default=0.0),
                         "tensor_bytes": total, "edge_s": per_edge}
    return out


# ---- the worker (inside torchrun) -------------------------------------------------------------------
def _action_ms(trace: list[dict[str, Any]], pp: int) -> dict[str, list[float | None]]:
    """Median duration (ms) of each compute kind per stage, and of sends (SEND_F/SEND_B, ready→done)."""
    out: dict[str, list[float | None]] = {}
    for kind in ("F", "B", "I", "W", "SEND_F", "SEND_B"):
        row = []
        for s in range(pp):
            d = [1e3 * (r["end"] - r["start"]) for r in trace if r["stage"] == s and r["kind"] == kind]
            row.append(round(statistics.median(d), 3) if d else None)
        if any(v is not None for v in row):
            out[kind] = row
    return out


class _Step:
    """One configuration's forward_backward_fn: the runtime, then non-finite gradients zeroed.

    The signal strategy moves one byte, so a stage's input is whatever ``torch.empty``
    held; its gradients may be inf/NaN, and the optimizer (shared by every configuration)
    must not learn them. The same pass runs for every configuration, so timings stay
    comparable.
    """

    finalizes_grads = True

    def __init__(self, runtime, optimizer) -> None:
        self.runtime, self.optimizer = runtime, optimizer

    def __call__(self, model, microbatches, device, **kwargs):
        import torch

        loss = self.runtime(model, microbatches, device, **kwargs)
        for g in self.optimizer.grad_tensors():
            torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
        return loss


def _worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megareshard.pipeline.runtime import PipelineRuntime, gather_trace
    from megareshard.pipeline.stage import stage_layouts
    from megareshard.training import Trainer, build_context, init_distributed

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # garbage (signal) inputs must not hit the slow denormal path
    device = torch.device("cpu")
    world = init_distributed(device)
    world = world[0] if isinstance(world, tuple) else world  # newer versions also return rank infos
    rank = dist.get_rank() if dist.is_initialized() else 0
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if rank == 0 else (lambda *x: None)
    configs = check_args(a, world)
    procs_per_host = a.procs_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    t_start = time.monotonic()

    parsed = [parse_model_config(a, c, world) for c in configs]
    cfgs, spec = [p[0] for p in parsed], parsed[0][1]
    ctx, placement = build_context(cfgs[0], world)
    say(f"[bench_pipeline] {a.model}: {world} ranks, {world // procs_per_host} host(s) x {procs_per_host}; "
        f"{placement}")
    trainer = Trainer(cfgs[0], ctx, device, out=io.StringIO(), **({"model_spec": spec} if spec is not None else {}))
    layouts = spec.stage_layouts(cfgs[0], ctx.topology) if spec is not None else stage_layouts(cfgs[0], ctx.topology)
    build_runtime = spec.build_runtime if spec is not None else PipelineRuntime.for_gpt
    say("[bench_pipeline] " + trainer.pipeline.describe().replace("\n", "\n[bench_pipeline] "))
    hosts_of_stage = [list(lay.mesh.host_ids()) for lay in layouts]
    runtimes = [trainer.pipeline]
    for c, cfg in zip(configs[1:], cfgs[1:]):  # collective: every rank builds every edge, same order
        rt = build_runtime(cfg, ctx, layouts, finalize_grads=trainer.finalize_grads, record_trace=True,
                           dtype=trainer.params_dtype)
        rt.watchdog = getattr(trainer.pipeline, "watchdog", None)
        runtimes.append(rt)
    runtimes[0].record_trace = True
    steps = [_Step(rt, trainer.optimizer) for rt in runtimes]
    batch = trainer._microbatches(trainer.train_data, next(trainer._train_iter))
    say(f"[bench_pipeline] {len(configs)} configurations, {len(batch)} microbatches of "
        f"{a.micro_batch_size}x{a.seq_length} tokens; {a.warmup} warm-up + {a.iters} timed rounds "
        f"(set-up {time.monotonic() - t_start:.1f}s)")

    pace = parse_pace(a.pace, warmup=a.warmup, quantile=a.pace_quantile, margin=a.pace_margin)
    stage = ctx.pp_rank()
    budgets: list[dict[str, float]] | None = None

    def set_pace(per_stage: list[dict[str, float]]) -> None:
        for rt in runtimes:
            rt.pace = per_stage[stage]

    if isinstance(pace, dict):
        budgets = [dict(pace) for _ in range(a.pp)]
        set_pace(budgets)
    # --pace auto: the warm-up rounds run unpaced and calibrate; one more untimed round runs paced
    skip = a.warmup + (1 if pace == "auto" else 0)
    rounds = skip + a.iters
    overruns = torch.zeros(len(configs), 2, dtype=torch.float64)  # (count, excess µs) over ranks and rounds
    times = torch.zeros(len(configs), rounds, dtype=torch.float64)
    warm: list[list[dict[str, Any]] | None] = []  # --pace auto: every warm-up round's traces
    for r in range(rounds):
        if pace == "auto" and r == a.warmup:
            box = [calibrate_pace(warm, a.pp, a.pace_quantile, a.pace_margin) if rank == 0 else None]
            if dist.is_initialized():
                dist.broadcast_object_list(box, src=0)
            budgets = box[0]
            set_pace(budgets)
            say("[bench_pipeline] paced compute (ms, per stage): " + "; ".join(
                f"stage {s} " + " ".join(f"{k}={1e3 * v:.0f}" for k, v in b.items()) for s, b in enumerate(budgets)))
        t_round = time.monotonic()
        for i, step in enumerate(steps):
            trainer.forward_backward_fn = step
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step(batch)
            times[i, r] = time.perf_counter() - t0
            if r >= skip:
                st = step.runtime.last_stats
                overruns[i, 0] += st.get("pace_overruns", 0)
                overruns[i, 1] += st.get("pace_overrun_us", 0)
        if pace == "auto" and r < a.warmup:
            warm += [gather_trace(ctx, rt.last_trace) for rt in runtimes]  # collective
        if dist.is_initialized():
            mx = times[:, r].clone()
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            times[:, r] = mx
        tag = "warm-up" if r < a.warmup else "paced warm-up" if r < skip else "timed"
        say(f"[bench_pipeline] round {r + 1}/{rounds} ({tag}, {time.monotonic() - t_round:.1f}s, total "
            f"{time.monotonic() - t_start:.0f}s): " + ", ".join(
                f"{c.name} {1e3 * times[i, r]:.0f}" for i, c in enumerate(configs)) + " ms")

    traces = [gather_trace(ctx, rt.last_trace) for rt in runtimes]  # collective
    if dist.is_initialized():
        dist.all_reduce(overruns)
    if rank == 0:
        ms = [[1e3 * x for x in times[i, skip:].tolist()] for i in range(len(configs))]
        records = make_records(a, configs, ms, traces, world, procs_per_host,
                               mode="measured" if budgets is None else "measured, paced compute",
                               hosts_of_stage=hosts_of_stage)
        for i, rec in enumerate(records):
            rec["pace_ms"] = None if budgets is None else [{k: round(1e3 * v, 3) for k, v in b.items()}
                                                           for b in budgets]
            # actions (summed over ranks and timed rounds) whose real compute outlasted the budget
            rec["pace_overruns"] = None if budgets is None else int(overruns[i, 0].item())
            # their excess over the budget, ms per iteration, summed over ranks (an upper bound of what
            # they added to the iteration: overlapping excesses on different ranks count twice)
            rec["pace_overrun_ms_per_iter"] = None if budgets is None else \
                round(overruns[i, 1].item() / 1e3 / a.iters, 3)
        if budgets is not None:
            print("[bench_pipeline] paced compute: actions over budget (all ranks, timed rounds) and their excess "
                  "(ms per iteration, summed over ranks): " + ", ".join(
                      f"{r['config']} {r['pace_overruns']} / {r['pace_overrun_ms_per_iter']:.0f}" for r in records),
                  file=sys.stderr)
        finish(a, records, traces, configs)
    if dist.is_initialized():
        dist.barrier()
    trainer.close()
    return 0


def make_records(a: argparse.Namespace, configs: Sequence[BenchConfig], ms: Sequence[Sequence[float]],
                 traces: Sequence[list[dict[str, Any]] | None], world: int, procs_per_host: int, *, mode: str,
                 hosts_of_stage: list[list[int]] | None = None) -> list[dict[str, Any]]:
    net = edge_transfer_model(a, configs, world, procs_per_host)
    dp = world // (a.tp * a.pp)
    tokens = a.micro_batch_size * dp * a.microbatches * a.seq_length
    recs = []
    for c, m, tr in zip(configs, ms, traces):
        med = statistics.median(m)
        q = statistics.quantiles(m, n=4) if len(m) >= 2 else [med, med, med]
        recs.append({
            "model": a.model, "config": c.name, "schedule": c.schedule, "strategy": c.strategy, "delay_wgrad": c.dw,
            "mode": mode, "ms_per_iter": med, "ms_q1": q[0], "ms_q3": q[2], "ms_min": min(m),
            "ms_all": [round(x, 3) for x in m],
            "tokens_per_s": tokens / (med / 1e3),
            "world_size": world, "procs_per_host": procs_per_host, "tp": a.tp, "pp": a.pp, "dp": dp,
            "microbatches": a.microbatches, "micro_batch_size": a.micro_batch_size, "seq_length": a.seq_length,
            "hidden_size": a.hidden_size, "num_layers": a.num_layers, "nic_gbps": a.nic_gbps,
            "transfer_bytes": net[c.strategy]["tensor_bytes"], "transfer_nic_bytes": net[c.strategy]["nic_bytes"],
            "transfer_model_ms": 1e3 * net[c.strategy]["model_s"],
            "edge_model_ms": {k: round(1e3 * v, 3) for k, v in net[c.strategy]["edge_s"].items()},
            "action_ms": _action_ms(tr, a.pp) if tr else {},
            "hosts_of_stage": hosts_of_stage,
        })
    fill_ratios(recs, a.baseline)
    return recs


def fill_ratios(recs: list[dict[str, Any]], baseline: str) -> None:
    """speedup_vs_baseline, signal_ms/signal_fraction (same schedule) and best_signal_fraction, from medians;
    the same from the fastest round (``*_min``: least disturbed by outside load); and ``*_paired``: the
    median over rounds of the per-round ratio (both runs of a ratio come from the same round)."""
    by = {r["config"]: r for r in recs}
    base = by.get(baseline)
    sig_recs = [r for r in recs if r["strategy"] == "signal"]
    best = min((r["ms_per_iter"] for r in sig_recs), default=None)
    best_min = min((r.get("ms_min", r["ms_per_iter"]) for r in sig_recs), default=None)

    def paired(num: dict[str, Any] | None, den: dict[str, Any]) -> float | None:
        if num is None or not num.get("ms_all") or len(num["ms_all"]) != len(den.get("ms_all") or []):
            return None
        return statistics.median(a / b for a, b in zip(num["ms_all"], den["ms_all"]))

    for r in recs:
        r["baseline"] = baseline
        r["speedup_vs_baseline"] = base["ms_per_iter"] / r["ms_per_iter"] if base else None
        sig = by.get(BenchConfig(r["schedule"], "signal", r["delay_wgrad"]).name)
        r["signal_config"] = sig["config"] if sig else None
        r["signal_ms"] = sig["ms_per_iter"] if sig else None
        r["signal_fraction"] = sig["ms_per_iter"] / r["ms_per_iter"] if sig else None
        r["best_signal_fraction"] = best / r["ms_per_iter"] if best else None
        if "ms_min" in r:
            r["speedup_vs_baseline_min"] = base["ms_min"] / r["ms_min"] if base else None
            r["signal_fraction_min"] = sig["ms_min"] / r["ms_min"] if sig else None
            r["best_signal_fraction_min"] = best_min / r["ms_min"] if best_min else None
            r["speedup_vs_baseline_paired"] = paired(base, r)
            r["signal_fraction_paired"] = paired(sig, r)


# ---- simulate --------------------------------------------------------------------------------------
def _costs(a: argparse.Namespace, configs: Sequence[BenchConfig]) -> dict[str, Any]:
    """Per-stage F/B/I/W costs (ms): --cost-* win, else a measured run's action_ms, else F=10, B=2F."""
    f = b = i = w = None
    if a.costs_from:
        recs = json.load(open(a.costs_from))
        # compute costs from the signal runs (no waiting inside F/B), else from any run
        pool = [r for r in recs if r.get("strategy") == "signal" and r.get("action_ms")] or \
               [r for r in recs if r.get("action_ms")]
        if not pool:
            raise ValueError(f"{a.costs_from} has no action_ms (per-action times of a measured run)")

        def per_stage(kind: str) -> list[float] | None:
            rows = [r["action_ms"][kind] for r in pool if kind in r["action_ms"]]
            if not rows:
                return None
            return [statistics.median(row[s] for row in rows if row[s] is not None) for s in range(len(rows[0]))]

        f, b, i, w = per_stage("F"), per_stage("B"), per_stage("I"), per_stage("W")
    f = [a.cost_f] * a.pp if a.cost_f is not None else f or [10.0] * a.pp
    b = [a.cost_b] * a.pp if a.cost_b is not None else b or [2 * x for x in f]
    if a.cost_i is not None:
        i = [a.cost_i] * a.pp
    if a.cost_w is not None:
        w = [a.cost_w] * a.pp
    if i is None:
        i = [x / 2 for x in b]
    if w is None:
        w = [x - y for x, y in zip(b, i)]
    return {"f": f, "b": b, "i": i, "w": w}


def _simulate(a: argparse.Namespace) -> int:
    from megareshard.pipeline import Costs, generate, simulate

    configs = check_args(a)
    world = a.tp * a.pp
    pph = a.procs_per_host or (world // (a.hosts or a.pp))
    costs = _costs(a, configs)
    net = edge_transfer_model(a, configs, world, pph)
    print(f"[bench_pipeline] simulate: pp {a.pp}, tp {a.tp}, {a.microbatches} microbatches, {pph} ranks/host, "
          f"NIC {a.nic_gbps} Gbit/s; ms per action F {costs['f']} B {costs['b']} I {costs['i']} W {costs['w']}; "
          "transfer ms " + ", ".join(f"{s} {1e3 * v['model_s']:.2f}" for s, v in net.items()),
          file=sys.stderr)
    ms, traces = [], []
    graph = None
    if a.model != "gpt":
        from megareshard.parallel import Topology

        cfg, spec = parse_model_config(a, configs[0], world)
        graph = spec.graph(cfg, spec.stage_layouts(cfg, Topology(world, tp=a.tp, pp=a.pp, nproc_per_node=pph)))
    for c in configs:
        sched = generate(c.schedule, a.pp, a.microbatches, delay_wgrad=c.dw, graph=graph)
        comm_ms = {k: 1e3 * v for k, v in net[c.strategy]["edge_s"].items()}
        tl = simulate(sched, costs=Costs(f=costs["f"], b=costs["b"], i=costs["i"], w=costs["w"], comm=comm_ms))
        ms.append([tl.makespan])
        traces.append([{**r, "start": r["start"] / 1e3, "end": r["end"] / 1e3} for r in tl.to_trace()])
    records = make_records(a, configs, ms, traces, world, pph, mode="simulated")
    finish(a, records, traces, configs)
    return 0


def _replay(a: argparse.Namespace) -> int:
    records = json.load(open(a.from_json))
    configs = [parse_config(r["config"]) for r in records]
    traces = []
    for c in configs:
        f = Path(a.trace_dir or "", f"{c.name}.json")
        traces.append(json.loads(f.read_text()) if a.trace_dir and f.exists() else None)
    a.trace_dir = None  # read, not written
    a.json = None if a.json == a.from_json else a.json
    finish(a, records, traces, configs)
    return 0


# ---- output -----------------------------------------------------------------------------------------
def format_table(records: Sequence[dict[str, Any]]) -> str:
    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    rows = [["config", "ms/iter", "q1-q3", "min", "tokens/s", "vs " + records[0]["baseline"], "(paired)", "(min)",
             "of signal", "(paired)", "(min)", "of best signal", "xfer model ms"]]
    for r in records:
        rows.append([r["config"], f"{r['ms_per_iter']:.1f}", f"{r['ms_q1']:.0f}-{r['ms_q3']:.0f}",
                     f"{r.get('ms_min', r['ms_per_iter']):.0f}", f"{r['tokens_per_s']:.0f}",
                     x(r["speedup_vs_baseline"]), x(r.get("speedup_vs_baseline_paired")),
                     x(r.get("speedup_vs_baseline_min")), pct(r["signal_fraction"]),
                     pct(r.get("signal_fraction_paired")), pct(r.get("signal_fraction_min")),
                     pct(r["best_signal_fraction"]), f"{r['transfer_model_ms']:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)


def finish(a: argparse.Namespace, records: list[dict[str, Any]], traces: Sequence[list[dict[str, Any]] | None],
           configs: Sequence[BenchConfig]) -> None:
    print(format_table(records), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"[bench_pipeline] records: {a.json}", file=sys.stderr)
    if a.trace_dir:
        from megareshard.pipeline.runtime import write_trace

        os.makedirs(a.trace_dir, exist_ok=True)
        for c, tr in zip(configs, traces):
            if tr:
                write_trace(os.path.join(a.trace_dir, f"{c.name}.json"), tr)
        print(f"[bench_pipeline] traces: {a.trace_dir}/CONFIG.json (tools/plot_schedule.py --trace FILE -o X.png)",
              file=sys.stderr)
    if a.plot:
        plot_bars(records, a.plot)
        print(f"[bench_pipeline] picture: {a.plot}", file=sys.stderr)
    if a.compare_plot:
        names = [parse_config(x).name for x in a.compare.split(",") if x.strip()]
        by = {c.name: tr for c, tr in zip(configs, traces)}
        missing = [n for n in names if not by.get(n)]
        if missing:
            print(f"[bench_pipeline] --compare-plot: no trace for {', '.join(missing)}; skipped", file=sys.stderr)
        else:
            plot_compare([(n, by[n]) for n in names], records, a.compare_plot)
            print(f"[bench_pipeline] timelines: {a.compare_plot}", file=sys.stderr)


def plot_bars(records: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sendrecv": "#c44e52", "allgather": "#dd8452", "broadcast": "#4c72b0", "signal": "#bbbbbb"}
    names = [r["config"] for r in records]
    ms = [r["ms_per_iter"] for r in records]
    err = [[m - r["ms_q1"] for m, r in zip(ms, records)], [r["ms_q3"] - m for m, r in zip(ms, records)]]
    fig, ax = plt.subplots(figsize=(2.0 + 1.05 * len(records), 4.2))
    bars = ax.bar(range(len(records)), ms, yerr=err, capsize=3, color=[colors[r["strategy"]] for r in records],
                  edgecolor="black", linewidth=0.6)
    for bar, r in zip(bars, records):
        if r["delay_wgrad"]:
            bar.set_hatch("//")
        lines = []
        if r["speedup_vs_baseline"] is not None:
            lines.append(f"{r['speedup_vs_baseline']:.2f}x")
        if r["strategy"] != "signal" and r["signal_fraction"] is not None:
            lines.append(f"{r['signal_fraction']:.0%} sig")
        ax.text(bar.get_x() + bar.get_width() / 2, r["ms_q3"] + 0.01 * max(ms),
                "\n".join(lines), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per iteration (median, q1–q3)")
    r0 = records[0]
    ax.set_title(f"{r0['model']} pp {r0['pp']} × tp {r0['tp']} × dp {r0['dp']}, {r0['microbatches']} microbatches, "
                 f"NIC {r0['nic_gbps']:g} Gbit/s ({r0['mode']}); labels: speedup vs {r0['baseline']}, "
                 "fraction of the signal bound", fontsize=8)
    ax.set_ylim(0, max(ms) * 1.25 + max(err[1]))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare(named: Sequence[tuple[str, list[dict[str, Any]]]], records: Sequence[dict[str, Any]],
                 path: str) -> None:
    """Measured timelines stacked (paper Figure 4), one common time axis in ms."""
    from megareshard.pipeline import Timeline
    from plot_schedule import draw  # tools/ is on sys.path when this file runs as a script

    by = {r["config"]: r for r in records}
    tls = []
    for name, tr in named:
        ms = [{**x, "start": 1e3 * x["start"], "end": 1e3 * x["end"]} for x in tr]
        r = by.get(name)
        label = name if r is None else f"{name} (median {r['ms_per_iter']:.0f} ms/iter)"
        tls.append(Timeline.from_trace(ms, name=label))
    draw(tls, Path(path), 0.0)


# ---- entry ------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    if os.environ.get(ENV_ARGV) is not None:  # started by main() below: arguments come via the environment
        return _worker(p.parse_args(json.loads(os.environ[ENV_ARGV])))
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if "RANK" in os.environ and not a.simulate:  # inside someone's torchrun (e.g. emulate_cluster.py)
        return _worker(a)
    try:
        check_args(a, None if a.simulate else a.nproc)
    except (ValueError, NotImplementedError) as e:
        print(f"bench_pipeline: {e}", file=sys.stderr)
        return 2
    if a.simulate:
        return _simulate(a)
    if a.from_json:
        return _replay(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           os.path.abspath(__file__)]
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", **{ENV_ARGV: json.dumps(argv)})
    print(f"[bench_pipeline] torchrun --standalone, {a.nproc} ranks", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=a.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its workers: our own session only
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        why = f"timed out after {a.timeout:.0f}s" if isinstance(e, subprocess.TimeoutExpired) else "interrupted"
        print(f"[bench_pipeline] stopped: {why}", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
