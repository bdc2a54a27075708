"""lab/bench/gpu_profile.py on a synthetic GPU trace whose numbers are worked out by hand (integer microseconds:
exact), and on a real CPU-only torch.profiler trace (no GPU activity: a field says so). CPU only."""
from __future__ import annotations

import json

import pytest

from lab.bench.gpu_profile import category, draw, main, summarize

HOST, S7, S13 = (100, 100), (0, 7), (0, 13)


def _x(cat, name, ts, end, where=HOST, corr=None):
    args = {} if corr is None else {"correlation": corr}
    if where[0] == 0:  # a GPU event: device and stream, as Kineto writes them
        args.update(device=0, stream=where[1])
    return {"ph": "X", "cat": cat, "name": name, "pid": where[0], "tid": where[1], "ts": ts, "dur": end - ts,
            "args": args}


def synthetic_trace() -> dict:
    """One iteration: host ops on the main thread launching kernels of every category on streams 7 and 13.
    GPU busy: [10,40] [50,57] [80,85] [95,111] [130,146] = 74 us; idle gaps 10 + 23 + 10 + 19 = 62 us."""
    rt, op, ann = "cuda_runtime", "cpu_op", "user_annotation"
    ev = [
        _x(op, "aten::mm", 0, 10), _x(rt, "cudaLaunchKernel", 2, 5, corr=1),
        _x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 10, 30, S7, 1),
        _x(op, "aten::_flash_attention_forward", 10, 20), _x(rt, "cudaLaunchKernel", 12, 15, corr=2),
        _x("kernel", "flash_fwd_kernel", 30, 40, S7, 2),
        _x(op, "_VocabParallelCE", 20, 30), _x(rt, "cudaLaunchKernel", 22, 24, corr=3),
        _x("kernel", "nll_loss_forward_reduce_cuda_kernel_2d", 50, 55, S7, 3),
        # .item(): a copy to pageable memory (blocks) and a stream synchronisation, one point
        _x(op, "aten::item", 30, 70), _x(op, "aten::_local_scalar_dense", 31, 69),
        _x(rt, "cudaMemcpyAsync", 32, 36, corr=4), _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 55, 57, S7, 4),
        _x(rt, "cudaStreamSynchronize", 36, 66, corr=11),
        _x(ann, "Torch-Compiled Region: 0/1", 70, 80), _x("cuda_driver", "cuLaunchKernel", 72, 74, corr=5),
        _x("kernel", "triton_poi_fused_add_0", 80, 85, S7, 5),
        _x(ann, "Optimizer.step#AdamW.step", 90, 115),
        _x(op, "aten::_foreach_add_", 91, 101), _x(rt, "cudaLaunchKernel", 92, 94, corr=6),
        _x("kernel", "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<float>", 95, 110, S7, 6),
        _x(op, "aten::zero_", 105, 110), _x(rt, "cudaMemsetAsync", 106, 107, corr=7),
        _x("gpu_memset", "Memset (Device)", 110, 111, S7, 7),
        _x(op, "aten::mm", 116, 120), _x(rt, "cudaLaunchKernel", 117, 118, corr=10),
        _x("kernel", "cutlass_80_tensorop_s1688gemm_128x128", 132, 136, S7, 10),
        _x(op, "c10d::allreduce_", 121, 126), _x(rt, "cudaLaunchKernel", 122, 124, corr=8),
        _x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 130, 140, S13, 8),
        _x(op, "aten::gelu", 126, 130), _x(rt, "cudaLaunchKernel", 127, 128, corr=9),
        _x("kernel", "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", 140, 146,
           S7, 9),
        # not counted: a GPU-side copy of a user annotation, flows, metadata, the profiler's own span
        _x("gpu_user_annotation", "Optimizer.step#AdamW.step", 10, 146, S7),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 100, "tid": 100, "ts": 2},
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler", "pid": "Spans", "tid": "x", "ts": 0, "dur": 200},
    ]
    return {"traceEvents": ev}


def test_kernel_categories_follow_the_table():
    assert category("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") == "attention"  # FA3: cutlass too
    assert category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert category("triton_red_fused__log_softmax_0") == "loss"  # the loss row comes before triton's
    assert category("triton_per_fused_add_native_layer_norm_1") == "triton"
    assert category("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy") == "copy"
    assert category("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>") == "copy"
    assert category("void at::native::reduce_kernel<512, 1>") == "other"


