"""Megatron-Core itself as the oracle for mixture-of-experts checkpoints (one process, tp 1, ep 1, CPU).

``run_oracle(work)`` starts this file in a process of its own (Megatron-Core patches torch.cuda calls for the
CPU, see megatron_oracle.py), which for each architecture of ``ARCHS`` (a Mixtral-like MoE, and a Qwen3-MoE-like
one: query/key layernorm, softmax before the top-k; and one whose first layer is dense, which Megatron-Core keys
per layer) builds a Megatron-Core GPTModel with the local layer spec
(SequentialMLP experts, the allgather dispatcher), gives its norms random values, runs it on the oracle's
tokens (eval: no router loss), saves it as Megatron-LM does (``torch_dist``), then has megareshard's
``import-megatron`` and ``export-megatron`` write it back and loads that export with ``dist_checkpointing.load``
into a freshly seeded model: whether every weight equals the original's bit for bit, and its logits.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

import torch
import torch.distributed as dist

if __package__:
    from . import megatron_oracle as base
else:   # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.checkpoint import megatron_oracle as base

ROOT = base.ROOT
E, K, FE = 4, 2, 24
ARCHS = {"mixtral": dict(qk_layernorm=False, pre_softmax=False, freq=1),
         "qwen": dict(qk_layernorm=True, pre_softmax=True, freq=1),
         "first_dense": dict(qk_layernorm=False, pre_softmax=False, freq=[0, 1, 1, 1])}   # layers keyed apart
LLAMA = base.ARCHS["llama"]


def megatron_args(arch: str) -> argparse.Namespace:
    args = base.megatron_args("llama", 1)
    a = ARCHS[arch]
    args.__dict__.update(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FE, moe_layer_freq=a["freq"],
                         moe_router_pre_softmax=a["pre_softmax"], moe_router_load_balancing_type="aux_loss",
                         moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                         qk_layernorm=a["qk_layernorm"], expert_model_parallel_size=1)
    return args


def build(arch: str, seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a, L = ARCHS[arch], LLAMA
    cfg = TransformerConfig(
        num_layers=L["num_layers"], hidden_size=L["hidden_size"], num_attention_heads=L["num_attention_heads"],
        num_query_groups=L["num_query_groups"], ffn_hidden_size=L["ffn_hidden_size"], normalization="RMSNorm",
        layernorm_epsilon=L["eps"], gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        init_method_std=0.02, tensor_model_parallel_size=1, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FE, moe_token_dispatcher_type="allgather",
        moe_router_pre_softmax=a["pre_softmax"], moe_aux_loss_coeff=0.01, qk_layernorm=a["qk_layernorm"],
        moe_layer_freq=a["freq"])
    torch.manual_seed(seed)
    if a["freq"] == 1:
        spec = get_gpt_layer_local_spec(num_experts=E, qk_layernorm=a["qk_layernorm"], normalization="RMSNorm")
    else:       # dense and MoE layers: a spec per layer
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=base.padded(1), max_sequence_length=64, parallel_output=False,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=base.ROTARY_BASE, rotary_percent=1.0)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + 1.0)
            elif name.endswith("router.weight"):   # decisive routing: no near-tie between the top-k and the rest
                p.mul_(20.0)
    return model.eval()


def make_fixtures(work: str) -> dict:
    base._keep_cuda_off()
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    base._local_results_queue()
    moe_utils.te_general_gemm = None       # megatron-core 0.16 names it only when Transformer Engine imports

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    out: dict = {"logits": {}, "export": {}}
    originals = {}
    for arch in ARCHS:
        model = build(arch)
        out["logits"][arch] = base.forward(model)
        originals[arch] = {n: p.detach().clone() for n, p in model.named_parameters()}
        base.save_dist(model, os.path.join(work, arch), megatron_args(arch))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.checkpoint._helpers import load_tool; "
            "tool = load_tool(); work = sys.argv[2]\n"
            "for name in sys.argv[3:]:\n"
            "    tool.import_megatron(f'{work}/{name}', f'{work}/{name}_ours')\n"
            "    tool.export_megatron(f'{work}/{name}_ours', f'{work}/{name}_export', tp=1)\n")
    subprocess.run([sys.executable, "-c", code, ROOT, work, *ARCHS], check=True)
    for arch in ARCHS:
        fresh = build(arch, seed=7)
        export = os.path.join(work, f"{arch}_export")
        with open(os.path.join(export, "latest_checkpointed_iteration.txt")) as f:
            it = int(f.read())
        loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, os.path.join(export, f"iter_{it:07d}"))
        fresh.load_state_dict(loaded["model"])
        mine = dict(fresh.named_parameters())
        same = {n: torch.equal(base._real_rows(n, mine[n].detach(), 1, 0), base._real_rows(n, p, 1, 0))
                for n, p in originals[arch].items()}
        out["export"][arch] = {"same_weights": same, "logits": base.forward(fresh)}
    parallel_state.destroy_model_parallel()
    return out


def run_oracle(work: str, timeout: float = 600.0) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    log = os.path.join(work, "oracle.log")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), os.path.join(work, "store"), work], env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode:
        with open(log, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if "warn" not in ln.lower()]
        raise RuntimeError("the Megatron-Core MoE oracle failed:\n" + "\n".join(lines[-40:]))
    return torch.load(os.path.join(work, "oracle.pt"), weights_only=False)


def _main(store_path: str, work: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    torch.save(make_fixtures(work), os.path.join(work, "oracle.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
