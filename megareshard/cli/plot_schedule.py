"""Draw a pipeline schedule's timeline (simulated or measured) as a PNG, paper Figure 4 style.

One row per stage (stage 0 on top), coloured F/B/I/W boxes labelled with the microbatch,
the stage's outgoing transfers as thin bars under its row. Prints makespan, bubble
fraction and peak live activations per schedule (a table, or JSON with --json). Times are
seconds for a measured trace and cost units (a forward takes --cost-f) for a simulation.

    python tools/plot_schedule.py --schedule 1f1b --stages 4 --microbatches 8 \\
        --comm 0.5 -o 1f1b.png
    python tools/plot_schedule.py --compare --schedule 1f1b eager-1f1b eager-1f1b+dw \\
        --stages 4 --microbatches 8 --comm 1 -o cmp.png
    python tools/plot_schedule.py --trace trace.json -o measured.png
    python tools/plot_schedule.py --trace ours.json torch.json -o both.png     # stacked, one time axis each
    python tools/plot_schedule.py --schedule-file my_schedule.csv --comm 0.5 -o mine.png

A schedule name may end in ``+dw`` (delayed weight gradients for that one);
``--delay-wgrad`` applies it to all. A trace is the runtime's JSON list of
{stage, kind, mb, start, end} records (SEND_F/SEND_B records, with optional edge/peer,
are drawn as transfers). Matplotlib is imported only when drawing (extras: plots/test).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from megareshard.pipeline import (
    Costs,
    PipelineGraph,
    Schedule,
    Timeline,
    generate,
    get_schedule,
    schedule_names,
    simulate,
    validate,
)
from megareshard.pipeline.draw import draw, format_table



def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plot_schedule.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", nargs="+", default=["1f1b"],
                   help=f"one of {', '.join(schedule_names())}, optionally with +dw; several with --compare")
    p.add_argument("--delay-wgrad", action="store_true", help="split B into I + delayed W")
    p.add_argument("--stages", "-P", type=int, default=4)
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--comm", type=float, default=0.0, help="transfer time per edge and microbatch")
    p.add_argument("--cost-f", type=float, default=1.0)
    p.add_argument("--cost-b", type=float, default=2.0)
    p.add_argument("--cost-i", type=float, default=None, help="default: cost-b / 2")
    p.add_argument("--cost-w", type=float, default=None, help="default: cost-b - cost-i")
    p.add_argument("--rendezvous", action="store_true",
                   help="a transfer starts only once the receiver posted its receive")
    p.add_argument("--no-recv-nic", action="store_true",
                   help="leave the receiving stage's NIC out of the model (only the sender's NIC is a bottleneck)")
    p.add_argument("--skip", nargs=2, type=int, action="append", default=[], metavar=("SRC", "DST"),
                   help="add a skip edge SRC->DST (repeatable)")
    p.add_argument("--trace", type=Path, nargs="+",
                   help="draw measured traces (JSON) instead of simulating; several are stacked in one figure")
    p.add_argument("--schedule-file", type=Path,
                   help="simulate the schedule written in this file (--pipeline-schedule-file's forms) instead")
    p.add_argument("--compare", action="store_true", help="stack every --schedule in one figure")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("-o", "--output", type=Path, help="PNG to write (omit: metrics only)")
    return p.parse_args(argv)


def build_timelines(args: argparse.Namespace) -> list[Timeline]:
    if args.trace is not None:
        return [Timeline.from_trace(json.loads(t.read_text()), name=t.stem if len(args.trace) == 1 else
                                    f"{t.parent.name}/{t.stem}") for t in args.trace]
    names = args.schedule if args.compare else args.schedule[:1]
    graph = PipelineGraph(args.stages, tuple(tuple(e) for e in args.skip))
    costs = Costs(f=args.cost_f, b=args.cost_b, i=args.cost_i, w=args.cost_w,
                  comm=args.comm, rendezvous=args.rendezvous, recv_nic=not args.no_recv_nic)
    if args.schedule_file is not None:
        sched = Schedule.load(args.schedule_file)
        validate(sched)
        sched.name = sched.name or args.schedule_file.stem
        return [simulate(sched, costs=costs)]
    out = []
    for spec in names:
        name, dw = (spec[:-3], True) if spec.endswith("+dw") else (spec, args.delay_wgrad)
        if get_schedule(name).stages_per_mesh == 1:
            sched = generate(name, args.stages, args.microbatches, delay_wgrad=dw, graph=graph)
            out.append(simulate(sched, costs=costs))
            continue
        if args.skip:
            raise SystemExit(f"plot_schedule: --skip applies to one-stage-per-mesh schedules, not {name}")
        sched = generate(name, args.stages, args.microbatches, delay_wgrad=dw)
        V = sched.num_stages // args.stages  # a virtual stage is 1/V of a mesh's layers: 1/V of its costs
        per = {k: (None if v is None else v / V) for k, v in (("f", args.cost_f), ("b", args.cost_b),
                                                               ("i", args.cost_i), ("w", args.cost_w))}
        out.append(simulate(sched, costs=Costs(**per, comm=args.comm, rendezvous=args.rendezvous,
                                               recv_nic=not args.no_recv_nic)))
    return out


def time_unit(args: argparse.Namespace) -> str:
    """What the timeline's times count: seconds for a measured trace; for a simulation the unit of the costs
    given (a forward's time is --cost-f of them)."""
    if args.trace is not None:
        return "s"
    return f"cost units, F = {args.cost_f:g}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        timelines = build_timelines(args)
    except (ValueError, NotImplementedError) as e:  # ScheduleError is a ValueError
        print(f"plot_schedule: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([t.summary() for t in timelines], indent=2))
    else:
        print(format_table(timelines, time_unit(args)))
    if args.output is not None:
        draw(timelines, args.output, args.comm if args.trace is None else 0.0, time_unit(args))
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
