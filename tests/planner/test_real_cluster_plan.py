"""A real cluster's plan does not move: the planner's ranking and numbers on a committed cluster file (2 hosts × 4
GPUs, each host its own cores; written in the older layout that still carried the emulated cluster's shared-core
fields, null and zero) equal, bit for bit, those recorded from the planner before its extra cost terms moved out
(commit c1be776; `python -m tests.planner.test_real_cluster_plan --record` wrote them there). Pure: no processes."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from megareshard.planner import ModelShape, plan_layouts
from megareshard.planner.cluster_file import load_cluster

DATA = Path(__file__).resolve().parent / "data"
CLUSTER = DATA / "cluster_2x4.json"
RECORDED = DATA / "cluster_2x4_plans.json"
MODELS = {  # a GPT that fills the devices (memory prunes) and a Llama-style one (GQA, SwiGLU, untied, rotary)
    "gpt-24x4096": (ModelShape(24, 4096, 32, 4096, 50304), 32),
    "llama-12x1536": (ModelShape(12, 1536, 16, 1024, 32000, ffn_hidden_size=4096, num_query_groups=4, swiglu=True,
                                 untied=True, learned_positions=False), 32),
}
SIMULATED = ("name", "flags", "step_s", "estimate_s", "bubble", "bottleneck", "breakdown", "memory_gib",
             "live_microbatches", "edge_s", "stage_f_s", "stage_b_s", "stage_w_s", "tp_bytes", "pp_nic_bytes",
             "dp_nic_bytes", "tokens_per_s", "runtime")
ESTIMATED = ("name", "step_s", "estimate_s", "memory_gib")
REST = 40
"""The estimated (not simulated) candidates kept, best first."""


def summary() -> dict[str, Any]:
    """Per model: the planner's counts, every simulated candidate in full and the first `REST` estimated ones."""
    cluster = load_cluster(str(CLUSTER))
    out: dict[str, Any] = {}
    for key, (model, global_batch) in MODELS.items():
        stats: dict[str, int] = {}
        ranked = plan_layouts(model, cluster, global_batch, stats=stats)
        sim = [c for c in ranked if c.breakdown]
        rest = [c for c in ranked if not c.breakdown][:REST]
        out[key] = {"stats": stats, "candidates": len(ranked),
                    "simulated": [{k: (c.flags() if k == "flags" else c.name if k == "name" else getattr(c, k))
                                   for k in SIMULATED} for c in sim],
                    "estimated": [{k: (c.name if k == "name" else getattr(c, k)) for k in ESTIMATED} for c in rest]}
    return json.loads(json.dumps(out))  # tuples as lists, as recorded


def test_a_real_cluster_plan_is_the_recorded_one() -> None:
    want = json.loads(RECORDED.read_text(encoding="utf-8"))
    got = summary()
    assert list(got) == list(want)
    for key in want:
        g, w = got[key], want[key]
        assert (g["stats"], g["candidates"]) == (w["stats"], w["candidates"]), key
        assert [c["name"] for c in g["simulated"]] == [c["name"] for c in w["simulated"]], key  # the ranking
        for a, b in zip(g["simulated"], w["simulated"]):
            assert a == b, (key, a["name"])  # every number, bit for bit (JSON keeps a float's repr)
        assert g["estimated"] == w["estimated"], key


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.planner.test_real_cluster_plan --record")
    RECORDED.write_text(json.dumps(summary(), indent=0) + "\n", encoding="utf-8")
    print(f"wrote {RECORDED}")
