"""Megatron-Core itself as the oracle: tiny GPT/Llama models built, run and saved by Megatron-Core on CPU.

``run_oracle(work)`` starts this file on two gloo ranks (two plain processes: Megatron-Core's checkpoint
writer starts processes of its own, which ``tests.harness.run_ranks``' daemonic ranks may not) and, in one
launch (importing Megatron-Core costs seconds per process):

* builds a Llama-style model (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, untied output
  layer, no biases) and a GPT-style one (LayerNorm, learned positions, biases, tied output layer) with
  Megatron-Core's local layer spec at tensor parallelism 2, then 1 (data parallelism 2), with the norms'
  and biases' values drawn at random (they start at one and zero);
* runs each on the same tokens (Megatron's forward, logits gathered over tp) and saves it the way
  Megatron-LM's training loop does: ``dist_checkpointing.save`` of ``{"args", "checkpoint_version",
  "iteration", "model": model.sharded_state_dict()}`` into ``iter_0000010`` and the tracker file
  (``torch_dist``), and for the per-rank ``torch`` format ``{"args", ..., "model":
  model.state_dict_for_save_checkpoint()}`` into ``mp_rank_TT[_PPP]/model_optim_rng.pt`` — the Llama at tp 2,
  and the GPT at pipeline parallelism 2, its stages loaded by Megatron-Core from its tp 1 ``torch_dist``
  checkpoint (so its logits are the tp 1 GPT's);
* exports each tp 1 / tp 2 ``torch_dist`` checkpoint back with megareshard's ``import-megatron`` then
  ``export-megatron`` (rank 0), loads the export with ``dist_checkpointing.load`` into a freshly built
  (differently seeded) Megatron-Core model of the same configuration and returns whether its weights equal
  the original's bit for bit (real vocabulary rows) and its logits.

Megatron-Core's CPU run needs a few CUDA-only calls kept off: ``torch.cuda.current_device`` (RoPE moves
its frequencies there, the attention's memory buffer is allocated there) answers "cpu",
``torch.cuda.synchronize`` (before the save's writes) does nothing, ``Tensor.cuda`` (the tied embedding's copy
on a last pipeline stage) stays on the CPU, the tensor-parallel RNG tracker's fork
(dropout is 0) is a no-op, and the attention gets an explicit causal mask.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, SEQ, BATCH = 100, 16, 2
ITERATION = 10
ARCHS = {
    "llama": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                  normalization="RMSNorm", swiglu=True, bias=False, position="rope", tied=False, eps=1e-6),
    "gpt": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128,
                normalization="LayerNorm", swiglu=False, bias=True, position="learned_absolute", tied=True, eps=1e-5),
}
ROTARY_BASE = 500


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def padded(tp: int) -> int:
    return -(-VOCAB // (128 * tp)) * 128 * tp


def megatron_args(arch: str, tp: int, pp: int = 1, fmt: str = "torch_dist") -> argparse.Namespace:
    """The architecture part of Megatron-LM's saved arguments, under Megatron-LM's names."""
    a = ARCHS[arch]
    return argparse.Namespace(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"],
        group_query_attention=a["num_query_groups"] != a["num_attention_heads"],
        num_query_groups=a["num_query_groups"], kv_channels=a["hidden_size"] // a["num_attention_heads"],
        seq_length=SEQ, max_position_embeddings=64, position_embedding_type=a["position"], rotary_base=ROTARY_BASE,
        rotary_percent=1.0, swiglu=a["swiglu"], openai_gelu=False, squared_relu=False, normalization=a["normalization"],
        norm_epsilon=a["eps"], apply_layernorm_1p=False, untie_embeddings_and_output_weights=not a["tied"],
        add_bias_linear=a["bias"], add_qkv_bias=a["bias"], vocab_size=VOCAB - 1, tokenizer_type="NullTokenizer",
        make_vocab_size_divisible_by=128, padded_vocab_size=padded(tp), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        num_experts=None, multi_latent_attention=False, qk_layernorm=False, params_dtype=torch.float32,
        ckpt_format=fmt, use_mcore_models=True)


def _keep_cuda_off() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self       # the tied embedding's pipeline all-reduce moves it there


def _local_results_queue() -> None:
    """The checkpoint writer hands its results to the finishing step through a queue that Megatron-Core makes
    with a ``spawn`` Manager (a fresh interpreter importing this file and torch: seconds on a loaded CPU), for
    asynchronous saves in another process. A synchronous save puts and takes in this process: a plain queue."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results: queue.Queue = queue.Queue()
    filesystem_async._get_write_results_queue = lambda: results


def build(arch: str, tp: int, pp: int = 1, seed: int = 0):
    """A Megatron-Core GPTModel of ``arch`` for this rank (local layer spec, fp32, CPU initialisation)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a = ARCHS[arch]
    cfg = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"], ffn_hidden_size=a["ffn_hidden_size"], normalization=a["normalization"],
        layernorm_epsilon=a["eps"], gated_linear_unit=a["swiglu"],
        activation_func=torch.nn.functional.silu if a["swiglu"] else torch.nn.functional.gelu,
        add_bias_linear=a["bias"], add_qkv_bias=a["bias"], hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, init_method_std=0.02, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    torch.manual_seed(seed)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=a["normalization"]), vocab_size=padded(tp),
                     max_sequence_length=64, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), parallel_output=False,
                     share_embeddings_and_output_weights=a["tied"], position_embedding_type=a["position"],
                     rotary_base=ROTARY_BASE, rotary_percent=1.0)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:   # norms start at one, biases at zero: give them values so their mapping counts
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


def forward(model) -> torch.Tensor:
    t = tokens()
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)     # True: masked (Megatron's convention)
    with torch.no_grad():
        return model(t, pos, mask)[..., :VOCAB].clone()


def save_dist(model, root: str, args: argparse.Namespace) -> None:
    from megatron.core import dist_checkpointing

    d = os.path.join(root, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                             "model": model.sharded_state_dict()}, d)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()


def save_torch(model, root: str, args: argparse.Namespace, tp_rank: int, pp_rank: int, pp: int, write: bool) -> None:
    """Megatron-LM's ``--ckpt-format torch`` save of this rank's model."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    d = os.path.join(root, f"iter_{ITERATION:07d}", name)
    if write:
        os.makedirs(d, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint()}, os.path.join(d, "model_optim_rng.pt"))
        if tp_rank == 0 and pp_rank == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))
    dist.barrier()


