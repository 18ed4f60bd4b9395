"""A PNG of client-side TTFT per turn, one line per server (matplotlib, the `bench` extra).

    series: {label: [ttft seconds per turn, ...]}; `marks`: turn indexes to shade (the strip turns).
"""

from __future__ import annotations

from pathlib import Path


def write_chart(path: Path, title: str, series: dict[str, list[float | None]], marks: list[int] = ()) -> Path | None:
    """Write the chart; None (with the reason printed) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: render straight to a file
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no chart: matplotlib is not installed (pip install -e '.[bench]'); skipped {path}")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for label, values in series.items():
        turns = [i + 1 for i, v in enumerate(values) if v is not None]
        ax.plot(turns, [v for v in values if v is not None], marker="o", label=label)
    for i in marks:
        ax.axvspan(i + 0.5, i + 1.5, color="0.9", zorder=0)
    ax.set_xlabel("turn (shaded: new user message after a tool chain)")
    ax.set_ylabel("TTFT, client-side (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
