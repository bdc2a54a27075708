"""Print the rank map of a parallel layout: which host, tp, pp and dp rank every global rank gets.

    python tools/show_topology.py --world-size 16 --nproc-per-node 8 --tp 2 --pp 4
    python tools/show_topology.py --world-size 8 --tp 2 --pp 2 --order pp-tp-dp --sagemaker
    python tools/show_topology.py ... --json              # machine-readable records
    python tools/show_topology.py --world-size 8 --nproc-per-node 4 --stage-layouts tp1dp4,tp2dp2
    python tools/show_topology.py --world-size 256 --nproc-per-node 8 --tp 8 --pp 8 --communicators
    python tools/show_topology.py --world-size 8 --nproc-per-node 4 --tp 2 --expert-model-parallel-size 2
    python tools/show_topology.py --world-size 8 --tp 2 --num-experts 8 --expert-model-parallel-size 4 \
        --expert-tensor-parallel-size 1    # MoE: each rank's expert coordinates and experts, the expert groups

The expert groups (ep, etp, edp, etp × ep: Megatron-Core's order inside each pipeline stage) are listed when
--num-experts is given (whatever ep and etp, the defaults 1 and --tp included) or ep / etp differ from the
defaults; with --num-experts every rank's record also says which experts it holds. With --stage-layouts every
stage is its own expert grid (etp default: the stage's tp).

Without --order the order comes from per-layer communication volume (docs/design.md §1) for the
model shape given by --hidden-size/--seq-length/--micro-batch-size, and the volumes are printed.
"""
from __future__ import annotations

import argparse
import json
import sys

