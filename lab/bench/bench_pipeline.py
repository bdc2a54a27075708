#!/usr/bin/env python
"""Pipeline schedules × cross-stage resharding strategies, side by side in one launch (paper §4–§5).

    # the NIC-rate grid (issue 13): both models, paced, every rate on the emulated cluster (root); writes
    # docs/results/pipeline_grid_MODEL.json and docs/img/pipeline_grid_MODEL.png, prints Markdown tables
    python -m lab.bench.bench_pipeline --grid
    python -m lab.bench.bench_pipeline --grid --dry-run          # each point's command and a wall-time estimate only
    python -m lab.bench.bench_pipeline --from-json docs/results/pipeline_grid_gpt.json   # redraw its tables and picture
    # one point by hand: one pipeline stage per host, tp 2 inside each host, slow NICs
    python -m lab.cluster.emulate_cluster --hosts 4 --procs-per-host 2 --nic-rate 100mbit -- \
        -m lab.bench.bench_pipeline --tp 2 --pp 4 --nic-gbps 0.1 --json out.json --plot bars.png \
        --trace-dir traces/ --compare-plot timelines.png
    # plain torchrun on this machine (no rate limit; a smoke run)
    python -m lab.bench.bench_pipeline --nproc 4 --tp 1 --pp 4 --configs 1f1b+allgather,1f1b+broadcast
    # no processes: the simulator with per-action costs (measured: --costs-from a JSON of a real run)
    python -m lab.bench.bench_pipeline --simulate --costs-from out.json --nic-gbps 0.1
    # redraw the table and pictures of a finished run
    python -m lab.bench.bench_pipeline --from-json out.json --trace-dir traces/ --plot bars.png --compare-plot cmp.png
    # the U-Transformer (skip edges across stages): same flags, --u-* for its shape
    python -m lab.cluster.emulate_cluster ... -- -m lab.bench.bench_pipeline --model utransformer --nic-gbps 0.2 ...

A configuration is ``SCHEDULE+STRATEGY[+dw]``: schedule gpipe|1f1b|eager-1f1b, strategy
sendrecv|allgather|broadcast|signal, ``+dw`` = delayed weight gradients. For every
(schedule, dw) pair used, ``SCHEDULE+signal[+dw]`` is added (unless ``--no-signal``): the
same run with 1-byte transfers, the upper bound of what communication can cost.

All configurations share ONE model, optimizer and batch; each has its own
``PipelineRuntime`` (its own resharders). Iterations are interleaved — round r runs one
iteration of every configuration — so slow drift of the machine's load hits all alike.
An iteration is timed between a barrier and the end of the optimizer step, as the max
over ranks; the median over ``--iters`` rounds after ``--warmup`` is reported.

Per configuration: ms/iteration, tokens/s, speedup over the baseline (``--baseline``, default
the Megatron-style ``1f1b+allgather``: send to one rank per receiving host, all-gather inside it),
gap closure = (t_baseline − t) / (t_baseline − t_signal), the share of what communication costs the
baseline that the configuration wins back, fraction of the signal upper bound = t(signal, same schedule) / t
and = min over all signal runs / t — each from medians, from the fastest round (``_min``)
and as the median of per-round ratios (``_paired``) —, the model's seconds per transfer at
``--nic-gbps`` (all edges a stage sends, for the busiest stage), and
the measured per-action times (F/B/I/W medians per stage, from the runtime's trace of
the last round). Rank 0 prints progress and the table, writes ``--json``, ``--plot``,
``--trace-dir`` (one ``CONFIG.json`` per config for ``tools/plot_schedule.py --trace``) and
``--compare-plot`` (measured timelines of ``--compare A,B`` stacked, paper Figure 4). A configuration
above 100 % of its own signal bound is marked void (``"void": true``, **void** in the tables): no
correct measurement can be, and a void number never counts as meeting a target. While running, rank 0
rewrites ``--json`` after every timed round (``"status": "running"``), so a run that is stopped leaves
its finished rounds behind.

``--grid`` runs, for each of ``--models``, one paced launch per operating point (``--points``, default
``grid_points.GRID_POINTS``: a NIC rate, optionally with another microbatch count or sequence length, fixed
before running with ``--choose-points``, which prints the simulator's prediction at every candidate) on
``lab/cluster/emulate_cluster.py`` (4 hosts × 2 ranks), with the baseline, the extra ``1f1b+sendrecv`` row,
the full method ``eager-1f1b+broadcast+dw`` and their signal runs. Every point started is reported: one that
fails, times out (``--point-timeout``) or is interrupted (Ctrl-C) is "stopped", with the rounds it finished.
Beside every measured point, the simulator's prediction at the same per-action budgets and rate. Per model:
the grid's JSON, a picture (speedup over the baseline and gap closure per point, measured and simulated) and
Markdown tables with two target lines (pipeline_grid.py): at every point where the baseline is below 90 % of
its signal bound the full method wins back >= 75 % of the gap; the full method at >= 90 % of its **physical
bound** (``physical_bound.py``: every rank's compute, every NIC side's bytes ÷ its rate, the fill-and-drain
critical path — the largest; a measurement below it is void) at every point.

``--pace auto`` emulates one dedicated device per rank: after the (unpaced) warm-up rounds,
every F/B/I/W of a stage is given a fixed wall time — a quantile of its warm-up durations ×
a margin, the same for every configuration — and an action that finishes early sleeps the
rest. The durations are the signal configurations' where they cover every kind (their 1-byte
transfers leave a compute action's tp collective nothing to wait for; a real transfer at a low
rate makes one tp rank wait inside it for its partner's input, which would count network time as
compute), else every configuration's. Without it, ranks that share a few CPU cores lend a stage's core to the other stages
while it waits for the network, which hides communication under *any* schedule and is
what no GPU stage can do. Compute then costs the same in every configuration and only
communication and scheduling differ; actions that outlast their budget are counted
(``pace_overruns``) and reported. Results of a paced run are labelled as such.

Inside torchrun (``RANK`` set, e.g. under ``lab/cluster/emulate_cluster.py``) this script is the
worker; otherwise it starts ``torchrun --standalone --nproc-per-node N`` on itself and
hands the arguments over in the environment (torchrun's own parser would claim
``--nproc``), or with ``--simulate`` runs no processes at all.
"""
from __future__ import annotations

import argparse
import copy
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

