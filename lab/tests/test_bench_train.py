"""lab/bench/bench_train.py end to end on one CPU rank (the GPU MFU numbers in docs/benchmarks.md come from it)."""
import json
import subprocess
import sys
from pathlib import Path

from lab import ROOT, module_command  # noqa: F401


def test_one_rank_llama_flags_pass_through(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([*module_command("lab.bench.bench_train"), "--nproc", "1", "--layouts", "tp1",
                        "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                        "--vocab-size", "128", "--iters", "2", "--warmup", "1", "--peak-tflops", "1", "--json", str(out),
                        "--model-args=--swiglu --normalization RMSNorm --position-embedding-type rope "
                        "--group-query-attention --num-query-groups 2"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    (r,) = json.loads(out.read_text())
    assert r["layout"] == "tp1" and r["ms_per_iter"] > 0 and r["mfu"] == r["tflops_per_rank"] / 1.0
    assert "tp1" in p.stdout and "mfu" in p.stdout
