"""The planner's outputs: a ranked Markdown table and a picture of a layout on the cluster."""
from __future__ import annotations

from typing import Sequence

from .costs import ClusterSpec
from .search import Candidate

__all__ = ["table", "draw_layout"]


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def table(rows: Sequence[Candidate], cluster: ClusterSpec) -> str:
    """Markdown: one row per candidate, best first."""
    head = ("| # | layout | step s | tokens/s | bubble | max GiB/device | tp GB/device | pp GB/NIC | dp GB/NIC "
            "| bottleneck |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    groups: list[list[Candidate]] = []
    for c in rows:  # strategies that predict the same step and memory share a row
        g = groups[-1] if groups else None
        if g and (c.name.replace(c.strategy, "") == g[0].name.replace(g[0].strategy, "")
                  and c.step_s == g[0].step_s and c.memory_gib == g[0].memory_gib):
            g.append(c)
        else:
            groups.append([c])
    for i, g in enumerate(groups, 1):
        c = g[0]
        name = c.name.replace(c.strategy, "|".join(x.strategy for x in g)) if len(g) > 1 else c.name
        scored = "" if c.breakdown else " (est.)"
        if not c.runtime:
            name += " (simulated only)"
        out.append(f"| {i} | {name} | {c.step_s:.3f}{scored} | {c.tokens_per_s:,.0f} | {c.bubble:.2f} | "
                   f"{max(c.memory_gib):.1f} / {cluster.memory_bytes / 2**30:.0f} | {_gb(c.tp_bytes)} | "
                   f"{_gb(c.pp_nic_bytes)} | {_gb(c.dp_nic_bytes)} | {c.bottleneck or '—'} |")
    return "\n".join(out)


def draw_layout(c: Candidate, cluster: ClusterSpec, path: str) -> None:
    """Hosts as rows of device boxes, each coloured by its pipeline stage and labelled tp/dp (two hosts
    per stage drawn, the rest counted); an arrow per stage boundary (a cross-mesh resharding edge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..parallel import Topology
    from ..parallel.stage_topology import StageTopology
    from ..pipeline.draw import fit_text

    if c.stage_layouts:  # per-stage meshes: contiguous rank blocks, tp innermost
        topo = StageTopology(cluster.world, c.stage_layouts, nproc_per_node=cluster.devices_per_host)
    else:
        topo = Topology(cluster.world, tp=c.tp, pp=c.pp, nproc_per_node=cluster.devices_per_host,
                        order=tuple(c.order.split("-")))
    H, D = cluster.hosts, cluster.devices_per_host
    by_stage: dict[int, list[int]] = {}
    for h in range(H):  # the hosts of each stage; at most two drawn per stage, the rest summarised
        for s in sorted({topo.coords(h * D + d).pp for d in range(D)}):
            by_stage.setdefault(s, []).append(h)
    rows: list[tuple[int | None, str]] = []
    for s in range(c.pp):
        hs = by_stage.get(s, [])
        for h in hs[:2]:
            if not rows or rows[-1][0] != h:
                rows.append((h, f"host {h}"))
        if len(hs) > 2:
            rows.append((None, f"… {len(hs) - 2} more hosts of stage {s}"))
    n = len(rows)
    fig, ax = plt.subplots(figsize=(max(6, D * 0.9 + 2), max(3, n * 0.45 + 1)))
    cmap = plt.get_cmap("tab20")
    stage_y: dict[int, list[float]] = {}
    for i, (h, _) in enumerate(rows):
        y = n - 1 - i
        if h is None:
            continue
        for d in range(D):
            co = topo.coords(h * D + d)
            stage_y.setdefault(co.pp, []).append(y + 0.4)
            ax.add_patch(plt.Rectangle((d, y), 0.9, 0.8, color=cmap(co.pp % 20), alpha=0.85))
            ax.text(d + 0.45, y + 0.4, f"s{co.pp}\nt{co.tp} d{co.dp}", ha="center", va="center", fontsize=6)
    for s in range(c.pp - 1):  # stage boundaries: cross-mesh resharding edges
        if s in stage_y and s + 1 in stage_y:
            ax.annotate("", xy=(D + 0.3, max(stage_y[s + 1])), xytext=(D + 0.3, min(stage_y[s])),
                        arrowprops=dict(arrowstyle="->", color="black", lw=1))
            ax.text(D + 0.4, (min(stage_y[s]) + max(stage_y[s + 1])) / 2, f"{s}→{s + 1}\n{c.strategy}",
                    fontsize=6, va="center")
    ax.set_xlim(-0.2, D + 1.6)
    ax.set_ylim(-0.2, n)
    ax.set_yticks([n - 1 - i + 0.4 for i in range(n)], [label for _, label in rows], fontsize=7)
    ax.set_xticks([])
    ax.set_xlabel("device of the host (box: s pipeline stage, t tensor-parallel rank, d data-parallel rank)",
                  fontsize=7)
    text = f"{c.name}: {c.step_s:.3f} s per step (predicted) on {H} hosts × {D} devices"
    title = ax.set_title(text, fontsize=9)
    fig.tight_layout()
    for _ in range(3):  # wrap the title to the figure's width (measured, not guessed), then lay out again
        before = title.get_text()
        fit_text(fig, title, text)
        fig.tight_layout()
        if title.get_text() == before:
            break
    fig.savefig(path, dpi=110)
    plt.close(fig)
