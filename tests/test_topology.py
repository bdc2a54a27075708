"""Topology (pure) and ParallelContext (8 gloo ranks) against each other and against the
SageMaker model parallelism library's rank mechanism."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megareshard.parallel import CommVolume, ParallelContext, Topology, TopologyError, parse_order
from tests.harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]
ORDERS = ["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp"]


@st.composite
def layouts(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    pp = draw(st.sampled_from([1, 2, 3, 4]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    world = tp * pp * dp
    nproc = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    return Topology(world, tp=tp, pp=pp, nproc_per_node=nproc, order=draw(st.sampled_from(ORDERS)))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_group_families_partition_and_are_orthogonal(topo):
    for axes in ["tp", "pp", "dp", ("tp", "pp"), ("tp", "dp")]:
        groups = topo.groups(axes)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(topo.world_size)), f"{axes}: every rank in exactly one group"
        size = 1
        for a in ((axes,) if isinstance(axes, str) else axes):
            size *= topo.degree(a)
        assert all(len(g) == size for g in groups)
        for r in range(topo.world_size):
            assert r in topo.group_of(axes, r)
    # orthogonality: a tp group and a dp group (and pp) share at most one rank, and the
    # tp, dp and pp groups of a rank meet only in that rank
    for r in range(topo.world_size):
        tp, dp, pp = (set(topo.group_of(a, r)) for a in ("tp", "dp", "pp"))
        assert tp & dp == {r} and tp & pp == {r} and dp & pp == {r}
    # coordinates round-trip
    for r in range(topo.world_size):
        c = topo.coords(r)
        assert topo.rank_of(tp=c.tp, dp=c.dp, pp=c.pp) == r
        assert c.host * topo.nproc_per_node + c.local_rank == r


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_tp_groups_inside_a_host_when_tp_first_and_divides(topo):
    if topo.order[0] == "tp" and topo.nproc_per_node % topo.tp == 0:
        for g in topo.groups("tp"):
            assert len(topo.hosts_of(g)) == 1
        Topology(topo.world_size, tp=topo.tp, pp=topo.pp, nproc_per_node=topo.nproc_per_node,
                 order=topo.order, keep_tp_in_host=True)  # accepted


def test_seed_001_table():
    """The 8-GPU table of the SageMaker model parallelism library's rank mechanism (tp 2, pp 2,
    ranks placed pp-tp-dp)."""
    text = (ROOT.parent / "shared" / "seeds" / "001_0000785cb3a16ca9.txt")
    expected = [
        (0, 0, 0, 0, 0), (1, 0, 0, 0, 1), (0, 1, 0, 1, 2), (1, 1, 0, 1, 3),
        (0, 0, 1, 2, 0), (1, 0, 1, 2, 1), (0, 1, 1, 3, 2), (1, 1, 1, 3, 3),
    ]  # (pp_rank, tp_rank, rdp_rank, dp_rank, mp_rank) of GPU0..GPU7
    if text.exists():  # when the seeds are beside the repo, check the table is the seed's own
        seed = text.read_text()
        for gpu, (pp, tp, rdp, dp, mp) in enumerate(expected):
            assert (f"GPU{gpu}: pp_rank {pp}, tp_rank {tp}, rdp_rank {rdp}, dp_rank {dp}, mp_rank {mp}") in seed
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "show_topology.py"), "--world-size", "8",
                          "--tp", "2", "--pp", "2", "--order", "pp-tp-dp", "--sagemaker", "--json"],
                         check=True, capture_output=True, text=True).stdout
    recs = json.loads(out)
    got = [(r["pp_rank"], r["tp_rank"], r["rdp_rank"], r["dp_rank"], r["mp_rank"]) for r in recs]
    assert got == expected


def _show_topology(argv, capsys):
    """tools/show_topology.py's main in this process (a pure planning tool: no process group): exit code, out, err."""
    sys.path.insert(0, str(ROOT / "tools"))
    import show_topology

    code = show_topology.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_show_topology_table_and_errors(capsys):
    # as a script once: the exit code and the one-line error reach the shell
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "show_topology.py"), "--world-size", "6", "--tp", "4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "world size 6 is not divisible by tp 4" in bad.stderr
    assert bad.stderr.count("\n") == 1 and not bad.stdout
    code, out, _ = _show_topology(["--world-size", "16", "--nproc-per-node", "8", "--tp", "2", "--pp", "2"], capsys)
    assert code == 0 and "order tp-dp-pp" in out and "tp_rank" in out and "hosts spanned" in out
    code, out, _ = _show_topology(["--world-size", "4", "--tp", "2", "--json"], capsys)
    recs = json.loads(out)
    assert code == 0 and set(recs[0]) == {"rank", "host", "local_rank", "tp_rank", "pp_rank", "dp_rank", "mp_rank"}


