"""Clean tick labels on logarithmic axes.

plotly labels a log axis at every power of ten plus small "2" and "5" marks in between,
which reads as clutter on the budgets, token counts and times the study plots.
:func:`log_ticks` chooses round tick values instead - powers of two (1, 2, 4, 8, ...) for
counts, powers of ten (1, 10, 100, ...) for wide ranges, 1-2-5 steps (0.05, 0.1, 0.2, 0.5)
for narrow ranges below one - and :func:`tidy_log_axes` puts them on every log axis of a
figure, facets included::

    fig = px.line(table, x="budget", y="tau", color="strategy", log_x=True)
    tidy_log_axes(fig)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["log_ticks", "tidy_log_axes"]


def _label(value: float) -> str:
    if value >= 1 and float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.6g}"


def _thin(values: list[float], max_ticks: int) -> list[float]:
    step = max(1, math.ceil(len(values) / max_ticks))
    return values[::step]


def log_ticks(lo: float, hi: float, max_ticks: int = 8) -> tuple[list[float], list[str]]:
    """Round tick values and their labels for a log axis showing ``[lo, hi]``.

    * ``lo >= 1`` and at most ``2 * max_ticks`` doublings: powers of two (every second or
      third one when there would be more than ``max_ticks``);
    * otherwise, a range of at least two decades: powers of ten (thinned the same way);
    * otherwise: 1-2-5 steps (..., 0.1, 0.2, 0.5, 1, 2, 5, ...).

    Only ticks inside ``[lo, hi]`` are returned. A range too narrow for two ticks of
    these sequences gets evenly spaced round values (1.5, 2, 2.5, 3) instead.

    Args:
        lo, hi: the smallest and largest positive value on the axis.
        max_ticks: the most ticks to return (>= 2).

    Returns:
        ``(tickvals, ticktext)``: labels are plain numbers ("1", "16", "1,024", "0.05").

    Raises:
        ValueError: ``lo`` or ``hi`` not finite and positive, ``lo > hi``, or
            ``max_ticks`` < 2.
    """
    if isinstance(max_ticks, bool) or not isinstance(max_ticks, int) or max_ticks < 2:
        raise ValueError(f"max_ticks must be an int >= 2, got {max_ticks!r}")
    for name, v in (("lo", lo), ("hi", hi)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0 (a log axis), got {v!r}")
    if lo > hi:
        raise ValueError(f"lo must be <= hi, got lo={lo} > hi={hi}")
    eps = 1e-9
    inside = lambda vs: [v for v in vs if lo * (1 - eps) <= v <= hi * (1 + eps)]  # noqa: E731
    if lo >= 1 - eps and math.log2(hi / lo) <= 2 * max_ticks:
        first, last = math.floor(math.log2(lo) + eps), math.ceil(math.log2(hi) - eps)
        values = inside([2.0 ** k for k in range(first, last + 1)])
    elif math.log10(hi / lo) >= 2:
        first, last = math.floor(math.log10(lo) + eps), math.ceil(math.log10(hi) - eps)
        values = inside([10.0 ** k for k in range(first, last + 1)])
    else:
        first, last = math.floor(math.log10(lo) + eps), math.ceil(math.log10(hi) - eps)
        values = inside([float(f"{m * 10.0 ** k:.12g}") for k in range(first, last + 1) for m in (1, 2, 5)])
    if len(values) < 2 and hi > lo * (1 + eps):
        # a narrow range (less than one step of the sequences above): evenly spaced round
        # values, the step 1, 2 or 5 times a power of ten
        for k in range(math.floor(math.log10(hi - lo)) + 1, math.floor(math.log10(hi - lo)) - 3, -1):
            for m in (5, 2, 1):
                step = m * 10.0 ** k
                grid = [float(f"{j * step:.12g}") for j in range(math.ceil(lo / step - eps),
                                                                   math.floor(hi / step + eps) + 1)]
                if len(grid) >= 3:
                    break
            if len(grid) >= 3:
                values = grid
                break
    if not values:  # a single value
        values = [lo]
    values = _thin(values, max_ticks)
    values = [float(f"{v:.12g}") for v in values]
    return values, [_label(v) for v in values]


def _positive(values: Iterable) -> list[float]:
    out = []
    for v in values if values is not None else ():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f) and f > 0:
            out.append(f)
    return out


def tidy_log_axes(fig: "go.Figure", max_ticks: int = 8) -> "go.Figure":
    """Put :func:`log_ticks` on every logarithmic axis of ``fig`` (in place) and return it.

    All log x axes (and all log y axes) of a faceted figure share one set of ticks, from
    the positive values of every trace drawn on them, so facets read alike. Axes without
    positive data are left as they are.

    Raises:
        ValueError: ``max_ticks`` < 2.
    """
    if isinstance(max_ticks, bool) or not isinstance(max_ticks, int) or max_ticks < 2:
        raise ValueError(f"max_ticks must be an int >= 2, got {max_ticks!r}")
    for letter in ("x", "y"):
        axes = {name: axis for name, axis in fig.layout.to_plotly_json().items()
                if name.startswith(f"{letter}axis") and isinstance(axis, dict) and axis.get("type") == "log"}
        if not axes:
            continue
        ids = {letter + name[len(letter) + 4:] for name in axes}  # "xaxis2" -> "x2", "xaxis" -> "x"
        data: list[float] = []
        for trace in fig.data:
            if letter not in trace or (getattr(trace, f"{letter}axis", None) or letter) not in ids:
                continue
            data += _positive(trace[letter])
        if not data:
            continue
        values, labels = log_ticks(min(data), max(data), max_ticks)
        fig.update_layout({name: dict(tickmode="array", tickvals=values, ticktext=labels,
                                      minor=dict(showgrid=False, ticks="")) for name in axes})
    return fig
