"""The U-Transformer model on one process: causality across the shortening boundaries, global names
and layout-independent initialisation, the stage graph's skip edges, and its argument checks."""
from __future__ import annotations

import pytest
import torch

from megareshard.arguments import ConfigError, ModelConfig, parse_model_args
from megareshard.models.utransformer import (UPlan, UTransformerConfig, UTransformerModel,
                                             shorten, upsample)
from megareshard.parallel import ParallelContext

SEQ = 16


def _model(levels=3, widths=(16, 24, 32), blocks=(1, 2, 1), f=2, merge="add", **kw):
    m = ModelConfig(num_layers=1, hidden_size=widths[0], num_attention_heads=2, seq_length=SEQ, vocab_size=50,
                    hidden_dropout=0.0, attention_dropout=0.0)
    u = UTransformerConfig(levels=levels, widths=widths, blocks_per_level=blocks, shorten_factor=f, skip_merge=merge)
    return UTransformerModel(m, u, ParallelContext.single_process(), seed=5, **kw), m, u


@pytest.mark.parametrize("levels, widths, blocks, f, merge", [
    (3, (16, 24, 32), (1, 2, 1), 2, "add"),
    (3, (16, 24, 32), (1, 1, 1), 2, "concat"),
    (2, (16, 32), (2, 1), 4, "concat"),
])
def test_changing_token_t_never_changes_anything_before_t(levels, widths, blocks, f, merge):
    torch.manual_seed(0)
    model, _, _ = _model(levels, widths, blocks, f, merge)
    model.eval()
    tokens = torch.randint(0, 50, (2, SEQ + 1))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        losses = model(tokens[:, :-1], labels=tokens[:, 1:])
        # every position, so every pooling boundary (multiples of f and f², and just after them)
        for t in range(SEQ):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 7) % 50
            out = model(changed[:, :-1])
            diff = (out - logits).abs().amax(dim=(0, 2))
            assert diff[:t].max().item() <= 1e-6 if t else True, f"token {t} changed logits before it: {diff[:t]}"
            assert diff[t].item() > 0, f"token {t} does not even reach its own logits"
            # per-token losses before t (labels of positions < t are tokens <= t: use labels up to t-1)
            lab = tokens[:, 1:].clone()
            out_l = model(changed[:, :-1], labels=lab)
            assert (out_l - losses)[:, :t].abs().max().item() <= 1e-6 if t else True


def test_shorten_and_upsample_are_causally_aligned():
    x = torch.arange(8.0).view(8, 1, 1)
    y = shorten(x, 2)  # position j averages original positions 2j-1, 2j (zero before the start)
    assert y.flatten().tolist() == [0.0, 1.5, 3.5, 5.5]
    assert upsample(y, 2).flatten().tolist() == [0.0, 0.0, 1.5, 1.5, 3.5, 3.5, 5.5, 5.5]
    # upsampled position i saw original positions <= i only: i=2 gets 1.5 = mean(x1, x2)


def test_stage_parts_hold_the_full_models_weights_under_global_names():
    full, m, u = _model(merge="concat")
    ref = dict(full.named_parameters())
    plan = UPlan.build(u, SEQ)
    assert plan.num_blocks == 7  # enc 1+2+1, dec 2+1
    seen = {}
    ranges = [(0, 2), (2, 5), (5, 7)]
    for i, (a, b) in enumerate(ranges):
        part, _, _ = _model(merge="concat", pre_process=i == 0, post_process=i == 2, layer_range=(a, b))
        for name, p in part.named_parameters():
            assert name not in seen, name
            seen[name] = p
            torch.testing.assert_close(p, ref[name], rtol=0, atol=0, msg=name)
    assert seen.keys() == ref.keys()
    assert "layers.6.mlp.fc2.weight" in ref and "merge.0.weight" in ref and "down.2.weight" in ref
    # blocks 0,1 | 2,3,4 | 5,6 : skip0 from block 0 (stage 0) to block 6 (stage 2); skip1 from block 2
    # (stage 1) to block 4 (stage 1): local
    assert plan.skip_edges(ranges) == [(0, 2, "skip0")]
    assert plan.skip_edges([(0, 1), (1, 2), (2, 3), (3, 7)]) == [(0, 3, "skip0"), (2, 3, "skip1")]


def test_untied_head_and_shapes():
    model, _, _ = _model()
    assert model.tied_embedding is False
    assert not torch.equal(model.output_layer.weight[:50], model.embedding.word_embeddings.weight[:50])
    part, _, _ = _model(pre_process=True, post_process=False, layer_range=(0, 3))
    out = part(torch.randint(0, 50, (3, SEQ)))
    # blocks 0 (enc0), 1, 2 (enc1): chain output at level 1, which is also skip1; skip0 (level 0)
    assert set(out) == {"", "skip0", "skip1"} and out["skip1"] is out[""]
    assert out[""].shape == (SEQ // 2, 3, 24) and out["skip0"].shape == (SEQ, 3, 16)


_BASE = ["--mock-data", "--vocab-size", "64", "--u-levels", "3", "--u-widths", "16,24,32", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr-warmup-iters", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_cli_derives_layers_and_hidden_size():
    cfg, spec = parse_model_args("utransformer", _BASE + ["--u-blocks-per-level", "2,1,3"], world_size=1)
    assert cfg.model.num_layers == 2 + 1 + 3 + 1 + 2 and cfg.model.hidden_size == 16
    assert spec.u.blocks_per_level == (2, 1, 3)


@pytest.mark.parametrize("extra, world, match", [
    (["--u-widths", "16,24"], 1, r"gives 2 widths for --u-levels 3"),
    (["--seq-length", "18"], 1, r"--seq-length 18 is not divisible by --u-shorten-factor 2\^2 = 4"),
    (["--u-widths", "16,25,32"], 1, r"level 1's width 25 is not divisible by --num-attention-heads 2"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, r"--sequence-parallel is not supported"),
    (["--u-widths", "16,24,36", "--num-attention-heads", "4", "--stage-layouts", "tp1dp2,tp8dp1"], 10,
     r"level 0's width 16 is not divisible by stage 1's tp 8|not divisible by stage 1's tp 8"),
    (["--stage-layouts", "tp1dp2,tp2dp1", "--num-layers-per-stage", "2,2"], 4,
     r"--num-layers-per-stage 2,2 must give 2 positive numbers .* adding up to --num-layers 5"),
])
def test_bad_shapes_are_refused_with_the_numbers(extra, world, match):
    with pytest.raises(ConfigError, match=match):
        parse_model_args("utransformer", _BASE + extra, world_size=world)


def test_pretrain_utransformer_runs_on_one_process(tmp_path):
    import json

    import pretrain_utransformer

    metrics = tmp_path / "metrics.jsonl"
    assert pretrain_utransformer.main(_BASE + ["--device", "cpu", "--metrics-file", str(metrics)]) == 0
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2] and all(r["loss"] > 0 for r in recs)
    assert pretrain_utransformer.main(_BASE + ["--u-widths", "16,24"]) == 2  # a ConfigError is exit status 2
