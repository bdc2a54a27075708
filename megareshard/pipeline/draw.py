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

__all__ = ["COLORS", "COMM_COLORS", "KIND_LABELS", "draw", "figure", "fit_text", "format_table"]

COLORS = MappingProxyType({"F": "#6fa8dc", "B": "#93c47d", "I": "#b6d7a8", "W": "#f6b26b"})
COMM_COLORS = MappingProxyType({"F": "#3d85c6", "B": "#38761d"})
KIND_LABELS = MappingProxyType({"F": "F forward", "B": "B backward", "I": "I input-grad", "W": "W weight-grad"})
COMM_LABELS = MappingProxyType({"F": "send activation", "B": "send gradient"})


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


def fit_text(fig, artist, text: str, min_chars: int = 20) -> None:
    """Wrap ``text`` into ``artist`` (a title) at the widest line length that keeps it inside the figure.
    Call after the layout is final; re-run the layout afterwards if the wrapped text grew taller."""
    import textwrap

    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    width = max(len(line) for line in text.splitlines() or [""])
    while True:
        artist.set_text("\n".join(textwrap.fill(line, width) for line in text.splitlines()))
        ext = artist.get_window_extent(renderer)
        if (ext.x0 >= box.x0 and ext.x1 <= box.x1) or width <= min_chars:
            return
        width -= max(1, width // 20)


def kinds_drawn(timelines: Sequence[Timeline]) -> tuple[list[str], list[str]]:
    """The compute kinds (F, B, I, W) and transfer directions (F, B) that the timelines hold, in legend order."""
    kinds = {iv.action.kind.value for tl in timelines for row in tl.compute for iv in row}
    comm = {c.direction for tl in timelines for c in tl.comm}
    return [k for k in KIND_LABELS if k in kinds], [d for d in COMM_LABELS if d in comm]


def figure(timelines: Sequence[Timeline], comm_cost: float, unit: str = "cost units"):
    """The timelines' figure (matplotlib, Agg): one panel per timeline, a legend of the kinds drawn only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(t.makespan for t in timelines) or 1.0
    n_rows = sum(t.num_stages for t in timelines)
    fig_w = min(24.0, max(8.0, 0.35 * span + 2))
    titles = [title(tl, unit, 10 ** 6) for tl in timelines]  # one line each; fit_text wraps them below
    fig, axes = plt.subplots(len(timelines), 1, squeeze=False, sharex=True,
                             figsize=(fig_w, 1.0 + 0.55 * n_rows + 0.5 * len(timelines)))
    title_artists = []
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
        title_artists.append(ax.set_title(text, fontsize=9, loc="left"))
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlim(0, span * 1.01)
    axes[-1, 0].set_xlabel(f"time ({unit}" + (f"; a transfer takes {comm_cost:g}" if comm_cost else "") + ")")
    kinds, comm = kinds_drawn(timelines)  # the legend names only what the picture draws
    handles = [Patch(facecolor=COLORS[k], edgecolor="black", label=KIND_LABELS[k]) for k in kinds]
    handles += [Patch(facecolor=COMM_COLORS[d], label=COMM_LABELS[d]) for d in comm]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    rect = (0, 0.06 if len(timelines) > 1 else 0.1, 1, 1)
    height = fig.get_figheight()
    fig.tight_layout(rect=rect)
    for _ in range(3):  # wrap each title to the figure's width; taller titles grow the figure, lay out again
        before = [t.get_text() for t in title_artists]
        for artist, text in zip(title_artists, titles):
            fit_text(fig, artist, text)
        fig.set_figheight(height + 0.2 * sum(t.get_text().count("\n") for t in title_artists))
        fig.tight_layout(rect=rect)
        if [t.get_text() for t in title_artists] == before:
            break
    return fig


def draw(timelines: Sequence[Timeline], path: Path, comm_cost: float, unit: str = "cost units") -> None:
    import matplotlib.pyplot as plt

    fig = figure(timelines, comm_cost, unit)
    fig.savefig(path, dpi=110)
    plt.close(fig)
