"""Pictures of what int8 costs: the figures of :meth:`Report.plot`, the MiniLM example and ``benchmarks/speed.py``.

matplotlib is an optional dependency (``pip install -e '.[plot]'``, included in ``examples``); it is imported when
a figure is made, and its absence is one clear error. Figures are drawn with the non-interactive ``Agg`` backend
unless another one is already selected, so they work on machines without a display.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Sequence

from .._core.errors import Int8ifyError

__all__ = ["COLORS", "bar_chart", "new_figure", "save"]

# One colour per decision, the same in every figure.
COLORS = {"rewritten": "#3b6fb6", "kept": "#e08a2c", "not measured": "#b0b0b0"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise Int8ifyError(
            "plotting needs matplotlib, an optional dependency: pip install -e '.[plot]' (or pip install matplotlib)"
        ) from None
    if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg", "ps", "cairo") and not _has_display():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.name == "nt")


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 10.0, height: float = 4.0):
    """``(figure, axes)`` for ``nrows x ncols`` panels (``axes`` a flat list)."""
    plt = _pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False)
    return fig, [ax for row in axes for ax in row]


def bar_chart(ax, labels: Sequence[str], values: Sequence[float], colors: Sequence[str] | None = None, *,
              log: bool = False, title: str | None = None, ylabel: str | None = None,
              legend: dict[str, str] | None = None) -> None:
    """One bar per value, in order, labelled below (rotated when there are many).

    Arguments:
        ax: the matplotlib axes.
        labels, values: one label and one height per bar (a ``None`` or NaN value draws an empty slot, an
            infinite one a full-height bar labelled "inf").
        colors: one colour per bar (default: the "rewritten" colour).
        log: a logarithmic value axis (errors span decades).
        title, ylabel: texts.
        legend: ``{label: colour}`` entries for a legend.
    """
    heights = [0.0 if v is None or v != v else float(v) for v in values]
    colors = list(colors) if colors is not None else [COLORS["rewritten"]] * len(heights)
    positions = list(range(len(heights)))
    finite = [h for h in heights if 0 < h < math.inf]
    # an infinite value (an error measured on inputs holding inf or NaN) is drawn up to the top, labelled "inf"
    top = max(finite, default=1.0)
    if log:  # whole decades (at least one), so bar lengths compare honestly
        bottom = 10.0 ** math.floor(math.log10(min(finite, default=top)))
        top = max(10.0 ** math.ceil(math.log10(top)), 10 * bottom)
    infinite = [i for i, h in enumerate(heights) if h == math.inf]
    heights = [top if i in infinite else h for i, h in enumerate(heights)]
    ax.bar(positions, heights, color=colors)
    ax.set_xticks(positions)
    ax.set_xticklabels(labels, rotation=90 if len(labels) > 8 else 0, fontsize=7 if len(labels) > 8 else 9)
    if log and (finite or infinite):
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
    for i in infinite:
        ax.text(i, top, "inf", ha="center", va="top", fontsize=7, color="white", clip_on=True)
    if title:
        width = ax.figure.get_figwidth()
        ax.set_title("\n".join(textwrap.wrap(title, int(width * 12))), fontsize=9)
    if ylabel:
        ax.set_ylabel(ylabel)
    if legend:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=c, label=name) for name, c in legend.items()], fontsize=8)


def save(fig, path) -> Path:
    """Write ``fig`` to ``path`` (PNG, SVG or PDF by its suffix), creating its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
