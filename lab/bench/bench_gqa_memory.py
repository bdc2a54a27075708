#!/usr/bin/env python
"""Grouped-query attention's smaller keys and values, measured: activation memory saved for backward and
key/value weights of one Llama-style model, per number of key/value groups (one process, CPU or GPU).

    python -m lab.bench.bench_gqa_memory [--json docs/results/gqa_memory.json] [--device cuda]

Same model (RMSNorm, RoPE, SwiGLU, no bias), same batch; only --num-query-groups changes. Activation
bytes come from `megareshard.memory.ActivationMeter` (tensors autograd keeps for backward, parameters
excluded); the expected saving is 2·b·s·(heads − groups)·head_dim elements per layer for the keys and
values (two tensors per layer) — printed beside the measurement.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch  # noqa: E402

from megareshard.memory import ActivationMeter  # noqa: E402
from megareshard.models import GPTModel, ModelConfig  # noqa: E402
from megareshard.parallel import ParallelContext  # noqa: E402


def measure(groups: int, a: argparse.Namespace) -> dict:
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                      vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                      position_embedding_type="rope", swiglu=True, group_query_attention=groups < a.heads,
                      num_query_groups=groups, disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    dev = torch.device(a.device)
    model = GPTModel(cfg, ParallelContext.single_process(), seed=0, device=dev)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    with ActivationMeter(exclude=list(model.parameters()), device=dev) as meter:
        loss = model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    kv_params = sum(p.numel() for n, p in model.named_parameters() if "qkv" in n) - a.layers * a.hidden * a.hidden
    head_dim = a.hidden // a.heads
    return {"groups": groups, "activation_bytes": int(meter.peak_bytes), "qkv_weight_elements": int(kv_params + a.layers * a.hidden * a.hidden),
            "kv_elements_per_layer": 2 * a.batch * a.seq * groups * head_dim}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--groups", default="8,4,2,1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = [measure(int(g), a) for g in a.groups.split(",")]
    mha = rows[0]
    print("| kv groups | activations MiB | saved vs first row, measured | k and v of every layer, 2 tensors (expected) | qkv weights (M elements) |")
    print("|---|---|---|---|---|")
    for r in rows:
        saved = mha["activation_bytes"] - r["activation_bytes"]
        expect = a.layers * (mha["kv_elements_per_layer"] - r["kv_elements_per_layer"]) * 4
        print(f"| {r['groups']} | {r['activation_bytes'] / 2**20:.2f} | {saved / 2**20:.2f} MiB | {expect / 2**20:.2f} MiB | "
              f"{r['qkv_weight_elements'] / 1e6:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
