"""The worker half of lab/bench/bench_peers.py: the participants, one launch on every rank, the run's JSON.

``run_worker(args)`` runs on every rank (inside torchrun, or on a test's gloo ranks) and returns the
run's JSON on rank 0; ``our_configs`` lists megareshard's participants; ``predict`` adds the
simulator's prediction to records. The method is described in lab/bench/bench_peers.py. One ``Trainer``
per distinct stage placement (one stage per rank; interleaved; zbv's V): its model (this rank's chunks
with virtual stages) serves every configuration of that placement, each on a runtime of its own.
"""
from __future__ import annotations

import argparse
import copy
import io
import os
import sys
import time
from typing import Any

from lab.bench import bench_pipeline as bp
from lab.bench import peers_report as rep
from lab.cluster.pacing import calibrate_pace, pacer, parse_pace
from lab.bench.physical_bound import refill_s

METHOD = "eager-1f1b+broadcast+dw"
INTERLEAVED_V = 2  # virtual stages per rank of the interleaved kinds (--num-virtual-stages-per-pipeline-rank)


def virtual_stages_of(schedule: str) -> int:
    """Stages per rank the bench runs ``schedule`` with: 1, the schedule's own (zbv: 2), or INTERLEAVED_V."""
    from megareshard.pipeline import get_schedule

    k = get_schedule(schedule)
    return k.stages_per_mesh if k.stages_per_mesh is not None else INTERLEAVED_V


# ---- participants --------------------------------------------------------------------------------
def our_configs(a: argparse.Namespace) -> tuple[list[bp.BenchConfig], list[tuple[str, str]]]:
    """megareshard's configurations, and (name, reason) of registry schedules not run here."""
    from megareshard.pipeline import get_schedule, schedule_names

    names = [s.strip() for s in a.schedules.split(",")] if a.schedules else list(schedule_names())
    strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in bp.STRATEGY_NAMES or s == "signal"]
    if bad or not strategies:
        raise ValueError(f"--strategies {a.strategies!r}: each of sendrecv, allgather, broadcast")
    out: list[bp.BenchConfig] = []
    skipped = []
    for n in names:
        if n not in schedule_names():
            raise ValueError(f"--schedules: unknown {n!r}; registry: {', '.join(schedule_names())}")
        k = get_schedule(n)
        out += [bp.BenchConfig(n, s, k.zero_bubble) for s in strategies]
    if not a.no_method and "eager-1f1b" in names:
        out.append(bp.BenchConfig("eager-1f1b", "broadcast", True))
    base = bp.BenchConfig("1f1b", "allgather", False)  # the baseline, whatever --strategies says: first
    out = [base] + [c for c in out if c != base]
    seen: list[bp.BenchConfig] = []
    for c in out:
        if c not in seen:
            seen.append(c)
    for c in list(seen):
        if c.signal not in seen:
            seen.append(c.signal)
    return seen, skipped


def _model_argv(a: argparse.Namespace, c: bp.BenchConfig, world: int) -> list[str]:
    from megareshard.pipeline import get_schedule

    argv = bp.model_argv(a, c, world) + ["--untie-embeddings-and-output-weights", "--seed", "1234"]
    if get_schedule(c.schedule).stages_per_mesh is None:  # the interleaved kinds: Megatron-LM's flag gives V
        argv += ["--num-virtual-stages-per-pipeline-rank", str(INTERLEAVED_V)]
    return argv


