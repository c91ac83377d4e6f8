"""A dependency-free SVG line plot of empirical CDFs, for the benchmarks."""

from __future__ import annotations

from html import escape

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def cdf_plot(series: dict[str, list[float]], title: str, unit: str, width: int = 640, height: int = 400) -> str:
    """One CDF line per series on shared axes."""
    left, right, top, bottom = 60, 20, 40, 50
    xs = [x for v in series.values() for x in v] or [0.0, 1.0]
    xmax = max(xs) * 1.05 or 1.0
    pw, ph = width - left - right, height - top - bottom

    def px(x: float, y: float) -> str:
        return f"{left + pw * x / xmax:.1f},{top + ph * (1 - y):.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<polyline fill="none" stroke="black" points="{px(0, 1)} {px(0, 0)} {px(xmax, 0)}"/>']  # fmt: skip
    for i in range(6):
        x = xmax * i / 5
        parts.append(f'<text x="{left + pw * i / 5:.1f}" y="{top + ph + 18}" text-anchor="middle">{x:.0f}</text>')
        parts.append(f'<text x="{left - 8}" y="{top + ph * (1 - i / 5) + 4:.1f}" text-anchor="end">{i / 5:.1f}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle">{escape(unit)}</text>')
    for k, (label, values) in enumerate(series.items()):
        v = sorted(values)
        pts = " ".join(px(x, (j + 1) / len(v)) for j, x in enumerate(v))
        color = _COLORS[k % len(_COLORS)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
        parts.append(f'<text x="{left + 10}" y="{top + 16 * (k + 1)}" fill="{color}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
