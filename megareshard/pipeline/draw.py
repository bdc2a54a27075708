"""Draw pipeline timelines (simulated or measured) as a PNG, paper Figure 4 style, and tabulate them.

One row per mesh (mesh 0 on top), coloured F/B/I/W boxes labelled with the microbatch (a mesh's later
virtual stages hatched), the mesh's outgoing transfers as thin bars under its row. Matplotlib is imported
only when drawing (extras: plots/test), so the schedule IR stays importable without it.
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Sequence

from .simulate import Timeline

__all__ = ["COLORS", "COMM_COLORS", "draw", "format_table"]

COLORS = MappingProxyType({"F": "#6fa8dc", "B": "#93c47d", "I": "#b6d7a8", "W": "#f6b26b"})
COMM_COLORS = MappingProxyType({"F": "#3d85c6", "B": "#38761d"})


def format_table(timelines: Sequence[Timeline], unit: str = "cost units") -> str:
    rows = [("schedule", f"makespan ({unit})", "bubble", "peak activations per stage")]
    rows += [(t.name, f"{t.makespan:g}", f"{t.bubble_fraction:.3f}",
              " ".join(map(str, t.peak_activations))) for t in timelines]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def title(tl: Timeline, unit: str, width_chars: int) -> str:
    """The panel's title, wrapped to ``width_chars`` (the figure's width at the title's font size)."""
    import textwrap

    text = (f"{tl.name}: makespan {tl.makespan:.4g} {unit.split(',')[0]}, bubble {tl.bubble_fraction:.1%}, peak "
            f"activations per stage {' '.join(map(str, tl.peak_activations))}")
    return "\n".join(textwrap.wrap(text, max(width_chars, 20)))


def draw(timelines: Sequence[Timeline], path: Path, comm_cost: float, unit: str = "cost units") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(t.makespan for t in timelines) or 1.0
    n_rows = sum(t.num_stages for t in timelines)
    fig_w = min(24.0, max(8.0, 0.35 * span + 2))
    titles = [title(tl, unit, int(fig_w * 72 / (9 * 0.55))) for tl in timelines]  # 9 pt, ~0.55 em per char
    extra = sum(t.count("\n") for t in titles)
    fig, axes = plt.subplots(len(timelines), 1, squeeze=False, sharex=True,
                             figsize=(fig_w, 1.0 + 0.55 * n_rows + 0.5 * len(timelines) + 0.2 * extra))
    for ax, tl, text in zip(axes[:, 0], timelines, titles):
        P = tl.num_stages
        row_stages = [sorted({iv.action.stage for iv in row}) for row in tl.compute]
        for s, row in enumerate(tl.compute):
            y = P - 1 - s
            for iv in row:
                k = iv.action.kind.value
                w = iv.end - iv.start
                chunk = row_stages[s].index(iv.action.stage)  # virtual stages: later chunks hatched
                ax.add_patch(plt.Rectangle((iv.start, y + 0.22), w, 0.66, facecolor=COLORS[k],
                                           edgecolor="black", linewidth=0.6, hatch=("", "//", "..", "xx")[chunk % 4]))
                if w >= 0.02 * span or w >= 0.4:
                    label = f"{iv.action.mb}" if k in "FB" else f"{k}{iv.action.mb}"
                    ax.text(iv.start + w / 2, y + 0.55, label, ha="center", va="center",
                            fontsize=7 if len(label) > 1 else 8)
        for c in tl.comm:
            y = P - 1 - c.sender
            lane = 0.02 if c.direction == "F" else 0.12
            ax.add_patch(plt.Rectangle((c.start, y + lane), max(c.end - c.start, 1e-3), 0.08,
                                       facecolor=COMM_COLORS[c.direction], edgecolor="white",
                                       linewidth=0.5))
        ax.set_ylim(-0.1, P)
        ax.set_yticks([P - 1 - s + 0.55 for s in range(P)])
        ax.set_yticklabels([f"stage {s}" if row_stages[s] in ([s], []) else
                            f"mesh {s} ({','.join(map(str, row_stages[s]))})" for s in range(P)])
        ax.set_title(text, fontsize=9, loc="left")
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlim(0, span * 1.01)
    axes[-1, 0].set_xlabel(f"time ({unit}" + (f"; a transfer takes {comm_cost:g}" if comm_cost else "") + ")")
    handles = [Patch(facecolor=COLORS[k], edgecolor="black", label=lbl) for k, lbl in
               [("F", "F forward"), ("B", "B backward"), ("I", "I input-grad"), ("W", "W weight-grad")]]
    handles += [Patch(facecolor=COMM_COLORS["F"], label="send activation"),
                Patch(facecolor=COMM_COLORS["B"], label="send gradient")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(timelines) > 1 else 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
