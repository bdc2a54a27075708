"""Megatron-LM checkpoints that cannot or must not load, refused in one line; the mapping both ways.

The checkpoints here are written by megareshard's own ``torch_dist`` writer (``export-megatron``'s) from a
random model (the Megatron-Core oracle, tests/checkpoint/test_megatron_interop.py, shows that writer's output
is what Megatron-Core reads) and then altered: features megareshard does not build (experts, multi-latent
attention, Transformer Engine fp8 scaling state), truncated and mismatched files, an existing output. Per-rank
``torch`` files with virtual pipeline stages and tp 2 (which the oracle does not write) are laid out by hand as
Megatron-LM lays them out, and read back exactly. None of this needs Megatron-Core.
"""
from __future__ import annotations

import argparse
import io
import os
import pickle

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.checkpoint import CheckpointError
from megareshard.checkpoint.megatron import LAYERS, args_from_model_config, our_shape, sources, to_megatron
from megareshard.checkpoint.megatron_io import write_torch_dist
from megareshard.models import hf as hf_map
from megareshard.models.config import ModelConfig
from megareshard.parallel import ParallelContext
from megareshard.training import Trainer

from ._helpers import load_tool

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  max_position_embeddings=16, vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0,
                  normalization="RMSNorm", position_embedding_type="rope", swiglu=True, group_query_attention=True,
                  num_query_groups=2, untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                  apply_layernorm_1p=True)


def _weights(cfg: ModelConfig = CFG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(our_shape(name, cfg), generator=g) for name in sources(cfg)}


def _write(root, *, args: dict | None = None, objects: dict | None = None, tensors: dict | None = None,
           cfg: ModelConfig = CFG) -> str:
    t, o = to_megatron(_weights(cfg), cfg, tp=1)
    t.update(tensors or {})
    o.update(objects or {})
    a = argparse.Namespace(**args_from_model_config(cfg, 1, args))
    write_torch_dist(str(root), 10, t, o, {"args": a, "checkpoint_version": 3.0, "iteration": 10})
    return str(root)


def _refused(tool, argv, capsys) -> str:
    assert tool.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("checkpoint_util.py: error: "), err   # one line, no traceback
    return err


def test_round_trip_of_the_mapping(tmp_path, capsys):
    """export-megatron's files read back by import-megatron: every tensor bit for bit, flags that parse into the
    same architecture (1p included), and a second export equal to the first."""
    src = _write(tmp_path / "meg")
    tool = load_tool()
    assert tool.main(["import-megatron", src, str(tmp_path / "ours")]) == 0
    flags = capsys.readouterr().out.split("--finetune ", 1)[1].split()
    assert "--apply-layernorm-1p" in flags
    cfg = parse_args(["--mock-data", "--seq-length", "16", *flags], world_size=1).model
    assert cfg == CFG
    _, _, _, back = tool._model_tensors(str(tmp_path / "ours"))
    want = _weights()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
    again = tool.export_megatron(str(tmp_path / "ours"), str(tmp_path / "meg2"), tp=2)
    assert os.path.basename(again) == "iter_0000000"


@pytest.mark.parametrize("change, tensors, words", [
    ({"num_experts": 8, "moe_shared_expert_intermediate_size": 16}, None,
     "MoE shared experts (--moe-shared-expert-intermediate-size) = 16"),
    ({"multi_latent_attention": True}, None, "multi-latent attention"),
    ({}, {f"{LAYERS}mlp.shared_experts.linear_fc1.weight": torch.zeros(2, 8, 32)},
     "decoder.layers.mlp.shared_experts.linear_fc1.weight (MoE shared experts)"),
    ({"num_experts": 8}, None, "has no tensor decoder.layers.mlp.router.weight"),
    ({"position_embedding_type": "yarn"}, None, "--position-embedding-type yarn"),
], ids=["shared-experts", "mla", "shared-expert-tensors", "experts-without-tensors", "yarn"])
def test_features_not_built_are_named(tmp_path, capsys, change, tensors, words):
    src = _write(tmp_path / "meg", args=change, tensors=tensors)
    err = _refused(load_tool(), ["import-megatron", src, str(tmp_path / "ours")], capsys)
    assert words in err
    assert not (tmp_path / "ours").exists()


def _te_extra_state(payload: dict) -> list:
    """Transformer Engine's extra state as Megatron-Core stores it: the pickled dict in a uint8 tensor, in a list."""
    return [torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)]


def test_fp8_scaling_state_is_refused_but_recipe_only_state_loads(tmp_path, capsys):
    key = f"{LAYERS}self_attention.linear_qkv._extra_state/shard_0_2"
    delayed = _te_extra_state({"recipe": "DelayedScaling", "scale_fwd": torch.ones(3),
                               "amax_history_fwd": torch.zeros(4, 3)})
    src = _write(tmp_path / "fp8", objects={key: delayed})
    err = _refused(load_tool(), ["import-megatron", src, str(tmp_path / "ours")], capsys)
    assert "fp8 scaling state" in err and key in err
    recipe_only = _write(tmp_path / "mx", objects={key: _te_extra_state({"recipe": "MXFP8BlockScaling"})})
    assert load_tool().main(["import-megatron", recipe_only, str(tmp_path / "ours2")]) == 0