from lab import env_with_root, module_command
from lab.bench.physical_bound import refill_s
from lab.bench import pipeline_grid  # the grid's tables and picture
import lab.signal  # noqa: F401 (registers the `signal` bound these benchmarks run)
from lab.cluster.pacing import calibrate_pace, needed_kinds, pacer, parse_pace  # no torch import

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager-1f1b")
STRATEGY_NAMES = ("sendrecv", "allgather", "broadcast", "signal")
MODELS = ("gpt", "utransformer")
DEFAULT_CONFIGS = ("1f1b+sendrecv,1f1b+allgather,1f1b+broadcast,eager-1f1b+broadcast,"
                   "eager-1f1b+broadcast+dw,gpipe+broadcast")
GRID_CONFIGS = f"{pipeline_grid.BASELINE},{pipeline_grid.EXTRA},{pipeline_grid.METHOD}"
# The rates of the previous grid (issue 13), an example for --rates; the grid itself runs the operating points
# of grid_points.GRID_POINTS (chosen with --choose-points before running).
GRID_RATES = "10,20,40,80,160"
# what the grid runs per point unless given: few timed rounds (paced compute repeats to within a few %)
GRID_DEFAULTS = {"iters": 4, "warmup": 2, "microbatches": 8, "pace": "auto"}
RUN_DEFAULTS = {"iters": 10, "warmup": 2, "microbatches": 8, "pace": "none"}
# flags a grid point hands to its worker (the rest are the grid's own, or set per point)
WORKER_DESTS = ("configs", "no_signal", "baseline", "tp", "pp", "num_layers", "hidden_size", "num_attention_heads",
                "seq_length", "micro_batch_size", "microbatches", "vocab_size", "num_layers_per_stage", "u_levels",
                "u_widths", "u_blocks_per_level", "u_shorten_factor", "u_skip_merge", "reshard_scheduler",
                "reshard_chunks", "recv_posting", "iters", "warmup", "pace", "pace_quantile", "pace_margin")
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
    p.add_argument("--configs", default=None, help="comma list of SCHEDULE+STRATEGY[+dw] (default: "
                   f"{DEFAULT_CONFIGS}; with --grid: {GRID_CONFIGS})")
    p.add_argument("--no-signal", action="store_true", help="do not add the signal upper-bound runs")
    p.add_argument("--baseline", default="1f1b+allgather",
                   help="speedups and gap closure are relative to this configuration (default: the Megatron-style "
                        "baseline, send to one rank per receiving host then all-gather inside it)")
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
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per iteration (per dp rank; "
                   "default 8)")
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
    p.add_argument("--recv-posting", default=None, choices=("auto", "early", "grouped", "mixed"),
                   help="--pipeline-recv-posting of every configuration (default: the runtime's, auto)")
    p.add_argument("--reshard-chunks", type=int, default=None,
                   help="broadcast chunks per task (default: the network model's choice per task)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed rounds, one iteration of every config each (default 10; --grid: 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2)")
    p.add_argument("--nic-gbps", type=float, default=1.0,
                   help="NIC rate for the network model's per-transfer time (set it to the emulated rate)")
    p.add_argument("--json", default=None, help="write the records (a JSON list) here")
    p.add_argument("--plot", default=None, help="bar chart PNG of ms/iteration per configuration")
    p.add_argument("--trace-dir", default=None, help="write each configuration's measured timeline here")
    p.add_argument("--trace-every-round", action="store_true",
                   help="with --trace-dir: also every timed round's timeline, CONFIG.roundK.json (K from 1), written "
                        "between rounds (a round's spread can then be read off its own timeline)")
    p.add_argument("--compare", default="1f1b+allgather,eager-1f1b+broadcast+dw",
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
    p.add_argument("--pace", default=None,
                   help="emulate a dedicated device per rank: every F/B/I/W takes at least a fixed wall time "
                        "(a faster one sleeps the rest). 'none' (default); 'auto': after the warm-up rounds, "
                        "per stage and kind, --pace-quantile of the warm-up durations × --pace-margin; or "
                        "'F=60,B=120,I=90,W=30' (ms, every stage; every kind the configurations execute needs one). "
                        "--grid: default 'auto'")
    p.add_argument("--pace-quantile", type=float, default=0.9, help="--pace auto: quantile of warm-up durations")
    p.add_argument("--pace-margin", type=float, default=1.25, help="--pace auto: budget = quantile × this")
    g = p.add_argument_group("grid", "--grid: every model at every NIC rate, each point one run on the emulated "
                                     "cluster (lab/cluster/emulate_cluster.py, needs root)")
    g.add_argument("--grid", action="store_true", help="run the NIC-rate grid")
    g.add_argument("--models", default=",".join(MODELS), help="--grid: comma list of models")
    g.add_argument("--rates", default=None, help="--grid: NIC rates in Mbit/s, each direction (comma list): the points "
                   "are these rates at the flags' shape (default: --points)")
    g.add_argument("--points", default=None,
                   help="--grid: operating points RATE[:m=MICROBATCHES][:seq=SEQ_LENGTH], comma list (default: the "
                        "model's grid_points.GRID_POINTS, chosen with --choose-points before running); with "
                        "--choose-points: the candidates (default grid_points.CANDIDATES)")
    g.add_argument("--choose-points", action="store_true",
                   help="no run: the simulator's prediction at every candidate point (baseline and method, their "
                        "physical bounds, the point's wall time), per model of --models")
    g.add_argument("--method", default=pipeline_grid.METHOD, help="--grid: the configuration the target is about")
    g.add_argument("--point-timeout", type=float, default=900.0,
                   help="--grid: stop a point's run after this many seconds (it is reported as stopped)")
    g.add_argument("--dry-run", action="store_true",
                   help="--grid: print each point's command and the simulator's wall-time estimate; run nothing")
    g.add_argument("--estimate-costs", default=None,
                   help="--grid --dry-run: per-action ms for the estimate, 'gpt=FILE,utransformer=FILE' (JSON records "
                        "of a paced run, e.g. a grid point's); default --cost-f/b/i/w or F=10, B=2F")
    g.add_argument("--results-dir", default="docs/results", help="--grid: pipeline_grid_MODEL.json goes here")
    g.add_argument("--img-dir", default="docs/img", help="--grid: pipeline_grid_MODEL.png goes here")
    return p


def resolve_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags whose default depends on --grid (a grid point runs few, paced rounds)."""
    for k, v in (GRID_DEFAULTS if a.grid else RUN_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.configs is None:
        a.configs = GRID_CONFIGS if a.grid else DEFAULT_CONFIGS
    return a


def parse_rates(text: str) -> list[float]:
    """--rates: positive Mbit/s, distinct, kept in the order given (sorted ascending for the picture)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates {text!r}: write Mbit/s numbers separated by commas, e.g. {GRID_RATES}") from None
    if not rates or any(r <= 0 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--rates {text!r}: need at least one rate, every one > 0 and none twice")
    return sorted(rates)


def check_args(a: argparse.Namespace, world: int | None = None) -> list[BenchConfig]:
    resolve_defaults(a)
    configs = expand_configs(a.configs, not a.no_signal)
    base = parse_config(a.baseline)
    if base not in configs:
        raise ValueError(f"--baseline {a.baseline} is not among the configurations "
                         f"({', '.join(c.name for c in configs)})")
    if world is not None and world % (a.tp * a.pp):
        raise ValueError(f"{world} ranks are not divisible by tp {a.tp} × pp {a.pp}")
    if a.iters < 1 or a.warmup < 0 or a.microbatches < 1:
        raise ValueError("--iters must be >= 1, --warmup >= 0, --microbatches >= 1")
    if a.trace_every_round and not a.trace_dir:
        raise ValueError("--trace-every-round writes into --trace-dir: give one")
    parse_pace(a.pace, warmup=a.warmup, quantile=a.pace_quantile, margin=a.pace_margin,
               needed=needed_kinds(c.dw for c in configs))
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
            "--reshard-scheduler", a.reshard_scheduler, "--hidden-dropout", "0", "--attention-dropout", "0",
            # every configuration alike: the signal runs' undefined stage inputs may give a NaN loss, which the
            # check would stop on; the benchmark times the step without the check's all-reduce
            "--no-check-for-nan-in-loss-and-grad"]
    if a.reshard_chunks is not None:
        argv += ["--reshard-chunks", str(a.reshard_chunks)]
    if getattr(a, "recv_posting", None):
        argv += ["--pipeline-recv-posting", a.recv_posting]
    if a.procs_per_host:
        argv += ["--nproc-per-node", str(a.procs_per_host)]
    return argv + cfg.flags()


def parse_model_config(a: argparse.Namespace, c: BenchConfig, world: int):
    """(Config, model spec or None for the GPT) of one configuration."""
    if a.model == "gpt":
        from megareshard.arguments import parse_args

        return parse_args(model_argv(a, c, world), world_size=world), None
    from megareshard.arguments import parse_model_args

    return parse_model_args("utransformer", model_argv(a, c, world), world_size=world)


def graph_and_shapes(cfg, spec, layouts, batch: int):
    """The stage graph (chain + skip edges) and every edge's global tensor shape."""
    if spec is None:
        from megareshard.model_spec import get_model_spec

        spec = get_model_spec("gpt")
    return spec.graph(cfg, layouts), spec.edge_shapes(cfg, layouts, batch)


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
    dp = cfg.plan.dp
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
        side: dict[str, int] = {}  # "h{host} out|in": bytes of one microbatch, activations and gradients
        wire: dict[str, int] = {}  # per edge: the busiest NIC side's bytes of its smaller direction
        total = 0
        for e in graph.edges:
            src, dst = lay[e.src], lay[e.dst]
            if src.mesh == dst.mesh and src.hidden_spec == dst.hidden_spec:
                continue  # a local hand-off (virtual stages): nothing crosses ranks
            plans = [plan_resharding(shapes[e], a_.mesh, a_.hidden_spec, b_.mesh, b_.hidden_spec, strategy=strategy,
                                     scheduler=a.reshard_scheduler, itemsize=4, broadcast_chunks=a.reshard_chunks,
                                     time_budget_s=0.2) for a_, b_ in ((src, dst), (dst, src))]
            for h, (o, i) in net.host_bytes(plans[0]).items():
                host_out[h] = host_out.get(h, 0) + max(o, i)
            per_edge[str(e)] = net.predict(plans[0])
            stage_s[e.src] = stage_s.get(e.src, 0.0) + per_edge[str(e)]
            total = max(total, math.prod(shapes[e]) * 4)
            busiest = []
            for plan in plans:
                hb = net.host_bytes(plan)
                for h, (o, i) in hb.items():
                    side[f"h{h} out"] = side.get(f"h{h} out", 0) + o
                    side[f"h{h} in"] = side.get(f"h{h} in", 0) + i
                busiest.append(max((max(o, i) for o, i in hb.values()), default=0))
            wire[str(e)] = min(busiest)
        out[strategy] = {"nic_bytes": max(host_out.values(), default=0), "model_s": max(stage_s.values(), default=0.0),
                         "tensor_bytes": total, "edge_s": per_edge, "side_bytes": side, "wire_bytes": wire}
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

    from megareshard.pipeline.runtime import gather_trace
    from megareshard.pipeline.stage import stage_layouts
    from megareshard.training import Trainer, build_context, build_pipeline, init_distributed

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
    say("[bench_pipeline] " + trainer.pipeline.describe().replace("\n", "\n[bench_pipeline] "))
    hosts_of_stage = [list(lay.mesh.host_ids()) for lay in layouts]
    runtimes = [trainer.pipeline]
    for c, cfg in zip(configs[1:], cfgs[1:]):  # collective: every rank builds every edge, same order
        rt = build_pipeline(trainer.model_spec, cfg, ctx, layouts, finalize_grads=trainer.finalize_grads,
                            record_trace=True, dtype=trainer.params_dtype)
        runtimes.append(rt)
    runtimes[0].enable_trace()
    steps = [_Step(rt, trainer.optimizer) for rt in runtimes]
    batch = trainer._microbatches(trainer.train_data, next(trainer._train_iter))
    say(f"[bench_pipeline] {len(configs)} configurations, {len(batch)} microbatches of "
        f"{a.micro_batch_size}x{a.seq_length} tokens; {a.warmup} warm-up + {a.iters} timed rounds "
        f"(set-up {time.monotonic() - t_start:.1f}s)")

    kinds = needed_kinds(c.dw for c in configs)
    pace = parse_pace(a.pace, warmup=a.warmup, quantile=a.pace_quantile, margin=a.pace_margin, needed=kinds)
    # --pace auto calibrates on the signal configurations where they cover every kind: their transfers are 1 byte,
    # so their compute actions do not absorb a tp partner's wait for its input, as real transfers' do at low rates
    calib = [i for i, c in enumerate(configs) if c.strategy == "signal"]
    if not calib or not set(kinds) <= set(needed_kinds(configs[i].dw for i in calib)):
        calib = list(range(len(configs)))
    if pace == "auto":
        say("[bench_pipeline] --pace auto calibrates on " + ", ".join(configs[i].name for i in calib))
    stage = ctx.pp_rank()
    budgets: list[dict[str, float]] | None = None

    def set_pace(per_stage: list[dict[str, float]]) -> None:
        for rt in runtimes:
            pacer(rt).budgets = per_stage[stage]

    if isinstance(pace, dict):
        budgets = [dict(pace) for _ in range(a.pp)]
        set_pace(budgets)
    # --pace auto: the warm-up rounds run unpaced and calibrate; one more untimed round runs paced
    skip = a.warmup + (1 if pace == "auto" else 0)
    rounds = skip + a.iters
    overruns = torch.zeros(len(configs), 2, dtype=torch.float64)  # (count, excess µs) over ranks and rounds
    times = torch.zeros(len(configs), rounds, dtype=torch.float64)
    warm: list[list[dict[str, Any]] | None] = []  # --pace auto: every warm-up round's traces
    act_bytes: list[list[int] | None] = [None] * len(configs)  # measured in the first warm-up round (MAX per stage)

    def records_of(done: int, traces, status: str, summed_overruns=None) -> list[dict[str, Any]]:
        """Rank 0: the records of the first `done` timed rounds; overruns only once summed over ranks."""
        ms = [[1e3 * x for x in times[i, skip:skip + done].tolist()] for i in range(len(configs))]
        recs = make_records(a, configs, ms, traces or [None] * len(configs), world, procs_per_host,
                            mode="measured" if budgets is None else "measured, paced compute",
                            hosts_of_stage=hosts_of_stage,
                            costs=None if budgets is None else {
                                k.lower(): [1e3 * b[k] for b in budgets] if all(k in b for b in budgets) else None
                                for k in "FBIW"})
        for i, rec in enumerate(recs):
            rec.update(status=status, rounds_done=done, rounds_planned=a.iters, pace_ms=None if budgets is None else
                       [{k: round(1e3 * v, 3) for k, v in b.items()} for b in budgets])
            known = budgets is not None and summed_overruns is not None
            # actions (summed over ranks and timed rounds) whose real compute outlasted the budget, and their
            # excess over it, ms per iteration summed over ranks (an upper bound of what they added to the
            # iteration: overlapping excesses on different ranks count twice)
            rec["pace_overruns"] = int(summed_overruns[i, 0].item()) if known else None
            rec["pace_overrun_ms_per_iter"] = round(summed_overruns[i, 1].item() / 1e3 / done, 3) if known else None
            rec["peak_activation_bytes_measured"] = act_bytes[i]
        return recs

    for r in range(rounds):
        if pace == "auto" and r == a.warmup:
            box: list[Any] = [None]
            if rank == 0:  # an error (a kind never traced) goes to every rank, so none waits forever
                try:
                    box = [calibrate_pace(warm, a.pp, a.pace_quantile, a.pace_margin, needed=kinds)]
                except ValueError as e:
                    box = [str(e)]
            if dist.is_initialized():
                dist.broadcast_object_list(box, src=0)
            if isinstance(box[0], str):
                raise ValueError(box[0])
            budgets = box[0]
            set_pace(budgets)
            say("[bench_pipeline] paced compute (ms, per stage): " + "; ".join(
                f"stage {s} " + " ".join(f"{k}={1e3 * v:.0f}" for k, v in b.items()) for s, b in enumerate(budgets)))
        t_round = time.monotonic()
        for i, step in enumerate(steps):
            trainer.forward_backward_fn = step
            if dist.is_initialized():
                dist.barrier()
                time.sleep(refill_s(a.nic_gbps))  # every configuration starts with full token buckets
            measure = r == 0 and skip > 0  # the activation meter slows a step: only in an untimed round
            if measure:
                trainer.memory = None  # train_step measures activations (collective) when it has none
            t0 = time.perf_counter()
            trainer.train_step(batch)
            times[i, r] = time.perf_counter() - t0
            if measure:
                act_bytes[i] = [m.activations for m in trainer.memory]
            if r >= skip:
                st = step.runtime.last_stats
                overruns[i, 0] += st.get("pace_overruns", 0)
                overruns[i, 1] += st.get("pace_overrun_us", 0)
        if pace == "auto" and r < a.warmup:
            traces = [gather_trace(ctx, rt.last_trace) for rt in runtimes]  # collective
            warm += [traces[i] for i in calib]
        if a.trace_dir and a.trace_every_round and r >= skip:  # collective, between the timed steps
            traces = [gather_trace(ctx, rt.last_trace) for rt in runtimes]
            if rank == 0:
                write_traces(a.trace_dir, configs, traces, f".round{r + 1 - skip}")
        if dist.is_initialized():
            mx = times[:, r].clone()
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            times[:, r] = mx
        if rank == 0 and r >= skip and a.json:  # what a stopped run leaves: every finished timed round
            write_json(a.json, records_of(r + 1 - skip, None, "running"))
        tag = "warm-up" if r < a.warmup else "paced warm-up" if r < skip else "timed"
        say(f"[bench_pipeline] round {r + 1}/{rounds} ({tag}, {time.monotonic() - t_round:.1f}s, total "
            f"{time.monotonic() - t_start:.0f}s): " + ", ".join(
                f"{c.name} {1e3 * times[i, r]:.0f}" for i, c in enumerate(configs)) + " ms")

    traces = [gather_trace(ctx, rt.last_trace) for rt in runtimes]  # collective
    if dist.is_initialized():
        dist.all_reduce(overruns)
    if rank == 0:
        records = records_of(a.iters, traces, "complete", overruns)
        if budgets is not None:
            print("[bench_pipeline] paced compute: actions over budget (all ranks, timed rounds) and their excess "
                  "(ms per iteration, summed over ranks): " + ", ".join(
                      f"{r['config']} {r['pace_overruns']} / {r['pace_overrun_ms_per_iter']:.0f}" for r in records),
                  file=sys.stderr)
        finish(a, records, traces, configs)
    if dist.is_initialized():
        dist.barrier()
    trainer.close()
    for rt in runtimes:  # every configuration's stream threads joined and communicators destroyed (collective)
        rt.close()
    return 0


def make_records(a: argparse.Namespace, configs: Sequence[BenchConfig], ms: Sequence[Sequence[float]],
                 traces: Sequence[list[dict[str, Any]] | None], world: int, procs_per_host: int, *, mode: str,
                 hosts_of_stage: list[list[int]] | None = None, costs: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """`costs`: the per-stage F/B/I/W ms the configurations' compute costs (the paced budgets, or the simulated
    costs) for the physical bound; None: the signal runs' measured action medians, where traced."""
    from megareshard.pipeline import Timeline, generate, simulate

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
            # peak microbatches whose activations a stage holds at once (F until B, or W): from the trace, and the
            # simulator's on the chain schedule at unit costs (docs/design.md §4, "memory shown")
            "peak_inflight_measured": Timeline.from_trace(tr).peak_activations if tr else None,
            "peak_inflight_simulated": simulate(generate(c.schedule, a.pp, a.microbatches,
                                                         delay_wgrad=c.dw)).peak_activations,
        })
    fill_physical(a, configs, recs, net, costs, world, procs_per_host)
    fill_ratios(recs, a.baseline)
    return recs


