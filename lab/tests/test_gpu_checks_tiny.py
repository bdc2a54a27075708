"""lab.bench.gpu_checks run on CPU with --tiny: the machinery the GPU run uses (the determinism part's runs of
``pretrain_gpt.py``, the compile modes read from megareshard's parser, the speed grid's worker process per model
with the megareshard-cli point as a user launches it, its log read back, the lean peer beside it, every point on
record, the deadline), so that the lent GPU's single run works the first time."""
from __future__ import annotations

import json
import os

import pytest


def _gpu_checks(out, *args: str) -> dict:
    """The tool's main in this process (a fresh interpreter costs seconds of imports); its runs and workers are
    their own processes, as on the GPU."""
    from lab.bench import gpu_checks

    assert gpu_checks.main(["--out", str(out), "--tiny", *args]) == 0
    return json.load(open(os.path.join(out, "gpu_checks.json")))


def test_lean_peer_has_megareshards_shapes_and_parameter_count():
    """The lean peer is built from megareshard's parsed config: the same parameters as megareshard's own model
    (GPT: tied output, learned positions, biases; Llama: untied, GQA, SwiGLU of --ffn-hidden-size, no biases)."""
    import torch

    from lab.bench import gpu_checks, lean_peer
    from megareshard.model_spec import get_model_spec
    from megareshard.parallel import ParallelContext

    def spec(flags: str, mbs: int, gbs: int, seq: int, vocab: int) -> dict:
        return dict(flags=flags, mbs=mbs, gbs=gbs, seq=seq, vocab=vocab, warmup=1, iters=1, device="cpu",
                    compile_backend="aot_eager")

    counts = {}
    for name, family, flags, mbs, gbs in gpu_checks.TINY_GRID:
        cfg = gpu_checks._model_config(spec(flags, mbs, gbs, gpu_checks.TINY_SEQ, gpu_checks.TINY_VOCAB), [])
        ours = get_model_spec("gpt").build_model(cfg, ParallelContext.single_process(), None, num_stages=1, seed=1,
                                                 device=torch.device("cpu"), params_dtype=torch.float32)
        lean, step = lean_peer.build(cfg, family, torch.device("cpu"), compile_backend=None)
        counts[name] = sum(p.numel() for p in lean.parameters())
        assert counts[name] == sum(p.numel() for p in ours.parameters()), name
        assert lean.s.llama == (family == "llama") and (lean.head is None) == (family == "gpt")
        assert float(step()) > 0
    assert counts["gpt-tiny"] != counts["llama-tiny"]
    with pytest.raises(ValueError, match="no counterpart"):  # a GPT config is not a Llama peer
        lean_peer.Shape.from_config(gpu_checks._model_config(spec(gpu_checks.TINY_GRID[0][2], 2, 4, 64, 512), []).model,
                                    "llama")
    # the GPU grid's shapes, built on the meta device (no memory): the Llama has ffn 5632
    full = {}
    for name, family, flags, mbs, gbs in gpu_checks.GRID:
        s = lean_peer.Shape.from_config(gpu_checks._model_config(spec(flags, mbs, gbs, 2048, 50304), []).model, family)
        with torch.device("meta"):
            full[name] = sum(p.numel() for p in lean_peer.LeanModel(s).parameters())
        if name == "llama-1.2b":
            assert (s.ffn, s.groups, s.heads, s.vocab) == (5632, 8, 32, 50304)
    assert [g[0] for g in gpu_checks.GRID][:4] == ["gpt-125m", "gpt-1.3b", "llama-1.2b", "gpt-350m"]
    assert 124e6 < full["gpt-125m"] < 126e6 and 1.3e9 < full["gpt-1.3b"] < 1.33e9, full


