"""Destination boxes of MoE models (no processes): what `megareshard.transfer.destination_boxes` says a destination
layout holds is exactly what a GPTModel built at that layout holds, read from its parameters as a checkpoint saves
them (`source_boxes`: each expert parameter's ``expert_box``), for tp, pp, ep and etp together, SwiGLU and GELU
experts, expert biases, shared experts and dense layers between MoE layers. The parameters' description
(`ParamInfo`) is the same whatever layout it is read from, so a plan does not depend on the trainer's layout."""
from __future__ import annotations

import dataclasses

import pytest

from megareshard.models import GPTModel
from megareshard.models.config import ModelConfig
from megareshard.parallel import ParallelContext
from megareshard.parallel.expert_topology import EXPERT_FAMILIES, expert_groups
from megareshard.parallel.topology import Topology
from megareshard.resharding.weight_transfer import even_layer_ranges
from megareshard.transfer import Destination, destination_boxes, source_boxes

FAMILIES = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "mp": ("tp", "pp"), "stage": ("tp", "dp")}


def _cfg(kind: str) -> ModelConfig:
    kw = dict(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=50,
              make_vocab_size_divisible_by=8, ffn_hidden_size=32, num_experts=4, moe_router_topk=2,
              moe_ffn_hidden_size=8)
    if kind == "swiglu":   # Mixtral-like, a dense layer every other layer, shared experts
        kw.update(swiglu=True, disable_bias_linear=True, moe_layer_freq=2, moe_shared_expert_intermediate_size=8,
                  normalization="RMSNorm", untie_embeddings_and_output_weights=True)
    return ModelConfig(**kw)


def _fake_ctx(topo: Topology, rank: int, ep: int, etp: int) -> ParallelContext:
    """A context without process groups: only the ranks of each group (what building a model reads)."""
    ranks = {name: next(g for g in topo.groups(axes) if rank in g) for name, axes in FAMILIES.items()}
    fams = expert_groups(topo, ep, etp)
    for name in EXPERT_FAMILIES:
        ranks[name] = next(g for g in fams[name] if rank in g)
    ranks["embedding"] = ()
    return ParallelContext(topology=topo, rank=rank, groups={n: None for n in ranks}, group_ranks=ranks)


def _built(cfg: ModelConfig, tp: int, pp: int, ep: int, etp: int):
    """Per rank of a (tp, pp) layout with (ep, etp) experts: (its parameters' infos, its boxes as a set)."""
    topo = Topology(tp * pp, tp=tp, pp=pp, nproc_per_node=tp * pp, order="tp-dp-pp")
    ranges = even_layer_ranges(cfg.num_layers, pp)
    out = {}
    for r in range(tp * pp):
        ctx = _fake_ctx(topo, r, ep, etp)
        s = ctx.pp_rank()
        model = GPTModel(cfg, ctx, seed=1, sequence_parallel=tp > 1, layer_range=ranges[s], pre_process=s == 0,
                         post_process=s == pp - 1)
        infos, boxes, _ = source_boxes(model, ctx)
        out[r] = (infos, {(b.name, b.region, b.local_name) for b in boxes})
    return out


LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 2), (2, 1, 2, 1), (2, 1, 1, 1), (4, 1, 2, 2), (4, 1, 4, 1), (2, 2, 2, 1),
           (4, 2, 1, 4)]


@pytest.mark.parametrize("kind", ["swiglu", "gelu_bias"])
def test_destination_boxes_are_what_the_model_at_that_layout_holds(kind):
    cfg = _cfg(kind)
    reference = None
    for tp, pp, ep, etp in LAYOUTS:
        if kind == "gelu_bias" and etp > 1:   # expert biases need etp 1 (the model refuses them otherwise)
            continue
        built = _built(cfg, tp, pp, ep, etp)
        params = {p.name: p for infos, _ in built.values() for p in infos}
        if reference is None:
            reference = params
            assert any(p.expert_dim == 2 for p in params.values()) and any(p.expert_dim == 1 for p in params.values())
        assert params == reference, (tp, pp, ep, etp)   # one description whatever the layout
        d = Destination("d", tuple(range(tp * pp)), tp=tp, pp=pp, ep=ep, etp=etp)
        want = destination_boxes(d, sorted(params.values(), key=lambda p: p.name), cfg)
        for r, (_, held) in built.items():
            # (the tied output-layer copy of a last stage is no source box: compared without it)
            got = {(b.name, b.region, b.local_name) for b in want[r] if b.local_name == b.name}
            assert got == held, (kind, tp, pp, ep, etp, r, sorted(got ^ held)[:4])


@pytest.mark.parametrize("kw, says", [
    (dict(tp=2, ep=2), "ep 2 × etp 2 = 4 does not divide its tp 2"),
    (dict(tp=4, ep=4, etp=1), "6 experts of width 8 cannot be split over ep 4 × etp 1"),
])
def test_bad_expert_destination_is_one_line(kw, says):
    cfg = dataclasses.replace(_cfg("swiglu"), num_experts=6)
    built = _built(cfg, 1, 1, 1, 1)
    params = sorted(built[0][0], key=lambda p: p.name)
    n = kw["tp"]
    with pytest.raises(ValueError) as e:
        destination_boxes(Destination("d", tuple(range(n)), **kw), params, cfg)
    assert says in str(e.value) and "\n" not in str(e.value)