def _graph(a: argparse.Namespace, configs: Sequence[BenchConfig], world: int, pph: int):
    """The model's stage graph (None: the GPT's chain)."""
    if a.model == "gpt":
        return None
    from megareshard.parallel import Topology

    cfg, spec = parse_model_config(a, configs[0], world)
    return spec.graph(cfg, spec.stage_layouts(cfg, Topology(world, tp=a.tp, pp=a.pp, nproc_per_node=pph)))


def fill_physical(a: argparse.Namespace, configs: Sequence[BenchConfig], recs: list[dict[str, Any]],
                  net: dict[str, Any], costs: dict[str, Any] | None, world: int, pph: int) -> None:
    """Per record: ``physical`` (lab/bench/physical_bound.py: compute, NIC and critical-path terms, the bound and
    which term binds) at `costs`, or at the signal runs' measured action medians (``physical_costs``)."""
    from megareshard.pipeline import Costs, generate
    from lab.bench.physical_bound import physical_bound

    source = "paced budgets" if costs is not None else "measured action medians"
    if costs is None:
        try:
            costs = costs_from_records(recs, a.pp)
        except ValueError:  # no traces yet (a run's intermediate records): no bound
            return
    costs = _costs_filled(costs, a.pp)
    graph = _graph(a, configs, world, pph)
    for c, r in zip(configs, recs):
        n = net[c.strategy]
        sched = generate(c.schedule, a.pp, a.microbatches, delay_wgrad=c.dw, graph=graph)
        pb = physical_bound(sched, Costs(f=costs["f"], b=costs["b"], i=costs["i"], w=costs["w"]), n["wire_bytes"],
                            n["side_bytes"], a.microbatches, a.nic_gbps)
        r["physical"] = pb.record()
        r["physical_costs"] = source