@pytest.mark.slow
def test_tiny_speed_grid_cli_and_lean_points(tmp_path):
    from lab.bench import gpu_checks

    res = _gpu_checks(tmp_path / "a", "--parts", "speed", "--models", "gpt-tiny", "--variants",
                      "megareshard-cli,lean-compile,lean-eager", "--late-variants", "", "--warmup", "1", "--iters", "1",
                      "--profile-model", "gpt-tiny", "--deadline-s", "300")
    assert res["ceilings"]["device"] == "cpu" and "Megatron-LM model FLOPs" in res["flop_formula"]
    points = res["speed"]["points"]
    assert [(p["model"], p["variant"], p["status"]) for p in points] == \
        [("gpt-tiny", v, "ok") for v in ("megareshard-cli", "lean-compile", "lean-eager")], points
    cli, lean, eager = points
    # megareshard-cli-model (a late variant by default) is the same launch with the whole model as one graph
    # (what that flag does: tests/test_compile_scope.py)
    spec = {"warmup": 1, "iters": 1, "device": "cpu", "flags": "--num-layers 2", "seq": 64, "vocab": 512, "mbs": 2,
            "gbs": 4, "compile_backend": "aot_eager"}
    plain, whole = (gpu_checks.cli_command(spec, None, v) for v in ("megareshard-cli", "megareshard-cli-model"))
    assert [x for x in whole if x not in plain] == ["--torch-compile-scope", "model"] and len(whole) == len(plain) + 2
    # the CLI point: pretrain_gpt.py as a user launches it, tokens/s as its log line for the timed iteration says
    assert "pretrain_gpt.py" in cli["command"] and "--cross-entropy-loss-fusion" in cli["command"]
    assert "--torch-compile-backend aot_eager" in cli["command"] and "--eval-interval 0" in cli["command"]
    logged = gpu_checks.log_iterations(open(cli["log"]).read())
    assert [r["iteration"] for r in logged] == [1, 2, 3, 4] and cli["logged_iterations"] == 4
    assert cli["tokens_per_s"] == logged[1]["tokens_per_s"]  # 1 warm-up, 1 timed, then the 2 profiled ones
    assert cli["profiled_iterations"] == [3, 4] and cli["seconds_per_iter"] > 0
    assert "traceEvents" in json.load(open(cli["profile_trace"]))
    # the trace summarised by lab.bench.gpu_profile (a CPU run: it says there is no GPU activity) and drawn
    assert cli["profile"]["gpu"]["present"] is False and os.path.getsize(cli["profile"]["png"]) > 0, cli["profile"]
    assert "cross-entropy fused" in cli["fast_path"] and cli["compile_s"] >= 0
    # the lean peer, compiled (aot_eager: the whole model) and eager; one FLOP count for all
    assert lean["params"] == eager["params"] and "whole model" in lean["compile"] and eager["compile"] is None
    for p in points:
        assert p["tokens_per_s"] > 0 and 0 < p["mfu_vs_peak"] < 1
        assert p["tflops"] / p["tokens_per_s"] == pytest.approx(cli["tflops"] / cli["tokens_per_s"], rel=1e-12)
    assert lean["vs_lean"] == 1.0 and cli["vs_lean"] == pytest.approx(cli["tokens_per_s"] / lean["tokens_per_s"])
    assert "vs_hf_compile" not in cli
    # no time: every point is on record as skipped, both rounds (tiny grid: 2 models × 2 variants, then the late two)
    skipped = _gpu_checks(tmp_path / "b", "--parts", "speed", "--deadline-s", "0")["speed"]["points"]
    assert [p["variant"] for p in skipped] == ["megareshard-cli", "lean-compile"] * 2 + \
        ["megareshard-cli-model", "hf-compile"] * 2
    assert all(p["status"] == "skipped" for p in skipped)


@pytest.mark.slow
def test_tiny_determinism_and_compile_modes(tmp_path):
    from megareshard.config.compile import COMPILE_MODES

    res = _gpu_checks(tmp_path, "--parts", "determinism,compile_modes", "--determinism-runs",
                      "bf16,bf16_again,bf16_first_half,bf16_resumed", "--compile-modes", "reduce-overhead")
    d = res["determinism"]
    assert d["same_command_bitwise_equal"] is True and d["resume_bitwise_equal"] is True, d
    # as printed and at full precision (--metrics-file: the same path for every run, so the same command)
    assert d["same_command_bitwise_equal_full_precision"] is True and d["resume_bitwise_equal_full_precision"] is True
    assert d["same_command_first_difference"] is None and d["resume_first_difference"] is None
    assert "dropout" not in d["command"]  # Megatron's default dropout 0.1
    runs = d["runs"]
    assert [runs[r]["iterations"] for r in ("bf16", "bf16_first_half", "bf16_resumed")] == \
        [[1, 2, 3, 4, 5, 6], [1, 2, 3], [4, 5, 6]]
    asked = ("bf16", "bf16_again", "bf16_first_half", "bf16_resumed")
    assert all(runs[r]["rc"] == 0 and os.path.exists(runs[r]["log"]) and runs[r]["attention_kernels"] == ["sdpa"]
               for r in asked)
    assert runs["bf16"]["attention_reused"] is False and runs["bf16_resumed"]["attention_reused"] is True
    assert d["resumed_attention_reused"] is True and "CKPT" in runs["bf16_resumed"]["command"]
    assert runs["bf16"]["command"] == runs["bf16_again"]["command"] == d["command"]
    assert [r["iteration"] for r in runs["bf16_resumed"]["full_precision"]] == [4, 5, 6]
    assert runs["bf16"]["loss"][0] == f"{runs['bf16']['full_precision'][0]['loss']:.6E}"
    for name in ("det", "fp32"):
        assert runs[name]["status"] == "skipped"  # not asked: recorded, not run
    assert d["deterministic_mode"]["same_command_bitwise_equal"] is None and d["max_rel_diff_bf16_vs_fp32"] is None
    c = res["compile_modes"]
    assert c["choices"] == list(COMPILE_MODES)  # as pretrain_gpt.py --help offers them
    # a CUDA-graph mode: refused, in one line, read from the launch's stderr (max-autotune's refusal is the same
    # check: tests/test_fast_path.py; one launch of the tool's machinery is enough here)
    m = c["modes"]["reduce-overhead"]
    assert m["status"] == "refused" and m["rc"] == 2 and m["trained"] is False
    assert m["line"].startswith("pretrain_gpt.py: error: --torch-compile-mode reduce-overhead cannot train here")
    assert c["modes"]["default"]["status"] == c["modes"]["max-autotune"]["status"] == "skipped"
    assert set(res["part_seconds"]) == {"determinism", "compile_modes"}


