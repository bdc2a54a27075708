"""A checkpoint's model is compared with this run's field by field before anything loads, the mixture-of-experts
shape included (issue #52's leftover): the expert count, which layers are MoE, each expert's width and the shared
experts' width, each compared as the model builds it (``--moe-layer-freq 2`` is ``[1,0,1,0]``, an unset
``--moe-ffn-hidden-size`` is ``--ffn-hidden-size``)."""
from __future__ import annotations

import dataclasses

from megareshard.checkpoint.loading import architecture_differences
from megareshard.models.config import ModelConfig


def _cfg(**kw) -> dict:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    return dataclasses.asdict(ModelConfig(**{**base, **kw}))


def test_equal_moe_shapes_written_differently_are_equal():
    a = _cfg(num_experts=4, moe_layer_freq=2)
    b = _cfg(num_experts=4, moe_layer_freq="[1,0,1,0]", moe_ffn_hidden_size=a["ffn_hidden_size"])
    assert architecture_differences(a, b) == []
    dense = _cfg()
    old = {k: v for k, v in dense.items() if not k.startswith(("num_experts", "moe_"))}  # saved before MoE existed
    assert architecture_differences(old, dense) == []


def test_each_moe_shape_difference_is_named():
    moe = _cfg(num_experts=4)
    assert architecture_differences(moe, _cfg()) == [("num_experts", 4, None)]
    assert architecture_differences(moe, _cfg(num_experts=8)) == [("num_experts", 4, 8)]
    assert architecture_differences(moe, _cfg(num_experts=4, moe_layer_freq=2)) == \
        [("moe_layer_freq", [1, 1, 1, 1], [1, 0, 1, 0])]
    assert architecture_differences(moe, _cfg(num_experts=4, moe_ffn_hidden_size=48)) == \
        [("moe_ffn_hidden_size", moe["ffn_hidden_size"], 48)]
    assert architecture_differences(moe, _cfg(num_experts=4, moe_shared_expert_intermediate_size=64)) == \
        [("moe_shared_expert_intermediate_size", None, 64)]
    # with the dense fields, in one list: every difference is in the one-line refusal
    assert architecture_differences(moe, _cfg(num_experts=8, hidden_size=64)) == \
        [("hidden_size", 32, 64), ("ffn_hidden_size", 128, 256), ("num_experts", 4, 8)]