def test_synthetic_gpu_trace_exact_numbers():
    s = summarize(synthetic_trace(), iterations=2)
    assert (s["iterations"], s["iterations_from"], s["window_us"], s["per_iteration_us"]) == (2, "argument", 146, 73)
    g = s["gpu"]
    assert g["present"] and g["span_us"] == 136 and g["busy_us"] == 74 and g["busy_per_iteration_us"] == 37
    assert g["idle"]["inside_us"] == 62 and g["idle"]["count"] == 4 and g["idle"]["inside_per_iteration_us"] == 31
    assert (g["idle"]["before_first_us"], g["idle"]["after_last_us"], g["idle"]["count_per_iteration"]) == (10, 0, 2)
    assert [(x["at_us"], x["gap_us"]) for x in g["idle"]["largest"]] == [(57, 23), (111, 19), (40, 10), (85, 10)]
    big = g["idle"]["largest"][0]
    assert big["before"] == "Memcpy DtoH (Device -> Pageable)" and big["after"] == "triton_poi_fused_add_0"
    assert big["after_launched_under"] == "Torch-Compiled Region: 0/1" and big["after_launched_at_us"] == 15
    assert big["host_during"] == [{"op": "aten::item", "us": 13}, {"op": "Torch-Compiled Region: 0/1", "us": 10}]
    assert big["syncs_during"] == ["cudaStreamSynchronize under aten::item > aten::_local_scalar_dense"]
    assert g["idle"]["largest"][1]["after_launched_under"] == "c10d::allreduce_"
    assert g["idle"]["largest"][1]["host_during"][0] == {"op": "c10d::allreduce_", "us": 5}
    cats = {k: (c["count"], c["time_us"]) for k, c in g["categories"].items()}
    assert cats == {"gemm": (2, 24), "optimizer": (1, 15), "attention": (1, 10), "nccl": (1, 10), "other": (1, 6),
                    "loss": (1, 5), "triton": (1, 5), "copy": (2, 3)}
    assert g["categories"]["gemm"]["per_iteration_us"] == 12
    assert [(x["stream"], x["events"], x["busy_us"]) for x in g["streams"]] == [(13, 1, 10), (7, 9, 68)]
    assert g["launch_to_start_median_us"] == 10.5  # 3 4 8 8 8 | 13 15 18 23 28
    la = s["launches"]
    assert (la["count"], la["per_iteration"], la["host_us"]) == (8, 4, 16)
    assert la["by_name"] == {"cudaLaunchKernel": 7, "cuLaunchKernel": 1}
    sy = s["syncs"]
    assert (sy["calls"], sy["points"], sy["time_us"], sy["per_iteration_us"], sy["points_per_iteration"]) == \
        (2, 1, 34, 17, 0.5)
    assert sy["by_op"] == [
        {"under": "aten::item > aten::_local_scalar_dense > cudaStreamSynchronize (after _VocabParallelCE)",
         "calls": 1, "us": 30},
        {"under": "aten::item > aten::_local_scalar_dense > cudaMemcpyAsync (after _VocabParallelCE)",
         "calls": 1, "us": 4}]
    sr = s["scalar_reads"]
    assert (sr["calls"], sr["points"], sr["time_us"]) == (1, 1, 38)
    assert sr["by_op"][0]["under"] == "aten::item > aten::_local_scalar_dense (after _VocabParallelCE)"
    opt, loss = s["regions"]["optimizer step"], s["regions"]["loss"]
    assert (opt["host_us"], opt["kernels"], opt["gpu_us"], opt["per_iteration_gpu_us"]) == (25, 2, 16, 8)
    assert opt["kernel_name_rows"] == {"kernels": 1, "gpu_us": 15}  # the memset is the optimizer's, by launch
    assert (loss["host_us"], loss["kernels"], loss["gpu_us"]) == (10, 1, 5)
    assert s["host"]["threads"] == 1 and s["host"]["runtime_calls"] == 11
    tl = s["timeline"]  # one Optimizer.step mark: the whole window
    assert tl["what"] == "the profiled window" and tl["length_us"] == 146
    assert [ln["lane"] for ln in tl["host"]] == ["host main"] and len(tl["gpu"]) == 2 and len(tl["gaps"]) == 4
    assert tl["host"][0]["syncs"] == [[32, 4, "cudaMemcpyAsync"], [36, 30, "cudaStreamSynchronize"]]


def test_iterations_from_the_optimizer_step_and_without_it():
    s = summarize(synthetic_trace())
    assert (s["iterations"], s["iterations_from"], s["gpu"]["busy_per_iteration_us"]) == \
        (1, "Optimizer.step# annotations", 74)
    doc = synthetic_trace()
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not e["name"].startswith("Optimizer")]
    s = summarize(doc)
    assert s["iterations_from"] == "assumed 1"
    assert s["regions"]["optimizer step"]["attributed_by"].startswith("kernel names only")
    assert s["regions"]["optimizer step"]["gpu_us"] == 15


def test_main_prints_and_writes_the_json(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(synthetic_trace()))
    assert main([str(trace), "--iterations", "2", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "GPU busy 0.04 ms/iter" in out and "syncs 0.5/iter" in out
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["gpu"]["busy_us"] == 74 and len(doc["timeline"]["gpu"]) == 2


def test_real_cpu_trace_has_no_gpu_activity(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            # the annotation torch.optim records around a step (torch.optim itself would import torch._dynamo:
            # seconds on a shared CPU)
            with torch.no_grad(), torch.profiler.record_function("Optimizer.step#SGD.step"):
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
                    p.grad = None
            loss.item()
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    s = summarize(path)
    assert s["gpu"]["present"] is False and "no GPU activity" in s["gpu"]["note"]
    assert (s["iterations"], s["iterations_from"]) == (3, "Optimizer.step# annotations")
    assert s["syncs"]["calls"] == 0 and s["launches"]["count"] == 0
    assert s["scalar_reads"]["points"] == 3 and s["window_us"] > 0
    assert s["regions"]["optimizer step"]["host_us"] > 0 and s["regions"]["optimizer step"]["kernels"] == 0
    assert any(op["op"].startswith("aten::") for op in s["host"]["top_level_ops"])
    draw(s, str(tmp_path / "cpu.png"))
    assert (tmp_path / "cpu.png").read_bytes()[:4] == b"\x89PNG"
