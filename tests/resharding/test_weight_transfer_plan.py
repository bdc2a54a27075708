"""Weight-transfer planning (megareshard/resharding/weight_transfer), pure: no processes.

The box decomposition equals the library's mesh decomposition where both apply; every destination element is
delivered exactly once per rank; replicated sources are spread over dp replicas; buckets respect their bound; the
plan is cached by everything that determines it; bad input is one line with the numbers."""
from __future__ import annotations

from collections import Counter

import pytest

from megareshard.models.config import ModelConfig
from megareshard.resharding import Mesh, ShardingSpec, decompose
from megareshard.resharding.spec import local_slices
from megareshard.resharding.weight_transfer import (ParamInfo, Replica, clear_plan_cache, decompose_boxes,
                                                    layout_boxes, plan_weight_transfer)
from megareshard.transfer import Destination, destination_boxes

V, H = 100, 16
PARAMS = [ParamInfo("embedding.word_embeddings.weight", (V, H), "float32", 0, True),
          ParamInfo("final_layernorm.weight", (H,), "float32")]
for i in range(4):
    PARAMS += [ParamInfo(f"layers.{i}.attention.qkv.weight", (3 * H, H), "float32", 0),
               ParamInfo(f"layers.{i}.attention.proj.weight", (H, H), "bfloat16", 1),
               ParamInfo(f"layers.{i}.input_layernorm.weight", (H,), "float32")]


