"""lab/bench/bench_train.py end to end on one CPU rank (the GPU MFU numbers in docs/benchmarks.md come from it)."""
import json

from lab.tests import run_main


def test_one_rank_llama_flags_pass_through(tmp_path, capsys):
    """The tool in this process (its own interpreter would cost seconds of imports), its torchrun launch real."""
    from lab.bench import bench_train

    out = tmp_path / "r.json"
    p = run_main(bench_train.main, ["--nproc", "1", "--layouts", "tp1", "--num-layers", "1", "--hidden-size", "32",
                                    "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128",
                                    "--iters", "2", "--warmup", "1", "--peak-tflops", "1", "--json", str(out),
                                    "--model-args=--swiglu --normalization RMSNorm --position-embedding-type rope "
                                    "--group-query-attention --num-query-groups 2"], capsys)
    assert p.returncode == 0, p.stderr[-2000:]
    (r,) = json.loads(out.read_text())
    assert r["layout"] == "tp1" and r["ms_per_iter"] > 0 and r["mfu"] == r["tflops_per_rank"] / 1.0
    assert "tp1" in p.stdout and "mfu" in p.stdout
