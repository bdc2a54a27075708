"""Choose tp, pp, dp, micro batch, schedule, resharding strategy, recomputation and ZeRO for a model on a cluster.

    python tools/plan_layout.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --ffn-hidden-size 14336 --group-query-attention --num-query-groups 8 --swiglu \\
        --untie-embeddings-and-output-weights --position-embedding-type rope \\
        --seq-length 4096 --vocab-size 128256 --global-batch-size 1024 \\
        --hosts 64 --devices-per-host 8 --device-memory-gib 80 --device-tflops 989 --nic-gbps 400
    ... --cluster cluster.json          # speeds measured by tools/calibrate_cluster.py
    ... --json plan.json --picture layout.png --top 15

Prints a ranked table (predicted step time, tokens/s, bubble, memory per device of the fullest
stage, bytes per link, the bottleneck), the best layout's flags ready to paste, and draws the
best layout on the cluster. Model flags keep Megatron-LM's names. Pure planning: nothing runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from megareshard.planner import ClusterSpec, ModelShape, PlanError, plan_layouts
from megareshard.planner.calibration import load_cluster
from megareshard.planner.report import draw_layout, table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan_layout.py", description=__doc__.splitlines()[0])
    g = p.add_argument_group("model (Megatron-LM's flags)")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--vocab-size", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=("learned_absolute", "rope", "none"))
    g.add_argument("--global-batch-size", type=int, required=True)
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", default=None, help="a cluster JSON measured by tools/calibrate_cluster.py (its "
                   "speeds replace the flags below; --hosts / --devices-per-host, when given, replace its counts)")
    c.add_argument("--hosts", type=int, default=None)
    c.add_argument("--devices-per-host", type=int, default=None)
    c.add_argument("--device-memory-gib", type=float, default=80.0, help="memory per device, GiB (default: "
                   "%(default)g, an H100)")
    c.add_argument("--device-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s per device "
                   "(default: %(default)g, an H100 SXM)")
    c.add_argument("--efficiency", type=float, default=0.45, help="achieved fraction of the peak in a layer's GEMMs "
                   "(default: %(default)g)")
    c.add_argument("--nic-gbps", type=float, default=400.0, help="NIC Gbit/s per host and direction (default: "
                   "%(default)g)")
    c.add_argument("--intra-gbps", type=float, default=3600.0, help="intra-host link Gbit/s per device (default: "
                   "%(default)g, NVLink 4)")
    s = p.add_argument_group("search")
    s.add_argument("--micro-batch-sizes", default="1,2,4,8")
    s.add_argument("--zero-stages", default="0,1,2", help="comma list of 0-3 (3: parameters sharded too; its per-layer "
                   "all-gathers make it slower per step, so --auto-layout takes it only when nothing else fits)")
    s.add_argument("--no-recompute", action="store_true", help="never consider full recomputation")
    s.add_argument("--schedules", default=None, help="comma list (default: every registered schedule; the table "
                   "marks those the runtime does not execute yet)")
    s.add_argument("--runtime-only", action="store_true", help="only schedules the pipeline runtime executes "
                   "(what --auto-layout applies)")
    s.add_argument("--no-uneven-splits", action="store_true", help="only even layer splits")
    s.add_argument("--no-stage-layouts", action="store_true", help="only uniform meshes (no --stage-layouts)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=12, help="rows of the table")
    o.add_argument("--json", default=None, help="write every candidate that fits (JSON)")
    o.add_argument("--picture", default=None, help="draw the best layout on the cluster (PNG)")
    return p


def describe_cluster(cluster: ClusterSpec, source: str) -> str:
    """The cluster the plan assumes, in one line, and where its numbers came from."""
    return (f"cluster ({source}): {cluster.hosts} hosts × {cluster.devices_per_host} devices; per device "
            f"{cluster.device_memory_gib:g} GiB, {cluster.device_tflops:g} TFLOP/s peak ({cluster.efficiency:.0%} of it "
            f"achieved in GEMMs), intra-host links {cluster.intra_gbps:g} Gbit/s; NIC {cluster.nic_gbps:g} Gbit/s per "
            "host and direction")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        ints = lambda text, flag: [int(x) for x in text.split(",")]  # noqa: E731
        groups = a.num_query_groups if a.group_query_attention else None
        if a.group_query_attention and not groups:
            raise PlanError("--group-query-attention needs --num-query-groups")
        model = ModelShape(a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.vocab_size,
                           ffn_hidden_size=a.ffn_hidden_size, num_query_groups=groups, swiglu=a.swiglu,
                           untied=a.untie_embeddings_and_output_weights,
                           learned_positions=a.position_embedding_type == "learned_absolute")
        if a.cluster:
            cluster = load_cluster(a.cluster, hosts=a.hosts, devices_per_host=a.devices_per_host)
            source = f"measured, {a.cluster}"
        elif a.hosts is None or a.devices_per_host is None:
            raise PlanError("give --hosts and --devices-per-host (or --cluster FILE)")
        else:
            cluster = ClusterSpec(a.hosts, a.devices_per_host, a.device_memory_gib, a.device_tflops, a.efficiency,
                                  a.nic_gbps, a.intra_gbps)
            speeds = ("device_memory_gib", "device_tflops", "efficiency", "nic_gbps", "intra_gbps")
            source = ("the flags' defaults, an H100 cluster: give yours or --cluster FILE"
                      if all(getattr(a, k) == p.get_default(k) for k in speeds) else "from the flags")
        print(describe_cluster(cluster, source), flush=True)
        stats: dict[str, int] = {}
        t0, c0 = time.monotonic(), time.process_time()
        ranked = plan_layouts(model, cluster, a.global_batch_size, micro_batches=ints(a.micro_batch_sizes, "mb"),
                              zero_stages=ints(a.zero_stages, "zero"),
                              recompute_options=(False,) if a.no_recompute else (False, True), stats=stats,
                              schedules=a.schedules.split(",") if a.schedules else None, runtime_only=a.runtime_only,
                              uneven_splits=not a.no_uneven_splits, stage_meshes=not a.no_stage_layouts)
        dt, cpu = time.monotonic() - t0, time.process_time() - c0
    except (PlanError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"planned {cluster.hosts} hosts x {cluster.devices_per_host} devices in {dt:.1f} s ({cpu:.1f} s CPU): "
          f"{stats['enumerated']} candidates, {stats['pruned_memory']} pruned by memory, "
          f"{stats['simulated']} pipelines simulated")
    print(table(ranked[:a.top], cluster))
    best = ranked[0]
    if not best.runtime:
        run = next((c for c in ranked if c.runtime), None)
        print(f"\nnote: the best layout's schedule {best.schedule} is not executed by the pipeline runtime yet"
              + (f"; the best it executes: {run.name} ({run.step_s:.3f} s/step)" if run else ""))
    print(f"\nbest: {best.name} — {best.step_s:.3f} s/step, {best.tokens_per_s:,.0f} tokens/s, "
          f"bottleneck: {best.bottleneck}")
    print(f"flags: {best.flags(model.num_layers)}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"model": vars(model), "cluster": vars(cluster), "global_batch": a.global_batch_size,
                       "stats": stats, "candidates": [c.to_dict() for c in ranked]}, f, indent=1)
        print(f"candidates: {a.json}")
    if a.picture:
        draw_layout(best, cluster, a.picture)
        print(f"picture: {a.picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