def test_show_topology_expert_groups_with_num_experts(capsys):
    # --num-experts alone (ep 1, etp = tp): the groups are listed, each rank holds all 8 experts' half widths
    code, out, _ = _show_topology(["--world-size", "4", "--tp", "2", "--num-experts", "8"], capsys)
    assert code == 0 and "expert groups (ep 1 × etp 2 × edp 2 per pipeline stage):" in out
    assert "8 experts per MoE layer, 8 per rank, each expert's width in 2 slice(s):" in out
    assert "r1[ep0 etp1 edp0 experts 0-7]" in out and "edp    expert-data-parallel" in out and "[0,2] [1,3]" in out
    # ep 4 · etp 1 on tp 2 · dp 4: Megatron-Core's grid (etp, then ep, then edp over j = dp·tp + tp)
    argv = ["--world-size", "8", "--tp", "2", "--num-experts", "8", "--expert-model-parallel-size", "4",
            "--expert-tensor-parallel-size", "1"]
    code, out, _ = _show_topology(argv, capsys)
    assert code == 0 and "r5[ep1 etp0 edp1 experts 2-3]" in out and "ep     expert-parallel (token all-to-all): " \
        "[0,1,2,3] [4,5,6,7]" in out and "[0,4] [1,5] [2,6] [3,7]" in out
    code, out, _ = _show_topology(argv + ["--json"], capsys)
    rec = json.loads(out)[5]
    assert code == 0 and (rec["ep"], rec["etp"], rec["edp"], rec["experts"]) == (1, 0, 1, [2, 4])
    code, _, err = _show_topology(["--world-size", "4", "--num-experts", "6", "--expert-model-parallel-size", "4"],
                                  capsys)
    assert code == 2 and err == "error: --num-experts 6 is not a positive multiple of --expert-model-parallel-size 4\n"
    # per-stage layouts: every stage its own grid (etp default: the stage's tp)
    code, out, _ = _show_topology(["--world-size", "4", "--stage-layouts", "tp2dp1,tp1dp2", "--num-experts", "4",
                                   "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], capsys)
    assert code == 0 and "expert groups (ep 2 × etp 1 in each stage):" in out
    assert "r1[ep1 etp0 edp0 experts 2-3] r2[ep0 etp0 edp0 experts 0-1]" in out
    # the trainer's rank map: the same coordinates, the experts held
    from megareshard.launch import RankInfo, rank_map_table
    topo = Topology(8, tp=2, nproc_per_node=4)
    table = rank_map_table([RankInfo(r, f"node{r // 4}", r % 4, 100 + r) for r in range(8)], topo, (4, 1, 8))
    assert "experts ep 4 × etp 1 × edp 2, 8 per MoE layer, 2 per rank" in table
    assert "r5[pp0 tp1 dp2 ep1 etp0 edp1 experts 2-3]" in table


def test_show_topology_stage_layouts(capsys):
    code, out, _ = _show_topology(["--world-size", "8", "--nproc-per-node", "4", "--stage-layouts", "tp1dp4,tp2dp2"],
                                  capsys)
    assert code == 0 and "stage 0 tp1×dp4 ranks 0..3" in out and "stage 1 tp2×dp2 ranks 4..7" in out
    code, _, err = _show_topology(["--world-size", "8", "--stage-layouts", "tp1dp4,tp2dp4"], capsys)
    assert code == 2 and "error:" in err


def test_default_order_follows_volume():
    assert CommVolume.for_gpt(4096, 2048, 8).order() == ("tp", "dp", "pp")  # ordinary GPT: TP > DP > PP
    # a narrow model with long sequences moves more pipeline than gradient bytes
    assert CommVolume.for_gpt(64, 2048, 8).order() == ("tp", "pp", "dp")
    # degree-1 axes move nothing and go outermost
    assert CommVolume.for_gpt(4096, 2048, 8, tp=1).order()[-1] == "tp"
    assert "order tp-dp-pp" in CommVolume.for_gpt(4096, 2048, 8).describe()


def test_expert_all_to_all_counts_on_the_data_parallel_axis_so_expert_groups_stay_in_a_host():
    """The expert groups are cut from the data-parallel ranks: with ep > 1 their token all-to-alls (4·k·b·s·h per
    MoE layer) add to dp's volume, which can move dp inside pp and put an expert group inside one host."""
    from megareshard.parallel.expert_topology import expert_groups

    dense = CommVolume.for_gpt(64, 2048, 8, tp=2, dp=2, pp=2)
    assert dense.order() == ("tp", "pp", "dp")
    moe = CommVolume.for_gpt(64, 2048, 8, tp=2, dp=2, pp=2, ep=2, topk=2, moe_share=0.5)
    assert moe.dp == dense.dp + 4 * 2 * 8 * 2048 * 64 * 0.5 and moe.order() == ("tp", "dp", "pp")
    assert CommVolume.for_gpt(64, 2048, 8, tp=2, dp=2, pp=2, ep=1, topk=2, moe_share=1.0) == dense
    hosts = lambda order: [{r // 4 for r in g} for g in expert_groups(  # noqa: E731
        Topology(8, tp=2, pp=2, nproc_per_node=4, order=order), 2, None)["ep"]]
    assert all(len(h) == 2 for h in hosts(dense.order()))  # across the NIC
    assert all(len(h) == 1 for h in hosts(moe.order()))  # inside a host


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), "world size 6 is not divisible by tp 4 × pp 1"),
    (dict(world_size=8, tp=2, pp=3), "world size 8 is not divisible by tp 2 × pp 3"),
    (dict(world_size=8, nproc_per_node=3), "world size 8 is not a multiple of nproc-per-node 3"),
    (dict(world_size=8, tp=4, nproc_per_node=2, keep_tp_in_host=True), "tp 4 does not divide nproc-per-node 2"),
    (dict(world_size=8, tp=2, nproc_per_node=4, order="dp-tp-pp", keep_tp_in_host=True), "does not put tp innermost"),
    (dict(world_size=8, order="tp-xp-pp"), "unknown axis 'xp'"),
    (dict(world_size=8, order="tp-tp-pp"), "repeated tp"),
    (dict(world_size=8, order="tp-dp"), "missing pp"),
    (dict(world_size=0), "world_size must be a positive integer"),
    (dict(world_size=4, tp=0), "tp must be a positive integer"),
])
def test_validation_errors(kwargs, message):
    with pytest.raises(TopologyError, match=message.replace("(", r"\(")):
        Topology(**kwargs)


