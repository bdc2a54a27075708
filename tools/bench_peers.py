#!/usr/bin/env python
"""megareshard's pipeline schedules against torch.distributed.pipelining's, side by side in one launch.

    # the grid (the lead runs it alone): every NIC rate of GRID_RATES, tp 1 and tp 2, 4 emulated hosts (root);
    # writes docs/results/peers_pp4.json and docs/img/peers_pp4.png, prints Markdown tables
    tools/bench_peers.py --grid
    tools/bench_peers.py --grid --dry-run        # each point's command and a wall-time estimate only
    tools/bench_peers.py --from-json docs/results/peers_pp4.json [--plot X.png]   # redraw
    # one point by hand
    tools/emulate_cluster.py --hosts 4 --procs-per-host 2 --nic-rate 40mbit -- \
        tools/bench_peers.py --tp 2 --pp 4 --nic-gbps 0.04 --pace auto --json out.json --plot out.png
    # plain torchrun on this machine (a smoke run; no rate limit)
    python tools/bench_peers.py --tp 1 --pp 4 --iters 2 --warmup 1

Participants. megareshard: every schedule of ``REGISTRY`` the runtime executes (``runtime=True``) with one
stage per rank, each with ``allgather`` (the Megatron-style baseline) and ``broadcast`` (its best
strategy), the full method ``eager-1f1b+broadcast+dw``, and a ``signal`` run (1-byte transfers: the
upper bound of what communication can cost) per (schedule, delayed W). torch: every schedule of
``peers_torch.PEER_SCHEDULES`` (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV); one that cannot be built or
cannot step here is reported "failed" with its reason (each runs on pipeline groups of its own with a
short timeout, so a peer that hangs fails alone). Virtual-stage schedules of megareshard are listed as
not run until the bench builds per-schedule chunks for them (they need the trainer's chunk builder).

Same model, same arithmetic: one ``GPTModel`` configuration (untied output layer, no dropout), the same
batch and seed; torch's stages are ``GPTModel`` chunks (``layer_range``) of the same layers, the loss is
ours. Every participant's loss on the first step is compared with the baseline's (``loss - ref``; the
tolerance 2·m·2⁻²⁴·|loss| is the reordering of the m per-microbatch fp32 terms — everything else is the
same kernels on the same tensors). Parameters are not updated (no optimizer step is timed or run):
an iteration is the forward and backward of every microbatch plus the gradient reductions.

Method (as tools/bench_pipeline.py): rounds interleave the participants (round r runs one iteration of
each), an iteration is timed from a barrier to the end of its backward, max over ranks; the median of
``--iters`` timed rounds after ``--warmup`` unpaced rounds is reported. ``--pace auto`` calibrates per
stage F/B/I/W budgets on megareshard's warm-up traces (``pacing.calibrate_pace``) and pads every compute
action of every participant to them (torch's: ``peers_torch.pace_stage``; a chunk holding a share of a
rank's layers gets that share of the budget). Per participant: ms/iteration, throughput ratio to
torch's best and to the baseline, fraction of the signal bound (megareshard), bubble fraction per stage
(measured idle / iteration span, last timed round), peak saved-activation bytes per stage
(``peers_torch.LifetimeMeter`` over the last warm-up round) and the simulator's prediction
(``megareshard.pipeline.simulate`` with the paced budgets and the network model's transfer times;
torch's schedules through the registry schedule with the same order, where there is one). A result
faster than the compute bound (every rank's paced compute, ``peers_report.compute_bound_ms``) or than
its own signal run is void and never counts as best.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_pipeline as bp  # noqa: E402 (tools/: model flags, network model, grid point runner)
import peers_report as rep  # noqa: E402
from megareshard.pipeline.pacing import calibrate_pace, parse_pace  # noqa: E402 (no torch import)

ENV_ARGV = "MR_BENCH_PEERS_ARGV"
METHOD = "eager-1f1b+broadcast+dw"
# the grid: few participants and rounds (paced compute repeats to within a few %), so 10 points fit in 20 min
GRID_DEFAULTS = {"iters": 3, "warmup": 1, "pace": "auto", "strategies": "broadcast"}
RUN_DEFAULTS = {"iters": 5, "warmup": 2, "pace": "none", "strategies": "allgather,broadcast"}
GRID_SETUP_S = 45.0  # start-up of one point: torchrun on 4 namespaces, every runtime, every peer's probe step


def build_parser() -> argparse.ArgumentParser:
    from peers_torch import PEER_SCHEDULES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=8, help="2 per rank per chunk at pp 4 with two chunks")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64,
                   help="with hidden 128, micro batch 2: a 0.52 Mbit activation, 52 ms at 10 Mbit/s (NIC-bound) "
                        "and 3 ms at 160 Mbit/s (compute-bound)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--strategies", default=None,
                   help="megareshard strategies per schedule (default allgather,broadcast; --grid: broadcast); "
                        "1f1b+allgather, the baseline, always runs")
    p.add_argument("--schedules", default=None, help="megareshard schedules (default: every runtime schedule)")
    p.add_argument("--no-method", action="store_true", help=f"leave out {METHOD}")
    p.add_argument("--peers", default=",".join(PEER_SCHEDULES), help="torch schedules (comma list)")
    p.add_argument("--peer-timeout", type=float, default=120.0,
                   help="seconds a peer's pipeline operation may block before that peer is reported failed")
    p.add_argument("--reshard-scheduler", default="auto")
    p.add_argument("--reshard-chunks", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed rounds (default 5; --grid 3)")
    p.add_argument("--warmup", type=int, default=None, help="unpaced rounds first (default 2; --grid 1)")
    p.add_argument("--pace", default=None, help="'none' (default), 'auto' (--grid default) or 'F=..,B=..,I=..,W=..' ms")
    p.add_argument("--pace-quantile", type=float, default=0.9)
    p.add_argument("--pace-margin", type=float, default=1.25)
    p.add_argument("--nic-gbps", type=float, default=1.0, help="the emulated NIC rate (network model, simulator)")
    p.add_argument("--procs-per-host", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: bars per participant and peak activations per stage")
    p.add_argument("--from-json", default=None, help="no run: redraw the tables (and --plot) of a run or grid JSON")
    p.add_argument("--timeout", type=float, default=900.0, help="plain torchrun launch: kill after this long")
    g = p.add_argument_group("grid")
    g.add_argument("--grid", action="store_true", help="every --rates × --grid-tp point on the emulated cluster")
    g.add_argument("--rates", default=bp.GRID_RATES, help="NIC rates, Mbit/s (bench_pipeline's GRID_RATES)")
    g.add_argument("--grid-tp", default="1,2", help="tensor-parallel sizes of the grid (4 hosts × tp ranks)")
    g.add_argument("--dry-run", action="store_true", help="--grid: commands and a wall-time estimate only")
    g.add_argument("--point-timeout", type=float, default=420.0,
                   help="stop a point after this many seconds (it is reported as stopped)")
    g.add_argument("--results", default="docs/results/peers_pp4.json")
    g.add_argument("--picture", default="docs/img/peers_pp4.png")
    return p


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    for k, v in (GRID_DEFAULTS if a.grid else RUN_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    # the fields bench_pipeline's helpers read
    a.model, a.num_layers_per_stage, a.baseline = "gpt", None, rep.BASELINE
    if a.iters < 1 or a.warmup < 1 or a.microbatches < 1:
        raise ValueError("--iters >= 1, --warmup >= 1 (the memory round and the calibration are warm-up rounds), "
                         "--microbatches >= 1")
    if a.num_layers % (2 * a.pp):
        raise ValueError(f"--num-layers {a.num_layers} must split into 2 chunks per rank on pp {a.pp} "
                         f"(a multiple of {2 * a.pp}) for the peers' interleaved and V schedules")
    return a


# ---- participants --------------------------------------------------------------------------------
def our_configs(a: argparse.Namespace) -> tuple[list[bp.BenchConfig], list[tuple[str, str]]]:
    """megareshard's configurations, and (name, reason) of registry schedules not run here."""
    from megareshard.pipeline import REGISTRY

    names = [s.strip() for s in a.schedules.split(",")] if a.schedules else [
        n for n, k in REGISTRY.items() if k.runtime]
    strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in bp.STRATEGY_NAMES or s == "signal"]
    if bad or not strategies:
        raise ValueError(f"--strategies {a.strategies!r}: each of sendrecv, allgather, broadcast")
    out: list[bp.BenchConfig] = []
    skipped = []
    for n in names:
        if n not in REGISTRY:
            raise ValueError(f"--schedules: unknown {n!r}; registry: {', '.join(REGISTRY)}")
        k = REGISTRY[n]
        if not k.runtime:
            skipped.append((n, "the runtime does not execute it (REGISTRY runtime=False)"))
            continue
        if k.stages_per_mesh != 1:
            skipped.append((n, "virtual stages: this bench builds one stage model per rank (the trainer's); "
                               "a chunk model per schedule is not wired in yet"))
            continue
        out += [bp.BenchConfig(n, s, k.zero_bubble) for s in strategies]
    if not a.no_method and "eager-1f1b" in names:
        out.append(bp.BenchConfig("eager-1f1b", "broadcast", True))
    base = bp.BenchConfig("1f1b", "allgather", False)  # the baseline, whatever --strategies says
    if base not in out:
        out.insert(0, base)
    seen: list[bp.BenchConfig] = []
    for c in out:
        if c not in seen:
            seen.append(c)
    for c in list(seen):
        if c.signal not in seen:
            seen.append(c.signal)
    return seen, skipped


