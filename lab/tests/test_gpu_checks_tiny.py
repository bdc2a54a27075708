"""lab.bench.gpu_checks's speed grid, run on CPU with --tiny: the machinery the GPU run uses (a worker process per
model, every point on record, the FLOP count, the deadline), so that the lent GPU's run works the first time.
Eager variants only here (the compiled path's correctness is tests/test_fast_path.py's)."""
from __future__ import annotations

import json
import os

import pytest


def _gpu_checks(out, *args: str) -> dict:
    """The tool's main in this process (a fresh interpreter costs seconds of imports); each point's worker is its
    own process, as on the GPU."""
    from lab.bench import gpu_checks

    assert gpu_checks.main(["--out", str(out), "--tiny", *args]) == 0
    return json.load(open(os.path.join(out, "gpu_checks.json")))


@pytest.mark.slow
def test_tiny_speed_grid_records_every_point(tmp_path):
    res = _gpu_checks(tmp_path / "a", "--models", "gpt-tiny", "--variants", "megareshard-eager,hf-eager",
                      "--warmup", "1", "--iters", "1", "--deadline-s", "300")
    assert res["ceilings"]["device"] == "cpu" and "Megatron-LM model FLOPs" in res["flop_formula"]
    points = res["speed"]["points"]
    assert [(p["model"], p["variant"], p["status"]) for p in points] == \
        [("gpt-tiny", "megareshard-eager", "ok"), ("gpt-tiny", "hf-eager", "ok")], points
    for p in points:
        assert p["tokens_per_s"] > 0 and p["tflops"] > 0 and 0 < p["mfu_vs_peak"] < 1 and p["peak_mem_gib"] > 0
        assert len(p["iter_s"]) == 2 and p["seq_length"] == 64 and p["global_batch"] == 4
    # the same FLOP count for both (same shapes): TFLOP/s / tokens/s agree
    a, b = (p["tflops"] / p["tokens_per_s"] for p in points)
    assert a == pytest.approx(b, rel=1e-12)
    assert points[0]["params"] == points[1]["params"]  # the same shapes: megareshard GPT-2 = transformers GPT2
    skipped = _gpu_checks(tmp_path / "b", "--deadline-s", "0")["speed"]["points"]
    assert len(skipped) == 6 and all(p["status"] == "skipped" for p in skipped)


def test_report_puts_reruns_side_by_side_and_names_what_did_not_run(tmp_path):
    import json

    from lab.bench import gpu_report

    def run(path, tok, status="ok"):
        pts = [{"model": "gpt-tiny", "variant": v, "status": status if v == "hf-compile" else "ok",
                "tokens_per_s": tok * k, "tflops": 1.0, "mfu_vs_peak": 0.5, "mfu_vs_measured": 0.6,
                "vs_hf_compile": k, "peak_mem_gib": 1.0, "compile_s": 2.0, "error": "boom"}
               for v, k in (("megareshard-eager", 0.5), ("megareshard-fast", 1.25), ("hf-compile", 1.0))]
        path.write_text(json.dumps({"ceilings": {"device": "cpu"}, "peak_tflops": 1.0, "speed": {"points": pts}}))
        return str(path)

    text = gpu_report.table(gpu_report.load([run(tmp_path / "a.json", 100), run(tmp_path / "b.json", 200, "failed")]))
    rows = [r for r in text.splitlines() if r.startswith("| gpt-tiny")]
    assert rows[1].startswith("| gpt-tiny | megareshard-fast | 125 / 250 |") and "1.250 / 1.250" in rows[1]
    assert "run 2: failed boom" in rows[2] and "run 1" not in rows[2]