# ---- the worker ------------------------------------------------------------------------------------
class _Ours:
    framework = "megareshard"

    def __init__(self, cfg: bp.BenchConfig, runtime, trainer) -> None:
        from megareshard.pipeline.chunks import ModelChunks
        from lab.bench.peers_torch import chunk_share

        self.cfg, self.rt, self.trainer = cfg, runtime, trainer
        self.name = cfg.name
        self.virtual = runtime.virtual_stages
        # paced compute: each chunk gets its share of the rank's per-kind budget (torch's multi-chunk rule);
        # the runtime takes one budget per kind, so the rank's chunks must hold equal shares
        m = trainer.model
        mods = [m.chunk(st) for st in m.stages] if isinstance(m, ModelChunks) else [m]
        held = sum(x.layer_range[1] - x.layer_range[0] for x in mods)
        shares = sorted({chunk_share(x.layer_range, held) for x in mods})
        if len(shares) != 1:
            raise ValueError(f"{cfg.name}: the chunks on pp rank {runtime.stage} hold unequal shares {shares} of its "
                             f"{held} layers; the runtime paces every chunk with one budget per kind")
        self.share = shares[0]

    def params(self):
        return list(self.trainer.model.parameters())

    def zero(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def step(self, batch):
        return self.rt(self.trainer.model, batch, self.trainer.device)

    def set_pace(self, budgets: dict[str, float] | None) -> None:
        pacer(self.rt).budgets = None if budgets is None else {k: v * self.share for k, v in budgets.items()}

    def trace(self):
        return [r for r in self.rt.last_trace if r["kind"] in ("F", "B", "I", "W")]

    def calibration_trace(self):
        """The last trace with each action's duration scaled to a whole stage's (÷ the chunk's share): the
        budgets are per rank, and a chunk is paced to its share of them (``set_pace``)."""
        if self.share == 1.0:
            return self.rt.last_trace
        return [{**r, "end": r["start"] + (r["end"] - r["start"]) / self.share} for r in self.rt.last_trace]

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
    from lab.bench.peers_torch import PEER_SCHEDULES, TorchPeer, chunk_layer_ranges, peer_stages_of

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


def run_worker(a: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank: the whole benchmark; rank 0 returns the run's JSON (and prints, writes --json/--plot).
    Uses the process group already initialised (a test's gloo ranks), else torchrun's environment."""
    import torch
    import torch.distributed as dist

    from megareshard.pipeline.runtime import gather_trace
    from megareshard.training import Trainer, build_context, build_pipeline, init_distributed
    from lab.bench.peers_torch import LifetimeMeter, compute_order

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = init_distributed(torch.device("cpu"))
        world = world[0] if isinstance(world, tuple) else world
    rank = dist.get_rank()
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if rank == 0 else (lambda *x: None)
    if world != a.tp * a.pp:
        raise ValueError(f"{world} ranks: the peers run without data parallelism, so the world must be tp {a.tp} "
                         f"× pp {a.pp} = {a.tp * a.pp} (torch's schedules reduce no gradients over dp here)")
    pph = a.procs_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    configs, skipped = our_configs(a)
    t_start = time.monotonic()
    from megareshard.arguments import parse_args

    cfgs, kept, failed = [], [], []
    for c in configs:  # deterministic on every rank: a configuration the arguments refuse is reported, not run
        try:
            cfgs.append(parse_args(_model_argv(a, c, world), world_size=world))
            kept.append(c)
        except (ValueError, SystemExit) as e:  # ConfigError is a ValueError; argparse exits
            failed.append({"name": c.name, "framework": "megareshard", "status": "not run",
                           "reason": f"refused by the arguments: {e}"})
    if not kept or kept[0].name != rep.BASELINE:
        raise ValueError(f"the baseline {rep.BASELINE} cannot run: "
                         + "; ".join(f["reason"] for f in failed if f["name"] == rep.BASELINE))
    configs = kept
    ctx, placement = build_context(cfgs[0], world)
    # One Trainer (model, optimizer, runtime) per distinct stage placement among the configurations: the
    # baseline's (one stage per rank) first, then each virtual-stage placement's (interleaved, zbv), whose
    # model is this rank's chunks. Same seed, and chunks keep the model's parameter names: the same initial
    # weights. The other configurations of a placement get runtimes of their own on that trainer's layouts.
    trainers: dict[tuple[int, ...], Any] = {}
    parts: list[Any] = []
    for c, cfg in zip(configs, cfgs):  # collective: every rank builds every trainer and edge, same order
        key = cfg.plan.pipeline.placement
        if key not in trainers:
            trainers[key] = tr = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
            rt = tr.pipeline
            rt.enable_trace()
        else:
            tr = trainers[key]
            layouts = tr.model_spec.stage_layouts(cfg, ctx.topology, key)
            rt = build_pipeline(tr.model_spec, cfg, ctx, layouts, finalize_grads=tr.finalize_grads,
                                record_trace=True)
        parts.append(_Ours(c, rt, tr))
    trainer = parts[0].trainer  # the baseline's: the batch, and the stage model the single-chunk peers share
    batch = trainer._microbatches(trainer.train_data, next(trainer._train_iter))
    failed += [{"name": n, "framework": "megareshard", "status": "not run", "reason": r} for n, r in skipped]
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
    refill = refill_s(a.nic_gbps)
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
            time.sleep(refill)  # every participant starts with full token buckets (physical_bound.refill_s)
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
            warm += [gather_trace(ctx, p.calibration_trace()) for p in parts if isinstance(p, _Ours)]  # collective
        mx = times[:, r].clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        times[:, r] = mx
        tag = "warm-up" if r < a.warmup else "paced warm-up" if r < skip else "timed"
        say(f"[bench_peers] round {r + 1}/{rounds} ({tag}, {time.monotonic() - t_round:.1f}s, total "
            f"{time.monotonic() - t_start:.0f}s): " + ", ".join(
                f"{p.name} {1e3 * times[i, r]:.0f}" for i, p in enumerate(parts)) + " ms")

    if getattr(a, "trace_dir", None):  # both sides' timelines of the last timed round (collective)
        from megareshard.pipeline.runtime import write_trace

        full = [gather_trace(ctx, p.rt.last_trace if isinstance(p, _Ours) else p.trace()) for p in parts]
        if rank == 0:
            os.makedirs(a.trace_dir, exist_ok=True)
            for p, tr in zip(parts, full):
                if tr:
                    write_trace(os.path.join(a.trace_dir, p.name.replace(" ", "_") + ".json"), tr)
            say(f"[bench_peers] traces: {a.trace_dir}/NAME.json (tools/plot_schedule.py --trace FILE)")
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
    for tr in trainers.values():
        tr.close()
    for p in parts:  # every configuration's stream threads joined and communicators destroyed (collective)
        if isinstance(p, _Ours):
            p.rt.close()
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
               "virtual_stages": p.virtual if ours else None,
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
                     "command": " ".join(["python -m lab.bench.bench_peers"] + sys.argv[1:])},
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
    from lab.bench.peers_torch import EQUIVALENT, order_to_schedule
    from lab.bench.physical_bound import physical_bound, uniform_side_bytes

    costs = budgets_ms or [{"F": 10.0, "B": 20.0, "I": 10.0, "W": 10.0}] * a.pp
    strategies = sorted({r["strategy"] for r in records if r["status"] == "ok" and r["strategy"] != "p2p"}
                        | {"sendrecv"})
    net = bp.edge_transfer_model(a, [bp.BenchConfig("1f1b", s, False) for s in strategies], world, pph)
    first_host = 0  # stage 0's host (one stage per host)
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
                sched = generate(r["schedule"], a.pp, a.microbatches, delay_wgrad=bool(r.get("delay_wgrad")),
                                 virtual_stages=r.get("virtual_stages"))
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
        tm = net["sendrecv" if r["strategy"] == "p2p" else r["strategy"]]  # torch: a full copy per receiving rank
        # stage 0's host sends one activation and receives one gradient per microbatch in the 1F1B graph
        out_b, in_b = tm["side_bytes"].get(f"h{first_host} out", 0), tm["side_bytes"].get(f"h{first_host} in", 0)
        pb = physical_bound(sched, Costs(f=per["F"], b=per["B"], i=per["I"], w=per["W"]),
                            {"*": tm["wire_bytes"].get("0->1", 0)}, uniform_side_bytes(sched, out_b, in_b),
                            a.microbatches, a.nic_gbps)
        r["physical"] = pb.record()
        # live (stage, microbatch) activations per rank at the peak; a chunk of a 2-chunk schedule is half a stage
        r["predicted_peak_activations"] = tl.peak_activations
        r["chunks_per_rank"] = n // a.pp
