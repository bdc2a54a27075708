"""The model seam on one process: the registry, a spec's stage modules and forward step, its edges.

The multi-rank equivalence tests (tests/pipeline, test_training_equivalence, test_utransformer_pipeline)
run the same specs through the pipeline runtime; here each piece is checked on its own.
"""
from __future__ import annotations

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args, parse_model_args
from megareshard.parallel import ParallelContext, Topology
from megareshard.model_spec import ModelSpec, get_model_spec, model_spec_names, register_model_spec

_GPT = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "4", "--hidden-dropout", "0",
        "--attention-dropout", "0"]
_U = ["--mock-data", "--vocab-size", "64", "--u-levels", "3", "--u-widths", "16,24,32", "--num-attention-heads", "2",
      "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--hidden-dropout", "0",
      "--attention-dropout", "0"]


def test_registry_finds_the_built_in_models_and_names_them_when_asked_for_another():
    gpt, u = get_model_spec("gpt"), get_model_spec("utransformer")
    assert isinstance(gpt, ModelSpec) and (gpt.name, u.name) == ("gpt", "utransformer")
    assert get_model_spec("gpt") is gpt  # one registered instance
    assert {"gpt", "utransformer"} <= set(model_spec_names())
    with pytest.raises(ConfigError, match="unknown model 'bert'; registered: gpt, utransformer"):
        get_model_spec("bert")
    with pytest.raises(ValueError, match="model .gpt. is registered already .* registers another under the same name"):
        register_model_spec(type(gpt)())
    with pytest.raises(TypeError):
        register_model_spec(object())  # type: ignore[arg-type]


def _tokens(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_length + 1), generator=g)}


def test_gpt_forward_step_is_the_mean_token_loss_over_the_microbatches():
    cfg = parse_args(_GPT, world_size=1)
    spec, ctx = get_model_spec("gpt"), ParallelContext.single_process()
    model = spec.build_model(cfg, ctx, None, num_stages=1, seed=7, device=torch.device("cpu"))
    batch = _tokens(cfg)
    loss = spec.forward_step(model, batch, torch.device("cpu"), num_microbatches=3)
    t = batch["tokens"]
    per_token = model(t[:, :-1], labels=t[:, 1:])
    assert loss.shape == () and torch.equal(loss, per_token.float().mean() / 3)  # the same ops in the same order


def test_gpt_stage_modules_chained_by_their_forward_steps_give_the_whole_models_loss():
    cfg = parse_args(_GPT + ["--pipeline-model-parallel-size", "2", "--num-layers-per-stage", "1,3"], world_size=2)
    spec, ctx, cpu = get_model_spec("gpt"), ParallelContext.single_process(), torch.device("cpu")
    layouts = spec.stage_layouts(cfg, Topology(2, tp=1, pp=2))
    assert [lay.layer_range for lay in layouts] == [(0, 1), (1, 4)]
    whole = spec.build_model(cfg, ctx, None, num_stages=1, seed=7, device=cpu)
    stages = [spec.build_model(cfg, ctx, lay, num_stages=2, seed=7, device=cpu) for lay in layouts]
    assert (stages[0].pre_process, stages[0].post_process, stages[1].pre_process, stages[1].post_process) == (
        True, False, False, True)
    batch = _tokens(cfg)
    out = spec.forward_step(stages[0], batch, cpu, num_microbatches=2, first=True, last=False)
    assert set(out) == {""} and out[""].shape == (8, 2, 32)  # the chain edge's [s, b, h]
    loss = spec.forward_step(stages[1], batch, cpu, num_microbatches=2, received=out, first=False, last=True)
    ref = spec.forward_step(whole, batch, cpu, num_microbatches=2)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)  # same model; the split may fuse differently


def test_each_spec_declares_every_edge_of_its_graph():
    cfg = parse_args(_GPT + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
                     world_size=8)
    gpt = get_model_spec("gpt")
    layouts = gpt.stage_layouts(cfg, Topology(8, tp=2, pp=2))
    (decl,) = gpt.edge_tensors(cfg, layouts, batch=4, dtype=torch.bfloat16)
    assert (str(decl.edge), decl.shape, decl.dtype, str(decl.src_spec)) == ("0->1", (8, 4, 32), torch.bfloat16,
                                                                          "R,S0,R")
    assert decl.src_mesh == layouts[0].mesh and decl.dst_mesh == layouts[1].mesh

    cfg, u = parse_model_args("utransformer", _U + ["--pipeline-model-parallel-size", "3",
                                                   "--num-layers-per-stage", "1,2,2"], world_size=3)
    layouts = u.stage_layouts(cfg, Topology(3, tp=1, pp=3))
    decls = {str(d.edge): d.shape for d in u.edge_tensors(cfg, layouts, batch=2, dtype=torch.float32)}
    # blocks enc0 | enc1 enc2 | dec1 dec0: both skips cross to stage 2, each at its level's [s_k, b, w_k];
    # the chain edges carry the level at each cut (level 0 after enc0, level 2 after enc2)
    assert decls == {"0->1": (16, 2, 16), "0->2:skip0": (16, 2, 16), "1->2": (4, 2, 32), "1->2:skip1": (8, 2, 24)}
