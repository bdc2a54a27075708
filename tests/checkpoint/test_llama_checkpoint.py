"""A Llama-style GPT's checkpoint relayouts like any other: names are global, the untied output
layer is stored as its own tensor, the grouped QKV weight re-slices by tp.

One 4-rank launch: tp 2 · pp 2 · ZeRO 1 trains 5 iterations saving at 3; tp 4 · ZeRO 2
(one key/value group per rank), pp 4 and tp 2 · dp 2 load iteration 3 and continue with the
source's losses (1e-5 relative: other layouts sum in other orders). Loading it with the
GPT-2 architecture is refused, naming the fields that differ.
"""
from __future__ import annotations

import io

import pytest
import torch

from megareshard.arguments import parse_args
from megareshard.checkpoint import CheckpointError
from megareshard.training import Trainer, build_context
from tests.harness import run_ranks

from tests.checkpoint.test_trainer_checkpoint import MODEL

LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
         "--num-attention-heads", "8", "--num-query-groups", "4", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear"]
TARGETS = [("tp4_z2", ["--tensor-model-parallel-size", "4", "--zero-stage", "2"]),
           ("pp4", ["--pipeline-model-parallel-size", "4"]),
           ("tp2_dp2", ["--tensor-model-parallel-size", "2"])]


def _trainer(argv, world, llama=True):
    cfg = parse_args(MODEL + (LLAMA if llama else []) + ["--nproc-per-node", str(world)] + argv, world_size=world)
    ctx, _ = build_context(cfg, world)
    return Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())


def _worker(rank: int, world: int, root: str):
    torch.set_num_threads(1)
    out = {}
    src = _trainer(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                    "--train-iters", "5", "--save", f"{root}/src", "--save-interval", "3"], world)
    out["src"] = [r["loss"] for r in src.train()]
    out["src_names"] = sorted(n for n, _ in src.model.named_parameters())
    src.close()
    for name, argv in TARGETS:
        t = _trainer(argv + ["--train-iters", "5", "--load", f"{root}/src/iter_0000003"], world)
        out[name] = (t.iteration, [r["loss"] for r in t.train()])
        t.close()
    try:
        _trainer(["--train-iters", "5", "--load", f"{root}/src/iter_0000003"], world, llama=False)
        out["gpt2"] = None
    except CheckpointError as e:
        out["gpt2"] = str(e)
    return out


@pytest.mark.slow
def test_llama_checkpoint_relayouts_tp_pp_dp_and_zero(tmp_path):
    results = run_ranks(_worker, 4, str(tmp_path), timeout=400)
    r = next(x for x in results if len(x["src"]) == 5 and x["tp4_z2"][1])
    src = r["src"]
    names = [n for x in results for n in x["src_names"]]
    assert "output_layer.weight" in names and "layers.3.mlp.fc1_up.weight" in names   # global names, untied head
    for name, _ in TARGETS:
        start, losses = r[name]
        assert start == 3 and len(losses) == 2, name
        for a, b in zip(losses, src[3:]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, losses, src[3:])
    message = r["gpt2"]
    assert message is not None, "a Llama checkpoint loaded into a GPT-2 model"
    for field in ("normalization: checkpoint RMSNorm, this run LayerNorm", "swiglu: checkpoint True, this run False",
                  "untie_embeddings_and_output_weights: checkpoint True, this run False"):
        assert field in message, message