def _costs_filled(m: dict[str, Any], pp: int) -> dict[str, Any]:
    """Missing kinds of a cost dict filled as `_costs` does (B = 2F, I = B/2, W = B − I)."""
    f = m["f"] or [10.0] * pp
    b = m["b"] or [2 * x for x in f]
    i = m["i"] or [x / 2 for x in b]
    w = m["w"] or [x - y for x, y in zip(b, i)]
    return {"f": f, "b": b, "i": i, "w": w}


def fill_ratios(recs: list[dict[str, Any]], baseline: str) -> None:
    """speedup_vs_baseline, signal_ms/signal_fraction (same schedule) and best_signal_fraction, from medians;
    the same from the fastest round (``*_min``: least disturbed by outside load); and ``*_paired``: the
    median over rounds of the per-round ratio (both runs of a ratio come from the same round).

    ``gap_closure`` = (t_baseline − t) / (t_baseline − t_signal), t_signal the configuration's own signal run
    (same schedule and delayed-W setting): the share of what communication costs the baseline that this
    configuration wins back (None where that gap is not positive). ``void``: the configuration is above 100 %
    of its own signal bound (median), which no correct measurement can be; a void number never counts."""
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
        r["gap_closure"] = gap_closure(base["ms_per_iter"] if base else None, r["ms_per_iter"], r["signal_ms"])
        r["void"] = r["strategy"] != "signal" and r["signal_fraction"] is not None and r["signal_fraction"] > 1.0
        if "ms_min" in r:
            r["speedup_vs_baseline_min"] = base["ms_min"] / r["ms_min"] if base else None
            r["signal_fraction_min"] = sig["ms_min"] / r["ms_min"] if sig else None
            r["best_signal_fraction_min"] = best_min / r["ms_min"] if best_min else None
            r["speedup_vs_baseline_paired"] = paired(base, r)
            r["signal_fraction_paired"] = paired(sig, r)
    from lab.bench.physical_bound import fill

    fill(recs, baseline)  # physical_fraction, physical_gap_closure, physical_void
    for r in recs:
        r["void"] = r["void"] or (r["strategy"] != "signal" and r["physical_void"])


