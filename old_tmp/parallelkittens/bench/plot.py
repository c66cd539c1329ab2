"""One line plot per benchmark result, as a PNG, when matplotlib is installed (it is not a dependency)."""

from __future__ import annotations


def line_plot(path: str, title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]]) -> bool:
    """Draw each non-empty series of (x, y) points against a log2 x axis into `path`; returns whether it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
