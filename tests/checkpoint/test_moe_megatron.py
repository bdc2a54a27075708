"""Megatron-LM ``torch_dist`` mixture-of-experts checkpoints in and out, against Megatron-Core itself
(tests/checkpoint/megatron_moe_oracle.py: a Mixtral-like and a Qwen3-MoE-like model, query/key layernorm and
softmax before the top-k, built, run and saved by Megatron-Core on one CPU process; issue #52).

* ``import-megatron`` prints flags that parse into the architecture of the saved arguments (``--num-experts``,
  ``--moe-ffn-hidden-size``, ``--moe-router-pre-softmax``, ``--qk-layernorm``, ...); the imported checkpoint
  (``--load OUT --finetune``) gives Megatron-Core's logits (fp32, tolerance from the arithmetic:
  tests/tolerances.py; the router weights are scaled up so that no token sits near a top-k tie) and ``--load``
  of the Megatron-LM directory itself the same logits bit for bit;
* ``export-megatron`` of the imported checkpoint, loaded by Megatron-Core's ``dist_checkpointing.load`` into a
  freshly seeded model, gives back every weight (routers and ``[layers, experts, ...]`` expert tensors included)
  and Megatron-Core's logits bit for bit;
* dense and MoE layers mixed (``--moe-layer-freq [0,1,1,1]``), which Megatron-Core keys layer by layer
  (``decoder.layers.N.…``, no layer axis), go in and out the same way;
* what is not read or written yet is one line: shared experts, per-rank ``torch`` files of an MoE model.
"""
from __future__ import annotations

import io
import shlex
from contextlib import redirect_stdout

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.checkpoint import CheckpointError
from megareshard.checkpoint.megatron import args_from_model_config, model_config_from_args
from megareshard.checkpoint.megatron_io import MegatronCheckpoint
from megareshard.parallel import ParallelContext
from megareshard.training import Trainer
from tests.tolerances import forward_tolerance, gpt_forward_reductions

from . import megatron_moe_oracle as oracle
from ._helpers import load_tool
from .test_megatron_interop import _require_megatron_core

base = oracle.base


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    _require_megatron_core()
    work = tmp_path_factory.mktemp("megatron_moe")
    return work, oracle.run_oracle(str(work))


def _argv(load: str, flags: list[str]) -> list[str]:
    return ["--mock-data", "--seq-length", str(base.SEQ), "--load", load, "--device", "cpu", "--micro-batch-size", "1",
            "--global-batch-size", "2", *flags]


def _reductions() -> int:
    """The sums a logit depends on (tests/tolerances.py): the Llama's shape, each token's MLP the k experts'."""
    L = base.ARCHS["llama"]
    return gpt_forward_reductions(L["num_layers"], L["hidden_size"], oracle.FE * oracle.K, L["num_attention_heads"],
                                  L["hidden_size"] // L["num_attention_heads"], base.SEQ)


def _logits(argv: list[str]) -> torch.Tensor:
    trainer = Trainer(parse_args(argv, world_size=1), ParallelContext.single_process(), torch.device("cpu"),
                      out=io.StringIO())
    with torch.no_grad():
        return trainer.model.eval()(base.tokens())[..., :base.VOCAB]


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(oracle.ARCHS))
def test_import_megatron_moe_gives_megatron_cores_logits(megatron, arch, tmp_path):
    work, res = megatron
    src, out = str(work / arch), str(tmp_path / "ours")
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert load_tool().main(["import-megatron", src, out]) == 0
    flags = shlex.split(buf.getvalue().split("--finetune ", 1)[1])
    cfg = parse_args(_argv(out, flags + ["--finetune"]), world_size=1)
    stored = MegatronCheckpoint(src)
    expected, _ = model_config_from_args(stored.args)
    apart = oracle.ARCHS[arch]["freq"] != 1         # Megatron-Core keyed the layers apart: no layer axis
    assert any(k.startswith("decoder.layers.0.") for k in stored.shapes) == apart
    assert any(k.startswith("decoder.layers.0.mlp.linear_fc2") for k in stored.shapes) == apart   # a dense layer
    assert cfg.model.__dict__ == {**expected.__dict__, "seq_length": base.SEQ}     # the printed flags say it all
    assert cfg.model.num_experts == oracle.E and cfg.model.qk_layernorm == oracle.ARCHS[arch]["qk_layernorm"]
    assert cfg.model.moe_router_pre_softmax == oracle.ARCHS[arch]["pre_softmax"]
    ref = res["logits"][arch]
    got = _logits(_argv(out, flags + ["--finetune"]))
    reductions = _reductions()
    err = (got - ref).abs().max().item()
    assert err <= forward_tolerance(reductions, ref.abs().max().item()), f"{arch}: logits differ by {err:.3g}"
    assert torch.equal(got, _logits(_argv(src, flags)))      # --load of the Megatron-LM directory: the same weights