def gap_closure(t_baseline: float | None, t: float, t_signal: float | None) -> float | None:
    """(t_baseline − t) / (t_baseline − t_signal); None without both times or when the gap is not positive."""
    if t_baseline is None or t_signal is None or t_baseline - t_signal <= 0:
        return None
    return (t_baseline - t) / (t_baseline - t_signal)


# ---- simulate --------------------------------------------------------------------------------------
def costs_from_records(recs: Sequence[dict[str, Any]], pp: int, source: str = "records") -> dict[str, Any]:
    """Per-stage F/B/I/W ms of a measured run: a paced run's budgets (``pace_ms``: what each action costs
    its emulated device, the same for every configuration), else the median action_ms of the signal runs
    (no waiting inside F/B), else of any run. Kinds the run did not execute are None."""
    paced = next((r["pace_ms"] for r in recs if r.get("pace_ms")), None)
    if paced:
        return {k.lower(): ([b[k] for b in paced] if all(k in b for b in paced) else None) for k in "FBIW"}
    pool = [r for r in recs if r.get("strategy") == "signal" and r.get("action_ms")] or \
           [r for r in recs if r.get("action_ms")]
    if not pool:
        raise ValueError(f"{source} has neither pace_ms nor action_ms (per-action times of a measured run)")

    def per_stage(kind: str) -> list[float] | None:
        rows = [r["action_ms"][kind] for r in pool if kind in r["action_ms"]]
        if not rows:
            return None
        return [statistics.median(row[s] for row in rows if row[s] is not None) for s in range(pp)]

    return {k.lower(): per_stage(k) for k in "FBIW"}


def load_cost_records(path: str) -> list[dict[str, Any]]:
    """A run's records, or a grid JSON's first point that has records (every point shares its budgets)."""
    data = json.load(open(path))
    if isinstance(data, dict) and data.get("kind") == pipeline_grid.GRID_KIND:
        data = next((pt["records"] for pt in data["points"] if pt.get("records")), [])
    if not isinstance(data, list):
        raise ValueError(f"{path} is neither a list of records nor a grid JSON")
    return data


def _costs(a: argparse.Namespace, configs: Sequence[BenchConfig]) -> dict[str, Any]:
    """Per-stage F/B/I/W costs (ms): --cost-* win, else a measured run's (``costs_from_records``), else F=10, B=2F."""
    f = b = i = w = None
    if a.costs_from:
        m = costs_from_records(load_cost_records(a.costs_from), a.pp, a.costs_from)
        f, b, i, w = m["f"], m["b"], m["i"], m["w"]
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