def test_report_puts_reruns_side_by_side_and_names_what_did_not_run(tmp_path):
    from lab.bench import gpu_report

    def run(path, tok, status="ok", lean=True):
        pts = [{"model": "gpt-tiny", "variant": v, "status": status if v == "hf-compile" else "ok",
                "tokens_per_s": tok * k, "tflops": 1.0, "mfu_vs_peak": 0.5, "mfu_vs_measured": 0.6,
                "vs_hf_compile": k, "peak_mem_gib": 1.0, "compile_s": 2.0, "error": "boom",
                **({"vs_lean": k / 0.8} if lean else {})}
               for v, k in (("megareshard-cli", 1.25), ("lean-compile", 0.8), ("hf-compile", 1.0))]
        path.write_text(json.dumps({"ceilings": {"device": "cpu"}, "peak_tflops": 1.0, "speed": {"points": pts}}))
        return str(path)

    text = gpu_report.table(gpu_report.load([run(tmp_path / "a.json", 100), run(tmp_path / "b.json", 200, "failed")]))
    rows = [r for r in text.splitlines() if r.startswith("| gpt-tiny")]
    assert [r.split(" | ")[1] for r in rows] == ["megareshard-cli", "lean-compile", "hf-compile"]
    assert rows[0].startswith("| gpt-tiny | megareshard-cli | 125 / 250 |") and "| 1.562 / 1.562 | 1.250 / 1.250 |" \
        in rows[0]
    assert "run 2: failed boom" in rows[2] and "run 1" not in rows[2]
    # a run from before the lean peer: its ratio column is empty, its picture falls back to transformers
    old = gpu_report.load([run(tmp_path / "c.json", 100, lean=False)])
    assert "| - | 1.250 |" in gpu_report.table(old) and old[0]["mfu_targets"] == gpu_report.OLD_MFU_TARGETS


def test_report_merges_the_parts_of_one_grid_and_refuses_a_point_measured_twice(tmp_path):
    from lab.bench import gpu_report

    def part(path, ok, skipped):
        pts = [{"model": m, "variant": "megareshard-cli", "status": "ok", "tokens_per_s": 10.0, "tflops": 1.0,
                "mfu_vs_peak": 0.5, "mfu_vs_measured": 0.6, "vs_lean": 1.0, "peak_mem_gib": 1.0, "compile_s": 2.0}
               for m in ok] + [{"model": m, "variant": "megareshard-cli", "status": "skipped", "error": "no time"}
                               for m in skipped]
        path.write_text(json.dumps({"ceilings": {"device": "cpu"}, "peak_tflops": 1.0, "speed": {"points": pts}}))
        return str(path)

    a, b = part(tmp_path / "a.json", ["m1"], ["m2", "m3"]), part(tmp_path / "b.json", ["m2"], [])
    (run,) = gpu_report.load([a, b], merge=True)
    rows = [r for r in gpu_report.table([run]).splitlines() if r.startswith("| m") and "variant" not in r]
    assert [r.split(" | ")[0][2:] for r in rows] == ["m1", "m2", "m3"]       # m2 from b, m3 still named skipped
    assert "no time" not in rows[1] and "run 1: skipped no time" in rows[2]
    with pytest.raises(ValueError, match="m1 megareshard-cli measured in more than one file"):
        gpu_report.load([a, part(tmp_path / "c.json", ["m1"], [])], merge=True)
