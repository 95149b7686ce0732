"""Pictures of whole generations: the text coloured by the step that committed each token,
the accepted length of every step, and the generation's numbers as small HTML tables.

Dimension legend: L = committed tokens of one generation.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from specviz.render.text import MONO_FONT, escape_token, figure_title, plot_text, token_text

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from specviz.decode.records import GenerationResult

__all__ = [
    "CommittedToken",
    "committed_tokens",
    "representative_step",
    "step_view_figure",
    "composite_parts",
    "drafting_parts",
    "drafter_strip_figure",
    "stats_html",
    "figure_mimebundle",
]

# Step colours of the step view: Okabe-Ito, so neighbouring steps always differ.
_STEP_COLORS = ("#56B4E9", "#E69F00", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")


@dataclass(frozen=True)
class CommittedToken:
    """One generated token and the step that committed it.

    Attributes:
        position: index in the generated output.
        token: token id.
        step: index into ``GenerationResult.steps``.
        kind: ``"drafted"`` (an accepted draft token) or ``"bonus"`` (added by the target).
    """

    position: int
    token: int
    step: int
    kind: str


def committed_tokens(result: "GenerationResult") -> tuple[CommittedToken, ...]:
    """Attribute every output token to the step that committed it.

    Steps commit their accepted draft tokens followed by the bonus token; the output may
    end early (a stop token or ``max_new_tokens``), so the walk stops at its length.

    Raises:
        ValueError: if a step's committed tokens disagree with the output.
    """
    output = torch.as_tensor(result.output_ids).flatten().tolist()
    out: list[CommittedToken] = []
    for s, step in enumerate(result.steps):
        acc = step.acceptance
        kinds = ["drafted"] * acc.n_accepted + ["bonus"]
        for tok, kind in zip(acc.committed_tokens, kinds):
            if len(out) == len(output):
                return tuple(out)
            if output[len(out)] != tok:
                raise ValueError(
                    f"step {s} commits token {tok} at output position {len(out)}, but the output "
                    f"holds {output[len(out)]} there"
                )
            out.append(CommittedToken(len(out), int(tok), s, kind))
    return tuple(out)


def representative_step(result: "GenerationResult") -> int:
    """The step that shows the most in a picture: the longest accepted path, then the
    largest tree, then the earliest.

    Raises:
        ValueError: if the generation has no steps.
    """
    if not result.steps:
        raise ValueError("the generation has no speculative steps to show")
    return max(range(len(result.steps)),
               key=lambda s: (result.steps[s].acceptance.n_accepted, result.steps[s].tree.n_nodes, -s))


def _wrap(labels: Sequence[str], texts: Sequence[str], line_chars: int) -> list[tuple[int, int]]:
    """(line, column) of each label when written left to right, breaking lines after a
    newline token and before a label that would pass ``line_chars``."""
    pos, line, col = [], 0, 0
    for label, text in zip(labels, texts):
        if col and col + len(label) > line_chars:
            line, col = line + 1, 0
        pos.append((line, col))
        col += len(label)
        if "\n" in text:
            line, col = line + 1, 0
    return pos


def step_view_figure(result: "GenerationResult", *, tokenizer: Any = None,
                     highlight_step: int | None = None, line_chars: int = 72,
                     title: str | None = None) -> "go.Figure":
    """A whole generation at a glance.

    Top: the generated text, one box per token, the box colour naming the step that
    committed it (neighbouring steps always differ); accepted draft tokens are plain,
    bonus tokens (added by the target) bold on a darker outline. Bottom: per step, the
    accepted draft tokens (bar) plus the bonus token (hatched), i.e. tau, and the exact
    expected accepted draft tokens (diamond).

    The figure takes its container's width and ``line_chars`` characters fill one text
    line, so the 13 px token text fits its boxes from about ``8.2 * line_chars + 90`` px
    (680 px for the default 72); pass a smaller ``line_chars`` for narrower pages.

    Args:
        result: a :class:`~specviz.decode.GenerationResult`.
        tokenizer: decodes the tokens (``#id`` labels without one).
        highlight_step: step drawn with an emphasised outline in both panels (e.g. the
            explorer's current step).
        line_chars: characters per text line.
        title: figure title.
    """
    from plotly.subplots import make_subplots

    if line_chars < 8:
        raise ValueError(f"line_chars must be >= 8, got {line_chars}")
    n_steps = len(result.steps)
    if highlight_step is not None and not 0 <= highlight_step < n_steps:
        raise ValueError(f"highlight_step must be in [0, {n_steps}), got {highlight_step}")
    toks = committed_tokens(result)
    texts = [token_text(tokenizer, t.token) for t in toks]
    labels = [escape_token(t, max_chars=None) for t in texts]
    where = _wrap(labels, texts, line_chars)
    n_lines = (where[-1][0] + 1) if where else 1

    text_h = 26 * n_lines + 20
    bars_h = 220
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.12,
                        row_heights=[text_h / (text_h + bars_h), bars_h / (text_h + bars_h)],
                        subplot_titles=("generated text, coloured by step",
                                        "tokens committed per step (x axis: step)"))
    for trace in _token_traces(toks, labels, where):
        fig.add_trace(trace, row=1, col=1)
    # one layout update with all boxes: adding shapes one by one is slow in plotly
    fig.update_layout(shapes=_token_boxes(toks, labels, where, highlight_step))
    for trace in _step_traces(result, highlight_step):
        fig.add_trace(trace, row=2, col=1)

    if title is None:
        title = _generation_title(result, len(toks))
    fig.update_layout(
        title=figure_title(title), barmode="stack", autosize=True, height=int(text_h + bars_h + 160),
        margin=dict(l=60, r=30, t=90, b=130), plot_bgcolor="#FFFFFF", paper_bgcolor="#FFFFFF",
        legend=dict(orientation="h", yanchor="top", y=-0.12, xanchor="left", x=0.0),
    )
    fig.update_xaxes(visible=False, range=[-0.5, line_chars + 0.5], row=1, col=1)
    fig.update_yaxes(visible=False, range=[-n_lines + 0.4, 0.6], row=1, col=1)
    fig.update_xaxes(dtick=1 if n_steps <= 30 else None, row=2, col=1)
    fig.update_yaxes(title="tokens", gridcolor="#EEEEEE", rangemode="tozero", row=2, col=1)
    return fig


def _token_traces(toks: Sequence[CommittedToken], labels: Sequence[str],
                  where: Sequence[tuple[int, int]]) -> list:
    """The text panel's two text traces: accepted draft tokens (plain) and bonus tokens
    (bold), each label centred on its (line, column) in ``where``."""
    import plotly.graph_objects as go

    traces = []
    for kind, weight in (("drafted", "normal"), ("bonus", "bold")):
        members = [i for i, t in enumerate(toks) if t.kind == kind]
        traces.append(go.Scatter(
            x=[where[i][1] + len(labels[i]) / 2 for i in members], y=[-where[i][0] for i in members],
            mode="text", text=[plot_text(labels[i]) for i in members],
            textfont=dict(family=MONO_FONT, size=13, color="#000000", weight=weight),
            name="accepted draft token" if kind == "drafted" else "bonus token (target)",
            hovertext=[f"{plot_text(labels[i])}<br>output position {toks[i].position}<br>"
                       f"step {toks[i].step} · {kind}" for i in members],
            hoverinfo="text", legendgroup=kind,
        ))
    return traces


def _token_boxes(toks: Sequence[CommittedToken], labels: Sequence[str], where: Sequence[tuple[int, int]],
                 highlight_step: int | None) -> list[dict]:
    """One rectangle shape behind each token, coloured by its step: outlined for bonus
    tokens, stronger and thicker for the tokens of ``highlight_step``."""
    boxes = []
    for i, t in enumerate(toks):
        line, col = where[i]
        emph = t.step == highlight_step
        boxes.append(dict(type="rect", xref="x", yref="y", x0=col, x1=col + len(labels[i]),
                          y0=-line - 0.42, y1=-line + 0.42, layer="below",
                          fillcolor=_STEP_COLORS[t.step % len(_STEP_COLORS)], opacity=0.9 if emph else 0.45,
                          line=dict(color="#000000" if (t.kind == "bonus" or emph) else "rgba(0,0,0,0)",
                                    width=2 if emph else 1)))
    return boxes


def _step_traces(result: "GenerationResult", highlight_step: int | None) -> list:
    """The step panel's traces: accepted draft tokens per step (bars in the step
    colours), the bonus token stacked on them (hatched, one trace per colour) and the
    exact expected accepted tokens (diamonds); ``highlight_step``'s bars are outlined."""
    import plotly.graph_objects as go

    steps = list(range(len(result.steps)))
    colors = [_STEP_COLORS[s % len(_STEP_COLORS)] for s in steps]
    outline = [3 if s == highlight_step else 0.5 for s in steps]
    traces = [go.Bar(x=steps, y=[st.acceptance.n_accepted for st in result.steps],
                     marker=dict(color=colors, line=dict(color="#000000", width=outline)),
                     name="accepted draft tokens",
                     hovertemplate="step %{x}: %{y} accepted<extra></extra>")]
    # Hatched bars with one colour per bar make plotly.js warn about invalid colours, so
    # the bonus bars are one trace per step colour, shown in the legend once.
    for k, color in enumerate(_STEP_COLORS):
        mine = [s for s in steps if s % len(_STEP_COLORS) == k]
        if not mine:
            continue
        traces.append(go.Bar(x=mine, y=[1] * len(mine),
                             marker=dict(color=color, pattern=dict(shape="/", fgcolor="#000000"),
                                         line=dict(color="#000000", width=[outline[s] for s in mine])),
                             name="bonus token", legendgroup="bonus token", showlegend=k == 0,
                             hovertemplate="step %{x}: +1 bonus<extra></extra>"))
    traces.append(go.Scatter(x=steps, y=[st.expected_accepted for st in result.steps],
                             mode="markers", marker=dict(symbol="diamond", color="#000000", size=8),
                             name="expected accepted (exact)",
                             hovertemplate="step %{x}: expected %{y:.3f}<extra></extra>"))
    return traces


def composite_parts(name: str) -> tuple[str, ...]:
    """The part names inside the name of a drafter that gives each step to one part,
    ``choose(p1|p2|...)``, ``switch(p1|p2)`` or ``fallback(p1>p2>...)``, split where no
    bracket is open; ``()`` for any other name (a merged tree mixes its parts' nodes)."""
    head, bracket, body = name.partition("(")
    if not bracket or not body.endswith(")") or head not in ("choose", "switch", "fallback"):
        return ()
    parts, depth, start, body = [], 0, 0, body[:-1]
    for i, ch in enumerate(body):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and ch in "|>":
            parts.append(body[start:i])
            start = i + 1
    return tuple(parts + [body[start:]]) if len(parts) else ()


def drafting_parts(result: "GenerationResult") -> list[str] | None:
    """Per step, the name of the part of a composite drafter that drafted it (``"plain"``
    where the step drafted nothing), from the tree's ``source``; None for a drafter
    without parts or a generation whose trees carry no source."""
    parts = composite_parts(result.drafter)
    if not parts or not any(st.tree.source is not None for st in result.steps):
        return None
    out = []
    for st in result.steps:
        if st.tree.n_nodes == 1 or st.tree.source is None:
            out.append("plain")
        else:
            index = int(st.tree.source[1])
            out.append(parts[index] if 0 <= index < len(parts) else f"part {index}")
    return out


def drafter_strip_figure(result: "GenerationResult", *, highlight_step: int | None = None) -> "go.Figure":
    """A strip of a composite drafter's choices over a generation: one cell per step,
    coloured by the part that drafted it (grey: no draft, a plain step), with the tokens
    the step committed on hover.

    Raises:
        ValueError: the drafter has no parts (:func:`drafting_parts`).
    """
    import plotly.graph_objects as go

    parts = drafting_parts(result)
    if parts is None:
        raise ValueError(f"{result.drafter!r} is not a composite drafter whose steps record their part")
    names = list(dict.fromkeys(composite_parts(result.drafter))) + ["plain"]
    fig = go.Figure()
    for k, name in enumerate(names):
        mine = [s for s, p in enumerate(parts) if p == name]
        if not mine:
            continue
        color = "#BBBBBB" if name == "plain" else _STEP_COLORS[k % len(_STEP_COLORS)]
        committed = [result.steps[s].acceptance.n_accepted + 1 for s in mine]
        fig.add_trace(go.Bar(x=mine, y=[1] * len(mine), name=name, customdata=committed,
                             marker=dict(color=color, line=dict(color="#000000",
                                                                width=[3 if s == highlight_step else 0.5
                                                                       for s in mine])),
                             hovertemplate=f"step %{{x}}: {html.escape(name)}, %{{customdata}} tokens committed"
                                           "<extra></extra>"))
    counts = ", ".join(f"{name} {parts.count(name)}" for name in names if parts.count(name))
    fig.update_layout(title=figure_title(f"which part drafted each step ({counts})"), barmode="overlay",
                      bargap=0.05, height=200, autosize=True, margin=dict(l=60, r=30, t=60, b=60),
                      plot_bgcolor="#FFFFFF", paper_bgcolor="#FFFFFF",
                      legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0.0))
    fig.update_yaxes(visible=False, range=[0, 1])
    fig.update_xaxes(title="step", range=[-0.5, len(parts) - 0.5])
    return fig


