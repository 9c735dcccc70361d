"""The pieces of the PNGs (matplotlib, no display): figures, grouped bars, saving."""

from __future__ import annotations

from pathlib import Path

from harness.tables import fmt


def figure(ncols: int = 1, size: tuple[float, float] = (8, 4.8), **kw: object):
    """A figure of ``ncols`` axes side by side: ``(fig, [ax, ...])``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False, **kw)
    return fig, list(axes[0])


def bars(ax, groups: list[str], series: dict[str, list[float | None]], *, spec: str = ".2f",
         ceilings: dict[int, tuple[float, str]] | None = None, log: bool = False,
         ylabel: str = "") -> None:
    """A group of bars per ``groups`` entry, a bar per series in each, labelled with its figure;
    ``ceilings`` maps a group's index to a dashed line (value, label) over it."""
    import matplotlib.ticker

    width = 0.8 / max(1, len(series))
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        drawn = ax.bar(xs, [y or 0 for y in ys], width, label=name)
        ax.bar_label(drawn, labels=[fmt(y, spec) for y in ys], fontsize=7,
                     rotation=90 if len(series) > 2 else 0)
    for j, (value, text) in (ceilings or {}).items():
        if value:
            ax.hlines(value, j - 0.45, j + 0.45, colors="k", linestyles="--")
            ax.annotate(text, (j, value), fontsize=7, ha="center", va="bottom")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylabel(ylabel)
    if len(series) > 2:  # below the axes, clear of the bars
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    else:
        ax.legend(fontsize=7)


def save(fig, png: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
