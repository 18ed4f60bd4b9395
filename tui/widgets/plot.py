"""A small text plot with axes: points (or bars) on a grid, y ticks at 0, half and the maximum,
x labels at both ends. Pure string building, so a snapshot sees exactly what a terminal sees."""

from __future__ import annotations


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def plot(points: list[tuple[float, float]], width: int, height: int, x_title: str, y_title: str,
         bars: bool = False) -> str:
    """`points` as (x, y) with y >= 0; `bars` fills each column from the axis up to its point."""
    if not points:
        return f"{y_title}\n(no turns yet)\n{x_title}"
    width, height = max(width - 9, 8), max(height - 3, 3)  # room for the y labels and the x axis
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, top = min(xs), max(xs), max(max(ys), 1e-9)
    grid = [[" "] * width for _ in range(height)]
    for x, y in points:
        col = 0 if x1 == x0 else round((x - x0) / (x1 - x0) * (width - 1))
        row = height - 1 - min(height - 1, round(y / top * (height - 1)))
        if bars:
            for r in range(row, height):
                grid[r][col] = "█"
        else:
            grid[row][col] = "●"
    ticks = {0: _fmt(top), (height - 1) // 2: _fmt(top / 2), height - 1: "0"}
    lines = [y_title]
    lines += [f"{ticks.get(r, ''):>7} ┤" + "".join(grid[r]) for r in range(height)]
    lines.append(" " * 8 + "└" + "─" * width)
    left, right = _fmt(x0), _fmt(x1)
    lines.append(" " * 9 + left + " " * max(1, width - len(left) - len(right)) + right)
    lines.append(" " * 9 + x_title)
    return "\n".join(lines)