def test_export_megatron_moe_loads_in_megatron_core_bit_for_bit(megatron):
    _, res = megatron
    for arch in oracle.ARCHS:
        check = res["export"][arch]
        assert check["same_weights"] and all(check["same_weights"].values()), (arch, check["same_weights"])
        assert any("experts" in n for n in check["same_weights"]) and any("router" in n for n in check["same_weights"])
        assert torch.equal(check["logits"], res["logits"][arch]), arch


ARGS = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "vocab_size": 100,
        "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "num_experts": 4}


@pytest.mark.parametrize("extra, match", [
    ({"moe_shared_expert_intermediate_size": 32}, r"MoE shared experts \(--moe-shared-expert-intermediate-size\)"),
    ({"moe_router_topk_scaling_factor": 2.5}, r"a scaled top-k"),
    ({"moe_router_num_groups": 2}, r"group-limited routing"),
], ids=["shared-experts", "topk-scaling", "group-limited"])
def test_megatron_moe_arguments_not_built_are_one_line(extra, match):
    with pytest.raises(CheckpointError, match=match) as e:
        model_config_from_args({**ARGS, **extra})
    assert "\n" not in str(e.value)


def test_export_megatron_refuses_shared_experts_in_one_line():
    cfg = parse_args("--mock-data --vocab-size 10 --num-layers 2 --hidden-size 16 --ffn-hidden-size 32 "
                     "--num-attention-heads 2 --num-experts 4 --moe-shared-expert-intermediate-size 8".split(),
                     world_size=1).model
    with pytest.raises(CheckpointError, match=r"^MoE shared experts are not written to Megatron-LM checkpoints yet$"):
        args_from_model_config(cfg, 1)


def _ep2_tp2_logits(rank: int, world: int, runs: dict) -> dict:
    from megareshard.tensor_parallel import all_gather_dim
    from megareshard.training import build_context

    out = {}
    for arch, argv in runs.items():
        cfg = parse_args(argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--expert-model-parallel-size", "2"], world_size=world)
        ctx, _ = build_context(cfg, world)
        assert (ctx.tp_size, ctx.ep_size, ctx.dp_size) == (2, 2, 2)
        trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
        with torch.no_grad():
            out[arch] = all_gather_dim(trainer.model.eval()(base.tokens()), ctx, -1)[..., :base.VOCAB]
        trainer.close()
        ctx.destroy()
    return out


@pytest.mark.slow
def test_megatron_moe_directories_load_at_ep2_tp2(megatron):
    """``--load`` of the Megatron-LM directories straight into ep 2 · tp 2 (sequence parallelism; 4 gloo ranks,
    each reading the boxes of its experts): Megatron-Core's logits within the forward's rounding."""
    from megareshard.models import hf as hf_map
    from tests.harness import run_ranks

    work, res = megatron
    runs = {}
    for arch in oracle.ARCHS:
        cfg, _ = model_config_from_args(MegatronCheckpoint(str(work / arch)).args)
        runs[arch] = _argv(str(work / arch), hf_map.megatron_flags(cfg))
    reductions = _reductions()
    for got in run_ranks(_ep2_tp2_logits, 4, runs, timeout=300):
        for arch, logits in got.items():
            ref = res["logits"][arch]
            err = (logits - ref).abs().max().item()
            assert err <= forward_tolerance(reductions, ref.abs().max().item()), f"{arch}: differ by {err:.3g}"