def _hosts(n, per=2):
    return {r: r // per for r in range(n)}


def test_box_decomposition_is_the_mesh_decomposition():
    shape = (12, 10)
    src_mesh, dst_mesh = Mesh.grid(2, 2), Mesh.grid(1, 3, first_rank=4, first_host=2)
    src_spec, dst_spec = ShardingSpec.parse("S0,S1"), ShardingSpec.parse("R,S1")
    want = decompose(shape, src_mesh, src_spec, dst_mesh, dst_spec, 4)
    reg = lambda m, s: {r: tuple((x.start, x.stop) for x in local_slices(shape, m, s, r)) for r in m.flat_ranks}
    got = decompose_boxes("t", shape, reg(src_mesh, src_spec), reg(dst_mesh, dst_spec), 4)
    assert [(t.slice, t.senders, t.receivers, t.nbytes) for t in got] == \
        [(t.slice, t.senders, t.receivers, t.nbytes) for t in want]


def _delivered(plan):
    """(rank, name) -> Counter of elements delivered (pieces and local copies)."""
    got: dict = {}
    for u, name in zip(plan.pieces, plan.piece_names):
        for r in u.receivers:
            if r not in u.senders:
                got.setdefault((r, name), []).append(tuple((s.start, s.stop) for s in u.slice))
    for r, name, reg in plan.local_copies:
        got.setdefault((r, name), []).append(reg)
    return got


def _volume(regs):
    n = 0
    for reg in regs:
        v = 1
        for a, b in reg:
            v *= b - a
        n += v
    return n


@pytest.mark.parametrize("tp,pp,dp,virtual,zero3", [(2, 2, 2, 1, False), (1, 2, 2, 2, True), (2, 1, 2, 1, True)])
def test_every_destination_element_once_and_buckets_bounded(tp, pp, dp, virtual, zero3):
    n = tp * pp * dp
    src = layout_boxes(PARAMS, list(range(n)), tp=tp, pp=pp, dp=dp, virtual=virtual, zero3=zero3, divisible_by=8)
    reps = [Replica("a", layout_boxes(PARAMS, [n, n + 1], tp=2, divisible_by=8)),
            Replica("b", layout_boxes(PARAMS, [n + 2], tp=1, divisible_by=8)),
            Replica("same", layout_boxes(PARAMS, [0], tp=1, divisible_by=8))]
    plan = plan_weight_transfer(PARAMS, src, reps, _hosts(n + 3), bucket_mb=0.002)
    got = _delivered(plan)
    for rep in reps:
        for r, boxes in rep.boxes.items():
            for b in boxes:
                if b.local:
                    continue
                assert _volume(got[(r, b.name)]) == b.numel, (r, b.name)  # disjoint pieces tiling the box
    assert plan.streams > 1  # the tp-1 replica's rank needs pieces from several holders
    for b in plan.buckets:
        assert b.numel * (2 if b.dtype == "bfloat16" else 4) <= plan.bucket_bytes // (2 * plan.streams)
    # what a rank stages in one wave (the sum of its buckets there) stays within the bound
    for w in range(plan.num_waves):
        staged: Counter = Counter()
        for b in plan.buckets:
            if b.wave == w:
                for r in {b.sender, *b.receivers}:
                    staged[r] += b.numel * (2 if b.dtype == "bfloat16" else 4)
        assert max(staged.values()) <= plan.bucket_bytes
    assert max(plan.staging_bytes().values()) <= plan.bucket_bytes
    assert "weight transfer" in plan.describe()


def test_replicated_sources_spread_over_dp_replicas():
    src = layout_boxes(PARAMS, list(range(4)), tp=1, dp=4, divisible_by=8)
    plan = plan_weight_transfer(PARAMS, src, [Replica("g", layout_boxes(PARAMS, [4, 5], tp=2, divisible_by=8))],
                                {r: r for r in range(6)}, bucket_mb=1)
    sent = Counter()
    for u in plan.pieces:
        sent[u.sender] += u.nbytes
    assert set(sent) == {0, 1, 2, 3}
    assert max(sent.values()) <= 1.5 * min(sent.values())
    # two replicas that need the same bytes: one piece, both receivers (one broadcast)
    two = plan_weight_transfer(PARAMS, src, [Replica("x", layout_boxes(PARAMS, [4], divisible_by=8)),
                                             Replica("y", layout_boxes(PARAMS, [5], divisible_by=8))],
                               {r: r for r in range(6)}, bucket_mb=1)
    assert all(set(u.receivers) == {4, 5} for u in two.pieces)
    assert two.wire_bytes == sum(p.nbytes for p in PARAMS)


def test_plan_cache_keyed_by_everything():
    clear_plan_cache()
    src = layout_boxes(PARAMS, [0, 1], tp=2, divisible_by=8)
    rep = [Replica("g", layout_boxes(PARAMS, [2], divisible_by=8))]
    a = plan_weight_transfer(PARAMS, src, rep, _hosts(3), bucket_mb=1)
    assert plan_weight_transfer(PARAMS, src, rep, _hosts(3), bucket_mb=1) is a
    assert plan_weight_transfer(PARAMS, src, rep, _hosts(3), bucket_mb=2).key != a.key
    other = layout_boxes(PARAMS, [0, 1], tp=1, dp=2, divisible_by=8)
    assert plan_weight_transfer(PARAMS, other, rep, _hosts(3), bucket_mb=1).key != a.key
    assert plan_weight_transfer(PARAMS, src, rep, {0: 0, 1: 0, 2: 0}, bucket_mb=1).key != a.key
    bf = [ParamInfo(p.name, p.shape, "bfloat16", p.partition_dim, p.vocab_padded) for p in PARAMS]
    assert plan_weight_transfer(bf, src, rep, _hosts(3), bucket_mb=1).key != a.key


def test_bad_input_one_line_with_numbers():
    cfg = ModelConfig(num_layers=4, hidden_size=16, num_attention_heads=4, group_query_attention=True,
                      num_query_groups=2, vocab_size=V, seq_length=8)
    with pytest.raises(ValueError, match="tensor-parallel size 4 does not divide num_attention_heads 4 and "
                                         "num_query_groups 2"):
        destination_boxes(Destination("g", (0, 1, 2, 3), tp=4), PARAMS, cfg)
    with pytest.raises(ValueError, match=r"tp 2 × pp 1 needs 2 ranks, got 1"):
        destination_boxes(Destination("g", (5,), tp=2), PARAMS, cfg)
    src = layout_boxes(PARAMS, [0, 1], tp=2, divisible_by=8)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] are both source and destination"):
        plan_weight_transfer(PARAMS, src, [Replica("g", layout_boxes(PARAMS, [1], divisible_by=8))], _hosts(2),
                             allow_overlap=False)
    with pytest.raises(ValueError, match="rank 2 is in destination replicas a and b"):
        plan_weight_transfer(PARAMS, src, [Replica("a", layout_boxes(PARAMS, [2], divisible_by=8)),
                                           Replica("b", layout_boxes(PARAMS, [2], divisible_by=8))], _hosts(3))
    half = {0: src[0]}
    with pytest.raises(ValueError, match="no source rank holds"):
        plan_weight_transfer(PARAMS, half, [Replica("g", layout_boxes(PARAMS, [2], divisible_by=8))], _hosts(3))
    for msg in ("tensor-parallel size 4", "needs 2 ranks"):
        assert "\n" not in msg


def test_auto_sends_directly_unless_a_chain_unloads_the_busiest_nic():
    """``auto`` (the default): one replica per host, the model's halves on two source hosts — direct sends load
    no NIC side more than a chain would, so no forwarding hop; two replicas on one host — the chain enters that
    host once and fans out inside it, half the bytes on its NIC."""
    src = layout_boxes(PARAMS, [0, 1], pp=2, divisible_by=8)
    hosts = {0: 0, 1: 1, 2: 2, 3: 3, 4: 2}
    def reps(*ranks):
        return [Replica(n, layout_boxes(PARAMS, [r], divisible_by=8)) for n, r in zip("ab", ranks)]

    apart, together = reps(2, 3), reps(2, 4)
    assert plan_weight_transfer(PARAMS, src, apart, hosts, bucket_mb=0.002).strategy == "sendrecv"
    plan = plan_weight_transfer(PARAMS, src, together, hosts, bucket_mb=0.002)
    assert plan.strategy == "broadcast"
    direct = plan_weight_transfer(PARAMS, src, together, hosts, bucket_mb=0.002, strategy="sendrecv")
    into = lambda p: p.network.host_bytes(p)[2][1]  # noqa: E731
    assert 2 * into(plan) == into(direct)
