"""The worker of lab/bench/bench_pipeline.py, on every rank inside torchrun.

``_worker`` builds one model, optimizer and batch and one ``PipelineRuntime`` per configuration, then runs the
rounds — each one iteration of every configuration (``_Step``: the runtime, then non-finite gradients zeroed),
timed between a barrier and the end of the optimizer step — with ``--pace`` (fixed budgets, or ``auto``:
calibrated on the warm-up rounds). Rank 0 rewrites ``--json`` after every timed round and at the end prints the
table and writes the outputs (lab/bench/pipeline_output.py). The method is described in bench_pipeline.py.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Any

from lab.bench.physical_bound import refill_s
from lab.bench.pipeline_args import check_args, parse_model_config
from lab.bench.pipeline_output import finish, write_json, write_traces
from lab.bench.pipeline_records import make_records
from lab.cluster.pacing import calibrate_pace, needed_kinds, pacer, parse_pace  # no torch import


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
