"""Hugging Face interop against ``transformers`` itself: Llama (LlamaForCausalLM) and GPT-2 (GPT2LMHeadModel).

A tiny random model made with ``save_pretrained`` (safetensors) is imported with
``tools/checkpoint_util.py import-hf``; the flags it prints parse into the same architecture;
the trainer loads the checkpoint (``--load --finetune``, vocabulary padded to 128) and the
model's logits equal Hugging Face's within fp32 tolerance (1e-5 of the largest logit: the two
sum in different orders over at most a few hundred terms). ``export-hf`` writes it back;
``from_pretrained`` loads it and gives Hugging Face's logits again, bit for bit (same weights,
same code). The imported Llama also loads into tp 2 with sequence parallelism (2 ranks: the key/value
groups split over tp) with the same logits. Refusals name the reason.
"""
from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch
import transformers

from megareshard.arguments import parse_args
from megareshard.checkpoint import CheckpointError
from megareshard.models import hf as hf_map
from megareshard.parallel import ParallelContext
from megareshard.tensor_parallel import all_gather_dim
from megareshard.training import Trainer, build_context
from tests.harness import run_ranks

from ._helpers import load_tool

VOCAB, SEQ = 100, 16


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights start at one (and biases at zero): give them values so their mapping is exercised."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "weight" in name else 0.0))


def _llama(tmp):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _randomize_norms(model)
    model.save_pretrained(tmp)
    return model


def _gpt2(tmp):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    _randomize_norms(model)
    model.save_pretrained(tmp)
    return model


def _tp2_logits(rank: int, world: int, argv: list[str], tokens: torch.Tensor) -> torch.Tensor:
    cfg = parse_args(argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], world_size=world)
    ctx, _ = build_context(cfg, world)
    model = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO()).model.eval()
    with torch.no_grad():
        return all_gather_dim(model(tokens), ctx, -1)[..., :VOCAB]    # vocabulary shards -> full logits


@pytest.mark.parametrize("make, expect, tp2", [(_llama, "LlamaForCausalLM", True), (_gpt2, "GPT2LMHeadModel", False)],
                         ids=["llama", "gpt2"])
def test_import_run_export_roundtrip_against_transformers(tmp_path, make, expect, tp2, capsys):
    hf_dir, ck, back = tmp_path / "hf", tmp_path / "ck", tmp_path / "back"
    hf_model = make(hf_dir)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf_model(tokens).logits

    tool = load_tool()
    assert tool.main(["import-hf", str(hf_dir), str(ck)]) == 0
    printed = capsys.readouterr().out
    flags = printed.split("--finetune ", 1)[1].split()
    argv = ["--mock-data", "--seq-length", str(SEQ), "--load", str(ck), "--finetune", "--device", "cpu", *flags]
    cfg = parse_args(argv, world_size=1)
    saved = json.loads((hf_dir / "config.json").read_text())
    assert cfg.model == dataclasses.replace(hf_map.model_config_from_hf(saved), seq_length=SEQ)   # flags say it all
    trainer = Trainer(cfg, ParallelContext.single_process(), torch.device("cpu"), out=io.StringIO())
    model = trainer.model.eval()
    assert model.padded_vocab_size == 128                                  # padded on load, unpadded in files
    with torch.no_grad():
        logits = model(tokens)[..., :VOCAB]
    err = (logits - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"logits differ from transformers' by {err:.3g}"
    if tp2:
        for got in run_ranks(_tp2_logits, 2, argv, tokens, timeout=120):
            err = (got - ref).abs().max().item()
            assert err <= 1e-5 * ref.abs().max().item(), f"tp 2 logits differ from transformers' by {err:.3g}"

    assert tool.main(["export-hf", str(ck), str(back)]) == 0
    reloaded = getattr(transformers, expect).from_pretrained(back).eval()
    with torch.no_grad():
        again = reloaded(tokens).logits
    assert torch.equal(again, ref)


def test_refusals_name_the_reason(tmp_path):
    with pytest.raises(hf_map.HFInteropError, match="model_type 'mistral' is not supported"):
        hf_map.model_config_from_hf({"model_type": "mistral"})
    with pytest.raises(hf_map.HFInteropError, match="rope scaling .* is not supported"):
        hf_map.model_config_from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
                                     "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                                     "intermediate_size": 64, "vocab_size": 10})
    cfg = parse_args(["--mock-data", "--vocab-size", "10", "--normalization", "RMSNorm"], world_size=1).model
    with pytest.raises(hf_map.HFInteropError, match="is neither Llama .* nor GPT-2"):
        hf_map.hf_model_type(cfg)
    with pytest.raises(CheckpointError, match="cannot read .*config.json"):
        load_tool().import_hf(str(tmp_path / "nowhere"), str(tmp_path / "ck"))


def test_export_hf_adds_the_one_to_zero_centred_norm_weights():
    """--apply-layernorm-1p stores gamma − 1; Hugging Face's Llama stores gamma: the export adds the one."""
    from megareshard.checkpoint.megatron import our_shape, sources

    cfg = parse_args(["--mock-data", "--vocab-size", "10", "--num-layers", "1", "--hidden-size", "8",
                      "--num-attention-heads", "2", "--ffn-hidden-size", "16", "--normalization", "RMSNorm",
                      "--position-embedding-type", "rope",
                      "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                      "--apply-layernorm-1p"], world_size=1).model
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(our_shape(n, cfg), generator=g) for n in sources(cfg)}
    out = hf_map.state_dict_to_hf(sd, cfg)
    assert torch.equal(out["model.norm.weight"], sd["final_layernorm.weight"] + 1)
    assert torch.equal(out["model.layers.0.input_layernorm.weight"], sd["layers.0.input_layernorm.weight"] + 1)
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], sd["layers.0.mlp.fc1_up.weight"])