def _generation_title(result: "GenerationResult", n_tokens: int) -> str:
    """The step view's default title: tokens, steps and the acceptance numbers of
    :func:`specviz.metrics.acceptance.summarize_steps`."""
    from specviz.metrics.acceptance import summarize_steps

    stats = summarize_steps(result.steps, new_tokens=n_tokens)
    return (f"{n_tokens} tokens in {len(result.steps)} steps · accepted per step "
            f"{stats.accepted_per_step:.3f} · tau {stats.tokens_per_step:.3f} · "
            f"acceptance rate {stats.acceptance_rate:.3f}")


def stats_html(result: "GenerationResult", step: int | None = None) -> str:
    """Small HTML tables of a generation's acceptance numbers (via :mod:`specviz.metrics`)
    and, when ``step`` is given, of that step alone."""
    from specviz.metrics.acceptance import summarize

    stats = summarize([result])[0]
    rows = [
        ("tokens · steps", f"{stats.new_tokens} in {stats.n_steps} steps (stop: {result.stop_reason})"),
        ("drafter · verifier", f"{html.escape(result.drafter)} · {html.escape(result.verifier)}"),
        ("accepted per step (tau - 1)", f"{stats.accepted_per_step:.3f}"),
        ("tau (tokens / target call)", f"{stats.tau:.3f}"),
        ("expected accepted per step (exact)", f"{stats.expected_accepted:.3f}"),
        ("acceptance rate (accepted / drafted)",
         f"{stats.acceptance_rate:.3f} ({stats.accepted_tokens} / {stats.drafted_tokens})"),
        ("wall time", f"{result.wall_s:.3f} s ({stats.tokens_per_second:.1f} tokens/s)"),
    ]
    tables = [("generation", rows)]
    if step is not None:
        if not 0 <= step < len(result.steps):
            raise ValueError(f"step must be in [0, {len(result.steps)}), got {step}")
        st = result.steps[step]
        tables.append((f"step {step}", [
            ("draft nodes · depth", f"{st.tree.budget} · {st.tree.depth}"),
            ("accepted (expected)",
             f"{st.acceptance.n_accepted} ({st.expected_accepted:.3f}) + 1 bonus"),
            ("draft · verify time", f"{1000 * st.draft_time_s:.1f} ms · {1000 * st.verify_time_s:.1f} ms"),
        ]))
    cell = "padding:1px 1em 1px 0;text-align:left"
    parts = []
    for caption, body in tables:
        trs = "".join(f"<tr><th style='{cell}'>{k}</th><td style='{cell}'>{v}</td></tr>" for k, v in body)
        parts.append(f"<table class='specviz-stats' style='margin:0'><caption style='text-align:left'>"
                     f"<b>{caption}</b></caption>{trs}</table>")
    return "<div style='display:flex;gap:3em;align-items:flex-start'>" + "".join(parts) + "</div>"


def figure_mimebundle(fig: "go.Figure", config: dict | None = None) -> dict:
    """``fig`` as a Jupyter display bundle with plotly's own mime type (drawn by the
    plotly JupyterLab extension; ``text/plain`` names the figure elsewhere)."""
    import json

    import plotly.io as pio

    spec = json.loads(pio.to_json(fig, validate=False))
    spec["config"] = {"displaylogo": False, "scrollZoom": True, **(config or {})}
    title = fig.layout.title.text or "figure"
    return {"application/vnd.plotly.v1+json": spec, "text/plain": f"<plotly figure: {title}>"}