def _real_rows(name: str, t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """The rows of a vocabulary-parallel shard that are real vocabulary (padding rows are not kept)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        start = tp_rank * t.shape[0]
        return t[:max(0, min(t.shape[0], VOCAB - start))]
    return t


def _export_all(work: str, names: list[str]) -> None:
    """megareshard's ``import-megatron`` then ``export-megatron`` of each checkpoint, in one process of its own
    (the tools write single-process; this process is in a two-rank group)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.checkpoint._helpers import load_tool; "
            "tool = load_tool(); work = sys.argv[2]\n"
            "for name in sys.argv[3:]:\n"
            "    tool.import_megatron(f'{work}/{name}', f'{work}/{name}_ours')\n"
            "    tool.export_megatron(f'{work}/{name}_ours', f'{work}/{name}_export', tp=int(name[-1]))\n")
    subprocess.run([sys.executable, "-c", code, ROOT, work, *names], check=True)


def _check_export(arch: str, tp: int, work: str, original: dict[str, torch.Tensor]) -> dict:
    """Megatron-Core loads the export into a freshly built model: its weights against the original's, its logits."""
    from megatron.core import dist_checkpointing, parallel_state

    export = os.path.join(work, f"{arch}_tp{tp}_export")
    fresh = build(arch, tp, seed=7)
    with open(os.path.join(export, "latest_checkpointed_iteration.txt")) as f:
        it = int(f.read())
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, os.path.join(export, f"iter_{it:07d}"))
    fresh.load_state_dict(loaded["model"])
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mine = dict(fresh.named_parameters())
    same = {n: torch.equal(_real_rows(n, mine[n].detach(), tp, tp_rank), _real_rows(n, p, tp, tp_rank))
            for n, p in original.items()}
    return {"same_weights": same, "logits": forward(fresh)}


def make_fixtures(rank: int, world: int, work: str) -> dict:
    """Runs on two ranks: every fixture above under ``work``; returns {name: reference logits} and the export
    checks (logits are gathered over tp, so every rank has them)."""
    _keep_cuda_off()
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    _local_results_queue()

    out: dict = {"logits": {}, "export": {}}
    originals = {}
    for tp in (2, 1):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for arch in ARCHS:
            model = build(arch, tp)
            out["logits"][f"{arch}_tp{tp}"] = forward(model)
            originals[(arch, tp)] = {n: p.detach().clone() for n, p in model.named_parameters()}
            save_dist(model, os.path.join(work, f"{arch}_tp{tp}"), megatron_args(arch, tp))
            if arch == "llama" and tp == 2:
                save_torch(model, os.path.join(work, "llama_tp2_torch"), megatron_args(arch, tp, fmt="torch"),
                           tp_rank, 0, 1, write=True)
        parallel_state.destroy_model_parallel()
    # the GPT at pipeline parallelism 2, per-rank files: each stage loads its layers from the tp 1 checkpoint
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    stage = build("gpt", 1, pp=2, seed=3)
    stage.load_state_dict(dist_checkpointing.load({"model": stage.sharded_state_dict()},
                                                  os.path.join(work, "gpt_tp1", f"iter_{ITERATION:07d}"))["model"])
    save_torch(stage, os.path.join(work, "gpt_pp2_torch"), megatron_args("gpt", 1, pp=2, fmt="torch"), 0,
               parallel_state.get_pipeline_model_parallel_rank(), 2, write=True)
    parallel_state.destroy_model_parallel()
    if rank == 0:
        _export_all(work, [f"{arch}_tp{tp}" for tp in (2, 1) for arch in ARCHS])
    dist.barrier()
    for tp in (2, 1):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        for arch in ARCHS:
            out["export"][f"{arch}_tp{tp}"] = _check_export(arch, tp, work, originals[(arch, tp)])
        parallel_state.destroy_model_parallel()
    out["logits"]["llama_tp2_torch"] = out["logits"]["llama_tp2"]
    out["logits"]["gpt_pp2_torch"] = out["logits"]["gpt_tp1"]
    return out


def run_oracle(work: str, timeout: float = 600.0) -> dict:
    """Run ``make_fixtures`` on two ranks writing under ``work``; returns its result (rank 0's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    store = os.path.join(work, "store")
    logs = [os.path.join(work, f"rank{r}.log") for r in range(2)]
    procs = []
    for r in range(2):
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), "2", store, work],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        tail = ""
        for r, (p, path) in enumerate(zip(procs, logs)):
            with open(path, errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if "warn" not in ln.lower()]
            tail += f"\n--- rank {r} (exit {p.returncode}) ---\n" + "\n".join(lines[-30:])
        raise RuntimeError(f"the Megatron-Core oracle failed (or ran past {timeout:.0f} s):{tail}")
    return torch.load(os.path.join(work, "oracle.pt"), weights_only=False)


def _main(rank: int, world: int, store_path: str, work: str) -> None:
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    out = make_fixtures(rank, world, work)
    if rank == 0:
        torch.save(out, os.path.join(work, "oracle.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