def test_truncated_and_mismatched_files_name_the_file_and_the_tensor(tmp_path, capsys):
    tool = load_tool()
    src = _write(tmp_path / "cut")
    data = os.path.join(src, "iter_0000010", "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    err = _refused(tool, ["import-megatron", src, str(tmp_path / "o1")], capsys)
    assert "__0_0.distcp is truncated" in err and "is stored up to byte" in err, err
    wide = _write(tmp_path / "wide", args={"hidden_size": 48})
    err = _refused(tool, ["import-megatron", wide, str(tmp_path / "o2")], capsys)
    assert ".metadata: embedding.word_embeddings.weight has shape (128, 32)" in err and "(128, 48)" in err, err
    # the per-rank torch format: a truncated model_optim_rng.pt is named
    legacy = tmp_path / "legacy" / "iter_0000010" / "mp_rank_00"
    legacy.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(**args_from_model_config(CFG, 1)), "checkpoint_version": 3.0,
                "iteration": 10, "model": {"embedding.word_embeddings.weight": torch.zeros(128, 32)}},
               legacy / "model_optim_rng.pt")
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("10")
    with open(legacy / "model_optim_rng.pt", "r+b") as f:
        f.truncate(100)
    err = _refused(tool, ["import-megatron", str(tmp_path / "legacy"), str(tmp_path / "o3")], capsys)
    assert "mp_rank_00/model_optim_rng.pt is truncated or corrupt" in err, err


def test_nothing_is_written_over_an_existing_output(tmp_path, capsys):
    tool = load_tool()
    src = _write(tmp_path / "meg")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = _refused(tool, ["import-megatron", src, str(out)], capsys)
    assert "refusing to overwrite it" in err and os.listdir(out) == ["keep.txt"]
    assert tool.main(["import-megatron", src, str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    err = _refused(tool, ["export-megatron", str(tmp_path / "ours"), str(out)], capsys)
    assert "refusing to overwrite it" in err and os.listdir(out) == ["keep.txt"]


def test_load_names_the_differing_flags_and_save_may_not_share_the_directory(tmp_path):
    src = _write(tmp_path / "meg")
    flags = hf_map.megatron_flags(CFG)
    base = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--device",
            "cpu", "--load", src]
    wrong = [f for f in flags if f != "--apply-layernorm-1p"]
    with pytest.raises(CheckpointError) as e:
        Trainer(parse_args(base + wrong, world_size=1), ParallelContext.single_process(), torch.device("cpu"),
                out=io.StringIO())
    assert "--apply-layernorm-1p: checkpoint True, this run False" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="holds a Megatron-LM checkpoint"):
        Trainer(parse_args(base + flags + ["--save", src], world_size=1), ParallelContext.single_process(),
                torch.device("cpu"), out=io.StringIO())
    log = io.StringIO()
    at_iteration = [a if a != src else os.path.join(src, "iter_0000010") for a in base]   # the directory itself
    trainer = Trainer(parse_args(at_iteration + flags, world_size=1), ParallelContext.single_process(),
                      torch.device("cpu"), out=log)
    assert trainer.iteration == 0 and "weights only, as --finetune" in log.getvalue()
    emb = trainer.model.embedding.word_embeddings.weight
    assert torch.equal(emb[:100], _weights()["embedding.word_embeddings.weight"]) and not emb[100:].any()


def _write_legacy(root, weights: dict, cfg: ModelConfig, tp: int, pp: int, vp: int) -> None:
    """Per-rank ``torch`` files as Megatron-LM lays them out: model chunk v of pipeline rank p (``model<v>`` with
    virtual stages) holds global layers of model stage v·pp + p, numbered from 0; tp slices along each tensor's
    split dim; SwiGLU's fc1 slice is [gate slice; up slice]; the vocabulary padded to 128 × tp."""
    padded = -(-cfg.vocab_size // (128 * tp)) * 128 * tp
    per = cfg.num_layers // (pp * vp)
    table = sources(cfg)
    for p in range(pp):
        for t in range(tp):
            chunks = {}
            for v in range(vp):
                stage = v * pp + p
                sd = {}
                for name, src in table.items():
                    if src.layer is not None and not stage * per <= src.layer < (stage + 1) * per:
                        continue
                    if src.layer is None and (stage != 0 if src.key.startswith("embedding") else stage != pp * vp - 1):
                        continue
                    key = src.key if src.layer is None else f"{LAYERS}{src.layer - stage * per}.{src.key[len(LAYERS):]}"
                    full = weights[name]
                    if src.vocab:
                        full = torch.cat([full, torch.zeros(padded - full.shape[0], *full.shape[1:])])
                    piece = full.chunk(tp, dim=src.tp_dim)[t] if src.tp_dim is not None else full
                    sd[key] = torch.cat([sd[key], piece]) if src.part == 1 else piece   # gate slice, then up
                    if src.layer is not None and key.endswith("weight") and "norm" not in key:
                        sd[key.rsplit(".", 1)[0] + "._extra_state"] = None
                chunks[f"model{v}" if vp > 1 else "model"] = sd
            d = root / "iter_0000007" / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            d.mkdir(parents=True)
            args = argparse.Namespace(**args_from_model_config(cfg, tp, {"pipeline_model_parallel_size": pp}))
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7, **chunks}, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("7")


def test_per_rank_files_with_virtual_stages_and_tp_read_back_exactly(tmp_path, capsys):
    cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 8})
    weights = _weights(cfg)
    _write_legacy(tmp_path / "meg", weights, cfg, tp=2, pp=2, vp=2)
    tool = load_tool()
    assert tool.main(["import-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    _, _, back_cfg, back = tool._model_tensors(str(tmp_path / "ours"))
    assert back_cfg == cfg and back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)
