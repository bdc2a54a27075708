"""The cluster file: a `ClusterSpec` as JSON (what `tools/calibrate_cluster.py` writes and
`tools/plan_layout.py --cluster` / `--auto-layout-cluster` read). Pure: no torch, no model — the
measurements that fill it are in `calibration.py`.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from .costs import ClusterSpec

__all__ = ["CLUSTER_FORMAT", "load_cluster", "cluster_from_json", "cluster_to_json", "read_cluster_json"]

CLUSTER_FORMAT = "megareshard-cluster/1"
_FIELDS = tuple(f.name for f in dataclasses.fields(ClusterSpec))


def cluster_to_json(cluster: ClusterSpec, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"format": CLUSTER_FORMAT, **dataclasses.asdict(cluster), "measured": measured or {}}


def load_cluster(path: str, hosts: int | None = None, devices_per_host: int | None = None) -> ClusterSpec:
    """The `ClusterSpec` of a cluster JSON; `hosts` / `devices_per_host` (the launch's) replace the file's;
    fields the file lacks (older files: the latency terms) keep `ClusterSpec`'s defaults.

    Keys other than `ClusterSpec`'s are left alone: ``measured`` (the raw timings) and what others keep beside the
    cluster — the lab's ``lab`` section (its emulated cluster's shared cores, which older files held at the top
    level: ``shared_cores``, ``cpu_s_per_*``, ...). The product plans a real cluster: it reads none of them.

    Raises ValueError (one line, the file and the field) on a missing file, another format or a value that
    is not a positive number."""
    return cluster_from_json(read_cluster_json(path), path, hosts, devices_per_host)


def read_cluster_json(path: str) -> dict[str, Any]:
    """The JSON of a cluster file; ValueError (one line, the file) if it cannot be read or is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cluster file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"cluster file {path}: not JSON ({e.msg} at line {e.lineno})") from None


def cluster_from_json(data: Any, path: str, hosts: int | None = None,
                      devices_per_host: int | None = None) -> ClusterSpec:
    """`load_cluster` of a cluster JSON already read (`path` names where it came from in the errors)."""
    if not isinstance(data, dict) or data.get("format") != CLUSTER_FORMAT:
        raise ValueError(f"cluster file {path}: expected \"format\": \"{CLUSTER_FORMAT}\" (written by "
                         "tools/calibrate_cluster.py)")
    kw = {k: data[k] for k in _FIELDS if k in data}
    if hosts is not None:
        kw["hosts"] = hosts
    if devices_per_host is not None:
        kw["devices_per_host"] = devices_per_host
    if "wgrad_fraction" in kw:
        share = kw["wgrad_fraction"]
        if share is None:
            del kw["wgrad_fraction"]  # not calibrated: the FLOP share
        elif not (isinstance(share, (int, float)) and 0 <= share <= 1):
            raise ValueError(f"cluster file {path}: wgrad_fraction = {share!r} is not a share in [0, 1]")
    for k, v in kw.items():
        zero_ok = k in ("memory_reserve", "optimizer_s_per_param", "grad_pass_s_per_param", "intra_latency_s",
                        "nic_latency_s", "collective_latency_s", "action_overhead_s", "send_post_s", "recv_post_s",
                        "layer_overhead_s", "wgrad_fraction")
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if zero_ok else v > 0)
        if not ok:
            raise ValueError(f"cluster file {path}: {k} = {v!r} is not a positive number")
    missing = [k for k in ("hosts", "devices_per_host") if k not in kw]
    if missing:
        raise ValueError(f"cluster file {path}: missing {', '.join(missing)}")
    return ClusterSpec(**kw)
