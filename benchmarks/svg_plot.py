"""A dependency-free SVG line plot of empirical CDFs, for the benchmarks."""

from __future__ import annotations

from html import escape

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def line_plot(
    series: dict[str, list[tuple[float, float]]],
    title: str,
    x_unit: str,
    y_unit: str,
    width: int = 640,
    height: int = 400,
    y_max: float | None = None,
    legend_right: int = 0,
) -> str:
    """One line per series on shared axes from 0; the legend inside the plot,
    or in a margin of legend_right pixels at its right."""
    left, right, top, bottom = 60, 20 + legend_right, 40, 50
    pts = [pt for v in series.values() for pt in v] or [(1.0, 1.0)]
    xmax = max(x for x, _ in pts) * 1.05 or 1.0
    ymax = y_max or max(y for _, y in pts) * 1.05 or 1.0
    pw, ph = width - left - right, height - top - bottom

    def px(x: float, y: float) -> str:
        return f"{left + pw * x / xmax:.1f},{top + ph * (1 - y / ymax):.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left + pw / 2:.0f}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<polyline fill="none" stroke="black" points="{px(0, ymax)} {px(0, 0)} {px(xmax, 0)}"/>',
    ]
    for i in range(6):
        parts.append(
            f'<text x="{left + pw * i / 5:.1f}" y="{top + ph + 18}" text-anchor="middle">{xmax * i / 5:.0f}</text>'
        )
        label = f"{ymax * i / 5:.1f}" if ymax < 10 else f"{ymax * i / 5:.0f}"
        parts.append(f'<text x="{left - 8}" y="{top + ph * (1 - i / 5) + 4:.1f}" text-anchor="end">{label}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle">{escape(x_unit)}</text>')
    if y_unit:
        parts.append(
            f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" '
            f'text-anchor="middle">{escape(y_unit)}</text>'
        )
    for k, (label, values) in enumerate(series.items()):
        color = _COLORS[k % len(_COLORS)] if k < 2 * len(_COLORS) else "#999999"
        line = " ".join(px(x, y) for x, y in values)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="{2 if k < 5 else 1}" points="{line}"/>')
        if k < 20:
            x = left + pw + 8 if legend_right else left + 10
            parts.append(f'<text x="{x}" y="{top + 16 * (k + 1)}" fill="{color}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def cdf_plot(series: dict[str, list[float]], title: str, unit: str, width: int = 640, height: int = 400) -> str:
    """One CDF line per series on shared axes."""
    cdfs = {label: [(x, (j + 1) / len(v)) for j, x in enumerate(sorted(v))] for label, v in series.items()}
    return line_plot(cdfs, title, unit, "", width, height, y_max=1.0)