def test_coordinate_errors():
    topo = Topology(8, tp=2, pp=2)
    with pytest.raises(TopologyError, match="rank 8 is outside 0..7"):
        topo.coords(8)
    with pytest.raises(TopologyError, match="pp coordinate 2 is outside 0..1"):
        topo.rank_of(pp=2)
    assert parse_order(["PP", "tp", "dp"]) == ("pp", "tp", "dp")


def _context_queries(rank, world_size, layouts):
    """One launch checks several layouts: groups built, queries agree with the pure Topology."""
    import torch
    import torch.distributed as dist

    out = []
    for kw in layouts:
        topo = Topology(world_size, **kw)
        ctx = ParallelContext.create(topo)
        c = topo.coords(rank)
        rec = {"tp": ctx.tp_rank(), "pp": ctx.pp_rank(), "dp": ctx.dp_rank(), "mp": ctx.mp_rank(),
               "rdp": ctx.rdp_rank(), "smp_dp": ctx.smp_dp_rank(), "first": ctx.is_first_stage(),
               "last": ctx.is_last_stage(), "next": ctx.stage_neighbour(1), "prev": ctx.stage_neighbour(-1)}
        # each group really contains exactly its members: all-reduce the ranks over it
        sums = {}
        for family in ("tp", "pp", "dp", "mp", "stage", "embedding"):
            if ctx.groups[family] is None:
                continue
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=ctx.groups[family])
            sums[family] = t.item()
        expected = {
            "tp": c.tp, "pp": c.pp, "dp": c.dp, "mp": topo.mp_rank(rank), "rdp": c.dp,
            "smp_dp": topo.stage_dp_rank(rank), "first": c.pp == 0, "last": c.pp == topo.pp - 1,
            "next": topo.rank_of(tp=c.tp, dp=c.dp, pp=c.pp + 1) if c.pp + 1 < topo.pp else None,
            "prev": topo.rank_of(tp=c.tp, dp=c.dp, pp=c.pp - 1) if c.pp > 0 else None,
        }
        exp_sums = {f: float(sum(topo.group_of(a, rank))) for f, a in
                    [("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mp", ("tp", "pp")), ("stage", ("tp", "dp"))]}
        emb = next(g for g in topo.embedding_groups() if rank in g) if (c.pp in (0, topo.pp - 1)) else None
        if emb is not None:
            exp_sums["embedding"] = float(sum(emb))
        out.append((rec == expected, rec, expected, sums == exp_sums, sums, exp_sums))
    return out


def test_context_matches_topology_on_8_ranks():
    layouts_ = [dict(tp=2, pp=2, order="tp-dp-pp", nproc_per_node=4),
                dict(tp=2, pp=2, order="pp-tp-dp"),
                dict(tp=4, pp=1),
                dict(tp=1, pp=4, order="dp-pp-tp", nproc_per_node=2),
                dict(tp=2, pp=4)]
    results = run_ranks(_context_queries, 8, layouts_, timeout=120)
    for rank, per_layout in enumerate(results):
        for kw, (ok, rec, exp, sums_ok, sums, exp_sums) in zip(layouts_, per_layout):
            assert ok, f"rank {rank} {kw}: {rec} != {exp}"
            assert sums_ok, f"rank {rank} {kw}: group sums {sums} != {exp_sums}"


def test_single_process_context():
    ctx = ParallelContext.single_process()
    assert (ctx.tp_rank(), ctx.pp_rank(), ctx.dp_rank(), ctx.mp_rank()) == (0, 0, 0, 0)
    assert ctx.is_first_stage() and ctx.is_last_stage() and ctx.stage_neighbour(1) is None