def simulate_records(a: argparse.Namespace, configs: Sequence[BenchConfig], costs: dict[str, Any], world: int,
                     pph: int) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Records (mode "simulated") and traces of every configuration under the simulator, each stage on its
    own device, every edge's transfer time from the network model at ``a.nic_gbps``."""
    from megareshard.pipeline import Costs, generate, simulate

    net = edge_transfer_model(a, configs, world, pph)
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
    return make_records(a, configs, ms, traces, world, pph, mode="simulated", costs=costs), traces


def _simulate(a: argparse.Namespace) -> int:
    configs = check_args(a)
    world = a.tp * a.pp
    pph = a.procs_per_host or (world // (a.hosts or a.pp))
    costs = _costs(a, configs)
    print(f"[bench_pipeline] simulate: pp {a.pp}, tp {a.tp}, {a.microbatches} microbatches, {pph} ranks/host, "
          f"NIC {a.nic_gbps} Gbit/s; ms per action F {costs['f']} B {costs['b']} I {costs['i']} W {costs['w']}",
          file=sys.stderr)
    records, traces = simulate_records(a, configs, costs, world, pph)
    finish(a, records, traces, configs)
    return 0


def _replay(a: argparse.Namespace) -> int:
    records = json.load(open(a.from_json))
    if isinstance(records, dict) and records.get("kind") == pipeline_grid.GRID_KIND:
        print(pipeline_grid.format_grid(records, format_table), flush=True)
        picture = a.plot or records.get("picture")
        if picture:
            pipeline_grid.plot_grid(records, picture)
            print(f"[bench_pipeline] picture: {picture}", file=sys.stderr)
        return 0
    configs = [parse_config(r["config"]) for r in records]
    traces = []
    for c in configs:
        f = Path(a.trace_dir or "", f"{c.name}.json")
        traces.append(json.loads(f.read_text()) if a.trace_dir and f.exists() else None)
    a.trace_dir = None  # read, not written
    a.json = None if a.json == a.from_json else a.json
    finish(a, records, traces, configs)
    return 0


# ---- the grid: every model at every NIC rate on the emulated cluster ----------------------------------
def grid_shape(a: argparse.Namespace) -> tuple[int, int]:
    """(hosts, ranks per host) of the grid's emulated cluster: one stage per host, tp ranks in each."""
    return a.hosts or a.pp, a.procs_per_host or a.tp


def worker_argv(p: argparse.ArgumentParser, a: argparse.Namespace, model: str, rate: float, json_path: str) -> list[str]:
    """The bench_pipeline.py arguments of one grid point (forwarded flags, then the point's own)."""
    out: list[str] = []
    for act in p._actions:
        v = getattr(a, act.dest, None)
        if act.dest not in WORKER_DESTS or v is None or v is False:
            continue
        out += [act.option_strings[-1]] if v is True else [act.option_strings[-1], str(v)]
    return out + ["--model", model, "--nic-gbps", f"{rate / 1e3:g}", "--procs-per-host", str(grid_shape(a)[1]),
                  "--json", json_path]


def point_from_run(rate: float, rc: int | None, records: list[dict[str, Any]] | None, reason: str | None,
                   wall_s: float, rounds_planned: int) -> dict[str, Any]:
    """One grid point from its run's exit and JSON: "complete" only if it exited 0 with its final records;
    otherwise "stopped", keeping whatever timed rounds it finished (never dropped)."""
    done = records[0].get("rounds_done", 0) if records else 0
    complete = rc == 0 and bool(records) and records[0].get("status") == "complete"
    if not complete:
        reason = reason or (f"exit code {rc}" if rc else "ended without its final records")
        for r in records or []:
            r["status"] = "stopped"
    return {"rate_mbit": rate, "status": "complete" if complete else "stopped", "reason": None if complete else reason,
            "rc": rc, "wall_s": round(wall_s, 1), "rounds_done": done, "rounds_planned": rounds_planned,
            "records": records or [], "simulated": None}


def _run_point(cmd: list[str], timeout_s: float) -> tuple[int | None, str | None]:
    """Run one point's emulated cluster; (exit code, reason it stopped or None). Ctrl-C reaches the cluster
    too (same process group), which tears itself down; it is waited for, then KeyboardInterrupt goes on."""
    proc = subprocess.Popen(cmd, env=env_with_root())
    try:
        rc = proc.wait(timeout=timeout_s + 120)  # the cluster's own --timeout fires first
    except subprocess.TimeoutExpired:
        proc.terminate()
        return proc.wait(), f"no exit {timeout_s + 120:.0f} s after start"
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait()
        raise
    return rc, (f"timed out after {timeout_s:.0f} s" if rc == 124 else None)


def point_command(p: argparse.ArgumentParser, a: argparse.Namespace, model: str, rate: float, out: str) -> list[str]:
    """One grid point: the emulated cluster at `rate` running this tool's worker for `model`."""
    hosts, pph = grid_shape(a)
    return module_command("lab.cluster.emulate_cluster", [
        "--hosts", str(hosts), "--procs-per-host", str(pph), "--nic-rate", f"{round(rate * 1e3)}kbit", "--timeout",
        f"{a.point_timeout:g}", "--", "-m", "lab.bench.bench_pipeline", *worker_argv(p, a, model, rate, out)])


def estimate_point_s(records: Sequence[dict[str, Any]], a: argparse.Namespace, setup_s: float) -> float:
    """Wall seconds of one point from simulated iteration times: every round runs every configuration once
    (warm-up, one paced warm-up with --pace auto, timed rounds), plus `setup_s` (start, model, resharders)."""
    rounds = a.warmup + (1 if a.pace == "auto" else 0) + a.iters
    return setup_s + rounds * sum(r["ms_per_iter"] for r in records) / 1e3


GRID_SETUP_S = 30.0  # start-up of one point (torchrun on 4 namespaces, model, every configuration's resharders)


def grid_points_of(a: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    """The grid's operating points for `model`: --rates (at the flags' shape), else --points, else GRID_POINTS."""
    from lab.bench.grid_points import GRID_POINTS, parse_points

    if a.rates:
        return [{"rate_mbit": r, "overrides": {}, "label": f"{r:g}", "text": f"{r:g}"} for r in parse_rates(a.rates)]
    return parse_points(a.points or GRID_POINTS[model])


def _grid_costs(a: argparse.Namespace, model: str, configs: list[BenchConfig]) -> dict[str, Any]:
    """Per-action costs for the grid's estimates: --estimate-costs, else the committed grid's (the highest-rate
    complete point's budgets, grid_points.reference_costs), else --cost-f/b/i/w or F=10, B=2F."""
    from lab.bench.grid_points import reference_costs

    files = dict(x.split("=", 1) for x in (a.estimate_costs or "").split(",") if x.strip())
    if model in files:
        return costs_from_records(load_cost_records(files[model]), a.pp, files[model])
    committed = os.path.join(a.results_dir, f"pipeline_grid_{model}.json")
    if os.path.exists(committed) and a.cost_f is None:
        try:
            return reference_costs(committed, a.pp)[0]
        except ValueError:
            pass
    pa = copy.copy(a)
    pa.model = model
    return _costs(pa, configs)


def _grid_dry_run(p: argparse.ArgumentParser, a: argparse.Namespace, models: list[str],
                  configs: list[BenchConfig]) -> int:
    hosts, pph = grid_shape(a)
    total = 0.0
    for m in models:
        costs, per_model = _grid_costs(a, m, configs), 0.0
        for pt in grid_points_of(a, m):
            pa = _at(a, m, pt)
            est = estimate_point_s(simulate_records(pa, configs, _shape_costs(a, pt, costs), hosts * pph, pph)[0], pa,
                                   GRID_SETUP_S)
            per_model += est
            print(f"# {m} {pt['label']} Mbit/s: about {est / 60:.1f} min (simulated, plus {GRID_SETUP_S:.0f} s set-up)")
            print(" ".join(point_command(p, pa, m, pt["rate_mbit"],
                                         os.path.join(a.results_dir, f"{m}-{pt['text']}.part.json"))))
        print(f"# {m}: about {per_model / 60:.0f} min")
        total += per_model
    print(f"# whole grid: about {total / 60:.0f} min")
    return 0


def _at(a: argparse.Namespace, model: str, point: dict[str, Any]) -> argparse.Namespace:
    from lab.bench.grid_points import apply_point

    pa = apply_point(a, point)
    pa.model = model
    return pa


def _shape_costs(a: argparse.Namespace, point: dict[str, Any], costs: dict[str, Any]) -> dict[str, Any]:
    """Costs at a point that changes the sequence length: scaled by the tokens per microbatch (grid_points)."""
    from lab.bench.grid_points import scale_costs

    seq = point["overrides"].get("seq_length")
    return scale_costs(costs, seq / a.seq_length) if seq else costs


def _choose_points(a: argparse.Namespace) -> int:
    """--choose-points: the simulator's prediction at every candidate, per model (grid_points.choose)."""
    from lab.bench.grid_points import CANDIDATES, GRID_POINTS, choose, parse_points, reference_costs

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    hosts, pph = grid_shape(a)
    configs = check_args(a, hosts * pph)
    for m in models:
        path = os.path.join(a.results_dir, f"pipeline_grid_{m}.json")
        if a.estimate_costs or a.cost_f is not None:
            costs, where = _grid_costs(a, m, configs), a.estimate_costs or "--cost-*"
        else:
            costs, where = reference_costs(path, a.pp)

        def predict(pt, m=m, costs=costs):
            pa = _at(a, m, pt)
            recs = simulate_records(pa, configs, _shape_costs(a, pt, costs), hosts * pph, pph)[0]
            by = {r["config"]: r for r in recs}
            return by[a.baseline], by[parse_config(a.method).name], estimate_point_s(recs, pa, GRID_SETUP_S)

        chosen = [pt["text"] for pt in parse_points(GRID_POINTS[m])]
        print(choose(parse_points(a.points or CANDIDATES), predict, chosen,
                     f"{m}: {hosts} hosts × {pph}, tp {a.tp}, pp {a.pp}, costs of {where}"), flush=True)
        print()
    return 0


def _grid(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    import tempfile

    from lab.cluster.emulate_cluster import check_privileges

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        raise ValueError(f"--models {a.models!r}: each of {', '.join(MODELS)}")
    hosts, pph = grid_shape(a)
    configs = check_args(a, hosts * pph)
    names = [c.name for c in configs]
    method = parse_config(a.method).name
    if method not in names:
        raise ValueError(f"--method {method} is not among the configurations ({', '.join(names)})")
    points = {m: grid_points_of(a, m) for m in models}  # every point checked before anything runs
    if a.dry_run:
        return _grid_dry_run(p, a, models, configs)
    check_privileges()  # ClusterError: one line, before anything runs
    os.makedirs(a.results_dir, exist_ok=True)
    os.makedirs(a.img_dir, exist_ok=True)
    cluster = f"{hosts} hosts × {pph} ranks, tp {a.tp}, pp {a.pp}, {a.microbatches} microbatches, --pace {a.pace}"
    grids = {m: {"kind": pipeline_grid.GRID_KIND, "model": m, "rates_mbit": [pt["rate_mbit"] for pt in points[m]],
                 "baseline": a.baseline,
                 "method": method, "extra": pipeline_grid.EXTRA if pipeline_grid.EXTRA in names else None,
                 "configs": names, "cluster": cluster,
                 "target": {"baseline_below": pipeline_grid.BELOW, "gap_closure_at_least": pipeline_grid.CLOSURE,
                            "method_physical_at_least": pipeline_grid.PHYSICAL},
                 "command": " ".join(["python -m lab.bench.bench_pipeline"] + sys.argv[1:]),
                 "picture": os.path.join(a.img_dir, f"pipeline_grid_{m}.png"),
                 "points": [{"rate_mbit": pt["rate_mbit"], "label": pt["label"], "overrides": pt["overrides"],
                             "status": "not run", "reason": None, "records": [], "simulated": None}
                            for pt in points[m]]} for m in models}
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-grid-") as tmp:
        for m in models:
            if interrupted:  # the models not started keep no file: nothing of them ran
                break
            grid, path = grids[m], os.path.join(a.results_dir, f"pipeline_grid_{m}.json")
            for k, pt in enumerate(points[m]):
                if interrupted:
                    break
                pa = _at(a, m, pt)
                out = os.path.join(tmp, f"{m}-{k}.json")
                cmd = point_command(p, pa, m, pt["rate_mbit"], out)
                print(f"[bench_pipeline] grid {m} {pt['label']} Mbit/s: {' '.join(cmd)}", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                try:
                    rc, reason = _run_point(cmd, a.point_timeout)
                except KeyboardInterrupt:
                    rc, reason, interrupted = None, "interrupted (Ctrl-C)", True
                recs = json.load(open(out)) if os.path.exists(out) else None
                point = point_from_run(pt["rate_mbit"], rc, recs, reason, time.monotonic() - t0, a.iters)
                point.update(label=pt["label"], overrides=pt["overrides"])
                if point["records"]:  # the simulator's prediction at the same budgets and rate
                    try:
                        costs = costs_from_records(point["records"], a.pp)
                    except ValueError as e:  # unpaced and stopped before its traces: nothing to feed it
                        print(f"[bench_pipeline] grid {m} {pt['label']} Mbit/s: no prediction: {e}", file=sys.stderr)
                    else:
                        point["simulated"] = simulate_records(pa, configs, costs, hosts * pph, pph)[0]
                grid["points"][k] = point
                write_json(path, grid)  # after every point: a stopped grid keeps what it ran
            print(pipeline_grid.format_grid(grid, format_table), flush=True)
            pipeline_grid.plot_grid(grid, grid["picture"])
            print(f"[bench_pipeline] grid {m}: {path}, {grid['picture']}", file=sys.stderr)
    return 130 if interrupted else 0


# ---- output -----------------------------------------------------------------------------------------
def format_table(records: Sequence[dict[str, Any]]) -> str:
    """One Markdown table of a run's records (ready to paste into docs/benchmarks.md)."""
    def pct(v):
        return "-" if v is None else f"{v:.0%}"

    def x(v):
        return "-" if v is None else f"{v:.2f}×"

    r0 = records[0]
    head = ["config", "ms/iter median", "q1–q3", "min", f"vs {r0['baseline']} (median / paired / min)",
            "gap closure", "of signal, same schedule (median / paired / min)", "of best signal",
            "physical bound ms (binding)", "of physical bound", "gap closure vs physical", "model ms / transfer",
            "peak in flight per stage (measured / simulated)", "peak activations MiB per stage (measured)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if r0.get("status") not in (None, "complete"):  # a stopped (or still running) launch: say so first
        lines.insert(0, f"*{r0['status']} after {r0.get('rounds_done')} of {r0.get('rounds_planned')} timed rounds"
                        + (f" ({r0['stop_reason']})" if r0.get("stop_reason") else "") + "*\n")
    for r in records:
        sig = f"{pct(r['signal_fraction'])} / {pct(r.get('signal_fraction_paired'))} / {pct(r.get('signal_fraction_min'))}"
        if r.get("void"):
            sig = f"**void** ({sig})"
        row = [r["config"], f"{r['ms_per_iter']:.0f}", f"{r['ms_q1']:.0f}–{r['ms_q3']:.0f}",
               f"{r.get('ms_min', r['ms_per_iter']):.0f}",
               f"{x(r['speedup_vs_baseline'])} / {x(r.get('speedup_vs_baseline_paired'))} / "
               f"{x(r.get('speedup_vs_baseline_min'))}",
               "-" if r["strategy"] == "signal" or r["config"] == r["baseline"] else pct(r.get("gap_closure")),
               sig, pct(r["best_signal_fraction"]), _physical_cell(r),
               (f"**void** ({pct(r.get('physical_fraction'))})" if r.get("physical_void")
                else pct(r.get("physical_fraction"))),
               "-" if r["config"] == r["baseline"] else pct(r.get("physical_gap_closure")),
               f"{r['transfer_model_ms']:.1f}",
               " / ".join(",".join(map(str, v)) if v else "-" for v in (r.get("peak_inflight_measured"),
                                                                         r.get("peak_inflight_simulated"))),
               ",".join(f"{b / 2**20:.1f}" for b in r["peak_activation_bytes_measured"])
               if r.get("peak_activation_bytes_measured") else "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _physical_cell(r: dict[str, Any]) -> str:
    pb = r.get("physical")
    return "-" if not pb else f"{pb['bound_ms']:.0f} ({pb['binding']})"


def write_traces(trace_dir: str, configs: Sequence[BenchConfig], traces: Sequence[list[dict[str, Any]] | None],
                 suffix: str = "") -> None:
    """Each configuration's trace as ``CONFIG{suffix}.json`` in `trace_dir` (configurations without one: none)."""
    from megareshard.pipeline.runtime import write_trace

    os.makedirs(trace_dir, exist_ok=True)
    for c, tr in zip(configs, traces):
        if tr:
            write_trace(os.path.join(trace_dir, f"{c.name}{suffix}.json"), tr)


def finish(a: argparse.Namespace, records: list[dict[str, Any]], traces: Sequence[list[dict[str, Any]] | None],
           configs: Sequence[BenchConfig]) -> None:
    print(format_table(records), flush=True)
    if a.json:
        write_json(a.json, records)
        print(f"[bench_pipeline] records: {a.json}", file=sys.stderr)
    if a.trace_dir:
        write_traces(a.trace_dir, configs, traces)
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


def write_json(path: str, data: Any) -> None:
    """Write `data` as JSON to `path` through a temporary file beside it, so a reader (or a run stopped
    half-way through a write) never sees half a file."""
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


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
    from megareshard.pipeline.draw import draw

    by = {r["config"]: r for r in records}
    tls = []
    for name, tr in named:
        ms = [{**x, "start": 1e3 * x["start"], "end": 1e3 * x["end"]} for x in tr]
        r = by.get(name)
        label = name if r is None else f"{name} (median {r['ms_per_iter']:.0f} ms/iter)"
        tls.append(Timeline.from_trace(ms, name=label))
    draw(tls, Path(path), 0.0, "ms")


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
        if a.choose_points:
            a.grid = True  # the grid's configurations and rounds
            return _choose_points(a)
        if a.grid:
            return _grid(p, a)
        check_args(a, None if a.simulate else a.nproc)
    except (ValueError, NotImplementedError, OSError) as e:  # emulate_cluster's ClusterError is a RuntimeError
        print(f"bench_pipeline: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"bench_pipeline: {e}", file=sys.stderr)
        return 2
    if a.simulate:
        return _simulate(a)
    if a.from_json:
        return _replay(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           "-m", "lab.bench.bench_pipeline"]
    env = env_with_root(WANDB_MODE="disabled", OMP_NUM_THREADS="1", **{ENV_ARGV: json.dumps(argv)})
    print(f"[bench_pipeline] torchrun --standalone, {a.nproc} ranks", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=a.timeout)
        if rc:
            mark_stopped(a.json, f"exit code {rc}")
        return rc
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
        mark_stopped(a.json, why)
        return 124


def mark_stopped(path: str | None, reason: str) -> None:
    """A stopped launch's --json (the rounds it finished) is marked "stopped", with the reason."""
    if not path or not os.path.exists(path):
        if path:
            print(f"[bench_pipeline] stopped before its first timed round: no {path}", file=sys.stderr)
        return
    records = json.load(open(path))
    for r in records:
        if r.get("status") != "complete":
            r.update(status="stopped", stop_reason=reason)
    write_json(path, records)
    print(f"[bench_pipeline] {path}: {records[0].get('rounds_done') if records else 0} finished timed rounds, "
          f"marked stopped", file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