from megareshard.parallel import CommVolume, Topology, TopologyError, hosts_spanned
from megareshard.parallel.expert_topology import EXPERT_FAMILIES, expert_coords, expert_groups
from megareshard.parallel.stage_topology import StageTopology
from megareshard.resharding import strategy_names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="show_topology.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int, default=None, help="processes per host (default: all on one host)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--order", default=None, help="e.g. tp-dp-pp (innermost first); default: by volume")
    p.add_argument("--hidden-size", type=int, default=4096, help="model shape used to choose the order")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--keep-tp-in-host", action="store_true", help="fail unless every tp group sits in one host")
    p.add_argument("--stage-layouts", default=None,
                   help="per-stage (tp, dp), e.g. tp1dp4,tp2dp2: each stage on its own block of ranks")
    p.add_argument("--sagemaker", action="store_true", help="the SageMaker model parallelism library's names: pp/tp/rdp/dp/mp ranks")
    p.add_argument("--json", action="store_true", help="print a JSON list of per-rank records")
    p.add_argument("--communicators", action="store_true",
                   help="also count the communicators a GPT's stage boundaries create (one per distinct "
                        "sender and receiver set, the NCCL rule) for --reshard-strategy")
    p.add_argument("--reshard-strategy", default="broadcast", choices=strategy_names(planned=True))
    p.add_argument("--sequence-parallel", action="store_true", help="hidden states sharded over tp (S1,S0,R)")
    p.add_argument("--num-experts", type=int, default=None,
                   help="MoE: experts per MoE layer; the expert groups and each rank's experts are listed")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="MoE: expert-parallel degree (ep); the expert groups are listed")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="MoE: expert-tensor-parallel degree (etp; default --tp)")
    a = p.parse_args(argv)
    ep, E = a.expert_model_parallel_size, a.num_experts
    if a.stage_layouts:   # every stage its own expert grid (etp default: each stage's tp)
        etp = a.expert_tensor_parallel_size
        try:
            topo = StageTopology(a.world_size, a.stage_layouts, a.nproc_per_node)
            experts = E is not None or ep > 1 or etp is not None
            _check_num_experts(E, ep)
            groups = expert_groups(topo, ep, etp) if experts else None
        except (TopologyError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if a.json:
            print(json.dumps(_with_experts(topo.records(), topo, ep, etp, E) if experts else topo.records(), indent=1))
            return 0
        print(topo.table())
        if groups is not None:
            print(expert_group_lines(topo, groups, ep, etp, E))
        return 0
    try:
        if a.world_size < 1 or a.tp < 1 or a.pp < 1:
            raise TopologyError(f"degrees must be positive: world size {a.world_size}, tp {a.tp}, pp {a.pp}")
        dp = max(a.world_size // (a.tp * a.pp), 1)
        volume = CommVolume.for_gpt(a.hidden_size, a.seq_length, a.micro_batch_size, tp=a.tp, dp=dp, pp=a.pp)
        order = a.order or volume.order()
        topo = Topology(a.world_size, tp=a.tp, pp=a.pp, nproc_per_node=a.nproc_per_node, order=order,
                        keep_tp_in_host=a.keep_tp_in_host)
        etp = a.expert_tensor_parallel_size
        experts = E is not None or ep > 1 or (etp is not None and etp != a.tp)
        etp = a.tp if etp is None else etp
        _check_num_experts(E, ep)
        groups = expert_groups(topo, ep, etp) if experts else None
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        records = topo.records(sagemaker=a.sagemaker)
        print(json.dumps(_with_experts(records, topo, ep, etp, E) if experts else records, indent=1))
        return 0
    if a.order is None:
        print(f"order chosen by {volume.describe()} "
              f"(hidden {a.hidden_size}, seq {a.seq_length}, micro batch {a.micro_batch_size})")
    print(topo.table(sagemaker=a.sagemaker))
    spans = {axis: hosts_spanned(topo, axis) for axis in ("tp", "dp", "pp")}
    print("hosts spanned by the widest group: " + ", ".join(f"{k} {v}" for k, v in spans.items()))
    if groups is not None:
        print(expert_group_lines(topo, groups, ep, etp, E))
    if a.communicators:
        print(count_communicators(topo, a.seq_length, a.micro_batch_size, a.hidden_size, a.reshard_strategy,
                                  a.sequence_parallel))
    return 0


def _check_num_experts(E: int | None, ep: int) -> None:
    if E is not None and (E < 1 or E % ep):
        raise TopologyError(f"--num-experts {E} is not a positive multiple of --expert-model-parallel-size {ep}")


def _with_experts(records: list[dict], topo, ep: int, etp: int | None, E: int | None) -> list[dict]:
    """``records`` with each rank's expert coordinates (and, given E, its experts ``[first, stop)``)."""
    for r in records:
        c = expert_coords(topo, r["rank"], ep, etp)
        r.update({k: v for k, v in c.items() if k != "pp"})
        if E is not None:
            r["experts"] = [c["ep"] * (E // ep), (c["ep"] + 1) * (E // ep)]
    return records


def expert_group_lines(topo, groups: dict[str, list[tuple[int, ...]]], ep: int, etp: int | None,
                       num_experts: int | None = None) -> str:
    """The expert groups of an MoE layout (Megatron-Core's order: etp innermost, then ep, then edp), each family's
    groups and the most hosts one of them spans (the ep group's all-to-all is the traffic to keep in a host); with
    ``num_experts`` also each rank's expert coordinates and the experts it holds (of every MoE layer). Per-stage
    layouts (``etp`` None: each stage's tp): every stage is its own grid."""
    host = {r: topo.coords(r).host for r in range(topo.world_size)}
    if getattr(topo, "per_stage", False):
        lines = [f"expert groups (ep {ep} × etp {etp if etp is not None else 'the stage tp'} in each stage):"]
    else:
        lines = [f"expert groups (ep {ep} × etp {etp} × edp {topo.tp * topo.dp // (ep * etp)} per pipeline stage):"]
    if num_experts is not None:
        per = num_experts // ep
        cells = []
        for r in range(topo.world_size):
            c = expert_coords(topo, r, ep, etp)
            held = f"{c['ep'] * per}" if per == 1 else f"{c['ep'] * per}-{(c['ep'] + 1) * per - 1}"
            cells.append(f"r{r}[ep{c['ep']} etp{c['etp']} edp{c['edp']} experts {held}]")
        width = f", each expert's width in {etp} slice(s)" if etp is not None and etp > 1 else ""
        lines.append(f"  {num_experts} experts per MoE layer, {per} per rank{width}:")
        lines += ["    " + " ".join(cells[i:i + 4]) for i in range(0, min(len(cells), 32), 4)]
        if len(cells) > 32:
            lines.append(f"    … ({len(cells)} ranks; --json lists every one)")
    names = {"ep": "expert-parallel (token all-to-all)", "etp": "expert-tensor-parallel",
             "edp": "expert-data-parallel (expert gradients reduced here only)",
             "etp_ep": "etp × ep (all-gather dispatcher, token counts)"}
    for fam in EXPERT_FAMILIES:
        spans = max(len({host[r] for r in g}) for g in groups[fam])
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[fam][:16])
        more = f" … ({len(groups[fam])} groups)" if len(groups[fam]) > 16 else ""
        lines.append(f"  {fam:<6} {names[fam]}: {shown}{more}; spans up to {spans} host(s)")
    return "\n".join(lines)


def count_communicators(topo: Topology, seq: int, micro_batch: int, hidden: int, strategy: str,
                        sequence_parallel: bool) -> str:
    """How many resharding communicators the GPT's stage boundaries create, and per rank (pure planning)."""
    import torch

    from megareshard.pipeline import PipelineGraph
    from megareshard.pipeline.comm import EdgeTensor, communicator_keys, plan_edges
    from megareshard.pipeline.stage import hidden_spec, stage_mesh

    graph = PipelineGraph(topo.pp)
    meshes = [stage_mesh(topo, i) for i in range(topo.pp)]
    spec = hidden_spec(sequence_parallel and topo.tp > 1)
    shape = (seq, micro_batch * topo.dp, hidden)
    decls = [EdgeTensor(e, shape, torch.bfloat16, meshes[e.src], spec, meshes[e.dst], spec) for e in graph.edges]
    keys = communicator_keys(plan_edges(graph, decls, strategy=strategy, scheduler="loadbalance", chunks=None))
    per_rank: dict[int, int] = {}
    for parts, _ in keys:
        for r in parts:
            per_rank[r] = per_rank.get(r, 0) + 1
    sizes = sorted({len(parts) for parts, _ in keys})
    return (f"resharding communicators ({strategy}, hidden {spec}): {len(keys)} for {len(graph.edges)} edges x 2 "
            f"directions, {len(sizes) and min(sizes)}-{len(sizes) and max(sizes)} ranks each; a rank is in at most "
            f"{max(per_rank.values(), default=0)} (one per distinct participant and forwarder set, created once at "
            "start-up; the two directions between two single ranks share one)")


if __name__ == "__main__":
    sys.exit(main())