def _model_argv(a: argparse.Namespace, c: bp.BenchConfig, world: int) -> list[str]:
    return bp.model_argv(a, c, world) + ["--untie-embeddings-and-output-weights", "--seed", "1234"]


# ---- the worker ------------------------------------------------------------------------------------
class _Ours:
    framework = "megareshard"

    def __init__(self, cfg: bp.BenchConfig, runtime, trainer) -> None:
        self.cfg, self.rt, self.trainer = cfg, runtime, trainer
        self.name = cfg.name

    def params(self):
        return list(self.trainer.model.parameters())

    def zero(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def step(self, batch):
        return self.rt(self.trainer.model, batch, self.trainer.device)

    def set_pace(self, budgets: dict[str, float] | None) -> None:
        self.rt.pace = budgets

    def trace(self):
        return [r for r in self.rt.last_trace if r["kind"] in ("F", "B", "I", "W")]

    def overruns(self) -> tuple[int, int]:
        st = self.rt.last_stats
        return st.get("pace_overruns", 0), st.get("pace_overrun_us", 0)


class _Peer:
    framework = "torch"

    def __init__(self, name: str, peer, trainer) -> None:
        self.name, self.peer, self.trainer = name, peer, trainer
        self.shares_model = any(c is trainer.model for c in peer.chunks.values())

    def params(self):
        return list(self.peer.parameters())

    def zero(self) -> None:
        for p in self.peer.parameters():
            p.grad = None

    def step(self, batch):
        loss = self.peer.step(batch)
        if self.shares_model:  # the same reductions megareshard's runtime runs at its end
            self.trainer.finalize_grads()
        return loss

    def set_pace(self, budgets: dict[str, float] | None) -> None:
        self.peer.budget = budgets

    def trace(self):
        return list(self.peer.stats.trace)

    def overruns(self) -> tuple[int, int]:
        return self.peer.stats.overruns, self.peer.stats.overrun_us


def _timeout_groups(ctx, timeout_s: float):
    """This rank's own pipeline group (one per tp position, every rank creates all in the same order)
    with a short timeout: a peer that blocks fails alone instead of hanging the launch."""
    import datetime

    import torch.distributed as dist

    mine = tuple(ctx.group_ranks["pp"])
    allg: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(allg, mine)
    handle = None
    for members in sorted(set(allg)):
        g = dist.new_group(list(members), timeout=datetime.timedelta(seconds=timeout_s))
        if members == mine:
            handle = g
    return handle


def _build_peer(name: str, a, trainer, cfg, ctx, group):
    from megareshard.models.gpt import GPTModel
    from peers_torch import PEER_SCHEDULES, TorchPeer, chunk_layer_ranges, peer_stages_of

    pp, v = a.pp, PEER_SCHEDULES[name][1]
    ranges = chunk_layer_ranges(a.num_layers, pp * v)
    chunks = {}
    for s in peer_stages_of(name, ctx.pp_rank(), pp):
        if v == 1:
            chunks[s] = trainer.model  # the very same stage model (and parameters) megareshard trains
        else:
            chunks[s] = GPTModel(cfg.model, ctx, seed=cfg.training.seed, pre_process=s == 0,
                                 post_process=s == pp * v - 1, layer_range=ranges[s])
    pctx = copy.copy(ctx)
    pctx.groups = {**ctx.groups, "pp": group}
    return TorchPeer(name, chunks, pctx, pp=pp, num_microbatches=a.microbatches, vocab_size=cfg.model.vocab_size,
                     layers_per_rank=a.num_layers // pp)


def _agree_failed(err: str | None) -> str | None:
    """Collective: the first rank's error text if any rank failed, else None."""
    import torch.distributed as dist

    errs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    return f"rank {bad[0][0]}: {bad[0][1]}" if bad else None


def _worker(a: argparse.Namespace) -> int:
    run_worker(a)
    return 0


def run_worker(a: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank: the whole benchmark; rank 0 returns the run's JSON (and prints, writes --json/--plot).
    Uses the process group already initialised (a test's gloo ranks), else torchrun's environment."""
    import torch
    import torch.distributed as dist

    from megareshard.pipeline.runtime import PipelineRuntime, gather_trace
    from megareshard.pipeline.stage import stage_layouts
    from megareshard.training import Trainer, build_context, init_distributed
    from peers_torch import LifetimeMeter, compute_order

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = init_distributed(torch.device("cpu"))
        world = world[0] if isinstance(world, tuple) else world
    rank = dist.get_rank()
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if rank == 0 else (lambda *x: None)
    resolve(a)
    if world != a.tp * a.pp:
        raise ValueError(f"{world} ranks: the peers run without data parallelism, so the world must be tp {a.tp} "
                         f"× pp {a.pp} = {a.tp * a.pp} (torch's schedules reduce no gradients over dp here)")
    pph = a.procs_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    configs, skipped = our_configs(a)
    t_start = time.monotonic()
    from megareshard.arguments import parse_args

    cfgs = [parse_args(_model_argv(a, c, world), world_size=world) for c in configs]
    ctx, placement = build_context(cfgs[0], world)
    trainer = Trainer(cfgs[0], ctx, torch.device("cpu"), out=__import__("io").StringIO())
    layouts = stage_layouts(cfgs[0], ctx.topology)
    parts: list[Any] = [_Ours(configs[0], trainer.pipeline, trainer)]
    for c, cfg in zip(configs[1:], cfgs[1:]):  # collective: every rank builds every edge, same order
        parts.append(_Ours(c, PipelineRuntime.for_gpt(cfg, ctx, layouts, finalize_grads=trainer.finalize_grads,
                                                      record_trace=True), trainer))
    parts[0].rt.record_trace = True
    batch = trainer._microbatches(trainer.train_data, next(trainer._train_iter))
    failed: list[dict[str, Any]] = [{"name": n, "framework": "megareshard", "status": "not run", "reason": r}
                                    for n, r in skipped]
    # the peers: built and stepped once each (their probe, also the loss check); a failure is reported
    peer_names = [s.strip() for s in a.peers.split(",") if s.strip()]
    orders: dict[str, Any] = {}
    for name in peer_names:
        group = _timeout_groups(ctx, a.peer_timeout)
        err = None
        try:
            peer = _Peer(name, _build_peer(name, a, trainer, cfgs[0], ctx, group), trainer)
            peer.zero()
            peer.step(batch)
        except Exception as e:  # noqa: BLE001 (reported, never hidden)
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        why = _agree_failed(err)
        if why:
            say(f"[bench_peers] torch {name}: failed ({why})")
            failed.append({"name": f"torch {name}", "framework": "torch", "status": "failed", "reason": why})
        else:
            peer.name = f"torch {name}"
            parts.append(peer)
            try:
                orders[name] = compute_order(peer.peer.schedule)
            except ValueError as e:  # the prediction says why it is missing; the run goes on
                say(f"[bench_peers] torch {name}: no compute order for the simulator ({e})")
    say(f"[bench_peers] {world} ranks ({placement}); {len(parts)} participants: "
        + ", ".join(p.name for p in parts) + f" (set-up {time.monotonic() - t_start:.0f}s)")

    needed = ("F", "B", "I", "W")
    pace = parse_pace(a.pace, warmup=a.warmup, quantile=a.pace_quantile, margin=a.pace_margin, needed=needed)
    stage = ctx.pp_rank()
    budgets: list[dict[str, float]] | None = [dict(pace) for _ in range(a.pp)] if isinstance(pace, dict) else None
    if budgets:
        for p in parts:
            p.set_pace(budgets[stage])
    skip = a.warmup + (1 if pace == "auto" else 0)
    rounds = skip + a.iters
    times = torch.zeros(len(parts), rounds, dtype=torch.float64)
    losses = [None] * len(parts)
    peaks = [0] * len(parts)
    spans = [0.0] * len(parts)
    warm: list[Any] = []
    for r in range(rounds):
        if pace == "auto" and r == a.warmup:
            box: list[Any] = [None]
            if rank == 0:
                try:
                    box = [calibrate_pace(warm, a.pp, a.pace_quantile, a.pace_margin, needed=needed)]
                except ValueError as e:
                    box = [str(e)]
            dist.broadcast_object_list(box, src=0)
            if isinstance(box[0], str):
                raise ValueError(box[0])
            budgets = box[0]
            for p in parts:
                p.set_pace(budgets[stage])
            say("[bench_peers] paced compute (ms): " + "; ".join(
                f"stage {s} " + " ".join(f"{k}={1e3 * v:.0f}" for k, v in b.items()) for s, b in enumerate(budgets)))
        t_round = time.monotonic()
        for i, p in enumerate(parts):
            p.zero()
            meter = LifetimeMeter(exclude=p.params()) if r == a.warmup - 1 else None
            dist.barrier()
            t0, w0 = time.perf_counter(), time.time()
            if meter is not None:
                with meter:
                    loss = p.step(batch)
                peaks[i] = meter.peak_bytes
            else:
                loss = p.step(batch)
            times[i, r] = time.perf_counter() - t0
            spans[i] = time.time() - w0
            if r == 0:
                losses[i] = float(loss)
        if pace == "auto" and r < a.warmup:
            warm += [gather_trace(ctx, p.rt.last_trace) for p in parts if isinstance(p, _Ours)]  # collective
        mx = times[:, r].clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        times[:, r] = mx
        tag = "warm-up" if r < a.warmup else "paced warm-up" if r < skip else "timed"
        say(f"[bench_peers] round {r + 1}/{rounds} ({tag}, {time.monotonic() - t_round:.1f}s, total "
            f"{time.monotonic() - t_start:.0f}s): " + ", ".join(
                f"{p.name} {1e3 * times[i, r]:.0f}" for i, p in enumerate(parts)) + " ms")

    mine = [{"pp": stage, "tp": ctx.tp_rank(), "bubble": rep.bubble_fraction(p.trace(), spans[i]),
             "peak": peaks[i], "overruns": p.overruns()} for i, p in enumerate(parts)]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    run = None
    if rank == 0:
        run = assemble(a, parts, failed, times[:, skip:].tolist(), losses, every, budgets, world, pph, orders)
        print(rep.format_table(run), flush=True)
        if a.json:
            rep.write_json(a.json, run)
        if a.plot:
            rep.plot_run(run, a.plot)
    dist.barrier()
    trainer.close()
    return run


def assemble(a, parts, failed, times_s, losses, every, budgets, world, pph, orders=None) -> dict[str, Any]:
    """Rank 0: the run's JSON from the per-rank measurements."""
    budgets_ms = None if budgets is None else [{k: round(1e3 * v, 3) for k, v in b.items()} for b in budgets]
    ref = losses[0]
    tol = 2 * a.microbatches * 2.0 ** -24 * abs(ref)
    records = []
    for i, p in enumerate(parts):
        ms = [1e3 * t for t in times_s[i]]
        per = [x[i] for x in every]
        bubble = [next((x["bubble"] for x in per if x["pp"] == s and x["tp"] == 0), None) for s in range(a.pp)]
        peak = [max(x["peak"] for x in per if x["pp"] == s) for s in range(a.pp)]
        ours = isinstance(p, _Ours)
        rec = {"name": p.name, "framework": p.framework, "status": "ok", "reason": None,
               "schedule": p.cfg.schedule if ours else p.name.split(" ", 1)[1],
               "strategy": p.cfg.strategy if ours else "p2p", "delay_wgrad": p.cfg.dw if ours else None,
               "signal_name": p.cfg.signal.name if ours and p.cfg.strategy != "signal" else None,
               "ms_all": [round(x, 3) for x in ms], **rep.summarise(ms),
               "bubble": bubble, "act_peak_bytes": peak,
               "pace_overruns": sum(x["overruns"][0] for x in per),
               "loss": losses[i], "loss_diff": None, "loss_ok": None}
        if not (ours and p.cfg.strategy == "signal"):  # a signal run's inputs are garbage: no loss to compare
            rec["loss_diff"] = abs(losses[i] - ref)
            rec["loss_ok"] = rec["loss_diff"] <= tol
        records.append(rec)
    records += [{**f, "ms_all": []} for f in failed]
    predict(a, records, budgets_ms, world, pph, orders)
    bound = rep.compute_bound_ms(budgets_ms, a.microbatches)
    run = {"kind": rep.RUN_KIND, "status": "complete",
           "setup": {"cluster": f"{world // pph} hosts × {pph} ranks, tp {a.tp}, pp {a.pp}, --pace {a.pace}",
                     "tp": a.tp, "pp": a.pp, "world_size": world, "procs_per_host": pph,
                     "microbatches": a.microbatches, "micro_batch_size": a.micro_batch_size,
                     "seq_length": a.seq_length, "num_layers": a.num_layers, "hidden_size": a.hidden_size,
                     "nic_gbps": a.nic_gbps, "iters": a.iters, "warmup": a.warmup, "pace": a.pace,
                     "command": " ".join(["tools/bench_peers.py"] + sys.argv[1:])},
           "budgets_ms": budgets_ms, "compute_bound_ms": bound, "reference_loss": ref, "loss_tolerance": tol,
           "records": records}
    run["summary"] = rep.fill_ratios(records, bound)
    return run


def predict(a, records, budgets_ms, world: int, pph: int, orders: dict[str, Any] | None = None) -> None:
    """``predicted_ms`` per record: the simulator at the paced budgets (or F=10, B=20 ms unpaced: then only
    the shape of the prediction means something) and the network model's transfer time per edge (torch's
    point-to-point copies priced as ``sendrecv``). A torch schedule runs through its own compute order
    (``orders``: ``peers_torch.compute_order``) or, for the single-stage ones, the registry's equivalent."""
    from megareshard.pipeline import Costs, ScheduleError, generate, simulate
    from peers_torch import EQUIVALENT, order_to_schedule

    costs = budgets_ms or [{"F": 10.0, "B": 20.0, "I": 10.0, "W": 10.0}] * a.pp
    strategies = sorted({r["strategy"] for r in records if r["status"] == "ok" and r["strategy"] != "p2p"}
                        | {"sendrecv"})
    net = bp.edge_transfer_model(a, [bp.BenchConfig("1f1b", s, False) for s in strategies], world, pph)
    for r in records:
        r["predicted_ms"] = None
        if r["status"] != "ok":
            continue
        try:
            if r["framework"] == "torch" and (orders or {}).get(r["schedule"]):
                sched = order_to_schedule(orders[r["schedule"]], r["schedule"], a.pp, a.microbatches)
            elif r["framework"] == "torch" and r["schedule"] in EQUIVALENT:
                sched = generate(EQUIVALENT[r["schedule"]], a.pp, a.microbatches)
            elif r["framework"] == "torch":
                r["predicted_note"] = "no compute order known for this schedule"
                continue
            else:
                sched = generate(r["schedule"], a.pp, a.microbatches, delay_wgrad=bool(r.get("delay_wgrad")))
            comm = 1e3 * net["sendrecv" if r["strategy"] == "p2p" else r["strategy"]]["model_s"]
            place, n = sched.placement, sched.graph.num_stages
            share = a.pp / n  # a chunk holds an even share of its rank's layers
            per = {k: [costs[place[s]][k] * share for s in range(n)] for k in "FBIW"}
            edges = {str(e): (0.0 if place[e.src] == place[e.dst] else comm) for e in sched.graph.edges}
            tl = simulate(sched, costs=Costs(f=per["F"], b=per["B"], i=per["I"], w=per["W"], comm=edges))
        except (ValueError, KeyError, ScheduleError) as e:  # the simulator refuses it: say why, predict nothing
            r["predicted_note"] = f"{type(e).__name__}: {e}"
            continue
        r["predicted_ms"] = round(tl.makespan, 3)
        r["predicted_bubble"] = round(tl.bubble_fraction, 4)
        # live (stage, microbatch) activations per rank at the peak; a chunk of a 2-chunk schedule is half a stage
        r["predicted_peak_activations"] = tl.peak_activations
        r["chunks_per_rank"] = n // a.pp


# ---- grid -------------------------------------------------------------------------------------------
WORKER_DESTS = ("tp", "pp", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "microbatches", "vocab_size", "strategies", "schedules", "no_method", "peers", "peer_timeout",
                "reshard_scheduler", "reshard_chunks", "iters", "warmup", "pace", "pace_quantile", "pace_margin")


def point_command(p: argparse.ArgumentParser, a: argparse.Namespace, rate: float, tp: int, out: str) -> list[str]:
    argv: list[str] = []
    for act in p._actions:
        v = getattr(a, act.dest, None)
        if act.dest not in WORKER_DESTS or v is None or v is False or act.dest == "tp":
            continue
        argv += [act.option_strings[-1]] if v is True else [act.option_strings[-1], str(v)]
    tools = Path(__file__).resolve().parent
    return ([sys.executable, str(tools / "emulate_cluster.py"), "--hosts", str(a.pp), "--procs-per-host", str(tp),
             "--nic-rate", f"{round(rate * 1e3)}kbit", "--timeout", f"{a.point_timeout:g}", "--",
             str(Path(__file__).resolve())] + argv
            + ["--tp", str(tp), "--nic-gbps", f"{rate / 1e3:g}", "--procs-per-host", str(tp), "--json", out])


def estimate_point_s(a: argparse.Namespace, rate: float, tp: int) -> float:
    """Wall seconds of one point: every participant's simulated iteration (F=10, B=20 ms per stage, or the
    budgets of --estimate-from) for every round, plus the set-up."""
    from peers_torch import PEER_SCHEDULES

    pa = copy.copy(a)
    pa.tp, pa.nic_gbps = tp, rate / 1e3
    configs, _ = our_configs(pa)
    recs = [{"name": c.name, "framework": "megareshard", "status": "ok", "schedule": c.schedule,
             "strategy": c.strategy, "delay_wgrad": c.dw} for c in configs]
    peers = [s.strip() for s in a.peers.split(",") if s.strip()]
    recs += [{"name": f"torch {n}", "framework": "torch", "status": "ok", "schedule": f"torch {n}",
              "strategy": "p2p", "delay_wgrad": None} for n in peers if n in PEER_SCHEDULES]
    budgets = None
    if a.estimate_from:
        budgets = rep.load_json(a.estimate_from).get("budgets_ms")
        if not budgets or len(budgets) != a.pp:
            raise ValueError(f"--estimate-from {a.estimate_from}: no paced budgets for {a.pp} stages in it")
    predict(pa, recs, budgets, tp * a.pp, tp)
    known = [r["predicted_ms"] for r in recs if r["predicted_ms"]]
    mean = sum(known) / len(known) if known else 0.0
    per_round = sum(r["predicted_ms"] or mean for r in recs) / 1e3
    rounds = a.warmup + (1 if a.pace == "auto" else 0) + a.iters + 1  # + the peers' probe step
    return GRID_SETUP_S + rounds * per_round


def _grid(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    import tempfile

    rates = bp.parse_rates(a.rates)
    tps = [int(x) for x in a.grid_tp.split(",") if x.strip()]
    if a.dry_run:
        total = 0.0
        for tp in tps:
            for rate in rates:
                est = estimate_point_s(a, rate, tp)
                total += est
                print(f"# tp {tp}, {rate:g} Mbit/s: about {est / 60:.1f} min")
                print(" ".join(point_command(p, a, rate, tp, f"peers-{tp}-{rate:g}.json")))
        print(f"# whole grid: about {total / 60:.0f} min")
        return 0
    from emulate_cluster import check_privileges

    check_privileges()
    grid = {"kind": rep.GRID_KIND, "rates_mbit": rates, "tps": tps, "pp": a.pp, "picture": a.picture,
            "command": " ".join(["tools/bench_peers.py"] + sys.argv[1:]),
            "points": [{"rate_mbit": r, "tp": tp, "status": "not run", "reason": None, "run": None}
                       for tp in tps for r in rates]}
    os.makedirs(os.path.dirname(a.results) or ".", exist_ok=True)
    os.makedirs(os.path.dirname(a.picture) or ".", exist_ok=True)
    t_grid = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-peers-grid-") as tmp:
        for k, pt in enumerate(grid["points"]):
            out = os.path.join(tmp, f"{k}.json")
            cmd = point_command(p, a, pt["rate_mbit"], pt["tp"], out)
            print(f"[bench_peers] grid point {k + 1}/{len(grid['points'])} (tp {pt['tp']}, {pt['rate_mbit']:g} "
                  f"Mbit/s, {time.monotonic() - t_grid:.0f}s so far): {' '.join(cmd)}", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                rc, reason = bp._run_point(cmd, a.point_timeout)
            except KeyboardInterrupt:
                pt.update(status="stopped", reason="interrupted (Ctrl-C)")
                rep.write_json(a.results, grid)
                return 130
            run = json.load(open(out)) if os.path.exists(out) else None
            ok = rc == 0 and run is not None and run.get("status") == "complete"
            pt.update(status="complete" if ok else "stopped", run=run, wall_s=round(time.monotonic() - t0, 1),
                      reason=None if ok else (reason or f"exit code {rc}"))
            rep.write_json(a.results, grid)  # after every point: a stopped grid keeps what it ran
    print(rep.format_grid(grid), flush=True)
    rep.plot_grid(grid, a.picture)
    print(f"[bench_peers] grid: {a.results}, {a.picture} ({time.monotonic() - t_grid:.0f}s)", file=sys.stderr)
    return 0


def _replay(a: argparse.Namespace) -> int:
    data = rep.load_json(a.from_json)
    if data["kind"] == rep.GRID_KIND:
        print(rep.format_grid(data))
        for pt in data["points"]:
            if pt.get("run"):
                print(f"\n### tp {pt['tp']}, {pt['rate_mbit']:g} Mbit/s\n")
                print(rep.format_table(pt["run"]))
        if a.plot or data.get("picture"):
            rep.plot_grid(data, a.plot or data["picture"])
    else:
        print(rep.format_table(data))
        if a.plot:
            rep.plot_run(data, a.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    p.add_argument("--estimate-from", default=None, help="--grid --dry-run: budgets_ms of a run JSON")
    if os.environ.get(ENV_ARGV) is not None:
        return _worker(p.parse_args(json.loads(os.environ[ENV_ARGV])))
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if "RANK" in os.environ:  # inside someone's torchrun (tools/emulate_cluster.py)
        return _worker(a)
    try:
        if a.from_json:
            return _replay(a)
        resolve(a)
        if a.grid:
            return _grid(p, a)
        our_configs(a)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"bench_peers: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.tp * a.pp),
           os.path.abspath(__file__)]
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", **{ENV_ARGV: json.dumps(argv)})
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=a.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        print("bench_peers: stopped (timeout or Ctrl-C)", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
