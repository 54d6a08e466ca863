"""Dependency-free SVG line plots of throughput against sequence length (log axes, one panel
per configuration space), for ``metp plan --frontier``'s reports. Every plot is titled
ESTIMATE: the values come from the timeline model, not from a GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from megatron_metp.measure.planner import seq_label

COLOURS = {"stock": "#1f77b4", "metp": "#d62728", "wallfacer": "#2ca02c"}


@dataclass
class Line:
    label: str
    colour: str
    points: Sequence[Tuple[int, float]]   # (s, value), s ascending
    dash: str = ""                        # an SVG stroke-dasharray; "" draws it solid


@dataclass
class Panel:
    title: str
    lines: List[Line]


def write(path: str, heading: str, panels: List[Panel], y_label: str, cols: int = 2) -> None:
    """Panels of lines, ``cols`` to a row; each line ends in a dot at its last point and is
    labelled with the length it reaches."""
    W, H, m = 380, 260, 55
    cols = min(len(panels), cols) or 1
    nrows = -(-len(panels) // cols)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * cols}" '
             f'height="{H * nrows + 40}" font-family="sans-serif" font-size="11">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="10" y="18" font-size="14">{heading}</text>']
    for n, panel in enumerate(panels):
        parts += _panel(panel, (n % cols) * W + m, (n // cols) * H + 50, W - m - 20, H - 75,
                        y_label)
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def _panel(panel: Panel, x0: float, y0: float, pw: float, ph: float, y_label: str
           ) -> List[str]:
    lines = [ln for ln in panel.lines if ln.points]
    seqs = [s for ln in lines for s, _ in ln.points]
    vals = [v for ln in lines for _, v in ln.points]
    out = [f'<text x="{x0}" y="{y0 - 6}">{panel.title}</text>',
           f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    if not lines:
        return out
    sx0, sx1 = math.log2(min(seqs)), math.log2(max(seqs))
    ty0, ty1 = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
    ty1 += ty1 == ty0
    xs = lambda s: x0 + pw * (math.log2(s) - sx0) / ((sx1 - sx0) or 1)  # noqa: E731
    ys = lambda v: y0 + ph * (1 - (math.log10(v) - ty0) / (ty1 - ty0))  # noqa: E731
    for e in range(ty0, ty1 + 1):
        out.append(f'<text x="{x0 - 45}" y="{ys(10 ** e) + 4:.1f}">1e{e}</text>')
    for k in range(math.ceil(sx0), int(sx1) + 1, 2):
        out.append(f'<text x="{xs(2 ** k) - 10:.1f}" y="{y0 + ph + 14}">{seq_label(2 ** k)}'
                   f'</text>')
    out.append(f'<text x="{x0 + pw / 2 - 60}" y="{y0 + ph + 30}">sequence length s (log)</text>')
    for j, ln in enumerate(lines):
        d = " ".join(f"{xs(s):.1f},{ys(v):.1f}" for s, v in ln.points)
        dash = f' stroke-dasharray="{ln.dash}"' if ln.dash else ""
        out.append(f'<polyline points="{d}" fill="none" stroke="{ln.colour}" stroke-width="2"'
                   f'{dash}/>')
        s, v = ln.points[-1]
        out.append(f'<circle cx="{xs(s):.1f}" cy="{ys(v):.1f}" r="3.5" fill="{ln.colour}"/>')
        out.append(f'<text x="{x0 + pw - 130}" y="{y0 + 14 + 13 * j}" fill="{ln.colour}">'
                   f'{ln.label} (to {seq_label(s)})</text>')
    out.append(f'<text x="{x0 + 4}" y="{y0 + ph - 6}" fill="#555">{y_label}</text>')
    return out


__all__ = ["Line", "Panel", "write", "COLOURS"]
